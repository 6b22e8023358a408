"""Reconfiguration of the LM trainer: in-process, across processes, and Orbax stop/restart.

For each resize of a schedule (default: 8 -> 4 -> 2 -> 8 devices, the stage
count 2 -> 2 -> 1 -> 4) it measures, as Tenplex's Fig. 9 does, the time the
job spends changing its layout, next to the step time:

* **in-process**: ``tenplex_jax.remesh`` of the train state
  (``examples/lm/train.py``; ``reconfig_s``);
* **across processes**: ``train.py --procs``: the old processes save to
  their stores and exit, ``tenplex-jax launch`` starts the new ones (another
  process count, another number of devices per process), which restore onto
  their mesh; from the save call to the restored state (imports and
  ``jax.distributed`` start included, compilation not). Twice: **cold**
  (``--no-standby --no-compilation-cache``: fresh interpreters, every mesh
  compiled) and **warm** (the launcher's defaults: standby processes with
  jax, flax and optax imported take the new ranks, and jax's persistent
  compilation cache in the job directory answers a mesh the job ran
  before); each resize's components (relaunch, imports, ``jax.distributed``,
  restore, compile, the first step) and ``resize_s``, from the save call to
  the new step's end;
* **Orbax stop/restart** (the baseline users have): one process on the old
  layout saves the train state with ``orbax.checkpoint.StandardCheckpointer``
  and exits; a new process starts, imports, and restores it onto the new
  mesh's shardings; from the save call to the restored state.

The step time is the median step of the new phase in the in-process run. The
methods run one after the other in the same invocation (load hits all
alike within the noise; ``uptime`` is recorded before and after), between
two timings of ``python -c "import jax, flax, optax"`` (the targets: the
worst warm resize no longer than that, and under 0.5 s onto a mesh run
before: the schedule's last phase is its first one's).

  python benchmarks/bench_lm_resize.py [--steps 15] [--out results/bench_lm_resize.json] \
      [--plot docs/lm_resize.png]
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEDULE = ("0:data=2,tensor=2,stage=2 3:fsdp=2,stage=2 6:tensor=2 9:fsdp=2,stage=4"
            " 12:data=2,tensor=2,stage=2")
PROCS = "2,2,1,2,2"
# A resize's parts on its critical path, in order: the compile runs in a thread during the
# restore, so only what is left of it after the restore counts (compile_wait_s).
PARTS = ("relaunch_s", "import_s", "distributed_s", "restore_s", "compile_wait_s", "step_s",
         "other_s")


def _lm():
  sys.path.insert(0, str(ROOT))
  from tenplex_jax.demo import load_lm_trainer
  return load_lm_trainer()


def _abstract(lm, cfg, layout_text):
  """(mesh, init, abstract state with shardings, rules) of ``data=2,...`` on this process."""
  import jax
  phase = lm.configs.parse(f"0:{layout_text}")[0]
  mesh, rules, _ = lm.layout(phase, cfg, jax.devices(), search=False,
                             global_batch=lm.configs.GLOBAL_BATCH)
  init = lm.init_fn(cfg, mesh, rules, lm.configs.LEARNING_RATE)
  return init, jax.eval_shape(init, jax.random.key(lm.configs.SEED))


def _plain(state):
  """The train state as Orbax saves it: unboxed params and optimizer state, the step."""
  import flax.linen as nn
  s = nn.unbox(state)
  return {"params": s.params, "opt_state": s.opt_state, "step": s.step}


def orbax_side(args):
  """One process of the Orbax baseline: ``save`` (old layout) or ``restore`` (new)."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import orbax.checkpoint as ocp
  lm = _lm()
  cfg = lm.configs.CONFIGS[args.config]
  init, abstract = _abstract(lm, cfg, args.layout)
  if args.orbax == "save":
    state = init(jax.random.key(lm.configs.SEED))
    jax.block_until_ready(state)
    t0 = time.time()
    ck = ocp.StandardCheckpointer()
    ck.save(args.dir, _plain(state))
    ck.wait_until_finished()
    ck.close()
    out = {"save_start": t0, "save_s": time.time() - t0,
           "bytes": sum(x.nbytes for x in jax.tree.leaves(state))}
  else:
    t_import = time.time()
    t0 = time.time()
    ck = ocp.StandardCheckpointer()
    restored = ck.restore(args.dir, _plain(abstract))
    jax.block_until_ready(restored)
    ck.close()
    t1 = time.time()
    want = jax.tree.leaves(_plain(abstract))
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored), want))
    out = {"process_start": _PROCESS_START, "import_s": t_import - _PROCESS_START,
           "restore_s": t1 - t0, "restored": t1}
  print("RESULT " + json.dumps(out), flush=True)


