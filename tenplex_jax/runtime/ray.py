"""Elastic JAX jobs on Ray, the state rebuilt from the stores in the nodes' memory.

``pip install tenplex_jax[ray]``. One training script runs unchanged under
``tenplex-jax launch`` and under :func:`run`: it calls the launcher's script
API (:func:`initialize`, :func:`restore_or_init`, :func:`resize_due`,
:func:`save_and_exit`, :func:`save_snapshot`, re-exported here from
:mod:`tenplex_jax.runtime.launch`), which reads its job from ``TENPLEX_*``
environment variables that :func:`run` sets in each Ray worker.

What :func:`run` does on a Ray cluster:

* one tenplex store server per node, as a **detached named Ray actor**
  (``tenplex-store-<job>-<node>`` in namespace ``tenplex``) serving a
  directory in that node's ``/dev/shm``; it outlives the worker groups, is
  found by name by the next one and is removed at the end of the run
  (``keep_stores=False``); the driver starts it as soon as Ray lists a
  node that joins, and a group waits for a store that never answered (a
  slow start on a loaded node) up to ``start_timeout`` while its node is
  alive;
* a worker group of N Ray actors (one CPU each, spread round robin over the
  alive nodes), new processes for every group, running
  ``jax.distributed`` on gloo (the coordinator on worker 0's node);
* **standby workers**: the next group's actors are started ahead (0 CPUs,
  pinned to nodes with room, as many as the largest group), with jax,
  flax, optax and Orbax imported, waiting before ``jax.distributed``; a
  resize or a recovery hands them their rank and the new process count
  (:meth:`_Worker.run`) instead of starting actors. The driver starts the
  replacements after the new group's first step (and checks every 1 s),
  and drops the dead ones, those whose imports are not done within
  ``standby_timeout`` and those on nodes that left or drain; an unused
  standby costs only memory. jax's persistent compilation cache sits beside each node's
  store (``<store_root>/tenplex-ray-<job>/xla``), so a group on a mesh the
  job ran before loads its step instead of compiling it;
* a resize is decided by the driver through a controller actor that every
  worker's :func:`resize_due` asks each step, so all workers stop at the
  same step: with ``num_workers=(min, max)`` (like Ray Train's
  ``ScalingConfig(num_workers=(min, max))``) the driver follows Ray's node
  table, one worker per CPU (or per ``worker_resources``, e.g. a GPU) of
  the alive nodes within the bounds (a node joins: the job grows onto it),
  else by ``schedule={step: workers}`` or
  :meth:`Job.request_resize`; :func:`save_and_exit` writes each worker's
  shards to its node's store and ends the group; the next group (N'
  workers) restores with :func:`restore_or_init` from the stores: its own
  node's directory first, then the peers' store servers
  (``tenplex_jax.store.restore``) onto the layout the script builds for N'
  workers (its rules, or ``tenplex_jax.search.best_mesh_for``); the step
  and every non-array leaf (e.g. the data iterator's position) travel in
  the snapshot;
* a node Ray drains (a preemption notice, an autoscaler scale-down,
  :func:`drain_node`; seen in the GCS's draining table) is a planned
  leave: the driver asks the group to save and resize (to the room left,
  or the same count placed elsewhere) a few steps ahead, before the
  deadline; the next group restores from the stores, the drained node's
  shards from its store server, which serves until the node goes: no
  failure, no step lost;
* a worker that fails (an exception, its process or node gone) ends the
  group; the next one (on the nodes that still answer, within the bounds)
  restores the newest complete :func:`save_snapshot` (the lost node's
  shards from store replicas), else the newest checkpoint in the user's
  Ray storage (``run_config=RunConfig(storage_path, name)``: a file system
  every node mounts, or ``s3://``/``gs://``, where each worker uploads its
  own shards; written by the script with
  ``store.save_checkpoint(info["checkpoint"], ...)``), reporting the steps
  lost.

The job token (``TENPLEX_JAX_STORE_TOKEN``: the driver's value, else a new
secret) is passed to the store actors and the workers in their
environment; so are the driver's object-storage variables
(:data:`STORAGE_ENV`) when the checkpoint is on object storage.

Example (a local 3-node cluster, a 2-worker job that grows to 3 at step 4;
then a (1, 4)-worker job that follows the cluster and falls back to the
checkpoints in its Ray storage; ``train.py`` is a script written for
``tenplex-jax launch``, e.g. ``tests/ray_train.py``)::

  import ray
  from ray.cluster_utils import Cluster
  from ray.train import RunConfig
  from tenplex_jax import ray as tray

  # Loopback addresses only (Ray turns 127.0.0.1 into the outward address).
  cluster = Cluster(initialize_head=True, head_node_args={
      "num_cpus": 1, "node_ip_address": "127.0.0.2"})
  for k in (3, 4):
    cluster.add_node(num_cpus=1, node_ip_address=f"127.0.0.{k}")
  ray.init(address=cluster.address, _node_ip_address="127.0.0.2")
  result = tray.run("train.py", ["10"], num_workers=2, schedule={4: 3})
  print([g["workers"] for g in result["generations"]])   # [2, 3]
  result = tray.run("train.py", ["10"], num_workers=(1, 4), replicas=1,
                    run_config=RunConfig(storage_path="/tmp/ray", name="lm"))
  print([g["workers"] for g in result["generations"]])   # [3]
  ray.shutdown(); cluster.shutdown()
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
  import ray as _ray  # the real ray (absolute import; this is tenplex_jax.ray)
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - the optional extra is missing
  raise ImportError("tenplex_jax.ray needs Ray: pip install"
                    " 'tenplex_jax[ray]'") from e

from tenplex_jax.errors import StoreError, UsageError
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.runtime import launch as _launch
from tenplex_jax.runtime.env import (STANDBY_ASSIGNED_ENV, STANDBY_READY_ENV,
                                     job_env)
from tenplex_jax.store import private
from tenplex_jax.runtime.launch import (
    CA_ENV,
    TOKEN_ENV,
    Controller,
    check_tls_options,
    initialize,
    resize_due,
    restore_or_init,
    save_and_exit,
    save_snapshot,
    use_controller,
)
from tenplex_jax.store.server import make_server, new_token, resolve_token

__all__ = ["Job", "ResizeExit", "STANDBY_IMPORTS", "checkpoint_dir",
           "cleanup_stores", "drain_node", "draining_nodes", "initialize",
           "resize_due", "restore_or_init", "run", "save_and_exit",
           "save_snapshot", "stop_store", "store_actor_name"]

NAMESPACE = "tenplex"
_MARGIN = 3  # steps ahead of the furthest worker for a request
# How often the driver replaces dead standbys: a GCS node query and a ping
# per ready standby, so a dead one is gone within about 2 s (the ping sent
# at one check fails by the next).
_STANDBY_CHECK_S = 1.0
# Seconds a group started ahead may take to be ready by default (the
# launcher's default prepare timeout without a step timeout).
_PREPARE_TIMEOUT = 600.0
# The job's jax persistent compilation cache on a node, beside its store
# directories: <store_root>/tenplex-ray-<job>/xla.
_CACHE_DIR = "xla"
# What a standby worker imports ahead of its rank (the launcher's list, and
# the Orbax checkpointer the persistent checkpoint uses).
STANDBY_IMPORTS = (*_launch.STANDBY_IMPORTS, "orbax.checkpoint")


# ------------------------------------------------------------ worker side

class ResizeExit(BaseException):
  """Raised by ``save_and_exit`` in a Ray worker after its save: the
  worker catches it and reports the resize (a ``BaseException``, so a
  script's ``except Exception`` does not swallow it)."""

  def __init__(self, procs: int, step: int):
    super().__init__(f"resize to {procs} workers at step {step}")
    self.procs, self.step = int(procs), int(step)


class _WorkerController(Controller):
  """A worker's controller under :func:`run`: the job's driver decides
  (``resize_due`` asks the controller actor), and a worker leaves for a
  resize by raising :class:`ResizeExit` to :meth:`_Worker.run`."""

  def __init__(self):
    self.handle = None

  def resize_due(self, step: int) -> int | None:
    restored = None
    if self.handle is None:
      self._actor()
      # What this group restored, known to the driver even if it fails
      # later.
      restored = dict(_launch.last_restore)
    return _ray.get(self.handle.poll.remote(
        job_env().proc_id, int(step), restored))

  def leave_for_resize(self, procs: int, step: int) -> None:
    raise ResizeExit(procs, step)

  def _actor(self):
    if self.handle is None:
      self.handle = _ray.get_actor(job_env().ray_controller,
                                   namespace=NAMESPACE)
    return self.handle

  def wait_turn(self, path: str, ready: float) -> dict:
    """A worker of a group prepared ahead (``TENPLEX_TURN_FILE=ray``):
    blocks until the controller gives its generation the turn (every
    worker of the running group has saved)."""
    gen = job_env().generation
    while True:
      turn = _ray.get(self._actor().wait_turn.remote(
          gen, job_env().proc_id, 10.0))
      if turn is not None:
        return turn

  def saved(self, procs: int, step: int) -> None:
    """Tells the controller this worker saved for a resize to ``procs``
    workers at ``step`` (the last one gives a prepared group its turn)."""
    env = job_env()
    _ray.get(self._actor().saved.remote(env.generation, env.proc_id,
                                        int(step), int(procs)))


def store_actor_name(job: str, node_id: str) -> str:
  """The name of job ``job``'s store actor on node ``node_id``."""
  return f"tenplex-store-{job}-{node_id[:16]}"


@_ray.remote(num_cpus=0)
class _StoreActor:
  """A tenplex store server for one node's directory (detached); HTTPS with
  ``tls`` (certificate, key: paths on that node)."""

  def __init__(self, root: str, tls: tuple[str, str] | None = None):
    self.root = root
    private.check_dir(root)  # e.g. a tenplex-ray-JOB another user made first
    private.makedirs(root)
    host = _ray.util.get_node_ip_address()
    cert, key = tls or (None, None)
    self.srv = make_server(root, 0, host=host, tls_cert=cert, tls_key=key)
    threading.Thread(target=self.srv.serve_forever, daemon=True).start()
    scheme = "http" if tls is None else "https"
    self.addr = f"{scheme}://{host}:{self.srv.server_address[1]}"

  def info(self) -> dict:
    return {"url": self.addr, "dir": self.root,
            "node": _ray.get_runtime_context().get_node_id()}

  def stop(self) -> None:
    self.srv.shutdown()
    self.srv.server_close()
    shutil.rmtree(self.root, ignore_errors=True)
    parent = os.path.dirname(self.root)
    try:  # the job's directory on this node, once its last store is gone
      if os.listdir(parent) == [_CACHE_DIR]:  # and the compilation cache
        shutil.rmtree(os.path.join(parent, _CACHE_DIR), ignore_errors=True)
      os.rmdir(parent)
    except OSError:
      pass


@_ray.remote(num_cpus=0, concurrency_groups={"turn": 64})
class _Controller:
  """Progress of the workers and the resize decision of the driver; the
  turn of a group prepared ahead (:meth:`wait_turn` runs in its own
  threads, so that a prepared worker waiting for its turn does not hold up
  the running group's :meth:`poll`)."""

  def __init__(self):
    self.cond = threading.Condition()
    self.turns: dict[int, dict] = {}  # generation: its turn, once given
    self.done: dict[int, dict] = {}  # generation: its last state()
    self.next = None  # (generation, workers, schedule)
    self.saves: dict[int, int] = {}  # rank: the step it saved at
    self.waiting: dict[int, set[int]] = {}  # generation: ranks at the turn
    self.gen = 0
    self._reset(0, 0, {})

  def _reset(self, n: int, start: int, schedule: dict) -> None:
    self.n, self.start, self.progress = n, start, {}
    self.schedule = {int(k): int(v) for k, v in schedule.items()}
    self.request = None
    self.first_poll = None
    self.restored: dict = {}

  def new_generation(self, n: int, start: int, schedule: dict,
                     gen: int | None = None) -> None:
    """Generation ``gen`` (``n`` workers from step ``start``) runs now; a
    generation that was prepared ahead switched at its turn already."""
    if gen is not None and gen in self.turns:
      return
    self.done[self.gen] = self.state()
    self.gen = self.gen + 1 if gen is None else int(gen)
    self._reset(n, start, schedule)

  def prepare(self, gen: int | None, n: int = 0,
              schedule: dict | None = None) -> None:
    """Generation ``gen`` (``n`` workers) waits for its turn: given once
    every worker of the running generation has saved, at one step, for a
    resize to ``n`` workers (:meth:`saved`). ``None``: none."""
    self.next = None if gen is None else (int(gen), int(n),
                                          dict(schedule or {}))
    self.saves = {}

  def saved(self, gen: int, rank: int, step: int, procs: int) -> bool:
    """Worker ``rank`` of generation ``gen`` saved at ``step`` for a
    resize to ``procs`` workers; the last one gives the prepared
    generation its turn (when it is the one prepared for that)."""
    nx = self.next
    if nx is None or gen != self.gen or nx[0] != gen + 1 or procs != nx[1]:
      return False
    self.saves[int(rank)] = int(step)
    if len(self.saves) < self.n or len(set(self.saves.values())) != 1:
      return False
    return self.give_turn(nx[0], int(step))

  def give_turn(self, gen: int, start: int) -> bool:
    """Switches to the prepared generation ``gen``, which starts from step
    ``start``, and lets its workers restore (at once if they wait);
    whether ``gen`` has its turn."""
    nx = self.next
    if nx is None or nx[0] != gen:
      return gen in self.turns
    self.next = None
    self.done[self.gen] = self.state()
    self.gen = gen
    self._reset(nx[1], start, nx[2])
    with self.cond:
      self.turns[gen] = {"handed": time.time(),
                         "env": {"TENPLEX_START_STEP": str(int(start))}}
      self.cond.notify_all()
    return True

  @_ray.method(concurrency_group="turn")
  def wait_turn(self, gen: int, rank: int, timeout: float) -> dict | None:
    """Generation ``gen``'s turn (``{"handed": t, "env": {start step}}``),
    waited for up to ``timeout`` seconds by its worker ``rank``; ``None``
    if not given yet."""
    with self.cond:
      self.waiting.setdefault(gen, set()).add(int(rank))
      self.cond.wait_for(lambda: gen in self.turns, timeout)
      return self.turns.get(gen)

  def withdraw(self, gen: int) -> None:
    """Takes back generation ``gen``'s turn (its group, prepared ahead, was
    dropped at the turn): the group started instead runs as generation
    ``gen`` (:meth:`new_generation`)."""
    with self.cond:
      self.turns.pop(int(gen), None)
      self.waiting.pop(int(gen), None)

  @_ray.method(concurrency_group="turn")
  def waiting_ranks(self, gen: int) -> list[int]:
    """The workers of generation ``gen`` that reached their turn's wait."""
    with self.cond:
      return sorted(self.waiting.get(gen, ()))

  def poll(self, rank: int, step: int, restored: dict | None = None
           ) -> int | None:
    if self.first_poll is None:
      self.first_poll = time.time()
    if restored is not None:
      self.restored[rank] = restored
    self.progress[rank] = max(step, self.progress.get(rank, 0))
    m = self.schedule.get(step)
    if m is not None and step > self.start and m != self.n:
      return m
    r = self.request
    if r and r[1] == step and (r[0] != self.n or r[2]):
      return r[0]
    return None

  def request_resize(self, procs: int, move: bool = False) -> int:
    """At a few steps past the furthest worker; ``move``: also at the same
    count (a new group placed off draining nodes)."""
    at = max([self.start, *self.progress.values()]) + _MARGIN
    self.request = (int(procs), at, bool(move))
    return at

  def state(self, gen: int | None = None) -> dict:
    """Generation ``gen``'s (default: the running one's) progress, first
    poll, request and what its worker 0 restored."""
    if gen is not None and gen != self.gen:
      return self.done.get(gen, {"progress": {}, "first_poll": None,
                                 "request": None, "restored": None})
    return {"progress": dict(self.progress), "first_poll": self.first_poll,
            "request": self.request, "restored": self.restored.get(0)}


def _use_compilation_cache(env: Mapping[str, str]) -> None:
  """Points jax's persistent compilation cache at ``env``'s
  ``JAX_COMPILATION_CACHE_DIR`` (made ``0700``), or turns it off without
  one. A fresh worker's jax reads the variables when the script imports
  it; a standby imported jax before it had them, so this also sets them in
  jax's config (nothing has compiled in it yet)."""
  path = env.get("JAX_COMPILATION_CACHE_DIR")
  if path:
    private.makedirs(path)
  jax = sys.modules.get("jax")
  if jax is None:
    return
  jax.config.update("jax_compilation_cache_dir", path or None)
  if path:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _free_arrays() -> None:
  """Deletes every live jax array of this process: a worker that saved
  for a resize uses none again, and the next group's restore (on this
  node, at once when it was started ahead) allocates as much again. On
  the project's VMs memory freed moments before is faulted in much faster
  than memory the guest has not touched lately."""
  jax = sys.modules.get("jax")
  if jax is None:
    return
  for a in jax.live_arrays():
    try:
      a.delete()
    except Exception:  # noqa: BLE001 - deleted already, or donated
      pass


@_ray.remote(num_cpus=1)
class _Worker:
  """One process of a worker group (a new process per group: a fresh actor,
  or a standby started ahead with :meth:`prepare`)."""

  def prepare(self, imports: Sequence[str]) -> dict:
    """A standby's start: imports ``imports`` (jax, flax, optax, ...; a
    module that fails is left to the script's own import), nothing that
    starts jax's backends or ``jax.distributed``; then it waits for
    :meth:`run` to hand it its rank."""
    for name in imports:
      try:
        importlib.import_module(name)
      except Exception:  # noqa: BLE001 - the script's import reports it
        pass
    self.ready = time.time()
    return {"pid": os.getpid(), "ready": self.ready}

  def ping(self) -> int:
    """Answers while the process lives (a standby's liveness check)."""
    return os.getpid()

  def address(self) -> tuple[str, int, str]:
    with socket.socket() as s:
      s.bind(("", 0))
      port = s.getsockname()[1]
    return (_ray.util.get_node_ip_address(), port,
            _ray.get_runtime_context().get_node_id())

  def run(self, train: str | Callable, args: Sequence[str],
          env: Mapping[str, str]) -> dict:
    os.environ.update(env)
    out: dict = {"pid": os.getpid(), "standby": hasattr(self, "ready")}
    if out["standby"]:  # as the launcher's standby processes report it
      os.environ[STANDBY_READY_ENV] = repr(self.ready)
      os.environ[STANDBY_ASSIGNED_ENV] = repr(time.time())
    _use_compilation_cache(env)
    ctrl = _WorkerController()
    use_controller(ctrl)  # the driver decides resizes
    try:
      if callable(train):
        train(*args)
      else:
        sys.argv = [train, *map(str, args)]
        runpy.run_path(train, run_name="__main__")
      out["outcome"] = "done"
    except ResizeExit as e:
      out.update(outcome="resize", procs=e.procs, step=e.step)
      if job_env().ray_free_arrays:
        _free_arrays()  # before the next group's restore allocates
      try:  # saved: a group prepared for this resize may restore now
        ctrl.saved(e.procs, e.step)
      except Exception:  # noqa: BLE001 - the driver gives the turn then
        pass
    except SystemExit as e:  # a script's sys.exit(main())
      if e.code not in (None, 0):
        raise RuntimeError(f"{train} exited with status {e.code!r}") from e
      out["outcome"] = "done"
    finally:
      jax = sys.modules.get("jax")
      if jax is not None and job_env().procs > 1:
        try:
          jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - already down or never up
          pass
    # Through the module: Ray ships this class by value (cloudpickle), with
    # a copy of the globals it names; a module goes by reference.
    out["restored"] = dict(_launch.last_restore)
    return out


# ------------------------------------------------------------ driver side

@_ray.remote(num_cpus=0)
def _probe() -> str:
  return _ray.get_runtime_context().get_node_id()


def _responds(node: str, timeout: float = 15.0) -> bool:
  """Whether node ``node``'s raylet still runs a task (a node killed without
  warning stays "alive" in Ray's node table for a while)."""
  ref = _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
      node, soft=False)).remote()
  try:
    return _ray.get(ref, timeout=timeout) == node
  except (_ray.exceptions.RayError, TimeoutError):
    _ray.cancel(ref, force=True)
    return False


