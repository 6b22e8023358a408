"""The restart flow: ``tenplex-jax launch`` and the calls a training script makes.

The launcher runs a script as N local processes (one ``jax.distributed`` job
on 127.0.0.1 with gloo CPU collectives, D devices each), starts one store
server per store directory (they outlive the training processes), and when
the script exits for a resize it relaunches the script as M processes; the
state travels through the stores.

A training script::

  from tenplex_jax import store
  store.initialize()                      # jax.distributed from the env
  state, step = store.restore_or_init(init_fn, target)
  while step < total:
    state = train_step(state); step += 1
    if store.resize_due(step):
      store.save_and_exit(state, step)    # exits with RESIZE_EXIT_CODE

A resize is requested by a schedule file (lines ``step 20 procs 2``), by
``request_resize(m)`` from the script, or by SIGUSR1 to the launcher with the
new size in ``JOB_DIR/request`` (the launcher turns it into a request a few
steps ahead of the slowest process, so all processes resize at one step).

Failures: an uncaught exception or ``sys.exit(n)`` in a process that
called :func:`initialize` ends it at once (no ``jax.distributed`` shutdown
barrier) with a report to the launcher; the launcher also sees exits,
signals (SIGKILL, the OOM killer) and, with ``step_timeout``, hangs. On the
first failure it stops the other processes (their process groups), names
the process that failed first, and relaunches the script (at most
``max_restarts`` times) on as many processes (``on_failure="same"``) or on
one fewer (``"shrink"``). The new processes' :func:`restore_or_init`
restores the newest complete snapshot that :func:`save_snapshot` (called
every few steps) left in the stores or their replicas, else the newest Orbax
checkpoint in the launcher's ``checkpoint`` directory, else starts afresh,
and reports the steps lost; but while a store server does not answer it
fails instead of falling back (the launcher restarts dead store servers, on
their intact stores, for the next generation).

Faster generations: every process gets jax's persistent compilation cache
in the job directory (a mesh the job ran before is not compiled again), and
the launcher keeps standby processes (Python, jax, flax, optax imported)
that a resize or a restart hands the new ranks to instead of starting
interpreters (``compilation_cache``, ``standby`` of :func:`launch`).
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import ctypes
import faulthandler
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tenplex_jax.errors import NoCopyError, StoreError, UsageError
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.store import private
from tenplex_jax.runtime.env import STANDBY_IMPORTS_ENV, job_env
from tenplex_jax.store.api import compile_restore, restore_with_report, save
from tenplex_jax.store.server import (CA_ENV, TOKEN_ENV, client_ca, free_port,
                                      is_remote, new_token, resolve_token)

__all__ = ["Controller", "RESIZE_EXIT_CODE", "STANDBY_IMPORTS", "controller",
           "expect_resizes", "heartbeat",
           "initialize", "launch", "prepared", "prepared_for_failure", "register", "request_resize",
           "resize_due", "restore_or_init", "save_and_exit", "save_snapshot",
           "use_controller", "wait_programs", "wait_turn", "warming_up"]

RESIZE_EXIT_CODE = 75
_MARGIN = 3  # steps ahead of the slowest process for signalled requests


class Controller:
  """Who decides a resize and how a process leaves for one.

  This one is ``tenplex-jax launch``'s: a resize is due at a ``step S procs
  M`` line of the schedule file or at a request (:func:`request_resize`,
  SIGUSR1 to the launcher), and a process leaves by exiting with
  :data:`RESIZE_EXIT_CODE` for the launcher to relaunch the script. The Ray
  integration's workers use their own (:mod:`tenplex_jax.runtime.ray`). A
  process has one, chosen once (:func:`controller`).
  """

  def resize_due(self, step: int) -> int | None:
    """The new process count if a resize is due at ``step``, else None."""
    env = job_env()
    start, n = env.start_step, env.procs
    for s, m in _schedule():
      if s == step and s > start and m != n:
        return m
    if env.job_dir:
      p = os.path.join(env.job_dir, "resize_request.json")
      try:
        req = json.loads(_text(p))
      except (OSError, ValueError):
        req = None
      if req and req["step"] == step and step > start and req["procs"] != n:
        return int(req["procs"])
    return None

  def wait_turn(self, path: str, ready: float) -> dict:
    """Marks this prepared process ready (``JOB_DIR/ready_<g>_<p>.txt``)
    and blocks until the launcher writes its turn to ``path`` (looked for
    every 2 ms); returns the turn (``handed``, ``saved``, ...)."""
    with private.open_private(_job_file("ready", "txt")) as f:
      f.write(repr(ready))
    while True:
      try:
        return json.loads(_text(path))
      except (OSError, ValueError):
        time.sleep(0.002)

  def leave_for_resize(self, procs: int, step: int) -> None:
    """Ends this process after its resize save (does not return)."""
    job = job_env().job_dir
    if job:
      with private.open_private(
          os.path.join(job, f"resize_{jax.process_index()}.json")) as f:
        json.dump({"procs": procs, "step": step}, f)
    if jax.process_count() > 1:
      jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(RESIZE_EXIT_CODE)


_controller: list = []


def use_controller(c: Controller) -> None:
  """Makes ``c`` this process's controller (a Ray worker does, before it
  runs the script); call it before the script's first :func:`resize_due`."""
  _controller[:] = [c]


def controller() -> Controller:
  """This process's controller: the one :func:`use_controller` gave, else
  the launcher's, chosen on first use and kept."""
  if not _controller:
    _controller.append(Controller())
  return _controller[0]


def _text(path: str) -> str:
  with open(path) as f:
    return f.read()


def initialize() -> dict:
  """Configures gloo CPU collectives and ``jax.distributed`` from the
  launcher's environment; returns the job description.

  Without a launcher (no ``TENPLEX_NUM_PROCS``) it is a single process job.
  Under ``tenplex-jax launch`` it also installs the failure hooks: an
  uncaught exception, or ``sys.exit`` with a nonzero status, prints as
  usual, writes ``JOB_DIR/failure_<generation>_<process>.json`` for the
  launcher and ends the process with ``os._exit`` at once, without entering
  ``jax.distributed``'s shutdown barrier (which would wait for the other
  processes, themselves blocked in a collective with this one, for
  ``shutdown_timeout``); SIGUSR2 (when the script has no handler of its own)
  dumps every thread's stack to ``JOB_DIR/stacks_<generation>_<process>.txt``,
  which the launcher asks for when the job hangs.

  Example:
    >>> info = initialize()  # doctest: +SKIP
    >>> info["num_processes"], info["process_id"]  # doctest: +SKIP
    (2, 0)
  """
  env = job_env()
  n, i = env.procs, env.proc_id
  if env.job_dir and env.launched:
    _install_failure_hooks()
    heartbeat()  # started; the next one after jax.distributed is up
  if env.devices:
    jax.config.update("jax_num_cpu_devices", env.devices)
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if env.compilation_cache:
      _one_cache_key_for_every_process()
    jax.distributed.initialize(coordinator_address=env.coordinator,
                               num_processes=n, process_id=i,
                               initialization_timeout=120)
  heartbeat()
  return {"num_processes": n, "process_id": i,
          "store": env.store, "job_dir": env.job_dir,
          "generation": env.generation, "checkpoint": env.checkpoint}


def _one_cache_key_for_every_process() -> None:
  """Makes jax's persistent compilation cache key of a CPU program the same in
  every process of the job.

  jax hashes the devices' topology into the key, and on CPU that fingerprint
  differs from process to process (each sees its own devices as the local
  ones), while only process 0 writes cache entries: without this, processes
  other than 0 never find their programs in the cache, compile them anew and
  make process 0 wait for them in the first collective. In place of the
  fingerprint this hashes what it stands for on CPU, the same in every
  process: each device's id, process and kind, in the program's order (jax
  itself shares one compiled binary between processes with
  ``jax_share_binary_between_hosts``). Other platforms keep jax's hash. A
  jax without ``jax._src.cache_key._hash_accelerator_config`` is left alone.
  """
  try:
    from jax._src import cache_key
  except ImportError:
    return
  original = getattr(cache_key, "_hash_accelerator_config", None)
  if original is None or getattr(original, "_tenplex", False):
    return

  def hash_accelerator_config(hash_obj, accelerators):
    devices = list(accelerators.flat)
    if not devices or any(d.platform != "cpu" for d in devices):
      return original(hash_obj, accelerators)
    hash_obj.update("|".join(f"{d.id}:{d.process_index}:{d.device_kind}"
                             for d in devices).encode())

  hash_accelerator_config._tenplex = True
  cache_key._hash_accelerator_config = hash_accelerator_config


_hooks: dict = {}


def _job_file(prefix: str, ext: str) -> str:
  env = job_env()
  return os.path.join(env.job_dir,
                      f"{prefix}_{env.generation}_{env.proc_id}.{ext}")


def _report_failure(kind: str, code: int, error: str) -> None:
  """Writes this process's failure report for the launcher (best effort)."""
  env = job_env()
  try:
    step = int(_text(os.path.join(env.job_dir, f"progress_{env.proc_id}")))
  except (OSError, ValueError):
    step = None
  p = _job_file("failure", "json")
  try:
    with private.open_private(p + ".tmp") as f:
      json.dump({"process": env.proc_id, "generation": env.generation,
                 "kind": kind, "exit_code": code, "error": error[-2000:],
                 "step": step, "time": time.time(), "pid": os.getpid()}, f)
    os.replace(p + ".tmp", p)
  except OSError:
    pass


def _fail_now(kind: str, code: int, error: str) -> None:
  _report_failure(kind, code, error)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass
  os._exit(code)


def _exit_status(status: Any) -> int:
  """The process exit status ``sys.exit(status)`` gives."""
  if status is None:
    return 0
  if isinstance(status, int):
    return status & 0xFF
  return 1  # a message: printed to stderr, status 1


def _install_failure_hooks() -> None:
  """See :func:`initialize`. Idempotent."""
  if _hooks:
    return
  # jax registered its atexit shutdown barrier when this module imported
  # it; ours, registered after it, runs before it.
  _hooks["exit_status"] = None
  prev_hook = sys.excepthook

  def excepthook(tp, value, tb):
    try:
      prev_hook(tp, value, tb)
    finally:
      kind = "interrupt" if issubclass(tp, KeyboardInterrupt) else "exception"
      _fail_now(kind, 1, "".join(traceback.format_exception_only(tp, value))
                .strip())

  sys.excepthook = excepthook
  orig_exit = sys.exit

  def exit_(status=None):
    if threading.current_thread() is threading.main_thread():
      _hooks["exit_status"] = status  # (in a thread it ends that thread)
    orig_exit(status)

  exit_.__doc__ = orig_exit.__doc__
  sys.exit = exit_
  for name in ("exit", "quit"):  # site's exit()/quit() raise SystemExit
    quitter = getattr(builtins, name, None)
    if quitter is not None and not getattr(quitter, "_tenplex", False):
      def make(q):
        class _Quitter(type(q)):
          _tenplex = True

          def __call__(self, code=None):
            _hooks["exit_status"] = code
            return super().__call__(code)
        return _Quitter(q.name, q.eof)
      try:
        setattr(builtins, name, make(quitter))
      except (TypeError, AttributeError):
        pass

  def at_exit():
    status = _hooks["exit_status"]
    code = _exit_status(status)
    if code != 0:  # a failure: leave without jax's shutdown barrier
      _fail_now("exit", code, f"sys.exit({status!r})")

  atexit.register(at_exit)
  if signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None):
    try:
      f = private.open_private(_job_file("stacks", "txt"))
      faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)
      _hooks["stacks_file"] = f
    except (OSError, ValueError, RuntimeError):
      pass
  # The launcher signals it.
  with private.open_private(_job_file("pid", "txt")) as f:
    f.write(str(os.getpid()))


def _progress(step: int) -> None:
  env = job_env()
  if env.job_dir:
    p = os.path.join(env.job_dir, f"progress_{env.proc_id}")
    with private.open_private(p + ".tmp") as f:
      f.write(str(step))
    os.replace(p + ".tmp", p)
    heartbeat()


def heartbeat() -> None:
  """Marks this process alive for the launcher's ``step_timeout``, as
  ``initialize`` (entering and leaving), the restore, every step and every
  snapshot do; a script calls it for a wait it knows to be progress, not a
  hang (e.g. every few seconds while a step compiles). A no-op outside
  ``tenplex-jax launch`` and in a generation prepared ahead (until its
  turn).

  Example:
    >>> from tenplex_jax import store
    >>> store.heartbeat()  # outside the launcher: nothing happens
  """
  env = job_env()
  if env.job_dir and env.launched and not prepared():
    # (a prepared process's index is the running generation's until its turn)
    p = os.path.join(env.job_dir, f"heartbeat_{env.proc_id}")
    try:
      with private.open_private(p) as f:
        f.write(f"{env.generation} {time.time()}")
    except OSError:
      pass


