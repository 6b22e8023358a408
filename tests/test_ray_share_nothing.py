"""A Ray cluster whose nodes share nothing (examples/ray/share_nothing.py):
each node in its own mount namespace with private /dev/shm, /tmp and
working directory, on its own loopback address."""

import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import (  # noqa: E402
    NodeAffinitySchedulingStrategy)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples", "ray"))
from share_nothing import ShareNothingCluster, namespaces_permitted  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]


@pytest.fixture(scope="module")
def sn_cluster():
  """Three share-nothing nodes (the head first), every process, mount and
  directory gone at the end, also when a test fails."""
  why = namespaces_permitted()
  if why:
    pytest.skip(why)
  c = ShareNothingCluster()
  try:
    for _ in range(3):
      c.add_node()
    ray.init(address=c.address, _node_ip_address=c.head_ip,
             log_to_driver=False)
    yield c
  finally:
    ray.shutdown()
    c.shutdown()


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
  c.kill_node(writer)
  assert writer["proc"].poll() is not None
  assert c._members(writer) == []  # no process of the node is left


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
    assert c._members(node) == []
  out = subprocess.run(["pgrep", "-f", c.base], capture_output=True,
                       text=True, check=False).stdout.split()
  assert out == [], out