_gcs: dict = {}


def draining_nodes() -> dict[str, int]:
  """The nodes Ray is draining (a preemption notice, an autoscaler
  scale-down, :func:`drain_node`): ``{node id: deadline}`` in ms since the
  epoch (0: none), from the GCS."""
  from ray._raylet import GcsClient
  address = _ray.get_runtime_context().gcs_address
  if _gcs.get("address") != address:
    _gcs.update(address=address, client=GcsClient(address=address))
  return {(k.hex() if hasattr(k, "hex") and not isinstance(k, str) else
           str(k)): int(v)
          for k, v in _gcs["client"].get_draining_nodes(timeout=30).items()}


def drain_node(node_id: str, deadline_s: float | None = 60.0,
               reason: str = "preemption", message: str = "") -> int:
  """Asks Ray's GCS to drain node ``node_id`` as its autoscaler does
  (``reason``: ``preemption`` or ``idle``), the node to be gone in
  ``deadline_s`` seconds (``None``: no deadline); Ray stops placing work on
  it and a running :func:`run` moves its workers off it in time (it does
  not kill the node: whoever drains it does, after the deadline). Returns
  the deadline in ms since the epoch (0: none)."""
  from ray._raylet import GcsClient
  from ray.core.generated import autoscaler_pb2
  kinds = {"preemption": "DRAIN_NODE_REASON_PREEMPTION",
           "idle": "DRAIN_NODE_REASON_IDLE_TERMINATION"}
  if reason not in kinds:
    raise UsageError(f"drain_node: reason must be one of {sorted(kinds)},"
                     f" got {reason!r}")
  deadline = 0 if deadline_s is None else int(
      (time.time() + float(deadline_s)) * 1000)
  client = GcsClient(address=_ray.get_runtime_context().gcs_address)
  ok, why = client.drain_node(
      node_id, autoscaler_pb2.DrainNodeReason.Value(kinds[reason]),
      message or "tenplex_jax.ray.drain_node", deadline)
  if not ok:
    raise StoreError(f"Ray refused to drain node {node_id}: {why}")
  return deadline