class Heartbeats:
  """A thread that calls :func:`heartbeat` every ``every`` seconds until
  :meth:`stop` (or the end of a ``with`` block); see :func:`heartbeats`."""

  def __init__(self, every: float = 2.0):
    if not every > 0:
      raise UsageError(f"heartbeats: every={every!r} s, must be > 0")
    self.every = float(every)
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name="tenplex-heartbeats")
    self._thread.start()

  def _run(self) -> None:
    while not self._done.is_set():
      heartbeat()
      self._done.wait(self.every)

  def stop(self) -> None:
    """Stops the beats (at once; a beat in progress finishes)."""
    self._done.set()

  def __enter__(self) -> "Heartbeats":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def heartbeats(every: float = 2.0) -> Heartbeats:
  """Marks this process alive every ``every`` seconds, from a thread, until
  the returned object's ``stop()`` or the end of its ``with`` block.

  For set-up that is progress however long it takes (``import``s,
  ``initialize``, a restore, the first step's compile on a loaded host), so
  that the launcher's ``step_timeout`` bounds the steps, not the set-up:
  start it before the set-up, stop it before the first step (a step that
  hangs must stop beating). A no-op wherever :func:`heartbeat` is one.

  Example:
    >>> from tenplex_jax import store
    >>> with store.heartbeats(every=0.5):
    ...   pass  # imports, initialize(), the restore, the step's compile
    >>> beats = store.heartbeats()  # or stopped by hand
    >>> beats.stop()
  """
  return Heartbeats(every)


def _schedule() -> list[tuple[int, int]]:
  path = job_env().schedule
  out = []
  if path and os.path.exists(path):
    for line in _text(path).splitlines():
      parts = line.split()
      if len(parts) == 4 and parts[0] == "step" and parts[2] == "procs":
        out.append((int(parts[1]), int(parts[3])))
  return sorted(out)


def request_resize(procs: int, *, at_step: int) -> None:
  """Asks for a resize to ``procs`` processes at step ``at_step``.

  Call it in every process with the same arguments (e.g. from a decision all
  processes compute alike); :func:`resize_due` then fires at that step.
  """
  job = job_env().job_dir
  if not job:
    raise RuntimeError("request_resize needs tenplex-jax launch"
                       " (TENPLEX_JOB_DIR is not set)")
  p = os.path.join(job, "resize_request.json")
  tmp = f"{p}.{os.getpid()}"
  with private.open_private(tmp) as f:
    json.dump({"procs": int(procs), "step": int(at_step)}, f)
  os.replace(tmp, p)


def resize_due(step: int) -> int | None:
  """The new process count if a resize is due at ``step``, else ``None``.

  This process's :func:`controller` decides: under ``tenplex-jax launch``
  the schedule file (a ``step S procs M`` line with S == step, after this
  generation's start step) and resize requests; under
  :mod:`tenplex_jax.ray` the job's driver.
  """
  _progress(step)
  return controller().resize_due(step)


def expect_resizes(resizes: Sequence[tuple[int, int, str]], *,
                   key: str = "",
                   failure: tuple[int, str] | None = None,
                   early: bool = False) -> None:
  """Tells the launcher the resizes this job expects, so that it prepares
  their generations while this one trains.

  ``resizes``: ``(step, procs, key)`` per expected resize (e.g. the
  schedule's next phases): at ``step`` the job will resize to ``procs``
  processes running what ``key`` names (e.g. the mesh and the step's
  program); ``key`` (keyword) names this generation's. The launcher starts
  each expected generation ahead (:func:`prepared` is true in its
  processes): it runs the script up to :func:`wait_turn` (imports,
  ``jax.distributed``, compiling its step into the persistent compilation
  cache), and waits there; when the running generation has saved at that
  step for that many processes, the launcher hands it the turn, else stops
  it. Generations with equal keys prepare one after the other (the later one
  loads the earlier one's programs from the compilation cache). Process 0's
  call counts; the others' do nothing. Without the launcher it does nothing.

  ``failure``: ``(procs, key)`` of the generation that would take over after a
  process of this one fails (e.g. the config search's choice for N - 1
  hosts). The launcher prepares it too, once this generation has stepped, as
  a standby generation: when a process fails and the launcher restarts on
  ``procs`` processes (its ``on_failure``), it hands that generation the turn
  (with the failed step, ``TENPLEX_FAILED_STEP``, and the start step) instead
  of starting processes; :func:`restore_or_init` then restores the newest
  snapshot. Its start step is not known before the turn: its
  ``TENPLEX_START_STEP`` is this generation's until :func:`wait_turn`.

  ``early``: start a generation whose key another generation is still
  compiling at once too, instead of after that one: it imports, starts
  ``jax.distributed`` and traces its step meanwhile, and the script calls
  :func:`wait_programs` before it compiles (then loads the other's programs
  from the compilation cache). For scripts that call it.

  Example:
    >>> expect_resizes([(8, 2, "2x2 data=2,stage=2"), (16, 1, "1x2 tensor=2")],
    ...                key="2x4 data=2,tensor=2,stage=2",
    ...                failure=(1, "1x4 data=4"))  # no launcher: nothing
  """
  if failure is not None:
    try:
      fprocs, fkey = failure
      ok = int(fprocs) >= 1
    except (TypeError, ValueError):
      ok = False
    if not ok:
      raise UsageError(f"expect_resizes: failure={failure!r}: expected"
                       " (procs >= 1, key)")
  env = job_env()
  job = env.job_dir
  if not job or not env.launched or env.ray_controller or env.proc_id != 0:
    return
  out = []
  for r in resizes:
    step, procs, what = r
    if int(procs) < 1:
      raise UsageError(f"expect_resizes: the resize at step {step} has"
                       f" {procs} processes; it needs at least 1")
    out.append([int(step), int(procs), str(what)])
  p = os.path.join(job, "expected_resizes.json")
  with private.open_private(f"{p}.{os.getpid()}") as f:
    json.dump({"generation": env.generation,
               "key": str(key), "resizes": out,
               "failure": None if failure is None
               else [int(failure[0]), str(failure[1])],
               "early": bool(early)}, f)
  os.replace(f"{p}.{os.getpid()}", p)


_turn: dict = {}  # a prepared process's turn: {"ready", "seen", "handed"}


def wait_programs() -> float:
  """In a generation started early (:func:`expect_resizes`'s ``early``)
  while another generation with its key was still compiling: blocks until
  the launcher says that one has its programs (it stepped, or is ready),
  so that this one's compile loads them from the compilation cache instead
  of compiling them again; looked for every 20 ms. Returns the seconds it
  waited (0.0 at once elsewhere: not started early, or not prepared).

  Example:
    >>> wait_programs()  # not started early: returns at once
    0.0
  """
  path = job_env().programs_file
  if not path or not prepared():
    return 0.0
  t0 = time.time()
  while not os.path.exists(path):
    time.sleep(0.02)
  return time.time() - t0


def warming_up() -> None:
  """In a prepared process (:func:`prepared`): marks it compiled, about to
  run its warm-up step (``JOB_DIR/warmup_<g>_<p>.txt``), the point from
  which the launcher's ``warmup_timeout`` counts until its ready mark
  (:func:`wait_turn`); nothing elsewhere. Call it after the compile,
  before the first run of the compiled step (where jaxlib 0.10.2's gloo
  communicators are made, and can deadlock).

  Example:
    >>> warming_up()  # a process the launcher did not start ahead
  """
  if not prepared() or not job_env().job_dir:
    return
  with private.open_private(_job_file("warmup", "txt")) as f:
    f.write(repr(time.time()))


def prepared() -> bool:
  """Whether this process belongs to a generation the launcher started
  ahead (:func:`expect_resizes`) and has not had its turn yet: the script
  may compile and warm up, but its state comes only after :func:`wait_turn`
  (which :func:`restore_or_init` calls).

  Example:
    >>> prepared()  # a process the launcher did not start ahead
    False
  """
  return bool(job_env().turn_file) and not _turn.get("seen")


def prepared_for_failure() -> bool:
  """Whether this process belongs to the generation the launcher prepared
  for a failure of the running one (:func:`expect_resizes`'s ``failure``),
  before and after its turn: the script lays it out for the process count
  a restart would have (e.g. the config search's choice for N - 1 hosts),
  since it learns only at the turn that a process failed and which step it
  restores.

  Example:
    >>> prepared_for_failure()  # a process the launcher did not prepare
    False
  """
  return job_env().for_failure and bool(job_env().turn_file)


def wait_turn() -> dict:
  """In a prepared process (:func:`prepared`): marks it ready for the
  launcher and blocks until the launcher hands this generation its turn
  (the previous one saved the state this one restores). Returns
  ``{"ready": t, "handed": t, "seen": t}`` (``time.time()``: ready, turn
  handed by the launcher, turn seen here; ``"saved"``: when the previous
  generation's last process had saved, or None; ``"started"``: when the
  launcher started the generation; ``"nice"``: the nice increment it
  prepared at; ``"failure": True`` for a
  generation prepared for a failure (:func:`expect_resizes`), whose start
  and failed step the turn sets in ``os.environ``); ``{}`` in other
  processes. The turn is looked for every 2 ms.

  Example:
    >>> wait_turn()  # not started ahead: returns at once
    {}
  """
  path = job_env().turn_file
  if not path or _turn.get("seen"):
    return dict(_turn)
  _turn["ready"] = time.time()
  turn = controller().wait_turn(path, _turn["ready"])
  _turn.update(handed=turn["handed"], saved=turn.get("saved"), seen=time.time(),
               started=turn.get("started"), nice=turn.get("nice", 0))
  # A generation prepared for a failure learns its start and failed step now.
  os.environ.update(turn.get("env") or {})
  if turn.get("failure"):
    _turn["failure"] = True
  heartbeat()
  return dict(_turn)


def save_snapshot(state: Any, step: int, *, replicas: int | None = None,
                  run: str | None = None, delete_arrays: bool = False) -> str:
  """Saves this process's shards to its host store and goes on training.

  Call it in every process at the same steps (e.g. every 10 steps): after a
  process failure the relaunched job restores the newest snapshot, so a
  failure loses at most the steps since it. ``replicas`` (default: the
  launcher's ``--replicas``) also copies the snapshot to the next stores,
  round robin, so it survives the loss of its host. Each store keeps the
  previous snapshot too (``save``'s ``keep=2``, up to twice the state's
  size on disk), so a process that dies during a round leaves the previous
  round complete for the restore. ``run`` (default: ``TENPLEX_RUN``, which
  the launcher sets per generation) is recorded in the snapshot; restore
  never combines snapshots of one step from different runs.
  ``delete_arrays``: each array of ``state`` is deleted as soon as it is
  written (``store.save``'s; for a save after which the process does not
  use the state, as :func:`save_and_exit`'s).

  Returns:
    The committed snapshot's directory.
  """
  env = job_env()
  if replicas is None:
    replicas = env.replicas
  peers = list(env.stores)
  if len(peers) < 2:
    replicas = 0  # a single process has no other host to replicate to
  store = env.store
  if not store:
    raise RuntimeError("save_snapshot needs tenplex-jax launch"
                       " (TENPLEX_STORE is not set)")
  out = save(state, store, step=step, replicas=replicas,
             peers=peers or None, run=run, delete_arrays=delete_arrays)
  heartbeat()
  return out


def save_and_exit(state: Any, step: int, *, procs: int | None = None,
                  replicas: int | None = None) -> None:
  """Saves this process's shards to its host store and exits for a resize.

  Every process calls it at the same step. The launcher relaunches the
  script with the new process count, whose :func:`restore_or_init` restores
  the state. Under :mod:`tenplex_jax.ray` it raises
  ``tenplex_jax.ray.ResizeExit`` instead of exiting (the Ray worker catches
  it, shuts ``jax.distributed`` down and reports the resize to the driver):
  this process's :func:`controller` ends it. The arrays of ``state`` are
  deleted as they are written (``save_snapshot``'s ``delete_arrays``): the
  snapshot's pages reuse their memory.
  """
  procs = procs or resize_due(step) or job_env().procs
  # The state is not used again: each array's memory is free as soon as it
  # is written, for the rest of the save and the next generation.
  save_snapshot(state, step, replicas=replicas, delete_arrays=True)
  controller().leave_for_resize(procs, step)


last_restore: dict = {}  # what the last restore_or_init restored (step,
# source, failed_step, the RestoreReport as a dict); empty after an init


