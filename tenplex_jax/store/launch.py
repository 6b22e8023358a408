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

Failures: when a process exits with any other nonzero code (or is killed),
the launcher stops the others and relaunches the script (at most
``max_restarts`` times) on as many processes (``on_failure="same"``) or on
one fewer (``"shrink"``). The new processes' :func:`restore_or_init`
restores the newest complete snapshot that :func:`save_snapshot` (called
every few steps) left in the stores or their replicas, else the newest Orbax
checkpoint in the launcher's ``checkpoint`` directory, else starts afresh,
and reports the steps lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RESIZE_EXIT_CODE", "initialize", "launch", "register",
           "request_resize", "resize_due", "restore_or_init", "save_and_exit",
           "save_snapshot"]

RESIZE_EXIT_CODE = 75
_MARGIN = 3  # steps ahead of the slowest process for signalled requests


def _text(path: str) -> str:
  with open(path) as f:
    return f.read()


def _env(name: str, default: str | None = None) -> str | None:
  return os.environ.get(name, default)


def initialize() -> dict:
  """Configures gloo CPU collectives and ``jax.distributed`` from the
  launcher's environment; returns the job description.

  Without a launcher (no ``TENPLEX_NUM_PROCS``) it is a single process job.

  Example:
    >>> info = initialize()  # doctest: +SKIP
    >>> info["num_processes"], info["process_id"]  # doctest: +SKIP
    (2, 0)
  """
  import jax
  n = int(_env("TENPLEX_NUM_PROCS", "1"))
  i = int(_env("TENPLEX_PROC_ID", "0"))
  devices = _env("TENPLEX_DEVICES")
  if devices:
    jax.config.update("jax_num_cpu_devices", int(devices))
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_env("TENPLEX_COORDINATOR"),
                               num_processes=n, process_id=i,
                               initialization_timeout=120)
  return {"num_processes": n, "process_id": i,
          "store": _env("TENPLEX_STORE"), "job_dir": _env("TENPLEX_JOB_DIR"),
          "generation": int(_env("TENPLEX_GENERATION", "0")),
          "checkpoint": _env("TENPLEX_CHECKPOINT")}


def _progress(step: int) -> None:
  job = _env("TENPLEX_JOB_DIR")
  if job:
    p = os.path.join(job, f"progress_{_env('TENPLEX_PROC_ID', '0')}")
    with open(p + ".tmp", "w") as f:
      f.write(str(step))
    os.replace(p + ".tmp", p)


def _schedule() -> list[tuple[int, int]]:
  path = _env("TENPLEX_SCHEDULE")
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
  job = _env("TENPLEX_JOB_DIR")
  if not job:
    raise RuntimeError("request_resize needs tenplex-jax launch"
                       " (TENPLEX_JOB_DIR is not set)")
  p = os.path.join(job, "resize_request.json")
  tmp = f"{p}.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump({"procs": int(procs), "step": int(at_step)}, f)
  os.replace(tmp, p)


def resize_due(step: int) -> int | None:
  """The new process count if a resize is due at ``step``, else ``None``.

  Sources: the schedule file (a ``step S procs M`` line with S == step,
  after this generation's start step) and resize requests.
  """
  _progress(step)
  start = int(_env("TENPLEX_START_STEP", "0"))
  n = int(_env("TENPLEX_NUM_PROCS", "1"))
  for s, m in _schedule():
    if s == step and s > start and m != n:
      return m
  job = _env("TENPLEX_JOB_DIR")
  if job:
    p = os.path.join(job, "resize_request.json")
    try:
      req = json.loads(_text(p))
    except (OSError, ValueError):
      req = None
    if req and req["step"] == step and step > start and req["procs"] != n:
      return int(req["procs"])
  return None


