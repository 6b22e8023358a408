"""Index reads and ElasticIterator throughput against a plain numpy memmap loop.

All rows read the same shuffled epoch order of the same ``.npy`` file:

* ``memmap loop``: ``np.load(mmap_mode="r")`` and ``mm[ids]`` per global batch
  (the baseline: one process, no sharding, no state, no prefetch);
* ``index read_bytes`` / ``index reader[i]``: one ranged ``os.pread`` per
  sample through the byte-range index (raw bytes / decoded rows);
* ``ElasticIterator(...)``: batches as dicts with ids and mask, with and
  without the prefetch thread and parallel reads, over the index reader and
  over the memmap itself;
* ``+ compute``: each batch followed by a simulated train step (sleep), where
  prefetching overlaps reading with the step.

Usage: python benchmarks/bench_data.py --out results/bench_data.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tenplex_jax.data import (  # noqa: E402
    DatasetReader,
    ElasticIterator,
    build_index,
    epoch_permutation,
    save_index,
)


def _timed(fn, samples: int, repeats: int) -> dict:
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return {"seconds": best, "samples_per_s": samples / best}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/bench_data.json")
  p.add_argument("--samples", type=int, default=32768)
  p.add_argument("--row-bytes", type=int, default=1024)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--compute-ms", type=float, default=5.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--workdir", default=None)
  args = p.parse_args(argv)

  workdir = args.workdir or tempfile.mkdtemp(prefix="tenplex_bench_data_")
  n, b = args.samples, args.batch
  width = args.row_bytes // 4
  path = os.path.join(workdir, "x.npy")
  np.save(path, np.random.default_rng(0).normal(size=(n, width)).astype(np.float32))
  order = epoch_permutation(0, 0, n)
  steps = -(-n // b)
  results: dict[str, dict] = {}

  t0 = time.perf_counter()
  index = build_index([path])
  save_index(index, os.path.join(workdir, "idx"))
  results["index build + save"] = {"seconds": time.perf_counter() - t0,
                                   "samples_per_s": n / (time.perf_counter() - t0)}
  mm = np.load(path, mmap_mode="r")

  def memmap_loop(compute=0.0):
    for t in range(steps):
      batch = np.asarray(mm[order[t * b:(t + 1) * b]])
      assert batch.shape[1] == width
      if compute:
        time.sleep(compute)

  reader = DatasetReader(os.path.join(workdir, "idx"))

  def index_bytes():
    for i in order:
      reader.read_bytes(int(i))

  def index_rows():
    for i in order:
      reader[int(i)]

  def iterate(source, compute=0.0, **kw):
    with ElasticIterator(source, global_batch_size=b, seed=0, num_epochs=1, **kw) as it:
      for batch in it:
        assert batch["data"].shape[1] == width
        if compute:
          time.sleep(compute)

  r = args.repeats
  results["memmap loop (baseline)"] = _timed(memmap_loop, n, r)
  results["index read_bytes (pread)"] = _timed(index_bytes, n, r)
  results["index reader[i] (decoded)"] = _timed(index_rows, n, r)
  results["ElasticIterator(reader, prefetch=0)"] = _timed(
      lambda: iterate(reader, prefetch=0), n, r)
  results["ElasticIterator(reader, prefetch=4)"] = _timed(
      lambda: iterate(reader, prefetch=4), n, r)
  results["ElasticIterator(reader, prefetch=4, read_threads=2)"] = _timed(
      lambda: iterate(reader, prefetch=4, read_threads=2), n, r)
  results["ElasticIterator(memmap, prefetch=4)"] = _timed(
      lambda: iterate(mm, prefetch=4), n, r)
  c = args.compute_ms / 1000
  results[f"memmap loop + {args.compute_ms:g} ms compute/step"] = _timed(
      lambda: memmap_loop(c), n, 1)
  results[f"ElasticIterator(reader, prefetch=0) + {args.compute_ms:g} ms compute/step"] = (
      _timed(lambda: iterate(reader, c, prefetch=0), n, 1))
  results[f"ElasticIterator(reader, prefetch=4) + {args.compute_ms:g} ms compute/step"] = (
      _timed(lambda: iterate(reader, c, prefetch=4), n, 1))
  reader.close()

  base = results["memmap loop (baseline)"]["samples_per_s"]
  name_w = max(len(k) for k in results)
  print(f"{n} samples x {args.row_bytes} B, global batch {b}, {steps} steps, best of {r}; "
        f"{os.cpu_count()} CPUs")
  print(f"{'case':<{name_w}}  {'samples/s':>12}  {'seconds':>8}  {'vs memmap':>9}")
  for k, v in results.items():
    ratio = v["samples_per_s"] / base
    print(f"{k:<{name_w}}  {v['samples_per_s']:>12,.0f}  {v['seconds']:>8.3f}  {ratio:>8.2f}x")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"config": {"samples": n, "row_bytes": args.row_bytes, "batch": b,
                          "compute_ms": args.compute_ms, "repeats": r,
                          "cpus": os.cpu_count(), "python": platform.python_version(),
                          "numpy": np.__version__},
               "results": results}, f, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
