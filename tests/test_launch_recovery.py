"""``tenplex-jax launch`` recovers from every way a training process fails.

Each test starts a launcher in its own process group (killed on the way
out), with tests/launch_train.py (2 processes x 1 device, a few steps) made
to fail by ``TRAIN_FAULTS`` in chosen generations: an uncaught exception, a
SIGKILL (what the OOM killer sends), ``sys.exit(4)``, and a hang caught by
``--step-timeout``. The launcher must name the process that failed first
(not the one that failed in sympathy), relaunch within seconds, and leave no
process behind. Fast tests with trivial commands cover SIGTERM to the
launcher and the temporary job directory.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

import procs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "",
       "JAX_PLATFORMS": "cpu"}
ENV.pop("TENPLEX_JAX_STORE_TOKEN", None)

pytestmark = pytest.mark.slow


def _text(path):
  with open(path) as f:
    return f.read()


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # a zombie is dead too
    return _text(f"/proc/{pid}/stat").split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


@contextlib.contextmanager
def launcher(tmp, cmd, *opts, job=True, **env):
  """``tenplex-jax launch OPTS -- CMD`` in its own session; it and every
  process the test saw it start are SIGKILLed on the way out."""
  args = [sys.executable, "-m", "tenplex_jax", "launch", *opts]
  if job:
    args += ["--job-dir", os.path.join(tmp, "job")]
  # Append mode: the processes write through the same open file as this
  # test reads with seek(0), and a shared offset moved back by that seek
  # would let their next line overwrite the log's start (a launcher
  # test once saw 'pid 2110' and then a line cut to 'pid', for 60 s).
  log = open(os.path.join(tmp, "launch.log"), "a+")
  p = subprocess.Popen(args + ["--timeout", "150", "--", *cmd],
                       env={**ENV, **{k: str(v) for k, v in env.items()}},
                       stdout=log, stderr=subprocess.STDOUT,
                       start_new_session=True)
  seen = procs.Seen()  # pids with their start times: never a reused pid
  try:
    yield p, log, seen
  finally:
    procs.kill_group(p)  # only while not reaped: then its group is ours
    seen.kill_groups()
    log.close()


def assert_private(job, skip=()):
  """Every directory under ``job`` (itself included) is 0700 and every
  file 0600 or stricter (issue 22), but for ``skip`` (what the script
  itself writes, and jax's compilation cache entries: jax writes them with
  its own modes, inside the launcher's 0700 ``compilation_cache``)."""
  n = 0
  for d, _, files in os.walk(job):
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
    cache = os.path.relpath(d, job).split(os.sep)[0] == "compilation_cache"
    for f in files:
      if f not in skip and not cache:
        mode = stat.S_IMODE(os.lstat(os.path.join(d, f)).st_mode)
        assert mode & 0o177 == 0, (os.path.join(d, f), oct(mode))
        n += 1
  assert n > 0


def finish(p, log, timeout=170):
  rc = procs.wait_unreaped(p, timeout)  # reaped by launcher()'s kill_group
  log.seek(0)
  return rc, log.read()


def pids_of(job):
  """Every training process (pid files) and store server the job had."""
  pids = [int(_text(os.path.join(job, f))) for f in os.listdir(job)
          if f.startswith("pid_")]
  return pids


def train(total):
  return [sys.executable, os.path.join(HERE, "launch_train.py"), str(total)]


def failures(job):
  return [json.loads(x) for x in
          _text(os.path.join(job, "failures.jsonl")).splitlines()]


def check_final(job, *, procs, step, generation):
  final = json.loads(_text(os.path.join(job, "final.json")))
  assert (final["procs"], final["step"], final["generation"]) == \
      (procs, step, generation), final
  for start, stop, vals in final["boxes"]:  # +1 per step, across restarts
    assert vals == [float(i + step) for i in range(start, stop)], final


STEP_TIMEOUT = 10


def test_every_failure_kind_is_named_and_recovered_in_seconds(tmp):
  # One job, one failure per generation, each after that step's snapshot:
  # g0: process 0 calls sys.exit(4) after step 2; g1: process 1 hangs after
  # step 3 (--step-timeout names it, not process 0, which waits for it in
  # the next all-reduce); g2: process 0 (jax's coordinator) is
  # SIGKILLed after step 4 and process 1 fails in sympathy; g3: process 1
  # raises after step 5 while process 0 waits in the next all-reduce (and
  # then fails in sympathy: gloo's connection closed); g4 finishes step 6.
  # The step timeout counts from each process's last heartbeat, and until a
  # generation's first step is done launch_train.py beats every 0.5 s, so
  # jax.distributed, the restore and the compiles are not in it (a whole
  # start took over 10 s at load 12-22); what is: the imports before
  # store.initialize (0.3-0.5 s unloaded) and a step of 12 floats with its
  # snapshot (milliseconds). 10 s stays well clear of both on a loaded host.
  job = os.path.join(tmp, "job")
  t0 = time.time()
  with launcher(tmp, train(6), "--procs", "2", "--max-restarts", "4",
                "--step-timeout", str(STEP_TIMEOUT), TRAIN_SNAPSHOT_EVERY=1,
                TRAIN_FAULTS="0:2:0:sysexit,1:3:1:hang,2:4:0:sigkill,"
                "3:5:1:raise") as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  wall = time.time() - t0
  assert rc == 0, out[-5000:]
  for line in ("process 0 exited: sys.exit(4)",
               "process 0 failed (exit code 4) at step 2; restart 1 of 4",
               f"process 1 hung: no step for {STEP_TIMEOUT} s",
               "process 1 failed (exit code -9) at step 3; restart 2 of 4",
               "process 0 was killed by SIGKILL",
               "process 0 failed (exit code -9) at step 4; restart 3 of 4",
               "process 1 raised RuntimeError: launch_train: an error in"
               " process 1",
               "process 1 failed (exit code 1) at step 5; restart 4 of 4 on 2"
               " processes"):
    assert line in out, (line, out[-5000:])
  fails = failures(job)
  assert [(f["generation"], f["process"], f["kind"], f["step"])
          for f in fails] == [(0, 0, "exit", 2), (1, 1, "hang", 3),
                              (2, 0, "signal", 4), (3, 1, "exception", 5)], \
      fails
  assert [f["exit_code"] for f in fails] == [4, -9, -9, 1], fails
  assert "RuntimeError" in fails[3]["error"]
  hang = fails[1]["hang"]
  assert hang["where"] == {"0": "waiting", "1": "active"}, hang
  assert "launch_train.py" in _text(os.path.join(job, "stacks_1_1.txt"))
  for f in fails:  # stopped and relaunched within seconds, not minutes
    limit = STEP_TIMEOUT + 5 if f["kind"] == "hang" else 5
    assert f["detected_s"] < limit and f["relaunched_s"] < limit + 5, f
    assert f["resumed_s"] < 60, f
  for gen, step in ((1, 2), (2, 3), (3, 4), (4, 5)):  # nothing lost
    rec = json.loads(_text(os.path.join(job, f"recovery_{gen}.json")))
    assert (rec["failed_step"], rec["restored_step"]) == (step, step), rec
  check_final(job, procs=2, step=6, generation=4)
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)]  # nothing left running
  # The launcher's, its processes' and the store servers' files (failure
  # reports, stacks, pids, progress, logs, snapshots) are private.
  assert_private(job, skip=("final.json",))
  assert {"failures.jsonl", "stacks_1_1.txt", "server_0.log",
          "recovery_1.json"} <= set(os.listdir(job))
  print(f"\nfault job: {wall:.1f} s; " + "; ".join(
      f"{f['kind']}: detected {f['detected_s']} s, relaunched"
      f" {f['relaunched_s']} s, training again {f['resumed_s']} s"
      for f in fails))


