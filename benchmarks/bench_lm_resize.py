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
  ``jax.distributed`` start included, compilation not). Three times:
  **cold** (``--no-standby --no-compilation-cache --no-prepare``: fresh
  interpreters, every mesh compiled), **warm** (``--no-prepare``: standby
  processes with jax, flax and optax imported take the new ranks, and jax's
  persistent compilation cache in the job directory answers a mesh the job
  ran before) and **ahead** (the defaults: the trainer announces the
  schedule's next phases with ``store.expect_resizes`` and the launcher
  starts their generations at once, which import, start
  ``jax.distributed``, compile their step and run it once on zeros before
  their turn; at the save the launcher hands the prepared generation the
  turn and it only restores; they prepare at nice +10, and a phase whose mesh
  another generation is compiling starts at once and waits for its programs
  before compiling), and **ahead_nice0** (the same at the running
  generation's priority, ``--prepare-nice 0``); each resize's components
  (relaunch, imports, ``jax.distributed``, restore with its read, compile,
  the first batch, the first step) and ``resize_s``, from the save call to
  the new step's end; and what the background work costs the running steps:
  each phase's median step, warm against ahead, and within each ahead run
  the steps taken while some generation was being prepared (between its
  start and its ready time) against those while none was;
* **a failure** (``--failure-at STEP``): the job once more with the defaults and a
  snapshot every 4 steps (``train.py --snapshot-every 4``); the highest-rank process is
  SIGKILLed before STEP once the generation prepared for that failure (one process
  fewer, the search's layout) is ready; the recovery from the death to the new step
  done, with its parts, the steps lost and the snapshots' time;
* **Orbax stop/restart** (the baseline users have): one process on the old
  layout saves the train state with ``orbax.checkpoint.StandardCheckpointer``
  and exits; a new process starts, imports, and restores it onto the new
  mesh's shardings; from the save call to the restored state.

The step time is the median step of the new phase in the in-process run. The
methods run one after the other in the same invocation (load hits all
alike within the noise; ``uptime`` is recorded before and after), between
two timings of ``python -c "import jax, flax, optax"`` (the targets: the
worst resize no longer than that, and under 0.5 s onto a mesh run before:
the schedule's last phase is its first one's).

  python benchmarks/bench_lm_resize.py [--steps 40] [--kinds cold,warm,ahead,ahead_nice0] \
      [--no-orbax] [--failure-at STEP] \
      [--out results/bench_lm_resize.json] [--plot docs/lm_resize.png]
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
# The LM trainer's default schedule (8 steps a phase), and a fifth phase back onto the first
# mesh (a mesh the job ran before).
SCHEDULE = ("0:data=2,tensor=2,stage=2 8:fsdp=2,stage=2 16:tensor=2 24:fsdp=2,stage=4"
            " 32:data=2,tensor=2,stage=2")
KINDS = ("cold", "warm", "ahead", "ahead_nice0")
PROCS = "2,2,1,2,2"
# A resize's parts on its critical path, in order: the compile runs in a thread during the
# restore, so only what is left of it after the restore counts (compile_wait_s).
PARTS = ("relaunch_s", "import_s", "distributed_s", "restore_s", "compile_wait_s", "batch_s",
         "step_s", "other_s")


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
             compile_s=r["compile_s"], ahead=r["ahead"],
             xla_compiles=r["xla_compiles"], compile_cache_hit=r["compile_cache_hit"])
  out["restore_parts_s"] = r.get("restore_parts_s")
  # the first step: its call's return, and the CPU seconds process 0 spent in it; when the
  # old processes had exited (from the save call: after the first step's end, they ran
  # beside it)
  out.update(dispatch_s=r.get("dispatch_s"), step_cpu_s=r.get("step_cpu_s"),
             old_exit_s=r.get("old_exit_s"), restored_procs_s=r.get("restored_procs_s"))
  if r["ahead"]:  # started ahead: what came before the save, and the hand-over
    out.update(handoff_s=r["handoff_s"], ahead_wait_s=r["ahead_wait_s"],
               save_s=r.get("save_s"),
               ahead_margin_s=r["ahead_margin_s"], ahead_lead_s=r.get("ahead_lead_s"),
               nice=r["ahead_s"].get("nice", 0),
               ahead_parts_s={k: r["ahead_s"][k] for k in (
                   "import_s", "distributed_s", "compile_s", "warmup_s")})
  return out


def background_cost(records, phases, steps):
  """What the generations prepared in the background cost the running steps, in one run:
  per phase, the median step (after the phase's first) while some generation was being
  prepared (between its start and its ready time: imports, ``jax.distributed``, compile,
  warm-up) and while none was (the prepared ones only waiting), with the step counts."""
  windows = [(r["ahead_s"]["started_time"], r["ahead_s"]["ready_time"])
             for r in records if r.get("ahead") and r["ahead_s"].get("started_time")]
  out = []
  for i, p in enumerate(phases):
    end = phases[i + 1].step if i + 1 < len(phases) else steps
    busy, quiet = [], []
    for r in records:
      if p.step < r["step"] < end:
        t1 = r["time"]
        t0 = t1 - r["step_s"]
        (busy if any(a < t1 and t0 < b for a, b in windows) else quiet).append(r["step_s"])
    out.append({"step": p.step, "busy_n": len(busy), "quiet_n": len(quiet),
                "busy_s": statistics.median(busy) if busy else None,
                "quiet_s": statistics.median(quiet) if quiet else None})
  return out


def _phase_steps(records, phases, steps):
  """Median step time of each phase's steps after its first (seconds)."""
  out = []
  for i, p in enumerate(phases):
    end = phases[i + 1].step if i + 1 < len(phases) else steps
    ts = [r["step_s"] for r in records if p.step < r["step"] < end]
    out.append(statistics.median(ts) if ts else None)
  return out


def plot(rows, import_s, path):
  """Stacked bars: each resize's components across processes, cold, warm and ahead."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(10, 5))
  width = 0.27
  names = {"relaunch_s": "save + relaunch", "import_s": "imports",
           "distributed_s": "jax.distributed", "restore_s": "restore",
           "compile_wait_s": "compile (after the restore)", "batch_s": "first batch",
           "step_s": "first step", "other_s": "other"}
  kinds = [k for k in KINDS if k in rows[0]]
  for j, kind in enumerate(kinds):
    bottom = [0.0] * len(rows)
    for c, k in enumerate(PARTS):
      vals = [r[kind][k] for r in rows]
      ax.bar([i + (j - (len(kinds) - 1) / 2) * width for i in range(len(rows))], vals,
             width, bottom=bottom, color=f"C{c}", label=names[k] if j == 0 else None,
             hatch={"cold": "//", "ahead": "..", "ahead_nice0": "xx"}.get(kind),
             edgecolor="white")
      bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
      ax.text(i + (j - (len(kinds) - 1) / 2) * width, bottom[i],
              f"{kind}\n{r[kind]['resize_s']:.1f} s", ha="center", va="bottom", fontsize=6)
  ax.set_yscale("symlog", linthresh=1.0)
  ax.axhline(import_s, color="k", ls="--", lw=1)
  ax.text(len(rows) - 0.5, import_s, ' python -c "import jax, flax, optax"', va="bottom",
          ha="right", fontsize=7)
  ax.set_xticks(range(len(rows)), [
      f"step {r['step']}: {r['devices'][0]}->{r['devices'][1]} dev\n"
      f"{r['procs'][0]}->{r['procs'][1]} procs" + ("\n(mesh run before)" if r["seen"] else "")
      for r in rows], fontsize=8)
  ax.set_ylabel("seconds (save call -> new step done)")
  ax.set_title("LM trainer, resizes across processes: cold (hatched), warm (standby processes"
               " + compilation cache),\nahead (+ next generations started and compiled"
               " ahead at nice +10, dotted), ahead_nice0 (the same at the running one's"
               " priority, crossed)", fontsize=8)
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
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--kinds", default=",".join(KINDS),
                  help="runs across processes: cold (--no-standby --no-compilation-cache"
                  " --no-prepare), warm (--no-prepare), ahead (the defaults), ahead_nice0"
                  " (--prepare-nice 0)")
  ap.add_argument("--failure-at", type=int, metavar="STEP",
                  help="also run the job once more as ahead with a snapshot every 4 steps"
                  " (train.py --snapshot-every 4) where the highest-rank process is SIGKILLed"
                  " before STEP once the generation prepared for the failure is ready, and"
                  " report the recovery (death -> new step done) and its parts")
  ap.add_argument("--no-orbax", action="store_true",
                  help="skip the Orbax stop/restart comparison")
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
  kinds = [k for k in args.kinds.split(",") if k]
  if not kinds or any(k not in KINDS for k in kinds):
    ap.error(f"--kinds {args.kinds!r}: a comma-separated subset of {KINDS}")
  if "warm" not in kinds:
    ap.error("--kinds: warm is the reference of the other runs; keep it")
  with Progress() as progress:
    task = progress.add_task("in-process, across processes, orbax",
                             total=1 + len(kinds) + len(phases) - 1)
    inproc = lm.train(phases, args.steps, cfg, log=lambda *_: None, compiler_options=opts)
    progress.advance(task)
    runs = {}
    for kind in kinds:
      ns = argparse.Namespace(schedule=args.schedule, steps=args.steps, config=args.config,
                              search=False, remat=False, fast_compile=args.fast_compile,
                              deterministic=None, timeout=1800,
                              no_standby=kind == "cold", no_compilation_cache=kind == "cold",
                              no_prepare=not kind.startswith("ahead"),
                              prepare_nice=0 if kind == "ahead_nice0" else 10)
      runs[kind], _ = lm.run_procs(ns, cfg, phases, plan, log=lambda *_: None)
      progress.advance(task)
    if args.failure_at is not None:  # a failure, recovered by the generation prepared for it
      ns = argparse.Namespace(schedule=args.schedule, steps=args.steps, config=args.config,
                              search=False, remat=False, fast_compile=args.fast_compile,
                              deterministic=None, timeout=1800, snapshot_every=4,
                              kill_at=args.failure_at)
      failed, _ = lm.run_procs(ns, cfg, phases, plan, log=lambda *_: None)
      rec = next(r for r in failed if r.get("recovered"))
      res["failure"] = {
          **{k: rec.get(k) for k in (
              "step", "failed_step", "restored_step", "steps_lost", "steps_redone", "procs",
              "procs_from", "devices", "mesh", "recovery_s", "reconfig_s", "handoff_s",
              "relaunch_s", "restore_s", "batch_s", "step_s", "compile_wait_s",
              "ahead_margin_s", "restored_procs_s")},
          "detected_s": rec["failure"]["detected_s"], "stopped_s": rec["failure"]["stopped_s"],
          "prepare_s": {k: rec["ahead_s"].get(k) for k in ("compile_s", "warmup_s")},
          "steps": [r["step"] for r in failed],
          "max_abs_loss_diff_vs_in_process": max(
              abs(a["loss"] - b["loss"]) for a, b in zip(inproc, failed)),
          "snapshot_s": [r["snapshot_s"] for r in failed if "snapshot_s" in r]}
    procs = runs["warm"]
    # What starting and compiling the next generations in the background costs the running
    # steps: each phase's median step (after its first), warm against ahead.
    aheads = [k for k in kinds if k.startswith("ahead")]
    if aheads:
      res["phase_step_s"] = {k: _phase_steps(runs[k], phases, args.steps)
                             for k in ("warm", *aheads)}
      res["background_cost"] = {k: background_cost(runs[k], phases, args.steps)
                                for k in aheads}
    rows = []
    for i, p in enumerate(phases[1:], 1):
      old, new = phases[i - 1], p
      before = next(r for r in inproc if r["step"] == p.step - 1)
      after = next(r for r in inproc if r["step"] == p.step)
      cross = next(r for r in procs if r["step"] == p.step)
      row = {}
      if not args.no_orbax:
        d = tempfile.mkdtemp(prefix="bench-lm-orbax-",
                             dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
          saved, exited = _run_side("save", _layout_text(before["mesh"]), old.devices,
                                    args.config, os.path.join(d, "ckpt"))
          restored, _ = _run_side("restore", _layout_text(after["mesh"]), new.devices,
                                  args.config, os.path.join(d, "ckpt"))
        finally:
          shutil.rmtree(d, ignore_errors=True)
        orbax_total = saved["save_s"] + (restored["restored"] - exited)
        row.update(orbax_s=orbax_total, orbax_parts_s={
            "save_s": saved["save_s"], "relaunch_s": restored["process_start"] - exited,
            "import_s": restored["import_s"], "restore_s": restored["restore_s"]},
            state_bytes=saved["bytes"])
      end = min(x.step for x in phases[i + 1:]) if i + 1 < len(phases) else args.steps
      steps = [r["step_s"] for r in inproc if p.step <= r["step"] < end and not r["compile_s"]]
      rows.append({
          "step": p.step, "from": before["mesh"], "to": after["mesh"],
          "devices": [old.devices, new.devices], "procs": [cross["procs_from"], cross["procs"]],
          "step_s": statistics.median(steps) if steps else after["step_s"],
          "in_process_s": after["reconfig_s"], "in_process_bytes": after["reconfig_bytes"],
          "across_s": cross["reconfig_s"], "across_parts_s": {
              k: cross[k] for k in ("relaunch_s", "import_s", "init_s", "restore_s")},
          "across_bytes": cross["reconfig_bytes"],
          **{k: _components(next(r for r in runs[k] if r["step"] == p.step)) for k in kinds},
          # a mesh (and process split) the job ran before this resize
          "seen": any((q.devices, q.degrees, q.microbatches, plan[j])
                      == (p.devices, p.degrees, p.microbatches, plan[i])
                      for j, q in enumerate(phases[:i])),
          **row, "compile_s": after["compile_s"]})
      progress.advance(task)
  res["resizes"] = rows
  res["import_jax_flax_optax_s_after"] = import_time()
  res["load_after"] = os.getloadavg()
  imp = min(res["import_jax_flax_optax_s_before"], res["import_jax_flax_optax_s_after"])
  res["max_abs_loss_diff_in_vs_across"] = max(
      abs(a["loss"] - b["loss"]) for a, b in zip(inproc, procs))
  print(f"machine: {res['machine']}; load {res['load_before'][0]:.1f} ->"
        f" {res['load_after'][0]:.1f}; config {args.config}, state"
        f" {rows[0]['across_bytes'] / 2**10:.0f} KiB")
  if not args.no_orbax:
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
            f" ({(r['orbax_parts_s']['save_s'] + r['orbax_parts_s']['restore_s']) * 1e3:.0f})"
            f" | {r['compile_s']:.1f} |")
  print(f"\nresizes across processes ({', '.join(kinds)});"
        f' python -c "import jax, flax, optax": {res["import_jax_flax_optax_s_before"]:.2f} s'
        f' before, {res["import_jax_flax_optax_s_after"]:.2f} s after')
  print("\n| step | devices (procs) | run | relaunch (ahead: hand-over, of it the save; wait)"
        " | imports |"
        " jax.distributed | restore (read) | compile: all (after the restore; XLA compiles) |"
        " first batch | first step | resize (save -> step done) |")
  print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    for kind in kinds:
      c = r[kind]
      rel = f" {c['relaunch_s']:.2f}" + (
          f" ({c['handoff_s']:.2f}, save {c['save_s'] or 0:.2f}; {c['ahead_wait_s']:.2f})"
          if c["ahead"] else "") + " |"
      print(f"| {r['step']} | {r['devices'][0]} ({r['procs'][0]}) -> {r['devices'][1]}"
            f" ({r['procs'][1]}){' (run before)' if r['seen'] else ''} | {kind} |" + rel
            + "".join(f" {c[k]:.2f} |" for k in PARTS[1:3])
            + f" {c['restore_s']:.2f} ({(c['restore_parts_s'] or {}).get('read', 0):.2f}) |"
            + f" {c['compile_s']:.2f} ({c['compile_wait_s']:.2f}; {c['xla_compiles']}) |"
            f" {c['batch_s']:.2f} | {c['step_s']:.2f} |"
            f" {c['resize_s']:.2f} |")
  print("\nthe first step of each resize against its phase's median step (s): first"
        " (dispatch; CPU of process 0) | median; the old processes' exit after the save call")
  for i, r in enumerate(rows, 1):
    for kind in kinds:
      c = r[kind]
      med = _phase_steps(runs[kind], phases, args.steps)[i]
      c["phase_median_step_s"] = med
      if c.get("dispatch_s") is None:
        continue
      print(f"  step {r['step']} {kind}: {c['step_s']:.3f} ({c['dispatch_s']:.3f};"
            f" {c['step_cpu_s']:.3f}) | {med or 0:.3f}; old exit +"
            + (f"{c['old_exit_s']:.3f}" if c.get("old_exit_s") is not None else "-")
            + "; each process's restore done at +" + ", ".join(
                f"{x:.3f}" for x in c.get("restored_procs_s") or []))
  worst = {k: max(r[k]["resize_s"] for r in rows) for k in kinds}
  seen = {k: max([r[k]["resize_s"] for r in rows if r["seen"]], default=None) for k in kinds}
  res["targets"] = {"import_s": imp, **{f"worst_{k}_s": worst[k] for k in kinds},
                    **{f"worst_{k}_over_import": worst[k] / imp for k in kinds},
                    **{f"run_before_{k}_s": seen[k] for k in kinds}}
  for k in kinds:
    print(f"worst resize {k}: {worst[k]:.2f} s ({worst[k] / imp:.2f}x the import; target <= 1x)"
          + (f"; onto a mesh run before: {seen[k]:.2f} s (target < 0.5 s)"
             if seen[k] is not None else ""))
  if "phase_step_s" in res:
    print(f"\nmedian step per phase (s), warm | {' | '.join(aheads)} (the next generations"
          " started and compiled in the background):")
    for i, p in enumerate(phases):
      w = res["phase_step_s"]["warm"][i]
      if w:
        print(f"  phase at step {p.step}: {w:.3f} | " + " | ".join(
            f"{a:.3f} ({a / w:.2f}x)" if a else "-"
            for a in (res["phase_step_s"][k][i] for k in aheads)))
    print("\nthe same run's steps while a generation was being prepared (busy) and while"
          " none was (quiet), median s (count):")
    for k in aheads:
      for c in res["background_cost"][k]:
        b, q = c["busy_s"], c["quiet_s"]
        print(f"  {k}, phase at step {c['step']}: busy "
              + (f"{b:.3f} ({c['busy_n']})" if b else "-") + ", quiet "
              + (f"{q:.3f} ({c['quiet_n']})" if q else "-")
              + (f", {b / q:.2f}x" if b and q else ""))
  if "failure" in res:
    f = res["failure"]
    print(f"\nfailure before step {args.failure_at} ({f['procs_from']} -> {f['procs']} procs,"
          f" {f['devices']} devices {f['mesh']}): restored step {f['restored_step']}"
          f" ({f['steps_lost']} lost, redone {f['steps_redone']}); death -> new step done"
          f" {f['recovery_s']:.2f} s: detected {f['detected_s']:.2f}, stopped and handed"
          f" {f['handoff_s']:.2f}, restore {f['restore_s']:.2f}, batch {f['batch_s']:.2f},"
          f" step {f['step_s']:.2f} (compile left {f['compile_wait_s']:.2f}; prepared"
          f" {f['ahead_margin_s']:.1f} s before); snapshots"
          f" {statistics.median(f['snapshot_s']):.3f} s median")
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
