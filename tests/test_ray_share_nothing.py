"""A Ray cluster whose nodes share nothing (examples/ray/share_nothing.py):
each node in its own mount namespace with private /dev/shm, /tmp and
working directory, on its own loopback address."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import (  # noqa: E402
    NodeAffinitySchedulingStrategy)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples", "ray"))
from share_nothing import (  # noqa: E402
    STARVATION_TOLERANT, ShareNothingCluster, namespaces_permitted)

import test_ray  # noqa: E402
from tenplex_jax.data.order import global_batch_ids  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "ray", "train.py")

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]


@pytest.fixture(scope="module")
def sn_cluster():
  """Three share-nothing nodes (the head first), every process, mount and
  directory gone at the end, also when a test fails (and checked gone)."""
  why = namespaces_permitted()
  if why:
    pytest.skip(why)
  c = ShareNothingCluster(system_config=test_ray.SYSTEM_CONFIG)
  try:
    for _ in range(3):
      c.add_node()
    ray.init(address=c.address, _node_ip_address=c.head_ip,
             log_to_driver=False)
    # the GCS's settings
    assert ray._config.health_check_timeout_ms() == \
        STARVATION_TOLERANT["health_check_timeout_ms"]
    assert ray._config.health_check_period_ms() == \
        test_ray.SYSTEM_CONFIG["health_check_period_ms"]
    yield c
  finally:
    ray.shutdown()
    c.shutdown()
  assert not os.path.exists(c.base)
  for node in c.nodes:
    assert c.left_in(node) == []


@ray.remote(num_cpus=0)
def _probe(paths):
  return {"ip": ray.util.get_node_ip_address(),
          "seen": [os.path.exists(p) for p in paths]}


def test_nodes_share_no_memory_or_disk(sn_cluster):
  """Each node is alive on its own loopback address; a file a node writes
  to its /dev/shm, /tmp and working directory is there for that node's own
  Ray workers and invisible to another node's workers and to the host; a
  killed node's namespace is gone with all its processes."""
  c = sn_cluster
  nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes()
           if n["Alive"]}
  assert sorted(nodes) == ["127.0.0.2", "127.0.0.3", "127.0.0.4"], nodes
  assert [x["node_id"] for x in c.nodes] == [nodes[x["ip"]] for x in c.nodes]
  writer, other = c.nodes[1], c.nodes[2]
  paths = ["/dev/shm/tenplex-sn-probe", "/tmp/tenplex-sn-probe",
           os.path.join(writer["work"], "tenplex-sn-probe")]
  r = c.run_in(writer, ["sh", "-c", " && ".join(
      f"echo {i} > {p}" for i, p in enumerate(paths))],
      capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert not any(os.path.exists(p) for p in paths)  # not on the host
  got = {}
  for node in (writer, other, c.nodes[0]):
    got[node["ip"]] = ray.get(_probe.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            node["node_id"], soft=False)).remote(paths), timeout=120)
  assert got == {
      "127.0.0.3": {"ip": "127.0.0.3", "seen": [True, True, True]},
      "127.0.0.4": {"ip": "127.0.0.4", "seen": [False, False, False]},
      "127.0.0.2": {"ip": "127.0.0.2", "seen": [False, False, False]}}, got
  r = c.run_in(other, ["cat", paths[0]], capture_output=True, text=True,
               timeout=60)
  assert r.returncode != 0 and "No such file" in r.stderr
  t0 = time.monotonic()
  c.kill_node(writer, wait_dead=True)
  # Dead within seconds (each health check refused at once: about 5 x 1 s,
  # test_ray.SYSTEM_CONFIG), though a node that answers them late gets 60 s
  # each (STARVATION_TOLERANT: 5 x 61 s), and the kill itself waits for the
  # processes' exits.
  assert time.monotonic() - t0 < 100, time.monotonic() - t0
  assert writer["proc"].poll() is not None
  assert c.left_in(writer) == []  # no process of the node is left
  # A node's processes are those in its namespace and its session: the
  # kernel gives a new namespace a dead one's id (a later node, also of
  # another cluster, gets the killed writer's), so a record whose namespace
  # id is now another node's (here: other's, with the writer's session)
  # names none of that node's processes (nor does a reaper's).
  assert c._members(other)
  assert c._members({**other, "proc": writer["proc"]}) == []