def restore_or_init(init_fn: Callable[[], Any], target: Any = None
                    ) -> tuple[Any, int]:
  """Restores the state saved by the previous generation, or initialises.

  Args:
    init_fn: builds the initial state on this job's mesh (first start).
    target: the state's ``ShapeDtypeStruct``s with shardings on this job's
      mesh (default: ``jax.eval_shape(init_fn)``, whose leaves must carry
      shardings).

  After a resize it restores the state saved at the resize step. After a
  failure (the launcher relaunched the job) it restores the newest complete
  snapshot in the stores or their replicas, else the newest Orbax checkpoint
  in the launcher's ``--checkpoint`` directory, else calls ``init_fn``; it
  writes ``JOB_DIR/recovery_<generation>.json`` (the failed and the
  restored step, the steps lost, the source) and prints a line. Under
  ``tenplex-jax launch``, when a store server did not answer and the
  others hold no complete snapshot, it raises
  :class:`~tenplex_jax.errors.StoreError` instead of falling back to the
  checkpoint or ``init_fn``: the launcher restarts that server, its store
  intact, for the next generation (one more restart), whose restore
  finds the snapshot there.

  Returns:
    ``(state, step)``; ``step`` is 0 on a first start.
  """
  if prepared():
    # A generation started ahead: the restore's allocation program is
    # compiled (or loaded from the cache) before its turn, not after; with
    # TENPLEX_ALLOCATE_AHEAD also run (the arrays held for the restore).
    if target is None:
      target = jax.eval_shape(init_fn)
    try:
      compile_restore(target, allocate=job_env().allocate_ahead)
    except Exception:  # noqa: BLE001 - the restore reports a bad target
      pass
  wait_turn()  # a prepared generation: until the previous one saved
  env = job_env()
  stores = list(env.peers)
  start, failed = env.start_step, env.failed_step
  last_restore.clear()
  if not stores or (start == 0 and failed is None):
    state = init_fn()
    heartbeat()
    return state, 0
  if target is None:
    target = jax.eval_shape(init_fn)
  own = env.store
  locations = ([own] if own and os.path.isdir(own) else []) + stores
  ckpt, job, gen = env.checkpoint, env.job_dir, env.generation
  # Under tenplex-jax launch a store server that did not answer died and is
  # restarted with the next generation, its store intact: its snapshot
  # may be newer than the checkpoint, and is newer than an init. (A
  # directory that is no store is not a server the launcher restarts.)
  strict = failed is not None and env.launched and not env.ray_controller
  try:
    state, report = restore_with_report(locations, target, checkpoint=ckpt)
  except NoCopyError as e:
    if failed is None:
      raise
    if strict and any(map(is_remote, e.dead_sources)):
      _refuse_fallback(e.dead_sources, int(failed), "step 0", e)
    state, report, step, source = init_fn(), None, 0, f"init ({e})"
  else:
    step = report.step
    source = "checkpoint" if report.from_checkpoint else "stores"
    if strict and report.from_checkpoint and any(map(is_remote,
                                                     report.dead_sources)):
      _refuse_fallback(report.dead_sources, int(failed),
                       f"the checkpoint's step {step}")
  if job and report is not None:
    with private.open_private(os.path.join(
        job, f"restore_{jax.process_index()}_{gen}.json")) as f:
      json.dump(report.to_dict(), f)
  last_restore.update(
      step=step, source=source,
      failed_step=int(failed) if failed is not None else None,
      report=report.to_dict() if report is not None else None)
  if failed is not None:
    failed = int(failed)
    info = {"generation": int(gen), "failed_step": failed,
            "restored_step": step, "steps_lost": max(0, failed - step),
            "source": source,
            "dead_sources": list(report.dead_sources) if report else [],
            "lost_processes": list(report.lost_processes) if report else []}
    if jax.process_index() == 0:
      print(f"tenplex-jax: recovered step {step} from {source.split()[0]}"
            f" (failed at step {failed}, {info['steps_lost']} steps lost)",
            flush=True)
      if job:
        p = os.path.join(job, f"recovery_{gen}.json")
        with private.open_private(p + ".tmp") as f:
          json.dump(info, f)
        os.replace(p + ".tmp", p)
    # resize_due counts schedule steps after the restored one.
    os.environ["TENPLEX_START_STEP"] = str(step)
  heartbeat()
  return state, step


def _refuse_fallback(dead: Sequence[str], failed: int, instead: str,
                     cause: BaseException | None = None) -> None:
  """Raises the error of a restore after a failure that found no complete
  snapshot in the stores that answered while ``dead`` did not (see
  :func:`restore_or_init`)."""
  raise StoreError(
      f"restore_or_init: the job failed at step {failed}; the stores that"
      " answered hold no complete snapshot, and the store server(s)"
      f" {list(dead)} did not answer: the snapshot may be there, so this"
      f" process does not start from {instead}. tenplex-jax launch restarts"
      " a dead store server (its store intact) for the next generation,"
      " which restores again") from cause


# ------------------------------------------------------------ the launcher

_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when stopping processes


class _Interrupted(KeyboardInterrupt):
  """SIGINT/SIGTERM/SIGHUP to the launcher (after it stopped everything)."""

  def __init__(self, signum: int):
    super().__init__(f"tenplex-jax launch: stopped by"
                     f" {signal.Signals(signum).name}")
    self.signum = signum


def _no_orphans(nice: int | None = None) -> Callable[[], None] | None:
  """A ``preexec_fn`` that makes the kernel SIGKILL the child when the
  launcher dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), and, with
  ``nice``, gives it that nice value before it runs its command."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  parent = os.getpid()

  def setup():
    prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before prctl
      os._exit(1)
    if nice is not None:
      try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
      except OSError:
        pass
  return setup


def _signal_group(p: subprocess.Popen, sig: int) -> None:
  """``sig`` to ``p``'s process group (each child leads its own), only while
  ``p`` is not reaped. The leader's pid is the group's id; the kernel keeps
  it while the leader (a zombie included) or any process of its group
  lives, and hands it out again after that. A reaped leader's group may be
  gone, and its id an unrelated process's (pid numbers wrap: 32768 by
  default), whose group a stale ``killpg`` would kill. So the launcher
  notes a child's exit without reaping it (:func:`_exited`) and reaps it
  only after the last signal to its group."""
  if p.returncode is not None:  # reaped
    return
  try:
    os.killpg(p.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _exited(p: subprocess.Popen) -> bool:
  """Whether ``p`` has exited, without reaping it (its pid, and so its
  group's id, stay its own until ``p.wait()``)."""
  if p.returncode is not None:
    return True
  try:
    return os.waitid(os.P_PID, p.pid,
                     os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:  # reaped by someone else
    return True


def _gone(p: subprocess.Popen) -> bool:
  """Whether ``p`` has exited or is exiting (not reaped either way).

  More than :func:`_exited`: a process whose main thread has exited (a
  zombie in ``/proc/PID/stat``) while its other threads are still being
  torn down is not yet waitable (the kernel tells the parent only after the
  last thread, which for a SIGKILLed process with a large address space
  takes up to hundreds of ms on a loaded host), yet it serves nothing any
  more. A process whose main thread exited on its own while other threads
  run counts too: the caller kills its group."""
  if _exited(p):
    return True
  try:
    state = _text(f"/proc/{p.pid}/stat").rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):  # no /proc (not Linux): as _exited said
    return False
  return state in ("Z", "X")


def _wait_exited(p: subprocess.Popen, timeout: float) -> bool:
  """Waits up to ``timeout`` seconds for ``p`` to exit, without reaping
  it; whether it did."""
  if _exited(p):
    return True
  try:
    fd = os.pidfd_open(p.pid)  # readable once p exits; reaps nothing
  except (AttributeError, OSError):  # no pidfd (old kernel, not Linux)
    fd = None
  if fd is not None:
    try:
      poller = select.poll()
      poller.register(fd, select.POLLIN)
      poller.poll(max(0.0, timeout) * 1000)
    finally:
      os.close(fd)
    return _exited(p)
  deadline = time.monotonic() + timeout
  while not _exited(p):
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.02)
  return True


def _start_servers(slots: dict[int, tuple[str, str]], env: dict,
                   tls: tuple[str, str] | None = None
                   ) -> dict[int, tuple[subprocess.Popen, str]]:
  """Starts a store server per slot (``{slot: (dir, log)}``), all at once,
  and waits for each to be ready; returns ``{slot: (process, url)}``.
  ``tls``: (certificate, key) of HTTPS servers (``https://`` URLs)."""
  started = {}
  tls_args = [] if tls is None else ["--tls-cert", tls[0], "--tls-key",
                                     tls[1]]
  scheme = "http://" if tls is None else "https://"
  try:
    for i, (d, log) in slots.items():
      ready = os.path.join(d, ".server-ready")
      private.makedirs(d)  # the server checks it (and the job directory)
      if os.path.exists(ready):
        os.unlink(ready)
      with private.open_private(log, "a") as out:
        started[i] = subprocess.Popen(
            [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
             d, "--port", "0", "--ready-file", ready, *tls_args],
            stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_no_orphans())
    t0 = time.time()
    urls = {}
    while len(urls) < len(started):
      for i, proc in started.items():
        d, log = slots[i]
        ready = os.path.join(d, ".server-ready")
        if i in urls:
          continue
        if os.path.exists(ready) and _text(ready).strip():
          urls[i] = scheme + _text(ready).strip()
        elif _exited(proc) or time.time() - t0 > 60:
          raise StoreError(f"the store server for {d} did not start; see"
                           f" {log}")
      time.sleep(0.05)
  except BaseException:
    for proc in started.values():
      _signal_group(proc, signal.SIGKILL)
      proc.wait()
    raise
  return {i: (started[i], urls[i]) for i in started}


def _stop_servers(procs: Sequence[subprocess.Popen],
                  grace: float = 10.0) -> None:
  """SIGTERM to each store server's group, SIGKILL to what is left of the
  groups once the servers exited or ``grace`` seconds passed (their exits
  noted, not reaped: a group's id stays its own), then reaps them."""
  for p in procs:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in procs:
    _wait_exited(p, max(0.0, deadline - time.monotonic()))
    _signal_group(p, signal.SIGKILL)
    p.wait()


def _ensure_servers(servers: dict[int, tuple[subprocess.Popen, str]],
                    count: int, job_dir: str, env: dict,
                    tls: tuple[str, str] | None = None) -> list[str]:
  """Store servers for slots 0..count-1 and for every slot in ``servers``
  (started so far: its store may hold data the next generation restores);
  updates ``servers`` and returns every slot's URL, in slot order.

  A server that died, or is dying (:func:`_gone`: a SIGKILLed server whose
  threads are still being torn down is not yet waitable), is reaped and
  restarted on a new port, also for a slot a shrink dropped; its store
  directory and data stay.
  """
  dead = [i for i in sorted(servers) if _gone(servers[i][0])]
  for i in dead:
    p = servers.pop(i)[0]
    _signal_group(p, signal.SIGKILL)  # what it left in its group
    print(f"tenplex-jax launch: the store server of slot {i} died"
          f" (exit {p.wait()}); restarting it", file=sys.stderr, flush=True)
  servers.update(_start_servers(
      {i: (os.path.join(job_dir, "store", str(i)),
           os.path.join(job_dir, f"server_{i}.log"))
       for i in sorted(set(range(count)) | set(dead))
       if i not in servers}, env, tls))
  return [servers[i][1] for i in sorted(servers)]


def _pythonpath() -> str:
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  return os.pathsep.join([root] + [p for p in os.environ.get(
      "PYTHONPATH", "").split(os.pathsep) if p])


class _Child:
  """One training process, in its own process group, and two threads that
  note when it died (``time.time()``): one waits for its exit status; the
  other reads a pipe whose write end only the child holds, which the kernel
  closes together with the child's sockets, so its end is seen before a
  peer can fail in sympathy (a collective whose connection closed), even
  for a SIGKILL, which leaves no report."""

  def __init__(self, index: int, cmd: Sequence[str], env: dict,
               wake: threading.Event, standby: _Standby | None = None,
               nice: int | None = None):
    # ``nice``: the nice value the process runs its command at (from its
    # first instruction, not from whenever the launcher gets to it).
    if standby is not None:  # already started: hand it its rank
      if nice is not None:
        _set_nice(standby.popen.pid, nice)
      self.popen, r = standby.assign(cmd, env)
    else:
      r, w = os.pipe()
      try:
        self.popen = subprocess.Popen(list(cmd), env=env, pass_fds=(w,),
                                      start_new_session=True,
                                      preexec_fn=_no_orphans(nice))
      except BaseException:
        os.close(r)
        raise
      finally:
        os.close(w)
    self.index, self.exit_time, self.eof_time = index, None, None
    self._code: int | None = None
    self._wake = wake
    self._threads = [threading.Thread(target=self._wait, daemon=True),
                     threading.Thread(target=self._watch, args=(r,),
                                      daemon=True)]
    for t in self._threads:
      t.start()

  def _wait(self) -> None:
    # Notes the exit status without reaping the child: its pid, the id of
    # the group _stop signals, stays the child's until reap().
    try:
      info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped by someone else
      info = None
    if info is None:
      self._code = self.popen.wait()
    elif info.si_code == os.CLD_EXITED:
      self._code = info.si_status
    else:  # killed by a signal (CLD_KILLED, CLD_DUMPED)
      self._code = -info.si_status
    self.exit_time = time.time()
    self._wake.set()

  def _watch(self, r: int) -> None:
    try:
      while os.read(r, 4096):
        pass
    except OSError:
      pass
    finally:
      os.close(r)
    self.eof_time = time.time()
    self._wake.set()

  @property
  def code(self) -> int | None:
    return None if self.exit_time is None else self._code

  def reap(self) -> None:
    """Reaps the child once it has exited (after the last signal to its
    group); a child still running is left alone."""
    if self.exit_time is not None:
      self.popen.wait()

  def died_at(self) -> float | None:
    """When it died: the pipe's end, else its exit status's arrival."""
    times = [t for t in (self.eof_time, self.exit_time) if t is not None]
    return min(times) if times else None

  def join(self, timeout: float) -> None:
    self._threads[0].join(timeout)


# What a standby process imports ahead of its rank (``standby_imports``).
STANDBY_IMPORTS = ("jax", "jax.numpy", "numpy", "flax", "flax.linen",
                   "flax.training.train_state", "optax",
                   "tenplex_jax.store.api")


def _standby_form(cmd: Sequence[str]) -> tuple[str, str] | None:
  """``("path", SCRIPT)`` for ``python SCRIPT ARGS``, ``("module", MODULE)``
  for ``python -m MODULE ARGS``; ``None`` for any other command (no
  standby processes then)."""
  cmd = list(cmd)
  if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
    return None
  if cmd[1] == "-m" and len(cmd) > 2:
    return "module", cmd[2]
  if cmd[1].endswith(".py") and os.path.isfile(cmd[1]):
    return "path", cmd[1]
  return None