def test_a_store_server_that_died_is_restarted_for_the_next_generation(tmp):
  # Process 1 of 2 SIGKILLs its store server after its snapshot of step 4
  # and of step 5 is done, then exits (its store directory stays). The job
  # shrinks to 1 process, whose restore needs process 1's half of step 4:
  # it is only in store 1, which only a store server serves to process 0:
  # the one the launcher started again for slot 1 (on a port the kernel
  # picks again: another, or the same one where the old server's was freed).
  job = os.path.join(tmp, "job")
  with launcher(tmp, train(7), "--procs", "2", "--on-failure", "shrink",
                TRAIN_SNAPSHOT_EVERY=2, TRAIN_CRASH="5:1:server"
                ) as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert "the store server of slot 1 died (exit -9); restarting it" in out, \
      out[-5000:]
  assert "at step 5; restart 1 of 3 on 1 processes" in out, out[-5000:]
  rec = json.loads(_text(os.path.join(job, "recovery_1.json")))
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["source"], rec["dead_sources"], rec["lost_processes"]) == \
      (5, 4, 1, "stores", [], []), rec
  rep = json.loads(_text(os.path.join(job, "restore_0_1.json")))
  urls = [u for u in rep["per_source_bytes"] if u.startswith("http")]
  assert len(urls) == 1 and not rep["from_checkpoint"], rep
  server_log = _text(os.path.join(job, "server_1.log"))
  ports = re.findall(r"serving \S+ on http://127\.0\.0\.1:(\d+)",
                     server_log)  # the first server's, the new one's
  assert len(ports) == 2 and urls[0].endswith(":" + ports[-1]), (
      rep, server_log)
  check_final(job, procs=1, step=7, generation=1)
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out


