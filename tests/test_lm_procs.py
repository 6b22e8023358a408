"""examples/lm across processes: ``train.py --procs`` resizes through ``tenplex-jax launch``.

One job of 4 devices: 2 processes x 2 devices (stage 2, data 2), then at step
2 one process x 4 devices (stage 4, 2 microbatches): the train state and the
data iterator's state go through the per-host stores, the layers regroup
from 2 to 4 stages, and the losses stay on the static run's curve (float
reduction order only). The driver runs as a subprocess in its own process
group (the launcher's processes and store servers die with it), killed on
timeout.
"""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import procs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

pytestmark = pytest.mark.slow

# The trainer's static run, shared by the tests that compare with the same one
# (train.py --static-cache): the killed-process and the resizes-ahead tests
# (--deterministic 2, 6 steps), the hang and the stage-change tests
# (--fast-compile, 4 steps), on one worker or both. In the run's temporary
# directory, which the suite removes at its end.
STATIC_CACHE = os.path.join(tempfile.gettempdir(), "tenplex-lm-static")


def test_cross_process_resize_with_stage_change_follows_static_run(tmp):
  # Also when the generation started ahead for the resize hangs in its warm-up, before
  # its ready mark (--hang-ahead; as jaxlib 0.10.2's gloo communicators can deadlock
  # there): the launcher's warm-up timeout (from the end of its compile) stops it and
  # the resize starts afresh (or prepares it again), no step lost or repeated, nothing
  # left behind.
  procs.check_stage_change_resize(
      os.path.join(ROOT, "examples", "lm", "train.py"),
      os.path.join(tmp, "lm.json"), root=ROOT,
      n_params=sum(int(np.prod(s)) for s in _param_shapes()), hang_ahead=True,
      static_cache=STATIC_CACHE)


def _param_shapes():
  sys.path.insert(0, os.path.join(ROOT, "examples", "lm"))
  import config
  import jax
  from model import abstract_params
  return [x.shape for x in jax.tree.leaves(abstract_params(config.TINY))]