class _Standby:
  """A process of a later generation, started ahead of need: Python with
  the heavy modules imported (``tenplex_jax.runtime._standby``), waiting on
  a pipe for its rank and environment (:meth:`assign`). It says on a second
  pipe when its imports are done (:meth:`ready`). Its own process group, and
  the kernel kills it with the launcher, as a child's."""

  def __init__(self, cmd: Sequence[str], form: tuple[str, str], env: dict):
    r, self._w = os.pipe()  # the assignment: only this process and we
    watch_r, watch_w = os.pipe()  # its end, seen as a _Child's
    ready_r, ready_w = os.pipe()  # a byte once its imports are done
    try:
      self.popen = subprocess.Popen(
          [cmd[0], "-m", "tenplex_jax.runtime._standby", str(r), str(ready_w),
           *form],
          env=env, pass_fds=(r, watch_w, ready_w), start_new_session=True,
          preexec_fn=_no_orphans())
    except BaseException:
      os.close(self._w)
      os.close(watch_r)
      os.close(ready_r)
      raise
    finally:
      os.close(r)
      os.close(watch_w)
      os.close(ready_w)
    self._watch = watch_r
    self._ready: int | None = ready_r
    self.started = time.monotonic()
    self.ready_at: float | None = None  # (time.monotonic())

  def alive(self) -> bool:
    """Unassigned and not dying (:func:`_gone`: a process whose main thread
    has ended is no process to hand a rank to, even before it is
    waitable)."""
    return self._w is not None and not _gone(self.popen)

  def ready(self) -> bool:
    """Whether its imports are done (it wrote its byte; never blocks)."""
    if self.ready_at is None and self._ready is not None:
      if select.select([self._ready], [], [], 0)[0]:
        if os.read(self._ready, 1):  # (b"": it ended before it was ready)
          self.ready_at = time.monotonic()
        self._close_ready()
    return self.ready_at is not None

  def late(self, limit: float) -> bool:
    """Not ready ``limit`` seconds after its start (its imports hang, or
    run that much slower than they should)."""
    return not self.ready() and time.monotonic() - self.started > limit

  def _close_ready(self) -> None:
    if self._ready is not None:
      os.close(self._ready)
      self._ready = None

  def assign(self, cmd: Sequence[str], env: dict
             ) -> tuple[subprocess.Popen, int]:
    """Hands the process its command line and environment; returns it and
    the read end of its death-watch pipe. Raises OSError when it died."""
    w, self._w = self._w, None
    self._close_ready()
    argv = list(cmd)[2:] if cmd[1] == "-m" else list(cmd)[1:]
    try:
      os.write(w, json.dumps({"argv": argv, "env": env}).encode())
    except OSError:
      os.close(self._watch)
      raise
    finally:
      os.close(w)
    return self.popen, self._watch

  def kill(self) -> None:
    """Ends an unassigned standby (its group) and reaps it."""
    if self._w is not None:
      os.close(self._w)
      self._w = None
      os.close(self._watch)
    self._close_ready()
    _signal_group(self.popen, signal.SIGKILL)
    self.popen.wait()


def _drop_late_standbys(standbys: list[_Standby], limit: float) -> None:
  """Kills and removes the standbys of ``standbys`` that died, and those not
  ready ``limit`` seconds after their start (each named on stderr): a
  standby whose imports hang would hold up the generation handed it."""
  for sb in [sb for sb in standbys if not sb.alive() or sb.late(limit)]:
    if sb.alive():
      print(f"tenplex-jax launch: standby process {sb.popen.pid} not ready"
            f" {time.monotonic() - sb.started:.1f} s after its start (standby"
            f" timeout {limit:g} s): killed it", file=sys.stderr, flush=True)
    standbys.remove(sb)
    sb.kill()


def _start_child(index: int, cmd: Sequence[str], env: dict,
                 wake: threading.Event, standbys: list[_Standby],
                 nice: int | None = None,
                 standby_timeout: float = float("inf")) -> _Child:
  """A generation's process: a standby's, taken from ``standbys`` (a ready
  one first, else the one that started first, none past
  ``standby_timeout``: see :func:`_drop_late_standbys`), else a new one;
  ``nice``: its nice value from the start (see _Child)."""
  _drop_late_standbys(standbys, standby_timeout)
  standbys.sort(key=lambda sb: (not sb.ready(), sb.started))
  while standbys:
    sb = standbys.pop(0)
    if sb.alive():
      try:
        return _Child(index, cmd, env, wake, standby=sb, nice=nice)
      except OSError:  # it died just now
        pass
    sb.kill()
  return _Child(index, cmd, env, wake, nice=nice)


def _set_nice(pid: int, nice: int) -> bool:
  """Sets the nice value of every thread of process ``pid`` (Linux: a
  thread's own, ``/proc/PID/task``; threads it starts later inherit their
  creator's). False when a thread refused (gone, or not permitted)."""
  try:
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
  except OSError:
    tids = [pid]
  ok = True
  for tid in tids:
    try:
      os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
      ok = False
  return ok


_NICE_OK: dict = {}


def _can_renice(nice: int) -> bool:
  """Whether this process may raise a thread's nice value to ``nice`` and
  lower it back to its own (root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE``):
  tried once, on a thread of its own."""
  if nice not in _NICE_OK:
    out = []

    def probe():
      tid = threading.get_native_id()
      try:
        base = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, base + nice)
        os.setpriority(os.PRIO_PROCESS, tid, base)
        out.append(True)
      except (OSError, AttributeError):
        out.append(False)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    _NICE_OK[nice] = bool(out and out[0])
  return _NICE_OK[nice]


class _Ahead:
  """A generation started ahead of its turn (:func:`expect_resizes`): its
  processes run the script up to :func:`wait_turn`; :meth:`hand` gives
  them the turn (``TENPLEX_TURN_FILE``: the launcher's ``time.time()``).
  ``step`` None: the generation prepared for a failure."""

  def __init__(self, gen: int, n: int, step: int | None, key: str,
               children: list[_Child], turn_file: str, started: float,
               nice: int = 0):
    self.gen, self.n, self.step, self.key = gen, n, step, key
    self.children, self.turn_file = children, turn_file
    # While it prepares, its processes run at a lower priority (``nice``
    # more than the launcher's) than the running generation's: their
    # threads, and those they start, until the turn. The children were
    # started at it (_start_child's ``nice``).
    self.nice = nice if nice and _can_renice(nice) else 0
    # ``started``: noted before its first process was started (a standby
    # given its rank runs the script at once).
    self.started = started
    # The prepare timeout's clock: from the start, or, for a generation that
    # waits for another's programs (wait_programs), from when they came.
    self.since = self.started
    self.programs: str | None = None  # wait_programs's file, until written

  def alive(self) -> bool:
    return all(c.code is None for c in self.children)

  def ready(self, job_dir: str) -> bool:
    """Every process waits for its turn (compiled, warmed up)."""
    return not self.not_ready(job_dir)

  def not_ready(self, job_dir: str) -> list[int]:
    """The processes that have not marked themselves ready (in
    :func:`wait_turn`), by index."""
    return [i for i in range(self.n) if not os.path.exists(
        os.path.join(job_dir, f"ready_{self.gen}_{i}.txt"))]

  def overdue(self, job_dir: str, limit: float,
              warmup: float | None = None) -> bool:
    """Not ready ``limit`` seconds after its clock started (``since``), and
    not waiting for another generation's programs; or (``warmup``) a
    process not ready ``warmup`` seconds after its warm-up mark
    (:func:`warming_up`)."""
    if self.programs is None and time.time() - self.since > limit:
      return not self.ready(job_dir)
    return warmup is not None and bool(self.warmup_late(job_dir, warmup))

  def warmup_late(self, job_dir: str, warmup: float) -> list[int]:
    """The processes not ready ``warmup`` seconds after their warm-up mark
    (:func:`warming_up`), by index."""
    now, late = time.time(), []
    for i in self.not_ready(job_dir):
      try:
        t = float(_text(os.path.join(job_dir, f"warmup_{self.gen}_{i}.txt")))
      except (OSError, ValueError):  # no mark yet (or being written)
        continue
      if now - t > warmup:
        late.append(i)
    return late

  def release_programs(self) -> None:
    """Tells a generation waiting for another's programs (wait_programs)
    to compile now; its prepare timeout counts from here."""
    if self.programs is not None:
      with private.open_private(self.programs):
        pass
      self.programs = None
      self.since = time.time()

  def hand(self, saved: float | None = None,
           env: dict[str, str] | None = None) -> None:
    """The turn: when it was handed, and when the previous generation's
    last process had saved (``saved``, when known); ``env``: variables the
    processes set before they restore (a generation prepared for a failure:
    its start and failed step). Their priority is the launcher's again
    first, also when they had not finished preparing."""
    if self.nice:
      base = os.getpriority(os.PRIO_PROCESS, 0)
      for c in self.children:
        _set_nice(c.popen.pid, base)
    with private.open_private(self.turn_file + ".tmp") as f:
      json.dump({"handed": time.time(), "saved": saved, "env": env or {},
                 "failure": self.step is None, "started": self.started,
                 "nice": self.nice}, f)
    os.replace(self.turn_file + ".tmp", self.turn_file)
    if self.nice:  # threads a thread still at the lower priority started
      base = os.getpriority(os.PRIO_PROCESS, 0)
      for c in self.children:
        _set_nice(c.popen.pid, base)


def _cache_env(job_dir: str, cache: bool | str) -> dict[str, str]:
  """The environment that points jax's persistent compilation cache at the
  job's (see :func:`launch`'s ``compilation_cache``)."""
  if cache is False or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return {}
  path = os.path.join(job_dir, "compilation_cache") if cache is True \
      else os.path.abspath(cache)
  os.makedirs(path, mode=0o700, exist_ok=True)
  return {"JAX_COMPILATION_CACHE_DIR": path, "TENPLEX_COMPILATION_CACHE": "1",
          # every executable, however fast it compiled or small it is
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _stop(children: list[_Child], wake: threading.Event,
          grace: float = _GRACE) -> dict[int, int]:
  """SIGTERM to every live child's process group, SIGKILL to all of them
  ``grace`` seconds later (or when they are gone); waits for the children.

  Returns the signal this sent to each child that was still alive then
  (SIGKILL overrides SIGTERM), so that a death it caused is not blamed.
  Then reaps the children that have exited: a later call signals none of
  their groups (:func:`_signal_group`)."""
  sent = {}
  for c in children:
    if c.code is None:
      _signal_group(c.popen, signal.SIGTERM)
      sent[c.index] = signal.SIGTERM
  deadline = time.time() + grace
  while any(c.code is None for c in children) and time.time() < deadline:
    wake.wait(0.05)
    wake.clear()
  for c in children:  # also what the children left in their groups
    if c.code is None:
      sent[c.index] = signal.SIGKILL
    _signal_group(c.popen, signal.SIGKILL)
  for c in children:
    c.join(30)
    c.reap()
  return sent


def _failure_report(job_dir: str, gen: int, i: int) -> dict | None:
  try:
    return json.loads(_text(os.path.join(job_dir, f"failure_{gen}_{i}.json")))
  except (OSError, ValueError):
    return None


def _describe(code: int, report: dict | None) -> tuple[str, str]:
  """(kind, words) of a failure: how the process ended."""
  if report is not None:
    if report.get("kind") == "exit":
      return "exit", f"exited: {report.get('error')}"
    return report.get("kind", "exception"), f"raised {report.get('error')}"
  if code < 0:
    name = signal.Signals(-code).name if -code in signal.valid_signals() \
        else str(-code)
    extra = " (the kernel's OOM killer sends it too)" if name == "SIGKILL" \
        else ""
    return "signal", f"was killed by {name}{extra}"
  return "exit", f"exited with code {code}"


# What a process's error says when a peer's end broke its collective or its
# coordination service (gloo's TCP pairs, the distributed runtime's gRPC):
# a failure in sympathy, whatever the clocks say.
_PEER_LOST = ("connection closed by peer", "connection reset by peer",
              "broken pipe", "socket closed")


def _in_sympathy(report: dict | None) -> bool:
  """Whether a failure report's error is a peer's end seen from here."""
  error = str((report or {}).get("error", "")).lower()
  return any(words in error for words in _PEER_LOST)


def _first_failure(children: list[_Child], job_dir: str, gen: int,
                   sent: dict[int, int], stop_time: float
                   ) -> tuple[int, str, str, float]:
  """The process that failed first, once the generation has been stopped:
  ``(index, kind, words, when)``.

  Deaths the launcher caused (its SIGTERM/SIGKILL to a live process) and
  reports written after it began to stop the generation do not count. A
  process killed by a signal (SIGKILL from the OOM killer or a person, a
  SIGSEGV) comes before processes that raised or aborted: those may have
  failed in sympathy (a collective whose peer vanished raises; jax's
  distributed runtime aborts when the coordinator is gone), a signal death
  cannot; and those before processes whose report says a peer's end broke
  their collective (:func:`_in_sympathy`), which on a loaded host can be
  written before the launcher notes the peer's exit. Then the earliest
  time: a process's own report (written before it exits), else when its
  end was seen.
  """
  cands = []
  for c in children:
    report = _failure_report(job_dir, gen, c.index)
    if report is not None and report.get("time", 0) >= stop_time:
      report = None  # its reaction to being stopped
    code = c.code
    ours = code is not None and code < 0 and sent.get(c.index) == -code
    bad = code not in (None, 0, RESIZE_EXIT_CODE) and not ours
    if report is None and not bad:
      continue
    signalled = report is None and code is not None and code < 0 and \
        -code != signal.SIGABRT
    times = [t for t in (c.died_at(), (report or {}).get("time"))
             if t is not None]
    when = min(times) if times else stop_time
    rank = 0 if signalled else 2 if _in_sympathy(report) else 1
    cands.append(((rank, when, c.index), c, report, when))
  if not cands:  # every end was caused by the stop: blame the first seen
    c = min(children, key=lambda c: (c.died_at() or stop_time, c.index))
    cands = [((0, 0, 0), c, None, c.died_at() or stop_time)]
  _, c, report, when = min(cands, key=lambda x: x[0])
  kind, words = _describe(c.code, report)
  return c.index, kind, words, when


def _heartbeats(job_dir: str, n: int, since: float) -> list[float]:
  """When each process last showed life (``heartbeat_<i>``: initialised,
  restored, a step, a snapshot), at least ``since``."""
  out = []
  for i in range(n):
    try:
      out.append(max(since, os.stat(os.path.join(job_dir,
                                                 f"heartbeat_{i}")).st_mtime))
    except OSError:
      out.append(since)
  return out


def _main_thread_frames(text: str) -> list[str]:
  """The ``File ...`` lines of the main thread in a ``faulthandler`` dump
  (innermost first); Python lists the main thread last."""
  blocks = [b for b in text.split("\n\n") if "most recent call first" in b]
  if not blocks:
    return []
  return [ln.strip() for ln in blocks[-1].splitlines()
          if ln.strip().startswith("File ")]


_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}


