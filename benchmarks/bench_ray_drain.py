"""A node leaving an elastic JAX job on Ray: planned drain against kill, on nodes that share nothing.

One share-nothing cluster (``examples/ray/share_nothing.py``: every node in
its own mount namespace with private /dev/shm and /tmp, on its own
loopback address; a head and 2 nodes of 1 CPU) runs one
``tenplex_jax.ray`` job of the example's decoder LM
(``examples/ray/train.py``'s training script: 4 layers, AdamW, the layout
from the configuration search) with ``num_workers=(1, 3)``, snapshots
every 2 steps with 1 store replica, and its persistent checkpoint on S3
(moto's server on loopback, started here; every 10 steps). Events
alternate in the same job, ``drain, kill, drain, kill, ...``, each once the
job runs on 3 workers again and has run 3 steps:

* **drain**: Ray's GCS drains a node running a worker (``tray.drain_node``,
  a preemption notice with a 120 s deadline); the job saves and moves off
  it by itself;
* **kill**: a node running a worker is killed without warning (every
  process of its namespace: its /dev/shm with its store goes with it).

After the job has run a step without the node, the node goes (a drained
one is killed) and a fresh one joins; the job grows back onto it by
itself. Per event: seconds from the signal to the first step of the next
group that runs a step, the steps lost and where that group restored
from. Prints the medians per kind and their ratio and writes the rows and
the machine's load to ``--out``. At the end the example's check runs
(every restored digest equals the saved one, every step's global batch
read exactly once).

Usage (root: mount namespaces): python benchmarks/bench_ray_drain.py
          [--events 4] [--steps 80] [--out benchmarks/bench_ray_drain_result.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ray", "train.py")
sys.path.insert(0, os.path.join(ROOT, "examples", "ray"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def run(args) -> dict:
  import ray
  from ray.train import RunConfig
  from objservers import moto_server, new_bucket
  from tenplex_jax import ray as tray
  from train import SharedNothingNodes, check, log_read

  logging.getLogger("werkzeug").setLevel(logging.WARNING)
  kinds = ["drain" if i % 2 == 0 else "kill" for i in range(args.events)]
  events: list[dict] = []
  with moto_server() as srv:
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint,
                       "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_REGION": "us-east-1"})
    bucket = new_bucket(srv.endpoint)
    cluster = SharedNothingNodes(3)  # the head and 2 nodes
    log_dir = tempfile.mkdtemp(prefix="tenplex-bench-drain-",
                               dir="/var/tmp")  # seen by every node
    try:
      ray.init(address=cluster.address, _node_ip_address=cluster.head_ip,
               log_to_driver=False)

      def on_progress(job, step):
        gen = len(job.generations)
        cur = job.current
        if events and "done" not in events[-1]:
          e = events[-1]
          if gen > e["gen"] and step > cur["start_step"]:
            # The job ran a step without the node: it goes, a fresh one
            # joins (the job grows back onto it by itself).
            e["done"] = time.time()
            if e["kind"] == "drain":
              cluster.remove(e["node"], kill=True)
            cluster.add()
          return
        if len(events) >= len(kinds) or cur["workers"] < 3 or \
            step < cur["start_step"] + 3:
          return
        busy = [x for x in cluster.workers() if x in cur["nodes"]]
        if not busy:
          return
        kind = kinds[len(events)]
        e = {"kind": kind, "node": busy[-1], "gen": gen, "step": step,
             "t": time.time()}
        events.append(e)
        if kind == "drain":
          tray.drain_node(busy[-1], deadline_s=120)
        else:
          cluster.remove(busy[-1], kill=True)
        print(f"{kind} at step {step} (group {gen})", flush=True)

      job = f"bench-drain-{os.getpid()}"
      result = tray.run(
          EXAMPLE, ["--worker", str(args.steps), "2", log_dir, "search",
                    "10"],
          num_workers=(1, 3), replicas=1, on_progress=on_progress, job=job,
          run_config=RunConfig(storage_path=f"s3://{bucket}/runs",
                               name=job),
          env={"EXAMPLE_SLEEP": "0.2"})
      gens = result["generations"]
      rows = []
      for e in events:
        after = [g for g in gens if g["t0"] > e["t"]
                 and g.get("first_step_s") is not None]
        if not after:
          continue
        g = after[0]
        r = g.get("restored") or {}
        rows.append({
            "kind": e["kind"], "step": e["step"],
            "signal_to_first_step_s": g["t0"] + g["first_step_s"] - e["t"],
            "group": g["generation"], "workers": g["workers"],
            "source": r.get("source"),
            "steps_lost": (r.get("report") or {}).get("steps_lost")})
      problems = check(log_dir, args.steps)
      return {"events": rows, "check_passed": not problems,
              "problems": problems,
              # what the check read, kept when it failed
              "digests": log_read(log_dir, "digests") if problems else None,
              "generations": [{k: g.get(k) for k in (
                  "generation", "workers", "start_step", "outcome",
                  "started_s", "first_step_s", "end_s")} for g in gens]}
    finally:
      ray.shutdown()
      cluster.shutdown()
      shutil.rmtree(log_dir, ignore_errors=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--events", type=int, default=4)
  ap.add_argument("--steps", type=int, default=80)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  load0 = os.getloadavg()
  print(f"load {load0[0]:.1f}", flush=True)
  t0 = time.time()
  res = run(args)
  summary = {}
  for kind in ("drain", "kill"):
    xs = [r["signal_to_first_step_s"] for r in res["events"]
          if r["kind"] == kind]
    if xs:
      summary[kind] = {"median_s": statistics.median(xs), "n": len(xs),
                       "all_s": xs}
  for r in res["events"]:
    print(f"{r['kind']:5s} at step {r['step']:3d}:"
          f" {r['signal_to_first_step_s']:6.1f} s to the first step of group"
          f" {r['group']} ({r['workers']} workers, restored from"
          f" {r['source']}, {r['steps_lost']} steps lost)")
  ratio = (summary["kill"]["median_s"] / summary["drain"]["median_s"]
           if len(summary) == 2 else None)
  for kind, s in summary.items():
    print(f"median {kind}: {s['median_s']:.1f} s (n={s['n']})")
  if ratio:
    print(f"kill / drain: {ratio:.2f}x")
  print(f"check passed: {res['check_passed']}; load"
        f" {os.getloadavg()[0]:.1f}; wall {time.time() - t0:.0f} s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({**res, "summary": summary, "kill_over_drain": ratio,
                 "load_before": load0[:3], "load_after": os.getloadavg()[:3],
                 "cores": os.cpu_count(),
                 "command": " ".join([os.path.basename(sys.executable),
                                      *sys.argv])}, f, indent=1)


if __name__ == "__main__":
  main()