def test_a_store_server_that_dies_before_the_restore_loses_no_step(tmp):
  # Process 1 of 2 exits after step 5 (a snapshot every 2 steps); the job
  # shrinks to 1 process, whose restore needs process 1's half of step 4,
  # only in store 1. That store's server dies after the launcher looked at
  # it, just before the restore: the restore raises instead of starting
  # from step 0, the launcher restarts the server (on a port the kernel
  # picks, the store intact) with the next generation, which restores step 4.
  job = os.path.join(tmp, "job")
  with launcher(tmp, train(7), "--procs", "2", "--on-failure", "shrink",
                TRAIN_SNAPSHOT_EVERY=2, TRAIN_CRASH="5:1:exit",
                TRAIN_KILL_SERVER_BEFORE_RESTORE="1:1") as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  for line in ("killed the store server of slot 1 before the restore",
               "process 0 raised tenplex_jax.errors.StoreError:"
               " restore_or_init: the job failed at step 5",
               "at step 5; restart 2 of 3 on 1 processes",
               "the store server of slot 1 died (exit -9); restarting it",
               "recovered step 4 from stores (failed at step 5, 1 steps"
               " lost)"):
    assert line in out, (line, out[-5000:])
  assert "from init" not in out, out[-5000:]
  assert not os.path.exists(os.path.join(job, "recovery_1.json"))
  rec = json.loads(_text(os.path.join(job, "recovery_2.json")))
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["source"]) == (5, 4, 1, "stores"), rec
  check_final(job, procs=1, step=7, generation=2)
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out


# SYS_exit (ends the calling thread only), per machine.
_SYS_EXIT = {"x86_64": 60, "aarch64": 93}


def _dying_process():
  """A process whose main thread ended (SYS_exit) while another thread
  sleeps: a zombie in /proc, not yet waitable (as a SIGKILLed process with a
  large address space is for up to hundreds of ms)."""
  import platform
  nr = _SYS_EXIT.get(platform.machine())
  if nr is None:
    pytest.skip(f"no SYS_exit number for {platform.machine()}")
  return subprocess.Popen(
      [sys.executable, "-c", "import ctypes, threading, time;"
       " threading.Thread(target=time.sleep, args=(120,)).start();"
       f" ctypes.CDLL(None).syscall({nr}, 0)"], start_new_session=True)


def _wait_zombie(p):
  t0 = time.time()
  while _text(f"/proc/{p.pid}/stat").rsplit(")", 1)[1].split()[0] != "Z":
    assert time.time() - t0 < 30
    time.sleep(0.01)


