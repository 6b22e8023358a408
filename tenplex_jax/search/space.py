"""The candidate space: mesh factorizations and the hard pruning rules.

A candidate is ``(data, fsdp, tensor, pipeline)`` with product equal to the
device count, times a micro-batch count, times a remat choice. Mesh-level
rules run first on the (few hundred) factorizations, so micro-batches and remat
are only expanded for meshes that can work; the memory rule runs on the
expanded, vectorised candidates in :mod:`tenplex_jax.search.search`.

Rules, in the order they are checked (the first failing one is recorded):

* ``tensor_heads``: tensor degree divides every ``'heads'`` dimension;
* ``tensor_mlp``: tensor degree divides every ``'mlp'`` dimension;
* ``tensor_unused``: tensor > 1 on a model without heads/mlp axes;
* ``tensor_host``: tensor groups stay within one host (activation
  all-reduces every layer are too slow on the network); optional;
* ``pipeline_layers``: stages divide every ``'layers'`` dimension;
* ``pipeline_unused``: pipeline > 1 on a model without a ``'layers'`` axis;
* ``batch``: global batch divisible by ``data * fsdp`` (micro-batch counts
  are then enumerated among the divisors of the per-replica batch);
* ``memory``: estimated peak memory per device above
  ``(1 - memory_margin) * device memory``.

Other named dimensions (``'embed'`` under fsdp, ``'vocab'`` under tensor) that
do not divide are not rejected: that logical axis is replicated instead and the
full bytes are counted.
"""

from __future__ import annotations

import functools

from tenplex_jax.search.hardware import Topology
from tenplex_jax.search.model import ModelSpec

REJECTION_REASONS: tuple[str, ...] = (
    "tensor_heads", "tensor_mlp", "tensor_unused", "tensor_host",
    "pipeline_layers", "pipeline_unused", "batch", "memory")


@functools.lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
  """Sorted divisors of ``n``.

  Example:
    >>> divisors(12)
    (1, 2, 3, 4, 6, 12)
  """
  small = [i for i in range(1, int(n ** 0.5) + 1) if n % i == 0]
  return tuple(sorted(set(small + [n // i for i in small])))


@functools.lru_cache(maxsize=64)
def factorizations(n: int) -> tuple[tuple[int, int, int, int], ...]:
  """Every ordered ``(data, fsdp, tensor, pipeline)`` with product ``n``.

  Example:
    >>> len(factorizations(16)), factorizations(2)
    (35, ((1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1)))
  """
  out = []
  for d in divisors(n):
    for f in divisors(n // d):
      for t in divisors(n // (d * f)):
        out.append((d, f, t, n // (d * f * t)))
  return tuple(out)


def mesh_rejection(model: ModelSpec, topo: Topology, *, data: int, fsdp: int,
                   tensor: int, pipeline: int, global_batch: int,
                   tensor_within_host: bool = True) -> str | None:
  """The first mesh-level rule a factorization breaks, or ``None``.

  Example:
    >>> from tenplex_jax.search.model import model_preset
    >>> from tenplex_jax.search.hardware import Topology
    >>> m = model_preset("gpt3-2.7b")
    >>> topo = Topology.from_preset("a6000", devices=16, devices_per_host=4)
    >>> mesh_rejection(m, topo, data=1, fsdp=1, tensor=16, pipeline=1, global_batch=128)
    'tensor_host'
    >>> mesh_rejection(m, topo, data=2, fsdp=1, tensor=2, pipeline=4, global_batch=128) is None
    True
  """
  if tensor > 1:
    if not model.divisible("heads", tensor):
      return "tensor_heads"
    if not model.divisible("mlp", tensor):
      return "tensor_mlp"
    if not model.dims("heads") and not model.dims("mlp"):
      return "tensor_unused"
    if tensor_within_host:
      dph = topo.devices_per_host
      # Tensor groups are blocks of `tensor` consecutive devices; they stay in
      # a host iff the block size divides the host size.
      if tensor > dph or dph % tensor:
        return "tensor_host"
  if pipeline > 1:
    if not model.divisible("layers", pipeline):
      return "pipeline_layers"
    if not model.dims("layers"):
      return "pipeline_unused"
  if global_batch % (data * fsdp):
    return "batch"
  return None
