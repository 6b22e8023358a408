"""Job arrays: sibling training jobs packed on one mesh and trained as one program.

ArrayPipe (shared/seeds/004) packs sibling jobs (same model, different
hyper-parameters) onto shared devices. In JAX a job array is a train state
whose every array leaf has a leading ``job`` axis of size K, trained by the
user's single-job step mapped over that axis; the ``job`` axis is a mesh
axis like ``data`` or ``tensor``, so tenplex_jax resizes and re-packs the
array the way it re-meshes a single job.

Building and stepping:

* :func:`stack` / :func:`unstack`: K states <-> one stacked state;
* :func:`vmap_step`: the user's ``step_fn(state, batch, hparams)`` for all
  jobs at once (``jax.vmap`` or ``lax.map`` over the job axis);
* :func:`hparams`: per-job hyper-parameters as ``(K,)`` arrays;
* :func:`stacked_shardings` / :func:`job_mesh`: the ``job`` mesh axis in
  front of each job's own ``data`` / ``fsdp`` / ``tensor`` axes;
* :func:`job_iterators` / :func:`next_batches`: one
  :class:`~tenplex_jax.data.ElasticIterator` per job, its own seed.

Membership and devices (each returns new arrays; the inputs are never
written):

* :func:`remove` drops jobs (early-stopped trials), :func:`add` appends new
  ones; both go through :func:`repack`, which keeps every surviving job's
  rows on the devices that hold them when the new mesh allows it: it picks
  the device order of the new mesh (an assignment of job groups to device
  groups that maximises the rows that stay), reuses a device's buffer when
  its shard is unchanged, and moves only the rows whose device changes;
* :func:`resize` moves the whole array onto other devices with the same
  jobs: a same-shape reshard done by :func:`tenplex_jax.remesh` (the
  planner's minimum movement).

Placement: :func:`placement_search` splits the devices between the ``job``
axis and each job's own parallelism with the cost model of
:mod:`tenplex_jax.search` and reports every alternative.

Numerics (docs/jobarray.md): ``vmap_step(..., method="map")`` runs each job's
unbatched step, and an array on one device then matches the solo run bit for
bit; ``method="vmap"`` batches the jobs' operations, which XLA fuses and
vectorises differently, so gradients differ in the last bits (about 1e-9
relative) and an Adam trajectory drifts within the stated tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import determinism
from tenplex_jax.data import ElasticIterator
from tenplex_jax._keys import is_key, key_data_sharding, wrap_keys
from tenplex_jax.errors import LayoutError, SearchError, UsageError
from tenplex_jax.layout import key_path_name
from tenplex_jax.remesh import remesh
from tenplex_jax.search import hardware_preset, search
from tenplex_jax.search.hardware import Hardware

__all__ = [
    "JOB_AXIS", "Placement", "PlacementReport", "RepackReport", "add", "hparams",
    "jit", "job_iterators", "job_mesh", "next_batches", "num_jobs",
    "placement_search",
    "remove", "repack", "resize", "stack", "stacked_shardings", "unstack",
    "vmap_step",
]

JOB_AXIS = "job"


# --------------------------------------------------------------------------
# leaves
# --------------------------------------------------------------------------

def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _host(x: Any) -> np.ndarray:
  """Host value of an array leaf (key arrays as their key data)."""
  if is_key(x):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _names(tree: Any) -> list[str]:
  return [key_path_name(p) for p, _ in
          jax.tree_util.tree_flatten_with_path(tree)[0]]


def _same(a: Any, b: Any) -> bool:
  try:
    eq = a == b
    return bool(eq) if not isinstance(eq, np.ndarray) else bool(eq.all())
  except Exception:  # noqa: BLE001 - objects without a usable ==
    return a is b


def num_jobs(state: Any) -> int:
  """The size K of the leading job axis of a stacked state.

  Raises:
    LayoutError: the state has no array leaf, or array leaves disagree on
      their leading size (each leaf named with its size).

  Example:
    >>> import numpy as np
    >>> num_jobs({"w": np.zeros((3, 2)), "b": np.zeros(3)})
    3
  """
  sizes = {}
  for (path, x) in jax.tree_util.tree_flatten_with_path(state)[0]:
    if _is_array(x):
      if np.ndim(x) == 0:
        raise LayoutError(f"{key_path_name(path)}: a 0-d array has no job axis")
      sizes[key_path_name(path)] = int(np.shape(x)[0])
  if not sizes:
    raise LayoutError("the state has no array leaf, so no job axis")
  if len(set(sizes.values())) > 1:
    raise LayoutError("array leaves disagree on the job axis size: " + ", ".join(
        f"{k}={v}" for k, v in sizes.items()))
  return next(iter(sizes.values()))


# --------------------------------------------------------------------------
# stack / unstack
# --------------------------------------------------------------------------

def _target_sharding(shardings: Any, i: int, flat_targets: list | None):
  if flat_targets is not None:
    return flat_targets[i]
  return shardings


def stack(states: Sequence[Any], *, shardings: Any = None) -> Any:
  """Stacks K sibling states into one state with a leading job axis.

  Every array leaf (``jax.Array``, numpy array or scalar, typed PRNG key
  arrays included) becomes one array of shape ``(K, *shape)``; values are
  copied bit for bit. Other leaves (Python numbers, strings) must be equal in
  every job and are kept once.

  Args:
    states: K >= 1 pytrees of the same structure, shapes and dtypes.
    shardings: where the stacked arrays go: ``None`` (the default device),
      one ``jax.sharding.Sharding`` for every array leaf (e.g.
      ``NamedSharding(mesh, P('job'))``), or a pytree of shardings with the
      state's structure (``None`` at non-array leaves), such as
      :func:`stacked_shardings` returns.

  Returns:
    The stacked state.

  Raises:
    LayoutError: the structures, shapes or dtypes differ, or a non-array
      leaf differs between jobs; every problem is listed with the leaf's
      path and the jobs.

  Example:
    >>> import numpy as np
    >>> s = stack([{"w": np.ones(2), "name": "lm"}, {"w": np.zeros(2), "name": "lm"}])
    >>> s["w"].shape, s["name"]
    ((2, 2), 'lm')
  """
  states = list(states)
  if not states:
    raise LayoutError("stack needs at least one state")
  flat0, treedef = jax.tree_util.tree_flatten_with_path(states[0])
  flats = [flat0]
  problems = []
  for j, s in enumerate(states[1:], start=1):
    flat, td = jax.tree_util.tree_flatten_with_path(s)
    if td != treedef:
      raise LayoutError(f"job {j} has another tree structure than job 0:\n"
                        f"  job 0: {treedef}\n  job {j}: {td}")
    flats.append(flat)
  flat_targets = None
  if shardings is not None and not isinstance(shardings, jax.sharding.Sharding):
    flat_targets = treedef.flatten_up_to(shardings)
  leaves = []
  for i, (path, x0) in enumerate(flat0):
    name = key_path_name(path)
    xs = [f[i][1] for f in flats]
    if not _is_array(x0):
      diff = [j for j, x in enumerate(xs) if _is_array(x) or not _same(x, x0)]
      if diff:
        problems.append(f"{name}: non-array leaf differs from job 0 in jobs {diff}"
                        f" (job 0: {x0!r}, job {diff[0]}: {xs[diff[0]]!r})")
      leaves.append(x0)
      continue
    bad = [j for j, x in enumerate(xs)
           if not _is_array(x) or np.shape(x) != np.shape(x0)
           or is_key(x) != is_key(x0)
           or (not is_key(x) and np.asarray(x).dtype != np.asarray(x0).dtype)
           or (is_key(x) and jax.random.key_impl(x) != jax.random.key_impl(x0))]
    if bad:
      j = bad[0]
      problems.append(
          f"{name}: jobs {bad} differ from job 0 in shape, dtype or type"
          f" (job 0: {getattr(x0, 'dtype', type(x0))}{list(np.shape(x0))},"
          f" job {j}: {getattr(xs[j], 'dtype', type(xs[j]))}{list(np.shape(xs[j]))})")
      leaves.append(None)
      continue
    data = np.stack([_host(x) for x in xs])
    target = _target_sharding(shardings, i, flat_targets)
    if is_key(x0):
      arr = (jnp.asarray(data) if target is None else jax.device_put(
          data, key_data_sharding(target, data.ndim - 1, 1)))
      leaves.append(wrap_keys(arr, jax.random.key_impl(x0), target))
    else:
      leaves.append(jax.device_put(data, target) if target is not None
                    else jnp.asarray(data))
  if problems:
    raise LayoutError(f"cannot stack {len(states)} jobs:\n  " + "\n  ".join(problems))
  return treedef.unflatten(leaves)


def unstack(state: Any) -> list:
  """Splits a stacked state into its K per-job states.

  Array leaf ``x`` of job ``k`` is ``x[k]`` (bit for bit, the dtype kept;
  key arrays stay key arrays), a ``jax.Array`` on the default device;
  non-array leaves are shared.

  Example:
    >>> import numpy as np
    >>> jobs = unstack(stack([{"w": np.ones(2)}, {"w": np.zeros(2)}]))
    >>> [j["w"].tolist() for j in jobs]
    [[1.0, 1.0], [0.0, 0.0]]
  """
  k = num_jobs(state)
  flat, treedef = jax.tree_util.tree_flatten(state)
  per_leaf = []
  for x in flat:
    if not _is_array(x):
      per_leaf.append([x] * k)
      continue
    data = _host(x)
    rows = [jnp.asarray(data[j]) for j in range(k)]
    if is_key(x):
      impl = jax.random.key_impl(x)
      rows = [jax.random.wrap_key_data(r, impl=impl) for r in rows]
    per_leaf.append(rows)
  return [treedef.unflatten([col[j] for col in per_leaf]) for j in range(k)]


# --------------------------------------------------------------------------
# stepping
# --------------------------------------------------------------------------

def jit(fun: Callable, **kwargs) -> Callable:
  """``jax.jit`` for a job-array step, so each job's bits match its solo run.

  A job array spread over several devices is an SPMD program, and XLA runs
  its ``spmd-cleanup`` pass on it, which a one-device solo step never gets;
  afterwards XLA simplifies some divisions (softmax's normalisation among
  them) differently, and an attention LM's trials drift from their solo runs
  in the last bits (measured up to 7e-5 after 6 Adam steps). Compiled with
  that pass off (:data:`tenplex_jax.determinism.COMPILER_OPTIONS`), every
  trial of ``examples/jobarray`` is bitwise equal to its solo run, across
  removals, additions and a resize.

  Args:
    fun: the function to compile, usually ``vmap_step(step, method="map",
      mesh=mesh)``.
    **kwargs: passed to ``jax.jit``; ``compiler_options`` are merged.

  Returns:
    The jitted function.

  Example:
    >>> import jax.numpy as jnp
    >>> f = jit(vmap_step(lambda s, b, h: (s - h * b, s), method="map"))
    >>> f(jnp.zeros(2), jnp.ones(2), jnp.array([1., 2.]))[0].tolist()
    [-1.0, -2.0]
  """
  return determinism.jit(fun, **kwargs)


def vmap_step(step_fn: Callable, *, method: str = "vmap",
              mesh: Mesh | None = None, job_axis: str = JOB_AXIS) -> Callable:
  """Maps a single-job train step over the job axis.

  ``step_fn(state, batch, hparams) -> (state, metrics)`` is the user's step
  for one job. The returned ``f(states, batches, hparams)`` takes every
  input with a leading job axis and returns ``(states, metrics)`` with one;
  it is a pure function, to be wrapped in ``jax.jit`` (with the job axis
  sharded over a mesh axis, jit partitions the jobs over that axis), or in
  :func:`jit` for trials bitwise equal to their solo runs.

  Args:
    step_fn: the single-job step.
    method: ``"vmap"`` (``jax.vmap``: the jobs' operations are batched) or
      ``"map"`` (``jax.lax.map``: each job runs the unbatched step, one after
      another; on one device this reproduces the solo run bit for bit).
    mesh: with ``method="map"`` and the job axis sharded, the mesh: the map
      then runs inside ``jax.shard_map`` manual over ``job_axis`` only (each
      device group maps over its own jobs; the other axes stay automatic),
      so no device gathers another group's jobs.
    job_axis: the job mesh axis name.

  Returns:
    The job-array step.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(state, batch, hp):
    ...   w = state["w"] - hp["lr"] * batch.mean()
    ...   return {"w": w}, {"w": w}
    >>> f = jax.jit(vmap_step(step))
    >>> new, m = f({"w": jnp.zeros(3)}, jnp.ones((3, 4)), {"lr": jnp.array([1., 2., 3.])})
    >>> new["w"].tolist()
    [-1.0, -2.0, -3.0]
  """
  if method == "vmap":
    return jax.vmap(step_fn)
  if method != "map":
    raise UsageError(f"vmap_step: method must be 'vmap' or 'map', got {method!r}")

  def mapped(states, batches, hps):
    return jax.lax.map(lambda a: step_fn(*a), (states, batches, hps))

  if mesh is None:
    return mapped
  if job_axis not in mesh.axis_names:
    raise UsageError(f"vmap_step: mesh axes {mesh.axis_names} have no {job_axis!r}")
  spec = P(job_axis)
  return jax.shard_map(mapped, mesh=mesh, in_specs=spec, out_specs=spec,
                       axis_names={job_axis}, check_vma=False)


def hparams(**per_job: Sequence[float]) -> dict[str, jax.Array]:
  """Per-job hyper-parameters as float32 arrays of shape ``(K,)``.

  Raises:
    UsageError: the lists have different lengths (each named with its length).

  Example:
    >>> h = hparams(lr=[1e-3, 3e-3], dropout=[0.0, 0.1])
    >>> h["lr"].shape, h["dropout"].dtype
    ((2,), dtype('float32'))
  """
  lens = {k: len(v) for k, v in per_job.items()}
  if len(set(lens.values())) > 1:
    raise UsageError(f"hparams: lists of different lengths {lens}")
  return {k: np.asarray(v, np.float32) for k, v in per_job.items()}


# --------------------------------------------------------------------------
# shardings
# --------------------------------------------------------------------------

def job_mesh(devices: Sequence[Any], *, jobs: int, job_axis: str = JOB_AXIS,
             **inner: int) -> Mesh:
  """A mesh ``(job, *inner)`` over ``devices``, job outermost.

  Each job group is ``prod(inner)`` consecutive devices, so a job's own
  collectives stay among neighbours.

  Example:
    >>> import jax
    >>> dict(job_mesh(jax.devices()[:8], jobs=4, data=2).shape)
    {'job': 4, 'data': 2}
  """
  devices = list(devices)
  shape = (jobs, *inner.values())
  if math.prod(shape) != len(devices):
    raise UsageError(f"job_mesh: {job_axis}={jobs} x {inner} needs"
                     f" {math.prod(shape)} devices, got {len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(shape),
              (job_axis, *inner.keys()))


def stacked_shardings(per_job: Any, mesh: Mesh, *,
                      job_axis: str = JOB_AXIS) -> Any:
  """Shardings of a stacked state from a per-job sharding rule.

  Each leaf of ``per_job`` is a ``PartitionSpec``, a ``NamedSharding`` (its
  spec is used) or ``None`` (a non-array leaf); the result is
  ``NamedSharding(mesh, P(job_axis, *spec))``: the job axis first, each
  job's own dimensions as before.

  Raises:
    LayoutError: a spec names the job axis or an axis not in ``mesh``.

  Example:
    >>> import jax
    >>> mesh = job_mesh(jax.devices()[:8], jobs=4, tensor=2)
    >>> s = stacked_shardings({"w": P(None, "tensor")}, mesh)
    >>> s["w"].spec
    P('job', None, 'tensor')
  """
  if job_axis not in mesh.axis_names:
    raise LayoutError(f"mesh axes {mesh.axis_names} have no job axis {job_axis!r}")
  problems = []

  def one(path, leaf):
    if leaf is None:
      return None
    spec = leaf.spec if isinstance(leaf, NamedSharding) else leaf
    if not isinstance(spec, P):
      problems.append(f"{key_path_name(path)}: expected a PartitionSpec or"
                      f" NamedSharding, got {type(leaf).__name__}")
      return None
    used = [a for e in spec if e is not None
            for a in (e if isinstance(e, tuple) else (e,))]
    bad = [a for a in used if a == job_axis or a not in mesh.axis_names]
    if bad:
      problems.append(f"{key_path_name(path)}: spec {spec} uses {bad}; a job's"
                      f" own axes must be mesh axes other than {job_axis!r}"
                      f" ({mesh.axis_names})")
      return None
    return NamedSharding(mesh, P(job_axis, *spec))

  out = jax.tree_util.tree_map_with_path(
      one, per_job, is_leaf=lambda x: x is None or isinstance(x, (P, NamedSharding)))
  if problems:
    raise LayoutError("stacked_shardings:\n  " + "\n  ".join(problems))
  return out


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------

def job_iterators(source: Any, *, seeds: Sequence[int], global_batch_size: int,
                  **kwargs: Any) -> list:
  """One :class:`~tenplex_jax.data.ElasticIterator` per job, each its own seed.

  ``kwargs`` go to every iterator (``shuffle``, ``num_epochs``, ...). Each
  job's stream is exactly the one its solo run would read with that seed.

  Example:
    >>> its = job_iterators(list(range(8)), seeds=[0, 1], global_batch_size=4)
    >>> next_batches(its)["data"].shape
    (2, 4)
  """
  return [ElasticIterator(source, global_batch_size=global_batch_size, seed=s,
                          **kwargs) for s in seeds]


def next_batches(iterators: Sequence[Any]) -> dict[str, np.ndarray]:
  """The next batch of every job's iterator, stacked on a leading job axis.

  Example:
    >>> its = job_iterators(list(range(6)), seeds=[0, 0], global_batch_size=3)
    >>> b = next_batches(its)
    >>> b["data"].shape, bool((b["data"][0] == b["data"][1]).all())
    ((2, 3), True)
  """
  batches = [next(it) for it in iterators]
  return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


# --------------------------------------------------------------------------
# membership: remove / add / repack
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RepackReport:
  """What a :func:`repack` moved.

  Attributes:
    rows: for each new job slot, the old slot it came from, or ``-1 - i``
      for the ``i``-th new state.
    mesh_shape: the new mesh's axis sizes.
    state_bytes: bytes of one copy of the new stacked state. The other byte
      counts are summed over devices: a row held by two devices (replicated
      over an inner axis) counts twice.
    moved_bytes: bytes of surviving jobs' rows that arrived at a device
      that did not hold them. A row a device holds is always taken from
      that device, so this is the least any executor moves for the chosen
      placement.
    kept_bytes: surviving rows that stayed on their device (copied locally
      or not at all).
    added_bytes: bytes of the new jobs' rows written to devices.
    reused_shards: shards whose old buffer was kept as it was.
  """

  rows: tuple[int, ...]
  mesh_shape: Mapping[str, int]
  state_bytes: int
  moved_bytes: int
  kept_bytes: int
  added_bytes: int
  reused_shards: int


def _job_sharding(state: Any, job_axis: str) -> NamedSharding | None:
  """The NamedSharding of the first array leaf with the job axis on dim 0."""
  for x in jax.tree.leaves(state):
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
      spec = x.sharding.spec
      if len(spec) and spec[0] == job_axis:
        return x.sharding
  return None


def _groups(mesh: Mesh, job_axis: str) -> list[np.ndarray]:
  """The device groups along the job axis (each the inner mesh's devices)."""
  ax = mesh.axis_names.index(job_axis)
  return [np.asarray(np.take(mesh.devices, g, axis=ax), dtype=object)
          for g in range(mesh.shape[job_axis])]


def _plan_mesh(state: Any, rows: Sequence[int], devices: Sequence[Any] | None,
               job_axis: str) -> Mesh:
  """The new mesh for ``rows``: same inner axes, device groups assigned so
  that the most surviving rows stay on their devices."""
  from scipy.optimize import linear_sum_assignment

  sh = _job_sharding(state, job_axis)
  if sh is None:
    raise UsageError(
        f"repack: no array leaf is sharded with {job_axis!r} on its first"
        " dimension; pass mesh= or shardings=")
  old = sh.mesh
  k_old, k_new = num_jobs(state), len(rows)
  inner_shape = [old.shape[a] for a in old.axis_names if a != job_axis]
  g_size = math.prod(inner_shape)
  pool = list(old.devices.flat) if devices is None else list(devices)
  max_groups = len(pool) // g_size
  j_new = max((d for d in range(1, min(k_new, max_groups) + 1) if k_new % d == 0),
              default=0)
  if j_new == 0:
    raise UsageError(f"repack: {k_new} jobs need at least one group of"
                     f" {g_size} devices; {len(pool)} devices given")
  old_groups = _groups(old, job_axis)
  per_old = k_old // old.shape[job_axis]
  in_pool = set(id(d) for d in pool)
  phys = [g for g in old_groups if all(id(d) in in_pool for d in g.flat)]
  used = set(id(d) for g in phys for d in g.flat)
  rest = [d for d in pool if id(d) not in used]
  shape = old_groups[0].shape
  for i in range(len(rest) // g_size):
    phys.append(np.asarray(rest[i * g_size:(i + 1) * g_size], dtype=object).reshape(shape))
  old_index = {id(g.flat[0]): i for i, g in enumerate(old_groups)}
  per_new = k_new // j_new
  score = np.zeros((j_new, len(phys)))
  for j, r in enumerate(rows):
    if r < 0:
      continue
    g_old = r // per_old
    for p, g in enumerate(phys):
      if old_index.get(id(g.flat[0])) == g_old and np.array_equal(g, old_groups[g_old]):
        score[j // per_new, p] += 1
  new_idx, phys_idx = linear_sum_assignment(-score)
  order = [None] * j_new
  for a, b in zip(new_idx, phys_idx):
    order[a] = phys[b]
  ax = old.axis_names.index(job_axis)
  devs = np.stack(order, axis=ax)
  return Mesh(devs, old.axis_names)


def _new_value_rows(new_states: Sequence[Any], treedef) -> list[list]:
  flats = []
  for i, s in enumerate(new_states):
    flat, td = jax.tree_util.tree_flatten(s)
    if td != treedef:
      raise LayoutError(f"new state {i} has another tree structure than the"
                        f" array's jobs:\n  array: {treedef}\n  new {i}: {td}")
    flats.append(flat)
  return flats


def repack(state: Any, rows: Sequence[int], *, new_states: Sequence[Any] = (),
           mesh: Mesh | None = None, shardings: Any = None,
           devices: Sequence[Any] | None = None,
           job_axis: str = JOB_AXIS) -> tuple[Any, RepackReport]:
  """Builds a job array from some old jobs and some new ones, moving little.

  New slot ``j`` holds old job ``rows[j]`` (``rows[j] >= 0``) or
  ``new_states[-1 - rows[j]]`` (``rows[j] < 0``). Placement, in order of
  precedence: ``shardings`` (a pytree of shardings of the new state);
  ``mesh`` (each leaf keeps its PartitionSpec on it); otherwise a mesh with
  the old mesh's inner axes over ``devices`` (default: the old mesh's
  devices) whose job axis is the largest divisor of the new job count that
  fits, its device groups assigned to the new slots so that the most
  surviving rows stay where they are.

  Execution per leaf and new device: a shard whose rows and box equal an
  old shard on that device keeps that buffer; otherwise the shard is
  assembled from the rows, each taken from this device when it holds it,
  else from another device holding it; new jobs' rows come from
  ``new_states``. The old state is only read.

  Args:
    state: the stacked state.
    rows: the old slot (or ``-1 - i`` for new state ``i``) of each new slot.
    new_states: per-job states (same structure, shapes, dtypes as one job).
    mesh, shardings, devices: placement, see above.
    job_axis: the job mesh axis name.

  Returns:
    ``(new_state, report)``.

  Raises:
    UsageError: a row index is out of range, an old job repeats, or no
      placement can be derived.
    LayoutError: a new state does not match the array's jobs.

  Example:
    >>> import jax, numpy as np
    >>> mesh = job_mesh(jax.devices()[:4], jobs=4)
    >>> s = stack([{"w": np.full(2, k, np.float32)} for k in range(4)],
    ...           shardings=NamedSharding(mesh, P("job")))
    >>> new, rep = repack(s, [0, 3])
    >>> new["w"][:, 0].tolist(), rep.moved_bytes
    ([0.0, 3.0], 0)
  """
  rows = [int(r) for r in rows]
  k_old = num_jobs(state)
  new_states = list(new_states)
  olds = [r for r in rows if r >= 0]
  bad = [r for r in rows if r >= k_old or (r < 0 and -1 - r >= len(new_states))]
  if bad or len(set(olds)) != len(olds) or not rows:
    raise UsageError(f"repack: rows {rows} must name distinct old jobs in"
                     f" [0, {k_old}) or new states -1..-{len(new_states)}")
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  new_flats = _new_value_rows(new_states, jax.tree_util.tree_structure(state))
  if shardings is not None:
    targets = treedef.flatten_up_to(shardings)
  else:
    if mesh is None:
      mesh = _plan_mesh(state, rows, devices, job_axis)
    targets = []
    for _, x in flat:
      if not _is_array(x):
        targets.append(None)
        continue
      spec = (x.sharding.spec if isinstance(x, jax.Array)
              and isinstance(x.sharding, NamedSharding) else P(job_axis))
      targets.append(NamedSharding(mesh, spec))
  k_new = len(rows)
  stats = dict(state_bytes=0, moved=0, kept=0, added=0, reused=0)
  leaves = []
  problems = []
  for i, (path, x) in enumerate(flat):
    name = key_path_name(path)
    if not _is_array(x):
      diff = [n for n, f in enumerate(new_flats) if not _same(f[i], x)]
      if diff:
        problems.append(f"{name}: non-array leaf of new states {diff} differs"
                        f" from the array's ({x!r})")
      leaves.append(x)
      continue
    news = [f[i] for f in new_flats]
    shape = (k_new, *np.shape(x)[1:])
    wrong = [n for n, v in enumerate(news)
             if not _is_array(v) or tuple(np.shape(v)) != shape[1:]]
    if wrong:
      problems.append(f"{name}: new states {wrong} have shape"
                      f" {[list(np.shape(news[n])) for n in wrong]}, the jobs"
                      f" {list(shape[1:])}")
      leaves.append(None)
      continue
    leaves.append(_repack_leaf(x, rows, news, targets[i], stats))
  if problems:
    raise LayoutError("repack:\n  " + "\n  ".join(problems))
  sh = next((t for t in targets if isinstance(t, NamedSharding)), None)
  report = RepackReport(
      rows=tuple(rows), mesh_shape=dict(sh.mesh.shape) if sh is not None else {},
      state_bytes=stats["state_bytes"], moved_bytes=stats["moved"],
      kept_bytes=stats["kept"],
      added_bytes=stats["added"], reused_shards=stats["reused"])
  return treedef.unflatten(leaves), report


def _index_box(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _repack_leaf(x: Any, rows: list[int], news: list, target: Any,
                 stats: dict) -> jax.Array:
  key_impl = jax.random.key_impl(x) if is_key(x) else None
  keys_target = target
  if key_impl is not None:
    x = jax.random.key_data(x)
    news = [jax.random.key_data(v) if is_key(v) else np.asarray(v) for v in news]
    target = key_data_sharding(target, x.ndim - 1, 1)
  old_shape = tuple(x.shape)
  new_shape = (len(rows), *old_shape[1:])
  if isinstance(x, jax.Array):
    held = {}   # device id -> (row range, inner box, shard data)
    for sh in x.addressable_shards:
      box = _index_box(sh.index, old_shape)
      held[sh.device.id] = (box[0], box[1:], sh.data)
  else:
    held = {}
  host_cache: dict[int, np.ndarray] = {}

  def host_of(dev_id):
    if dev_id not in host_cache:
      host_cache[dev_id] = np.asarray(held[dev_id][2])
    return host_cache[dev_id]

  out_shards = []
  for dev, index in target.addressable_devices_indices_map(new_shape).items():
    box = _index_box(index, new_shape)
    (a, b), inner = box[0], box[1:]
    inner_sl = tuple(slice(lo, hi) for lo, hi in inner)
    nbytes = (b - a) * math.prod(hi - lo for lo, hi in inner) * np.dtype(x.dtype).itemsize
    mine = held.get(dev.id)
    want = rows[a:b]
    if (mine is not None and mine[1] == inner and all(r >= 0 for r in want)
        and list(range(mine[0][0], mine[0][1])) == want):
      out_shards.append(mine[2])
      stats["reused"] += 1
      stats["kept"] += nbytes
      continue
    parts = []
    piece_bytes = nbytes // max(b - a, 1)
    for r in want:
      if r < 0:
        parts.append(np.asarray(_host_leaf(news[-1 - r]))[inner_sl])
        stats["added"] += piece_bytes
        continue
      src = None
      if mine is not None and mine[0][0] <= r < mine[0][1] and _covers(mine[1], inner):
        src = dev.id
      else:
        src = next((d for d, (rr, ib, _) in sorted(held.items())
                    if rr[0] <= r < rr[1] and _covers(ib, inner)), None)
      if src is None:  # not addressable as jax shards (numpy input)
        parts.append(np.asarray(x)[r][inner_sl])
        stats["moved"] += piece_bytes
        continue
      rr, ib, _ = held[src]
      rel = tuple(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(inner, ib))
      parts.append(host_of(src)[(r - rr[0], *rel)])
      if src == dev.id:
        stats["kept"] += piece_bytes
      else:
        stats["moved"] += piece_bytes
    block = np.stack(parts) if parts else np.zeros((0, *[hi - lo for lo, hi in inner]),
                                                    x.dtype)
    out_shards.append(jax.device_put(block, dev))
  stats["state_bytes"] += math.prod(new_shape) * np.dtype(x.dtype).itemsize
  arr = jax.make_array_from_single_device_arrays(new_shape, target, out_shards)
  if key_impl is not None:
    arr = wrap_keys(arr, key_impl, keys_target)
  return arr


def _covers(outer: tuple, inner: tuple) -> bool:
  return all(olo <= lo and hi <= ohi for (olo, ohi), (lo, hi) in zip(outer, inner))


def _host_leaf(v: Any) -> np.ndarray:
  return _host(v) if _is_array(v) else np.asarray(v)


def remove(state: Any, job_indices: Sequence[int], *, mesh: Mesh | None = None,
           shardings: Any = None, devices: Sequence[Any] | None = None,
           job_axis: str = JOB_AXIS) -> Any:
  """Drops jobs from a job array; the others keep their order.

  Job ``job_indices`` are removed; old job ``k`` becomes job ``k - (number
  of removed jobs before k)``. Placement as in :func:`repack` (by default:
  the old mesh's inner axes, the largest job axis that divides the new
  count, device groups chosen so that surviving jobs stay on their devices).
  For the report use :func:`repack` with the same rows.

  Example:
    >>> import jax, numpy as np
    >>> mesh = job_mesh(jax.devices()[:4], jobs=4)
    >>> s = stack([{"w": np.full(2, k, np.float32)} for k in range(4)],
    ...           shardings=NamedSharding(mesh, P("job")))
    >>> remove(s, [1])["w"][:, 0].tolist()
    [0.0, 2.0, 3.0]
  """
  k = num_jobs(state)
  drop = {int(i) for i in job_indices}
  bad = sorted(i for i in drop if not 0 <= i < k)
  if bad:
    raise UsageError(f"remove: jobs {bad} are not in [0, {k})")
  if len(drop) == k:
    raise UsageError(f"remove: removing all {k} jobs leaves no job array")
  rows = [r for r in range(k) if r not in drop]
  return repack(state, rows, mesh=mesh, shardings=shardings, devices=devices,
                job_axis=job_axis)[0]


def add(state: Any, new_states: Sequence[Any], *, mesh: Mesh | None = None,
        shardings: Any = None, devices: Sequence[Any] | None = None,
        job_axis: str = JOB_AXIS) -> Any:
  """Appends new jobs (fresh trials) after the existing ones.

  Old job ``k`` stays job ``k``; ``new_states[i]`` becomes job ``K + i``.
  Placement as in :func:`repack`; pass ``devices`` to grow onto devices the
  array does not use yet.

  Example:
    >>> import jax, numpy as np
    >>> mesh = job_mesh(jax.devices()[:2], jobs=2)
    >>> s = stack([{"w": np.full(2, k, np.float32)} for k in range(2)],
    ...           shardings=NamedSharding(mesh, P("job")))
    >>> s = add(s, [{"w": np.full(2, 7, np.float32)}] * 2, devices=jax.devices()[:4])
    >>> s["w"][:, 0].tolist(), s["w"].sharding.mesh.shape["job"]
    ([0.0, 1.0, 7.0, 7.0], 4)
  """
  k = num_jobs(state)
  new_states = list(new_states)
  if not new_states:
    raise UsageError("add: no new states")
  rows = list(range(k)) + [-1 - i for i in range(len(new_states))]
  return repack(state, rows, new_states=new_states, mesh=mesh,
                shardings=shardings, devices=devices, job_axis=job_axis)[0]


def resize(state: Any, mesh: Mesh, *, method: str = "auto") -> tuple[Any, Any]:
  """Moves a job array onto another mesh, same jobs, minimum movement.

  Each array keeps its PartitionSpec (``P('job', ...)``) on ``mesh``; the
  transfer is :func:`tenplex_jax.remesh`'s: the planner moves only the
  pieces a device does not already hold (e.g. 8 -> 4 devices with one job
  per device: each remaining device keeps its job and receives one). The
  device order of ``mesh`` matters: below, device 1 held job 1, which goes
  to device 0, and receives jobs 2 and 3 (48 bytes); a mesh over devices 0
  and 2 would keep two jobs in place and move 32.

  Returns:
    ``(state, report)`` with a :class:`tenplex_jax.RemeshReport`.

  Example:
    >>> import jax, numpy as np
    >>> s = stack([{"w": np.full(4, k, np.float32)} for k in range(4)],
    ...           shardings=NamedSharding(job_mesh(jax.devices()[:4], jobs=4), P("job")))
    >>> s, rep = resize(s, job_mesh(jax.devices()[:2], jobs=2))
    >>> rep.moved_bytes, s["w"].sharding.spec
    (48, P('job',))
  """
  return remesh(state, mesh, method=method)


# --------------------------------------------------------------------------
# placement search
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Placement:
  """One way to split the devices: ``job`` groups x each job's own layout.

  Attributes:
    job: size of the job mesh axis (device groups); each group trains
      ``jobs / job`` jobs one after another.
    data, fsdp, tensor, pipeline: each job's own degrees (from the search).
    microbatches, remat: the job's schedule (from the search).
    job_step_s: estimated seconds of one step of one job on its group.
    step_s: seconds of one step of the whole array (``jobs / job`` job steps).
    samples_per_s: ``jobs * batch / step_s``.
    memory_bytes: estimated peak per device: the group's job states
      (``jobs / job`` copies of the weights and optimizer) plus one job's
      activations.
    fits: whether ``memory_bytes`` is within the device's limit.
  """

  job: int
  data: int
  fsdp: int
  tensor: int
  pipeline: int
  microbatches: int
  remat: str
  job_step_s: float
  step_s: float
  samples_per_s: float
  memory_bytes: int
  fits: bool


@dataclasses.dataclass(frozen=True)
class PlacementReport:
  """The result of :func:`placement_search`: every alternative, best first."""

  jobs: int
  devices: int
  batch: int
  alternatives: tuple[Placement, ...]
  rejected: tuple[tuple[int, str], ...]

  @property
  def best(self) -> Placement:
    fits = [a for a in self.alternatives if a.fits]
    if not fits:
      raise SearchError(f"no placement of {self.jobs} jobs on {self.devices}"
                        f" devices fits: {self.rejected}")
    return fits[0]

  def explain(self) -> str:
    """A table of the alternatives and a sentence on why the best wins."""
    lines = [f"{self.jobs} jobs x batch {self.batch} on {self.devices} devices",
             " job  data fsdp tens pipe | job step s | array step s | samples/s |"
             "   MiB/dev | fits"]
    for a in self.alternatives:
      lines.append(
          f" {a.job:>3}  {a.data:>4} {a.fsdp:>4} {a.tensor:>4} {a.pipeline:>4} |"
          f" {a.job_step_s:>10.4g} | {a.step_s:>12.4g} | {a.samples_per_s:>9.4g} |"
          f" {a.memory_bytes / 2**20:>9.1f} | {a.fits}")
    for j, why in self.rejected:
      lines.append(f" job={j}: {why}")
    fits = [a for a in self.alternatives if a.fits]
    if fits:
      b = fits[0]
      why = (f"best: job={b.job} with each job on {self.devices // b.job} device(s)"
             f" ({b.data}x{b.fsdp}x{b.tensor}x{b.pipeline}),"
             f" {b.samples_per_s:.4g} samples/s.")
      if len(fits) > 1:
        nxt = fits[1]
        why += (f" The next, job={nxt.job}, takes {nxt.step_s / b.step_s:.2f}x as long"
                f" per array step ({nxt.step_s:.4g} s).")
      if b.job == min(self.jobs, self.devices):
        why += (" Splitting jobs over devices needs no communication inside a job,"
                " while any data/tensor/pipeline degree inside a job pays collectives"
                " and smaller per-device work.")
      lines.append(why)
    return "\n".join(lines)

  def to_json(self) -> dict:
    return {"jobs": self.jobs, "devices": self.devices, "batch": self.batch,
            "alternatives": [dataclasses.asdict(a) for a in self.alternatives],
            "rejected": [list(r) for r in self.rejected]}


def placement_search(model: Any, *, jobs: int, devices: int, batch: int,
                     seq_len: int | None = None, hardware: Any = "cpu",
                     devices_per_host: int | None = None,
                     **search_kwargs: Any) -> PlacementReport:
  """Splits ``devices`` between the job axis and each job's parallelism.

  For every job-axis size ``J`` dividing both ``jobs`` and ``devices``, each
  group of ``devices / J`` devices trains ``jobs / J`` jobs one after another
  (as ``vmap_step`` or ``lax.map`` do); :func:`tenplex_jax.search.search`
  prices the best (data, fsdp, tensor, pipeline) layout of one job with
  batch ``batch`` on a group. The array's step is ``jobs / J`` job steps;
  memory per device holds ``jobs / J`` job states plus one job's
  activations. Alternatives are ranked by array step time.

  Args:
    model: a :class:`tenplex_jax.search.ModelSpec` or a preset name.
    jobs: K, the number of sibling jobs.
    devices: devices of the whole array.
    batch: each job's global batch per step.
    seq_len: tokens per sample.
    hardware: a preset name (``'cpu'``, ``'a100-80g'``...) or Hardware.
    devices_per_host: as in the search (default: the preset's, capped by
      the group size).
    **search_kwargs: passed to the search (``restrict``, ``remat``...).

  Returns:
    A :class:`PlacementReport`; ``.best`` and ``.explain()``.

  Example:
    >>> from tenplex_jax.search import transformer_spec
    >>> spec = transformer_spec(name="tiny", layers=2, hidden=64, heads=4,
    ...                         vocab=128, seq_len=32)
    >>> rep = placement_search(spec, jobs=8, devices=8, batch=8, seq_len=32)
    >>> rep.best.job
    8
  """
  hw = hardware if isinstance(hardware, Hardware) else hardware_preset(hardware)
  alts, rejected = [], []
  for j in range(1, devices + 1):
    if devices % j or jobs % j:
      continue
    g = devices // j
    dph = min(devices_per_host or hw.devices_per_host, g)
    try:
      res = search(model, hw, devices=g, devices_per_host=dph, global_batch=batch,
                   seq_len=seq_len, **search_kwargs)
    except SearchError as e:
      rejected.append((j, str(e)))
      continue
    per = jobs // j
    best = None
    for c in res.candidates:
      bd = dict(c.breakdown)
      weights = bd["weights_bytes"]
      mem = c.memory_bytes + (per - 1) * weights
      if mem <= res.memory_limit_bytes:
        best = (c, mem)
        break
    if best is None and res.candidates:
      c = res.candidates[0]
      best = (c, c.memory_bytes + (per - 1) * dict(c.breakdown)["weights_bytes"])
    if best is None:
      rejected.append((j, f"no feasible layout of one job on {g} devices:"
                          f" {res.rejection_counts()}"))
      continue
    c, mem = best
    step = per * c.step_time_s
    alts.append(Placement(
        job=j, data=c.data, fsdp=c.fsdp, tensor=c.tensor, pipeline=c.pipeline,
        microbatches=c.microbatches, remat=c.remat, job_step_s=c.step_time_s,
        step_s=step, samples_per_s=jobs * batch / step, memory_bytes=int(mem),
        fits=mem <= res.memory_limit_bytes))
  alts.sort(key=lambda a: (not a.fits, a.step_s, a.memory_bytes))
  return PlacementReport(jobs=jobs, devices=devices, batch=batch,
                         alternatives=tuple(alts), rejected=tuple(rejected))