def save_snapshot(state: Any, step: int, *, replicas: int | None = None,
                  run: str | None = None) -> str:
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

  Returns:
    The committed snapshot's directory.
  """
  from tenplex_jax.store.api import save
  if replicas is None:
    replicas = int(_env("TENPLEX_REPLICAS", "0"))
  peers = json.loads(_env("TENPLEX_STORES", "[]"))
  if len(peers) < 2:
    replicas = 0  # a single process has no other host to replicate to
  store = _env("TENPLEX_STORE")
  if not store:
    raise RuntimeError("save_snapshot needs tenplex-jax launch"
                       " (TENPLEX_STORE is not set)")
  return save(state, store, step=step, replicas=replicas,
              peers=peers or None, run=run)


def save_and_exit(state: Any, step: int, *, procs: int | None = None,
                  replicas: int | None = None) -> None:
  """Saves this process's shards to its host store and exits for a resize.

  Every process calls it at the same step. The launcher relaunches the
  script with the new process count, whose :func:`restore_or_init` restores
  the state.
  """
  import jax
  procs = procs or resize_due(step) or int(_env("TENPLEX_NUM_PROCS", "1"))
  save_snapshot(state, step, replicas=replicas)
  job = _env("TENPLEX_JOB_DIR")
  if job:
    with open(os.path.join(job, f"resize_{jax.process_index()}.json"),
              "w") as f:
      json.dump({"procs": procs, "step": step}, f)
  if jax.process_count() > 1:
    jax.distributed.shutdown()
  sys.stdout.flush()
  os._exit(RESIZE_EXIT_CODE)


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
  restored step, the steps lost, the source) and prints a line.

  Returns:
    ``(state, step)``; ``step`` is 0 on a first start.
  """
  import jax
  from tenplex_jax.errors import NoCopyError
  from tenplex_jax.store.api import restore_with_report
  stores = json.loads(_env("TENPLEX_PEERS", "[]"))
  start = int(_env("TENPLEX_START_STEP", "0"))
  failed = _env("TENPLEX_FAILED_STEP")
  if not stores or (start == 0 and failed is None):
    return init_fn(), 0
  if target is None:
    target = jax.eval_shape(init_fn)
  own = _env("TENPLEX_STORE")
  locations = ([own] if own and os.path.isdir(own) else []) + stores
  ckpt = _env("TENPLEX_CHECKPOINT")
  job = _env("TENPLEX_JOB_DIR")
  gen = _env("TENPLEX_GENERATION", "0")
  try:
    state, report = restore_with_report(locations, target, checkpoint=ckpt)
  except NoCopyError as e:
    if failed is None:
      raise
    state, report, step, source = init_fn(), None, 0, f"init ({e})"
  else:
    step = report.step
    source = "checkpoint" if report.from_checkpoint else "stores"
  if job and report is not None:
    with open(os.path.join(job, f"restore_{jax.process_index()}_{gen}.json"),
              "w") as f:
      json.dump(report.to_dict(), f)
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
        with open(p + ".tmp", "w") as f:
          json.dump(info, f)
        os.replace(p + ".tmp", p)
    # resize_due counts schedule steps after the restored one.
    os.environ["TENPLEX_START_STEP"] = str(step)
  return state, step


# ------------------------------------------------------------ the launcher


def _start_server(d: str, log: str) -> tuple[subprocess.Popen, str]:
  ready = os.path.join(d, ".server-ready")
  if os.path.exists(ready):
    os.unlink(ready)
  os.makedirs(d, exist_ok=True)
  proc = subprocess.Popen(
      [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir", d,
       "--port", "0", "--ready-file", ready],
      stdout=open(log, "a"), stderr=subprocess.STDOUT,
      env={**os.environ, "PYTHONPATH": _pythonpath()})
  t0 = time.time()
  while not os.path.exists(ready):
    if proc.poll() is not None or time.time() - t0 > 60:
      proc.kill()
      raise RuntimeError(f"store server for {d} did not start; see {log}")
    time.sleep(0.05)
  return proc, "http://" + _text(ready).strip()


def _pythonpath() -> str:
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  return os.pathsep.join([root] + [p for p in os.environ.get(
      "PYTHONPATH", "").split(os.pathsep) if p])