def _blocked_on_futex(pid: int) -> bool | None:
  """Whether ``pid``'s main thread waits on a futex (a lock, a condition: how
  a thread blocked in a collective waits), from ``/proc/PID/syscall``."""
  nr = _FUTEX.get(platform.machine())
  try:
    first = _text(f"/proc/{pid}/syscall").split()[0]
  except (OSError, IndexError):
    return None
  if nr is None or first == "running":
    return None if nr is None else False
  try:
    return int(first) == nr
  except ValueError:
    return None


def _in_group(pid: int, group: int) -> bool:
  """Whether process ``pid`` is in process group ``group`` (a live child's:
  its id is the child's own while the child is not reaped), so a signal to
  ``pid`` reaches one of the child's processes, never a process that got a
  dead one's pid."""
  try:
    return os.getpgid(pid) == group
  except OSError:
    return False


def _hang_culprit(children: list[_Child], job_dir: str, gen: int
                  ) -> tuple[int, dict]:
  """Which process of a hung generation to blame, and the evidence.

  Every process with failure hooks dumps its Python stacks on SIGUSR2
  (kept in the job dir). The culprit is a process that is active: running,
  sleeping or in I/O (its main thread not waiting on a futex in most of 10
  samples, as a thread blocked in
  a jax collective waits); else one in jax's shutdown barrier (it left the
  training loop while the others wait for it in a collective); else the
  process with the lowest step, then the lowest index. It is a best guess:
  a process that hangs on a lock of its own looks like one waiting in a
  collective.
  """
  pids, groups = {}, {}
  for c in children:
    if c.code is not None:
      continue
    groups[c.index] = c.popen.pid
    try:
      pids[c.index] = int(_text(os.path.join(job_dir,
                                             f"pid_{gen}_{c.index}.txt")))
    except (OSError, ValueError):
      pids[c.index] = c.popen.pid
  # Where each main thread waits, sampled 10 times over 0.5 s (a thread
  # blocked in a collective can be seen between two waits).
  samples = {i: [] for i in pids}
  for _ in range(10):
    for i, pid in pids.items():
      samples[i].append(_blocked_on_futex(pid))
    time.sleep(0.05)
  waiting = {i: None if None in v else sum(v) * 2 >= len(v)
             for i, v in samples.items()}
  sent = {}
  for i, pid in pids.items():
    path = os.path.join(job_dir, f"stacks_{gen}_{i}.txt")
    # (SIGUSR2 ends a process without the hooks: only to one of the
    # child's own processes, never to a pid that a dead one left behind)
    if os.path.exists(path) and _in_group(pid, groups[i]):
      try:
        os.kill(pid, signal.SIGUSR2)
        sent[i] = path
      except OSError:
        pass
  deadline = time.time() + 2
  while time.time() < deadline and not all(
      os.path.getsize(p) > 0 for p in sent.values()):
    time.sleep(0.05)
  time.sleep(0.1)  # let the last dump finish
  where = {}
  for i in pids:
    try:
      frames = _main_thread_frames(_text(sent[i])) if i in sent else []
    except OSError:
      frames = []
    if any("distributed.py" in f and "shutdown" in f for f in frames):
      where[i] = "exiting"
    elif waiting[i] is None:
      where[i] = "unknown"
    else:
      where[i] = "waiting" if waiting[i] else "active"
  steps = _progress_of(job_dir, len(children))
  rank = {"active": 0, "exiting": 1, "waiting": 2}
  live = list(pids) or [c.index for c in children]
  culprit = min(live, key=lambda i: (rank.get(where.get(i), 3), steps[i], i))
  return culprit, {"where": where, "steps": steps,
                   "stacks": sorted(sent.values())}


def _wait(children: list[_Child], wake: threading.Event, job_dir: str,
          gen: int, pending: dict, t_end: float | None,
          step_timeout: float | None,
          first_step: Callable[[float], None],
          tick: Callable[[], None] | None = None,
          poll: Callable[[], float | None] | None = None,
          grace: Callable[[], float] | None = None,
          overdue: Callable[[], str | None] | None = None) -> dict:
  """Waits for the generation to end: all processes done, or the first
  failure (then stops the others at once). Returns ``codes``, ``first``
  (the index of the first process that failed, or None), and for a
  failure ``kind``, ``error``, ``failed_at``, ``detected_at``,
  ``stopped_at``. Calls ``first_step(time)`` when a process first reports
  a step, ``tick()`` about once a second after that, and ``poll()`` on
  every wake (every 50 ms, or as many seconds as ``poll`` returned).
  ``grace()``: the seconds between SIGTERM and SIGKILL when it stops the
  others after a failure (default ``_GRACE``). ``overdue()``: for a
  generation prepared ahead that had its turn before it was ready, a reason
  to give up on it (its prepare timeout passed before every process was
  ready), else None; the generation is then stopped and the reason returned
  as ``replaced``, not as a failure."""
  start = time.time()
  n = len(children)
  stepped = False
  ticked = start
  interval = 0.05
  while True:
    wake.wait(interval)
    wake.clear()
    if poll is not None:
      interval = poll() or 0.05
    now = time.time()
    if stepped and tick is not None and now - ticked > 1:
      ticked = now
      tick()
    if not stepped:
      seen = [os.stat(p).st_mtime for p in (
          os.path.join(job_dir, f"progress_{i}") for i in range(n))
          if os.path.exists(p)]
      if seen:
        stepped = True
        first_step(min(seen))
    reports = {c.index: _failure_report(job_dir, gen, c.index)
               for c in children}
    if any(r is not None for r in reports.values()) or any(
        c.code not in (None, 0, RESIZE_EXIT_CODE) for c in children):
      stop_time = time.time()
      sent = _stop(children, wake, _GRACE if grace is None else grace())
      first, kind, words, failed_at = _first_failure(children, job_dir, gen,
                                                     sent, stop_time)
      return {"codes": [c.code for c in children], "first": first,
              "kind": kind, "error": words,
              "failed_at": min(failed_at, now), "detected_at": now,
              "stopped_at": time.time()}
    if all(c.code is not None for c in children):
      return {"codes": [c.code for c in children], "first": None}
    late = overdue() if overdue is not None else None
    if late is not None:
      _stop(children, wake, 0)
      return {"codes": [c.code for c in children], "first": None,
              "replaced": late}
    if step_timeout is not None:
      last = _heartbeats(job_dir, n, start)
      idle = [now - last[c.index] for c in children if c.code is None]
      if idle and max(idle) > step_timeout:
        first, evidence = _hang_culprit(children, job_dir, gen)
        where = evidence["where"].get(first, "unknown")
        _stop(children, wake, 0.2)  # jax takes SIGTERM as a preemption
        return {"codes": [c.code for c in children], "first": first,
                "kind": "hang",
                "error": f"hung: no step for {step_timeout:g} s (main"
                         f" thread {where}; all processes:"
                         f" {evidence['where']}; stacks in"
                         f" {', '.join(evidence['stacks']) or 'none'})",
                "failed_at": last[first], "detected_at": now,
                "stopped_at": time.time(), "hang": evidence}
    if pending["request"]:
      pending["request"] = None
      _signalled_request(job_dir, n)
    if t_end is not None and now > t_end:
      _print_stacks(children, job_dir, gen)
      raise TimeoutError("tenplex-jax launch: timed out")


def _print_stacks(children: list[_Child], job_dir: str, gen: int,
                  what: str | None = None) -> None:
  """At the launcher's timeout: where the generation's live processes are,
  on stderr (each one's main thread waiting or active, its last step, and
  its Python stacks, dumped on SIGUSR2 as for a hang), so that a job that
  timed out (whose directory may be gone) shows where it stood. ``what``:
  another occasion (a generation prepared ahead that was not ready in time,
  whose processes have no steps)."""
  try:
    _, ev = _hang_culprit(children, job_dir, gen)
  except Exception as e:  # noqa: BLE001 - the timeout is raised anyway
    print(f"tenplex-jax launch: {what or 'timed out'}; no stacks ({e!r})",
          file=sys.stderr, flush=True)
    return
  if what is None:
    print(f"tenplex-jax launch: timed out in generation {gen}: main threads"
          f" {ev['where']}, steps {ev['steps']}", file=sys.stderr, flush=True)
  else:
    print(f"tenplex-jax launch: {what}: main threads {ev['where']}",
          file=sys.stderr, flush=True)
  for path in ev["stacks"]:
    try:
      text = _text(path).strip()
    except OSError:
      continue
    if len(text) > 6000:
      text = "...\n" + text[-6000:]  # the main thread is last
    print(f"tenplex-jax launch: {os.path.basename(path)} (generation {gen}'s"
          f" Python stacks):\n{text}", file=sys.stderr, flush=True)


# A generation prepared ahead without a step timeout to size it by: seconds
# it may take to get ready (see launch's prepare_timeout).
_PREPARE_TIMEOUT = 600.0


def _prepare_limit(prepare_timeout: float | None,
                  step_timeout: float | None) -> float:
  """Seconds a generation prepared ahead may take to get ready (see
  :func:`launch`'s ``prepare_timeout``): ``prepare_timeout`` if given, else
  twice ``step_timeout`` (a prepared generation does what a generation does
  before its first step, at a lower priority beside the running one), else
  ``_PREPARE_TIMEOUT``.

  Example:
    >>> _prepare_limit(None, None), _prepare_limit(None, 60), _prepare_limit(45, 60)
    (600.0, 120.0, 45.0)
  """
  if prepare_timeout is not None:
    return float(prepare_timeout)
  if step_timeout is not None:
    return 2.0 * step_timeout
  return _PREPARE_TIMEOUT


def _checkpoint_location(checkpoint: str) -> str:
  """The checkpoint location the scripts get: a local directory made
  absolute, an ``s3://`` or ``gs://`` URL as given; ``UsageError`` for a
  store server or an unknown scheme."""
  loc = parse_location(checkpoint)
  if loc.kind == LOCAL:
    return os.path.abspath(loc.target)
  if loc.kind != OBJECT:
    raise UsageError(f"--checkpoint {checkpoint}: a directory, s3:// or"
                     " gs://, not a store server")
  return loc.target


