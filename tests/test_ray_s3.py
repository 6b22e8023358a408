"""The Ray example on an existing cluster whose nodes share nothing, its
persistent checkpoint on S3 (moto's server on loopback, started here)."""

import logging
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("ray")
pytest.importorskip("moto")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "ray", "train.py")
sys.path.insert(0, os.path.join(ROOT, "examples", "ray"))
from share_nothing import ShareNothingCluster, namespaces_permitted  # noqa: E402

from objservers import moto_server, new_bucket, s3_env  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]


def _objects(bucket: str, prefix: str) -> list[str]:
  import boto3
  c = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
  pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                      Prefix=prefix)
  return [o["Key"] for p in pages for o in p.get("Contents", [])]


def test_example_with_address_restores_a_killed_node_from_s3(monkeypatch):
  """``examples/ray/train.py --address HEAD --storage s3://BUCKET/runs`` on
  a running 3-node share-nothing cluster (no disk or /dev/shm shared: the
  checkpoint and the check's logs go to the bucket): a (1, 3)-worker job
  starts on 3 workers, each uploading its own shards to the checkpoint
  every 4 steps (no snapshots, no replicas: the stores hold nothing to
  restore from). A worker node is killed after the step-8 checkpoint: the
  job restarts on the 2 nodes left and restores the newest checkpoint
  from S3 (3 saving processes' shards onto 2), then runs to the end. The
  example exits 0 after checking every restored digest against the saved
  one and every step's global batch read exactly once."""
  why = namespaces_permitted()
  if why:
    pytest.skip(why)
  logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per
  # request otherwise
  with moto_server() as srv:
    s3_env(monkeypatch, srv.endpoint)
    bucket = new_bucket(srv.endpoint)
    c = ShareNothingCluster()
    proc, lines = None, []
    try:
      for _ in range(3):
        c.add_node()
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
      victim = c.nodes[2]

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
      keys = _objects(bucket, f"runs/{job}/")
      store = f"runs/{job}/tenplex-store/procs/"
      # Every one of the 3 first workers uploaded its own shards; the
      # 2-worker group after the kill, its own.
      assert {k[len(store):].split("/")[0] for k in keys
              if k.startswith(store)} == {"0", "1", "2"}, keys[:20]
      assert not _objects(bucket, f"runs/{job}-logs/")  # removed at the end
    finally:
      if proc is not None:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait(timeout=60)
        proc.stdout.close()
      c.shutdown()
  assert not os.path.exists(c.base)
  for node in c.nodes:
    assert c.left_in(node) == []