def test_a_standby_whose_threads_are_still_exiting_is_not_handed_a_rank():
  # The same window for a standby process: one whose main thread has ended
  # is dead, not a process to hand the generation's rank to (its rank's
  # process would be missing and the generation fail): the launcher kills
  # and reaps it and starts the process afresh.
  import threading
  from tenplex_jax.runtime import launch as L
  dying = _dying_process()
  sb = object.__new__(L._Standby)
  r, sb._w = os.pipe()
  sb._watch, watch_w = os.pipe()
  sb._ready, sb.ready_at, sb.started = None, None, time.monotonic()
  sb.popen = dying
  child = None
  try:
    _wait_zombie(dying)
    assert not L._exited(dying)
    child = L._start_child(0, [sys.executable, "-c", "pass"], dict(ENV),
                           threading.Event(), [sb])
    assert child.popen is not dying
    assert dying.returncode == -signal.SIGKILL  # killed and reaped
    assert child.popen.wait(timeout=60) == 0
  finally:
    for fd in (r, watch_w):
      os.close(fd)
    if dying.returncode is None:
      dying.kill()
      dying.wait()
    if child is not None:
      child.popen.wait(timeout=60)


def test_a_store_server_whose_threads_are_still_exiting_is_restarted(
    tmp, capfd):
  # A SIGKILLed store server's main thread is a zombie in /proc at once,
  # while its other threads are still torn down (its address space freed):
  # up to hundreds of ms on a loaded host, during which waitid does not
  # report it yet. A failure seen in that window made the launcher keep
  # the dead server's URL, and the next generation restarted from step 0
  # instead of the snapshot in that server's store. The same state, held
  # as long as needed: a process whose main thread ended (SYS_exit) while
  # another thread sleeps.
  from tenplex_jax.runtime import launch as L
  dying = _dying_process()
  servers = {1: (dying, "http://127.0.0.1:9")}
  try:
    _wait_zombie(dying)
    assert not L._exited(dying)  # not waitable: what the launcher looked at
    env = {**ENV, "TENPLEX_JAX_STORE_TOKEN": "t" * 43}
    urls = L._ensure_servers(servers, 1, tmp, env)
    assert "the store server of slot 1 died (exit -9); restarting it" in \
        capfd.readouterr().err
    assert dying.returncode == -signal.SIGKILL  # killed and reaped
    assert sorted(servers) == [0, 1] and servers[1][0] is not dying
    assert urls == [servers[0][1], servers[1][1]] and \
        urls[1] != "http://127.0.0.1:9", urls
    for p, _ in servers.values():
      assert not L._gone(p)
  finally:
    L._stop_servers([p for p, _ in servers.values()] + [dying])
  assert all(p.returncode is not None for p, _ in servers.values())


def test_a_restore_after_a_failure_does_not_skip_a_dead_servers_snapshot(
    tmp, monkeypatch):
  # After a failure, the only store that may hold the snapshot is behind a
  # store server that does not answer (it died after the launcher looked):
  # under the launcher restore_or_init raises instead of starting from
  # step 0, or from an older checkpoint, since the launcher restarts that
  # server for the next generation. Elsewhere (Ray: a lost node's store is
  # gone) it falls back as before.
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from tenplex_jax.errors import StoreError
  from tenplex_jax.runtime import launch as L
  from tenplex_jax.store import save_checkpoint
  from tenplex_jax.store.server import free_port
  sh = NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("d",)),
                     PartitionSpec())
  target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sh)}

  def init():
    return {"w": jax.device_put(jnp.zeros(4, jnp.float32), sh)}

  ck = os.path.join(tmp, "ckpt")
  save_checkpoint(ck, {"w": jax.device_put(jnp.full(4, 2.0), sh)}, 2)
  dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
  for k, v in {"TENPLEX_NUM_PROCS": "1", "TENPLEX_PROC_ID": "0",
               "TENPLEX_JOB_DIR": tmp, "TENPLEX_GENERATION": "1",
               "TENPLEX_START_STEP": "0", "TENPLEX_FAILED_STEP": "5",
               "TENPLEX_STORE": os.path.join(tmp, "no-store"),
               "TENPLEX_PEERS": json.dumps([dead]),
               "TENPLEX_JAX_STORE_TOKEN": "t" * 43}.items():
    monkeypatch.setenv(k, v)
  for checkpoint, instead in ((None, "step 0"),
                              (ck, "the checkpoint's step 2")):
    if checkpoint:
      monkeypatch.setenv("TENPLEX_CHECKPOINT", checkpoint)
    with pytest.raises(StoreError) as e:
      L.restore_or_init(init, target)
    assert "failed at step 5" in str(e.value) and dead in str(e.value) \
        and f"does not start from {instead}." in str(e.value), e.value
    assert not os.path.exists(os.path.join(tmp, "recovery_1.json"))
  monkeypatch.setenv("TENPLEX_RAY_CONTROLLER", "ray-controller")
  state, step = L.restore_or_init(init, target)
  assert step == 2 and L.last_restore["source"] == "checkpoint"
  assert (jnp.asarray(state["w"]) == 2.0).all()
  monkeypatch.delenv("TENPLEX_CHECKPOINT")
  state, step = L.restore_or_init(init, target)
  assert step == 0 and L.last_restore["source"].startswith("init (")


