"""The launcher signals only process groups that are still its children's.

A child leads its own process group, whose id is the child's pid. Once the
child is reaped and its group is empty, the kernel may hand that number to
an unrelated process (pid numbers wrap); a ``killpg`` to it then kills a
stranger's group (a full test run saw a fresh ``ray start`` die of SIGKILL
in its first second). The launcher notes a child's exit without reaping it,
signals its group, and reaps it after the last signal; a reaped child's
group is never signalled again.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tenplex_jax.runtime import launch


def _state(pid):
  """``/proc/PID/stat``'s state letter and start time, or None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return fields[0], int(fields[19])


def _until(pred, timeout=30.0):
  deadline = time.monotonic() + timeout
  while not pred():
    if time.monotonic() > deadline:
      raise AssertionError("timed out")
    time.sleep(0.02)


@pytest.fixture
def killpg_calls(monkeypatch):
  """Every ``os.killpg`` the launcher makes, recorded (and made)."""
  calls, real = [], os.killpg

  def record(pgid, sig):
    calls.append((pgid, sig))
    real(pgid, sig)
  monkeypatch.setattr(launch.os, "killpg", record)
  return calls


def test_signal_group_skips_a_reaped_process(killpg_calls):
  p = subprocess.Popen([sys.executable, "-c", "pass"],
                       start_new_session=True)
  p.wait()  # reaped: its pid may be anyone's now
  launch._signal_group(p, signal.SIGKILL)
  assert killpg_calls == []


def test_exited_child_stays_unreaped_until_stopped(tmp_path, killpg_calls):
  """A child that exited leaves a zombie (its pid and group id reserved)
  until ``_stop``; ``_stop`` kills what it left in its group, reaps it, and
  a second ``_stop`` signals nothing."""
  out = tmp_path / "grandchild"
  script = ("import subprocess, sys\n"
            "p = subprocess.Popen(['sleep', '60'])\n"
            f"open({str(out)!r}, 'w').write(str(p.pid))\n"
            "sys.exit(3)\n")
  wake = threading.Event()
  child = launch._Child(0, [sys.executable, "-c", script], dict(os.environ),
                        wake)
  pid = child.popen.pid
  grandchild = None
  try:
    _until(lambda: child.code is not None)
    assert child.code == 3
    assert child.popen.returncode is None  # noted, not reaped
    assert _state(pid)[0] == "Z"
    grandchild = int(out.read_text())
    assert os.getpgid(grandchild) == pid  # in the child's group
    sent = launch._stop([child], wake, grace=0.2)
    assert sent == {}  # it had exited on its own: not blamed on us
    assert (pid, signal.SIGKILL) in killpg_calls
    _until(lambda: _state(grandchild) is None or
           _state(grandchild)[0] == "Z")  # the group's rest is gone
    assert child.popen.returncode == 3  # reaped
    assert _state(pid) is None or _state(pid)[0] != "Z"
    del killpg_calls[:]
    launch._stop([child], wake, grace=0.2)  # e.g. the launcher's finally
    assert killpg_calls == []
  finally:
    if child.popen.returncode is None:  # unreaped: the group is ours
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      child.popen.wait()


def test_stop_reports_the_signal_it_sent(killpg_calls):
  wake = threading.Event()
  child = launch._Child(0, ["sleep", "60"], dict(os.environ), wake)
  try:
    sent = launch._stop([child], wake, grace=5)
    assert sent == {0: signal.SIGTERM}
    assert child.code == -signal.SIGTERM
    assert child.popen.returncode == -signal.SIGTERM
  finally:
    if child.popen.returncode is None:
      os.killpg(child.popen.pid, signal.SIGKILL)
      child.popen.wait()


def test_exited_does_not_reap():
  p = subprocess.Popen([sys.executable, "-c", "pass"],
                       start_new_session=True)
  try:
    assert launch._wait_exited(p, 30)
    assert launch._exited(p)
    assert p.returncode is None and _state(p.pid)[0] == "Z"
  finally:
    p.wait()
  assert p.returncode == 0 and launch._exited(p)


def test_wait_exited_times_out_on_a_live_child_and_wakes_on_its_exit():
  """The wait blocks on the child's pidfd: it gives up after ``timeout``
  for a live child, and returns once the child exits (well before the
  timeout), leaving it unreaped."""
  p = subprocess.Popen(["sleep", "60"], start_new_session=True)
  try:
    t0 = time.monotonic()
    assert not launch._wait_exited(p, 0.3)
    assert 0.25 <= time.monotonic() - t0 < 30
    threading.Timer(0.2, os.kill, (p.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    assert launch._wait_exited(p, 60)
    assert time.monotonic() - t0 < 30
    assert p.returncode is None and _state(p.pid)[0] == "Z"
  finally:
    if p.returncode is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  assert p.returncode == -signal.SIGKILL


def test_in_group():
  p = subprocess.Popen(["sleep", "60"], start_new_session=True)
  try:
    assert launch._in_group(p.pid, p.pid)
    assert not launch._in_group(p.pid, os.getpgid(0))
    assert not launch._in_group(os.getpid(), p.pid)
  finally:
    p.kill()
    p.wait()


def test_store_servers_are_signalled_only_before_they_are_reaped(
    tmp_path, monkeypatch):
  """The launcher's shutdown of its store servers: SIGTERM, then SIGKILL to
  what is left of each group, every signal while the server is unreaped
  (also for one that died before), and every server reaped at the end."""
  job = tmp_path / "job"
  job.mkdir(mode=0o700)
  env = {**os.environ, "PYTHONPATH": launch._pythonpath()}
  env.pop("TENPLEX_JAX_STORE_TOKEN", None)
  started = launch._start_servers(
      {i: (str(job / "store" / str(i)), str(job / f"server_{i}.log"))
       for i in range(2)}, env)
  procs = [p for p, _ in started.values()]
  calls, real = [], os.killpg
  by_pid = {p.pid: p for p in procs}

  def record(pgid, sig):
    calls.append((pgid, sig, by_pid[pgid].returncode))
    real(pgid, sig)
  try:
    os.kill(procs[0].pid, signal.SIGKILL)  # one died before the shutdown
    assert launch._wait_exited(procs[0], 30)
    monkeypatch.setattr(launch.os, "killpg", record)
    launch._stop_servers(procs)
    assert sorted(calls) == sorted(
        [(p.pid, signal.SIGTERM, None) for p in procs]
        + [(p.pid, signal.SIGKILL, None) for p in procs])
    assert procs[0].returncode == -signal.SIGKILL
    assert all(p.returncode is not None for p in procs)  # reaped
    del calls[:]
    launch._stop_servers(procs)  # again: nothing is signalled
    assert calls == []
  finally:
    for p in procs:
      if p.returncode is None:
        real(p.pid, signal.SIGKILL)
        p.wait()

