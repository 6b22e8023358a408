"""Resizing an elastic JAX job on Ray: tenplex against Ray Train's restart from a checkpoint.

One local Ray cluster (``ray.cluster_utils.Cluster``: 2 nodes, 1 CPU each)
runs one ``tenplex_jax.ray`` job of ``bench_ray_train.py`` (a 1.13 GiB
state: a 6 x 4096^2 float32 MLP with Adam's two moments, rows sharded over
the workers) that resizes between 1 and 2 workers, 8 times: the driver
asks for each resize (``request_resize``) once the group has run 3 steps
and, before a tenplex resize, once the next group's standby workers have
their imports done. The resizes alternate between two ways, in the same
job (``tenplex, ray, ray, tenplex, ...``, so each way does 2 grows and 2
shrinks):

* **tenplex**: every worker saves its shards to its node's tenplex store
  (a detached store actor's ``/dev/shm`` directory), each array deleted
  once written (``delete_arrays``, as ``save_and_exit`` does); the new
  group is the job's standby workers (started ahead with the imports
  done), handed their ranks before the resize (``Job.prepare_next``: they
  start ``jax.distributed``, build the target and compile the step from
  it, from jax's persistent compilation cache when the job ran that mesh
  before, allocate the arrays the restore reads into (``allocate_ahead``),
  then wait at their turn), which restore from the stores (own node
  first, then the peers' servers) once the last old worker saved;
* **ray** (Ray Train's restart from a checkpoint): every worker writes its
  shards into one Orbax checkpoint in the run's storage
  (``RunConfig(storage_path=..., name=...)``, a local disk directory here,
  as Ray's default ``~/ray_results``); a new worker group of fresh actors
  starts (imports included) without a compilation cache, opens it as a
  ``ray.train.Checkpoint`` and restores it with Orbax's
  ``StandardCheckpointer`` onto its shardings. (``JaxTrainer`` does not
  initialise ``jax.distributed`` on CPU workers in Ray 2.60, see
  docs/ray.md.)

Per resize, from the signal (``resize_due`` returns the new size) to the
first step of the new group, split at the slowest worker's timestamps:
``save`` (signal -> saved), ``relaunch`` (saved -> the script starts in
the new workers), ``imports``, ``distributed`` (``jax.distributed``),
``setup`` (mesh, target), ``compile`` (the step's AOT compilation),
``turn`` (a group started ahead: waiting for the last save), ``restore``
and ``step`` (the first step), in the order each way's script reaches
them (Ray Train's restart compiles after its restore); what a group
started ahead finished before the save ended counts 0 (``transitions``).
``start`` = relaunch through setup. (a) = start, (b) = save + restore,
(c) = compile. Prints per mode the medians and the ratios and writes the
rows, medians, the load and the machine's memory to ``--out`` (and a bar
chart beside it).

Usage: python benchmarks/bench_ray.py [--resizes 8] [--layers 6] [--dim 4096]
          [--no-standby] [--no-cache] [--no-prepare] [--no-free]
          [--no-allocate-ahead]
          [--out benchmarks/bench_ray_result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_ray_train.py")
PHASES = ("save", "relaunch", "imports", "distributed", "setup", "compile",
          "turn", "restore", "step")
START = ("relaunch", "imports", "distributed", "setup")
MODES = ("tenplex", "ray", "ray", "tenplex")


def _procs(cluster) -> list:
  """The Ray processes of ``cluster``'s nodes (``subprocess.Popen``s: a
  kill reaches one only while it is not reaped, never a later process
  that got its pid)."""
  out = []
  for node in [cluster.head_node, *cluster.worker_nodes]:
    if node is not None:
      for infos in node.all_processes.values():
        out += [i.process for i in infos if i.process is not None]
  return out


def transitions(rows: list[dict]) -> list[dict]:
  """Per resize (generation g -> g + 1) the phases at the slowest worker.

  Each new worker records its milestones in the order its script reached
  them (``marks``: the phase that ends there, and when). Per milestone the
  slowest worker's time counts, from the old group's last save on: a phase
  that a group started ahead finished before that costs the resize nothing
  (0 here; its own length is in ``ahead``), one that ran across it counts
  from the save."""
  out = []
  for g in sorted({r["gen"] for r in rows if r["kind"] == "save"}):
    save = [r for r in rows if r["kind"] == "save" and r["gen"] == g]
    new = [r for r in rows if r["kind"] == "start" and r["gen"] == g + 1]
    if not new:
      continue
    signal_t = min(r["t_signal"] for r in save)
    saved = max(r["t_saved"] for r in save)
    names = [m[0] for m in new[0]["marks"]]
    assert all([m[0] for m in r["marks"]] == names for r in new)
    at = [max(r["marks"][i][1] for r in new) for i in range(len(names))]
    phases, ahead, prev, raw_prev = {}, {}, saved, None
    for name, t in zip(names, at):
      clipped = max(prev, t)
      phases[name] = clipped - prev
      if raw_prev is not None:
        ahead[name] = t - raw_prev
      prev, raw_prev = clipped, t
    f1 = at[-1]
    assert {r["mode"] for r in save} == {r["mode"] for r in new}
    rep = [r["restored"] for r in new if r["restored"]]
    # tenplex's restore in parts (its RestoreReport's seconds), slowest
    # worker: manifests, plan, read (destination buffers and the reads),
    # build (the arrays).
    parts = {f"restore_{k}": max(x["seconds"][k] for x in rep)
             for k in ("manifest", "plan", "read", "build")} if rep else {}
    row = {"mode": save[0]["mode"], "from": save[0]["procs"],
           "to": new[0]["procs"], "at_step": save[0]["step"],
           "save": saved - signal_t, **{p: phases.get(p, 0.0)
                                        for p in PHASES[1:]}}
    row.update({
        "start": sum(row[p] for p in START),
        "standby": all(r["standby"] for r in new),
        "prepared": all(r.get("prepared") for r in new),
        "cache": all(r["cache"] for r in new),
        "total": f1 - signal_t,
        # each phase's own length (slowest worker, milestone to milestone),
        # wherever it fell; the ready margin: the save's end minus the end
        # of the phase before the turn (> 0: waiting before the save ended)
        "ahead": ahead,
        "ready_margin": (saved - at[names.index("turn") - 1]
                         if "turn" in names else None),
        "steady_step_s": max(r["step_s"] for r in save),
        "local_bytes": sum(x["local_bytes"] for x in rep) if rep else None,
        "network_bytes": sum(x["network_bytes"] for x in rep) if rep
        else None, **parts})
    out.append(row)
  return out


def run(args) -> dict:
  import ray
  from ray.cluster_utils import Cluster
  from ray.train import RunConfig
  from rich.progress import Progress
  from tenplex_jax import ray as tray

  tmp = tempfile.mkdtemp(prefix="tenplex-bench-ray-")  # local disk
  run_config = RunConfig(storage_path=os.path.join(tmp, "ray_results"),
                         name="bench")
  ckpt = os.path.join(run_config.storage_path, run_config.name)
  os.makedirs(ckpt)
  out_dir = os.path.join(tmp, "times")
  os.makedirs(out_dir)
  k = 3  # steps per generation before the driver asks for the resize
  node = {"num_cpus": 1, "object_store_memory": 256 * 2**20}
  # Loopback only: the head on 127.0.0.2 (Ray turns 127.0.0.1 into the
  # machine's outward address), the other node on 127.0.0.3.
  cluster = Cluster(initialize_head=True, head_node_args={
      **node, "include_dashboard": False, "node_ip_address": "127.0.0.2"})
  procs = _procs(cluster)
  job = f"bench-ray-{os.getpid()}"
  try:
    cluster.add_node(**node, node_ip_address="127.0.0.3")
    procs += _procs(cluster)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.2",
             log_to_driver=False)
    asked: dict = {}
    with Progress() as bar:
      task = bar.add_task("resizes", total=args.resizes)

      def driver(j, step):
        """Resizes group g (1 <-> 2 workers) once it has run k steps and,
        when the resize is tenplex's, the next group's standby workers
        have their imports done. Ray Train's restart starts a fresh worker
        group (new actors, imports, no compilation cache): the tenplex
        job's standbys and cache are off for it."""
        gen = len(j.generations)
        bar.update(task, completed=gen)
        if gen >= args.resizes or gen in asked:
          return
        if step < j.current.get("start_step", 0) + k:
          return
        m = 2 if j.current["workers"] == 1 else 1
        tenplex = MODES[gen % len(MODES)] == "tenplex"
        j.standby = 2 if tenplex and args.standby else False
        j.compilation_cache = tenplex and args.cache
        if tenplex and args.standby and sum(
            s["ready"] is not None for s in j.standbys()) < m:
          return
        if tenplex and args.prepare and not sum(
            bool(s.get("waiting")) for s in j.standbys()) == m:
          j.prepare_next(m)  # the next group waits at its turn first
          return
        asked[gen] = j.request_resize(m)

      result = tray.run(
          SCRIPT, [], num_workers=1, job=job, max_restarts=0,
          on_progress=driver, standby=2 if args.standby else False,
          prepare=args.prepare, free_arrays=args.free_arrays,
          allocate_ahead=args.allocate_ahead,
          compilation_cache=args.cache, standby_imports=(
              *tray.STANDBY_IMPORTS, "ray.train", "jax.sharding",
              "tenplex_jax.store.checkpoint"),
          env={"BENCH_MODES": ",".join(MODES), "BENCH_OUT": out_dir,
               "BENCH_CKPT": ckpt, "BENCH_RESIZES": str(args.resizes),
               "BENCH_K": str(k),
               "BENCH_LAYERS": str(args.layers), "BENCH_DIM": str(args.dim),
               "PYTHONPATH": ROOT})
      bar.update(task, completed=args.resizes)
    with open(os.path.join(out_dir, "times.jsonl")) as f:
      rows = [json.loads(x) for x in f]
    gens = [{k: g.get(k) for k in ("generation", "workers", "started_s",
                                   "teardown_s", "outcome", "standby",
                                   "standby_ready_s", "pids")}
            for g in result["generations"]]
    return {"transitions": transitions(rows), "generations": gens}
  finally:
    ray.shutdown()
    procs += _procs(cluster)
    cluster.shutdown()
    for proc in procs:
      try:
        proc.kill()  # nothing once reaped
      except (ProcessLookupError, PermissionError):
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(f"/dev/shm/tenplex-ray-{job}", ignore_errors=True)


