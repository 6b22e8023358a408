"""Pipeline parallelism on 8 CPU devices: step times and the bubble.

Two measurements, each with its methods interleaved round-robin and
repeated (medians), so machine load hits every method alike:

1. **Step time** of one training step (forward, backward, Adam) of the LM in
   examples/lm at a fixed global batch, for
   * ``pipeline S x M``: ``tenplex_jax.pipeline``, ``stage=S, data=8/S``,
     M microbatches (S in {2, 4}, M in {4, 8, 16});
   * ``layer-sharded S``: the same model with the stacked ``layers`` axis
     sharded over ``stage=S`` but run by ``lax.scan`` under ``jit``: FSDP over
     layers, each step gathers every layer onto every device;
   * ``data-parallel``: ``data=8``, params replicated.
2. **Bubble**: the pipelined layer stack alone (forward + backward, no
   embedding or optimizer) at a *fixed microbatch size* for M in {4, 8, 16}.
   A GPipe step takes ``M + S - 1`` ticks of equal length, so its time is
   ``t(M) = tau * M + beta`` with ``beta = tau * (S - 1)`` plus fixed overhead.
   A least-squares fit gives ``tau`` (one tick) and ``beta``; the measured
   bubble fraction at M is ``beta / t(M)``, next to ``(S-1)/(M+S-1)``.

  python benchmarks/bench_pipeline.py [--reps 7] [--out results/bench_pipeline.json]
  python benchmarks/bench_pipeline.py --quick   # tiny sizes, 2 stages, M in {2, 4}: a smoke run

Every layout's first step must give the data-parallel step's loss (same
params, same batch; float reduction order only): ``loss_max_rel_diff`` in
the JSON, checked before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from rich.progress import Progress  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"))
import tenplex_jax as tj  # noqa: E402
from model import LM, RULES, Block, Config, abstract_params, make_mesh  # noqa: E402

CFG = Config(vocab=128, seq_len=16, embed=64, heads=4, mlp=256, layers=8)


def lm_step(cfg, mesh, microbatches, pipeline, global_batch, compiler_options=None):
  """(compiled step, args) for one LM training step on ``mesh``."""
  cfg = dataclasses.replace(cfg, pipeline=pipeline, microbatches=microbatches)
  model = LM(cfg, mesh)
  tx = optax.adam(1e-3)
  ab = abstract_params(cfg)
  shard = nn.logical_to_mesh_sharding(nn.get_partition_spec(ab), mesh, RULES)
  params = jax.jit(lambda k: nn.unbox(model.init(k, jnp.zeros((1, cfg.seq_len), jnp.int32))
                                      ["params"]), out_shardings=nn.unbox(shard))(
                                          jax.random.key(0))
  opt = tx.init(params)
  tokens = jax.device_put(
      jax.random.randint(jax.random.key(1), (global_batch, cfg.seq_len + 1), 0, cfg.vocab),
      NamedSharding(mesh, P(("data", "fsdp"))))

  def step(params, opt, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  args = (params, opt, tokens)
  return jax.jit(step).lower(*args).compile(compiler_options), args


def stack_step(cfg, stages, microbatches, mb_rows, compiler_options=None):
  """(compiled fwd+bwd of the pipelined stack, args) at ``mb_rows`` rows per microbatch."""
  mesh = make_mesh(jax.devices(), stage=stages, data=8 // stages)
  block = Block(cfg)
  x = jnp.zeros((1, cfg.seq_len, cfg.embed))
  keys = jax.random.split(jax.random.key(0), cfg.layers)
  params = jax.jit(jax.vmap(lambda k: nn.unbox(block.init(k, x)["params"])),
                   out_shardings=NamedSharding(mesh, P("stage")))(keys)
  batch = microbatches * mb_rows
  x = jax.device_put(jax.random.normal(jax.random.key(1), (batch, cfg.seq_len, cfg.embed)),
                     NamedSharding(mesh, P("data")))
  layer = lambda p, h: block.apply({"params": p}, h)  # noqa: E731

  def f(params, x):
    return jax.grad(lambda p: tj.pipeline(layer, p, x, mesh=mesh,
                                          microbatches=microbatches).sum())(params)

  return jax.jit(f).lower(params, x).compile(compiler_options), (params, x)


def timed(fn, args):
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def interleaved(cases, reps, progress, label, warm_up=True):
  """Median seconds per case, cases run round-robin ``reps`` times after a warm-up
  (``warm_up=False``: the caller ran each case once already)."""
  times = {k: [] for k in cases}
  task = progress.add_task(label, total=reps * len(cases))
  for fn, args in cases.values() if warm_up else ():
    timed(fn, args)
  for _ in range(reps):
    for k, (fn, args) in cases.items():
      times[k].append(timed(fn, args))
      progress.advance(task)
  return {k: statistics.median(v) for k, v in times.items()}, times


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--global-batch", type=int, default=32)
  ap.add_argument("--mb-rows", type=int, default=4, help="rows per microbatch for the fit")
  ap.add_argument("--stages", default="2,4")
  ap.add_argument("--microbatches", default="4,8,16")
  ap.add_argument("--out", default="results/bench_pipeline.json")
  ap.add_argument("--quick", action="store_true",
                  help="smoke run: a 4-layer model with embed 16, stages 2, microbatches 2,4"
                  " for the bubble fit (4 rows each), the LM step only data-parallel and"
                  " pipelined 2x2, global batch 8, 1 rep, XLA optimisation level 0")
  args = ap.parse_args(argv)
  cfg, opts = CFG, None
  if args.quick:
    cfg = dataclasses.replace(CFG, vocab=32, embed=16, heads=2, mlp=32, layers=4)
    args.stages, args.microbatches, args.reps = "2", "2,4", 1
    args.global_batch, args.mb_rows = 8, 4
    opts = {"xla_backend_optimization_level": 0}
  stages = [int(s) for s in args.stages.split(",")]
  mbs = [int(m) for m in args.microbatches.split(",")]
  # The LM step's layouts (--quick: fewer, each compile takes ~10 s here).
  lm_mbs = mbs[:1] if args.quick else mbs
  load0 = os.getloadavg()
  res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                    f"{platform.python_version()}, jax {jax.__version__}, 8 simulated CPU devices",
         "config": dataclasses.asdict(cfg), "global_batch": args.global_batch, "reps": args.reps}
  with Progress() as progress:
    task = progress.add_task("compiling", total=len(stages) * (
        len(lm_mbs) + len(mbs) + (not args.quick)) + 1)
    cases = {"data-parallel": lm_step(cfg, make_mesh(jax.devices(), data=8), 1, False,
                                      args.global_batch, opts)}
    progress.advance(task)
    for s in stages:
      mesh = make_mesh(jax.devices(), stage=s, data=8 // s)
      if not args.quick:
        cases[f"layer-sharded {s}"] = lm_step(cfg, mesh, 1, False, args.global_batch, opts)
        progress.advance(task)
      for m in lm_mbs:
        cases[f"pipeline {s}x{m}"] = lm_step(cfg, mesh, m, True, args.global_batch, opts)
        progress.advance(task)
    stacks = {}
    for s in stages:
      for m in mbs:
        stacks[(s, m)] = stack_step(cfg, s, m, args.mb_rows, opts)
        progress.advance(task)
    # Same params, same batch: every layout's first step has the data-parallel loss.
    losses = {k: float(fn(*a)[2]) for k, (fn, a) in cases.items()}
    ref = losses["data-parallel"]
    res["loss"] = losses
    res["loss_max_rel_diff"] = max(abs(v - ref) / abs(ref) for v in losses.values())
    if res["loss_max_rel_diff"] > 1e-5:
      raise SystemExit(f"the layouts disagree on the first step's loss: {losses}")
    # (that first step was each case's warm-up)
    step_med, step_all = interleaved(cases, args.reps, progress, "LM steps", warm_up=False)
    stack_med, _ = interleaved({f"{s}x{m}": v for (s, m), v in stacks.items()}, args.reps,
                               progress, "stack fwd+bwd")
  res["step_s"] = step_med
  res["step_s_all"] = step_all
  dp = step_med["data-parallel"]
  rows = []
  for k, v in step_med.items():
    rows.append(f"| {k} | {v * 1e3:.1f} | {v / dp:.2f}x |")
  fits = {}
  for s in stages:
    ms = np.array(mbs, float)
    ts = np.array([stack_med[f"{s}x{m}"] for m in mbs])
    tau, beta = np.polyfit(ms, ts, 1)
    fits[s] = {"tick_s": tau, "intercept_s": beta, "intercept_ticks": beta / tau,
               "theory_ticks": s - 1,
               "by_microbatches": {m: {"stack_s": t, "measured": beta / t,
                                       "theory": tj.bubble_fraction(s, m)}
                                   for m, t in zip(mbs, ts)}}
  res["bubble"] = fits
  res["load_before"], res["load_after"] = load0, os.getloadavg()
  print(f"machine: {res['machine']}; load {load0[0]:.1f} -> {res['load_after'][0]:.1f}")
  print(f"\nLM training step, global batch {args.global_batch} (median of {args.reps})\n")
  print("| layout | step ms | vs data-parallel |\n|---|---:|---:|")
  print("\n".join(rows))
  print(f"\nBubble: pipelined stack fwd+bwd, {args.mb_rows} rows per microbatch\n")
  print("| stages | M | stack ms | measured bubble | (S-1)/(M+S-1) |\n|---:|---:|---:|---:|---:|")
  for s, f in fits.items():
    for m, d in f["by_microbatches"].items():
      print(f"| {s} | {m} | {d['stack_s'] * 1e3:.1f} | {d['measured']:.3f} | {d['theory']:.3f} |")
  for s, f in fits.items():
    print(f"stages {s}: tick {f['tick_s'] * 1e3:.2f} ms, intercept {f['intercept_ticks']:.2f}"
          f" ticks (theory {s - 1})")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1, default=float))
  return res


if __name__ == "__main__":
  main()
