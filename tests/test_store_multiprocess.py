"""Multi-process save/restore through host stores and store servers.

Each test starts its own jax.distributed jobs (tests/store_worker.py) and
store servers (``python -m tenplex_jax store serve``), and stops them in a
``finally``. Values are compared bitwise with the deterministic state of
tests/store_state.py; shardings with the targets; bytes on the wire with the
plan and the host-level lower bound.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from procs import kill_group, run_all, wait_unreaped  # noqa: E402
from store_state import expected_state, storage_view  # noqa: E402

from tenplex_jax.store.server import free_port  # noqa: E402

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "",
       "JAX_PLATFORMS": "cpu"}


def _text(path):
  with open(path) as f:
    return f.read()


def run_job(tmp, name, *, procs, devices, mesh, action, timeout=90, **kw):
  out = os.path.join(tmp, name)
  os.makedirs(out, exist_ok=True)
  cfg = {"procs": procs, "devices": devices, "mesh": mesh, "action": action,
         "port": free_port(), "out": out, **kw}
  path = os.path.join(out, "config.json")
  with open(path, "w") as f:
    json.dump(cfg, f)
  children = run_all([[sys.executable, os.path.join(HERE, "store_worker.py"),
                        path, str(i)] for i in range(procs)],
                      env=ENV, timeout=timeout)
  results = []
  for i, c in enumerate(children):
    rp = os.path.join(out, f"result_{i}.json")
    if c.returncode != 0 or not os.path.exists(rp):
      raise AssertionError(f"{name}: process {i} exited {c.returncode}:\n"
                           f"{c.stdout[-3000:]}")
    results.append(json.loads(_text(rp)))
  return results, out


@contextlib.contextmanager
def servers(dirs):
  procs, urls = [], []
  try:
    for d in dirs:
      os.makedirs(d, exist_ok=True)
      ready = os.path.join(d, ".ready")
      p = subprocess.Popen([sys.executable, "-m", "tenplex_jax", "store",
                            "serve", "--dir", d, "--port", "0",
                            "--ready-file", ready], env=ENV,
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
      procs.append(p)
      t0 = time.time()
      while not os.path.exists(ready):
        assert p.poll() is None and time.time() - t0 < 30, \
            f"store server for {d} did not start"
        time.sleep(0.05)
      urls.append("http://" + _text(ready))
    yield urls, procs
  finally:
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()


def check_values(out, procs):
  exp = expected_state()
  n = 0
  for i in range(procs):
    with np.load(os.path.join(out, f"shards_{i}.npz")) as z:
      for key in z.files:
        path, _, box = key.split("|")
        idx = tuple(slice(int(a), int(b)) for a, b in
                    (r.split(":") for r in box.split(",") if r))
        want = storage_view(exp[path][idx])
        np.testing.assert_array_equal(z[key], want, err_msg=key)
        n += 1
  assert n > 0


def check_results(results):
  for r in results:
    assert r["ok"], r
    assert all(r["shardings_ok"].values()), r["shardings_ok"]
    assert r["step"] == 7 and r["note"] == "saved"


def save_job(tmp, procs, mesh, **kw):
  stores = [os.path.join(tmp, f"host{i}") for i in range(procs)]
  run_job(tmp, f"save{procs}", procs=procs, devices=2, mesh=mesh,
          action="save", stores=stores, **kw)
  return stores


@pytest.mark.parametrize("old,new", [
    ((2, [2, 2]), (1, [1, 2])),
    ((1, [1, 2]), (2, [2, 2])),
    ((2, [2, 2]), (3, [2, 3])),
    ((3, [3, 2]), (2, [1, 4])),
], ids=["2to1", "1to2", "2to3", "3to2"])
def test_resize(tmp, old, new):
  (n_old, mesh_old), (n_new, mesh_new) = old, new
  stores = save_job(tmp, n_old, mesh_old)
  # New process i runs on host i: its own store is a local directory (if
  # that host had one); every other store is reached over HTTP.
  with servers(stores) as (urls, _):
    locations = [([stores[i]] if i < n_old else []) + urls
                 for i in range(n_new)]
    results, out = run_job(tmp, "restore", procs=n_new, devices=2,
                           mesh=mesh_new, action="restore",
                           locations=locations)
    served = sum(_stats(u)["bytes_sent"] for u in urls)
  check_results(results)
  check_values(out, n_new)
  net = 0
  for r in results:
    rep = r["report"]
    # Cross-host bytes equal the host-level lower bound, and the plan.
    assert rep["network_bytes"] == rep["host_lower_bound_bytes"], rep
    assert rep["network_bytes"] == rep["planned_network_bytes"], rep
    assert not rep["fallbacks"]
    net += rep["network_bytes"]
  # Bytes on the wire (server side) within 10% of the plan's piece bytes.
  assert net <= served <= 1.1 * net + 1, (served, net)


def _stats(url):
  import urllib.request
  with urllib.request.urlopen(url + "/stats", timeout=10) as r:
    return json.load(r)


def test_redeploy_disjoint_processes_reads_only_over_http(tmp):
  stores = save_job(tmp, 2, [2, 2])
  with servers(stores) as (urls, _):
    results, out = run_job(tmp, "restore", procs=2, devices=2, mesh=[1, 4],
                           action="restore", locations=[urls, urls])
    served = sum(_stats(u)["bytes_sent"] for u in urls)
  check_results(results)
  check_values(out, 2)
  for r in results:
    rep = r["report"]
    assert rep["local_bytes"] == 0
    assert rep["network_bytes"] == rep["host_lower_bound_bytes"] > 0
    # Host-level dedup: fewer bytes than per-device reads would fetch when
    # devices of one process share pieces (here: replicated tensors).
    assert rep["network_bytes"] < rep["device_piece_bytes"]
  assert served == sum(r["report"]["network_bytes"] for r in results)


@pytest.mark.parametrize("replicas", [0, 1])
def test_peer_killed(tmp, replicas):
  # data=2 x model=2 on 2 processes: data-sharded tensors live only on
  # their own host unless the store is replicated to the next host.
  stores = save_job(tmp, 2, [2, 2], replicas=replicas)
  with servers(stores) as (urls, procs):
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(10)
    results, out = run_job(tmp, "restore", procs=1, devices=2, mesh=[1, 2],
                           action="restore", locations=[urls], timeout=60,
                           retries=0, timeout_s=2)
  r = results[0]
  if replicas:
    check_results(results)
    check_values(out, 1)
    assert any(urls[1] in f for f in r["report"]["fallbacks"])
  else:
    assert not r["ok"] and r["type"] == "NoCopyError", r
    assert "processes [1]" in r["error"] and urls[1] in r["error"], r


def test_lost_process_with_store_replica(tmp):
  stores = save_job(tmp, 2, [2, 2], replicas=1)
  shutil.rmtree(stores[1])  # host 1 and its store are lost
  with servers(stores[:1]) as (urls, _):
    results, out = run_job(tmp, "restore", procs=1, devices=2, mesh=[1, 2],
                           action="restore", locations=[urls])
  check_results(results)
  check_values(out, 1)
  assert results[0]["report"]["lost_processes"] == []


def test_lost_process_without_replica_uses_orbax_checkpoint(tmp):
  ck = os.path.join(tmp, "ckpt")
  stores = save_job(tmp, 2, [2, 2], checkpoint=ck, checkpoint_step=4)
  shutil.rmtree(stores[1])
  with servers(stores[:1]) as (urls, _):
    results, out = run_job(tmp, "restore", procs=1, devices=2, mesh=[1, 2],
                           action="restore", locations=[urls], checkpoint=ck)
  r = results[0]
  assert r["ok"], r
  assert r["report"]["from_checkpoint"]
  assert r["report"]["steps_lost"] == 3  # saved at 7, checkpoint at 4
  assert r["report"]["lost_processes"] == [1]
  check_values(out, 1)


def test_corrupt_chunk_read_from_replica(tmp):
  stores = save_job(tmp, 2, [2, 2], replicas=1)
  # Corrupt process 0's own copy of a tensor on host 0.
  snap = os.path.join(stores[0], "procs", "0")
  snap = os.path.join(snap, _text(os.path.join(snap, "CURRENT")).split()[0])
  chunk = os.path.join(snap, "data", "params", "dense", "kernel", "b0", "c",
                       "0", "0")
  with open(chunk, "r+b") as f:
    f.seek(5)
    b = f.read(1)
    f.seek(5)
    f.write(bytes([b[0] ^ 0xFF]))
  with servers(stores) as (urls, _):
    results, out = run_job(tmp, "restore", procs=1, devices=2, mesh=[1, 2],
                           action="restore", locations=[urls])
  check_results(results)
  check_values(out, 1)
  fb = results[0]["report"]["fallbacks"]
  assert any("checksum" in f and "params/dense/kernel" in f for f in fb), fb


@contextlib.contextmanager
def stalling_server(d, serve_first):
  """A store server (tests/stalling_store_server.py) that answers
  ``serve_first`` tensor reads, then holds the next; a watcher thread
  SIGKILLs it as soon as it holds one, i.e. while a restore is reading."""
  ready, stalled = os.path.join(d, ".ready"), os.path.join(d, ".stalled")
  p = subprocess.Popen([sys.executable,
                        os.path.join(HERE, "stalling_store_server.py"), d,
                        ready, stalled, str(serve_first)], env=ENV,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  done = threading.Event()

  def killer():
    while not done.is_set():
      if os.path.exists(stalled):
        p.send_signal(signal.SIGKILL)
        return
      time.sleep(0.01)

  watcher = threading.Thread(target=killer, daemon=True)
  try:
    t0 = time.time()
    while not os.path.exists(ready):
      assert p.poll() is None and time.time() - t0 < 30, \
          f"stalling server for {d} did not start"
      time.sleep(0.05)
    watcher.start()
    yield "http://" + _text(ready), p, stalled
  finally:
    done.set()
    if p.poll() is None:
      p.kill()
    p.wait(10)


@pytest.mark.parametrize("replicas", [1, 0], ids=["replica", "checkpoint"])
def test_peer_killed_during_multiprocess_restore(tmp, replicas):
  # The old job: 2 processes (data=2 x model=2), store i on host i; with
  # replicas=1 each store also holds the other process's snapshot. Host 1's
  # server holds the first read it gets (a batched POST /read carries up to
  # 16 MiB of pieces) and is SIGKILLed while it is in flight; the two new
  # processes (1 x 4, disjoint from the old ones) both list it first, so
  # both find it dead (mid-request or refused).
  ck = os.path.join(tmp, "ckpt")
  stores = save_job(tmp, 2, [2, 2], replicas=replicas, checkpoint=ck,
                    checkpoint_step=4)
  with servers(stores[:1]) as (urls, _), \
      stalling_server(stores[1], serve_first=0) as (dying, proc, stalled):
    results, out = run_job(tmp, "restore", procs=2, devices=2, mesh=[1, 4],
                           action="restore", locations=[[dying, urls[0]]] * 2,
                           checkpoint=ck, timeout_s=5, retries=1)
    assert os.path.exists(stalled) and proc.wait(10) == -signal.SIGKILL
  check_values(out, 2)  # bitwise, from the surviving copy or the checkpoint
  for r in results:
    assert r["ok"], r
    rep = r["report"]
    assert rep["dead_sources"] == [dying], rep  # the report names it
    if replicas:
      check_results([r])
      assert not rep["from_checkpoint"] and rep["steps_lost"] == 0
      assert rep["per_source_bytes"][urls[0]] > 0
      assert any(dying in f and "unreachable" in f
                 for f in rep["fallbacks"]), rep["fallbacks"]
    else:  # process 1's boxes had no other copy: every process falls back
      assert rep["from_checkpoint"] and rep["step"] == 4, rep
      assert rep["steps_lost"] == 3 and rep["lost_processes"] == [1], rep
      # Which failure the client saw first (refused at the listing, or
      # cut mid-read: "every copy failed") is a race; that the reasons
      # name the dead peer is not.
      assert any(dying in f for f in rep["fallbacks"]), rep["fallbacks"]


def test_launch_resizes_by_schedule(tmp):
  sched = os.path.join(tmp, "schedule.txt")
  with open(sched, "w") as f:
    f.write("step 3 procs 2\nstep 6 procs 3\n")
  job = os.path.join(tmp, "job")
  r = subprocess.run(
      [sys.executable, "-m", "tenplex_jax", "launch", "--procs", "1",
       "--devices-per-proc", "2", "--schedule", sched, "--job-dir", job,
       "--timeout", "150", "--", sys.executable,
       os.path.join(HERE, "launch_train.py"), "8"],
      env=ENV, capture_output=True, text=True, timeout=170)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  final = json.loads(_text(os.path.join(job, "final.json")))
  assert (final["procs"], final["step"], final["generation"]) == (3, 8, 2)
  assert final["devices"] == 6
  # Every element was incremented once per step across the two restarts.
  got = sorted(v for vals in final["shards"].values() for v in vals)
  assert got == [float(i + 8) for i in range(4)]  # devices 0, 1 of 6
  rep = json.loads(_text(os.path.join(job, "restore_0_2.json")))
  assert rep["step"] == 6 and rep["network_bytes"] == \
      rep["host_lower_bound_bytes"]


@contextlib.contextmanager
def launcher(tmp, total, *opts, procs=1, **env):
  """``tenplex-jax launch`` of tests/launch_train.py in its own process
  group, which is killed on the way out whatever happened."""
  job = os.path.join(tmp, "job")
  cmd = [sys.executable, "-m", "tenplex_jax", "launch", "--procs",
         str(procs), "--devices-per-proc", "2", "--job-dir", job,
         "--timeout", "150", *opts, "--", sys.executable,
         os.path.join(HERE, "launch_train.py"), str(total)]
  # Append mode: the processes write through the same open file as this
  # test reads with seek(0), and a shared offset moved back by that seek
  # would let their next line overwrite the log's start (a launcher
  # test once saw 'pid 2110' and then a line cut to 'pid', for 60 s).
  log = open(os.path.join(tmp, "launch.log"), "a+")
  p = subprocess.Popen(cmd, env={**ENV, **{k: str(v) for k, v in env.items()}},
                       stdout=log, stderr=subprocess.STDOUT,
                       start_new_session=True)
  try:
    yield p, job, log
  finally:
    # With the children the launcher did not get to stop; never after p
    # was reaped (its pid can be another process group's id by then).
    kill_group(p)
    log.close()


def finish(p, log, timeout=170):
  rc = wait_unreaped(p, timeout)  # reaped by launcher()'s kill_group
  log.seek(0)
  return rc, log.read()


def check_final(job, *, procs, step, generation):
  final = json.loads(_text(os.path.join(job, "final.json")))
  assert (final["procs"], final["step"], final["generation"]) == \
      (procs, step, generation), final
  # Every element was incremented once per step, across the restarts.
  for start, stop, vals in final["boxes"]:
    assert vals == [float(i + step) for i in range(start, stop)], final
  return final


def test_launch_resizes_on_sigusr1(tmp):
  # Generation 0 steps slowly (0.4 s) so that the signal lands before its
  # last step; generation 1, after the resize, at full speed.
  with launcher(tmp, 12, TRAIN_SLEEP=0.4, TRAIN_SLEEP_GEN0=1) as (p, job, log):
    t0 = time.time()
    while not os.path.exists(os.path.join(job, "progress_0")):
      assert p.poll() is None and time.time() - t0 < 60, "no progress"
      time.sleep(0.05)
    at_signal = int(_text(os.path.join(job, "progress_0")) or 0)
    with open(os.path.join(job, "request"), "w") as f:
      f.write("2\n")
    p.send_signal(signal.SIGUSR1)
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  req = json.loads(_text(os.path.join(job, "resize_request.json")))
  assert req["procs"] == 2 and at_signal < req["step"] < 12, (req, at_signal)
  assert f"1 -> 2 processes at step {req['step']}" in out, out[-2000:]
  rep = json.loads(_text(os.path.join(job, "restore_0_1.json")))
  assert rep["step"] == req["step"] and not rep["from_checkpoint"]
  check_final(job, procs=2, step=12, generation=1)


def test_launch_resizes_on_request_resize_from_the_script(tmp):
  with launcher(tmp, 6, TRAIN_REQUEST="2:2:4") as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  assert "1 -> 2 processes at step 4" in out, out[-2000:]
  for i in range(2):  # both new processes restored the state of step 4
    rep = json.loads(_text(os.path.join(job, f"restore_{i}_1.json")))
    assert rep["step"] == 4 and rep["lost_processes"] == []
  check_final(job, procs=2, step=6, generation=1)


def _recovery(job, gen=1):
  return json.loads(_text(os.path.join(job, f"recovery_{gen}.json")))


def test_launch_restarts_after_a_process_crash(tmp):
  # Process 1 of 2 dies after step 5; its store (a separate server) lives.
  with launcher(tmp, 8, procs=2, TRAIN_SNAPSHOT_EVERY=2,
                TRAIN_CRASH="5:1:exit") as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  assert "process 1 failed (exit code 3) at step 5; restart 1 of 3 on 2" \
      " processes" in out, out[-3000:]
  rec = _recovery(job)
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["source"]) == (5, 4, 1, "stores"), rec
  assert "recovered step 4 from stores (failed at step 5, 1 steps lost)" \
      in out
  check_final(job, procs=2, step=8, generation=1)


def test_launch_crash_mid_save_round_restores_the_previous_round(tmp):
  # Process 1 dies before its snapshot of step 6, after process 0 committed
  # its own: step 6 is incomplete, and step 4 (kept, keep=2) is restored
  # from the stores, without a checkpoint.
  with launcher(tmp, 8, procs=2, TRAIN_SNAPSHOT_EVERY=2,
                TRAIN_CRASH="6:1:midsave") as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  rec = _recovery(job)
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["source"]) == (6, 4, 2, "stores"), rec
  for i in range(2):
    rep = json.loads(_text(os.path.join(job, f"restore_{i}_1.json")))
    assert rep["step"] == 4 and rep["steps_lost"] == 2, rep  # 6 - 4
    assert not rep["from_checkpoint"] and rep["lost_processes"] == [], rep
  check_final(job, procs=2, step=8, generation=1)


def test_launch_lost_host_restores_from_store_replica_and_shrinks(tmp):
  # Process 1's host is lost (store deleted); its snapshot has a replica
  # in store 0. The job goes on with one process.
  with launcher(tmp, 8, "--replicas", "1", "--on-failure", "shrink",
                procs=2, TRAIN_SNAPSHOT_EVERY=2,
                TRAIN_CRASH="5:1:host") as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  assert "restart 1 of 3 on 1 processes" in out, out[-3000:]
  rec = _recovery(job)
  assert (rec["restored_step"], rec["steps_lost"], rec["source"]) == \
      (4, 1, "stores"), rec
  rep = json.loads(_text(os.path.join(job, "restore_0_1.json")))
  assert rep["lost_processes"] == [] and not rep["from_checkpoint"]
  store0 = os.path.join(job, "store", "0")
  assert set(rep["per_source_bytes"]) == {store0}, rep  # the replica
  check_final(job, procs=1, step=8, generation=1)


def test_launch_lost_host_without_replica_uses_checkpoint(tmp):
  ck = os.path.join(tmp, "ckpt")
  with launcher(tmp, 8, "--checkpoint", ck, procs=2, TRAIN_SNAPSHOT_EVERY=2,
                TRAIN_CKPT_EVERY=3, TRAIN_CRASH="5:1:host") as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 0, out[-3000:]
  rec = _recovery(job)
  # Stores hold step 4 of process 0 only; the checkpoint has step 3.
  assert (rec["failed_step"], rec["restored_step"], rec["steps_lost"],
          rec["source"], rec["lost_processes"]) == \
      (5, 3, 2, "checkpoint", [1]), rec
  for i in range(2):
    rep = json.loads(_text(os.path.join(job, f"restore_{i}_1.json")))
    assert rep["from_checkpoint"] and rep["steps_lost"] == 1, rep  # 4 - 3
  check_final(job, procs=2, step=8, generation=1)


def test_launch_gives_up_after_max_restarts(tmp):
  with launcher(tmp, 4, "--max-restarts", "1", TRAIN_CRASH="2:0:exit",
                TRAIN_CRASH_ALWAYS=1) as (p, job, log):
    rc, out = finish(p, log)
  assert rc == 3, out[-3000:]
  assert "restart 1 of 1 on 1 processes" in out
  assert "no restarts left (1 used), giving up" in out, out[-3000:]
  fails = [json.loads(x) for x in
           _text(os.path.join(job, "failures.jsonl")).splitlines()]
  assert [(f["generation"], f["process"], f["exit_code"], f["step"])
          for f in fails] == [(0, 0, 3, 2), (1, 0, 3, 2)]
  assert not os.path.exists(os.path.join(job, "final.json"))