def launch(cmd: Sequence[str], *, procs: int, devices_per_proc: int,
           schedule: str | None = None, job_dir: str | None = None,
           max_generations: int = 16, timeout: float | None = None,
           max_restarts: int = 3, on_failure: str = "same",
           checkpoint: str | None = None, replicas: int = 0,
           step_timeout: float | None = None, tls_cert: str | None = None,
           tls_key: str | None = None, tls_ca: str | None = None,
           compilation_cache: bool | str = True,
           standby: bool = True,
           standby_imports: Sequence[str] | None = None,
           standby_timeout: float = 300.0,
           prepare_ahead: int = 4, prepare_nice: int = 10,
           prepare_timeout: float | None = None,
           warmup_timeout: float | None = None,
           prepare_retries: int = 1, on_hang: str | None = None,
           hang_restarts: int | None = None) -> int:
  """Runs ``cmd`` as ``procs`` processes; relaunches it on resizes and
  after failures.

  Args:
    cmd: the training script's command line.
    procs: processes of the first generation.
    devices_per_proc: simulated CPU devices per process.
    schedule: a file of ``step S procs M`` lines.
    job_dir: the job's directory (stores, logs, progress); default: a new
      one under ``/dev/shm``, removed when the job succeeds (else kept and
      its path printed). One given is refused
      (:class:`~tenplex_jax.errors.UnsafePathError`) if it, or a directory
      above it, belongs to another user or is writable by group or others;
      everything the launcher, its processes and store servers write there
      is private (directories 0700, files 0600).
    max_generations: relaunches (resizes and restarts) at most.
    timeout: seconds for the whole job; past it the launcher prints where
      the running generation's processes are (their Python stacks) to
      stderr, stops everything and raises ``TimeoutError``.
    max_restarts: relaunches after a process failure (an uncaught
      exception, a nonzero exit other than a resize, a signal, or a hang)
      before giving up.
    on_failure: ``"same"`` relaunches on as many processes, ``"shrink"`` on
      one fewer (at least one).
    checkpoint: an Orbax checkpoint directory (``TENPLEX_CHECKPOINT``) the
      script may write with :func:`save_checkpoint`; restores fall back to
      it when no store copy survives.
    replicas: the default of :func:`save_snapshot`'s ``replicas``.
    step_timeout: a process that reports no step (:func:`resize_due`) for
      this many seconds (the first step counts from the generation's start,
      so allow for compilation and the restore) is hung: the launcher names
      it, stops the generation and relaunches. Default: no limit.
    tls_cert: a PEM certificate for the store servers (valid for
      127.0.0.1): they then serve HTTPS only, and the processes reach them
      at ``https://`` URLs.
    tls_key: its private key (both or neither).
    tls_ca: the CA file the processes verify the servers against, handed to
      them as ``TENPLEX_JAX_STORE_CA`` (default: the launcher's own
      ``$TENPLEX_JAX_STORE_CA``, else the system's CAs).
    compilation_cache: jax's persistent compilation cache for every
      generation's processes (``JAX_COMPILATION_CACHE_DIR``, every
      executable written, however fast it compiled): ``True`` (default)
      puts it in ``JOB_DIR/compilation_cache``, a string names the
      directory, ``False`` leaves jax's settings alone. A mesh the job ran
      before then loads its compiled steps instead of compiling them. A
      ``JAX_COMPILATION_CACHE_DIR`` in the launcher's environment wins.
    standby: keep processes for the next generation started, with Python
      and ``standby_imports`` imported, waiting for their rank before
      ``jax.distributed`` starts (``tenplex_jax.runtime._standby``): a resize
      or a restart hands them the process count and ranks over a pipe
      instead of starting interpreters. As many as the largest generation
      so far, started with the first generation and, as replacements, once
      a generation has reported its first step (their imports then do not
      slow a resize); an unused or dead one costs only its memory and is
      replaced in the background (checked about once a second while a
      generation runs), as is one not ready within ``standby_timeout``; a
      generation takes the ready ones first; all are killed when the job
      ends. Only for ``python SCRIPT ...`` and ``python -m MODULE ...``
      commands (others always start afresh).
    standby_imports: the modules a standby imports (default: jax, numpy,
      flax, flax.linen, flax.training.train_state, optax and the store's
      restore path; those not installed are skipped). Import nothing whose
      import has effects the script relies on seeing later.
    standby_timeout: seconds a standby may take from its start to finish
      its imports (default 300, for a loaded host: they take seconds on an
      idle one); one past it whose imports hang (a stuck network file
      system, a lock) is killed, named on stderr, and replaced, and no
      generation is handed it.
    prepare_ahead: generations the launcher starts ahead of their turn, at
      most, for the resizes the script expects (:func:`expect_resizes`):
      their processes import, start ``jax.distributed``, compile their step
      (into the compilation cache) and warm up while the running generation
      trains, then wait in :func:`wait_turn`; once every running process
      saved for that resize (same step and process count) the launcher hands
      them the turn, and they restore. A generation whose resize does not
      come is stopped; one that fails before its turn is not started again;
      the resize then starts its processes as without it. One that is not
      ready in time (``prepare_timeout``) is stopped and prepared again. 0:
      none.
    prepare_nice: how much lower the priority of a generation's processes
      is than the launcher's while they prepare (their nice value, every
      thread's, until their turn), so that the running generation's steps
      come first: default 10, 0 leaves it. Only where the launcher may
      lower a nice value again (root, ``CAP_SYS_NICE``, or ``ulimit -e``
      20); elsewhere they prepare at the launcher's priority. The old
      processes of a resize handed to a prepared generation exit at that
      lower priority too (raising it needs no privilege), so that their
      shutdown gives way to the new generation's restore and first step.
    prepare_timeout: seconds a generation prepared ahead (for a resize or a
      failure) may take to get ready, every process waiting in
      :func:`wait_turn`, counted from its start (for one started early, from
      when the programs it waited for came: :func:`wait_programs`). Default:
      twice ``step_timeout``, else 600. A generation past it and not ready
      hangs (e.g. jaxlib 0.10.2's XLA:CPU gloo communicators, created in its
      warm-up step, can deadlock): the launcher prints its processes' Python
      stacks to stderr with a line naming the generation and its processes
      not ready, stops all of them (their process groups, reaped) and, before
      its turn, prepares it again in the background (``prepare_retries``
      times; after that the resize starts its processes at the turn, and a
      failure restarts as without it). At its turn, or handed the turn and
      still not ready when the time is up, it is replaced by processes
      started then, as without a generation ahead: the running generation
      loses no step and repeats none, and a resize waits for a prepared
      generation only until its prepare timeout runs out.
    warmup_timeout: seconds each process of a generation prepared ahead
      may take from its warm-up mark (:func:`warming_up`, which the script
      calls after its compile, before its warm-up step) to its ready mark
      (:func:`wait_turn`). A hang there (the gloo deadlock above) is then
      caught that long after the compile, however long the imports and
      compile took, while ``prepare_timeout`` still bounds the whole from
      the start; past it the generation is handled as past
      ``prepare_timeout``. Default: none.
    prepare_retries: how many times a generation prepared ahead that was
      not ready in time is prepared again, per resize (and per running
      generation for the one prepared for a failure); default 1.
    on_hang: like ``on_failure``, for a generation stopped by
      ``step_timeout`` (default: ``on_failure``). A hang loses no device: a
      deadlock in a step (e.g. jaxlib 0.10.2's XLA:CPU gloo collectives,
      rarely, with several devices per process) is restarted on as many
      processes with ``"same"``, where a script keeps its layout.
    hang_restarts: relaunches after hangs (``step_timeout``) before giving
      up, counted apart from ``max_restarts`` (default: they share
      ``max_restarts``). A script that allows no restart after a lost
      process (it would repeat the steps since its last save) may still
      allow them after a hang, which repeats those steps from the same
      state on the same layout.

  Each process runs in its own process group; on the first failure the
  launcher sends SIGTERM to the others' groups and SIGKILL 2 s later (0.2 s
  when a generation prepared for the failure is ready to take over), and
  on SIGINT/SIGTERM/SIGHUP to itself it stops every process and store
  server before it exits. The job's store token (``TENPLEX_JAX_STORE_TOKEN``:
  the launcher's own if set, else a new random one) is handed to the
  processes and the store servers in their environment.

  Returns:
    The script's exit code: 0 when the last generation finished, else the
    failing process's code (negative: killed by that signal).

  Example:
    >>> launch(["python", "train.py"], procs=2, devices_per_proc=2,
    ...        schedule="sched.txt")  # doctest: +SKIP
    0
  """
  if on_failure not in ("same", "shrink"):
    raise UsageError(f"on_failure must be 'same' or 'shrink', not"
                     f" {on_failure!r}")
  if on_hang not in (None, "same", "shrink"):
    raise UsageError(f"on_hang must be 'same', 'shrink' or None, not"
                     f" {on_hang!r}")
  if hang_restarts is not None and (not isinstance(hang_restarts, int)
                                    or hang_restarts < 0):
    raise UsageError(f"launch: hang_restarts must be a count >= 0, not"
                     f" {hang_restarts!r}")
  for name, v in (("procs", procs), ("devices_per_proc", devices_per_proc)):
    if not isinstance(v, int) or v < 1:
      raise UsageError(f"launch: {name} must be a positive integer, not {v!r}")
  if not isinstance(prepare_ahead, int) or prepare_ahead < 0:
    raise UsageError(f"launch: prepare_ahead must be a count >= 0, not"
                     f" {prepare_ahead!r}")
  if not isinstance(prepare_nice, int) or not 0 <= prepare_nice <= 19:
    raise UsageError(f"launch: prepare_nice must be a nice increment in"
                     f" 0..19, not {prepare_nice!r}")
  if step_timeout is not None and not step_timeout > 0:
    raise UsageError(f"launch: step_timeout must be positive seconds, not"
                     f" {step_timeout!r}")
  if prepare_timeout is not None and not prepare_timeout > 0:
    raise UsageError(f"launch: prepare_timeout must be positive seconds, not"
                     f" {prepare_timeout!r}")
  if warmup_timeout is not None and not warmup_timeout > 0:
    raise UsageError(f"launch: warmup_timeout must be positive seconds, not"
                     f" {warmup_timeout!r}")
  if not isinstance(prepare_retries, int) or prepare_retries < 0:
    raise UsageError(f"launch: prepare_retries must be a count >= 0, not"
                     f" {prepare_retries!r}")
  if not standby_timeout > 0:
    raise UsageError(f"launch: standby_timeout must be positive seconds, not"
                     f" {standby_timeout!r}")
  limit = _prepare_limit(prepare_timeout, step_timeout)
  if schedule and not os.path.isfile(schedule):
    raise UsageError(f"launch: the schedule {schedule!r} is not a file")
  tls, tls_ca = check_tls_options(tls_cert, tls_key, tls_ca)
  token = resolve_token() or new_token()  # (a malformed one: UsageError)
  temporary = job_dir is None
  if not temporary:  # before anything is made there (mkdtemp's is 0700)
    private.check_dir(job_dir, what="job directory", inner=False)
  job_dir = os.path.abspath(job_dir or tempfile.mkdtemp(
      prefix="tenplex-job-", dir="/dev/shm" if os.path.isdir("/dev/shm")
      else None))
  private.makedirs(job_dir)
  private.check_dir(job_dir, what="job directory", inner=False)
  if temporary:
    print(f"tenplex-jax launch: job directory {job_dir} (temporary: removed"
          " when the job succeeds)", flush=True)
  base_env = {**os.environ, "PYTHONPATH": _pythonpath(), TOKEN_ENV: token}
  if tls_ca:
    base_env[CA_ENV] = tls_ca
  base_env.update(_cache_env(job_dir, compilation_cache))
  form = _standby_form(cmd) if standby else None
  standby_env = {**base_env, STANDBY_IMPORTS_ENV: ",".join(
      STANDBY_IMPORTS if standby_imports is None else standby_imports)}
  standbys: list[_Standby] = []
  most = procs  # standbys to keep: the largest generation so far

  def refill():
    """Replaces dead standbys and those not ready within the standby
    timeout, and starts missing ones (with the first generation; later
    once a generation reported its first step, so that their imports do
    not slow a resize)."""
    if form is None:
      return
    _drop_late_standbys(standbys, standby_timeout)
    while len(standbys) < most:
      standbys.append(_Standby(cmd, form, standby_env))
  servers: dict[int, tuple[subprocess.Popen, str]] = {}
  children: list[_Child] = []
  wake = threading.Event()
  pending = {"request": None}

  def on_usr1(*_):
    pending["request"] = True

  stopping = []

  def on_stop(signum, _frame):
    if not stopping:  # once; and not while cleaning up
      stopping.append(signum)
      raise _Interrupted(signum)

  old_handlers = {}
  if threading.current_thread() is threading.main_thread():
    old_handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_usr1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
      old_handlers[sig] = signal.signal(sig, on_stop)
  n = procs
  start_step = 0
  failed_step = None
  restarts = 0
  hangs = 0  # restarts after a hang, when hang_restarts counts them apart
  code = 1
  record = None  # the last failure's line, written once the job went on
  t_end = None if timeout is None else time.time() + timeout
  # Run ids (TENPLEX_RUN): this launch and the generation; unique across
  # launches of a job dir, so that restore never combines one step's
  # snapshots written by different generations or launches.
  launch_id = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"

  def write_record():
    with private.open_private(os.path.join(job_dir, "failures.jsonl"),
                              "a") as f:
      f.write(json.dumps(record) + "\n")

  def ensure_servers(count):
    return _ensure_servers(servers, count, job_dir, base_env, tls)

  def gen_env(i, count, port, g, step, urls, failed=None):
    env = {**base_env,
           "TENPLEX_COORDINATOR": f"127.0.0.1:{port}",
           "TENPLEX_NUM_PROCS": str(count), "TENPLEX_PROC_ID": str(i),
           "TENPLEX_DEVICES": str(devices_per_proc),
           "TENPLEX_STORE": os.path.join(job_dir, "store", str(i)),
           "TENPLEX_STORES": json.dumps(
               [os.path.join(job_dir, "store", str(j)) for j in range(count)]),
           "TENPLEX_PEERS": json.dumps(urls),
           "TENPLEX_JOB_DIR": job_dir,
           "TENPLEX_GENERATION": str(g),
           "TENPLEX_RUN": f"{launch_id}-g{g}",
           "TENPLEX_START_STEP": str(step),
           "TENPLEX_REPLICAS": str(replicas)}
    env.pop("TENPLEX_FAILED_STEP", None)
    env.pop("TENPLEX_TURN_FILE", None)
    env.pop("TENPLEX_FOR_FAILURE", None)
    if failed is not None:
      env["TENPLEX_FAILED_STEP"] = str(failed)
    if schedule:
      env["TENPLEX_SCHEDULE"] = os.path.abspath(schedule)
    if checkpoint:
      env["TENPLEX_CHECKPOINT"] = _checkpoint_location(checkpoint)
    return env

  # Generations started ahead of their turn (expect_resizes), and the last
  # expectations read.
  ahead: list[_Ahead] = []
  expected = {"mtime": None, "data": None}
  void: set[int] = set()  # generations that failed: their expectations are void
  numbers = {"next": 0}  # generation numbers handed out
  failed_ahead: set[int] = set()  # steps whose generation ahead failed
  # The generation prepared for a failure of the running one (at most one:
  # expect_resizes's failure), and the generations whose one failed early.
  standby_gen: list[_Ahead] = []
  failed_standby: set[int] = set()

  def drop_ahead(which):
    for a in [a for a in ahead if which(a)]:
      ahead.remove(a)
      _stop(a.children, wake, 0)

  def drop_standby_gen():
    for a in standby_gen:
      _stop(a.children, wake, 0)
    standby_gen.clear()

  def start_ahead(count, step, key, start, wait=False):
    """A generation of ``count`` processes started ahead: for the resize at
    ``step``, or (``step`` None) for a failure; ``start``: its start step;
    ``wait``: another generation compiles its key (wait_programs)."""
    g = numbers["next"]
    numbers["next"] += 1
    urls = ensure_servers(count)
    port = free_port()
    turn = os.path.join(job_dir, f"turn_{g}")
    programs = os.path.join(job_dir, f"programs_{g}")
    extra = {"TENPLEX_TURN_FILE": turn}
    if step is None:  # the script may lay it out for the failure (fewer hosts)
      extra["TENPLEX_FOR_FAILURE"] = "1"
    if wait:
      extra["TENPLEX_PROGRAMS_FILE"] = programs
    # Its processes prepare at the lower priority from their start: a
    # standby given its rank runs the script at once.
    low = (min(19, os.getpriority(os.PRIO_PROCESS, 0) + prepare_nice)
           if prepare_nice and _can_renice(prepare_nice) else None)
    started = time.time()
    kids = [_start_child(i, cmd, {**gen_env(i, count, port, g, start, urls),
                                  **extra},
                         wake, standbys, nice=low,
                         standby_timeout=standby_timeout)
            for i in range(count)]
    a = _Ahead(g, count, step, key, kids, turn, started, prepare_nice)
    a.programs = programs if wait else None
    return a

  def prepare(cur):
    """Starts the generations the running script expects (at most
    ``prepare_ahead`` at a time; one key at a time, see expect_resizes)."""
    p = os.path.join(job_dir, "expected_resizes.json")
    try:
      mtime = os.stat(p).st_mtime_ns
    except OSError:
      return
    if mtime != expected["mtime"]:
      try:
        expected.update(data=json.loads(_text(p)), mtime=mtime)
      except (OSError, ValueError):  # being replaced
        return
    data = expected["data"]
    if data.get("generation") in void:  # until the restarted one announces its own
      return
    for a in [a for a in ahead if not a.alive()]:  # failed before its turn: the
      failed_ahead.add(a.step)                     # resize starts it as usual
      print(f"tenplex-jax launch: generation {a.gen}, started ahead for step"
            f" {a.step}, failed before its turn (exit codes"
            f" {[c.code for c in a.children]}); not starting it again",
            file=sys.stderr, flush=True)
      drop_ahead(lambda x, a=a: x is a)
    for a in [a for a in standby_gen if not a.alive()]:
      failed_standby.add(cur["gen"])
      print(f"tenplex-jax launch: generation {a.gen}, prepared for a failure,"
            f" failed before its turn (exit codes"
            f" {[c.code for c in a.children]}); not starting it again",
            file=sys.stderr, flush=True)
      drop_standby_gen()
    # Keys being compiled: by the running generation before its first step,
    # by generations ahead not yet ready (but those waiting for programs).
    busy = {a.key for a in ahead + standby_gen
            if a.programs is None and not a.ready(job_dir)}
    mine = data.get("generation") == cur["gen"]
    if not cur["stepped"] and mine:
      busy.add(data.get("key"))
    for a in ahead + standby_gen:  # their programs are in the cache now
      if a.programs is not None and a.key not in busy:
        a.release_programs()
    busy |= {a.key for a in ahead + standby_gen if not a.ready(job_dir)}
    early = bool(data.get("early")) and mine
    for step, count, key in sorted(data.get("resizes", [])):
      if len(ahead) >= prepare_ahead:
        break
      if step <= cur["start"] or any(a.step == step for a in ahead) \
          or (key in busy and not early) or step in failed_ahead:
        continue
      a = start_ahead(count, step, key, step, wait=key in busy)
      ahead.append(a)
      busy.add(key)
      print(f"tenplex-jax launch: generation {a.gen} ({count} processes, from"
            f" step {step}) started ahead"
            + (" (waits for its programs)" if a.programs else ""), flush=True)
    failure = data.get("failure")
    # The generation for a failure: once the running one stepped (a failure
    # before that restarts as usual), and only if a restart would have its
    # process count.
    if (failure and mine and cur["stepped"] and not standby_gen
        and cur["gen"] not in failed_standby and restarts < max_restarts
        and int(failure[0]) == (max(1, cur["n"] - 1)
                                if on_failure == "shrink" else cur["n"])
        and failure[1] not in busy):
      a = start_ahead(int(failure[0]), None, failure[1], cur["start"])
      standby_gen.append(a)
      print(f"tenplex-jax launch: generation {a.gen} ({a.n} processes)"
            " prepared for a failure", flush=True)

  def hand_over(cur):
    """Hands the turn to the generation started ahead for the resize the
    running one saved for, as soon as every process saved (before they
    exit)."""
    if cur["handed"] is not None or not ahead:
      return
    infos, saved = [], 0.0
    for i in range(cur["n"]):
      p = os.path.join(job_dir, f"resize_{i}.json")
      try:
        mtime = os.stat(p).st_mtime
        if mtime < cur["started"]:
          return  # an earlier generation's
        infos.append(json.loads(_text(p)))
        saved = max(saved, mtime)
      except (OSError, ValueError):  # not yet (or being written)
        return
    if len({(x["procs"], x["step"]) for x in infos}) != 1:
      return
    info = infos[0]
    a = next((a for a in ahead if a.step == info["step"]
              and a.n == info["procs"]), None)
    if a is None or not a.alive():
      return
    a.hand(saved)
    cur.update(handed=a, handed_info=info)
    if prepare_nice:  # the old processes' exit (jax.distributed's shutdown)
      base = os.getpriority(os.PRIO_PROCESS, 0)  # gives way to the new ones
      for c in children:
        _set_nice(c.popen.pid, min(19, base + prepare_nice))

  retried: dict = {}  # the generations prepared again, by what they were for
  given_up: list[_Ahead] = []  # those the prepare timeout stopped

  def give_up(a, cur, at_turn=False):
    """Stops ``a``, a generation prepared ahead that was not ready in time
    (its processes' stacks printed first), and says what happens instead:
    before its turn it is prepared again (``prepare_retries`` times per
    resize, or per running generation for one prepared for a failure), at
    its turn the resize (or restart) starts its processes afresh."""
    late = a.not_ready(job_dir)
    if warmup_timeout is not None and a.warmup_late(job_dir, warmup_timeout):
      why = (f"not ready {warmup_timeout:g} s after its warm-up began"
             f" (warm-up timeout; processes not ready: {late})")
    else:
      since = "its start" if a.since == a.started else "its programs came"
      why = (f"not ready {time.time() - a.since:.1f} s after {since}"
             f" (prepare timeout {limit:g} s; processes not ready: {late})")
    what = (f"generation {a.gen} ({a.n} processes, "
            + (f"started ahead for step {a.step}" if a.step is not None
               else "prepared for a failure") + f") {why}")
    _print_stacks(a.children, job_dir, a.gen, what)
    _stop(a.children, wake, 0)
    given_up.append(a)
    if a.step is None:
      key = ("failure", cur["gen"])
    else:
      key = ("resize", a.step, a.n, a.key)
    retried[key] = retried.get(key, 0) + 1
    if at_turn:
      then = "its turn came: the processes start afresh"
    elif retried[key] <= prepare_retries:
      then = f"preparing it again ({retried[key]} of {prepare_retries})"
    else:
      if a.step is None:
        failed_standby.add(cur["gen"])
      else:
        failed_ahead.add(a.step)
      then = ("not preparing it again: "
              + ("its resize starts its processes at the turn"
                 if a.step is not None
                 else "a failure restarts as without it"))
    print(f"tenplex-jax launch: {what}; stopped it, {then}", file=sys.stderr,
          flush=True)
    return what

  def guard(cur):
    """Gives up on the generations prepared ahead that are overdue (not
    ready within the prepare timeout); prepare() starts them again."""
    for group in (ahead, standby_gen):
      for a in [a for a in group
                if a.alive() and a.overdue(job_dir, limit, warmup_timeout)]:
        group.remove(a)
        give_up(a, cur)

  try:
    adopt = None  # a generation started ahead that has its turn
    for _ in range(max_generations):
      if adopt is None:
        gen = numbers["next"]
        numbers["next"] += 1
        urls = ensure_servers(n)
        port = free_port()
        for i in range(max(n, len(children))):  # this generation's only
          for name in (f"progress_{i}", f"heartbeat_{i}"):
            try:
              os.unlink(os.path.join(job_dir, name))
            except FileNotFoundError:
              pass
        children, prepared_as = [], None
        wake.clear()
        for i in range(n):
          children.append(_start_child(
              i, cmd, gen_env(i, n, port, gen, start_step, urls, failed_step),
              wake, standbys, standby_timeout=standby_timeout))
      else:
        # (one that still waits for another's programs compiles them now)
        adopt.release_programs()
        prepared_as = None if adopt.ready(job_dir) else adopt
        gen, children, adopt = adopt.gen, adopt.children, None
        for i in range(n):  # the previous generation's last step's
          p = os.path.join(job_dir, f"progress_{i}")
          try:
            if int(_text(p)) <= start_step:
              os.unlink(p)
          except (OSError, ValueError):
            pass
      if gen == 0:  # ready by the first resize, which follows the first compile
        refill()
      if record is not None:  # the relaunch after a failure is under way
        record["relaunched_s"] = round(time.time() - record["failed_at"], 3)
      cur = {"gen": gen, "n": n, "start": start_step, "started": time.time(),
             "stepped": False, "handed": None, "handed_info": None,
             # a generation prepared ahead that had its turn before it was
             # ready: watched for the prepare timeout until it is
             "prepared": prepared_as}

      def first_step(at):
        nonlocal record
        cur["stepped"] = True
        refill()
        if record is not None:  # the new generation trains again
          record["resumed_s"] = round(at - record["failed_at"], 3)
          write_record()
          record = None

      def poll():
        if prepare_ahead > 0:
          guard(cur)
          prepare(cur)
          hand_over(cur)
          if ahead:  # a hand-over is 10 ms from the save at most
            return 0.01
          if standby_gen:
            return 0.05
        return None
      def grace():
        # A generation prepared for the failure is waiting for the turn: the
        # survivors, blocked in a collective with the dead process, take
        # SIGTERM as jax's preemption notice and would only be SIGKILLed
        # after the full grace, which the restart would wait for.
        return 0.2 if any(a.alive() and a.ready(job_dir)
                          for a in standby_gen) else _GRACE
      def overdue():
        a = cur["prepared"]
        if a is None or not a.overdue(job_dir, limit, warmup_timeout):
          if a is not None and a.ready(job_dir):  # the step timeout's now
            cur["prepared"] = None
          return None
        return give_up(a, cur, at_turn=True)
      out = _wait(children, wake, job_dir, gen, pending, t_end, step_timeout,
                  first_step, refill, poll, grace, overdue)
      codes, first = out["codes"], out["first"]
      _stop(children, wake, 0)  # whatever the children left behind
      if "replaced" in out:  # the resize (or restart) starts afresh instead
        print(f"tenplex-jax launch: generation {gen} was not ready in time;"
              f" starting {n} processes from step {start_step} afresh",
              flush=True)
        continue
      if all(c == 0 for c in codes):
        code = 0
        break
      if first is None and all(c == RESIZE_EXIT_CODE for c in codes):
        # when the old processes had exited (for the script's timeline: did
        # their exit overlap the new generation's restore and first step?)
        with private.open_private(os.path.join(job_dir,
                                               f"exited_{gen}.json")) as f:
          json.dump({"exit_times": [c.died_at() for c in children]}, f)
        info = cur["handed_info"] or json.loads(
            _text(os.path.join(job_dir, "resize_0.json")))
        n, start_step = int(info["procs"]), int(info["step"])
        most = max(most, n)
        failed_step = None
        # (the one handed the turn, unless the prepare timeout stopped it
        # since: then the one prepared again, if any)
        handed = cur["handed"] if cur["handed"] not in given_up else None
        adopt = handed or next(
            (a for a in ahead if a.step == start_step and a.n == n
             and a.alive()), None)
        if adopt is not None and (adopt not in ahead or not adopt.alive()):
          # handed the turn, but it failed before it could take it (prepare
          # already dropped it, or is about to): the resize starts afresh
          if adopt in ahead:
            failed_ahead.add(adopt.step)
            print(f"tenplex-jax launch: generation {adopt.gen}, started ahead"
                  f" for step {adopt.step}, failed before its turn (exit codes"
                  f" {[c.code for c in adopt.children]}); not starting it"
                  " again", file=sys.stderr, flush=True)
            drop_ahead(lambda x, a=adopt: x is a)
          adopt = None
        if adopt is not None and adopt.overdue(job_dir, limit, warmup_timeout):
          ahead.remove(adopt)  # warming up still, past its prepare timeout
          give_up(adopt, cur, at_turn=True)
          adopt = None
        if adopt is not None:
          ahead.remove(adopt)
          if adopt is not cur["handed"]:
            adopt.hand()
        # (those for this step or earlier can no longer be used; the one for
        # a failure was the old generation's)
        drop_ahead(lambda a: a.step <= start_step)
        drop_standby_gen()
        print(f"tenplex-jax launch: generation {gen}: {cur['n']} -> {n}"
              f" processes at step {start_step}"
              + (f" (generation {adopt.gen}, started ahead)" if adopt
                 else ""), flush=True)
        continue
      void.add(gen)  # a failure: the expectations are void (the generations
      # started ahead are stopped after the restart has its turn, not before)
      if first is None:  # some finished, some exited for a resize
        print(f"tenplex-jax launch: generation {gen}: the processes"
              f" disagree (exit codes {codes}); stopping", file=sys.stderr,
              flush=True)
        code = 1
        break
      # A failure: the first process that failed (the others were stopped
      # after it).
      code = codes[first]
      reached = _progress_of(job_dir, n)
      failed_step = max(reached + [failed_step or 0, start_step])
      if record is not None:  # the previous failure's generation never
        write_record()        # reached a step
      detect = out["detected_at"] - out["failed_at"]
      stopped = out["stopped_at"] - out["failed_at"]
      record = {"generation": gen, "process": first, "exit_code": code,
                "exit_codes": codes, "step": failed_step, "processes": n,
                "kind": out["kind"], "error": out["error"],
                "failed_at": out["failed_at"],
                "detected_s": round(detect, 3), "stopped_s": round(stopped, 3)}
      if "hang" in out:
        record["hang"] = out["hang"]
      print(f"tenplex-jax launch: generation {gen}: process {first}"
            f" {out['error']}; detected after {detect:.2f} s, generation"
            f" stopped after {stopped:.2f} s", flush=True)
      hung = out["kind"] == "hang"
      apart = hung and hang_restarts is not None  # counted apart
      used, allowed = (hangs, hang_restarts) if apart else (restarts, max_restarts)
      if used >= allowed:
        write_record()
        record = None
        print(f"tenplex-jax launch: generation {gen}: process {first}"
              f" failed (exit code {code}) at step {failed_step}; no"
              f" {'hang ' if apart else ''}restarts left ({allowed} used),"
              f" giving up", file=sys.stderr, flush=True)
        break
      if apart:
        hangs += 1
      else:
        restarts += 1
      mode = on_hang if hung and on_hang is not None else on_failure
      if mode == "shrink":  # drop the failed process's slot
        n = max(1, n - 1)
      # The generation prepared for this failure takes over, if it is alive
      # and has the restart's process count.
      spare = next((a for a in standby_gen if a.alive() and a.n == n), None)
      if spare is not None and spare.overdue(job_dir, limit, warmup_timeout):
        standby_gen.remove(spare)  # warming up still, past its prepare timeout
        give_up(spare, cur, at_turn=True)
        spare = None
      print(f"tenplex-jax launch: generation {gen}: process {first} failed"
            f" (exit code {code}) at step {failed_step}; restart"
            f" {used + 1} of {allowed}{' after a hang' if apart else ''}"
            f" on {n} processes"
            + (f" (generation {spare.gen}, prepared for a failure)" if spare
               else ""), flush=True)
      if spare is not None:
        standby_gen.remove(spare)
        for i in range(max(n, len(children))):  # the failed generation's
          for name in (f"progress_{i}", f"heartbeat_{i}"):
            try:
              os.unlink(os.path.join(job_dir, name))
            except FileNotFoundError:
              pass
        urls = ensure_servers(n)  # (a dead store server restarted: new URL)
        spare.hand(env={"TENPLEX_START_STEP": str(start_step),
                        "TENPLEX_FAILED_STEP": str(failed_step),
                        "TENPLEX_PEERS": json.dumps(urls)})
        adopt = spare
      drop_ahead(lambda a: True)
      drop_standby_gen()
      code = 1
  except BaseException:
    code = None
    raise
  finally:
    stopping.append(0)
    # Nothing outlives the launcher: the generation's process groups, then
    # the store servers.
    _stop(children, wake)
    drop_ahead(lambda a: True)
    drop_standby_gen()
    for sb in standbys:
      sb.kill()
    _stop_servers([p for p, _ in servers.values()])
    if record is not None:
      write_record()
    if temporary and code == 0:
      shutil.rmtree(job_dir, ignore_errors=True)
    elif temporary:
      print(f"tenplex-jax launch: kept the job directory {job_dir}"
            " (failures.jsonl, progress, stores; it is in host memory:"
            " remove it when done)", file=sys.stderr, flush=True)
    for sig, h in old_handlers.items():
      signal.signal(sig, h)
  return code


