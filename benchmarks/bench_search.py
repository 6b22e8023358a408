"""Benchmark: wall time of the configuration search (no refinement).

Prints a table and, with ``--out``, writes JSON. Example:

  python benchmarks/bench_search.py --out /tmp/bench_search.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from tenplex_jax.search import search
import importlib

search_mod = importlib.import_module("tenplex_jax.search.search")

CASES = [
    # (model, hardware, devices, devices_per_host, global_batch, seq_len)
    ("gpt3-2.7b", "a6000", 16, 4, 128, 1024),
    ("gpt3-6.7b", "a100-80g", 64, 8, 512, 2048),
    ("gpt3-6.7b", "h100", 256, 8, 1024, 2048),
    ("gpt3-6.7b", "h100", 1024, 8, 2048, 2048),
    ("gpt3-6.7b", "tpu-v4", 1024, 4, 2048, 2048),
    ("gpt3-1.3b", "h100", 1024, 8, 4096, 1024),
]


def bench(case, repeats: int) -> dict:
  model, hw, n, dph, batch, seq = case
  times = []
  for _ in range(repeats):
    search_mod._link.cache_clear()  # price links afresh each run
    t0 = time.perf_counter()
    res = search(model, hw, devices=n, devices_per_host=dph, global_batch=batch,
                 seq_len=seq)
    times.append(time.perf_counter() - t0)
  return {
      "model": model, "hardware": hw, "devices": n, "devices_per_host": dph,
      "global_batch": batch, "seq_len": seq,
      "candidates_priced": len(res.candidates) + sum(
          1 for r in res.rejected if r.reason == "memory"),
      "feasible": len(res.candidates), "rejected": len(res.rejected),
      "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
      "best": None if not res.candidates else res.best.to_json() | {"rules": None,
                                                                    "breakdown": None},
  }


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = [bench(c, args.repeats) for c in CASES]
  print(f"{'model':10} {'hw':9} {'devices':>7} {'priced':>7} {'feasible':>8}"
        f" {'median ms':>9} {'max ms':>7}  best (d,f,t,p,m,remat)")
  for r in rows:
    b = r["best"]
    best = "-" if b is None else (b["data"], b["fsdp"], b["tensor"], b["pipeline"],
                                  b["microbatches"], b["remat"])
    print(f"{r['model']:10} {r['hardware']:9} {r['devices']:7d} {r['candidates_priced']:7d}"
          f" {r['feasible']:8d} {r['median_ms']:9.1f} {r['max_ms']:7.1f}  {best}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"machine": {"platform": platform.platform(),
                             "processor": platform.processor(),
                             "python": platform.python_version(),
                             "numpy": np.__version__},
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
