"""Orbax checkpoints: inspect, restore onto any mesh, convert, export.

Reads any checkpoint current orbax-checkpoint writes (``StandardCheckpointer``,
``PyTreeCheckpointer``, ``CheckpointManager`` step/item directories, OCDBT or
not, zarr v3 or v2) through tensorstore, read-only, as a
:class:`tenplex_jax.sources.Source` of boxes:

* :func:`inspect`: the tree, shapes, dtypes, chunks, bytes, saved layout;
* :func:`restore`: onto any target layout; each process reads only the
  boxes its devices hold, into host buffers of the new shards' size;
* :func:`convert`: to another layout, offline, box by box under a memory
  limit, writing a checkpoint stock Orbax restores; optionally renaming,
  stacking (scanned layers) or unstacking leaves;
* :func:`save`: a live state as a standard Orbax checkpoint.

This module is named like the ``orbax`` package; inside it, the real one is
always imported absolutely (``import orbax.checkpoint``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from tenplex_jax.orbax._read import (COPY_THREADS, Location, OrbaxSource,
                                     inspect, locate)
from tenplex_jax.assembly import AssembleReport, assemble, match_target

# The offline converter (and what it imports: rich, the upload code) loads
# on first use: a restore in a fresh process does not pay for it.
_CONVERT_NAMES = ("MappedSource", "convert", "scan_mapping",
                  "unscan_mapping")


def __getattr__(name: str) -> Any:
  if name in _CONVERT_NAMES:
    from tenplex_jax.orbax import _convert
    return getattr(_convert, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["Location", "MappedSource", "OrbaxSource", "convert", "inspect",
           "locate", "restore", "restore_with_report", "save",
           "scan_mapping", "unscan_mapping"]


def restore_with_report(path: str, target: Any, *, step: int | None = None,
                        item: str | None = None,
                        inflight_bytes: int | None = None,
                        mesh: Any = None) -> tuple[Any, AssembleReport]:
  """Like :func:`restore`, and also returns the
  :class:`tenplex_jax.assembly.AssembleReport` (bytes read, seconds).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jnp.arange(16.0).reshape(8, 2)}, d, step=1)
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("tensor",))
    >>> s = NamedSharding(mesh, P("tensor"))
    >>> out, rep = restore_with_report(
    ...     d, {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=s)})
    >>> out["w"][6].tolist(), rep.new_shard_bytes, rep.read_bytes
    ([12.0, 13.0], 64, 64)
  """
  threads = _copy_threads(inflight_bytes if inflight_bytes is not None
                          else _inflight(_target_bytes(target)))
  with OrbaxSource(path, step=step, item=item, copy_threads=threads) as src:
    needs = None
    if src.remote and src.ocdbt:
      needs = _needs(src, target, mesh)
      src.stage(needs)
    if inflight_bytes is None:
      held = src.tensors()
      if needs is None:
        needs = _needs(src, target, mesh)
      inflight_bytes = _inflight(sum(held[k].nbytes for k in needs))
    # The bound is strict (one read may pass it, not two): a chunk read
    # holds its compressed bytes and a decoded copy besides the restored
    # shards, so two 4 MiB chunks of an 84 MiB state added 0.18x of it
    # (peak RSS rise 1.24-1.34x -> 1.15-1.20x of the bytes held, at the
    # same CPU time). Chunks up to half the bound still decode two at once.
    return assemble(src, target, inflight_bytes=inflight_bytes, mesh=mesh,
                    min_reads=1)


_INFLIGHT_MIN, _INFLIGHT_MAX = 4 << 20, 32 << 20


def _inflight(state_bytes: int) -> int:
  """The default bound on checkpoint bytes decoded at once: 1/16 of the
  bytes of the tensors restored, between 4 and 32 MiB (a small state's
  temporary chunk buffers are otherwise a large share of its peak memory:
  at 88 MB, 32 MiB in flight raised the peak by 14-25 MiB more than 8 MiB
  did, at the same speed)."""
  return int(min(_INFLIGHT_MAX, max(_INFLIGHT_MIN, state_bytes // 16)))


_COPY_THREAD_BYTES = 4 << 20


def _copy_threads(inflight_bytes: int) -> int:
  """tensorstore's decode threads for a restore that reads at most
  ``inflight_bytes`` at once: one per whole 4 MiB of them, at least one, at
  most ``COPY_THREADS`` (so 8 from 32 MiB in flight, the bound of every
  state of 512 MiB or more; 1 below 8 MiB, states under 128 MiB).

  A decode thread's freed chunk buffers stay in its own malloc arena, so
  every thread that ever decoded holds about a chunk's worth of memory when
  the restore ends; with the reads in flight bounded, more threads than
  reads in flight add that memory and no speed. An 88 MB restore (2-4 MiB
  chunks, 5.3 MiB in flight) peaked at 1.19-1.41x the bytes it holds with
  8 threads, 1.22-1.33x with 3, 1.15-1.24x with 2, 1.10-1.15x with 1, at
  the same CPU time (0.13-0.15 s); a 189 MB one (11.3 MiB in flight) at
  1.14-1.20x with 3, 1.12-1.16x with 2, 1.06-1.10x with 1 (2-core VM,
  one process per setting and layout, load ~10). With one decode thread the
  file reads (their own thread) still overlap the decoding.
  """
  return int(min(COPY_THREADS, max(1, inflight_bytes // _COPY_THREAD_BYTES)))


def _target_bytes(target: Any) -> int:
  """The bytes of ``target``'s array leaves (those with a shape and a numpy
  dtype); an estimate made before the checkpoint is opened."""
  n = 0
  for leaf in jax.tree_util.tree_leaves(target):
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
      continue
    try:
      n += math.prod(shape) * np.dtype(dtype).itemsize
    except TypeError:  # e.g. a PRNG key dtype: its data is small
      continue
  return n


def _needs(src: OrbaxSource, target: Any, mesh: Any) -> dict:
  """Per saved tensor, the boxes this process's devices hold in ``target``
  (the whole tensor for a plain leaf that takes its saved value)."""
  held = src.tensors()
  _, _, arrays, plain = match_target(target, held, mesh=mesh)
  out: dict = {}
  for saved, leaf in arrays.values():
    if saved is None:
      continue
    shape = held[saved].shape
    for idx in leaf.sharding.addressable_devices_indices_map(
        tuple(shape)).values():
      out.setdefault(saved, []).append(tuple(
          (s.start or 0, n if s.stop is None else s.stop)
          for s, n in zip(idx, shape)))
  for saved in plain.values():
    if saved is not None:
      out.setdefault(saved, []).append(tuple((0, n)
                                             for n in held[saved].shape))
  return out


def restore(path: str, target: Any, *, step: int | None = None,
            item: str | None = None, inflight_bytes: int | None = None,
            mesh: Any = None) -> Any:
  """Restores an Orbax checkpoint onto the target layout; call in every
  process.

  Each process reads only the boxes its own devices hold (a box several of
  its devices hold is read once), straight from the checkpoint's chunks into
  one aligned host buffer per distinct new box, so host memory stays near
  the bytes of the process's new shards; no array is ever materialised
  whole. No collective is needed: processes read independently.

  Args:
    path: a ``CheckpointManager`` directory (its newest step, or ``step``),
      a step directory or an item directory (see :func:`locate`).
    target: a pytree of ``jax.ShapeDtypeStruct``s with shardings (live
      ``jax.Array``s and Flax boxes such as ``nn.LogicallyPartitioned`` or
      ``nnx`` variables holding them work too; PRNG key arrays are key
      dtypes). A dtype other than the saved one is a cast, bitwise what
      Orbax's own restore gives (a key is never cast); a shape other than
      the saved one is an error naming the leaf. Shardings on an
      ``AbstractMesh`` (what ``nnx.eval_shape`` gives under
      ``jax.set_mesh``) are placed on ``mesh``, else on the mesh in
      context. Any other leaf takes the saved value at its path (a
      Python number stays one; a string leaf takes a saved string), or
      passes through when nothing is saved there.
    step: see ``path``.
    item: the item of a step (default ``default`` or the only one).
    inflight_bytes: bound on the checkpoint bytes being decoded at once
      (default: 1/16 of the bytes of the saved tensors restored, between 4
      and 32 MiB).
    mesh: the concrete ``jax.sharding.Mesh`` for target shardings on an
      ``AbstractMesh`` (default: the mesh in context).

  Returns:
    The tree, with arrays on the target shardings, bitwise equal to what
    Orbax restores.

  Raises:
    UsageError: ``path`` is not an Orbax checkpoint.
    TreeError: the target does not match (every mismatching leaf named).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, numpy as np
    >>> import orbax.checkpoint as ocp
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> d = tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(d) as m:
    ...   _ = m.save(1, args=ocp.args.StandardSave(
    ...       {"w": jnp.arange(8.0).reshape(4, 2), "step": 1}))
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    >>> s = NamedSharding(mesh, P("tensor"))
    >>> out = restore(d, {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32,
    ...                                             sharding=s), "step": 0})
    >>> out["w"].sharding == s, out["w"][2].tolist(), out["step"]
    (True, [4.0, 5.0], 1)
  """
  return restore_with_report(path, target, step=step, item=item,
                             inflight_bytes=inflight_bytes, mesh=mesh)[0]


def save(tree: Any, path: str, *, step: int | None = None) -> str:
  """Writes a live state as a standard Orbax checkpoint (the way to leave
  tenplex_jax at any time); call in every process.

  With ``step``, ``path`` is a ``CheckpointManager`` directory and the
  state goes to ``path/<step>/default`` (``StandardSave``); without it,
  ``path`` is the item directory (``StandardCheckpointer``).

  Returns:
    The item directory written.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> p = save({"w": jnp.ones(3)}, d, step=4)
    >>> inspect(d)["step"]
    4
  """
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  if step is None:
    ckptr = ocp.StandardCheckpointer()
    try:
      ckptr.save(path, tree)
      ckptr.wait_until_finished()
    finally:
      ckptr.close()
    return path
  with ocp.CheckpointManager(path) as mgr:
    mgr.save(int(step), args=ocp.args.StandardSave(tree), force=True)
    mgr.wait_until_finished()
  return os.path.join(path, str(int(step)), "default")
