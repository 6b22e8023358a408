"""Step time of the deterministic gradient against plain ``jax.grad`` + psum.

One command (8 simulated CPU devices):

  PYTHONPATH=. python3 benchmarks/bench_determinism.py [--sizes small,100m]
      [--reps 5] [--profile]

For each model size and layout (DP: params replicated; FSDP: params split
over the batch axis) it times, interleaved, ``reps`` calls of

* ``plain``: ``jax.jit(jax.value_and_grad(global mean loss))`` with the batch
  sharded over ``data`` (XLA inserts the all-reduce / reduce-scatter);
* ``plain_opts``: the same compiled with ``determinism.COMPILER_OPTIONS``
  (what the options alone cost a step);
* ``det``: :func:`tenplex_jax.determinism.value_and_grad` with V = 8 virtual
  workers (one per device) in a step compiled by ``determinism.jit``;
* ``det_concat``: the same with the gradient flattened by a concatenate, as
  before this version (the "before" of the flatten change, same run),

and reports medians and minima, ratios to ``plain``, XLA's per-device buffer sizes
(``memory_analysis``: temp, arguments, outputs) of each program,
:func:`partial_gradient_bytes`, the process's peak RSS and the load. Before
running a size it compiles every program and skips the size (saying why) if
1.3 x (8 devices' arguments, outputs and temp buffers of the largest
program) + 1 GiB would not fit in ``MemAvailable``. With ``--profile`` it also traces
``det`` and ``plain`` on the first size and adds up XLA's per-op times by
kind (collectives, gradient flatten/unflatten copies, matmuls, ...): where
the overhead goes. The ``100m`` model (12 blocks of 1024 x 4096, 100.7M
parameters) uses bfloat16 params and batch (both steps alike) so that it
fits this machine; ``--dtype float32`` overrides. Results go to stdout as
JSON lines and to ``benchmarks/bench_determinism_result.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax import determinism as det  # noqa: E402

# An MLP stack: d_model x d_ff blocks; "100m" is 12 blocks of 1024 x 4096
# (2 matrices each) = 100.7M parameters.
SIZES = {"small": dict(d=256, ff=1024, blocks=2, batch=64, dtype="float32"),
         "6m": dict(d=512, ff=2048, blocks=3, batch=32, dtype="float32"),
         "100m": dict(d=1024, ff=4096, blocks=12, batch=16, dtype="bfloat16")}
METHODS = ("plain", "plain_opts", "det", "det_concat")
GIB = 1 << 30


def init(size, key, dtype=None):
  cfg = SIZES[size]
  dt = jnp.dtype(dtype or cfg["dtype"])
  params = {}
  for i in range(cfg["blocks"]):
    k1, k2, key = jax.random.split(key, 3)
    params[f"b{i}"] = {
        "up": (jax.random.normal(k1, (cfg["d"], cfg["ff"]))
               / cfg["d"] ** 0.5).astype(dt),
        "down": (jax.random.normal(k2, (cfg["ff"], cfg["d"]))
                 / cfg["ff"] ** 0.5).astype(dt)}
  return params


def loss_fn(params, batch):
  h = batch["x"]
  for i in range(len(params)):
    p = params[f"b{i}"]
    h = h + jnp.tanh(h @ p["up"]) @ p["down"]
  return jnp.mean(((h - batch["y"]) ** 2).astype(jnp.float32))


def shardings(params, mesh, fsdp):
  spec = P("data") if fsdp else P()
  return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, spec), params)


def _concat_flatten(groups, leaves, loss):
  """determinism._flatten as it was: one concatenate per dtype."""
  parts = [[] for _ in groups.dtypes]
  for (g, _, _, _), leaf in zip(groups.slots, leaves):
    parts[g].append(jnp.ravel(leaf))
  parts[groups.loss_slot[0]].append(
      jnp.reshape(loss, (1,)).astype(groups.dtypes[groups.loss_slot[0]]))
  out = []
  for g, dt in enumerate(groups.dtypes):
    items = parts[g]
    pad = groups.lengths[g] - sum(x.shape[0] for x in items)
    if pad:
      items.append(jnp.zeros((pad,), dt))
    out.append(jnp.concatenate(items) if len(items) > 1 else items[0])
  return out


def programs(mesh, params, fsdp):
  """The four step functions, jitted; ``det_concat`` is traced (and so
  compiled) with the old flatten patched in."""
  out = (NamedSharding(mesh, P()), shardings(params, mesh, fsdp))
  vg = det.value_and_grad(loss_fn, virtual_workers=8, mesh=mesh)
  return {
      "plain": (jax.jit(jax.value_and_grad(loss_fn), out_shardings=out), None),
      "plain_opts": (jax.jit(jax.value_and_grad(loss_fn), out_shardings=out,
                             compiler_options=dict(det.COMPILER_OPTIONS)),
                     None),
      "det": (det.jit(lambda p, b: vg(p, b), out_shardings=out), None),
      "det_concat": (det.jit(lambda p, b: vg(p, b), out_shardings=out),
                     _concat_flatten)}


def _patched(flatten):
  if flatten is None:
    return contextlib.nullcontext()
  return mock.patch.object(det, "_flatten", flatten)


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 0


def batch_for(size, mesh, dtype):
  cfg = SIZES[size]
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(k1, (cfg["batch"], cfg["d"]), dtype),
           "y": jax.random.normal(k2, (cfg["batch"], cfg["d"]), dtype)}
  return jax.device_put(batch, NamedSharding(mesh, P("data")))


def bench(size, fsdp, reps, mesh, dtype=None, methods=METHODS,
          compile_only=False):
  cfg = SIZES[size]
  dt = jnp.dtype(dtype or cfg["dtype"])
  abstract = jax.eval_shape(lambda: init(size, jax.random.key(0), dt))
  sh = shardings(abstract, mesh, fsdp)
  aparams = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, sh)
  abatch = jax.eval_shape(lambda: batch_for(size, mesh, dt))
  abatch = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          mesh, P("data"))), abatch)
  fns = {k: v for k, v in programs(mesh, abstract, fsdp).items()
         if k in methods}
  mem, compiled = {}, {}
  for name, (f, flatten) in fns.items():
    with _patched(flatten):
      c = f.lower(aparams, abatch).compile()
    compiled[name] = c
    m = c.memory_analysis()
    mem[name] = {"temp": m.temp_size_in_bytes,
                 "arguments": m.argument_size_in_bytes,
                 "outputs": m.output_size_in_bytes}
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(
      abstract))
  row = {"size": size, "layout": "fsdp" if fsdp else "dp", "params": n_params,
         "dtype": str(dt), "global_batch": cfg["batch"], "virtual_workers": 8,
         "devices": 8, "reps": reps, "xla_bytes_per_device": mem,
         "partial_gradient_bytes": det.partial_gradient_bytes(
             abstract, virtual_workers=8, devices=8)}
  need = 8 * max(sum(m.values()) for m in mem.values())
  avail = mem_available()
  row["estimated_peak_bytes"] = need
  row["mem_available_bytes"] = avail
  print(f"{size} {row['layout']}: XLA buffers {mem}; ~{need / GIB:.2f} GiB"
        f" for 8 devices, {avail / GIB:.1f} GiB available", file=sys.stderr,
        flush=True)
  if compile_only:
    row["skipped"] = "--compile-only"
    return row
  # The process's RSS ran to ~1.27x XLA's figure (runtime, host copies,
  # allocator) in a 100m DP run: ask for 1.3x plus 1 GiB of slack.
  if 1.3 * need + GIB > avail:
    row["skipped"] = (f"needs ~{need / GIB:.1f} GiB (8 devices x arguments +"
                      f" outputs + temp of the largest program) x 1.3 + 1 GiB,"
                      f" only {avail / GIB:.1f} GiB available")
    return row
  params = jax.jit(lambda: init(size, jax.random.key(0), dt),
                   out_shardings=sh)()
  batch = batch_for(size, mesh, dt)
  row["loadavg_before"] = os.getloadavg()
  for c in compiled.values():  # warm up
    jax.block_until_ready(c(params, batch))
  times = {k: [] for k in compiled}
  for _ in range(reps):
    for k, c in compiled.items():  # interleaved
      t0 = time.perf_counter()
      jax.block_until_ready(c(params, batch))
      times[k].append(time.perf_counter() - t0)
  row["loadavg_after"] = os.getloadavg()
  med = {k: statistics.median(v) for k, v in times.items()}
  row["seconds"] = med
  # The fastest call: the least disturbed by other jobs on a shared machine.
  row["min_seconds"] = {k: min(v) for k, v in times.items()}
  row["min_ratio_to_plain"] = {k: min(v) / min(times["plain"])
                               for k, v in times.items()}
  row["ratio_to_plain"] = {k: v / med["plain"] for k, v in med.items()}
  if "det_concat" in med:
    row["det_concat_over_det"] = med["det_concat"] / med["det"]
  row["peak_rss_bytes"] = resource.getrusage(
      resource.RUSAGE_SELF).ru_maxrss * 1024
  row["_compiled"] = compiled
  row["_args"] = (params, batch)
  return row


KINDS = (("all-to-all", "exchange (all_to_all)"),
         ("all_to_all", "exchange (all_to_all)"),
         ("all-gather", "all_gather"), ("all_gather", "all_gather"),
         ("all-reduce", "all-reduce"), ("reduce-scatter", "reduce-scatter"),
         ("ynn_fusion", "matmuls"), ("dot", "matmuls"),
         ("while", "scan / tree loops"),
         ("dynamic-update-slice", "tree stack updates"),
         ("slice", "flatten / unflatten copies"),
         ("pad", "flatten / unflatten copies"),
         ("concatenate", "flatten / unflatten copies"),
         ("copy", "copies"), ("fusion", "other fusions"))


def profile(compiled, args, steps=5) -> dict:
  """XLA op time per step, summed over the 8 devices, by kind (ms)."""
  out = {}
  for name in ("plain", "det", "det_concat"):
    if name not in compiled:
      continue
    c = compiled[name]
    jax.block_until_ready(c(*args))
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(steps):
          jax.block_until_ready(c(*args))
      [fn] = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
      with gzip.open(fn) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    kinds: dict[str, float] = collections.Counter()
    wall = 0.0
    for e in events:
      if e.get("ph") != "X":
        continue
      name_ = e["name"]
      if name_.startswith("$api.py") and "block_until_ready" in name_:
        wall += e.get("dur", 0)
      if name_.startswith(("ThunkExecutor", "Wait", "Rendezvous", "$",
                           "Pjit", "Common", "[", "Invoke")):
        continue
      kind = next((k for key, k in KINDS if key in name_), None)
      if kind is not None:
        kinds[kind] += e.get("dur", 0) / steps / 1e3
    out[name] = {"wall_ms_per_step": wall / steps / 1e3,
                 "op_ms_per_step_all_devices": dict(
                     sorted(kinds.items(), key=lambda kv: -kv[1]))}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="small,100m")
  ap.add_argument("--layouts", default="dp,fsdp")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dtype", default=None,
                  help="param/batch dtype for every size (default: per size)")
  ap.add_argument("--methods", default=",".join(METHODS),
                  help=f"a subset of {','.join(METHODS)} (plain and det"
                  " always run)")
  ap.add_argument("--compile-only", action="store_true",
                  help="print XLA's buffer sizes and the memory estimate only")
  ap.add_argument("--profile", action="store_true",
                  help="also trace the first size's steps: XLA time by op kind")
  ap.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
      "bench_determinism_result.json")))
  args = ap.parse_args(argv)
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  load_before = os.getloadavg()
  rows = []
  profiles = {}
  for size in args.sizes.split(","):
    for layout in args.layouts.split(","):
      methods = {"plain", "det", *args.methods.split(",")}
      row = bench(size, layout == "fsdp", args.reps, mesh, args.dtype,
                  tuple(m for m in METHODS if m in methods), args.compile_only)
      compiled, bargs = row.pop("_compiled", None), row.pop("_args", None)
      if args.profile and compiled is not None and (
          not profiles or size in profiles):
        profiles.setdefault(size, {})[layout] = profile(compiled, bargs)
      del compiled, bargs
      rows.append(row)
      print(json.dumps(row), flush=True)
  result = {"machine": f"{os.cpu_count()} cores, 8 simulated CPU devices",
            "command": "PYTHONPATH=. python3 benchmarks/bench_determinism.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "jax": jax.__version__, "rows": rows, "profiles": profiles}
  if profiles:
    print(json.dumps({"profiles": profiles}, indent=1), flush=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
