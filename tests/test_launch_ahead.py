"""``tenplex-jax launch`` starts the generations a script expects ahead of their turn.

tests/launch_train.py with ``TRAIN_EXPECT`` calls ``store.expect_resizes``:
the launcher starts those generations at once (a generation whose key is the
running one's after that one's first step), they initialise ``jax.distributed``
and wait in ``wait_turn``; when every running process saved for the resize the
launcher hands the matching generation its turn. An expectation the job does
not follow costs nothing but the prepared processes, which are stopped. With
``TRAIN_EXPECT_FAILURE`` the launcher also prepares the generation a failure
would restart on, and a failure hands it the turn.
"""

import json
import os

import pytest

from test_launch_recovery import (_alive, _text, check_final, finish, launcher, pids_of,
                                  train)

pytestmark = pytest.mark.slow


def _ahead(job, gen, i):
  return json.loads(_text(os.path.join(job, f"ahead_{gen}_{i}.json")))


def test_expected_generations_are_started_ahead_and_take_their_turn(tmp):
  # 2 processes, 1 from step 4, 2 again from step 8, all expected: generation 1
  # (1 process) starts with generation 0; generation 2 (2 processes, generation 0's
  # key) once generation 0 stepped. Each had jax.distributed up before its turn came,
  # restored the state saved at its step (launch_train checks the values) and the
  # job ends right with no process left. The generation before each resize waits at
  # its step until the one started ahead for it is ready (TRAIN_WAIT_READY): a
  # launcher that did not start it ahead fails the test, however fast the host.
  job = os.path.join(tmp, "job")
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 4 procs 1\nstep 8 procs 2\n")
  with launcher(tmp, train(10), "--procs", "2", "--schedule", sched,
                TRAIN_EXPECT="4:1,8:2", TRAIN_WAIT_READY="4:1:1,8:2:2") as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert "generation 1 (1 processes, from step 4) started ahead" in out, out[-3000:]
  assert "generation 2 (2 processes, from step 8) started ahead" in out, out[-3000:]
  assert ("generation 0: 2 -> 1 processes at step 4 (generation 1, started ahead)"
          in out), out[-3000:]
  assert ("generation 1: 1 -> 2 processes at step 8 (generation 2, started ahead)"
          in out), out[-3000:]
  check_final(job, procs=2, step=10, generation=2)
  assert not _ahead(job, 0, 0)["prepared"]
  # Prepared at the launcher's nice value + 10 (--prepare-nice's default), where it
  # may lower it again (as root); back to the launcher's at the turn.
  from tenplex_jax.runtime.launch import _can_renice
  low = 10 if _can_renice(10) else 0
  base = os.getpriority(os.PRIO_PROCESS, 0)
  for gen, step, procs in ((1, 4, 1), (2, 8, 2)):
    for i in range(procs):
      a = _ahead(job, gen, i)
      assert a["prepared"] and a["step"] == step, a
      assert (a["nice_prepared"], a["nice_turn"]) == (min(19, base + low), base), a
      t = a["turn"]
      assert t["nice"] == low and t["started"] <= a["initialized"], a
      # initialised (jax.distributed up) before the previous generation had saved
      assert a["initialized"] < t["handed"] <= t["seen"], a
      assert t["ready"] <= t["seen"], a
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out  # nothing left


def test_an_expectation_the_job_does_not_follow_is_stopped(tmp):
  # Expected: 2 processes from step 3; the schedule resizes to 1. The prepared
  # generation is stopped, the resize starts its process as without it, and the
  # state is right.
  job = os.path.join(tmp, "job")
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 3 procs 1\n")
  with launcher(tmp, train(5), "--procs", "2", "--schedule", sched,
                TRAIN_SLEEP=0.5, TRAIN_EXPECT="3:2") as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert "generation 1 (2 processes, from step 3) started ahead" in out, out[-3000:]
  assert "generation 0: 2 -> 1 processes at step 3\n" in out, out[-3000:]
  check_final(job, procs=1, step=5, generation=2)
  assert not _ahead(job, 2, 0)["prepared"]
  assert not os.path.exists(os.path.join(job, "ahead_1_0.json"))  # never had a turn
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out


def test_a_generation_ahead_that_fails_is_not_started_again(tmp):
  # The process started ahead for step 3 exits with status 3 before its turn: the
  # launcher says so once, does not start it again, and the resize starts its
  # process as without it; the running generation is not disturbed.
  job = os.path.join(tmp, "job")
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 3 procs 1\n")
  with launcher(tmp, train(5), "--procs", "2", "--schedule", sched, TRAIN_SLEEP=1.0,
                TRAIN_EXPECT="3:1", TRAIN_AHEAD_FAIL=1) as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert out.count("started ahead for step 3, failed before its turn") == 1, out[-3000:]
  assert out.count("started ahead\n") == 1, out[-3000:]
  assert "generation 0: 2 -> 1 processes at step 3\n" in out, out[-3000:]
  check_final(job, procs=1, step=5, generation=2)
  assert not _ahead(job, 2, 0)["prepared"]
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out