def test_teardown_leaves_nothing():
  """A cluster that fails while it starts (a node Ray refuses to start)
  still ends every process it started and removes its directory."""
  why = namespaces_permitted()
  if why:
    pytest.skip(why)
  c = ShareNothingCluster(head_ip="127.0.0.9",
                          start_timeout=120)
  try:
    with pytest.raises(RuntimeError, match="ray start on 127.0.0.10"):
      with c:
        c.add_node()
        c.add_node(resources={"CPU": 1})  # Ray: use --num-cpus
  finally:
    c.shutdown()
  started = c.nodes
  assert len(started) == 2 and not os.path.exists(c.base)
  for node in started:
    assert node["proc"].poll() is not None
    assert c.left_in(node) == []
  out = subprocess.run(["pgrep", "-f", c.base], capture_output=True,
                       text=True, check=False).stdout.split()
  assert out == [], out


_TOKEN_HOME_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from share_nothing import ShareNothingCluster
import ray
with ShareNothingCluster(head_ip="127.0.0.12", start_timeout=60,
                         system_config={}) as c:
  c.add_node()
  ray.init(address=c.address, _node_ip_address=c.head_ip,
           log_to_driver=False)
  alive = [n for n in ray.nodes() if n["Alive"]]
  print("alive", len(alive), "mode", os.environ.get("RAY_AUTH_MODE"))
  ray.shutdown()