def _run_side(kind, layout, devices, cfg_name, d):
  cmd = [sys.executable, __file__, "--orbax", kind, "--layout", layout, "--devices",
         str(devices), "--dir", d, "--config", cfg_name]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  if p.returncode:
    raise SystemExit(f"orbax {kind} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
  line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):]), time.time()


def import_time(repeat=3):
  """Median seconds of ``python -c "import jax, flax, optax"``."""
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import jax, flax, optax"], check=True)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _components(r):
  """A resize's parts across processes, from the trainer's first new step."""
  out = {k: r[k] for k in PARTS[:-1]}
  out["other_s"] = max(0.0, r["resize_s"] - sum(out.values()))  # batches, bookkeeping
  out.update(resize_s=r["resize_s"], reconfig_s=r["reconfig_s"], standby=r["standby"],
             compile_s=r["compile_s"],
             xla_compiles=r["xla_compiles"], compile_cache_hit=r["compile_cache_hit"])
  return out


def plot(rows, import_s, path):
  """Stacked bars: each resize's components across processes, cold and warm."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 4.8))
  width = 0.38
  names = {"relaunch_s": "save + relaunch", "import_s": "imports",
           "distributed_s": "jax.distributed", "restore_s": "restore",
           "compile_wait_s": "compile (after the restore)", "step_s": "first step",
           "other_s": "other"}
  for j, kind in enumerate(("cold", "warm")):
    bottom = [0.0] * len(rows)
    for c, k in enumerate(PARTS):
      vals = [r[kind][k] for r in rows]
      ax.bar([i + (j - 0.5) * width for i in range(len(rows))], vals, width, bottom=bottom,
             color=f"C{c}", label=names[k] if j == 0 else None,
             hatch="//" if kind == "cold" else None, edgecolor="white")
      bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
      ax.text(i + (j - 0.5) * width, bottom[i], f"{kind}\n{r[kind]['resize_s']:.1f} s",
              ha="center", va="bottom", fontsize=7)
  ax.axhline(import_s, color="k", ls="--", lw=1)
  ax.text(len(rows) - 0.5, import_s, ' python -c "import jax, flax, optax"', va="bottom",
          ha="right", fontsize=7)
  ax.set_xticks(range(len(rows)), [
      f"step {r['step']}: {r['devices'][0]}->{r['devices'][1]} dev\n"
      f"{r['procs'][0]}->{r['procs'][1]} procs" + ("\n(mesh run before)" if r["seen"] else "")
      for r in rows], fontsize=8)
  ax.set_ylabel("seconds (save call -> new step done)")
  ax.set_title("LM trainer, resizes across processes: cold (hatched) and with standby"
               " processes + compilation cache", fontsize=9)
  ax.legend(fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _layout_text(degrees):
  return ",".join(f"{k}={v}" for k, v in degrees.items() if v > 1) or "data=1"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--schedule", default=SCHEDULE)
  ap.add_argument("--procs", default=PROCS, help="processes per phase (across processes)")
  ap.add_argument("--steps", type=int, default=15)
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--fast-compile", action="store_true")
  ap.add_argument("--out", default="results/bench_lm_resize.json")
  ap.add_argument("--plot", default="results/bench_lm_resize.png",
                  help="the per-resize components, cold and warm (PNG)")
  ap.add_argument("--orbax", choices=("save", "restore"), help=argparse.SUPPRESS)
  ap.add_argument("--layout", help=argparse.SUPPRESS)
  ap.add_argument("--devices", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--dir", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.orbax:
    return orbax_side(args)

  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  from rich.progress import Progress
  lm = _lm()
  cfg = lm.configs.CONFIGS[args.config]
  phases = lm.configs.parse(args.schedule)
  plan = lm.procs_plan(phases, args.procs)
  opts = {"xla_backend_optimization_level": 0} if args.fast_compile else None
  res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python"
                    f" {platform.python_version()}, jax {jax.__version__}",
         "config": args.config, "schedule": args.schedule, "procs": plan, "steps": args.steps,
         "fast_compile": args.fast_compile, "load_before": os.getloadavg(),
         "import_jax_flax_optax_s_before": import_time()}
  with Progress() as progress:
    task = progress.add_task("in-process, across processes, orbax", total=3 + len(phases) - 1)
    inproc = lm.train(phases, args.steps, cfg, log=lambda *_: None, compiler_options=opts)
    progress.advance(task)
    ns = argparse.Namespace(schedule=args.schedule, steps=args.steps, config=args.config,
                            search=False, remat=False, fast_compile=args.fast_compile,
                            deterministic=None, timeout=1800, no_standby=True,
                            no_compilation_cache=True)
    cold, _ = lm.run_procs(ns, cfg, phases, plan, log=lambda *_: None)
    progress.advance(task)
    ns.no_standby = ns.no_compilation_cache = False
    procs, _ = lm.run_procs(ns, cfg, phases, plan, log=lambda *_: None)
    progress.advance(task)
    rows = []
    for i, p in enumerate(phases[1:], 1):
      old, new = phases[i - 1], p
      before = next(r for r in inproc if r["step"] == p.step - 1)
      after = next(r for r in inproc if r["step"] == p.step)
      cross = next(r for r in procs if r["step"] == p.step)
      cross_cold = next(r for r in cold if r["step"] == p.step)
      d = tempfile.mkdtemp(prefix="bench-lm-orbax-",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
      try:
        saved, exited = _run_side("save", _layout_text(before["mesh"]), old.devices,
                                  args.config, os.path.join(d, "ckpt"))
        restored, _ = _run_side("restore", _layout_text(after["mesh"]), new.devices,
                                args.config, os.path.join(d, "ckpt"))
      finally:
        shutil.rmtree(d, ignore_errors=True)
      end = min(x.step for x in phases[i + 1:]) if i + 1 < len(phases) else args.steps
      steps = [r["step_s"] for r in inproc if p.step <= r["step"] < end and not r["compile_s"]]
      orbax_total = saved["save_s"] + (restored["restored"] - exited)
      rows.append({
          "step": p.step, "from": before["mesh"], "to": after["mesh"],
          "devices": [old.devices, new.devices], "procs": [cross["procs_from"], cross["procs"]],
          "step_s": statistics.median(steps) if steps else after["step_s"],
          "in_process_s": after["reconfig_s"], "in_process_bytes": after["reconfig_bytes"],
          "across_s": cross["reconfig_s"], "across_parts_s": {
              k: cross[k] for k in ("relaunch_s", "import_s", "init_s", "restore_s")},
          "across_bytes": cross["reconfig_bytes"],
          "cold": _components(cross_cold), "warm": _components(cross),
          # a mesh (and process split) the job ran before this resize
          "seen": any((q.devices, q.degrees, q.microbatches, plan[j])
                      == (p.devices, p.degrees, p.microbatches, plan[i])
                      for j, q in enumerate(phases[:i])),
          "orbax_s": orbax_total, "orbax_parts_s": {
              "save_s": saved["save_s"], "relaunch_s": restored["process_start"] - exited,
              "import_s": restored["import_s"], "restore_s": restored["restore_s"]},
          "state_bytes": saved["bytes"],
          "compile_s": after["compile_s"]})
      progress.advance(task)
  res["resizes"] = rows
  res["import_jax_flax_optax_s_after"] = import_time()
  res["load_after"] = os.getloadavg()
  imp = min(res["import_jax_flax_optax_s_before"], res["import_jax_flax_optax_s_after"])
  res["max_abs_loss_diff_in_vs_across"] = max(
      abs(a["loss"] - b["loss"]) for a, b in zip(inproc, procs))
  print(f"machine: {res['machine']}; load {res['load_before'][0]:.1f} ->"
        f" {res['load_after'][0]:.1f}; config {args.config}, state"
        f" {rows[0]['state_bytes'] / 2**10:.0f} KiB")
  print("\n| step | devices (procs) | degrees d,f,t,s | step ms | in-process ms | across"
        " processes ms (restore) | Orbax stop/restart ms (save + restore) | compile s |")
  print("|---:|---|---|---:|---:|---:|---:|---:|")
  for r in rows:
    deg = "->".join(",".join(str(m[a]) for a in ("data", "fsdp", "tensor", "stage"))
                    for m in (r["from"], r["to"]))
    print(f"| {r['step']} | {r['devices'][0]} ({r['procs'][0]}) -> {r['devices'][1]}"
          f" ({r['procs'][1]}) | {deg} | {r['step_s'] * 1e3:.0f} |"
          f" {r['in_process_s'] * 1e3:.0f} | {r['across_s'] * 1e3:.0f}"
          f" ({r['across_parts_s']['restore_s'] * 1e3:.0f}) | {r['orbax_s'] * 1e3:.0f}"
          f" ({(r['orbax_parts_s']['save_s'] + r['orbax_parts_s']['restore_s']) * 1e3:.0f}) |"
          f" {r['compile_s']:.1f} |")
  print(f"\nresizes across processes, cold (--no-standby --no-compilation-cache) and warm;"
        f' python -c "import jax, flax, optax": {res["import_jax_flax_optax_s_before"]:.2f} s'
        f' before, {res["import_jax_flax_optax_s_after"]:.2f} s after')
  print("\n| step | devices (procs) | run | relaunch | imports | jax.distributed | restore |"
        " compile: all (after the restore; XLA compiles) | first step | resize (save -> step"
        " done) |")
  print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    for kind in ("cold", "warm"):
      c = r[kind]
      print(f"| {r['step']} | {r['devices'][0]} ({r['procs'][0]}) -> {r['devices'][1]}"
            f" ({r['procs'][1]}){' (run before)' if r['seen'] else ''} | {kind} |"
            + "".join(f" {c[k]:.2f} |" for k in PARTS[:4])
            + f" {c['compile_s']:.2f} ({c['compile_wait_s']:.2f}; {c['xla_compiles']}) |"
            f" {c['step_s']:.2f} |"
            f" {c['resize_s']:.2f} |")
  worst = {k: max(r[k]["resize_s"] for r in rows) for k in ("cold", "warm")}
  seen = [r["warm"]["resize_s"] for r in rows if r["seen"]]
  res["targets"] = {"import_s": imp, "worst_cold_s": worst["cold"],
                    "worst_warm_s": worst["warm"],
                    "worst_warm_over_import": worst["warm"] / imp,
                    "run_before_warm_s": max(seen) if seen else None}
  print(f"\nworst resize: cold {worst['cold']:.2f} s ({worst['cold'] / imp:.1f}x the import),"
        f" warm {worst['warm']:.2f} s ({worst['warm'] / imp:.1f}x; target <= 1x)"
        + (f"; onto a mesh run before: {max(seen):.2f} s (target < 0.5 s)" if seen else ""))
  if args.plot:
    pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(rows, imp, args.plot)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1, default=float))
  del np
  return res


if __name__ == "__main__":
  main()
