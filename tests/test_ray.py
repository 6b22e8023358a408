"""tenplex_jax.ray on a local multi-node Ray cluster (ray.cluster_utils)."""

import glob
import json
import os
import shutil
import signal
import sys
import time

import numpy as np
import pytest

import procs

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import jax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tenplex_jax import ray as tray  # noqa: E402
from tenplex_jax.data.order import global_batch_ids  # noqa: E402
from tenplex_jax.search import best_mesh_for, transformer_spec  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples", "ray"))
from share_nothing import STARVATION_TOLERANT  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "ray_train.py")
N, B = 48, 12


def _pids(cluster):
  out = []
  for node in [cluster.head_node, *cluster.worker_nodes]:
    if node is None:
      continue
    for infos in node.all_processes.values():
      # Only processes still running: a number that ended may be another
      # process's by now (its start time would be recorded for it).
      out += [i.process.pid for i in infos
              if i.process is not None and i.process.poll() is None]
  return out


def _kill_leftovers(seen):
  """SIGKILL to each process of ``seen`` (a :class:`procs.Seen`) still
  running: never to a later process that got a dead one's pid number."""
  seen.kill()


# One worker runs both tests (`pytest -n 2 --dist loadgroup`): they share
# the module's cluster instead of starting one each.
pytestmark = pytest.mark.xdist_group("ray")


# Ray's GCS health-checks each raylet every 3 s by default and declares a
# node dead after 5 checks in a row fail: a killed node (each check refused
# at once) about 15 s after its kill. The tests' clusters check every 1 s:
# a killed node is dead in about 5 s, while a node starved of CPU still has
# 5 x (60 + 1) s (each check fails only at STARVATION_TOLERANT's timeout).
SYSTEM_CONFIG = {**STARVATION_TOLERANT, "health_check_period_ms": 1000}


# Loopback only: the head on 127.0.0.2 (Ray turns 127.0.0.1 and
# "localhost" into the machine's outward address), each added node on its
# own 127.0.0.K.
HEAD_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def cluster():
  """One local cluster for the module (1 CPU per node, each node on its own
  loopback address), torn down with every process it started, also when a
  test fails. Ray's health check as on the share-nothing cluster: a node
  starved of CPU on a loaded host is not declared dead (a killed one is,
  within seconds)."""
  c = Cluster(initialize_head=True, head_node_args={
      "num_cpus": 1, "include_dashboard": False,
      "node_ip_address": HEAD_IP, "_system_config": SYSTEM_CONFIG})
  c.pids = procs.Seen(_pids(c))
  c.next_ip = 3
  try:
    assert c.address.startswith(HEAD_IP + ":"), c.address
    ray.init(address=c.address, _node_ip_address=HEAD_IP,
             log_to_driver=False)
    # the GCS's settings
    assert ray._config.health_check_timeout_ms() == \
        STARVATION_TOLERANT["health_check_timeout_ms"]
    assert ray._config.health_check_period_ms() == \
        SYSTEM_CONFIG["health_check_period_ms"]
    yield c
  finally:
    ray.shutdown()
    c.pids.update(_pids(c))
    c.shutdown()
    _kill_leftovers(c.pids)


def _add_node(c):
  """A 1-CPU node on the next loopback address 127.0.0.K."""
  c.add_node(num_cpus=1, node_ip_address=f"127.0.0.{c.next_ip}")
  c.next_ip += 1
  c.pids.update(_pids(c))


