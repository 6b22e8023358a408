"""Warm reshards: five consecutive calls in one process, side by side with
``jax.device_put``, the previous result kept alive or dropped, the source
the same arrays every call or a fresh copy of them.

A job that reshards its state more than once (a resize, then another) holds
the previous result while the next call runs, or drops it first. Each (state,
method, previous result) runs in a fresh process on 12 simulated CPU
devices; every call moves the same source state to the same targets, and
its wall time is recorded (call 1 is cold: compilation, first touch).

Sources (``--sources``):

* ``same``: every call moves the same source arrays. ``jax.device_put``
  keeps the host copy it gathers of an array (``Array._npy_value``) for as
  long as the array lives, so its calls after the first hand out views of
  that copy and copy nothing (a cache hit; its page faults and CPU seconds
  show it). ``tj.reshard`` adopts the buffers of its previous result of the
  same arrays while that result lives (``alive``), and copies again once it
  was dropped (it keeps no second copy of the state);
* ``fresh``: before each call (outside the timed region) the source is
  replaced by a fresh copy of itself, as a training step replaces a job's
  state between two reshards: nothing is cached for any method.

States:

* ``mixed``: 512 MiB: 8 arrays of (2048, 4096) f32, 64 of (1024, 1024) f32
  and 64 small (256,) f32; ``P(None, "b")`` on a 2 x 4 mesh of devices 0-7
  -> ``P("a", None)`` on a 4-device mesh of the 4 other devices (8-11).
* ``small-shards``: a Gemma-sized nnx state (105 arrays, 34 MiB, new shards
  of 64-128 KiB): fsdp=4 x tensor=2 on devices 0-7 -> fsdp=2 x tensor=2 on
  devices 0-3, kernels ``P("fsdp", "tensor")``, vectors ``P("tensor")``.

``--baseline-src DIR`` adds a ``reshard (before)`` method: ``tj.reshard``
from the ``tenplex_jax`` in DIR (e.g. ``git archive <commit> tenplex_jax |
tar -x -C DIR``), in the same run.

  python benchmarks/bench_warm.py [--calls 5] [--rounds 3]
      [--sources same fresh] [--baseline-src DIR]
      [--out benchmarks/bench_warm_result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STATES = ("mixed", "small-shards")
METHODS = ("reshard", "device_put")
KEEPS = ("alive", "dropped")
SOURCES = ("same", "fresh")


def _fresh_copy(jax, tree):
  """A copy of every array (same shardings), made without compiling."""
  def cp(x):
    shards = [jax.device_put(s.data, s.device, may_alias=False)
              for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding,
                                                    shards)
  return jax.tree.map(cp, tree)


def _state(name: str):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = np.array(jax.devices())
  rng = np.random.default_rng(0)
  if name == "mixed":
    src = Mesh(devs[:8].reshape(2, 4), ("a", "b"))
    dst = Mesh(devs[8:12].reshape(4), ("a",))
    shapes = ([(2048, 4096)] * 8 + [(1024, 1024)] * 64 + [(256,)] * 64)
    tree, targets = {}, {}
    for k, shape in enumerate(shapes):
      x = rng.standard_normal(shape, dtype=np.float32)
      spec_in = P(None, "b") if len(shape) == 2 else P("b")
      spec_out = P("a", None) if len(shape) == 2 else P("a")
      tree[f"t{k}"] = jax.device_put(x, NamedSharding(src, spec_in))
      targets[f"t{k}"] = NamedSharding(dst, spec_out)
    return tree, targets
  # small-shards: 15 layers of 7 arrays (qkv, o, up, down kernels; 3
  # vectors), float32; 34 MiB.
  src = Mesh(devs[:8].reshape(4, 2), ("fsdp", "tensor"))
  dst = Mesh(devs[:4].reshape(2, 2), ("fsdp", "tensor"))
  shapes = [((256, 512), 2), ((512, 256), 2), ((256, 512), 2),
            ((512, 256), 2), ((256,), 1), ((512,), 1), ((256,), 1)]
  tree, targets = {}, {}
  for layer in range(15):
    for k, (shape, nd) in enumerate(shapes):
      x = rng.standard_normal(shape, dtype=np.float32)
      spec = P("fsdp", "tensor") if nd == 2 else P("tensor")
      tree[f"l{layer}/{k}"] = jax.device_put(x, NamedSharding(src, spec))
      targets[f"l{layer}/{k}"] = NamedSharding(dst, spec)
  return tree, targets


def _minor_faults() -> int:
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(state: str, method: str, keep: str, source: str,
           calls: int) -> dict:
  os.environ.setdefault("XLA_FLAGS", "")
  import jax
  jax.config.update("jax_num_cpu_devices", 12)
  jax.config.update("jax_platforms", "cpu")
  import numpy as np
  if "TENPLEX_BENCH_BASELINE" not in os.environ:
    sys.path.insert(0, ROOT)
  import tenplex_jax as tj
  tree, targets = _state(state)
  jax.block_until_ready(tree)
  # The process's first full cycle collection walks every object jax's
  # import made (0.18 s here); it comes once, wherever the allocation count
  # lands (a job has had it long before it reshards). Have it before timing,
  # for every method alike.
  import gc
  gc.collect()
  paths = []

  def fn(t):
    if method == "device_put":
      return jax.device_put(t, targets)
    new, rep = tj.reshard_with_report(t, targets)
    paths.append(rep.method)
    return new
  times, faults, cpu, out = [], [], [], None
  src = tree
  for _ in range(calls):
    if keep == "dropped":
      out = None
    if source == "fresh":
      src = None  # the old state goes, as a training step replaces it
      src = jax.block_until_ready(_fresh_copy(jax, tree))
    f0 = _minor_faults()
    c0 = time.process_time()
    t0 = time.perf_counter()
    new = jax.block_until_ready(fn(src))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    faults.append(_minor_faults() - f0)
    out = new  # the previous result lives until here ("alive")
    del new
  ok = all(np.array_equal(np.asarray(out[k]), np.asarray(tree[k]))
           and out[k].sharding == targets[k] for k in list(tree)[:: 17])
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
  return {"state": state, "method": method, "previous": keep,
          "source": source, "seconds": times, "cpu_seconds": cpu,
          "minor_faults": faults, "values_ok": ok, "paths": paths,
          "state_mib": nbytes / 2**20, "leaves": len(tree),
          "tenplex_jax": tj.__file__}


def _median(xs):
  xs = sorted(xs)
  return xs[(len(xs) - 1) // 2]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--rounds", type=int, default=3,
                  help="fresh processes per (state, method, previous)")
  ap.add_argument("--states", nargs="*", default=list(STATES))
  ap.add_argument("--sources", nargs="*", default=list(SOURCES))
  ap.add_argument("--out", default="benchmarks/bench_warm_result.json")
  ap.add_argument("--baseline-src", default=None)
  ap.add_argument("--worker", nargs=4,
                  metavar=("STATE", "METHOD", "KEEP", "SOURCE"))
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(worker(*args.worker, args.calls)))
    return
  methods = METHODS + (("reshard (before)",) if args.baseline_src else ())
  cases = [(state, source, keep) for state in args.states
           for source in args.sources for keep in KEEPS]
  runs = []
  for rnd in range(args.rounds):
    for state, source, keep in cases:
      for method in (methods if rnd % 2 == 0 else methods[::-1]):
        env = dict(os.environ)
        if method == "reshard (before)":
          env.update(PYTHONPATH=args.baseline_src, TENPLEX_BENCH_BASELINE="1")
        out = subprocess.run(
            [sys.executable, "-P", __file__, "--calls", str(args.calls),
             "--worker", state, method, keep, source],
            capture_output=True, text=True, check=True, env=env)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if method == "reshard (before)":
          assert runs[-1]["tenplex_jax"].startswith(args.baseline_src)
  rows = []
  print(f"{'state':>12} {'source':>6} {'previous':>8} {'method':>16}"
        f"  per-call seconds (median of {args.rounds} processes)"
        "   CPU seconds/call   minor faults/call")
  for state, source, keep in cases:
    for method in methods:
      rs = [r for r in runs if (r["state"], r["source"], r["method"],
                                r["previous"]) == (state, source, method, keep)]
      med = [_median(r["seconds"][c] for r in rs) for c in range(args.calls)]
      cpu = [_median(r["cpu_seconds"][c] for r in rs)
             for c in range(args.calls)]
      flt = [_median(r["minor_faults"][c] for r in rs)
             for c in range(args.calls)]
      rows.append({"state": state, "source": source, "previous": keep,
                   "method": method, "median_seconds": med,
                   "median_cpu_seconds": cpu, "median_minor_faults": flt,
                   "all_seconds": [r["seconds"] for r in rs],
                   "paths": sorted({p for r in rs for p in r["paths"]}),
                   "values_ok": all(r["values_ok"] for r in rs)})
      print(f"{state:>12} {source:>6} {keep:>8} {method:>16}  "
            + " ".join(f"{t:6.3f}" for t in med) + "   "
            + " ".join(f"{t:5.3f}" for t in cpu) + "   "
            + " ".join(f"{f:6d}" for f in flt))
  checks = {}
  for state, source, keep in cases:
    rs, dp = (next(r for r in rows if (r["state"], r["source"],
                                       r["previous"], r["method"])
                   == (state, source, keep, m)) for m in METHODS)
    warm = rs["median_seconds"][1:]
    dp_warm = _median(dp["median_seconds"][1:])
    per_call = [a / b for a, b in zip(rs["median_seconds"],
                                      dp["median_seconds"])]
    checks[f"{state}/{source}/{keep}"] = {
        "reshard_over_device_put_per_call": per_call,
        "worst_warm_call_over_device_put_same_call": max(per_call[1:]),
        "worst_warm_s": max(warm), "cold_s": rs["median_seconds"][0],
        "device_put_warm_s": min(dp["median_seconds"][1:]),
        "device_put_warm_median_s": dp_warm,
        "warm_never_slower_than_cold": max(warm) <= rs["median_seconds"][0],
        "worst_warm_over_device_put_warm_median": max(warm) / dp_warm,
        "median_warm_over_device_put_warm_median": _median(warm) / dp_warm,
        "warm_cpu_s": rs["median_cpu_seconds"][1:],
        "device_put_warm_cpu_s": dp["median_cpu_seconds"][1:],
        "paths": rs["paths"]}
  for k, v in checks.items():
    print(f"{k:>26}: worst warm {v['worst_warm_s']:.3f} s, cold"
          f" {v['cold_s']:.3f} s, device_put warm median"
          f" {v['device_put_warm_median_s']:.3f} s; reshard / device_put"
          " per call: "
          + " ".join(f"{r:.2f}" for r in
                     v["reshard_over_device_put_per_call"])
          + f"; path {','.join(v['paths'])}")
  with open("/proc/loadavg") as f:
    load = f.read().split()[:3]
  with open(args.out, "w") as f:
    json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores,"
               f" load average at end {load}", "rounds": args.rounds,
               "rows": rows, "checks": checks}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
