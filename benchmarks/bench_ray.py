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
  (a detached store actor's ``/dev/shm`` directory); the new group is the
  job's standby workers (started ahead with the imports done), handed
  their ranks, which restore from the stores (own node first, then the
  peers' servers) and load the step from jax's persistent compilation
  cache when the job ran that mesh before;
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
``setup`` (mesh, target), ``restore``, ``compile`` (the step's AOT
compilation) and ``step`` (the first step); ``start`` = relaunch through
setup. (a) = start, (b) = save + restore, (c) = compile. Prints per mode
the medians and the ratios and writes the rows, medians, the load and the
machine's memory to ``--out`` (and a bar chart beside it).

Usage: python benchmarks/bench_ray.py [--resizes 8] [--layers 6] [--dim 4096]
          [--no-standby] [--no-cache] [--out benchmarks/bench_ray_result.json]
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
PHASES = ("save", "relaunch", "imports", "distributed", "setup", "restore",
          "compile", "step")
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
  """Per resize (generation g -> g + 1) the phases at the slowest worker."""
  out = []
  for g in sorted({r["gen"] for r in rows if r["kind"] == "save"}):
    save = [r for r in rows if r["kind"] == "save" and r["gen"] == g]
    new = [r for r in rows if r["kind"] == "start" and r["gen"] == g + 1]
    if not new:
      continue
    signal_t = min(r["t_signal"] for r in save)
    saved = max(r["t_saved"] for r in save)
    t_start = max(r["t_start"] for r in new)
    t_imp = max(r["t_imported"] for r in new)
    t_init = max(r["t_init"] for r in new)
    r0 = max(r["t_restore0"] for r in new)
    r1 = max(r["t_restored"] for r in new)
    c1 = max(r["t_compiled"] for r in new)
    f1 = max(r["t_first"] for r in new)
    assert {r["mode"] for r in save} == {r["mode"] for r in new}
    rep = [r["restored"] for r in new if r["restored"]]
    out.append({
        "mode": save[0]["mode"], "from": save[0]["procs"],
        "to": new[0]["procs"], "at_step": save[0]["step"],
        "save": saved - signal_t, "start": r0 - saved,
        "relaunch": t_start - saved, "imports": t_imp - t_start,
        "distributed": t_init - t_imp, "setup": r0 - t_init,
        "standby": all(r["standby"] for r in new),
        "cache": all(r["cache"] for r in new), "restore": r1 - r0,
        "compile": c1 - r1, "step": f1 - c1, "total": f1 - signal_t,
        "steady_step_s": max(r["step_s"] for r in save),
        "local_bytes": sum(x["local_bytes"] for x in rep) if rep else None,
        "network_bytes": sum(x["network_bytes"] for x in rep) if rep
        else None})
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
        if tenplex and args.standby and sum(
            s["ready"] is not None for s in j.standbys()) < m:
          return
        j.standby = 2 if tenplex and args.standby else False
        j.compilation_cache = tenplex and args.cache
        asked[gen] = j.request_resize(m)

      result = tray.run(
          SCRIPT, [], num_workers=1, job=job, max_restarts=0,
          on_progress=driver, standby=2 if args.standby else False,
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
  ratios = {"save_restore": r["save_restore"] / t["save_restore"],
            "start": r["start"] / t["start"],
            "total": r["total"] / t["total"]}
  names = [p[:8] for p in (*PHASES, "total")]
  print(f"{'mode':8s} {'from':>4s} {'to':>3s} " +
        " ".join(f"{p:>8s}" for p in names) + " standby cache")
  for x in rows:
    print(f"{x['mode']:8s} {x['from']:4d} {x['to']:3d} " +
          " ".join(f"{x[p]:8.2f}" for p in (*PHASES, "total")) +
          f" {x['standby']!s:7s} {x['cache']!s:5s}")
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