def _nodes(c, k):
  """Exactly k alive nodes (the head included), 1 CPU each."""
  while 1 + len(c.worker_nodes) < k:
    _add_node(c)
  while 1 + len(c.worker_nodes) > k:
    c.remove_node(next(iter(c.worker_nodes)))  # a set in Ray
  c.pids.update(_pids(c))
  # Until Ray itself lists exactly those nodes alive with their CPUs free
  # (on a loaded host an added node registers, and a removed one's actors
  # go, seconds later): a job started before would size itself on fewer.
  deadline = time.monotonic() + 120
  while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    free = ray.available_resources().get("CPU", 0)
    if len(alive) == k and free >= k:
      return
    if time.monotonic() > deadline:
      raise TimeoutError(f"Ray lists {len(alive)} nodes alive with {free}"
                         f" CPUs free, 120 s after asking for {k}")
    time.sleep(0.2)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def _assert_ended(pids, started, seen_only=False, within=60.0):
  """Waits up to ``within`` s for the processes of ``pids`` to end, then
  asserts none is left. A pid ``started`` (a ``procs.Seen``) saw counts only
  while it is that process (its start time); one it did not see counts while
  a process has that number, unless ``seen_only``."""
  def left():
    return [p for p in pids if _alive(p) and (
        started.same(p) if seen_only or p in started else True)]
  deadline = time.monotonic() + within
  while time.monotonic() < deadline and left():
    time.sleep(0.5)
  assert not left(), pids


def _held_job_dirs(tmp_path, job_name):
  """(the job's ``/dev/shm`` directory, a new log directory, a new hold
  directory) of a test whose script waits for ``go_<generation>`` files in
  ``hold`` (``TRAIN_HOLD``)."""
  log_dir, hold = str(tmp_path / "logs"), str(tmp_path / "hold")
  os.makedirs(log_dir)
  os.makedirs(hold)
  return f"/dev/shm/tenplex-ray-{job_name}", log_dir, hold


def _read_ids(log_dir):
  seen = {}
  for path in sorted(glob.glob(os.path.join(log_dir, "ids_*.jsonl"))):
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        seen.setdefault(r["step"], []).append((r["lo"], r["ids"]))
  return seen