def test_a_failure_hands_the_turn_to_the_generation_prepared_for_it(tmp):
  # 3 processes, --on-failure shrink, a snapshot every step; the script expects a
  # failure's generation of 2 processes (expect_resizes(failure=...)): the launcher
  # prepares it once generation 0 stepped. Generation 0 waits at step 4 until it is
  # ready, then process 1 is SIGKILLed: the restart on 2 processes is that prepared
  # generation (the same processes: their pid files, written at initialize, predate
  # the failure), handed the failed step and the start step with its turn; it
  # restores step 4 (nothing lost) and the values are exactly the static run's.
  job = os.path.join(tmp, "job")
  with launcher(tmp, train(7), "--procs", "3", "--on-failure", "shrink",
                "--max-restarts", "1", TRAIN_SNAPSHOT_EVERY=1, TRAIN_SLEEP=0.2,
                TRAIN_EXPECT_FAILURE=2, TRAIN_WAIT_READY="4:1:2",
                TRAIN_FAULTS="0:4:1:sigkill") as (p, log, seen):
    rc, out = finish(p, log)
    seen.update(pids_of(job))
  assert rc == 0, out[-5000:]
  assert "generation 1 (2 processes) prepared for a failure" in out, out[-3000:]
  assert ("process 1 failed (exit code -9) at step 4; restart 1 of 1 on 2 processes"
          " (generation 1, prepared for a failure)" in out), out[-3000:]
  assert out.count("prepared for a failure\n") == 1, out[-3000:]  # not started again
  (fail,) = [json.loads(x) for x in _text(os.path.join(job, "failures.jsonl")).splitlines()]
  assert (fail["generation"], fail["process"], fail["kind"]) == (0, 1, "signal"), fail
  for i in range(2):
    a = _ahead(job, 1, i)
    assert a["prepared"] and a["step"] == 4 and a["turn"]["failure"], a
    t = a["turn"]
    # ready (jax.distributed up, waiting) before the failure; handed after it
    assert a["initialized"] <= t["ready"] < fail["failed_at"] <= t["handed"] <= t["seen"], a
    pid_time = os.stat(os.path.join(job, f"pid_1_{i}.txt")).st_mtime
    assert pid_time < fail["failed_at"], (pid_time, fail)
  rec = json.loads(_text(os.path.join(job, "recovery_1.json")))
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"]) == (4, 4, 0), rec
  assert not os.path.exists(os.path.join(job, "pid_2_0.txt"))  # no other generation
  check_final(job, procs=2, step=7, generation=1)
  assert not [pid for pid in seen if _alive(pid) and seen.same(pid)], out  # nothing left


def test_expect_resizes_refuses_a_failure_generation_without_processes():
  from tenplex_jax import store
  from tenplex_jax.errors import UsageError
  for bad in ((0, "k"), ("x", "k"), (1,), 5):
    with pytest.raises(UsageError, match=r"failure=.*expected \(procs >= 1, key\)"):
      store.expect_resizes([], key="k", failure=bad)
  store.expect_resizes([], key="k", failure=(1, "k"))  # no launcher: nothing


def test_the_warmup_timeout_counts_from_each_process_warmup_mark(tmp_path):
  # A generation prepared ahead is overdue once one of its processes is not ready
  # warmup seconds after its warm-up mark (store.warming_up, after its compile), however
  # long before that its imports and compile took; without a mark, or once ready, the
  # prepare timeout from its start alone decides. warming_up itself marks nothing in a
  # process the launcher did not start ahead.
  import time

  from tenplex_jax import store
  from tenplex_jax.runtime.launch import _Ahead
  job = str(tmp_path)
  now = time.time()
  a = _Ahead(7, 2, 2, "k", [], os.path.join(job, "turn"), started=now - 100)

  def mark(kind, i, t):
    with open(os.path.join(job, f"{kind}_7_{i}.txt"), "w") as f:
      f.write(repr(t))

  assert not a.overdue(job, 1000, 20)  # compiling still (no mark): not late
  assert a.overdue(job, 50, None) and a.overdue(job, 50, 20)  # the prepare timeout's
  mark("warmup", 1, now - 5)  # warming up for 5 s
  assert not a.overdue(job, 1000, 20) and a.warmup_late(job, 20) == []
  assert a.overdue(job, 1000, 4) and a.warmup_late(job, 4) == [1]
  assert not a.overdue(job, 1000, None)  # no warm-up timeout: only the prepare one
  mark("warmup", 0, now - 30)
  assert a.overdue(job, 1000, 20) and a.warmup_late(job, 20) == [0]
  mark("ready", 0, now)
  assert not a.overdue(job, 1000, 20) and a.warmup_late(job, 4) == [1]
  mark("ready", 1, now)
  assert not a.overdue(job, 50, 4) and a.warmup_late(job, 4) == []  # ready: never late
  store.warming_up()  # not prepared: no mark, no error
  assert sorted(os.listdir(job)) == ["ready_7_0.txt", "ready_7_1.txt", "warmup_7_0.txt",
                                     "warmup_7_1.txt"]


def test_heartbeats_beat_until_stopped(tmp_path, monkeypatch):
  # store.heartbeats() writes this process's heartbeat file every `every` s from a
  # thread (as heartbeat() does once), and none after stop() or its with-block.
  import time

  from tenplex_jax import store
  for name, value in [("TENPLEX_JOB_DIR", str(tmp_path)), ("TENPLEX_NUM_PROCS", "2"),
                      ("TENPLEX_PROC_ID", "1"), ("TENPLEX_GENERATION", "3")]:
    monkeypatch.setenv(name, value)
  path = tmp_path / "heartbeat_1"

  def beat_time():
    # heartbeat() truncates the file, then writes it: a read in between sees
    # it empty (the launcher reads only its mtime), so read until it is whole.
    while not (parts := path.read_text().split()):
      time.sleep(0.001)
    gen, t = parts
    assert gen == "3"
    return float(t)

  with store.heartbeats(every=0.05) as beats:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
      time.sleep(0.01)
    first = beat_time()
    while beat_time() == first and time.monotonic() < deadline:
      time.sleep(0.01)
    assert beat_time() > first  # beats again, unprompted
  beats._thread.join(5)
  assert not beats._thread.is_alive()
  last = beat_time()
  time.sleep(0.2)
  assert beat_time() == last  # stopped
  with pytest.raises(store.UsageError, match="every=0"):
    store.heartbeats(every=0)
