"""Runs a test's worker processes together and never leaves one behind."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_all(cmds, *, timeout: float, env=None, merge_stderr: bool = True,
            text: bool = True) -> list[subprocess.CompletedProcess]:
  """Runs ``cmds`` side by side; returns one ``CompletedProcess`` each.

  Every command starts in a process group of its own. All output pipes are
  read at once (a worker blocked on a full pipe cannot stall the others),
  the workers get ``timeout`` seconds in total, and every group still
  alive then, or when anything fails here, is killed (its return code is
  then ``-9``). With ``merge_stderr`` a worker's stderr is in its stdout.
  """
  procs, outs, threads = [], {}, []

  def talk(i, p):
    outs[i] = p.communicate()

  try:
    for cmd in cmds:
      procs.append(subprocess.Popen(
          cmd, env=env, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
          start_new_session=True))
    threads = [threading.Thread(target=talk, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in threads:
      t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
  finally:
    for p in procs:
      if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
    for t in threads:
      t.join(10)
    for p in procs:
      p.wait()

  def decode(b):
    return b.decode(errors="replace") if text and b is not None else b

  return [subprocess.CompletedProcess(p.args, p.returncode,
                                      decode(outs.get(i, (b"", b""))[0]),
                                      decode(outs.get(i, (b"", b""))[1]))
          for i, p in enumerate(procs)]


def cpu_job(devices: int, procs: int = 1, proc: int = 0,
            port: str | int | None = None):
  """Sets up jax in a fresh worker process (before anything else uses it):
  ``devices`` CPU devices, and with ``procs`` > 1 process ``proc`` of a
  ``jax.distributed`` job over gloo, coordinated on 127.0.0.1:``port``.
  Returns the ``jax`` module."""
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", devices)
  if procs > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=procs, process_id=proc,
                               initialization_timeout=60)
  return jax


def path_env(*dirs: str, env: dict | None = None) -> dict:
  """The caller's environment, updated with ``env``, with ``dirs`` first on
  ``PYTHONPATH`` (for a child that imports this checkout or these
  helpers)."""
  full = {**os.environ, **(env or {})}
  full["PYTHONPATH"] = os.pathsep.join(
      p for p in (*dirs, full.get("PYTHONPATH")) if p)
  return full


def python(code: str, *, timeout: float = 300, env: dict | None = None) -> str:
  """Runs ``code`` in a fresh Python (this checkout first on its path, the
  caller's environment updated with ``env``) and returns its stdout; a
  non-zero exit or the timeout fails the caller's test with the output's
  tails. For what only a fresh process shows (which modules an import
  loads) or what may crash its process rather than the test's worker."""
  (r,) = run_all([[sys.executable, "-c", code]], timeout=timeout,
                 env=path_env(ROOT, env=env),
                 merge_stderr=False)
  assert r.returncode == 0, (
      f"exit {r.returncode}", r.stdout[-2000:], r.stderr[-3000:])
  return r.stdout


def check_stage_change_resize(script: str, out: str, *, root: str,
                              n_params: int, hang_ahead: bool = False,
                              static_cache: str | None = None):
  """Runs an example trainer (``script``) with ``--procs 2,1``: 2 processes x
  2 devices (data 2, stage 2), then at step 2 one process x 4 devices (stage
  4, 2 microbatches), and checks what every such trainer promises: the steps
  run once each on the right processes and meshes, the new process read the
  whole state (``n_params`` float32 parameters and Adam's two moments) from
  the stores, and the losses and parameters follow the static run.

  ``hang_ahead`` (the LM trainer's ``--hang-ahead``): the process of the
  generation started ahead for step 2 hangs after its warm-up step, before
  its ready mark, once; the launcher's warm-up timeout (20 s here, from the
  process's warm-up mark after its compile, ``store.warming_up``: the
  compile, however slow on a loaded host, is not in it; the warm-up step
  and the data path's first use took 0.8 s at load 4-9, after a 21 s
  compile; one past it in the generation prepared again only makes the
  resize start its process afresh) must stop it and
  replace it, so the job ends well inside its ``--timeout`` with the
  same steps and losses, nothing of it left running or on disk (its job
  directory, its processes' ``TMPDIR``). (A prepare timeout from the
  generation's start, which must leave room for its imports and compile,
  needed 60 s: at load 13-20 a 30 s one fired while it still compiled.)

  ``static_cache`` (the LM trainer's ``--static-cache``): where the static run
  it compares with is shared with other tests'.
  """
  import json
  import sys

  import numpy as np
  where = os.path.dirname(out)
  env = {**os.environ, "PYTHONPATH": str(root), "XLA_FLAGS": "",
         "JAX_PLATFORMS": "cpu"}
  env.pop("TENPLEX_JAX_STORE_TOKEN", None)
  extra = []
  if hang_ahead:
    marker = os.path.join(where, "hang_ahead")
    extra = ["--hang-ahead", marker, "--warmup-timeout", "20"]
    env["TMPDIR"] = os.path.join(where, "tmp")
    os.mkdir(env["TMPDIR"])
  if static_cache is not None:
    extra += ["--static-cache", static_cache]
  t0 = time.monotonic()
  (run,) = run_all([[sys.executable, str(script), "--procs", "2,1",
                     "--schedule", "0:stage=2,data=2 2:stage=4,mb=2",
                     "--steps", "4", "--fast-compile", "--json", out,
                     # the job directory in the test's, also if this kills it
                     "--job-parent", where, *extra,
                     "--timeout", "400"]], timeout=450, env=env)
  wall = time.monotonic() - t0
  assert run.returncode == 0, run.stdout[-5000:]
  if hang_ahead:
    assert "--hang-ahead: process 0 of generation" in run.stdout, run.stdout[-5000:]
    # the launcher's line: which generation, its processes not ready, what it did
    assert ("not ready 20 s after its warm-up began (warm-up timeout; processes not"
            " ready: [0]); stopped it, ") in run.stdout, run.stdout[-5000:]
    # no wait for the launcher's --timeout (400 s): the guard replaced it
    assert wall < 300, (wall, run.stdout[-5000:])
    with open(marker) as f:
      hung = int(f.read())
    assert not os.path.exists(f"/proc/{hung}"), hung  # stopped and reaped
    assert not _processes_naming(marker)  # nothing of the job runs
    # (the trainer's generated dataset is kept there by design, for later runs)
    assert [x for x in os.listdir(env["TMPDIR"])
            if not x.startswith("tenplex-lm-data")] == [], os.listdir(env["TMPDIR"])
    assert sorted(os.listdir(where)) == sorted(
        [os.path.basename(out), "hang_ahead", "tmp"]), os.listdir(where)
  with open(out) as f:
    log = json.load(f)
  el, st = log["elastic"], log["static"]
  assert [r["step"] for r in el] == [0, 1, 2, 3]  # none repeated or lost
  assert [(r["procs"], r["devices_per_proc"]) for r in el] == [
      (2, 2), (2, 2), (1, 4), (1, 4)]
  assert [r["mesh"]["stage"] for r in el] == [2, 2, 4, 4]
  assert [r["microbatches"] for r in el] == [4, 4, 2, 2]
  (resized,) = [r for r in el if "resized_from" in r]
  assert resized["step"] == 2 and resized["procs_from"] == 2
  assert resized["resized_from"] == {"data": 2, "fsdp": 1, "tensor": 1,
                                     "stage": 2}
  assert resized["reconfig_bytes"] >= 3 * 4 * n_params, resized
  assert resized["reconfig_s"] >= resized["restore_s"] > 0
  np.testing.assert_allclose([r["loss"] for r in el],
                             [r["loss"] for r in st], rtol=1e-5)
  assert log["max_abs_loss_diff"] < 1e-4
  assert log["max_abs_param_diff"] < 1e-5
  assert "1 resizes across processes" in run.stdout
  assert "generation 0: 2 -> 1 processes at step 2" in run.stdout


def _processes_naming(text: str) -> list[int]:
  """Processes (not this one) whose command line names ``text``."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if text.encode() in f.read() and int(pid) != os.getpid():
          found.append(int(pid))
    except OSError:
      pass
  return found


def wait_unreaped(p: subprocess.Popen, timeout: float) -> int:
  """Waits up to ``timeout`` seconds for ``p`` to exit without reaping it;
  returns its exit code as ``Popen.returncode`` would. Until ``p.wait()``
  reaps it, its pid, the id of the process group it leads, stays its own,
  so :func:`kill_group` can still reach what it left in the group (a pid
  reaped can be an unrelated process's group id moments later).

  Raises:
    subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
  """
  deadline = time.monotonic() + timeout
  while p.returncode is None:
    try:
      info = os.waitid(os.P_PID, p.pid,
                       os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
      return p.wait()
    if info is not None:
      return info.si_status if info.si_code == os.CLD_EXITED \
          else -info.si_status
    if time.monotonic() > deadline:
      raise subprocess.TimeoutExpired(p.args, timeout)
    time.sleep(0.05)
  return p.returncode


def kill_group(p: subprocess.Popen, timeout: float = 10) -> None:
  """SIGKILL to the process group ``p`` leads (``start_new_session``),
  only while ``p`` is not reaped (its group id is then its own), then
  reaps ``p``."""
  if p.returncode is None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(p.pid, signal.SIGKILL)
  p.wait(timeout)


def start_time(pid: int) -> int | None:
  """When process ``pid`` started (clock ticks since boot, ``/proc``'s
  field 22), or ``None`` if there is no such process. With pid numbers
  reused (``pid_max`` is 32768 on many hosts), a pid alone does not name a
  process for long: kill or count one only if its start time is the one
  recorded when it was seen."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


class Seen(set):
  """Pids a test has seen, each with its start time (:func:`start_time`)
  so that a later check or kill never reaches another process that got the
  same number after it ended."""

  def __init__(self, pids=()):
    super().__init__()
    self.start: dict[int, int | None] = {}
    self.update(pids)

  def add(self, pid) -> None:
    pid = int(pid)
    self.start.setdefault(pid, start_time(pid))
    super().add(pid)

  def update(self, *iterables) -> None:
    for it in iterables:
      for pid in it:
        self.add(pid)

  def same(self, pid: int) -> bool:
    """Whether ``pid`` is still the process seen (alive or a zombie)."""
    st = self.start.get(pid)
    return st is not None and start_time(pid) == st

  def kill_groups(self, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the process group of each pid still the process seen."""
    for pid in self:
      if self.same(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.killpg(pid, sig)

  def kill(self, sig: int = signal.SIGKILL) -> None:
    """``sig`` to each pid still the process seen."""
    for pid in self:
      if self.same(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.kill(pid, sig)
