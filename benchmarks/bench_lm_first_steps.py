"""The first, second, third ... step of the LM trainer's step in a fresh 2-process job.

Is a resize's first step across processes slow because of its first run
(gloo opening its connections when a communicator is first used, the first
execution of a loaded executable), or is every step that slow? This starts a
job as ``tenplex-jax launch`` does (2 processes on 127.0.0.1, 4 CPU devices
each, gloo collectives, ``jax.distributed``), then in each process:

* times ``jax.distributed.initialize``;
* times each of ``--calls`` calls of a jitted sum over all 8 devices (one
  all-reduce across the processes), separately;
* compiles the LM trainer's step for ``--layout`` (default the benchmark's
  mesh run before, ``data=2,tensor=2,stage=2``: data across the processes,
  stage and tensor inside each) and times each of ``--steps`` steps
  separately (wall and this process's CPU seconds), on zeros, as the
  trainer's ahead generation warms up;
* the same step's time in one process with all 8 devices (no gloo), for
  comparison.

``--src DIR`` imports the trainer and tenplex_jax from another checkout (a
baseline commit's tree, e.g. ``git archive COMMIT | tar -x -C DIR``), so a
before/after pair runs with the same script; ``--procs 2`` skips the
one-process job. Each step records its wall time and the process's user and
system CPU seconds (``os.times``).

  python benchmarks/bench_lm_first_steps.py [--steps 8] [--calls 8] [--src DIR] \
      [--procs 2,1] [--layout data=2,tensor=2,stage=2] \
      [--out benchmarks/bench_lm_first_steps_result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if "--src" in sys.argv:  # before jax or the trainer is imported
  ROOT = pathlib.Path(sys.argv[sys.argv.index("--src") + 1]).resolve()


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def side(args):
  """One process: ``--side N,I,PORT``; prints its timings as one JSON line."""
  n, i, port = (int(x) for x in args.side.split(","))
  import jax
  jax.config.update("jax_num_cpu_devices", 8 // n)
  t0 = time.perf_counter()
  if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                               process_id=i, initialization_timeout=120)
  out = {"process": i, "distributed_s": time.perf_counter() - t0}
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  sys.path.insert(0, str(ROOT))
  from tenplex_jax.demo import load_lm_trainer
  lm = load_lm_trainer()
  devs = jax.devices()
  flat = jax.make_mesh((len(devs),), ("x",), devices=devs)
  x = jax.make_array_from_callback((len(devs) * 4,), NamedSharding(flat, P("x")),
                                   lambda idx: np.ones(4, np.float32))
  total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(flat, P())).lower(x).compile()
  calls = []
  for _ in range(args.calls):
    t0 = time.perf_counter()
    jax.block_until_ready(total(x))
    calls.append(time.perf_counter() - t0)
  out["allreduce_call_s"] = calls
  cfg = lm.configs.CONFIGS[args.config]
  gb = lm.configs.GLOBAL_BATCH
  phase = lm.configs.parse(f"0:{args.layout}")[0]
  mesh, rules, mb = lm.layout(phase, cfg, devs, search=False, global_batch=gb)
  _, abstract = lm.state_and_target(cfg, mesh, rules, lm.configs.LEARNING_RATE)
  spec = NamedSharding(mesh, P(("data", "fsdp")))
  batch = (jax.ShapeDtypeStruct((gb, cfg.seq_len + 1), jnp.int32, sharding=spec),
           jax.ShapeDtypeStruct((gb,), jnp.float32, sharding=spec))
  t0 = time.perf_counter()
  fn = lm.make_step(cfg, mesh, mb, state_shardings=jax.tree.map(lambda a: a.sharding, abstract)
                    ).lower(abstract, *batch).compile()
  out["compile_s"] = time.perf_counter() - t0
  text = fn.as_text()
  out["hlo_collectives"] = {k: text.count(f" {k}(") for k in (
      "all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")}
  out["hlo_conditionals"] = text.count(" conditional(")
  state = lm._zeros(abstract)
  tokens, mask = (lm._zeros(b, 1) for b in batch)
  steps = []
  for _ in range(args.steps):
    c0, t0, o0 = time.process_time(), time.perf_counter(), os.times()
    state, loss = fn(state, tokens, mask)
    jax.block_until_ready(loss)
    o1 = os.times()
    steps.append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                  "user_s": o1.user - o0.user, "sys_s": o1.system - o0.system})
  out["steps"] = steps
  print(json.dumps(out), flush=True)


def _job(args, n):
  """Runs ``n`` processes of :func:`side`; their JSON lines, by process."""
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  procs = [subprocess.Popen([sys.executable, __file__, "--side", f"{n},{i},{port}",
                             "--steps", str(args.steps), "--calls", str(args.calls),
                             "--layout", args.layout, "--config", args.config,
                             "--src", str(ROOT)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
           for i in range(n)]
  outs = []
  try:
    for p in procs:
      stdout, _ = p.communicate(timeout=900)
      if p.returncode:
        raise RuntimeError(f"a process of the {n}-process job exited with {p.returncode}")
      outs.append(json.loads(stdout.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return sorted(outs, key=lambda o: o["process"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--calls", type=int, default=8)
  ap.add_argument("--layout", default="data=2,tensor=2,stage=2")
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--out", default="benchmarks/bench_lm_first_steps_result.json")
  ap.add_argument("--src", help="the checkout to import the trainer from (default: this one)")
  ap.add_argument("--procs", default="2,1", help="the jobs' process counts")
  ap.add_argument("--side", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.side:
    return side(args)
  res = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "layout": args.layout,
         "config": args.config, "src": str(ROOT), "load_before": list(os.getloadavg())}
  for n in (int(x) for x in args.procs.split(",")):
    outs = _job(args, n)
    walls = [max(o["steps"][k]["wall_s"] for o in outs) for k in range(args.steps)]
    res[f"procs_{n}"] = {
        "per_process": outs, "step_wall_s": walls,
        "first_step_s": walls[0], "later_median_s": statistics.median(walls[1:]),
        "later_median_cpu_s": statistics.median(  # both processes together
            sum(o["steps"][k]["cpu_s"] for o in outs) for k in range(1, args.steps)),
        "later_median_sys_s": statistics.median(
            sum(o["steps"][k]["sys_s"] for o in outs) for k in range(1, args.steps)),
        "allreduce_first_s": max(o["allreduce_call_s"][0] for o in outs),
        "allreduce_later_median_s": statistics.median(
            max(o["allreduce_call_s"][k] for o in outs) for k in range(1, args.calls))}
    r = res[f"procs_{n}"]
    print(f"{n} process(es): distributed {max(o['distributed_s'] for o in outs):.2f} s;"
          f" all-reduce 1st {r['allreduce_first_s'] * 1e3:.1f} ms, later median"
          f" {r['allreduce_later_median_s'] * 1e3:.1f} ms; step "
          + ", ".join(f"{w:.3f}" for w in walls) + " s; CPU (process 0) "
          + ", ".join(f"{s['cpu_s']:.3f}" for s in outs[0]["steps"]) + " s", flush=True)
  res["load_after"] = list(os.getloadavg())
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