def _assert_each_sample_once(seen, total):
  """Every step 0..total-1 was logged, and its pieces tile the global batch
  with each sample exactly once (``seen``: :func:`_read_ids`'s form)."""
  assert sorted(seen) == list(range(total))
  for step, pieces in seen.items():
    got = np.full(B, -2)
    for lo, ids in pieces:
      assert (got[lo:lo + len(ids)] == -2).all(), (step, pieces)
      got[lo:lo + len(ids)] = ids
    np.testing.assert_array_equal(
        got, global_batch_ids(0, step * B // N, step % (N // B), N, B))


@pytest.mark.slow
def test_grow_onto_added_node_then_shrink(cluster, tmp_path):
  """A (1, 3)-worker job starts 2 workers on 2 one-CPU nodes; a third node
  joins while they hold at their first step and the job, told no step,
  grows to 3 workers (one per node) by itself; asked to shrink to 1, it
  does and ends at step 12. Each group holds after its first step until
  the driver has acted (``TRAIN_HOLD``), so the resize steps do not depend
  on how fast the loaded machine runs: each is 3 steps past the held step.
  Each group lays the state out as the configuration search chooses for its
  worker count, and restores at the step the previous one saved, bitwise
  (the script checks every shard against a static run), with no steps
  lost; each step's global batch is read exactly once; the store actors and
  their directories are gone at the end."""
  _nodes(cluster, 2)
  total = 12
  try:
    log_dir = str(tmp_path / "logs")
    hold = str(tmp_path / "hold")
    os.makedirs(log_dir)
    os.makedirs(hold)
    events = {}

    def go(gen):  # lets group `gen` go on past its first step
      open(os.path.join(hold, f"go_{gen}"), "w").close()

    def driver(job, step):  # in the driver, between its polls
      gen = len(job.generations)  # the running group
      if gen == 0 and "added" not in events:
        events["added"] = step  # the job notices the node by itself
        _add_node(cluster)  # (blocks until it is up)
      elif gen == 0 and job.current.get("auto_request"):
        go(0)
      if (gen == 1 and step >= job.current["start_step"] + 1
          and "shrink" not in events):
        events["shrink"] = job.request_resize(1)
        go(1)
      if gen >= 2:  # (a restart after a failure goes on too: the
        go(gen)     # assertion below then shows its error at once)

    t0 = time.time()
    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=(1, 3),
                      job="test-grow", on_progress=driver,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_LAYOUT": "search",
                           "TRAIN_HOLD": hold})
    print(f"tenplex_jax.ray job: {time.time() - t0:.1f} s")
    gens = result["generations"]
    # (1, 3) workers on 2 one-CPU nodes: 2; the added node: 3, at the step
    # the driver chose by itself (3 past the held step 1); request_resize(1)
    # caps it at 1 (3 past the grown group's held step).
    assert gens[0].get("auto_request", {}).get("workers") == 3, gens
    assert "shrink" in events, (events, gens)
    grow, shrink = gens[0]["auto_request"]["step"], events["shrink"]
    assert events["added"] <= 1 and (grow, shrink) == (4, 8), events
    assert [(g["workers"], g["start_step"], g["outcome"]) for g in gens] == [
        (2, 0, "resize"), (3, grow, "resize"), (1, shrink, "done")], gens
    assert [g.get("step") for g in gens[:2]] == [grow, shrink]
    assert len(set(gens[1]["nodes"])) == 3  # grew onto the added node
    # Each group's layout is the configuration search's for its devices.
    spec = transformer_spec(name="tiny", layers=2, hidden=48, heads=4,
                            vocab=96, seq_len=16)
    for g in gens:
      best = best_mesh_for(spec, jax.devices()[:g["workers"]], global_batch=B,
                           seq_len=16, devices_per_host=1,
                           restrict={"pipeline": (1,)}, max_microbatches=1,
                           remat=("none",))
      want = nn.logical_to_mesh_sharding(P("embed"), best.mesh, best.rules)
      with open(os.path.join(log_dir, f"layout_{g['generation']}.json")) as f:
        assert json.load(f) == {"mesh": dict(want.mesh.shape),
                                "spec": list(want.spec)}, g
    assert gens[0]["restored"] == {}  # the first group initialises
    for g, step in ((gens[1], grow), (gens[2], shrink)):
      assert g["restored"]["step"] == step
      assert g["restored"]["source"] == "stores"
      assert g["restored"]["report"]["steps_lost"] == 0
    # w is float32[12]: 16 bytes per shard on 3 workers. The worker on the
    # added node (an empty store) read its shard from peers' servers; the
    # single worker read its own node's third locally, the rest from peers.
    new_node = (set(gens[1]["nodes"]) - set(gens[0]["nodes"])).pop()
    reports = [r["restored"]["report"] for r in gens[1]["results"]]
    on_new = [rep for rep, node in zip(reports, gens[1]["nodes"])
              if node == new_node]
    assert [(r["local_bytes"], r["network_bytes"]) for r in on_new] == [(0, 16)]
    last = gens[2]["restored"]["report"]
    assert (last["local_bytes"], last["network_bytes"]) == (16, 32)
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 1
    assert final["data"] == {"epoch": total * B // N, "index": total % (N // B)}
    _assert_each_sample_once(_read_ids(log_dir), total)
    # The store actors' directories go as the actors stop; under load a
    # stop can outlast the driver's wait for it, so allow it a minute.
    deadline = time.time() + 60
    while os.path.exists("/dev/shm/tenplex-ray-test-grow") and \
        time.time() < deadline:
      time.sleep(0.5)
    assert not os.path.exists("/dev/shm/tenplex-ray-test-grow"), \
        _left("/dev/shm/tenplex-ray-test-grow")
  finally:
    shutil.rmtree("/dev/shm/tenplex-ray-test-grow", ignore_errors=True)


# Right after the grow test, which leaves 3 nodes (no node started for it),
# and before the kill test, which takes 2 of them.
def test_group_prepared_for_another_size_is_dropped(cluster, tmp_path):
  """A 2-worker job on 3 nodes: the driver starts a 1-worker group ahead
  (``Job.prepare_next(1)``), which waits at its turn; then it asks for 3
  workers instead. The prepared group never restores: its process is
  gone, the 3-worker group starts as without it (not prepared) and
  restores the saved step bitwise (the script's check), 0 steps lost,
  each step's batch exactly once."""
  _nodes(cluster, 3)
  total, job_name = 8, "test-prepared-dropped"
  shm, log_dir, hold = _held_job_dirs(tmp_path, job_name)
  seen = {}
  try:
    def driver(job, step):
      gen = len(job.generations)
      if gen == 1:
        open(os.path.join(hold, "go_1"), "w").close()
        return
      if "asked" in seen or step < job.current["start_step"] + 1:
        return
      kept = job.standbys()
      if "prepared" not in seen:
        if any(s["ready"] is not None for s in kept):
          # (False while the standby where the group goes still imports:
          # the driver tries again at its polls)
          job.prepare_next(1)
          seen["prepared"] = True
        return
      waiting = [s for s in kept if s.get("waiting")]
      if len(waiting) == 1:
        seen["pid"] = waiting[0]["pid"]
        seen["asked"] = job.request_resize(3)
        open(os.path.join(hold, "go_0"), "w").close()

    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=2,
                      job=job_name, on_progress=driver,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_HOLD": hold})
    gens = result["generations"]
    assert "pid" in seen, seen  # the prepared group waited at its turn
    assert [(g["workers"], g["outcome"], g["prepared"]) for g in gens] == [
        (2, "resize", False), (3, "done", False)], gens
    assert gens[1]["start_step"] == seen["asked"] == gens[0]["step"]
    assert gens[1]["restored"]["step"] == gens[1]["start_step"]
    assert gens[1]["restored"]["source"] == "stores"
    assert gens[1]["restored"]["report"]["steps_lost"] == 0
    assert seen["pid"] not in gens[1]["pids"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(seen["pid"]):
      time.sleep(0.5)
    assert not _alive(seen["pid"]), seen
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 3
    _assert_each_sample_once(_read_ids(log_dir), total)
  finally:
    shutil.rmtree(shm, ignore_errors=True)


def _left(path):
  """What is left under ``path``: each entry with its age in seconds (to
  tell a store that was never stopped from a late write after its stop)."""
  out, now = [], time.time()
  for d, dirs, files in os.walk(path):
    for name in dirs + files:
      p = os.path.join(d, name)
      try:
        out.append((os.path.relpath(p, path), round(now - os.lstat(p)
                                                    .st_mtime, 1)))
      except OSError:
        pass
  return sorted(out)[:50]


def _final_trajectory(log_dir):
  """Per step, the pieces of the newest generation that ran it (a failure
  replays the steps after the restored snapshot)."""
  newest = {}
  for path in glob.glob(os.path.join(log_dir, "ids_*.jsonl")):
    gen = int(os.path.basename(path).split("_")[1])
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        g, pieces = newest.get(r["step"], (-1, []))
        if gen > g:
          newest[r["step"]] = (gen, [(r["lo"], r["ids"])])
        elif gen == g:
          pieces.append((r["lo"], r["ids"]))
  return {s: p for s, (_, p) in newest.items()}


@pytest.mark.slow
def test_nodes_killed_recover_from_replicas_then_checkpoint(cluster, tmp_path):
  """A (1, 3)-worker job on 3 nodes snapshots every 2 steps (one store
  replica) and writes an Orbax checkpoint every 4 steps to its Ray
  ``RunConfig`` storage. A worker node is killed without warning: the job
  shrinks by itself to the 2 nodes left and restores the newest snapshot
  (the lost node's shards from their replicas). The driver then turns
  replicas off and kills the other worker node: no store holds that node's
  shards, so the last worker restores the newest checkpoint from the
  storage path. Each restore reports the steps lost; the job finishes with
  every step's batch exactly once in the surviving trajectory."""
  from ray.train import RunConfig
  _nodes(cluster, 3)
  total = 22
  try:
    log_dir = str(tmp_path / "logs")
    os.makedirs(log_dir)
    killed = []

    def driver(job, step):
      gen = len(job.generations)
      if len(killed) == gen and step >= (5 if gen == 0 else
                                         killed[0] + 6):  # a checkpoint
        # of the second group is complete by then
        victim = [n for n in cluster.worker_nodes
                  if n.node_id in job.current["nodes"]]
        if victim:
          killed.append(step)
          job.replicas = 0  # the next group's snapshots have no replica
          cluster.remove_node(victim[0], allow_graceful=False)

    config = RunConfig(storage_path=str(tmp_path / "storage"),
                       name="kill-run")
    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=(1, 3),
                      job="test-kill", on_progress=driver, replicas=1,
                      run_config=config,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_SNAPSHOT_EVERY": "2",
                           "TRAIN_CHECKPOINT_EVERY": "4"})
    gens = result["generations"]
    print(f"killed at steps {killed}:", [{k: g.get(k) for k in (
        "failed_step", "restored", "started_s", "first_step_s")}
        for g in gens[1:]])
    assert [(g["workers"], g["outcome"]) for g in gens] == [
        (3, "failed"), (2, "failed"), (1, "done")], gens
    # Each recovery handed its ranks to the standby workers kept on the
    # nodes left (the killed node's standby went with it).
    assert [g["standby"] for g in gens] == [3, 2, 1], gens
    for g, k, source, every in ((gens[1], killed[0], "stores", 2),
                                (gens[2], killed[1], "checkpoint", 4)):
      failed, restored = g["failed_step"], g["restored"]
      assert failed >= k
      assert restored["source"] == source, restored
      assert restored["failed_step"] == failed
      assert restored["step"] % every == 0
      # (a worker may complete the round of the step after its last
      # progress report before the node dies)
      assert failed - 2 * every <= restored["step"] <= failed + 1
      # The report counts from the newest round in the stores (steps after
      # it were never saved; a worker may have saved the round of the step
      # after its last progress report).
      lost = restored["report"]["steps_lost"]
      assert 0 <= lost <= failed + 1 - restored["step"]
      assert g["start_step"] == restored["step"]
    # The checkpoint is the one in the RunConfig's storage path.
    # (a node killed while writing leaves an unfinished Orbax temporary there)
    assert gens[2]["restored"]["step"] in [int(d.split("_")[1]) for d in (
        os.listdir(tmp_path / "storage" / "kill-run"))
        if not d.endswith(".orbax-checkpoint-tmp")]
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 1
    _assert_each_sample_once(_final_trajectory(log_dir), total)
  finally:
    shutil.rmtree("/dev/shm/tenplex-ray-test-kill", ignore_errors=True)