SLEEPER = [sys.executable, "-c",
           "import os, time; print('pid', os.getpid(), flush=True);"
           " time.sleep(120)"]


def test_sigterm_to_the_launcher_stops_every_process(tmp):
  sig = signal.SIGTERM  # SIGINT and SIGHUP take the same path
  job = None
  try:
    with launcher(tmp, SLEEPER, "--procs", "2", job=False) as (p, log, seen):
      t0 = time.time()
      while True:
        log.seek(0)
        out = log.read()
        pids = [int(x) for x in re.findall(r"^pid (\d+)", out, re.M)]
        m = re.search(r"job directory (\S+) \(temporary", out)
        job = m.group(1) if m else None
        if len(pids) == 2:
          break
        assert p.poll() is None and time.time() - t0 < 60, out
        time.sleep(0.05)
      servers = []  # the store servers: their command line names the dir
      for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
          cmdline = _text(f"/proc/{pid}/cmdline").split("\0")
        except OSError:
          continue
        if "serve" in cmdline and (os.path.join(job, "store", "0") in cmdline
                                   or os.path.join(job, "store", "1")
                                   in cmdline):
          servers.append(int(pid))
      seen.update(pids + servers)
      assert len(servers) == 2, servers
      tokens = set()  # one token for the job, in every process and server
      for pid in pids + servers:
        env = dict(kv.split("=", 1) for kv in _text(f"/proc/{pid}/environ")
                   .split("\0") if "=" in kv)
        tokens.add(env.get("TENPLEX_JAX_STORE_TOKEN"))
      assert len(tokens) == 1 and len(min(tokens) or "") >= 40, tokens
      assert_private(job)  # the job directory, logs, stores, pid files
      assert os.path.exists(os.path.join(job, "store", "0", "STORE_ID"))
      p.send_signal(sig)
      rc, out = finish(p, log, timeout=30)
    assert rc == 128 + sig, (rc, out)
    assert "tenplex-jax: error" not in out and "Traceback" not in out, out
    assert f"kept the job directory {job}" in out, out
    assert min(tokens) not in out  # never printed
    assert not [pid for pid in pids + servers
                if _alive(pid) and seen.same(pid)], out
  finally:  # also when an assertion above failed
    if job:
      shutil.rmtree(job, ignore_errors=True)


def test_temporary_job_dir_is_removed_after_success_and_token_is_kept(
    capfd, monkeypatch):
  # In this process (no launcher start-up): a token in the launcher's
  # environment is the job's, and it is not printed.
  from tenplex_jax.store.launch import launch
  monkeypatch.setenv("TENPLEX_JAX_STORE_TOKEN", "secret-tok")
  monkeypatch.setenv("PYTHONPATH", ROOT)
  cmd = [sys.executable, "-c", "import os; assert os.environ"
         "['TENPLEX_JAX_STORE_TOKEN'] == 'secret-tok'; print('ok')"]
  assert launch(cmd, procs=2, devices_per_proc=1, timeout=60) == 0
  out = capfd.readouterr().out
  job = re.search(r"job directory (\S+) \(temporary", out).group(1)
  assert out.count("ok") == 2 and not os.path.exists(job), out
  assert "secret-tok" not in out