def _progress_of(job_dir: str, n: int) -> list[int]:
  """The last step each process reported (through :func:`resize_due`)."""
  steps = []
  for i in range(n):
    try:
      steps.append(int(_text(os.path.join(job_dir, f"progress_{i}"))))
    except (OSError, ValueError):
      steps.append(0)
  return steps


def _signalled_request(job_dir: str, n: int) -> None:
  """SIGUSR1: turn ``JOB_DIR/request`` (a process count) into a request a
  few steps past the furthest process."""
  try:
    m = int(_text(os.path.join(job_dir, "request")).split()[0])
  except (OSError, ValueError, IndexError):
    print("tenplex-jax launch: SIGUSR1 without a valid JOB_DIR/request",
          file=sys.stderr)
    return
  steps = _progress_of(job_dir, n)
  p = os.path.join(job_dir, "resize_request.json")
  with private.open_private(p + ".tmp") as f:
    json.dump({"procs": m, "step": max(steps) + _MARGIN}, f)
  os.replace(p + ".tmp", p)


def check_tls_options(cert: str | None, key: str | None, ca: str | None,
                      who: str = "launch",
                      names: Sequence[str] = ("--tls-cert", "--tls-key",
                                              "--tls-ca")
                      ) -> tuple[tuple[str, str] | None, str | None]:
  """A launcher's TLS options checked: ((cert, key) or None, CA file or
  None), as absolute paths; the CA defaults to ``$TENPLEX_JAX_STORE_CA``.

  Raises:
    UsageError: only one of cert and key, a missing file, or a CA (which
      makes the processes refuse plain HTTP) without a certificate.
  """
  if (cert is None) != (key is None):
    raise UsageError(f"{who}: TLS needs both {names[0]} and {names[1]}")
  ca = client_ca(ca)
  for flag, path in zip(names, (cert, key, ca)):
    if path is not None and not os.path.isfile(path):
      raise UsageError(f"{who}: {flag} {path}: no such file")
  if cert is None:
    if ca is not None:
      raise UsageError(
          f"{who}: a CA file is set ({ca}; {names[2]} or ${CA_ENV}), so the"
          " processes refuse plain HTTP, but the store servers have no"
          f" certificate: give {names[0]} and {names[1]} (or unset it)")
    return None, None
  return ((os.path.abspath(cert), os.path.abspath(key)),
          None if ca is None else os.path.abspath(ca))