def _alive_cpu_nodes() -> list[str]:
  return [n["NodeID"] for n in _ray.nodes()
          if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]


class Job:
  """An elastic job on the connected Ray cluster (see :func:`run`)."""

  def __init__(self, train: str | Callable, args: Sequence[str] = (), *,
               num_workers: int | tuple[int, int],
               devices_per_worker: int = 1,
               worker_resources: Mapping[str, float] | None = None,
               schedule: Mapping[int, int] | None = None,
               max_restarts: int = 3, replicas: int = 0,
               checkpoint: str | None = None, run_config: Any = None,
               store_root: str = "/dev/shm",
               job: str | None = None, keep_stores: bool = False,
               start_timeout: float = 120.0,
               env: Mapping[str, str] | None = None,
               on_progress: Callable[[Job, int], None] | None = None,
               tls_cert: str | None = None, tls_key: str | None = None,
               tls_ca: str | None = None, standby: bool | int = True,
               standby_imports: Sequence[str] | None = None,
               standby_timeout: float = 300.0,
               compilation_cache: bool | str = True, prepare: bool = True,
               prepare_timeout: float | None = None,
               free_arrays: bool = True, allocate_ahead: bool = True):
    if not _ray.is_initialized():
      raise UsageError("tenplex_jax.ray.run: call ray.init(address=...)"
                       " first")
    self.auto = isinstance(num_workers, (tuple, list))
    lo, hi = (tuple(num_workers) + (0, 0))[:2] if self.auto else (
        num_workers, num_workers)
    if self.auto and len(num_workers) != 2 or not 1 <= int(lo) <= int(hi):
      raise UsageError(f"num_workers must be n >= 1 or (min, max) with"
                       f" 1 <= min <= max, got {num_workers!r}")
    self.bounds = (int(lo), int(hi))
    if prepare_timeout is not None and not prepare_timeout > 0:
      raise UsageError(f"prepare_timeout must be positive seconds, not"
                       f" {prepare_timeout!r}")
    if not standby_timeout > 0:
      raise UsageError(f"standby_timeout must be positive seconds, not"
                       f" {standby_timeout!r}")
    # What each worker asks Ray for (its CPU, and e.g. a GPU): the unit the
    # auto-resize counts on the alive nodes.
    self.worker_resources = {"CPU": 1.0, **{
        str(k): float(v) for k, v in (worker_resources or {}).items()}}
    bad = {k: v for k, v in self.worker_resources.items() if v < 0}
    if bad or not any(v > 0 for v in self.worker_resources.values()):
      raise UsageError(f"worker_resources must be amounts >= 0, one of them"
                       f" > 0, got {self.worker_resources}")
    self.train, self.args = train, list(args)
    self.n, self.devices = int(lo), int(devices_per_worker)
    self.schedule = dict(schedule or {})
    self.max_restarts, self.replicas = max_restarts, replicas
    self.job = job or f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if checkpoint is None and run_config is not None:
      checkpoint = checkpoint_dir(run_config, self.job)
    self.checkpoint, self.store_root = checkpoint, store_root
    self.keep_stores, self.start_timeout = keep_stores, start_timeout
    self.token = resolve_token() or new_token()
    self.tls, ca = check_tls_options(tls_cert, tls_key, tls_ca,
                                     "tenplex_jax.ray",
                                     ("tls_cert", "tls_key", "tls_ca"))
    self.env = {**_storage_env(self.checkpoint),
                **({CA_ENV: ca} if ca else {}), **dict(env or {})}
    self.on_progress = on_progress
    self.ctrl = _Controller.options(  # on the driver's node: it outlives
        # any other node leaving
        name=f"tenplex-ctrl-{self.job}", namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            _ray.get_runtime_context().get_node_id(), soft=False)).remote()
    self.generations: list[dict] = []
    self.current: dict = {}  # the running group's record (its "nodes")
    self.excluded: set[str] = set()  # nodes that stopped answering
    self.draining: dict[str, int] = {}  # node: deadline (ms), from Ray
    # Standby workers: per node, [(actor, its prepare() ref, created)].
    # Only for workers that ask Ray for CPUs alone (a standby holds no Ray
    # resources, so Ray would give it no GPU).
    self.standby = standby
    self.standby_imports = tuple(STANDBY_IMPORTS if standby_imports is None
                                 else standby_imports)
    self._standbys: dict[str, list[tuple[Any, Any, float]]] = {}
    # Seconds a standby may take from its creation to its imports' end;
    # past it, it is killed and replaced (:meth:`_drop_failed_standbys`).
    self.standby_timeout = float(standby_timeout)
    self.late_standbys: list[dict] = []  # those killed for it
    # The last ping sent to each ready standby, by its prepare() ref.
    self._pings: dict[Any, Any] = {}
    # standbys to keep: the largest group so far (or scheduled)
    self._most = max([self.n, *map(int, self.schedule.values())])
    self._store_nodes: set[str] = set()  # whose store answered last
    self._store_seen: set[str] = set()  # whose store ever answered
    # store actors started ahead on nodes that joined: node -> info() ref
    self._store_pending: dict[str, Any] = {}
    self.compilation_cache = compilation_cache
    # The next group started ahead of a known resize (standbys handed their
    # ranks, waiting for the turn in their restore): {"n", "start",
    # "group": _start_group's answer}.
    self.prepare = bool(prepare)
    # Seconds a group started ahead may take to get ready (every worker
    # waiting at its turn), from its start; past it, not ready: dropped.
    self.prepare_timeout = float(_PREPARE_TIMEOUT if prepare_timeout is None
                                 else prepare_timeout)
    self._given_up: set[int] = set()  # running groups whose prepared one
    # was dropped (not prepared again for them)
    self.free_arrays = bool(free_arrays)
    self.allocate_ahead = bool(allocate_ahead)
    self._next: dict | None = None
    self._expect: int | None = None  # prepare_next's size

  def request_resize(self, procs: int) -> int:
    """Asks the running group to resize to ``procs`` workers; returns the
    step at which it will (a few steps past the furthest worker). With
    ``num_workers=(min, max)``, ``procs`` also becomes the new maximum (the
    job no longer grows past it with the cluster)."""
    if self.auto:
      self.bounds = (min(self.bounds[0], int(procs)), int(procs))
    at = _ray.get(self.ctrl.request_resize.remote(int(procs)))
    self._most = max(self._most, int(procs))
    if self._standby_ok():
      self._fill_standbys()  # the next group's, if it is larger
      self._maybe_prepare()  # started now if its standbys are ready
    return at

  def slots(self, resources: Mapping[str, float]) -> int:
    """Workers a node with ``resources`` (Ray's totals) holds: its count of
    each resource a worker asks for (``worker_resources``: one CPU, and
    e.g. ``{"GPU": 1}``), divided by the ask, the least of them."""
    return min(int(resources.get(k, 0) // v + 1e-9)
               for k, v in self.worker_resources.items() if v > 0)

  def capacity(self) -> int:
    """Workers the cluster has room for now: :meth:`slots` summed over the
    alive nodes that have not stopped answering and are not draining."""
    return sum(self.slots(n["Resources"]) for n in _ray.nodes()
               if n["Alive"] and n["NodeID"] not in self.excluded
               and n["NodeID"] not in self.draining)

  def _target(self) -> int:
    lo, hi = self.bounds
    return max(lo, min(hi, self.capacity()))

  def _autoscale(self, n: int) -> None:
    """With ``num_workers=(min, max)``: resizes the running group of ``n``
    workers to the cluster's capacity within the bounds, once per group."""
    try:
      self.draining = draining_nodes()
    except Exception:  # noqa: BLE001 - the GCS is busy: the next poll
      pass
    drained = sorted(set(self.current.get("nodes", ())) & set(self.draining))
    if drained and not self.current.get("drain"):
      # A planned leave: save to the stores and go on without those nodes
      # (no failure, no step lost), before the deadline; a group prepared
      # for another resize goes.
      self._drop_next()
      m = self._target() if self.auto else min(n, self.capacity())
      at = _ray.get(self.ctrl.request_resize.remote(max(1, m), True))
      self.current["drain"] = {
          "nodes": drained, "workers": max(1, m), "step": at,
          "seen": time.time(),
          "deadline_ms": max(self.draining[x] for x in drained)}
      if self._standby_ok():
        self._fill_standbys()  # none on the draining nodes
      return
    if not self.auto or self.current.get("auto_request") or self.current.get(
        "drain"):
      return
    m = self._target()
    st = _ray.get(self.ctrl.state.remote())
    if m != n and st["request"] is None and st["progress"]:
      at = _ray.get(self.ctrl.request_resize.remote(m))
      self.current["auto_request"] = {"workers": m, "step": at}
      if self._standby_ok():
        self._fill_standbys()  # on a node that joined, say

  def _standby_ok(self) -> bool:
    return bool(self.standby) and set(self.worker_resources) == {"CPU"}

  def _worker_env(self) -> dict[str, str]:
    """A worker actor's process environment (Ray's ``runtime_env``): the
    token, no inherited ``XLA_FLAGS``, and the job's ``JAX_*`` variables,
    which jax reads when it is imported (a standby imports it before
    :meth:`_Worker.run` hands it the rest of the environment)."""
    return {TOKEN_ENV: self.token, "XLA_FLAGS": "",
            **{k: v for k, v in self.env.items() if k.startswith("JAX_")}}

  def _fill_standbys(self) -> None:
    """Keeps standby workers started (0 CPUs: they cost memory only),
    ``max(largest group so far, the auto-resize's target)`` of them, round
    robin over the alive nodes with room whose store answered (one per
    worker slot at most), none on draining or lost nodes; drops the dead
    ones and those on nodes that left. Does not wait for them. Not while
    a group prepared ahead waits for its turn (its standbys are taken; the
    replacements come after its first step). Those that died or are not
    ready within ``standby_timeout`` are dropped first, also then
    (:meth:`_drop_failed_standbys`)."""
    self._drop_failed_standbys()
    if self._next is not None:
      return
    room = {x["NodeID"]: self.slots(x["Resources"]) for x in _ray.nodes()
            if x["Alive"] and x["NodeID"] not in self.excluded
            and x["NodeID"] not in self.draining}
    # Only on nodes whose store actor has answered: on a node that has just
    # joined, a standby's imports would hold up its store's start.
    room = {k: v for k, v in room.items() if v > 0 and k in self._store_nodes}
    for node in [x for x in self._standbys if x not in room]:
      for a, _, _ in self._standbys.pop(node):
        _ray.kill(a, no_restart=True)
    want = max(self._most, self._target() if self.auto else 0,
               0 if isinstance(self.standby, bool) else int(self.standby))
    nodes = sorted(room)
    slots = [x for r in range(max(room.values(), default=0))
             for x in nodes if room[x] > r][:want]
    for node in nodes:
      have = self._standbys.setdefault(node, [])
      for _ in range(slots.count(node) - len(have)):
        a = _Worker.options(
            num_cpus=0, runtime_env={"env_vars": self._worker_env()},
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote()
        have.append((a, a.prepare.remote(self.standby_imports), time.time()))

  def _drop_failed_standbys(self) -> None:
    """Kills and drops the standbys that would not serve: those whose
    imports are not done ``standby_timeout`` seconds after their creation
    (their imports hang, or their process never started; each named on
    stderr and in :attr:`late_standbys`), and those that died: their
    imports failed, or, once ready, a ping came back with an error (each
    call pings the ready ones whose last ping answered, so a death is
    seen at the next call but one). The next :meth:`_fill_standbys`
    replaces them."""
    now = time.time()
    for node, lst in self._standbys.items():
      for item in list(lst):
        a, ref, t = item
        if _ray.wait([ref], timeout=0)[0]:
          if not self._answers(a, ref):
            lst.remove(item)
            _ray.kill(a, no_restart=True)
        elif now - t > self.standby_timeout:
          lst.remove(item)
          self._late(node, a, t, "starting another")
    kept = {ref for lst in self._standbys.values() for _, ref, _ in lst}
    self._pings = {k: v for k, v in self._pings.items() if k in kept}

  def _answers(self, actor: Any, ref: Any) -> bool:
    """Whether the ready standby ``actor`` (``ref``: its ``prepare``) lives
    as far as the driver knows: its imports ended without an error and so
    did its last ping, if it came back (then the next one is sent)."""
    try:
      _ray.get(ref)
    except _ray.exceptions.RayError:
      return False
    if self._pinged_dead(ref):
      return False
    ping = self._pings.get(ref)
    if ping is None or _ray.wait([ping], timeout=0)[0]:  # (else not answered
      self._pings[ref] = actor.ping.remote()  # yet: no second ping)
    return True

  def _pinged_dead(self, ref: Any) -> bool:
    """Whether the last ping to the ready standby of ``ref`` came back with
    an error (its process died)."""
    ping = self._pings.get(ref)
    if ping is None or not _ray.wait([ping], timeout=0)[0]:
      return False
    try:
      _ray.get(ping)
    except _ray.exceptions.RayError:
      return True
    return False

  def _late(self, node: str, actor: Any, created: float, then: str) -> None:
    """Kills ``actor``, a standby on ``node`` not ready within the standby
    timeout, and says so (:attr:`late_standbys`, stderr)."""
    waited = time.time() - created
    _ray.kill(actor, no_restart=True)
    self.late_standbys.append({"node": node, "waited_s": waited})
    print(f"tenplex_jax.ray: job {self.job}: a standby worker on node"
          f" {node} not ready {waited:.1f} s after its start (standby"
          f" timeout {self.standby_timeout:g} s): killed it, {then}",
          file=sys.stderr, flush=True)

  def standbys(self) -> list[dict]:
    """The standby workers kept now: per worker its ``node`` and, once its
    imports are done, its ``pid`` and ``ready`` (seconds since the epoch;
    ``None`` while it imports); those of the group prepared ahead
    (:meth:`prepare_next`) also with ``prepared`` and ``waiting`` (it
    reached its restore and waits for its turn)."""
    out = []
    for node, lst in self._standbys.items():
      for _, ref, _ in lst:
        info = {"node": node, "pid": None, "ready": None}
        if _ray.wait([ref], timeout=0)[0]:
          try:
            info.update(_ray.get(ref))
          except _ray.exceptions.RayError:
            continue  # dead: replaced at the next fill
          if self._pinged_dead(ref):
            continue
        out.append(info)
    if self._next is not None:  # the group prepared ahead: theirs too
      rec = self._next["group"][0]
      waiting = set(_ray.get(self.ctrl.waiting_ranks.remote(
          rec["generation"])))
      for i, (node, pid, r) in enumerate(zip(
          rec["nodes"], rec["standby_pids"], rec["standby_ready_s"])):
        out.append({"node": node, "pid": pid, "ready": rec["t0"] + r,
                    "prepared": True, "waiting": i in waiting})
    return out

  def drop_standbys(self) -> None:
    """Ends every standby worker (at the job's end; with ``standby`` off
    the ones kept stay for a later group that turns it on again)."""
    for lst in self._standbys.values():
      for a, _, _ in lst:
        _ray.kill(a, no_restart=True)
    self._standbys.clear()

  def _fresh_worker(self, node: str):
    ask = dict(self.worker_resources)
    ask_cpu, ask_gpu = ask.pop("CPU"), ask.pop("GPU", 0)
    return _Worker.options(
        num_cpus=ask_cpu, num_gpus=ask_gpu, resources=ask or None,
        runtime_env={"env_vars": self._worker_env()},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    ).remote()

  def _cache_env(self, store_dir: str) -> dict[str, str]:
    """A worker's jax persistent compilation cache: ``compilation_cache``
    (a directory) or, with ``True``, ``xla`` beside its node's store
    directory; nothing with ``False``."""
    if not self.compilation_cache:
      return {}
    path = (self.compilation_cache if isinstance(self.compilation_cache, str)
            else os.path.join(os.path.dirname(store_dir), _CACHE_DIR))
    return {"JAX_COMPILATION_CACHE_DIR": path,
            # every executable, however fast it compiled or small it is
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}

  def _start_stores(self) -> dict[str, Any]:
    """One store actor per alive node not left out (existing ones found by
    name, new ones started, not waited for; none started on a draining
    node); e.g. as soon as a node joins, so that its store is up before
    the resize onto it."""
    out = {}
    for node in [x for x in _alive_cpu_nodes() if x not in self.excluded]:
      name = store_actor_name(self.job, node)
      try:
        actor = _ray.get_actor(name, namespace=NAMESPACE)
      except ValueError:
        if node in self.draining:
          continue  # Ray places nothing new there
        actor = _StoreActor.options(
            name=name, namespace=NAMESPACE, lifetime="detached",
            get_if_exists=True,
            runtime_env={"env_vars": {TOKEN_ENV: self.token}},
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote(
                    os.path.join(self.store_root,
                                 f"tenplex-ray-{self.job}", node[:16]),
                    self.tls)
      out[node] = actor
    return out

  def _stores(self) -> dict[str, dict]:
    """One store actor per alive node (:meth:`_start_stores`), each one's
    ``info`` once it answers. A store that answered before gets 30 s (its
    node may have died without Ray knowing yet: the restore skips it); one
    that never answered (a node that has just joined, whose store actor's
    process starts slowly on a loaded host) gets ``start_timeout`` seconds
    while Ray lists its node alive: a group sized on the nodes whose store
    answered would leave the joined node out."""
    actors = self._start_stores()
    refs = {node: actor.info.remote() for node, actor in actors.items()}
    infos: dict[str, dict] = {}
    t0 = time.monotonic()
    while refs:
      done, _ = _ray.wait(list(refs.values()), num_returns=len(refs),
                          timeout=1.0)
      for node in [k for k, r in refs.items() if r in done]:
        try:
          infos[node] = _ray.get(refs.pop(node))
        except _ray.exceptions.RayError:
          pass  # its node is going away: the restore skips it
      waited = time.monotonic() - t0
      if refs and waited > 30.0:
        alive = set(_alive_cpu_nodes())
        for node in list(refs):
          if (node in self._store_seen or node not in alive
              or waited > self.start_timeout):
            del refs[node]
    self._store_nodes = set(infos)
    self._store_seen |= self._store_nodes
    self._store_pending = {k: v for k, v in self._store_pending.items()
                           if k not in infos}
    return infos

  def _watch_nodes(self, fill: bool) -> None:
    """In the driver's poll: starts the store actor of a node that joined
    as soon as Ray lists it (so the resize onto it does not wait for the
    store's process to start) and, once that store answers, with ``fill``
    (the group has run its first step), the standbys there."""
    alive = (set(_alive_cpu_nodes()) - self.excluded - set(self.draining)
             - self._store_seen - set(self._store_pending))
    if alive:
      actors = self._start_stores()
      for node in alive & set(actors):
        self._store_pending[node] = actors[node].info.remote()
    if not self._store_pending:
      return
    done, _ = _ray.wait(list(self._store_pending.values()),
                        num_returns=len(self._store_pending), timeout=0)
    answered = False
    for node in [k for k, r in self._store_pending.items() if r in done]:
      try:
        _ray.get(self._store_pending.pop(node))
      except _ray.exceptions.RayError:
        continue  # started again at the next poll if still alive
      self._store_nodes.add(node)
      self._store_seen.add(node)
      answered = True
    if answered and fill and self._standby_ok():
      self._fill_standbys()

  def _start_group(self, gen: int, n: int, start: int, failed: int | None,
                   prepared: bool = False) -> tuple[dict, list, list] | None:
    """Places generation ``gen``'s ``n`` workers (standbys where there
    are, fresh actors elsewhere), hands them their ranks and starts the
    script in them; returns ``(record, workers, run refs)``. ``prepared``:
    ahead of the running group's resize to ``n`` workers (expected at
    step ``start``; the turn gives the step it came at), from ready
    standbys only (else ``None``, nothing taken): the script runs up to
    its restore and waits there for its turn."""
    t0 = time.time()
    deadline = time.monotonic() + 120
    while True:
      stores = self._stores()  # a draining node's serves its shards
      nodes = [x for x in stores if x not in self.draining]
      if not nodes:
        if prepared:
          return None
        raise StoreError("no alive Ray node with a CPU for the workers"
                         f" (draining: {sorted(self.draining)})")
      room = {x["NodeID"]: self.slots(x["Resources"])
              for x in _ray.nodes() if x["Alive"]}
      if any(room.get(x, 0) > 0 for x in nodes):
        break
      # The nodes with room have not answered yet (a node that has just
      # joined starts its store actor first): ask again, for a while.
      if prepared:
        return None
      if time.monotonic() > deadline:
        raise StoreError(
            "no alive Ray node whose store answers has room for a worker"
            f" asking {dict(self.worker_resources)}: nodes with room"
            f" {sorted(k for k, v in room.items() if v > 0)}, answering"
            f" {sorted(nodes)} (draining: {sorted(self.draining)})")
      time.sleep(1.0)
    nodes = [x for x in nodes if room.get(x, 0) > 0]
    if prepared:  # the nodes with the most ready standbys first
      nodes.sort(key=lambda x: -sum(
          1 for _, ref, _ in self._standbys.get(x, [])
          if _ray.wait([ref], timeout=0)[0]))
    fits = sum(room.get(x, 1) for x in nodes)
    if self.auto and self.bounds[0] <= fits < n:
      if prepared:
        return None
      # Ray still lists a node killed moments ago, whose store did not
      # answer: as many workers as the answering nodes hold.
      n = fits
    slots = [x for r in range(max(room.get(x, 1) for x in nodes))
             for x in nodes if room.get(x, 1) > r]  # round robin
    placement = [slots[i % len(slots)] for i in range(n)]
    if prepared:  # every worker a standby whose imports are done
      need = {x: placement.count(x) for x in set(placement)}
      for node, k in need.items():
        pool = self._standbys.get(node, [])
        if sum(1 for _, ref, _ in pool
               if _ray.wait([ref], timeout=0)[0]) < k:
          return None
    else:
      self._most = max(self._most, n)
      if self._standby_ok():
        self._fill_standbys()
    # Standby workers where there are (started ahead; those with their
    # imports done first, then the one that started first), fresh actors
    # elsewhere.
    workers, kinds, ready, created = [], [], [], []
    for node in placement:
      pool = self._standbys.get(node) if self._standby_ok() else None
      if pool:
        pool.sort(key=lambda x: (not _ray.wait([x[1]], timeout=0)[0], x[2]))
        a, ref, t = pool.pop(0)
        workers.append(a)
        kinds.append("standby")
        ready.append(ref)
        created.append(t)
      else:
        workers.append(self._fresh_worker(node))
        kinds.append("fresh")
        ready.append(None)
        created.append(None)
    rec = {"generation": gen, "workers": n, "start_step": start,
           "failed_step": failed, "nodes": placement, "t0": t0,
           "prepared": prepared}
    if not prepared:
      self.current = rec
    try:
      refs = [w.address.remote() for w in workers]
      addrs = []
      for i, ref in enumerate(refs):
        try:
          if kinds[i] == "standby":  # (its imports end within its timeout)
            left = created[i] + self.standby_timeout - time.time()
            if not _ray.wait([ready[i]], timeout=max(0.0, left))[0]:
              self._late(placement[i], workers[i], created[i],
                         "starting a fresh worker instead")
              raise TimeoutError("a standby not ready in time")
          addrs.append(_ray.get(ref, timeout=self.start_timeout))
        except (_ray.exceptions.RayError, TimeoutError):
          if kinds[i] != "standby":
            raise
          # A standby that died (its node, or a crash), or whose imports
          # did not end within its standby timeout: a fresh one.
          _ray.kill(workers[i], no_restart=True)
          workers[i] = self._fresh_worker(placement[i])
          kinds[i], ready[i] = "fresh", None
          addrs.append(_ray.get(workers[i].address.remote(),
                                timeout=self.start_timeout))
      rec["standby"] = kinds.count("standby")
      # When each standby's imports were done (s since t0; < 0: before the
      # resize began).
      rec["standby_ready_s"] = [
          None if r is None else _ray.get(r)["ready"] - t0 for r in ready]
      rec["standby_pids"] = [None if r is None else _ray.get(r)["pid"]
                             for r in ready]
      if prepared:
        _ray.get(self.ctrl.prepare.remote(gen, n, self.schedule))
      else:
        _ray.get(self.ctrl.new_generation.remote(n, start, self.schedule,
                                                 gen))
      urls = [stores[a[2]]["url"] for a in addrs]
      peers = sorted({s["url"] for s in stores.values()})
      base = {
          "TENPLEX_RAY_JOB": self.job,
          "TENPLEX_RAY_CONTROLLER": f"tenplex-ctrl-{self.job}",
          "TENPLEX_COORDINATOR": f"{addrs[0][0]}:{addrs[0][1]}",
          "TENPLEX_NUM_PROCS": str(n),
          "TENPLEX_DEVICES": str(self.devices),
          "TENPLEX_STORES": json.dumps(urls),
          "TENPLEX_PEERS": json.dumps(peers),
          "TENPLEX_GENERATION": str(gen),
          "TENPLEX_RUN": f"{self.job}-g{gen}",
          "TENPLEX_START_STEP": str(start),
          "TENPLEX_REPLICAS": str(self.replicas),
          TOKEN_ENV: self.token, **self.env}
      if self.checkpoint:
        base["TENPLEX_CHECKPOINT"] = self.checkpoint
      if failed is not None:
        base["TENPLEX_FAILED_STEP"] = str(failed)
      if self.compilation_cache:
        base["TENPLEX_COMPILATION_CACHE"] = "1"
      if prepared:  # restore_or_init waits for the controller's turn
        base["TENPLEX_TURN_FILE"] = "ray"
      if self.free_arrays:
        base["TENPLEX_RAY_FREE_ARRAYS"] = "1"
      if prepared and self.allocate_ahead:  # arrays held until the turn
        base["TENPLEX_ALLOCATE_AHEAD"] = "1"
      rec["started_s"] = time.time() - t0
      refs = [w.run.remote(self.train, self.args, {
          **base, "TENPLEX_PROC_ID": str(i),
          "TENPLEX_STORE": stores[addrs[i][2]]["dir"],
          **self._cache_env(stores[addrs[i][2]]["dir"])})
          for i, w in enumerate(workers)]
    except BaseException:
      for w in workers:
        _ray.kill(w, no_restart=True)
      if prepared:
        _ray.get(self.ctrl.prepare.remote(None))
      raise
    return rec, workers, refs

  def prepare_next(self, procs: int) -> bool:
    """Starts the next group, of ``procs`` workers, ahead of the resize to
    that size (whenever it comes: a request, the schedule, the node
    table), from the standbys whose imports are done: they get their
    ranks now, start ``jax.distributed`` and run the script up to its
    restore (e.g. compiling the step from the restore's target), and
    restore once the running group has saved. Needs ``prepare`` and
    standbys; returns whether such a group waits now (``False``: not
    enough ready standbys yet; the driver tries again at its polls while
    this size stays the expected one). A resize to another size, a drain
    or a failure ends the prepared group unused."""
    self._expect = int(procs)
    self._maybe_prepare()
    return self._next is not None and self._next["n"] == int(procs)

  def _maybe_prepare(self) -> None:
    """With ``prepare``: once the running group's next size is known (a
    request or the schedule, not a drain's move; else
    :meth:`prepare_next`'s) and standbys with their imports done are there
    for every worker of it, starts that group ahead
    (:meth:`_start_group`'s ``prepared``)."""
    cur = self.current
    if (not self.prepare or not self._standby_ok() or self._next is not None
        or "generation" not in cur or cur.get("outcome")
        or cur["generation"] in self._given_up):
      return
    gen, n, start = cur["generation"], cur["workers"], cur["start_step"]
    st = _ray.get(self.ctrl.state.remote(gen))
    furthest = max([start, *st["progress"].values()])
    plans = [(s, m) for s, m in self.schedule.items()
             if s > start and s > furthest and m != n]
    req = st["request"]
    if req and not req[2] and req[0] != n and req[1] > furthest:
      plans.append((req[1], req[0]))
    if plans:
      at, m = min(plans, key=lambda p: p[0])  # the schedule's first on a tie
    elif self._expect is not None and self._expect != n:
      at, m = furthest + _MARGIN, self._expect
    else:
      return
    if self.auto and not self.bounds[0] <= m <= self.bounds[1]:
      return
    ready = sum(1 for lst in self._standbys.values() for _, ref, _ in lst
                if _ray.wait([ref], timeout=0)[0])
    if ready < m:  # (checked per node in _start_group)
      return
    try:
      got = self._start_group(gen + 1, m, at, None, prepared=True)
    except (_ray.exceptions.RayError, TimeoutError):
      return  # (a standby died on the way: the resize starts the group)
    if got is not None:
      self._next = {"n": m, "group": got}

  def _not_ready(self, nxt: dict) -> list[int]:
    """The workers of the group prepared ahead ``nxt`` that have not
    reached their turn's wait yet, by rank."""
    rec = nxt["group"][0]
    if nxt.get("ready"):
      return []
    waiting = set(_ray.get(self.ctrl.waiting_ranks.remote(rec["generation"])))
    late = [i for i in range(rec["workers"]) if i not in waiting]
    nxt["ready"] = not late
    return late

  def _overdue(self, nxt: dict) -> list[int]:
    """The workers of ``nxt`` not ready (:meth:`_not_ready`) once the group
    is past its prepare timeout or one of its workers ended (a worker not
    ready then never will be); else ``[]``."""
    rec, _, refs = nxt["group"]
    if (time.time() - rec["t0"] <= self.prepare_timeout
        and not _ray.wait(refs, num_returns=1, timeout=0)[0]):
      return []
    return self._not_ready(nxt)

  def _give_up(self, nxt: dict, late: list[int], at_turn: bool) -> dict:
    """Drops the group prepared ahead ``nxt`` (its workers ``late`` not
    ready in time), says so on stderr and returns what happened; its
    resize starts its workers as without it."""
    rec, workers, refs = nxt["group"]
    ended = [i for i, r in enumerate(refs) if _ray.wait([r], timeout=0)[0]]
    waited = time.time() - rec["t0"]
    what = (f"tenplex_jax.ray: job {self.job}: the group prepared ahead for"
            f" the resize to {rec['workers']} workers (generation"
            f" {rec['generation']}) not ready {waited:.1f} s after its start"
            f" (prepare timeout {self.prepare_timeout:g} s; workers not"
            f" waiting at their turn: {late}"
            + (f", ended: {ended}" if ended else "") + ")")
    then = ("its turn came: starting its workers as without it" if at_turn
            else "its resize starts its workers as without it")
    print(f"{what}; dropped it, {then}", file=sys.stderr, flush=True)
    for w in workers:
      _ray.kill(w, no_restart=True)
    if at_turn:
      _ray.get(self.ctrl.withdraw.remote(rec["generation"]))
    else:
      self._next = None
      try:
        _ray.get(self.ctrl.prepare.remote(None))
      except _ray.exceptions.RayError:
        pass
    return {"generation": rec["generation"], "workers": rec["workers"],
            "pids": rec["standby_pids"], "not_ready": late, "ended": ended,
            "waited_s": waited, "at_turn": at_turn}

  def _guard_next(self) -> None:
    """In the driver's poll: drops the group prepared ahead once it is past
    its prepare timeout and not ready, or one of its workers ended (it is
    not prepared again for the running group)."""
    nxt, cur = self._next, self.current
    if nxt is None:
      return
    late = self._overdue(nxt)
    if late:
      cur.setdefault("dropped_prepared", []).append(
          self._give_up(nxt, late, at_turn=False))
      self._given_up.add(cur["generation"])

  def _await_ready(self, nxt: dict) -> list[int]:
    """At its turn: waits until every worker of the group prepared ahead
    ``nxt`` is ready, up to its prepare timeout; returns those not ready
    then (``[]``: ready)."""
    while True:
      late = self._not_ready(nxt)
      if not late or self._overdue(nxt):
        return late
      time.sleep(0.02)

  def _drop_next(self) -> None:
    """Ends the group prepared ahead (its resize did not come)."""
    nxt, self._next = self._next, None
    if nxt is None:
      return
    try:
      _ray.get(self.ctrl.prepare.remote(None))
    except _ray.exceptions.RayError:
      pass
    for w in nxt["group"][1]:
      _ray.kill(w, no_restart=True)

  def _generation(self, n: int, start: int, failed: int | None) -> dict:
    gen = len(self.generations)
    nxt, dropped = self._next, None
    if nxt is not None and failed is None and nxt["n"] == n and (
        nxt["group"][0]["generation"] == gen):
      self._next = None
      self._expect = None
      # Its turn (given by the controller at the last save already, unless
      # a worker's word did not arrive); taken back if the group is not
      # ready within its prepare timeout (e.g. a hang in its start).
      _ray.get(self.ctrl.give_turn.remote(gen, start))
      late = self._await_ready(nxt)
      if late:
        dropped, nxt = self._give_up(nxt, late, at_turn=True), None
    else:
      nxt = None
    if nxt is not None:
      rec, workers, refs = nxt["group"]
      rec["start_step"] = start
      self.current = rec
    else:
      self._drop_next()
      self._expect = None
      rec, workers, refs = self._start_group(gen, n, start, failed)
      if dropped is not None:
        rec["dropped_prepared"] = [dropped]
    t0 = rec["t0"]
    try:
      results, error = [None] * n, None
      pending = list(refs)
      refilled, checked = False, time.monotonic()
      while pending:
        done, pending = _ray.wait(pending, num_returns=1, timeout=0.5)
        if not done:
          if not refilled and self._standby_ok() and _ray.get(
              self.ctrl.state.remote(gen))["first_poll"] is not None:
            # The group has run its first step: start the standbys of the
            # next one now (not during this group's start on its cores).
            self._fill_standbys()
            refilled, checked = True, time.monotonic()
          elif (refilled and self._standby_ok()
                and time.monotonic() - checked > _STANDBY_CHECK_S):
            # A standby that died since (its process, or its start on a
            # loaded node) is replaced now, not at the next resize.
            self._fill_standbys()
            checked = time.monotonic()
          self._watch_nodes(refilled)
          self._autoscale(n)
          self._guard_next()
          self._maybe_prepare()
          if self.on_progress is not None:
            st = _ray.get(self.ctrl.state.remote(gen))
            self.on_progress(self, max(st["progress"].values(),
                                       default=start))
          continue
        try:
          results[refs.index(done[0])] = _ray.get(done[0])
        except _ray.exceptions.RayError as e:
          error = e
          break
      st = _ray.get(self.ctrl.state.remote(gen))
      rec["pids"] = [r["pid"] for r in results if r is not None]
      rec["first_step_s"] = (st["first_poll"] - t0 if st["first_poll"]
                             else None)
      rec["progress"] = max(st["progress"].values(), default=start)
      rec["end_s"] = time.time() - t0
      if error is not None:
        lines = [x for x in str(error).splitlines() if x.strip()]
        rec.update(outcome="failed", error=f"{type(error).__name__}:"
                   f" {lines[-1] if lines else ''}")
        if st["restored"] is not None:  # worker 0 reported it at its step
          rec["restored"] = st["restored"]
          if failed is not None and rec["restored"]:
            rec["start_step"] = rec["restored"]["step"]
      else:
        rec["results"] = results
        kinds = {r["outcome"] for r in results}
        if len(kinds) != 1 or (
            "resize" in kinds and len({(r["procs"], r["step"])
                                       for r in results}) != 1):
          raise StoreError(f"generation {gen}: the workers disagree: "
                           f"{results}")
        rec["outcome"] = results[0]["outcome"]
        rec["restored"] = results[0]["restored"]
        if failed is not None and rec["restored"]:
          rec["start_step"] = rec["restored"]["step"]  # what the restore chose
        if rec["outcome"] == "resize":
          rec.update(step=results[0]["step"], next_workers=results[0]["procs"])
    finally:
      t1 = time.time()
      for w in workers:
        _ray.kill(w)
      rec["teardown_s"] = time.time() - t1
    self.generations.append(rec)
    return rec

  def run(self) -> dict:
    """Runs generations until the script finishes; returns the record."""
    n, start, failed, restarts = self.n, 0, None, 0
    if self.auto:
      n = self._target()
    try:
      while True:
        rec = self._generation(n, start, failed)
        if rec["outcome"] == "done":
          break
        if rec["outcome"] == "resize":
          n, start, failed = rec["next_workers"], rec["step"], None
          continue
        restarts += 1
        if restarts > self.max_restarts:
          raise StoreError(f"job {self.job}: generation {rec['generation']}"
                           f" failed ({rec['error']}) and {self.max_restarts}"
                           " restarts are spent")
        failed = rec["progress"]
        start = 0  # the restore decides the step
        self.excluded |= {x for x in set(rec["nodes"]) if not _responds(x)}
        n = (self._target() if self.auto else
             min(n, len(set(_alive_cpu_nodes()) - self.excluded)) or 1)
      return {"job": self.job, "generations": self.generations}
    finally:
      self._drop_next()
      self.drop_standbys()
      _ray.kill(self.ctrl)
      if not self.keep_stores:
        cleanup_stores(self.job)


def checkpoint_dir(run_config: Any, job: str) -> str:
  """The persistent checkpoint directory of a Ray ``RunConfig``:
  ``<storage_path>/<name>`` (defaults: ``~/ray_results``, and the name
  Ray's ``RunConfig`` gives, else the job's), where the script's
  ``store.save_checkpoint(info["checkpoint"], state, step)`` writes its
  checkpoints and the last restore fallback reads them. ``storage_path`` may be ``s3://BUCKET/PREFIX`` or
  ``gs://BUCKET/PREFIX``: a multi-process group then saves a tenplex store
  there, each worker its own shards (``tenplex_jax.store.save_checkpoint``),
  read back by any later group on any nodes.

  Example:
    >>> from ray.train import RunConfig
    >>> checkpoint_dir(RunConfig(storage_path="/mnt/ckpt", name="lm"), "j")
    '/mnt/ckpt/lm'
    >>> checkpoint_dir(RunConfig(storage_path="s3://b/runs/", name="lm"), "j")
    's3://b/runs/lm'
  """
  path = getattr(run_config, "storage_path", None) or "~/ray_results"
  loc = parse_location(str(path))  # an unknown scheme: UsageError
  name = getattr(run_config, "name", None) or job
  if loc.kind == OBJECT:
    return f"{loc.target}/{name}"
  if loc.kind != LOCAL:
    raise UsageError(f"run_config.storage_path {path!r}: a directory every"
                     " node mounts, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX,"
                     " not a store server")
  return os.path.join(os.path.expanduser(loc.target), name)


# The object-storage SDKs' standard environment (endpoint, credentials,
# region; the GCS emulator): what the driver has set of it is passed to the
# workers when the checkpoint is on object storage, since a worker's
# environment is its node's, not the driver's.
STORAGE_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
               "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
               "AWS_DEFAULT_REGION", "AWS_PROFILE", "STORAGE_EMULATOR_HOST",
               "GOOGLE_APPLICATION_CREDENTIALS")


def _storage_env(checkpoint: str | None) -> dict[str, str]:
  """:data:`STORAGE_ENV` as the driver has it, for an object-storage
  ``checkpoint`` (else nothing)."""
  if not checkpoint or "://" not in checkpoint:
    return {}
  return {k: os.environ[k] for k in STORAGE_ENV if os.environ.get(k)}


def _stop_stores(job: str, nodes: Sequence[str], timeout: float) -> int:
  """Stops job ``job``'s store actors on ``nodes`` all at once (each
  removes its directory), waits for them up to ``timeout`` seconds in all,
  then kills the actors; returns how many there were."""
  actors = []
  for node in nodes:
    try:
      actors.append(_ray.get_actor(store_actor_name(job, node),
                                   namespace=NAMESPACE))
    except ValueError:
      pass
  refs = [a.stop.remote() for a in actors]
  if refs:  # a stop that fails (its node gone) is ready with its error
    _ray.wait(refs, num_returns=len(refs), timeout=timeout)
  for a in actors:
    _ray.kill(a)
  return len(actors)


def stop_store(job: str, node: str) -> bool:
  """Stops job ``job``'s store actor on node ``node`` and removes its
  directory (e.g. before a node leaves); returns whether there was one."""
  return _stop_stores(job, [node], 30.0) > 0


def cleanup_stores(job: str) -> None:
  """Stops job ``job``'s store actors on every node and removes their
  directories (the stops run at once, up to 60 s in all)."""
  _stop_stores(job, [n["NodeID"] for n in _ray.nodes() if n["Alive"]], 60.0)


def run(train: str | Callable, args: Sequence[str] = (), **kwargs) -> dict:
  """Runs ``train`` (a script path, run as ``__main__`` with ``args`` in
  ``sys.argv``, or a callable called with ``args``) as an elastic job on the
  connected Ray cluster.

  Args:
    train: the training script (written for ``tenplex-jax launch``'s script
      API) or function; a path must exist on every node.
    args: its command line arguments.
    **kwargs: :class:`Job`'s: ``num_workers`` (required: a count, or
      ``(min, max)``: start with one worker per CPU (or per
      ``worker_resources``) of the alive nodes
      within the bounds, grow when nodes join, restart within the bounds
      after a loss; :meth:`Job.request_resize` then also sets the maximum),
      ``devices_per_worker`` (JAX CPU devices per worker, 1),
      ``worker_resources`` (what each worker asks Ray for besides its CPU,
      e.g. ``{"GPU": 1}`` or ``{"TPU": 4}``; the auto-resize then counts
      the alive nodes' room for that: :meth:`Job.slots`),
      ``schedule`` (``{step: workers}``), ``max_restarts`` (3),
      ``replicas`` (store replicas of :func:`save_snapshot`, 0; the driver
      may change ``job.replicas`` for the next group),
      ``checkpoint`` (an Orbax directory for the last fallback, in the
      workers' ``TENPLEX_CHECKPOINT`` and ``initialize()["checkpoint"]``),
      ``run_config`` (a Ray ``RunConfig``: ``checkpoint`` defaults to its
      :func:`checkpoint_dir`),
      ``store_root`` (``/dev/shm``), ``job`` (a name), ``keep_stores``,
      ``start_timeout`` (seconds for a group's actors to start, 120),
      ``env`` (more environment for the workers), ``on_progress``
      (``f(job, step)``, called in the driver about every 0.5 s with the
      furthest step of the running group: e.g. to add nodes or call
      :meth:`Job.request_resize`), ``tls_cert``, ``tls_key`` (PEM
      certificate and key of the store actors' servers, valid for every
      node's address, at the same path on every node: they then serve
      HTTPS only), ``tls_ca`` (the CA file the workers verify them
      against, at the same path on every node; default the driver's
      ``$TENPLEX_JAX_STORE_CA``), ``standby`` (``True``: keep standby
      workers for the next group, as many as the largest group so far, the
      schedule's or the auto-resize's target; an int: at least that many;
      ``False``: start every group's actors on the resize's path; only for
      workers asking Ray for CPUs alone, since a standby holds no Ray
      resources; the driver may change ``job.standby`` for the next
      group), ``standby_imports`` (the modules a standby imports,
      :data:`STANDBY_IMPORTS` by default), ``standby_timeout`` (seconds a
      standby may take from its start to finish its imports, 300; past
      it, it is killed and replaced, said on stderr and in
      ``Job.late_standbys``, and never handed a rank), ``compilation_cache``
      (``True``: jax's persistent compilation cache in ``xla`` beside each
      node's store directory, removed with the stores; a path: that
      directory on every node, e.g. a shared file system, since in a
      multi-process group jax writes entries from process 0 only;
      ``False``: none; the driver may change ``job.compilation_cache``),
      ``prepare`` (``True``: start the next group ahead of a resize whose
      size is known, from ready standbys: ranks, ``jax.distributed`` and
      the script up to its restore, where it waits for the running group's
      save; see :meth:`Job.prepare_next`), ``prepare_timeout`` (seconds
      such a group may take to be ready, every worker waiting at its turn,
      from its start; default 600: past it, or once one of its workers
      ended, the driver drops it with a line on stderr and the resize
      starts its workers as without it, waiting for it at its turn only
      up to the timeout), ``free_arrays`` (``True``: a
      worker deletes its jax arrays once it saved for a resize, before the
      next group restores, so that memory is free for it),
      ``allocate_ahead`` (``True``, the default: a group started ahead
      also allocates the arrays its restore reads into, every page faulted
      in, before its turn, with
      ``store.api.compile_restore(target, allocate=True)``; each of its
      workers holds its share of the state that much earlier, beside the
      running group's, freed with the worker if the group is dropped;
      ``False`` where memory is short: the restore allocates at the turn).

  Returns:
    ``{"job", "generations"}``: per worker group its ``workers``,
    ``start_step``, ``outcome`` (``done``, ``resize``, ``failed``), the step
    it resized at, what it ``restored`` (step, source ``stores`` or
    ``checkpoint``, ``failed_step``, the restore report with
    ``steps_lost``; also for a group that failed after its first step),
    ``auto_request`` (the ``workers`` and ``step`` of a resize it chose
    from the node table), ``dropped_prepared`` (a group prepared ahead
    that was not ready in time: its ``generation``, ``workers``, ``pids``,
    the ranks ``not_ready``, those ``ended``, ``waited_s`` and whether
    ``at_turn``; in the running group's record, or at the turn in the
    record of the group started instead),
    ``standby`` (how many of its workers were standbys),
    ``standby_ready_s`` (per worker, when its standby's imports were done,
    seconds from the group's start: < 0 before the resize began; ``None``
    for a fresh actor), ``pids``,
    and seconds: ``started_s`` (actors up), ``first_step_s`` (to the first
    :func:`resize_due`), ``end_s``, ``teardown_s``.

  Example:
    >>> result = run("train.py", ["10"], num_workers=2,
    ...              schedule={4: 3})  # doctest: +SKIP
    >>> [g["workers"] for g in result["generations"]]  # doctest: +SKIP
    [2, 3]
  """
  return Job(train, args, **kwargs).run()