def _standbys_of(launcher_pid):
  """The launcher's standby processes (its children running
  tenplex_jax.runtime._standby)."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      ppid = int(_text(f"/proc/{pid}/stat").split(")")[-1].split()[1])
      cmdline = _text(f"/proc/{pid}/cmdline").split("\0")
    except (OSError, ValueError, IndexError):
      continue
    if ppid == launcher_pid and "tenplex_jax.runtime._standby" in cmdline \
        and _alive(int(pid)):
      out.append(int(pid))
  return sorted(out)


def test_standby_processes_take_the_next_generation_and_none_is_left(tmp):
  # 2 processes, then 1 from step 4 (schedule), then 2 from step 8: the
  # launcher keeps 2 standbys (Python and jax imported) from generation 0
  # on; a standby killed before its turn is replaced; the
  # relaunched generations run in standby processes (their pid files name
  # standby pids), the training state is right, and when the job ends no
  # standby is left.
  job = os.path.join(tmp, "job")
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 4 procs 1\nstep 8 procs 2\n")
  with launcher(tmp, train(10), "--procs", "2", "--schedule", sched,
                TRAIN_SLEEP=0.3) as (p, log, seen):
    standbys, t0 = [], time.time()
    while len(standbys) < 2:  # started with generation 0
      assert p.poll() is None and time.time() - t0 < 60, finish(p, log)[1]
      standbys = _standbys_of(p.pid)
      time.sleep(0.05)
    observed = set(standbys)  # every standby pid seen
    seen.update(standbys)
    os.kill(standbys[0], signal.SIGKILL)  # a failed standby: replaced
    replaced, t0 = [], time.time()
    while not replaced:
      assert time.time() - t0 < 30, finish(p, log)[1]
      replaced = [x for x in _standbys_of(p.pid) if x not in standbys]
      observed.update(replaced)
      seen.update(replaced)
      time.sleep(0.05)
    while p.poll() is None:  # later generations' standbys too
      observed.update(_standbys_of(p.pid))
      seen.update(observed)
      time.sleep(0.05)
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert "generation 0: 2 -> 1 processes at step 4" in out, out[-3000:]
  assert "generation 1: 1 -> 2 processes at step 8" in out, out[-3000:]
  check_final(job, procs=2, step=10, generation=2)
  gen1 = int(_text(os.path.join(job, "pid_1_0.txt")))
  gen2 = {int(_text(os.path.join(job, f"pid_2_{i}.txt"))) for i in (0, 1)}
  assert gen1 in observed - {standbys[0]} and gen2 <= observed, (
      gen1, gen2, observed)
  assert standbys[0] not in gen2 | {gen1}
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out  # nothing left


def _pid_lines(path):
  try:
    return {int(x) for x in _text(path).split()}
  except OSError:
    return set()


def test_a_standby_whose_imports_hang_is_replaced_and_never_used(tmp):
  # 2 processes, then 1 from step 6. The launcher keeps 2 standbys, which
  # import tests/standby_hang.py (--standby-imports): the first to import
  # it never finishes. Past --standby-timeout the launcher kills it in the
  # background, says so, and starts another; generation 0 waits at step 4
  # until the test saw that (TRAIN_WAIT_READY: files only the test writes).
  # The resize's generation runs in a standby whose imports were done (its
  # pid file names it), never in the hung one; the state is right and
  # nothing is left. (An 8 s standby timeout: it counts from the standby's
  # start to the end of its imports, and these standbys import only
  # tests/standby_hang.py: no jax, no numpy; tenplex_jax.runtime._standby's
  # own imports take 0.04 s. Passed 6 of 6 beside one or two other jax
  # tests at load 6-13.)
  job = os.path.join(tmp, "job")
  token = os.path.join(tmp, "token")
  open(token, "w").close()
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 6 procs 1\n")
  with launcher(tmp, train(8), "--procs", "2", "--schedule", sched,
                "--standby-imports", "standby_hang", "--standby-timeout", "8",
                TRAIN_SLEEP=0.1, TRAIN_WAIT_READY="4:1:1",
                STANDBY_HANG_TOKEN=token) as (p, log, seen):
    deadline = time.monotonic() + 120
    while not os.path.exists(token + ".hung"):
      assert p.poll() is None and time.monotonic() < deadline, \
          finish(p, log)[1]
      time.sleep(0.05)
    hung = int(_text(token + ".hung"))
    seen.add(hung)
    # killed, and a replacement imported (with the other standby: 2)
    while _alive(hung) or len(_pid_lines(token + ".imported")) < 2:
      seen.update(_standbys_of(p.pid))
      assert p.poll() is None and time.monotonic() < deadline, (
          hung, _alive(hung), finish(p, log)[1])
      time.sleep(0.05)
    # generation 0 goes on from step 4
    open(os.path.join(job, "ready_1_0.txt"), "w").close()
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert f"standby process {hung} not ready" in out, out[-3000:]
  assert "generation 0: 2 -> 1 processes at step 6" in out, out[-3000:]
  check_final(job, procs=1, step=8, generation=1)
  gen1 = int(_text(os.path.join(job, "pid_1_0.txt")))
  imported = _pid_lines(token + ".imported")
  assert gen1 != hung and gen1 in imported, (hung, gen1, imported)
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out


def test_a_generation_takes_a_ready_standby_first_and_none_past_the_timeout(
    tmp, capfd, monkeypatch):
  # Two standbys, the first one's imports hang (tests/standby_hang.py):
  # a process of a generation is the second, ready one, though it came
  # later; with the standby timeout passed, the hung one is killed (and
  # named) instead of being handed the next rank, which a new process gets.
  import threading
  from tenplex_jax.runtime import launch as L
  token = os.path.join(tmp, "token")
  open(token, "w").close()
  env = {**ENV, "STANDBY_HANG_TOKEN": token, "PYTHONPATH": f"{ROOT}:{HERE}",
         "TENPLEX_STANDBY_IMPORTS": "standby_hang"}
  script = os.path.join(tmp, "ok.py")  # what each rank runs: exits 0
  with open(script, "w") as f:
    f.write("pass\n")
  cmd = [sys.executable, script]
  form = L._standby_form(cmd)
  standbys, children = [], []
  try:
    standbys.append(L._Standby(cmd, form, env))
    deadline = time.monotonic() + 60
    while not os.path.exists(token + ".hung"):  # the first one hangs
      assert time.monotonic() < deadline
      time.sleep(0.01)
    hung = standbys[0]
    standbys.append(L._Standby(cmd, form, env))
    while not standbys[1].ready():
      assert standbys[1].alive() and time.monotonic() < deadline
      time.sleep(0.01)
    ready = standbys[1]
    assert not hung.ready() and hung.alive() and not hung.late(3600)
    children.append(L._start_child(0, cmd, dict(ENV), threading.Event(),
                                   standbys, standby_timeout=3600))
    assert children[0].popen is ready.popen and standbys == [hung]
    children.append(L._start_child(1, cmd, dict(ENV), threading.Event(),
                                   standbys, standby_timeout=0.0))
    assert standbys == [] and hung.popen.returncode == -signal.SIGKILL
    assert children[1].popen is not hung.popen
    assert (f"standby process {hung.popen.pid} not ready"
            in capfd.readouterr().err)
    for c in children:
      assert c.popen.wait(60) == 0
  finally:
    for sb in standbys:
      sb.kill()
    for c in children:
      c.popen.kill()
      c.popen.wait()


def test_standby_runs_a_script_or_a_module_as_python_would(tmp_path, capfd):
  # A standby (imports done, no rank yet) handed a command runs it in place:
  # `python SCRIPT ARGS` with the script's directory first on sys.path,
  # `python -m MODULE ARGS` with argv[0] the module's file; the environment
  # is the one handed over (a module that fails to import is skipped), and
  # the exit status is the script's. It says when its imports are done
  # (ready). Other commands get no standby; an unused standby is killed and
  # reaped.
  from tenplex_jax.runtime.launch import _Standby, _standby_form
  (tmp_path / "pk").mkdir()
  (tmp_path / "pk" / "__init__.py").write_text("")
  (tmp_path / "pk" / "m.py").write_text(
      "import os, sys\nprint('MOD', sys.argv, os.environ['RANKX'])\n"
      "sys.exit(3)\n")
  script = tmp_path / "s.py"
  script.write_text("import os, sys\nprint('SCRIPT', sys.argv,"
                    " os.environ['RANKX'], sys.path[0])\n")
  env = {**ENV, "PYTHONPATH": f"{ROOT}:{tmp_path}", "PYTHONUNBUFFERED": "1",
         "TENPLEX_STANDBY_IMPORTS": "json,no_such_module"}
  module = [sys.executable, "-m", "pk.m", "a", "b"]
  for cmd, want_rc, want in (
      (module, 3, f"MOD {[str(tmp_path / 'pk' / 'm.py'), 'a', 'b']} 7"),
      ([sys.executable, str(script), "x"], 0,
       f"SCRIPT {[str(script), 'x']} 7 {tmp_path}")):
    sb = _Standby(cmd, _standby_form(cmd), env)
    assert sb.alive()
    deadline = time.monotonic() + 60
    while not sb.ready():  # it says when its imports are done
      assert sb.alive() and time.monotonic() < deadline
      time.sleep(0.01)
    assert not sb.late(0.0)  # ready: never late
    popen, watch = sb.assign(cmd, {**env, "RANKX": "7"})
    os.close(watch)
    assert popen.wait(60) == want_rc
    assert want in capfd.readouterr().out
  sb = _Standby(module, _standby_form(module), env)
  sb.kill()
  assert sb.popen.returncode == -signal.SIGKILL and not sb.alive()
  assert _standby_form([sys.executable, "-c", "pass"]) is None
  assert _standby_form(["bash", str(script)]) is None
  assert _standby_form(module) == ("module", "pk.m")


class _Ended:
  """A stand-in for the launcher's ``_Child`` once the process ended."""

  def __init__(self, index, code, died_at):
    self.index, self.code, self._died = index, code, died_at

  def died_at(self):
    return self._died