def _launch_cmd(args) -> int:
  cmd = list(args.cmd)
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    raise UsageError("launch: give the training command after --")
  code = launch(cmd, procs=args.procs, devices_per_proc=args.devices_per_proc,
                schedule=args.schedule, job_dir=args.job_dir,
                timeout=args.timeout, max_restarts=args.max_restarts,
                on_failure=args.on_failure, checkpoint=args.checkpoint,
                replicas=args.replicas, step_timeout=args.step_timeout,
                tls_cert=args.tls_cert, tls_key=args.tls_key,
                tls_ca=args.tls_ca,
                compilation_cache=(args.compilation_cache
                                   or not args.no_compilation_cache),
                standby=not args.no_standby,
                standby_imports=(None if args.standby_imports is None else
                                 [m for m in args.standby_imports.split(",")
                                  if m]),
                standby_timeout=args.standby_timeout,
                prepare_ahead=args.prepare_ahead,
                prepare_nice=args.prepare_nice,
                prepare_timeout=args.prepare_timeout,
                warmup_timeout=args.warmup_timeout,
                prepare_retries=args.prepare_retries, on_hang=args.on_hang,
                hang_restarts=args.hang_restarts)
  return 128 - code if code < 0 else code  # killed by N: 128+N, as a shell


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("launch", help="run a training script as N processes,"
                     " relaunching it on resizes")
  p.add_argument("--procs", type=int, required=True)
  p.add_argument("--devices-per-proc", type=int, default=1)
  p.add_argument("--schedule", default=None,
                 help="file with lines 'step S procs M'")
  p.add_argument("--job-dir", default=None)
  p.add_argument("--timeout", type=float, default=None)
  p.add_argument("--max-restarts", type=int, default=3,
                 help="relaunches after a process failure (default 3)")
  p.add_argument("--on-failure", choices=("same", "shrink"), default="same",
                 help="relaunch on as many processes, or on one fewer")
  p.add_argument("--on-hang", choices=("same", "shrink"), default=None,
                 help="after a hang (--step-timeout): relaunch on as many"
                 " processes, or on one fewer (default: as --on-failure)")
  p.add_argument("--hang-restarts", type=int, default=None, metavar="N",
                 help="relaunches after hangs, counted apart from"
                 " --max-restarts (default: they share --max-restarts)")
  p.add_argument("--checkpoint", default=None,
                 help="Orbax checkpoint directory, s3://BUCKET/DIR or"
                 " gs://BUCKET/DIR (TENPLEX_CHECKPOINT) to fall back to when"
                 " no store copy survives")
  p.add_argument("--replicas", type=int, default=0,
                 help="save_snapshot copies each snapshot to the next R"
                 " stores (default 0)")
  p.add_argument("--step-timeout", type=float, default=None,
                 help="seconds without a step (resize_due) after which a"
                 " process counts as hung and the job is relaunched"
                 " (default: no limit; the first step counts from the"
                 " start, compilation and restore included)")
  p.add_argument("--tls-cert", default=None,
                 help="PEM certificate (valid for 127.0.0.1) of the job's"
                 " store servers: they serve HTTPS only")
  p.add_argument("--tls-key", default=None, help="its PEM private key")
  p.add_argument("--tls-ca", default=None,
                 help="CA file the processes verify the store servers"
                 " against (TENPLEX_JAX_STORE_CA; default: the launcher's"
                 " own $TENPLEX_JAX_STORE_CA)")
  p.add_argument("--compilation-cache", metavar="DIR", default=None,
                 help="jax's persistent compilation cache for every"
                 " generation (default: JOB_DIR/compilation_cache)")
  p.add_argument("--no-compilation-cache", action="store_true",
                 help="leave jax's compilation cache settings alone")
  p.add_argument("--no-standby", action="store_true",
                 help="start every generation's processes afresh instead of"
                 " keeping standby processes (Python and jax imported)")
  p.add_argument("--standby-imports", default=None, metavar="MODULES",
                 help="comma-separated modules a standby process imports"
                 " ahead of its rank (default: jax, numpy, flax, optax and"
                 " the store's restore path)")
  p.add_argument("--standby-timeout", type=float, default=300.0,
                 metavar="SECONDS",
                 help="seconds a standby process may take to finish its"
                 " imports; past it it is killed and replaced (default 300)")
  p.add_argument("--prepare-ahead", type=int, default=4, metavar="N",
                 help="generations to start ahead of their turn for the"
                 " resizes the script expects (expect_resizes; default 4,"
                 " 0: none)")
  p.add_argument("--prepare-nice", type=int, default=10, metavar="N",
                 help="nice increment of a generation's processes while they"
                 " prepare, until their turn (default 10; 0: none; only where"
                 " the launcher may lower it again, e.g. as root)")
  p.add_argument("--prepare-timeout", type=float, default=None,
                 metavar="SECONDS",
                 help="seconds a generation started ahead may take to get"
                 " ready (compiled, warmed up); past it the launcher prints"
                 " its stacks, stops it and prepares it again (default:"
                 " twice --step-timeout, else 600)")
  p.add_argument("--warmup-timeout", type=float, default=None,
                 metavar="SECONDS",
                 help="seconds a process of a generation started ahead may"
                 " take from its warm-up mark (store.warming_up(), after its"
                 " compile) to ready; past it the generation is handled as"
                 " past --prepare-timeout (default: none)")
  p.add_argument("--prepare-retries", type=int, default=1, metavar="N",
                 help="times a generation started ahead that was not ready"
                 " in time is prepared again before its resize goes on"
                 " without it (default 1)")
  p.add_argument("cmd", nargs=argparse.REMAINDER)
  p.set_defaults(func=_launch_cmd)