def _job_processes(where):
  """Processes whose command line or environment names ``where`` (the job's
  workers, standbys and store servers, all started with its job directory)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    for part in ("cmdline", "environ"):
      try:
        with open(f"/proc/{pid}/{part}", "rb") as f:
          if where.encode() in f.read():
            found.append(int(pid))
            break
      except OSError:
        pass
  return [p for p in found if p != os.getpid()]


def _env():
  """The trainer's environment: this checkout, CPU devices, no store token or
  compilation cache of the caller's."""
  env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  env.pop("TENPLEX_JAX_STORE_TOKEN", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _run_job(tmp, *args, timeout):
  """``train.py ARGS --job-parent TMP`` to its end; returns the run and the
  job's processes still alive at its end (then killed, also on failure)."""
  try:
    (run,) = procs.run_all([[
        sys.executable, os.path.join(ROOT, "examples", "lm", "train.py"), *args,
        "--job-parent", tmp]], timeout=timeout, env=_env())
    return run, _job_processes(tmp)  # the launcher stopped every process of the job
  finally:
    for pid in _job_processes(tmp):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _run_2_1_2(out, *flags, timeout):
  """The LM trainer across processes, 2 x 2 devices (stage 2, data 2), 1 x 4
  (stage 4) from step 2, 2 x 2 again from step 4, 6 steps, its JSON at
  ``out``; asserts it exited 0. A step that hangs (jaxlib 0.10.2's gloo
  collectives deadlock one, rarely, on 2 processes x 2 devices) is run again
  after 90 s (``--step-timeout``): :func:`_hang_restarts` tells."""
  (run,) = procs.run_all([[
      sys.executable, os.path.join(ROOT, "examples", "lm", "train.py"), "--procs", "2,1,2",
      "--schedule", "0:stage=2,data=2 2:stage=4,mb=2 4:stage=2,data=2", "--steps", "6",
      "--step-timeout", "90", *flags, "--json", out,
      "--job-parent", os.path.dirname(out),  # the test's
      "--timeout", str(timeout - 50)]], timeout=timeout, env=_env())
  assert run.returncode == 0, run.stdout[-5000:]
  return run.stdout


def _hang_restarts(el, stdout):
  """The steps whose generation was run again after a hang (the launcher's step
  timeout), each checked to be one: the restarted generation's first step, on as
  many processes in the phase's layout, from the last save."""
  out = []
  for r in el:
    if r.get("recovered"):
      assert r["failure"]["kind"] == "hang" and not r["layout_from_search"], r
      assert "after a hang on" in stdout, stdout[-3000:]
      out.append(r["step"])
  return out


def _check_resize_back(log, stdout):
  # 2 processes x 2 devices (stage 2, data 2), 1 x 4 (stage 4) from step 2,
  # and back to 2 x 2 (stage 2, data 2) from step 4: the launcher's
  # persistent compilation cache has generation 0's step, so the last
  # resize's step compiles nothing (jax's compile events, counted in the
  # worker: every request a cache hit), while the step 2 resize onto a new
  # mesh compiles; the generations after the first run in the launcher's
  # standby processes, and the losses still follow the static run.
  el, st = log["elastic"], log["static"]
  assert [(r["step"], r["procs"]) for r in el] == [(0, 2), (1, 2), (2, 1), (3, 1), (4, 2),
                                                   (5, 2)]
  first, new, back = el[0], el[2], el[4]
  # Where a step hung (rarely: jaxlib's gloo collectives) and its generation ran again,
  # the properties of a generation started ahead are not its; the cache's still are.
  rerun = _hang_restarts(el, stdout)
  assert set(rerun) <= {4}, rerun  # (a new mesh at step 2 compiles: it cannot pass)
  assert first["xla_compiles"] > 0 and first["cache_hits"] == 0, first
  assert new["procs_from"] == 2 and new["xla_compiles"] > 0, new
  assert not new["compile_cache_hit"], new
  assert back["mesh"] == first["mesh"], back
  assert back["xla_compiles"] == 0 and back["cache_hits"] > 0, back
  # none of the processes compiled: each found its programs in the cache
  assert len(back["xla_compiles_procs"]) == 2, back
  assert all(c == 0 and h > 0 for c, h in back["xla_compiles_procs"]), back
  assert back["compile_cache_hit"], back
  np.testing.assert_allclose([r["loss"] for r in el], [r["loss"] for r in st], rtol=1e-5)
  assert log["max_abs_param_diff"] < 1e-5
  if rerun:
    return
  assert back["procs_from"] == 1, back
  assert new["standby"] and back["standby"], (new, back)
  # both relaunched generations were started ahead (train.py announces the schedule's
  # phases with store.expect_resizes): their step compiled (the second one loaded from
  # the cache, after generation 0 had written it) before their turn
  assert new["ahead"] and back["ahead"], (new, back)
  # The generation back onto generation 0's mesh started early (expect_resizes(early=True)),
  # with generation 0 (before its first step), and waited only before compiling
  # (store.wait_programs) for generation 0's programs.
  assert ("generation 2 (2 processes, from step 4) started ahead (waits for its programs)"
          in stdout), stdout[-3000:]
  assert back["ahead_s"]["started_time"] < first["time"] - first["step_s"], (first, back)
  for r in (new, back):
    a = r["ahead_s"]
    assert a["compile_s"] > 0 and a["warmup_s"] > 0, r
    assert r["import_s"] == 0 and r["distributed_s"] == 0, r
    assert r["relaunch_s"] >= r["handoff_s"] >= 0, r
  for r in (new, back):  # the components, each within the resize
    parts = ("relaunch_s", "import_s", "distributed_s", "restore_s", "batch_s")
    assert all(r[k] >= 0 for k in parts), r
    assert r["reconfig_s"] <= r["resize_s"], r
    # the new step's own parts: on the path after the restore
    assert (r["first_step_s"], r["first_batch_s"]) == (r["step_s"], r["batch_s"]), r
    assert r["reconfig_s"] + r["first_step_s"] <= r["resize_s"] + 1e-3, r
    assert set(r["restore_parts_s"]) == {"manifest", "plan", "read", "build", "total"}, r
    assert r["restore_parts_s"]["total"] <= r["restore_s"], r
    # started (by the launcher) before it was ready; the nice it prepared at
    assert r["ahead_lead_s"] >= r["ahead_margin_s"], r
    assert r["ahead_s"]["nice"] in (0, 10), r


def test_deterministic_resizes_through_generations_started_ahead_are_bitwise(tmp):
  # --deterministic 2 across processes (2 x 2 devices, 1 x 4 from step 2, 2 x 2 from
  # step 4): both relaunched generations were started ahead and ran their compiled step
  # once on zeros before their turn; the losses and final params are still bitwise the
  # static run's; and the resize back onto generation 0's mesh compiles nothing
  # (_check_resize_back).
  import json
  out = os.path.join(tmp, "det.json")
  stdout = _run_2_1_2(out, "--deterministic", "2", "--static-cache", STATIC_CACHE,
                      timeout=650)
  with open(out) as f:
    log = json.load(f)
  el = log["elastic"]
  assert [r["procs"] for r in el] == [2, 2, 1, 1, 2, 2]
  assert log["bitwise_identical"] is True
  assert [r["loss"] for r in el] == [r["loss"] for r in log["static"]]
  # (a generation run again after a hang, rarely: jaxlib's gloo collectives, was not)
  rerun = _hang_restarts(el, stdout)
  assert all(el[s]["ahead"] for s in (2, 4) if s not in rerun), (el[2], el[4])
  _check_resize_back(log, stdout)


def test_a_killed_process_hands_over_to_the_generation_prepared_for_the_failure(tmp):
  # 2 processes x 2 devices (stage 2, data 2), --deterministic 2, a snapshot every 2
  # steps: the trainer announces the generation a failure would restart on (1 process,
  # the search's layout of its 2 devices); once that generation is ready (step compiled,
  # warmed up), process 1 SIGKILLs itself before step 5. The launcher hands the turn to
  # that generation: it restores the snapshot of step 4 and runs steps 4 and 5. Every
  # step counts once, on the static run's batch (CRC-32 of tokens and mask), and the
  # losses and final params are bitwise the static run's.
  import json
  out = os.path.join(tmp, "kill.json")
  run, left = _run_job(
      tmp, "--procs", "2", "--schedule", "0:stage=2,data=2", "--steps", "6",
      "--deterministic", "2", "--snapshot-every", "2", "--kill-at", "5", "--json", out,
      "--static-cache", STATIC_CACHE, "--timeout", "600", timeout=650)
  assert run.returncode == 0, run.stdout[-5000:]
  assert not left, left
  assert "--kill-at: process 1 kills itself" in run.stdout, run.stdout[-3000:]
  assert ("process 1 failed (exit code -9) at step 5; restart 1 of 3 on 1 processes"
          " (generation 1, prepared for a failure)" in run.stdout), run.stdout[-3000:]
  with open(out) as f:
    log = json.load(f)
  el, st = log["elastic"], log["static"]
  assert [(r["step"], r["procs"], r["generation"]) for r in el] == [
      (0, 2, 0), (1, 2, 0), (2, 2, 0), (3, 2, 0), (4, 1, 1), (5, 1, 1)], el
  rec = el[4]
  assert rec["recovered"] and rec["layout_from_search"], rec
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["steps_redone"]) == (5, 4, 1, [4]), rec
  assert (rec["procs_from"], rec["devices"], rec["devices_per_proc"]) == (2, 2, 2), rec
  assert (rec["failure"]["process"], rec["failure"]["exit_code"]) == (1, -9), rec
  # prepared: compiled and ready before the failure, nothing imported or compiled after it
  assert rec["ahead"] and rec["ahead_s"]["compile_s"] > 0 and rec["ahead_margin_s"] > 0, rec
  assert rec["import_s"] == 0 and rec["distributed_s"] == 0, rec
  assert rec["compile_wait_s"] < 0.1, rec
  assert 0 < rec["reconfig_s"] <= rec["recovery_s"] == rec["resize_s"], rec
  assert [r.get("snapshot_s", 0) > 0 for r in el[:4]] == [False, True, False, True], el
  # no sample lost or repeated: each step's batch is the static run's
  assert [r["batch_crc"] for r in el] == [r["batch_crc"] for r in st]
  assert log["bitwise_identical"] is True
  assert [r["loss"] for r in el] == [r["loss"] for r in st]