def _tls(tmp_path):
  """``tls_cert``/``tls_key``/``tls_ca`` for :func:`tray.run`: a new CA and
  a certificate for every loopback address the cluster's nodes listen on
  (127.0.0.K)."""
  import trustme
  ca = trustme.CA()
  cert = ca.issue_cert(ray.util.get_node_ip_address(),
                       *(f"127.0.0.{k}" for k in range(1, 17)))
  pki = {k: str(tmp_path / f"{k}.pem") for k in ("ca", "cert", "key")}
  ca.cert_pem.write_to_path(pki["ca"])
  cert.private_key_and_cert_chain_pem.write_to_path(pki["cert"])
  cert.private_key_pem.write_to_path(pki["key"])
  os.chmod(pki["key"], 0o600)
  return {"tls_cert": pki["cert"], "tls_key": pki["key"],
          "tls_ca": pki["ca"]}


@pytest.mark.slow
def test_resizes_hand_ranks_to_standby_workers(cluster, tmp_path):
  """A 1 -> 2 -> 1 -> 2-worker job on 2 nodes (``schedule``): each group
  holds after its first step until the driver sees the next group's
  standby workers started with their imports done and, handed their ranks
  ahead of the resize, waiting at their turn in ``restore_or_init``; every
  later group is those standbys (their pids, started before the resize:
  no actor starts on the resize's path), restores the step the previous one saved bitwise
  (the script checks every shard against a static run) with each step's
  batch read exactly once, and a group on a mesh the job ran before (the
  second 1- and 2-worker groups) compiles nothing for its first step (jax's
  persistent compilation cache beside the stores). The standbys left at
  the end are gone with the job."""
  _nodes(cluster, 2)
  total, job_name = 12, "test-standby"
  shm, log_dir, hold = _held_job_dirs(tmp_path, job_name)
  sizes = [1, 2, 1, 2]
  seen_ready = {}  # generation: pids of the standbys kept when it was let go
  started = procs.Seen()  # those pids with their start times
  jobs = []
  try:
    def driver(job, step):
      jobs[:1] = [job]
      gen = len(job.generations)
      if gen in seen_ready or gen + 1 >= len(sizes):
        if gen + 1 >= len(sizes):
          open(os.path.join(hold, f"go_{gen}"), "w").close()
        return
      if step < job.current["start_step"] + 1:
        return
      kept = job.standbys()
      ready = [s for s in kept if s["ready"] is not None]
      # The next group's standbys with their imports done, and every other
      # one kept ready too (its pid known): the group may take any of them;
      # the next group started ahead from them (the schedule's next size)
      # and waiting at its turn.
      waiting = [s for s in kept if s.get("waiting")]
      if (len(ready) >= sizes[gen + 1] and len(ready) == len(kept)
          and len(waiting) == sizes[gen + 1]):
        seen_ready[gen] = {s["pid"] for s in kept}
        started.update(seen_ready[gen])
        open(os.path.join(hold, f"go_{gen}"), "w").close()

    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=1,
                      schedule={3: 2, 6: 1, 9: 2}, job=job_name,
                      on_progress=driver,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_HOLD": hold})
    gens = result["generations"]
    assert [(g["workers"], g["start_step"], g["outcome"]) for g in gens] == [
        (1, 0, "resize"), (2, 3, "resize"), (1, 6, "resize"),
        (2, 9, "done")], gens
    for g in gens[1:]:
      k = g["generation"]
      # Every worker was a standby whose imports were done before the
      # resize began, and one the driver saw ready while the previous
      # group held: no process started on the resize's path.
      assert g["standby"] == g["workers"], g
      assert all(r < 0 for r in g["standby_ready_s"]), g
      # Started ahead (ranks, jax.distributed, the script up to its
      # restore) while the previous group ran; its turn came at the save.
      assert g["prepared"], g
      assert g["first_step_s"] > 0, g
      assert set(g["pids"]) <= seen_ready[k - 1], (g["pids"], seen_ready)
      assert not set(g["pids"]) & set(gens[k - 1]["pids"])
      assert all(r["standby"] for r in g["results"])
      assert g["restored"]["step"] == g["start_step"]
      assert g["restored"]["source"] == "stores"
      assert g["restored"]["report"]["steps_lost"] == 0

    def first_step_compiles(k):
      out = []
      for p in range(sizes[k]):
        with open(os.path.join(log_dir, f"compiles_{k}_{p}.json")) as f:
          out.append(json.load(f)["first_step"])
      return out
    # (a process may find a program its peer compiled moments before)
    assert sum(first_step_compiles(0)) > 0 and sum(first_step_compiles(1)) > 0
    assert first_step_compiles(2) == [0]  # group 0's mesh: from the cache
    assert first_step_compiles(3) == [0, 0]  # group 1's
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 2
    _assert_each_sample_once(_read_ids(log_dir), total)
    # The unused standbys went with the job: every process it started
    # (Ray ends a killed actor's process within moments).
    assert jobs and jobs[0].standbys() == []
    pids = set().union(*seen_ready.values(), *(g["pids"] for g in gens))
    _assert_ended(pids, started)
  finally:
    shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_standby_whose_imports_hang_is_replaced_and_never_used(
    cluster, tmp_path, capfd):
  """A 1 -> 2-worker job on 2 nodes (``schedule={3: 2}``, no group
  prepared ahead) whose standby workers import tests/standby_hang.py: the
  first to import it once the driver armed it (the driver's first poll,
  after the first group's worker imported it) never finishes. Past
  ``standby_timeout`` the driver kills it, says so on stderr and in
  ``job.late_standbys``, and starts another; the first group holds until
  the hung process is gone and 2 standbys are ready; then the test
  SIGKILLs one of those (a standby that dies once ready), and the driver
  replaces it too (its ping fails) before the group goes on. The resize's
  group is the 2 ready standbys then (their pids), neither the hung nor
  the killed one, and restores the saved step bitwise (the script's
  check), each step's batch once; no process of the job is left."""
  _nodes(cluster, 2)
  total, job_name = 6, "test-standby-hang"
  shm, log_dir, hold = _held_job_dirs(tmp_path, job_name)
  # (the module's default: Ray workers get no environment of the test's)
  token = f"/dev/shm/tenplex-test-standby-hang-{os.getuid()}"
  files = [token, token + ".hung", token + ".imported"]
  seen = {}
  started = procs.Seen()
  try:
    for f in files:
      if os.path.exists(f):
        os.unlink(f)

    def driver(job, step):
      seen["job"] = job
      gen = len(job.generations)
      if gen == 1:
        open(os.path.join(hold, "go_1"), "w").close()
        return
      if "armed" not in seen:  # the standbys started from now on
        open(token, "w").close()
        seen["armed"] = True
      if "ready" in seen or not os.path.exists(token + ".hung"):
        return
      if "hung" not in seen:
        with open(token + ".hung") as f:
          seen["hung"] = int(f.read())
        started.add(seen["hung"])
      if _alive(seen["hung"]):
        return
      ready = {s["pid"] for s in job.standbys() if s["ready"] is not None}
      started.update(ready)
      if "killed" not in seen:
        if len(ready) >= 2:  # one of them dies
          seen["killed"] = min(ready)
          os.kill(seen["killed"], signal.SIGKILL)
        return
      if len(ready) >= 2 and seen["killed"] not in ready:
        seen["ready"] = ready
        open(os.path.join(hold, "go_0"), "w").close()

    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=1,
                      schedule={3: 2}, job=job_name, on_progress=driver,
                      prepare=False, standby_imports=("tests.standby_hang",),
                      # A standby here is ready 1.7-2.8 s after its
                      # creation at load 5-7 on 2 cores (its process, and
                      # the worker module with jax); 15 s leaves five times
                      # that, and a standby a loaded host keeps past it is
                      # replaced too (the assertions allow it).
                      standby_timeout=15.0,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_HOLD": hold})
    gens = result["generations"]
    assert "ready" in seen, seen
    assert [(g["workers"], g["start_step"], g["outcome"], g["prepared"])
            for g in gens] == [(1, 0, "resize", False),
                               (2, 3, "done", False)], gens
    assert gens[1]["standby"] == 2, gens[1]
    assert set(gens[1]["pids"]) <= seen["ready"], (gens[1], seen)
    assert not {seen["hung"], seen["killed"]} & set(gens[1]["pids"])
    assert gens[1]["restored"]["step"] == 3
    assert gens[1]["restored"]["source"] == "stores"
    # the hung one, and any other a loaded host kept past the timeout
    late = seen["job"].late_standbys
    assert late and all(x["waited_s"] > 15.0 for x in late), late
    assert "(standby timeout 15 s): killed it" in capfd.readouterr().err
    with open(os.path.join(log_dir, "final.json")) as f:
      assert json.load(f)["step"] == total
    _assert_each_sample_once(_read_ids(log_dir), total)
    pids = seen["ready"] | {seen["hung"], seen["killed"]} | set(
        gens[0]["pids"])
    _assert_ended(pids, started)
  finally:
    if "job" in seen:  # (its standbys, if the run failed before its end)
      seen["job"].drop_standbys()
    started.kill()
    shutil.rmtree(shm, ignore_errors=True)
    for f in files:
      if os.path.exists(f):
        os.unlink(f)


