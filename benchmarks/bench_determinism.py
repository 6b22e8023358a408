"""Step time and memory of the deterministic gradient against plain steps.

One command (simulated CPU devices):

  PYTHONPATH=. python3 benchmarks/bench_determinism.py [--sizes 100m]
      [--dtypes float32,bfloat16] [--layouts dp,fsdp] [--devices 2]
      [--ratios 1,2,4,8] [--rows 8] [--seq 1] [--reps 3] [--profile]
      [--profile-ratios 1,8] [--lock /work/.bench.lock] [--lock-compile]
      [--compile-reps 2]

For each model size, dtype, layout (DP: params replicated; FSDP / ZeRO-3:
every matrix split over ``data``) and ratio ``k = V/n`` of virtual workers to
devices, with ``V = n k`` workers of ``rows`` sequences each (global batch
``rows V``), it times, interleaved, ``reps`` calls of

* ``plain``: ``jax.value_and_grad`` of the global mean loss, the batch
  sharded over ``data`` (XLA's all-reduce / reduce-scatter), compiled with
  ``determinism.COMPILER_OPTIONS`` like the deterministic step;
* ``plain_acc``: the same gradient accumulated over ``k`` microbatches of
  ``rows`` sequences per device (a ``shard_map``: FSDP params all-gathered
  once, a ``lax.scan`` summing the microbatches' gradients plainly, then one
  ``psum`` / ``psum_scatter``): the same per-worker matmul sizes and the
  same communication as ``det``, so ``det / plain_acc`` is the cost of the
  fixed reduction order alone and ``plain_acc / plain`` that of the smaller
  matmuls (a plain step on ``V`` devices' work, run ``k`` at a time);
* ``plain_acc_cond``: ``plain_acc`` with each microbatch's
  ``value_and_grad`` run as both branches of a ``lax.cond`` on a predicate
  XLA cannot know while compiling, as ``det`` isolates each worker: the
  cost of that isolation alone (on GPU a conditional reads its predicate on
  the host);
* ``det``: :func:`tenplex_jax.determinism.value_and_grad` in a step compiled
  by ``determinism.jit``;
* ``det_prev``: ``det`` as it was before the transposed exchange
  (``determinism._EXCHANGE_TRANSPOSED`` and ``_COLLECTIVES_AS_BITS``
  False: gathered gradients split along their first dimension, 16-bit
  floats through the collectives as themselves, which XLA:CPU runs in
  float32; 16-bit float gradients left replicated exchanged by the
  ``all_to_all``): the "before" of the same run;
* ``det_s12``: ``det`` as the twelfth session left it:
  ``determinism._ACCUMULATE_TRANSPOSED`` False (16-bit matmul weights'
  gradients summed on the device as themselves at ``V/n > 1``, their
  column-major worker outputs added to row-major partial sums), the "before"
  of the thirteenth session's runs;
* ``det_gather``: ``det`` with ``determinism._GATHER_INSIDE_JIT`` set: every
  gradient all-gathered inside the step, also the FSDP ones that ``det``
  leaves in the reduce-scatter layout (the behaviour before; FSDP cells
  only: in DP it is ``det``'s program);
* ``det_a2a``: ``det`` with ``determinism._TOP_BY_PERMUTE`` and
  ``_ROOT_ADD_IN_TOP`` False, the behaviour before: the top of the tree
  exchanges the subtree sums by one ``all_to_all`` per leaf (each chunk
  first sliced out into a buffer of its own), and the root of an unrolled
  subtree is added before the FSDP gradients' top branches (the sum
  written whole);
* ``det_root_out``: ``det`` with ``_ROOT_ADD_IN_TOP`` False only (the
  permutes kept); where ``det`` does not unroll or keeps no gradient in
  the reduce-scatter layout, ``det``'s program;
* ``det_scan`` / ``det_unroll``: the same with
  ``determinism._UNROLL_LEVELS`` 0 / 3: each device's subtree as nested
  scans whose carries start at ``-0.0`` (the CPU default before), or its top
  three levels unrolled (a binary-counter stack of partial sums: no loop
  carries, no fill; each worker's conditional waits for the partial sums
  through its predicate), ``det``'s default (on CPU from 64 MiB of
  gradient per worker, ``_UNROLL_MIN_BYTES``, the scans below). Same bits;
* ``det_cond`` / ``det_barrier``: the same with
  ``determinism._ISOLATE_BY_COND`` True / False: each worker isolated by a
  ``lax.cond`` (the CPU default) or by optimisation barriers only (the GPU
  default: no predicate read on the host; on CPU barriers do not isolate);
* ``det_old``: the same with ``determinism._EXCHANGE_EVERY_WORKER`` set, the
  implementation before issue 23 (every worker's gradient flattened and
  exchanged with an ``all_to_all``, summed on a stack): the "before" of the
  same run,
* ``plain_l3`` / ``det_l3``: ``plain`` / ``det`` compiled at XLA's backend
  optimisation level 3 (``COMPILER_OPTIONS`` set 3 before the twenty-first
  session, 2 since: the same step time, a fraction of the compile time),

and reports medians and minima of the wall time and of the process's CPU
time per call (user + system: the work done, less disturbed by other jobs
taking the cores), ratios to ``plain`` and to ``plain_acc``, XLA's
per-device buffer sizes (``memory_analysis``) of each program beside the
least temp memory any evaluation of the fixed tree needs
(``tree_temp_bound``), the time to trace and lower each program and XLA's
compile time (wall and CPU, medians over ``--compile-reps`` fresh compiles;
``--lock-compile`` holds ``--lock`` while each cell compiles), the process's
peak RSS and the load. It compiles every cell's programs first, then
(holding ``--lock``, the machine's benchmark lock, if given) runs the
cells; it skips a cell
(saying why) if 1.3 x (the devices' arguments, outputs and temp buffers of the
largest program) + 1 GiB would not fit in ``MemAvailable``. With ``--profile``
it also traces each program of the cells whose ``V/n`` is in
``--profile-ratios`` and adds up XLA's per-op times by kind (matmuls, tree
or accumulation additions, collectives, slices, copies, fills, ...; the
events of conditionals and loops are not counted, their ops are): where the
time goes, and how much of it is not matmuls. Results go to stdout as JSON lines and to ``--out`` (rewritten after
every cell, ``"complete": true`` at the end).

The ``100m`` model is 12 blocks of 1024 x 4096 (2 matrices each, residual
tanh MLP): 100.7M parameters.
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
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax import determinism as det  # noqa: E402

from interleaved import time_interleaved  # noqa: E402

SIZES = {"small": dict(d=256, ff=1024, blocks=2),
         "6m": dict(d=512, ff=2048, blocks=3),
         "25m": dict(d=1024, ff=4096, blocks=3),
         "100m": dict(d=1024, ff=4096, blocks=12)}
METHODS = ("plain", "plain_acc", "plain_acc_cond", "det", "det_prev",
           "det_s12", "det_gather", "det_root_out", "det_a2a", "det_scan",
           "det_unroll", "det_cond", "det_barrier", "det_old", "plain_l3",
           "det_l3")
GIB = 1 << 30
OPTS = det._compiler_options()  # the xla_cpu_* options on CPU only


def init(size, key, dt):
  cfg = SIZES[size]
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


def programs(mesh, params, fsdp, k, rows, methods):
  n = mesh.shape["data"]
  v = n * k
  out = (NamedSharding(mesh, P()), shardings(params, mesh, fsdp))

  def plain_acc(p, b, isolate=False):
    # Gradient accumulation as a trainer writes it: each device runs k
    # microbatches of `rows` sequences (the virtual workers' slices), sums
    # their gradients locally in a lax.scan, and the devices' sums are
    # reduced once (psum, or psum_scatter to the FSDP shards): the same
    # per-worker matmuls and the same communication as `det`, without the
    # fixed order.
    specs = jax.tree.map(lambda s: s.spec, out[1])

    def body(ps, xb):
      full = jax.tree.map(
          lambda x, s: x if s == P() else lax.all_gather(x, "data", axis=0,
                                                         tiled=True),
          ps, specs)

      vg = jax.value_and_grad(loss_fn)
      first = jax.tree_util.tree_leaves(full)[0]

      def step(acc, mb):
        if isolate:
          pred = jnp.isnan(jnp.ravel(first)[0])
          lg = lax.cond(pred, lambda o: vg(*o), lambda o: vg(*o), (full, mb))
        else:
          lg = vg(full, mb)
        return jax.tree.map(jnp.add, acc, lg), None

      local = jax.tree.map(
          lambda x: jnp.reshape(x, (k, rows) + x.shape[1:]), xb)
      zero = jax.tree.map(jnp.zeros_like, (jnp.float32(0), full))
      (loss, g), _ = lax.scan(step, zero, local)
      loss = lax.psum(loss, "data") / v
      g = jax.tree.map(
          lambda x, s: (lax.psum(x, "data") if s == P() else
                        lax.psum_scatter(x, "data", scatter_dimension=0,
                                         tiled=True)) / jnp.asarray(v, x.dtype),
          g, specs)
      return loss, g

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                         out_specs=(P(), specs), check_vma=False)(p, b)

  fns = {}
  if "plain" in methods:
    fns["plain"] = jax.jit(jax.value_and_grad(loss_fn), out_shardings=out,
                           compiler_options=OPTS)
  if "plain_acc" in methods:
    fns["plain_acc"] = jax.jit(plain_acc, out_shardings=out,
                               compiler_options=OPTS)
  if "plain_acc_cond" in methods:
    fns["plain_acc_cond"] = jax.jit(lambda p, b: plain_acc(p, b, True),
                                    out_shardings=out, compiler_options=OPTS)
  if "det" in methods or "det_l3" in methods:
    vg = det.value_and_grad(loss_fn, virtual_workers=v, mesh=mesh,
                            param_shardings=out[1])
  if "det" in methods:
    fns["det"] = det.jit(lambda p, b: vg(p, b), out_shardings=out)
  if "det_gather" in methods and fsdp:  # in DP the same program as det
    with mock.patch.object(det, "_GATHER_INSIDE_JIT", True):
      vg_g = det.value_and_grad(loss_fn, virtual_workers=v, mesh=mesh,
                                param_shardings=out[1])
    fns["det_gather"] = det.jit(lambda p, b: vg_g(p, b), out_shardings=out)
  # The step before the transposed exchange and the 16-bit collectives as
  # ints (both settings False), 16-bit float gradients left replicated
  # exchanged by the all_to_all as they were then.
  narrow = any(jnp.dtype(x.dtype).itemsize == 2
               for x in jax.tree_util.tree_leaves(params))
  prev = {"_EXCHANGE_TRANSPOSED": False, "_COLLECTIVES_AS_BITS": False}
  if narrow and not fsdp:
    prev["_TOP_BY_PERMUTE"] = False
  for name, settings in (("det_prev", prev),
                         ("det_s12", {"_ACCUMULATE_TRANSPOSED": False}),
                         ("det_root_out", {"_ROOT_ADD_IN_TOP": False}),
                         ("det_a2a", {"_TOP_BY_PERMUTE": False,
                                      "_ROOT_ADD_IN_TOP": False}),
                         ("det_scan", {"_UNROLL_LEVELS": 0}),
                         ("det_unroll", {"_UNROLL_LEVELS": 3}),
                         ("det_cond", {"_ISOLATE_BY_COND": True}),
                         ("det_barrier", {"_ISOLATE_BY_COND": False})):
    if name in methods:
      with mock.patch.multiple(det, **settings):
        vg_l = det.value_and_grad(loss_fn, virtual_workers=v, mesh=mesh,
                                  param_shardings=out[1])
      fns[name] = det.jit(lambda p, b, vg_l=vg_l: vg_l(p, b),
                          out_shardings=out)
  level3 = {"xla_backend_optimization_level": 3}
  if "plain_l3" in methods:
    fns["plain_l3"] = jax.jit(jax.value_and_grad(loss_fn), out_shardings=out,
                              compiler_options={**OPTS, **level3})
  if "det_l3" in methods:
    fns["det_l3"] = det.jit(lambda p, b: vg(p, b), out_shardings=out,
                            compiler_options=level3)
  if "det_old" in methods:
    with mock.patch.object(det, "_EXCHANGE_EVERY_WORKER", True):
      vg_old = det.value_and_grad(loss_fn, virtual_workers=v, mesh=mesh)
    fns["det_old"] = det.jit(lambda p, b: vg_old(p, b), out_shardings=out)
  return fns


def tree_temp_bound(params, k: int, fsdp: bool) -> int | None:
  """The least temp memory per device any evaluation of the fixed tree needs.

  A device's ``k`` workers form a perfect subtree whose leaves are whole
  gradients, each produced at once by one worker's backward pass; summing
  them in the tree's order is the black pebble game on a complete binary
  tree of height ``log2(k)``: ``log2(k) + 1`` gradient-sized buffers live at
  once, at least. In DP the summed gradient's buffer can be the output
  (``log2(k)`` of them temporary); in FSDP the output is a ``1/n`` shard, so
  all ``log2(k) + 1`` are temporary, and the gathered params (needed by every
  worker) too. ``None`` for ``k = 1`` (no tree on the device).
  """
  if k < 2 or k & (k - 1):
    return None
  g = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
          for a in jax.tree_util.tree_leaves(params))
  levels = k.bit_length() - 1
  return g + (levels + 1) * g if fsdp else levels * g


def _cpu(r0, r1) -> float:
  return r1.user - r0.user + r1.system - r0.system


@contextlib.contextmanager
def _locked(path: str):
  """Holds ``flock`` on ``path`` (nothing if empty) for the block."""
  if not path:
    yield
    return
  import fcntl
  with open(path, "a") as f:
    t0 = time.perf_counter()
    fcntl.flock(f, fcntl.LOCK_EX)
    print(f"waited {time.perf_counter() - t0:.0f} s for {path} (compile)",
          file=sys.stderr, flush=True)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 0


def batch_for(size, mesh, dt, global_batch, seq):
  d = SIZES[size]["d"]
  k1, k2 = jax.random.split(jax.random.key(1))
  shape = (global_batch, d) if seq == 1 else (global_batch, seq, d)
  batch = {"x": jax.random.normal(k1, shape, dt),
           "y": jax.random.normal(k2, shape, dt)}
  return jax.device_put(batch, NamedSharding(mesh, P("data")))


def prepare(size, dt, fsdp, k, args, mesh, methods):
  """Compiles the cell's programs and reads XLA's buffer sizes (no timing)."""
  n = mesh.shape["data"]
  v = n * k
  global_batch = args.rows * v
  abstract = jax.eval_shape(lambda: init(size, jax.random.key(0), dt))
  sh = shardings(abstract, mesh, fsdp)
  aparams = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, sh)
  abatch = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          mesh, P("data"))),
      jax.eval_shape(lambda: batch_for(size, mesh, dt, global_batch,
                                       args.seq)))
  # Each rep builds the programs afresh (new closures: traced, lowered and
  # compiled again, no cache hit), the methods interleaved; the compile
  # times of the reps are kept, the last rep's executables timed.
  lowering = {name: [] for name in methods}
  compiling = {name: [] for name in methods}
  with _locked(args.lock if args.lock_compile else ""):
    for _ in range(max(1, args.compile_reps)):
      fns = programs(mesh, abstract, fsdp, k, args.rows, methods)
      compiled = {}
      for name, f in fns.items():
        r0, t0 = os.times(), time.perf_counter()
        lowered = f.lower(aparams, abatch)
        r1, t1 = os.times(), time.perf_counter()
        compiled[name] = lowered.compile()
        r2, t2 = os.times(), time.perf_counter()
        lowering[name].append((t1 - t0, _cpu(r0, r1)))
        compiling[name].append((t2 - t1, _cpu(r1, r2)))
  mem = {}
  for name, c in compiled.items():
    m = c.memory_analysis()
    mem[name] = {"temp": m.temp_size_in_bytes,
                 "arguments": m.argument_size_in_bytes,
                 "outputs": m.output_size_in_bytes}
  n_params = sum(int(np.prod(a.shape))
                 for a in jax.tree_util.tree_leaves(abstract))
  row = {"size": size, "layout": "fsdp" if fsdp else "dp", "params": n_params,
         "dtype": str(dt), "devices": n, "virtual_workers": v,
         "workers_per_device": k, "rows_per_worker": args.rows,
         "seq": args.seq, "global_batch": global_batch, "reps": args.reps,
         "xla_bytes_per_device": mem}
  if "plain" in mem:
    row["temp_ratio_to_plain"] = {
        kk: m["temp"] / max(1, mem["plain"]["temp"]) for kk, m in mem.items()}
  if "plain_acc" in mem:
    row["temp_ratio_to_plain_acc"] = {
        kk: m["temp"] / max(1, mem["plain_acc"]["temp"])
        for kk, m in mem.items()}
  row["tree_temp_bound_bytes"] = tree_temp_bound(abstract, k, fsdp)
  # Trace + lowering, and XLA's compile, per program: medians over the reps
  # of the wall and of the process's CPU seconds (user + system).
  row["compile_seconds"] = {
      name: {"lower": statistics.median(w for w, _ in lowering[name]),
             "lower_cpu": statistics.median(c for _, c in lowering[name]),
             "compile": statistics.median(w for w, _ in compiling[name]),
             "compile_cpu": statistics.median(c for _, c in compiling[name]),
             "reps": len(compiling[name])}
      for name in compiled}
  row["loadavg_compile"] = os.getloadavg()
  need = n * max(sum(m.values()) for m in mem.values())
  avail = mem_available()
  row["estimated_peak_bytes"] = need
  row["mem_available_bytes"] = avail
  label = f"{size} {dt} {row['layout']} V/n={k}"
  print(f"{label}: XLA buffers {mem}; ~{need / GIB:.2f} GiB,"
        f" {avail / GIB:.1f} GiB available", file=sys.stderr, flush=True)
  row["_compiled"] = compiled
  row["_cell"] = (size, dt, fsdp, k)
  return row


def measure(row, args, mesh):
  """Runs and times a prepared cell's programs."""
  compiled = row.pop("_compiled")
  size, dt, fsdp, k = row.pop("_cell")
  n = mesh.shape["data"]
  global_batch = row["global_batch"]
  abstract = jax.eval_shape(lambda: init(size, jax.random.key(0), dt))
  sh = shardings(abstract, mesh, fsdp)
  need = row["estimated_peak_bytes"]
  avail = mem_available()
  row["mem_available_bytes"] = avail
  if args.compile_only:
    row["skipped"] = "--compile-only"
    return row
  if 1.3 * need + GIB > avail:
    row["skipped"] = (f"needs ~{need / GIB:.1f} GiB ({n} devices x arguments +"
                      f" outputs + temp of the largest program) x 1.3 + 1 GiB,"
                      f" only {avail / GIB:.1f} GiB available")
    return row
  params = jax.jit(lambda: init(size, jax.random.key(0), dt),
                   out_shardings=sh)()
  batch = batch_for(size, mesh, dt, global_batch, args.seq)
  row["loadavg_before"] = os.getloadavg()
  outs = {}
  for name, c in compiled.items():  # warm up
    outs[name] = jax.block_until_ready(c(params, batch))
  # The methods compute the same gradient up to rounding.
  ref = outs.get("plain")
  if ref is not None:
    row["max_abs_diff_to_plain"] = {
        name: max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                        - b.astype(jnp.float32))))
                  for a, b in zip(jax.tree_util.tree_leaves(o),
                                  jax.tree_util.tree_leaves(ref)))
        for name, o in outs.items()}
  if args.check_bits and {"det", "det_scan", "det_unroll"} & set(outs):
    row["bitwise"] = check_bits(outs, params, batch, size, dt, fsdp,
                                row["virtual_workers"], args.rows)
    print(f"bitwise: {row['bitwise']}", file=sys.stderr, flush=True)
  del outs, ref
  kernel = {}
  times, cpu = time_interleaved(compiled, (params, batch), args.reps, kernel)
  row["loadavg_after"] = os.getloadavg()
  med = {name: statistics.median(t) for name, t in times.items()}
  row["seconds"] = med
  # The fastest call: the least disturbed by other jobs on a shared machine.
  row["min_seconds"] = {name: min(t) for name, t in times.items()}
  # The process's CPU time per call (user + system, every simulated
  # device's threads): the work done, less sensitive than the wall time to
  # other jobs taking the cores (not to their cache and memory traffic).
  row["cpu_seconds"] = {name: statistics.median(t) for name, t in cpu.items()}
  row["min_cpu_seconds"] = {name: min(t) for name, t in cpu.items()}
  # Of that, the kernel's share: system seconds and minor page faults per
  # call (XLA:CPU maps each call's temp buffer afresh, so every page of it
  # is faulted in and zeroed on every step; GLIBC_TUNABLES can change that).
  row["system_seconds"] = {name: statistics.median(t)
                           for name, t in kernel["system"].items()}
  row["minor_faults"] = {name: statistics.median(t)
                         for name, t in kernel["minor_faults"].items()}
  row["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
  if "plain" in med:
    row["ratio_to_plain"] = {name: t / med["plain"] for name, t in med.items()}
    row["min_ratio_to_plain"] = {
        name: min(t) / min(times["plain"]) for name, t in times.items()}
  # plain_acc does the deterministic step's per-worker work (k microbatches
  # of the virtual worker's rows per device, same compiler options) without
  # the fixed order: det / plain_acc is what the scheme costs beyond the
  # smaller matmuls.
  for base in ("plain_acc", "plain"):
    if base in med:
      row[f"ratio_to_{base}_by"] = {
          "median": {n: t / med[base] for n, t in med.items()},
          "min": {n: min(t) / min(times[base]) for n, t in times.items()},
          "cpu_median": {n: statistics.median(t)
                         / max(1e-9, statistics.median(cpu[base]))
                         for n, t in cpu.items()},
          "cpu_min": {n: min(t) / max(1e-9, min(cpu[base]))
                      for n, t in cpu.items()}}
  if "plain_acc" in med and "det" in med:
    row["det_over_plain_acc"] = med["det"] / med["plain_acc"]
    row["min_det_over_plain_acc"] = (row["min_seconds"]["det"]
                                     / row["min_seconds"]["plain_acc"])
  row["peak_rss_bytes"] = resource.getrusage(
      resource.RUSAGE_SELF).ru_maxrss * 1024
  row["_compiled"] = compiled
  row["_args"] = (params, batch)
  return row


def _bits(tree) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


_SINGLE: dict = {}


def check_bits(outs, params, batch, size, dt, fsdp, v, rows) -> dict:
  """``det``'s (loss, grads) against ``det_scan``'s, ``det_unroll``'s and the tree.

  Without ``det``, ``det_scan`` against ``det_unroll``; each of ``det``,
  ``det_scan``, ``det_unroll``, ``det_cond``, ``det_barrier`` run against
  the tree.

  The reference is what ``V`` devices with one worker each give: every
  worker's slice run alone (``value_and_grad`` with one worker on one
  device), the ``V`` results summed by :func:`determinism.tree_sum`, op by
  op (each node rounded to the dtype), and divided by ``V``.
  """
  res = {}
  for name in ("det_prev", "det_s12", "det_root_out", "det_a2a", "det_scan",
               "det_unroll", "det_cond", "det_barrier"):
    if name in outs and "det" in outs:
      res[f"det_equals_{name}"] = _bits(outs["det"]) == _bits(outs[name])
  if "det_scan" in outs and "det_unroll" in outs:
    res["det_scan_equals_det_unroll"] = (_bits(outs["det_scan"])
                                         == _bits(outs["det_unroll"]))
  one = Mesh(np.array(jax.devices()[:1]), ("data",))
  key = (size, str(dt), rows)
  if key not in _SINGLE:
    vg = det.value_and_grad(loss_fn, virtual_workers=1, mesh=one)
    _SINGLE[key] = det.jit(lambda p, b: vg(p, b))
  f1 = _SINGLE[key]
  rep = NamedSharding(one, P())
  p1 = jax.device_put(params, rep)
  per = [f1(p1, jax.device_put(jax.tree.map(
      lambda x: x[w * rows:(w + 1) * rows], batch), rep)) for w in range(v)]
  leaves = [jax.tree_util.tree_leaves(o) for o in per]
  ref = []
  with jax.disable_jit():
    for i in range(len(leaves[0])):
      total = det.tree_sum(jnp.stack([lv[i] for lv in leaves]))
      ref.append(total / jnp.asarray(v, total.dtype))
  want = [np.asarray(x).tobytes() for x in ref]
  for name in ("det", "det_scan", "det_unroll", "det_cond", "det_barrier"):
    if name in outs:
      got = jax.tree_util.tree_leaves(outs[name])
      res[f"{name}_equals_tree_of_single_workers"] = (
          [np.asarray(jax.device_get(x)).tobytes() for x in got] == want)
  del fsdp
  return res


# (substring of an XLA op name, kind), first match wins.
KINDS = (("all-to-all", "exchange (all-to-all)"),
         ("all_to_all", "exchange (all-to-all)"),
         ("all-gather", "all-gather"), ("all_gather", "all-gather"),
         ("all-reduce", "all-reduce"), ("reduce-scatter", "reduce-scatter"),
         ("collective-permute", "collective-permute"),
         ("ynn_fusion", "matmuls"), ("dot", "matmuls"),
         ("dynamic-update-slice", "dynamic-update-slice (stack, flatten)"),
         ("add", "adds (tree, accumulation)"),
         ("slice", "slices"), ("pad", "pads"),
         ("concatenate", "concatenates"),
         ("copy", "copies"), ("transpose", "transposes"),
         ("broadcast", "broadcasts (fills)"),
         ("fusion", "other fusions"))
# Events that are not XLA ops, or that contain others (a conditional's or a
# while loop's event spans its branch's or body's ops: counted there), or
# that an op contains (a transposing ``copy`` runs a ``TransposePlan``, whose
# nested "Transpose..." events were each counted again before the
# thirteenth session).
SKIP = ("ThunkExecutor", "Wait", "Rendezvous", "$", "Pjit", "Common", "[",
        "Invoke", "Slinky", "end:", "conditional", "while", "Handle",
        "Parse", "Allocate", "Python", "Transpose")


def profile(compiled, args, steps=3) -> dict:
  """XLA op time per step, summed over the devices, by kind (ms)."""
  out = {}
  for name, c in compiled.items():
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
      if name_.startswith(SKIP):
        continue
      kind = next((k for key, k in KINDS if key in name_),
                  "other (elementwise)")
      kinds[kind] += e.get("dur", 0) / steps / 1e3
    total = sum(kinds.values())
    out[name] = {"wall_ms_per_step": wall / steps / 1e3,
                 "op_ms_per_step_all_devices": dict(
                     sorted(kinds.items(), key=lambda kv: -kv[1])),
                 "op_ms_total": total,
                 "op_ms_not_matmul": total - kinds.get("matmuls", 0.0)}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="100m")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--layouts", default="dp,fsdp")
  ap.add_argument("--devices", type=int, default=2,
                  help="devices on the batch axis (of 8 simulated)")
  ap.add_argument("--ratios", default="1,2,4,8",
                  help="virtual workers per device, V/n")
  ap.add_argument("--rows", type=int, default=8,
                  help="sequences per virtual worker")
  ap.add_argument("--seq", type=int, default=1,
                  help="tokens per sequence (1: one row of d_model)")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--methods", default=",".join(METHODS),
                  help=f"a subset of {','.join(METHODS)}")
  ap.add_argument("--check-bits", action="store_true",
                  help="also check det bit for bit against det_scan,"
                       " det_unroll, det_cond, det_barrier and (det,"
                       " det_cond, det_barrier) against V single-worker"
                       " steps summed by tree_sum")
  ap.add_argument("--compile-only", action="store_true",
                  help="print XLA's buffer sizes and the memory estimate only")
  ap.add_argument("--profile", action="store_true",
                  help="also trace the programs of the cells whose V/n is in"
                       " --profile-ratios: XLA time by op")
  ap.add_argument("--profile-ratios", default="1",
                  help="V/n of the cells to profile (every size and layout)")
  ap.add_argument("--profile-steps", type=int, default=3,
                  help="steps traced per program")
  ap.add_argument("--profile-dtypes", default="",
                  help="dtypes of the cells to profile (default: all)")
  ap.add_argument("--lock", default="",
                  help="a file to flock while timing (after compiling)")
  ap.add_argument("--lock-compile", action="store_true",
                  help="also hold --lock while compiling each cell (released"
                       " between cells): compile times under the lock")
  ap.add_argument("--compile-reps", type=int, default=1,
                  help="compiles of each program per cell (interleaved,"
                       " fresh closures each time): compile_seconds medians")
  ap.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
      "bench_determinism_result.json")))
  args = ap.parse_args(argv)
  mesh = Mesh(np.array(jax.devices()[:args.devices]), ("data",))
  methods = tuple(m for m in METHODS if m in args.methods.split(","))
  load_before = os.getloadavg()
  rows, profiles = [], {}
  command = ("PYTHONPATH=. python3 benchmarks/bench_determinism.py "
             + " ".join(argv if argv is not None else sys.argv[1:]))

  def write(done):
    # After every cell, so that a run stopped early keeps what it measured.
    dev = jax.devices()[0]
    result = {"machine": (f"{os.cpu_count()} cores, {args.devices} simulated"
                          " CPU devices" if dev.platform == "cpu" else
                          f"{os.cpu_count()} cores, {args.devices} x"
                          f" {dev.device_kind}"),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "command": command, "complete": done,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "jax": jax.__version__, "rows": rows, "profiles": profiles}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))

  # V/n outermost (in the order given): a run stopped early has every
  # dtype and layout of the first ratios.
  cells = [(size, dtype, layout, int(k)) for k in args.ratios.split(",")
           for size in args.sizes.split(",") for dtype in args.dtypes.split(",")
           for layout in args.layouts.split(",")]
  # Every program is compiled first; only the timing holds --lock (the
  # machine's benchmark lock), so that compiling never waits for it.
  prepared = [prepare(size, jnp.dtype(dtype), layout == "fsdp", k, args, mesh,
                      methods) for size, dtype, layout, k in cells]
  lock = None
  if args.lock and not args.compile_only:
    import fcntl
    lock = open(args.lock, "a")
    t0 = time.perf_counter()
    fcntl.flock(lock, fcntl.LOCK_EX)
    print(f"waited {time.perf_counter() - t0:.0f} s for {args.lock}",
          file=sys.stderr, flush=True)
  for (size, dtype, layout, k), row in zip(cells, prepared):
    row = measure(row, args, mesh)
    compiled, bargs = row.pop("_compiled", None), row.pop("_args", None)
    if (args.profile and compiled is not None
        and str(k) in args.profile_ratios.split(",")
        and (not args.profile_dtypes or dtype in args.profile_dtypes.split(","))):
      cell = f"{size} {dtype} {layout} V/n={k}"
      profiles[cell] = profile(compiled, bargs, args.profile_steps)
      print(json.dumps({"profile": cell, **profiles[cell]}), flush=True)
    del compiled, bargs
    rows.append(row)
    print(json.dumps(row), flush=True)
    write(False)
  write(True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