def test_a_step_that_hangs_runs_again_on_as_many_processes_from_the_last_save(tmp):
  # 2 processes x 2 devices (stage 2, data 2), the same processes' devices as data 2,
  # tensor 2 from step 2 (a relaunch: its save is the last one), no snapshots; the first
  # process to reach step 3 sleeps before it (--hang-at 3: the shape of jaxlib 0.10.2's
  # rare gloo deadlock, one process stuck, the other waiting in the step's collectives).
  # The launcher's step timeout stops the generation and runs it again on 2 processes in
  # the phase's own layout (not the search's, as after a lost process) from the step-2
  # save: step 2 runs again from the same state on the same batch, the losses and final
  # params follow the static run, and nothing of the job is left behind.
  # (A 15 s step timeout: it counts from each process's last heartbeat, and until a
  # generation's first step the processes beat, so imports, compiles and the restore are
  # not in it; what is, a step of this config with its batch and a save, takes 0.3-0.5 s
  # at load 4-9 and stayed far below 15 s at load 8-12 beside another jax test.)
  import json
  out = os.path.join(tmp, "hang.json")
  run, left = _run_job(
      tmp, "--procs", "2,2", "--schedule", "0:stage=2,data=2 2:data=2,tensor=2",
      "--steps", "4", "--fast-compile", "--hang-at", "3", "--step-timeout", "15",
      "--json", out, "--static-cache", STATIC_CACHE, "--timeout", "400", timeout=450)
  assert run.returncode == 0, run.stdout[-5000:]
  assert not left, left
  assert "--hang-at: process" in run.stdout, run.stdout[-3000:]
  assert "hung: no step for 15 s" in run.stdout, run.stdout[-3000:]
  # (the one hang: the compile of a generation's first step, however slow, is no hang)
  assert run.stdout.count("hung: no step") == 1, run.stdout[-3000:]
  assert "at step 3; restart 1 of 2 after a hang on 2 processes" in run.stdout, \
      run.stdout[-3000:]
  with open(out) as f:
    log = json.load(f)
  el, st = log["elastic"], log["static"]
  assert [(r["step"], r["procs"]) for r in el] == [(0, 2), (1, 2), (2, 2), (3, 2)], el
  rec = el[2]
  assert rec["recovered"] and not rec["layout_from_search"], rec
  assert (rec["failed_step"], rec["restored_step"], rec["steps_redone"]) == (3, 2, [2]), rec
  assert rec["failure"]["kind"] == "hang", rec
  assert rec["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "stage": 1}, rec
  assert [r["batch_crc"] for r in el] == [r["batch_crc"] for r in st]
  np.testing.assert_allclose([r["loss"] for r in el], [r["loss"] for r in st], rtol=1e-5)
  assert log["max_abs_param_diff"] < 1e-5


def test_a_job_stopped_by_the_launchers_timeout_leaves_no_directory(tmp):
  # The launcher's --timeout ends the job while its first generation runs:
  # the launcher stops every process and store server and raises, and the
  # trainer removes its job directory (tenplex-lm-*, in /dev/shm unless
  # --job-parent) on the way out: nothing of the job is left in host memory.
  # (The processes are up, their pid files written, 7.5-8.2 s after the start
  # at load 8-13 on 2 cores; a 25 s timeout leaves three times that.) The
  # first process to reach step 1 sleeps there (--hang-at; the launcher's step
  # timeout, 300 s, is far off) and the other waits for it in the step's
  # collectives: a stuck job, as a timeout usually stops, and no CPU spent on
  # steps until the timeout (the job's processes 46 -> 19 CPU s alone here).
  # Append mode: the processes write through the same open file as this
  # test reads with seek(0), and a shared offset moved back by that seek
  # would let their next line overwrite the log's start (a launcher
  # test once saw 'pid 2110' and then a line cut to 'pid', for 60 s).
  log = open(os.path.join(tmp, "out.log"), "a+")
  parent = os.path.join(tmp, "jobs")
  os.mkdir(parent)
  p = subprocess.Popen([
      sys.executable, os.path.join(ROOT, "examples", "lm", "train.py"), "--procs", "2",
      "--schedule", "0:stage=2,data=2", "--steps", "100000", "--fast-compile",
      "--hang-at", "1", "--job-parent", parent, "--timeout", "25"], env=_env(), stdout=log,
      stderr=subprocess.STDOUT, start_new_session=True)
  try:
    t0, running = time.time(), []
    while not running and p.poll() is None and time.time() - t0 < 120:
      # the generation's processes are up (their failure hooks' pid files)
      running = glob.glob(os.path.join(parent, "tenplex-lm-*", "pid_0_*.txt"))
      time.sleep(0.1)
    rc = p.wait(200)
    left = _job_processes(parent)
  finally:
    procs.kill_group(p)
    for pid in _job_processes(parent):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
  log.seek(0)
  out = log.read()
  log.close()
  assert running, out[-5000:]  # stopped while it ran, not before it started
  assert rc != 0 and "tenplex-jax launch: timed out" in out, out[-5000:]
  # where each process stood, on the launcher's stderr (the directory is gone):
  # its Python stacks (SIGUSR2), the main thread in the trainer's code
  assert "tenplex-jax launch: timed out in generation 0: main threads" in out, out[-5000:]
  for i in range(2):
    head = f"stacks_0_{i}.txt (generation 0's Python stacks):"
    assert head in out, out[-5000:]
    dump = out.split(head, 1)[1].split("tenplex-jax launch:", 1)[0]
    assert "most recent call first" in dump and "train.py" in dump, dump[-3000:]
  assert os.listdir(parent) == [], (os.listdir(parent), out[-3000:])
  assert not left, left