"""


def test_a_cluster_starts_where_a_ray_auth_token_exists():
  """Where ``~/.ray/auth_token`` exists (a local ``ray.init()`` writes
  one) and ``RAY_AUTH_MODE`` is unset, ``ray start --head`` turns token
  authentication on by itself: the cluster's driver authenticates alike
  (its wait for the head timed out before), and the job connects."""
  why = namespaces_permitted()
  if why:
    pytest.skip(why)
  import pathlib
  import tempfile
  # Not under /tmp, which each node covers with its own: a home the nodes
  # see, as a host's is.
  home = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-sn-home-",
                                       dir="/var/tmp"))
  try:
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(os.urandom(32).hex())
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["HOME"] = str(home)
    run = subprocess.run(
        [sys.executable, "-c", _TOKEN_HOME_SCRIPT,
         os.path.join(ROOT, "examples", "ray")],
        env=env, capture_output=True, text=True, timeout=240)
  finally:
    shutil.rmtree(home, ignore_errors=True)
  assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
  assert "alive 1 mode token" in run.stdout, run.stdout[-2000:]


def _alive(c):
  return [x for x in c.nodes if not x.get("killed")]


def test_job_grows_survives_a_kill_and_a_drain(sn_cluster):
  """The elastic job on share-nothing nodes: a (1, 3)-worker job on two
  nodes grows by itself onto a node that joins (its worker, with an empty
  /dev/shm, reads its shard from the peers' store servers over their
  loopback addresses); a node is then killed with all it held (its
  /dev/shm gone) after the snapshot at step 6 (one store replica): the job
  restarts on the two nodes left from that snapshot, the lost node's
  shards from their replicas on the others (step 7 replayed). Then Ray drains
  one of the two nodes (a preemption notice with a deadline): the job saves
  and moves off it by itself (0 steps lost, restored from the stores, the
  drained node's half over the network from its store server, still up
  until the deadline), and the node is killed after. Each group holds at
  known steps until the driver has acted (``TRAIN_HOLD``), so the steps are
  exact; the script checks every restored shard bitwise; every step's
  global batch is read exactly once in the surviving trajectory."""
  import tempfile
  from tenplex_jax import ray as tray
  c = sn_cluster
  while len(_alive(c)) > 2:
    c.kill_node(_alive(c)[-1], wait_dead=True)
  while len(_alive(c)) < 2:
    c.add_node()
  total = 14
  # Not /tmp: every node has its own. This host directory stands for the
  # shared file system of the test's logs and hold files (no state).
  shared = tempfile.mkdtemp(prefix="tenplex-sn-job-", dir="/var/tmp")
  try:
    log_dir, hold = os.path.join(shared, "logs"), os.path.join(shared, "h")
    os.makedirs(log_dir)
    os.makedirs(hold)
    events = {}

    def go(name):
      open(os.path.join(hold, f"go_{name}"), "w").close()

    def driver(job, step):
      gen = len(job.generations)
      if gen == 0 and "added" not in events:
        events["added"] = c.add_node()
      elif gen == 0 and job.current.get("auto_request"):
        go(0)
      if gen == 1:
        go(1)
        if step >= 7 and "killed" not in events:
          events["stores"] = {
              n: ray.get(ray.get_actor(tray.store_actor_name(job.job, n),
                                       namespace=tray.NAMESPACE)
                         .info.remote(), timeout=60)["url"]
              for n in set(job.current["nodes"])}
          victim = _alive(c)[1]  # a worker node that saved at step 6
          events["killed"] = victim
          job.replicas = 0  # the next groups' snapshots: no replica
          events["t_kill"] = time.time()
          c.kill_node(victim)
          go("1_7")
      if gen == 2 and step >= 7 and "drained" not in events:
        node = _alive(c)[1]
        events["drained"] = node
        events["t_drain"] = time.time()
        tray.drain_node(node["node_id"], deadline_s=300)
      if gen == 2 and job.current.get("drain"):
        go(2)  # the job asked for the move while held: at step 7 + 3
      if gen == 3 and step >= 11 and "drain_killed" not in events:
        events["drain_killed"] = True  # the deadline: the node goes
        c.kill_node(events["drained"])
        go(3)

    job = tray.Job(test_ray.SCRIPT, [str(total), log_dir],
                   num_workers=(1, 3), job="test-sn", on_progress=driver,
                   replicas=1, start_timeout=300,
                   env={"TRAIN_SLEEP": "0.1", "TRAIN_SNAPSHOT_EVERY": "2",
                        "TRAIN_HOLD": hold, "TRAIN_HOLD_STEPS": "7"})
    try:
      result = job.run()
    except BaseException:
      print("generations so far:", job.generations, "current:", job.current,
            "events:", {k: v for k, v in events.items()
                        if not isinstance(v, dict)})
      raise
    gens = result["generations"]
    kill_s = gens[2]["t0"] + gens[2]["first_step_s"] - events["t_kill"]
    drain_s = gens[3]["t0"] + gens[3]["first_step_s"] - events["t_drain"]
    print(f"signal to the next group's first step: kill {kill_s:.1f} s,"
          f" drain {drain_s:.1f} s (the drain's includes 3 steps and the"
          " save before the deadline)")
    assert [(g["workers"], g["start_step"], g["outcome"]) for g in gens] == [
        (2, 0, "resize"), (3, 4, "failed"), (2, 6, "resize"),
        (1, 10, "done")], gens
    assert gens[2]["drain"]["nodes"] == [events["drained"]["node_id"]]
    assert gens[2]["drain"]["step"] == 10
    assert events["drained"]["node_id"] not in gens[3]["nodes"]
    drained = gens[3]["restored"]
    assert (drained["source"], drained["step"],
            drained["report"]["steps_lost"]) == ("stores", 10, 0), drained
    # The single worker read its node's half locally, the drained node's
    # half from that node's store server (no replicas by then).
    assert (drained["report"]["local_bytes"],
            drained["report"]["network_bytes"]) == (24, 24), drained
    # Each node's store server listens on that node's loopback address.
    ips = {x["node_id"]: x["ip"] for x in c.nodes}
    assert {n: u.split("//")[1].rsplit(":", 1)[0]
            for n, u in events["stores"].items()} == {
                n: ips[n] for n in events["stores"]}
    assert len(set(ips[n] for n in events["stores"])) == 3
    new = events["added"]["node_id"]
    assert gens[1]["restored"]["source"] == "stores"
    assert gens[1]["restored"]["step"] == 4
    assert new in gens[1]["nodes"]
    assert events["killed"]["node_id"] in gens[1]["nodes"]
    assert events["killed"]["node_id"] not in gens[2]["nodes"]
    restored = gens[2]["restored"]
    # (steps_lost counts saved rounds past the restored one: none; the
    # group replays step 7, which was never saved)
    assert (restored["source"], restored["step"], restored["failed_step"],
            restored["report"]["steps_lost"]) == ("stores", 6, 7, 0), restored
    # The killed node's shards came from their replicas on the two nodes
    # left (the script checked every restored shard bitwise).
    assert [(r["restored"]["source"], r["restored"]["step"],
             r["restored"]["report"]["from_checkpoint"])
            for r in gens[2]["results"]] == [("stores", 6, False)] * 2
    assert c.left_in(events["killed"]) == []
    with open(os.path.join(log_dir, "final.json")) as f:
      final = json.load(f)
    assert final["step"] == total and final["procs"] == 1
    seen = test_ray._final_trajectory(log_dir)
    assert sorted(seen) == list(range(total))
    for step, pieces in seen.items():
      got = np.full(test_ray.B, -2)
      for lo, ids in pieces:
        assert (got[lo:lo + len(ids)] == -2).all(), (step, pieces)
        got[lo:lo + len(ids)] = ids
      np.testing.assert_array_equal(got, global_batch_ids(
          0, step * test_ray.B // test_ray.N, step % (test_ray.N // test_ray.B),
          test_ray.N, test_ray.B))
  finally:
    shutil.rmtree(shared, ignore_errors=True)


def test_workers_follow_the_gpus(sn_cluster):
  """``worker_resources={"GPU": 1}``: the auto-resize counts the alive
  nodes' GPUs, not their CPUs. A node declaring 2 logical GPUs (and 2
  CPUs) joins CPU-only nodes: a (1, 8)-worker job asking a GPU per worker
  runs 2 workers, both on it (JAX on CPU devices), to the end."""
  import tempfile
  from tenplex_jax import ray as tray
  c = sn_cluster
  gpu = c.add_node(num_cpus=2, num_gpus=2)
  shared = tempfile.mkdtemp(prefix="tenplex-sn-gpu-", dir="/var/tmp")
  try:
    cpu_job = tray.Job(test_ray.SCRIPT, num_workers=(1, 8))
    gpu_job = tray.Job(test_ray.SCRIPT, num_workers=(1, 8),
                       worker_resources={"GPU": 1})
    cpus = sum(int(n["Resources"].get("CPU", 0)) for n in ray.nodes()
               if n["Alive"])
    assert (cpu_job.capacity(), gpu_job.capacity()) == (cpus, 2)
    assert gpu_job.slots({"CPU": 8, "GPU": 3}) == 3
    assert gpu_job.slots({"CPU": 1, "GPU": 3}) == 1
    with pytest.raises(tray.UsageError, match="worker_resources"):
      tray.Job(test_ray.SCRIPT, num_workers=1, worker_resources={"GPU": -1})
    for j in (cpu_job, gpu_job):
      ray.kill(j.ctrl)
    result = tray.run(test_ray.SCRIPT, ["3", shared], num_workers=(1, 8),
                      worker_resources={"GPU": 1}, job="test-sn-gpu")
    gens = result["generations"]
    assert [(g["workers"], g["outcome"]) for g in gens] == [(2, "done")]
    assert gens[0]["nodes"] == [gpu["node_id"]] * 2
    with open(os.path.join(shared, "final.json")) as f:
      assert json.load(f)["step"] == 3
  finally:
    shutil.rmtree(shared, ignore_errors=True)
    c.kill_node(gpu, wait_dead=True)


def _s3_objects(bucket: str, prefix: str) -> list[str]:
  import boto3
  c = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
  pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                      Prefix=prefix)
  return [o["Key"] for p in pages for o in p.get("Contents", [])]


# Last in the module: it kills one of the module cluster's nodes.
def test_example_with_address_restores_a_killed_node_from_s3(sn_cluster,
                                                             monkeypatch):
  """``examples/ray/train.py --address HEAD --storage s3://BUCKET/runs`` on
  the running share-nothing cluster, 3 nodes alive (no disk or /dev/shm
  shared: the checkpoint and the check's logs go to the bucket, moto's
  server on loopback, started here; the nodes' own environment has no S3
  endpoint or credentials, the driver passes them): a (1, 3)-worker job
  starts on 3 workers, each uploading its own shards to the checkpoint
  every 4 steps (no snapshots, no replicas: the stores hold nothing to
  restore from). A worker node is killed after the step-8 checkpoint: the
  job restarts on the 2 nodes left and restores the newest checkpoint
  from S3 (3 saving processes' shards onto 2), then runs to the end. The
  example exits 0 after checking every restored digest against the saved
  one and every step's global batch read exactly once."""
  pytest.importorskip("moto")
  from objservers import moto_server, new_bucket, s3_env
  c = sn_cluster
  while len(_alive(c)) < 3:
    c.add_node()
  # Until Ray lists the 3 nodes alive with their CPUs free (the earlier
  # tests' workers gone): the job sizes itself on what is free.
  deadline = time.monotonic() + 120
  while not (len([n for n in ray.nodes() if n["Alive"]]) == 3
             and ray.available_resources().get("CPU", 0) >= 3):
    assert time.monotonic() < deadline, (ray.nodes(), ray.available_resources())
    time.sleep(0.2)
  logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per
  # request otherwise
  with moto_server() as srv:
    s3_env(monkeypatch, srv.endpoint)
    bucket = new_bucket(srv.endpoint)
    proc, lines = None, []
    try:
      env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "",
             "PYTHONUNBUFFERED": "1"}
      proc = subprocess.Popen(
          [sys.executable, EXAMPLE, "--address", c.address,
           "--storage", f"s3://{bucket}/runs", "--steps", "16",
           "--max-workers", "3", "--snapshot-every", "0", "--replicas",
           "0", "--checkpoint-every", "4", "--sleep", "0.3"],
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          env=env, start_new_session=True)
      killed = threading.Event()
      victim = _alive(c)[2]  # a worker node

      def watch():
        for line in proc.stdout:
          lines.append(line)
          m = re.search(r"step (\d+) workers 3 ", line)
          if m and int(m.group(1)) >= 9 and not killed.is_set():
            killed.set()  # after the step-8 checkpoint
            c.kill_node(victim)

      reader = threading.Thread(target=watch, daemon=True)
      reader.start()
      rc = proc.wait(timeout=1200)
      reader.join(timeout=60)
      out = "".join(lines)
      print(out[-4000:])  # shown with -rP or on failure
      assert rc == 0, out[-6000:]
      assert killed.is_set(), out[-6000:]
      groups = re.findall(r"^group (\d+): (\d+) workers, steps (\d+)\.\.(\d+),"
                          r" ([^;]*);", out, re.M)
      assert groups[0][1] == "3" and groups[0][4].startswith("failed"), groups
      assert groups[-1][1] == "2", groups
      m = re.search(r"restored step (\d+) from checkpoint \(failed at step"
                    r" (\d+)", groups[-1][4])
      assert m and int(m.group(1)) in (8, 12), groups
      assert groups[-1][2] == m.group(1) and groups[-1][3] == "16", groups
      assert re.search(r"^check: 1 restores, each bitwise the saved state"
                       r" \(digests\); 16 steps, each global batch exactly"
                       r" once$", out, re.M), out[-3000:]
      job = re.search(r"checkpoint goes to s3://\S+/runs/(example-\d+),",
                      out).group(1)
      keys = _s3_objects(bucket, f"runs/{job}/")
      store = f"runs/{job}/tenplex-store/procs/"
      # Every one of the 3 first workers uploaded its own shards; the
      # 2-worker group after the kill, its own.
      assert {k[len(store):].split("/")[0] for k in keys
              if k.startswith(store)} == {"0", "1", "2"}, keys[:20]
      assert not _s3_objects(bucket, f"runs/{job}-logs/")  # removed at the end
      assert c.left_in(victim) == []  # (the whole cluster: the fixture's end)
    finally:
      if proc is not None:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait(timeout=60)
        proc.stdout.close()
