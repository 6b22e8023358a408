"""The ranked configuration search and its results.

:func:`search` enumerates every ``(data, fsdp, tensor, pipeline)``
factorization of the device count, every micro-batch count and remat choice,
prunes by the hard rules of :mod:`tenplex_jax.search.space`, prices the rest
with :mod:`tenplex_jax.search.cost` in one vectorised pass and returns them
best first, together with every rejected candidate and its reason.

:func:`best_mesh_for` is the entry point for re-meshing: abstract params and
devices in, a ``jax.sharding.Mesh`` and Flax logical axis rules out.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from tenplex_jax.errors import SearchError
from tenplex_jax.search import cost as cost_lib
from tenplex_jax.search.cost import (MESH_AXES, REMAT_CHOICES, Calibration,
                                     Workload)
from tenplex_jax.search.hardware import Hardware, Topology
from tenplex_jax.search.model import (LOGICAL_TO_MESH, ModelSpec,
                                      from_abstract_params, model_preset)
from tenplex_jax.search.space import (divisors, factorizations,
                                      mesh_rejection)

Rule = tuple[str, "str | tuple[str, ...] | None"]

_BREAKDOWN_KEYS = ("compute_s", "stage_imbalance_s", "tensor_comm_s", "pipeline_p2p_s", "bubble_s", "microbatch_overhead_s",
                   "data_comm_s", "fsdp_comm_s", "weights_bytes",
                   "activation_bytes", "logits_bytes", "fsdp_buffer_bytes",
                   "overhead_bytes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One priced layout: mesh degrees, schedule and its estimates.

  Attributes:
    data, fsdp, tensor, pipeline: mesh axis sizes (their product is the
      device count).
    microbatches: micro-batches per step (gradient accumulation / pipeline).
    remat: ``'none'``, ``'selective'`` or ``'full'``.
    step_time_s: estimated seconds per training step.
    memory_bytes: estimated peak bytes per device.
    breakdown: ``(term, value)`` pairs; time terms end in ``_s``, memory
      terms in ``_bytes``. The time terms sum to ``step_time_s``; the memory
      terms to ``memory_bytes``.
    rules: Flax logical axis rules, ``(logical name, mesh axis or None)``.

  Example:
    >>> c = evaluate("gpt3-2.7b", "a6000", devices=16, devices_per_host=4,
    ...              data=2, fsdp=1, tensor=2, pipeline=4, microbatches=16,
    ...              global_batch=128)
    >>> c.mesh_shape, dict(c.rules)["heads"], dict(c.rules)["layers"]
    ((2, 1, 4, 2), 'tensor', 'pipeline')
  """

  data: int
  fsdp: int
  tensor: int
  pipeline: int
  microbatches: int
  remat: str
  step_time_s: float
  memory_bytes: int
  breakdown: tuple[tuple[str, float], ...] = ()
  rules: tuple[Rule, ...] = ()

  @property
  def mesh_shape(self) -> tuple[int, int, int, int]:
    """Sizes in the order of :attr:`axis_names`."""
    return (self.data, self.fsdp, self.pipeline, self.tensor)

  @property
  def axis_names(self) -> tuple[str, ...]:
    """Mesh axis names, outermost first: ``('data', 'fsdp', 'pipeline', 'tensor')``."""
    return MESH_AXES

  @property
  def tpd(self) -> tuple[int, int, int]:
    """The paper's ``(T, P, D)`` triple (FSDP counted as data parallelism)."""
    return (self.tensor, self.pipeline, self.data * self.fsdp)

  def make_mesh(self, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """A mesh over ``devices`` (host-major order) with tensor innermost.

    Example:
      >>> import jax
      >>> c = Candidate(data=2, fsdp=1, tensor=2, pipeline=2, microbatches=1,
      ...               remat="none", step_time_s=1.0, memory_bytes=0)
      >>> dict(c.make_mesh(jax.devices()[:8]).shape)
      {'data': 2, 'fsdp': 1, 'pipeline': 2, 'tensor': 2}
    """
    devs = np.asarray(list(devices), dtype=object)
    n = int(np.prod(self.mesh_shape))
    if devs.size != n:
      raise SearchError(
          f"candidate {self.mesh_shape} needs {n} devices, got {devs.size}")
    return jax.sharding.Mesh(devs.reshape(self.mesh_shape), MESH_AXES)

  def to_json(self) -> dict[str, Any]:
    """A JSON-able dict: degrees, schedule, estimates, rules and breakdown.

    Example:
      >>> c = Candidate(data=1, fsdp=1, tensor=1, pipeline=1, microbatches=1,
      ...               remat="none", step_time_s=0.5, memory_bytes=10)
      >>> sorted(c.to_json())[:4]
      ['breakdown', 'data', 'fsdp', 'memory_bytes']
    """
    return {
        "data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
        "pipeline": self.pipeline, "microbatches": self.microbatches,
        "remat": self.remat, "step_time_s": self.step_time_s,
        "memory_bytes": self.memory_bytes,
        "rules": [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.rules],
        "breakdown": dict(self.breakdown),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rejection:
  """A candidate the hard rules removed, with the reason.

  ``microbatches`` and ``remat`` are ``None`` when the whole mesh was
  rejected (every micro-batch and remat choice); ``memory_bytes`` is set
  for ``'memory'`` rejections.
  """

  data: int
  fsdp: int
  tensor: int
  pipeline: int
  reason: str
  microbatches: int | None = None
  remat: str | None = None
  memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
  """The output of :func:`search`.

  Attributes:
    candidates: feasible candidates, best (lowest ``step_time_s``) first.
    rejected: every rejected candidate with its reason.
    model, topology, workload, calibration: the inputs.
    memory_limit_bytes: the feasibility threshold used.
    elapsed_s: wall time of the search.
  """

  candidates: tuple[Candidate, ...]
  rejected: tuple[Rejection, ...]
  model: ModelSpec
  topology: Topology
  workload: Workload
  calibration: Calibration
  memory_limit_bytes: int
  elapsed_s: float

  @property
  def best(self) -> Candidate:
    """The top candidate; raises :class:`SearchError` when none is feasible."""
    if not self.candidates:
      raise SearchError(
          f"no feasible layout for {self.model.name} on {self.topology.devices}"
          f" x {self.topology.hardware.name}: rejections {self.rejection_counts()}")
    return self.candidates[0]

  def rejection_counts(self) -> dict[str, int]:
    """Number of rejected candidates per reason (mesh-level rejections count
    every micro-batch and remat choice they cover as one)."""
    return dict(collections.Counter(r.reason for r in self.rejected))

  def best_per_mesh(self) -> list[Candidate]:
    """The best candidate of each distinct ``(data, fsdp, tensor, pipeline)``, ranked."""
    seen, out = set(), []
    for c in self.candidates:
      key = (c.data, c.fsdp, c.tensor, c.pipeline)
      if key not in seen:
        seen.add(key)
        out.append(c)
    return out


def _resolve(model: ModelSpec | str, hardware: Topology | Hardware | str,
             devices: int | None, devices_per_host: int | None,
             seq_len: int | None) -> tuple[ModelSpec, Topology]:
  if isinstance(model, str):
    model = model_preset(model)
  if isinstance(hardware, Topology):
    topo = hardware
    if devices is not None and devices != topo.devices:
      raise SearchError(f"devices={devices} contradicts the topology's {topo.devices}")
  else:
    if devices is None:
      raise SearchError("devices= is required unless a Topology is given")
    topo = Topology.from_preset(hardware, devices=devices,
                                devices_per_host=devices_per_host)
  if seq_len is not None and seq_len != model.seq_len:
    model = dataclasses.replace(model, seq_len=seq_len)
  return model, topo


@functools.lru_cache(maxsize=4096)
def _link(topo: Topology, calib: Calibration, size: int, stride: int) -> tuple[float, float]:
  link = cost_lib.axis_link(topo, calib, size=size, stride=stride)
  return link.bw, link.latency


def _rules(model: ModelSpec, sizes: Mapping[str, int]) -> tuple[Rule, ...]:
  rules: list[Rule] = [("batch", ("data", "fsdp"))]
  for name, _ in model.axis_dims:
    ax = LOGICAL_TO_MESH.get(name)
    if ax is not None and model.divisible(name, sizes[ax]):
      rules.append((name, ax))
    else:
      rules.append((name, None))
  return tuple(rules)


def _price(model: ModelSpec, topo: Topology, work: Workload, calib: Calibration,
           meshes: Sequence[tuple[int, int, int, int]],
           m: np.ndarray, remat: np.ndarray, mesh_idx: np.ndarray) -> dict[str, np.ndarray]:
  """Prices expanded candidates; ``mesh_idx`` points into ``meshes`` (d, f, t, p)."""
  mesh_arr = np.asarray(meshes, dtype=np.int64).reshape(-1, 4)
  params = np.empty(len(meshes))
  bw = {a: np.empty(len(meshes)) for a in MESH_AXES}
  lat = {a: np.empty(len(meshes)) for a in MESH_AXES}
  for i, (d, f, t, p) in enumerate(meshes):
    params[i] = cost_lib.sharded_param_count(model, data=d, fsdp=f, pipeline=p, tensor=t)
    strides = {"tensor": 1, "pipeline": t, "fsdp": t * p, "data": t * p * f}
    sizes = {"data": d, "fsdp": f, "pipeline": p, "tensor": t}
    for a in MESH_AXES:
      bw[a][i], lat[a][i] = _link(topo, calib, sizes[a], strides[a])
  sel = mesh_arr[mesh_idx]
  links = {a: {"bw": bw[a][mesh_idx], "latency": lat[a][mesh_idx]} for a in MESH_AXES}
  return cost_lib.estimate(
      model, topo, work, calib, data=sel[:, 0], fsdp=sel[:, 1], tensor=sel[:, 2],
      pipeline=sel[:, 3], microbatches=m, remat=remat,
      params_per_device=params[mesh_idx], links=links)


def _candidates(model, meshes, mesh_idx, m, remat, est, order) -> list[Candidate]:
  """Materialises candidates ``order`` (indices into the priced arrays)."""
  order = np.asarray(order, dtype=np.int64)
  cols = [est[k][order].tolist() for k in _BREAKDOWN_KEYS]
  step = est["step_time_s"][order].tolist()
  mem = est["memory_bytes"][order].tolist()
  ms, rs, idx = m[order].tolist(), remat[order].tolist(), mesh_idx[order].tolist()
  rules_cache: dict[int, tuple[Rule, ...]] = {}
  out = []
  for j in range(len(order)):
    k = idx[j]
    d, f, t, p = meshes[k]
    rules = rules_cache.get(k)
    if rules is None:
      rules = rules_cache[k] = _rules(model, {"data": d, "fsdp": f, "tensor": t, "pipeline": p})
    out.append(Candidate(
        data=d, fsdp=f, tensor=t, pipeline=p, microbatches=ms[j],
        remat=REMAT_CHOICES[rs[j]], step_time_s=step[j], memory_bytes=int(mem[j]),
        breakdown=tuple(zip(_BREAKDOWN_KEYS, (c[j] for c in cols))), rules=rules))
  return out


def search(model: ModelSpec | str, hardware: Topology | Hardware | str, *,
           devices: int | None = None, devices_per_host: int | None = None,
           global_batch: int, seq_len: int | None = None,
           param_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12,
           remat: Sequence[str] = REMAT_CHOICES,
           max_microbatches: int | None = None,
           tensor_within_host: bool = True,
           restrict: Mapping[str, Collection[int]] | None = None,
           calibration: Calibration = Calibration()) -> SearchResult:
  """Ranks every layout of ``model`` on a device set; no trial runs.

  Args:
    model: a :class:`ModelSpec` or a preset name (``'gpt3-2.7b'``).
    hardware: a :class:`Topology`, or a :class:`Hardware` / preset name plus
      ``devices`` and ``devices_per_host``.
    devices: device count (required unless ``hardware`` is a Topology).
    devices_per_host: devices per host (defaults to the preset's).
    global_batch: samples per step; fixed across layouts so training is
      unchanged by the choice.
    seq_len: tokens per sample (defaults to the model's).
    param_bytes, grad_bytes, optimizer_bytes: bytes per parameter of the
      weights, gradients and optimizer state (Adam in mixed precision:
      2 + 2 + 12; see :class:`Workload`).
    remat: remat choices to consider (subset of ``REMAT_CHOICES``).
    max_microbatches: cap on micro-batches per step (default: none).
    tensor_within_host: reject tensor groups that span hosts (default).
    restrict: allowed sizes per mesh axis, e.g. ``{'fsdp': (1,)}`` for the
      paper's (T, P, D) space without FSDP.
    calibration: cost model constants.

  Returns:
    A :class:`SearchResult`: ranked feasible candidates and rejections.

  Example:
    >>> res = search("gpt3-2.7b", "a6000", devices=16, devices_per_host=4,
    ...              global_batch=128, seq_len=1024, restrict={"fsdp": (1,)})
    >>> res.best.tpd
    (2, 4, 2)
    >>> all(c.memory_bytes <= res.memory_limit_bytes for c in res.candidates)
    True
  """
  start = time.perf_counter()
  cost_lib.check_remat(remat)
  model, topo = _resolve(model, hardware, devices, devices_per_host, seq_len)
  work = Workload(global_batch=global_batch, seq_len=model.seq_len,
                  param_bytes=param_bytes, grad_bytes=grad_bytes,
                  optimizer_bytes=optimizer_bytes)
  restrict = dict(restrict or {})
  unknown = set(restrict) - set(MESH_AXES)
  if unknown:
    raise SearchError(f"restrict names unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
  remat_idx = np.asarray([REMAT_CHOICES.index(r) for r in remat], dtype=np.int64)

  rejected: list[Rejection] = []
  meshes: list[tuple[int, int, int, int]] = []
  m_parts, idx_parts = [], []
  for d, f, t, p in factorizations(topo.devices):
    sizes = {"data": d, "fsdp": f, "tensor": t, "pipeline": p}
    if any(sizes[a] not in allowed for a, allowed in restrict.items()):
      continue
    reason = mesh_rejection(model, topo, data=d, fsdp=f, tensor=t, pipeline=p,
                            global_batch=global_batch,
                            tensor_within_host=tensor_within_host)
    if reason is not None:
      rejected.append(Rejection(data=d, fsdp=f, tensor=t, pipeline=p, reason=reason))
      continue
    ms = divisors(global_batch // (d * f))
    if max_microbatches is not None:
      ms = tuple(x for x in ms if x <= max_microbatches)
    m_parts.append(np.asarray(ms, dtype=np.int64))
    idx_parts.append(np.full(len(ms), len(meshes), dtype=np.int64))
    meshes.append((d, f, t, p))

  limit = int((1.0 - calibration.memory_margin) * topo.memory_bytes)
  candidates: list[Candidate] = []
  if meshes:
    m_all = np.repeat(np.concatenate(m_parts), len(remat_idx))
    idx_all = np.repeat(np.concatenate(idx_parts), len(remat_idx))
    r_all = np.tile(remat_idx, len(m_all) // len(remat_idx))
    est = _price(model, topo, work, calibration, meshes, m_all, r_all, idx_all)
    mem = est["memory_bytes"]
    fits = mem <= limit
    over = np.flatnonzero(~fits)
    for k, mb, ri, mb_bytes in zip(idx_all[over].tolist(), m_all[over].tolist(),
                                   r_all[over].tolist(), mem[over].tolist()):
      d, f, t, p = meshes[k]
      rejected.append(Rejection(data=d, fsdp=f, tensor=t, pipeline=p, reason="memory",
                                microbatches=mb, remat=REMAT_CHOICES[ri],
                                memory_bytes=int(mb_bytes)))
    ok = np.flatnonzero(fits)
    order = ok[np.lexsort((mem[ok], est["step_time_s"][ok]))]
    candidates = _candidates(model, meshes, idx_all, m_all, r_all, est, order)
  return SearchResult(
      candidates=tuple(candidates), rejected=tuple(rejected), model=model,
      topology=topo, workload=work, calibration=calibration,
      memory_limit_bytes=limit, elapsed_s=time.perf_counter() - start)


def evaluate(model: ModelSpec | str, hardware: Topology | Hardware | str, *,
             data: int, fsdp: int, tensor: int, pipeline: int,
             microbatches: int, remat: str = "none",
             devices: int | None = None, devices_per_host: int | None = None,
             global_batch: int, seq_len: int | None = None,
             param_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12,
             calibration: Calibration = Calibration()) -> Candidate:
  """Prices one layout without pruning (for what-if tables and checks).

  ``devices`` defaults to ``data * fsdp * tensor * pipeline``. Raises
  :class:`SearchError` when the batch does not split into the micro-batches.

  Example:
    >>> c = evaluate("gpt3-2.7b", "a6000", devices_per_host=4, data=1, fsdp=1,
    ...              tensor=16, pipeline=1, microbatches=8, remat="full",
    ...              global_batch=128)
    >>> c.step_time_s > 10 * evaluate(
    ...     "gpt3-2.7b", "a6000", devices_per_host=4, data=2, fsdp=1, tensor=2,
    ...     pipeline=4, microbatches=16, global_batch=128).step_time_s
    True
  """
  n = data * fsdp * tensor * pipeline
  model, topo = _resolve(model, hardware, devices or n, devices_per_host, seq_len)
  if topo.devices != n:
    raise SearchError(f"mesh {(data, fsdp, tensor, pipeline)} has {n} devices,"
                      f" the topology {topo.devices}")
  if global_batch % (data * fsdp * microbatches):
    raise SearchError(
        f"global batch {global_batch} does not split over data*fsdp*microbatches ="
        f" {data}*{fsdp}*{microbatches}")
  cost_lib.check_remat((remat,))
  work = Workload(global_batch=global_batch, seq_len=model.seq_len,
                  param_bytes=param_bytes, grad_bytes=grad_bytes,
                  optimizer_bytes=optimizer_bytes)
  mesh = (data, fsdp, tensor, pipeline)
  est = _price(model, topo, work, calibration, [mesh], np.asarray([microbatches]),
               np.asarray([REMAT_CHOICES.index(remat)]), np.asarray([0]))
  return _candidates(model, [mesh], np.asarray([0]), np.asarray([microbatches]),
                     np.asarray([REMAT_CHOICES.index(remat)]), est, [0])[0]


class BestMesh(NamedTuple):
  """What :func:`best_mesh_for` returns."""

  mesh: jax.sharding.Mesh
  rules: tuple[Rule, ...]
  candidate: Candidate


def best_mesh_for(abstract_params: Any, devices: Sequence[jax.Device], *,
                  global_batch: int, seq_len: int = 1,
                  hardware: str | Hardware = "cpu",
                  devices_per_host: int | None = None,
                  **search_kwargs: Any) -> BestMesh:
  """The best mesh and Flax logical axis rules for params on ``devices``.

  Used by re-meshing when it is given devices but no mesh. ``abstract_params``
  is ``jax.eval_shape(model.init, ...)`` output with ``nn.LogicallyPartitioned``
  leaves (or a :class:`ModelSpec`). For simulated CPU devices use the default
  ``hardware='cpu'``; ``devices_per_host`` defaults to the number of distinct
  ``process_index`` values among ``devices``.

  Args:
    abstract_params: boxed abstract params, or a ModelSpec.
    devices: the devices of the new mesh, host-major.
    global_batch: samples per step.
    seq_len: tokens per sample.
    hardware: a hardware preset name or :class:`Hardware`.
    devices_per_host: overrides the count derived from process indices.
    **search_kwargs: passed to :func:`search` (``remat``, ``restrict``, ...).

  Returns:
    ``BestMesh(mesh, rules, candidate)``; use ``rules`` with
    ``nn.logical_to_mesh_sharding``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class Mlp(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    ...     return nn.Dense(64, kernel_init=init)(x)
    >>> abstract = jax.eval_shape(Mlp().init, jax.random.key(0), jnp.ones((1, 32)))
    >>> best = best_mesh_for(abstract, jax.devices()[:4], global_batch=8)
    >>> int(np.prod(list(best.mesh.shape.values())))
    4
  """
  devices = list(devices)
  if not devices:
    raise SearchError("best_mesh_for needs at least one device")
  if isinstance(abstract_params, ModelSpec):
    model = dataclasses.replace(abstract_params, seq_len=seq_len)
  else:
    model = from_abstract_params(abstract_params, seq_len=seq_len)
  if devices_per_host is None:
    per_proc = collections.Counter(getattr(d, "process_index", 0) for d in devices)
    devices_per_host = max(per_proc.values())
  res = search(model, hardware, devices=len(devices),
               devices_per_host=devices_per_host, global_batch=global_batch,
               **search_kwargs)
  best = res.best
  return BestMesh(best.make_mesh(devices), best.rules, best)
