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
  ``jax.distributed`` start included, compilation not);
* **Orbax stop/restart** (the baseline users have): one process on the old
  layout saves the train state with ``orbax.checkpoint.StandardCheckpointer``
  and exits; a new process starts, imports, and restores it onto the new
  mesh's shardings; from the save call to the restored state.

The step time is the median step of the new phase in the in-process run. The
three methods run one after the other in the same invocation (load hits all
alike within the noise; ``uptime`` is recorded before and after).

  python benchmarks/bench_lm_resize.py [--steps 12] [--out results/bench_lm_resize.json]
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
SCHEDULE = "0:data=2,tensor=2,stage=2 3:fsdp=2,stage=2 6:tensor=2 9:fsdp=2,stage=4"
PROCS = "2,2,1,2"


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


def _layout_text(degrees):
  return ",".join(f"{k}={v}" for k, v in degrees.items() if v > 1) or "data=1"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--schedule", default=SCHEDULE)
  ap.add_argument("--procs", default=PROCS, help="processes per phase (across processes)")
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--fast-compile", action="store_true")
  ap.add_argument("--out", default="results/bench_lm_resize.json")
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
         "fast_compile": args.fast_compile, "load_before": os.getloadavg()}
  with Progress() as progress:
    task = progress.add_task("in-process, across processes, orbax", total=2 + len(phases) - 1)
    inproc = lm.train(phases, args.steps, cfg, log=lambda *_: None, compiler_options=opts)
    progress.advance(task)
    ns = argparse.Namespace(schedule=args.schedule, steps=args.steps, config=args.config,
                            search=False, remat=False, fast_compile=args.fast_compile,
                            deterministic=None, timeout=1800)
    procs, _ = lm.run_procs(ns, cfg, phases, plan, log=lambda *_: None)
    progress.advance(task)
    rows = []
    for i, p in enumerate(phases[1:], 1):
      old, new = phases[i - 1], p
      before = next(r for r in inproc if r["step"] == p.step - 1)
      after = next(r for r in inproc if r["step"] == p.step)
      cross = next(r for r in procs if r["step"] == p.step)
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
          "orbax_s": orbax_total, "orbax_parts_s": {
              "save_s": saved["save_s"], "relaunch_s": restored["process_start"] - exited,
              "import_s": restored["import_s"], "restore_s": restored["restore_s"]},
          "state_bytes": saved["bytes"],
          "compile_s": after["compile_s"]})
      progress.advance(task)
  res["resizes"] = rows
  res["load_after"] = os.getloadavg()
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
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1, default=float))
  del np
  return res


if __name__ == "__main__":
  main()