@pytest.mark.parametrize("at_turn", [False, True],
                         ids=["before_turn", "at_turn"])
def test_prepared_group_not_ready_in_time_is_dropped(cluster, tmp_path, capfd,
                                                     at_turn):
  """A 1 -> 2-worker job on 2 nodes (``schedule={3: 2}``) whose group started
  ahead for the resize hangs (``TRAIN_PREPARE_HANG``: its worker 1 never
  reaches its turn). Past ``prepare_timeout`` the driver drops it, says so
  on stderr (the group, its size, the worker not ready) and kills its
  processes; the resize starts its 2 workers as without it (not prepared)
  and restores the saved step bitwise (the script's check), 0 steps lost,
  each step's batch once. ``before_turn``: the running group is held until
  the drop (the running group's record has it); ``at_turn``: the running
  group saves while the prepared one hangs, and the resize waits for it
  only up to its timeout (the new group's record has it).

  Both jobs run with ``tls_cert``/``tls_key``/``tls_ca`` (issue 22): the
  store actors serve HTTPS and the workers verify them against the CA; the
  resize's worker on the other node reads its shard from the first node's
  store actor over ``https://``. (This was a job of its own, the same
  1 -> 2-worker resize on 2 nodes.)"""
  _nodes(cluster, 2)
  total, job_name = 6, f"test-prepare-timeout-{int(at_turn)}"
  # at_turn: the turn comes 0.5 s after the group prepared ahead started
  # (measured at load 5-7 on 2 cores: two steps and the save of the running
  # group); past its timeout before the turn it would be dropped before the
  # turn instead, so 10 s leaves many times that.
  timeout = 10.0 if at_turn else 8.0
  shm, log_dir, hold = _held_job_dirs(tmp_path, job_name)
  seen = {}
  started = procs.Seen()
  try:
    def driver(job, step):
      gen = len(job.generations)
      if gen == 1:
        open(os.path.join(hold, "go_1"), "w").close()
        return
      if "pids" not in seen:
        prepared = [s for s in job.standbys() if s.get("prepared")]
        if len(prepared) == 2:
          seen["pids"] = [s["pid"] for s in prepared]
          started.update(seen["pids"])
          if at_turn:  # the resize comes while it hangs
            open(os.path.join(hold, "go_0"), "w").close()
      elif not at_turn and job.current.get("dropped_prepared"):
        open(os.path.join(hold, "go_0"), "w").close()

    result = tray.run(SCRIPT, [str(total), log_dir], num_workers=1,
                      schedule={3: 2}, job=job_name, on_progress=driver,
                      prepare_timeout=timeout, max_restarts=0,
                      env={"TRAIN_SLEEP": "0.2", "TRAIN_HOLD": hold,
                           "TRAIN_PREPARE_HANG": "1"}, **_tls(tmp_path))
    gens = result["generations"]
    assert "pids" in seen, seen  # a group was started ahead
    assert [(g["workers"], g["start_step"], g["outcome"], g["prepared"])
            for g in gens] == [(1, 0, "resize", False),
                               (2, 3, "done", False)], gens
    dropped = gens[1 if at_turn else 0]["dropped_prepared"]
    assert "dropped_prepared" not in gens[0 if at_turn else 1]
    assert len(dropped) == 1, dropped
    d = dropped[0]
    # worker 1 hangs; worker 0 is ready unless a loaded host kept it past the
    # timeout too (then both are named)
    assert (d["generation"], d["workers"], d["at_turn"]) == (1, 2, at_turn), d
    assert d["not_ready"] in ([1], [0, 1]), d
    assert d["waited_s"] > timeout, d
    assert sorted(d["pids"]) == sorted(seen["pids"]), (d, seen)
    err = capfd.readouterr().err
    assert ("the group prepared ahead for the resize to 2 workers"
            " (generation 1) not ready") in err, err
    assert f"(prepare timeout {timeout:g} s; workers not waiting at their" \
           f" turn: {d['not_ready']})" in err, err
    assert not set(seen["pids"]) & set(gens[1]["pids"])
    assert gens[1]["restored"]["step"] == 3
    assert gens[1]["restored"]["source"] == "stores"
    assert gens[1]["restored"]["report"]["steps_lost"] == 0
    # The worker on the other node read from the first one's store actor,
    # over HTTPS only.
    reports = [r["restored"]["report"] for r in gens[1]["results"]]
    remote = [s for r in reports for s, n in r["per_source_bytes"].items()
              if n and not s.startswith("/")]
    assert remote and all(s.startswith("https://") for s in remote), reports
    # the dropped group's processes, the hung one too
    _assert_ended(seen["pids"], started, seen_only=True)
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 2
    _assert_each_sample_once(_read_ids(log_dir), total)
  finally:
    shutil.rmtree(shm, ignore_errors=True)
