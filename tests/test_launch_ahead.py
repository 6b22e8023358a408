"""``tenplex-jax launch`` starts the generations a script expects ahead of their turn.

tests/launch_train.py with ``TRAIN_EXPECT`` calls ``store.expect_resizes``:
the launcher starts those generations at once (a generation whose key is the
running one's after that one's first step), they initialise ``jax.distributed``
and wait in ``wait_turn``; when every running process saved for the resize the
launcher hands the matching generation its turn. An expectation the job does
not follow costs nothing but the prepared processes, which are stopped.
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
  # job ends right with no process left.
  job = os.path.join(tmp, "job")
  sched = os.path.join(tmp, "sched.txt")
  with open(sched, "w") as f:
    f.write("step 4 procs 1\nstep 8 procs 2\n")
  with launcher(tmp, train(10), "--procs", "2", "--schedule", sched,
                TRAIN_SLEEP=1.5, TRAIN_EXPECT="4:1,8:2") as (p, log, seen):
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
  for gen, step, procs in ((1, 4, 1), (2, 8, 2)):
    for i in range(procs):
      a = _ahead(job, gen, i)
      assert a["prepared"] and a["step"] == step, a
      t = a["turn"]
      # initialised (jax.distributed up) before the previous generation had saved
      assert a["initialized"] < t["handed"] <= t["seen"], a
      assert t["ready"] <= t["seen"], a
  assert not [pid for pid in seen if _alive(pid)], out  # nothing left


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
  assert not [pid for pid in seen if _alive(pid)], out


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
  assert not [pid for pid in seen if _alive(pid)], out