def plot(summary: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.2))
  modes = list(summary)
  left = [0.0] * len(modes)
  for ph in PHASES:
    vals = [summary[m][ph] for m in modes]
    ax.barh(modes, vals, left=left, label=ph)
    left = [a + b for a, b in zip(left, vals)]
  ax.set_xlabel("seconds from the resize signal to the first step"
                " (median of each phase)")
  ax.legend(ncol=5, fontsize=7, loc="upper center",
            bbox_to_anchor=(0.5, -0.35))
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--resizes", type=int, default=8)
  ap.add_argument("--layers", type=int, default=6)
  ap.add_argument("--dim", type=int, default=4096)
  ap.add_argument("--out", default=None)
  ap.add_argument("--no-standby", dest="standby", action="store_false",
                  help="tenplex resizes start fresh worker actors too")
  ap.add_argument("--no-cache", dest="cache", action="store_false",
                  help="no jax persistent compilation cache")
  ap.add_argument("--no-free", dest="free_arrays", action="store_false",
                  help="workers keep their arrays after their resize save"
                  " until they are killed (both ways)")
  ap.add_argument("--no-prepare", dest="prepare", action="store_false",
                  help="tenplex's next group gets its ranks after the save"
                  " (not started ahead, waiting at its turn)")
  ap.add_argument("--no-allocate-ahead", dest="allocate_ahead",
                  action="store_false",
                  help="tenplex's group started ahead does not allocate its"
                  " restore's arrays before its turn (the restore does, at"
                  " the turn)")
  args = ap.parse_args()
  state_gib = 3 * args.layers * args.dim**2 * 4 / 2**30
  with open("/proc/meminfo") as f:
    mem = {ln.split(":")[0]: int(ln.split()[1]) // 1024 for ln in f
           if ln.startswith(("MemTotal", "MemAvailable"))}
  load0 = os.getloadavg()
  print(f"state {state_gib:.2f} GiB; load {load0[0]:.1f}; memory available"
        f" {mem['MemAvailable']} of {mem['MemTotal']} MiB")
  t0 = time.time()
  res = run(args)
  rows = res["transitions"]
  summary = {}
  for mode in ("tenplex", "ray"):
    rs = [r for r in rows if r["mode"] == mode]
    summary[mode] = {k: statistics.median(r[k] for r in rs)
                     for k in (*PHASES, "start", "total")}
    summary[mode]["save_restore"] = statistics.median(
        r["save"] + r["restore"] for r in rs)
    summary[mode]["n"] = len(rs)
  t, r = summary["tenplex"], summary["ray"]
  ratios = {k: r[k] / t[k] if t[k] > 0 else float("inf")
            for k in ("save_restore", "start", "total")}
  names = [p[:8] for p in (*PHASES, "total")]
  print(f"{'mode':8s} {'from':>4s} {'to':>3s} " +
        " ".join(f"{p:>8s}" for p in names) + " standby prepared cache")
  for x in rows:
    print(f"{x['mode']:8s} {x['from']:4d} {x['to']:3d} " +
          " ".join(f"{x[p]:8.2f}" for p in (*PHASES, "total")) +
          f" {x['standby']!s:7s} {x['prepared']!s:8s} {x['cache']!s:5s}")
  for mode, s in summary.items():
    print(f"median {mode:8s}: (a) start {s['start']:.2f} s, (b) save +"
          f" restore {s['save_restore']:.2f} s, (c) compile"
          f" {s['compile']:.2f} s, total {s['total']:.2f} s (n={s['n']})")
  print(f"ray / tenplex: save + restore {ratios['save_restore']:.2f}x,"
        f" start {ratios['start']:.2f}x,"
        f" total {ratios['total']:.2f}x; load {os.getloadavg()[0]:.1f};"
        f" wall {time.time() - t0:.0f} s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"state_gib": state_gib, "resizes": args.resizes,
                 "modes": list(MODES), "transitions": rows,
                 "generations": res["generations"], "summary": summary,
                 "ratios": ratios, "load_before": load0[:3],
                 "load_after": os.getloadavg()[:3], "memory_mib": mem,
                 "command": " ".join([os.path.basename(sys.executable),
                                      *sys.argv])}, f, indent=1)
    plot(summary, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
  main()