def _report(tmp, gen, index, **fields):
  with open(os.path.join(tmp, f"failure_{gen}_{index}.json"), "w") as f:
    json.dump({"process": index, "generation": gen, **fields}, f)


@pytest.mark.parametrize("error", [
    "RuntimeError: Gloo all-reduce failed: Connection closed by peer"
    " [127.0.0.1]:40123",
    "XlaRuntimeError: UNAVAILABLE: Socket closed"])
def test_a_failure_in_sympathy_is_not_blamed_over_the_exit_that_caused_it(
    tmp, error):
  # Process 1 exits with code 3 (no report, os._exit); process 0's
  # collective then fails and its report, written at t = 100.0, comes before
  # the launcher's note of process 1's end (t = 100.2, a loaded host): the
  # exit is the first failure, not the peer's error it caused.
  from tenplex_jax.runtime import launch
  _report(tmp, 0, 0, kind="exception", error=error, time=100.0)
  children = [_Ended(0, 1, 100.3), _Ended(1, 3, 100.2)]
  first, kind, words, when = launch._first_failure(children, tmp, 0, {},
                                                   stop_time=101.0)
  assert (first, kind, words, when) == (1, "exit", "exited with code 3",
                                        100.2)
  # Two processes that both saw a peer's end: the earliest is named.
  _report(tmp, 0, 1, kind="exception", error=error, time=100.1)
  first, *_ = launch._first_failure(children, tmp, 0, {}, stop_time=101.0)
  assert first == 0
  # A process's own error (not a peer's end) still goes by time.
  _report(tmp, 0, 0, kind="exception", error="ValueError: bad batch",
          time=100.0)
  first, *_ = launch._first_failure(children, tmp, 0, {}, stop_time=101.0)
  assert first == 0