def launch(cmd: Sequence[str], *, procs: int, devices_per_proc: int,
           schedule: str | None = None, job_dir: str | None = None,
           max_generations: int = 16, timeout: float | None = None,
           max_restarts: int = 3, on_failure: str = "same",
           checkpoint: str | None = None, replicas: int = 0) -> int:
  """Runs ``cmd`` as ``procs`` processes; relaunches it on resizes and
  after failures.

  Args:
    cmd: the training script's command line.
    procs: processes of the first generation.
    devices_per_proc: simulated CPU devices per process.
    schedule: a file of ``step S procs M`` lines.
    job_dir: the job's directory (stores, logs, progress); default: a new
      one under ``/dev/shm``.
    max_generations: relaunches (resizes and restarts) at most.
    timeout: seconds for the whole job.
    max_restarts: relaunches after a process failure (nonzero exit other
      than a resize, or killed by a signal) before giving up.
    on_failure: ``"same"`` relaunches on as many processes, ``"shrink"`` on
      one fewer (at least one).
    checkpoint: an Orbax checkpoint directory (``TENPLEX_CHECKPOINT``) the
      script may write with :func:`save_checkpoint`; restores fall back to
      it when no store copy survives.
    replicas: the default of :func:`save_snapshot`'s ``replicas``.

  Returns:
    The script's exit code: 0 when the last generation finished, else the
    failing process's code (negative: killed by that signal).

  Example:
    >>> launch(["python", "train.py"], procs=2, devices_per_proc=2,
    ...        schedule="sched.txt")  # doctest: +SKIP
    0
  """
  from tenplex_jax.store.server import free_port
  if on_failure not in ("same", "shrink"):
    raise ValueError(f"on_failure must be 'same' or 'shrink', not"
                     f" {on_failure!r}")
  job_dir = os.path.abspath(job_dir or tempfile.mkdtemp(
      prefix="tenplex-job-", dir="/dev/shm" if os.path.isdir("/dev/shm")
      else None))
  os.makedirs(job_dir, exist_ok=True)
  servers: dict[int, tuple[subprocess.Popen, str]] = {}
  pending = {"request": None}

  def on_usr1(*_):
    pending["request"] = True

  old_handler = signal.signal(signal.SIGUSR1, on_usr1)
  n = procs
  start_step = 0
  failed_step = None
  restarts = 0
  code = 1
  t_end = None if timeout is None else time.time() + timeout
  # Run ids (TENPLEX_RUN): this launch and the generation; unique across
  # launches of a job dir, so that restore never combines one step's
  # snapshots written by different generations or launches.
  launch_id = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
  try:
    for gen in range(max_generations):
      for i in range(n):
        if i in servers and servers[i][0].poll() is not None:
          print(f"tenplex-jax launch: the store server of slot {i} died"
                f" (exit {servers[i][0].returncode}); restarting it",
                file=sys.stderr, flush=True)
          del servers[i]
        if i not in servers:
          servers[i] = _start_server(os.path.join(job_dir, "store", str(i)),
                                     os.path.join(job_dir, f"server_{i}.log"))
      # Every store that may hold data: those of all slots started so far.
      urls = [servers[i][1] for i in sorted(servers)]
      port = free_port()
      for i in range(n):  # progress of this generation only
        try:
          os.unlink(os.path.join(job_dir, f"progress_{i}"))
        except FileNotFoundError:
          pass
      children = []
      for i in range(n):
        env = {**os.environ,
               "PYTHONPATH": _pythonpath(),
               "TENPLEX_COORDINATOR": f"127.0.0.1:{port}",
               "TENPLEX_NUM_PROCS": str(n), "TENPLEX_PROC_ID": str(i),
               "TENPLEX_DEVICES": str(devices_per_proc),
               "TENPLEX_STORE": os.path.join(job_dir, "store", str(i)),
               "TENPLEX_STORES": json.dumps(
                   [os.path.join(job_dir, "store", str(j)) for j in range(n)]),
               "TENPLEX_PEERS": json.dumps(urls),
               "TENPLEX_JOB_DIR": job_dir,
               "TENPLEX_GENERATION": str(gen),
               "TENPLEX_RUN": f"{launch_id}-g{gen}",
               "TENPLEX_START_STEP": str(start_step),
               "TENPLEX_REPLICAS": str(replicas)}
        env.pop("TENPLEX_FAILED_STEP", None)
        if failed_step is not None:
          env["TENPLEX_FAILED_STEP"] = str(failed_step)
        if schedule:
          env["TENPLEX_SCHEDULE"] = os.path.abspath(schedule)
        if checkpoint:
          env["TENPLEX_CHECKPOINT"] = os.path.abspath(checkpoint)
        children.append(subprocess.Popen(list(cmd), env=env))
      codes, first = _wait(children, job_dir, pending, t_end)
      if all(c == 0 for c in codes):
        code = 0
        break
      if first is None and all(c == RESIZE_EXIT_CODE for c in codes):
        info = json.loads(_text(os.path.join(job_dir, "resize_0.json")))
        print(f"tenplex-jax launch: generation {gen}: {n} -> {info['procs']}"
              f" processes at step {info['step']}", flush=True)
        n, start_step = int(info["procs"]), int(info["step"])
        failed_step = None
        continue
      # A failure: the first process that exited badly (the others were
      # stopped after it).
      if first is None:  # some finished, some exited for a resize
        print(f"tenplex-jax launch: generation {gen}: the processes"
              f" disagree (exit codes {codes}); stopping", file=sys.stderr,
              flush=True)
        code = 1
        break
      code = codes[first]
      reached = _progress_of(job_dir, n)
      failed_step = max(reached + [failed_step or 0, start_step])
      record = {"generation": gen, "process": first, "exit_code": code,
                "exit_codes": codes, "step": failed_step, "processes": n}
      with open(os.path.join(job_dir, "failures.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
      if restarts >= max_restarts:
        print(f"tenplex-jax launch: generation {gen}: process {first}"
              f" failed (exit code {code}) at step {failed_step}; no"
              f" restarts left ({max_restarts} used), giving up",
              file=sys.stderr, flush=True)
        break
      restarts += 1
      if on_failure == "shrink":  # drop the failed process's slot
        n = max(1, n - 1)
      print(f"tenplex-jax launch: generation {gen}: process {first} failed"
            f" (exit code {code}) at step {failed_step}; restart"
            f" {restarts} of {max_restarts} on {n} processes", flush=True)
      code = 1
  finally:
    signal.signal(signal.SIGUSR1, old_handler)
    for p, _ in servers.values():
      p.terminate()
    for p, _ in servers.values():
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()
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


def _wait(children, job_dir, pending, t_end) -> tuple[list[int], int | None]:
  """Waits for every child; returns the exit codes and the index of the
  first child that failed (None if none did)."""
  try:
    while True:
      codes = [c.poll() for c in children]
      if all(c is not None for c in codes):
        bad = [i for i, c in enumerate(codes)
               if c not in (0, RESIZE_EXIT_CODE)]
        return codes, (bad[0] if bad else None)
      bad = [i for i, c in enumerate(codes)
             if c not in (None, 0, RESIZE_EXIT_CODE)]
      if bad:
        t0 = time.time()  # let the others notice, then stop them
        while time.time() - t0 < 2 and any(c.poll() is None
                                           for c in children):
          time.sleep(0.05)
        for c in children:
          if c.poll() is None:
            c.kill()
        return [c.wait() for c in children], bad[0]
      if pending["request"]:
        pending["request"] = None
        _signalled_request(job_dir, len(children))
      if t_end is not None and time.time() > t_end:
        raise TimeoutError("tenplex-jax launch: timed out")
      time.sleep(0.05)
  except BaseException:
    for c in children:
      if c.poll() is None:
        c.kill()
    for c in children:
      c.wait()
    raise


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
  with open(p + ".tmp", "w") as f:
    json.dump({"procs": m, "step": max(steps) + _MARGIN}, f)
  os.replace(p + ".tmp", p)


def _launch_cmd(args) -> int:
  cmd = list(args.cmd)
  if cmd and cmd[0] == "--":
    cmd = cmd[1:]
  if not cmd:
    print("tenplex-jax launch: give the command after --", file=sys.stderr)
    return 2
  return launch(cmd, procs=args.procs, devices_per_proc=args.devices_per_proc,
                schedule=args.schedule, job_dir=args.job_dir,
                timeout=args.timeout, max_restarts=args.max_restarts,
                on_failure=args.on_failure, checkpoint=args.checkpoint,
                replicas=args.replicas)


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
  p.add_argument("--checkpoint", default=None,
                 help="Orbax checkpoint directory (TENPLEX_CHECKPOINT) to"
                 " fall back to when no store copy survives")
  p.add_argument("--replicas", type=int, default=0,
                 help="save_snapshot copies each snapshot to the next R"
                 " stores (default 0)")
  p.add_argument("cmd", nargs=argparse.REMAINDER)
  p.set_defaults(func=_launch_cmd)
