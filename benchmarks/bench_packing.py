"""Elastic packing and ArrayRecord reads against Grain's own (non-elastic) pieces.

Packing (one epoch of variable-length token sequences, all <= L, so neither
side splits or cuts): ``PackedIterator`` against Grain's
``FirstFitPackIterDataset`` (the baseline: same first-fit idea, ``K`` bins,
bins not shuffled, state per host stream, so not elastic), then batched to
``B`` rows, Grain reading without threads (its fastest setting here).
Reported: tokens/s (the epoch's tokens over the time; for one shard of 4, the
global stream it keeps pace with), rows, and the fill (real tokens / slots,
for one shard of 4 over its own rows).
``PackedIterator`` is also timed as one shard of 4 (it plans the whole global
batch, materialises a quarter) and with a content filter (``keep``, which
makes the plan read every sample).

Reads (random order, one epoch): ``DatasetReader`` over ArrayRecord files
against Grain's ``ArrayRecordDataSource`` over the same files (the baseline)
and against the ``.tpxr`` record format.

Cases are interleaved and repeated; the table shows medians and the ratio to
the baseline of the same run.

Usage: python benchmarks/bench_packing.py --out results/bench_packing.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tenplex_jax.data import (  # noqa: E402
    DatasetReader,
    PackedIterator,
    build_index,
    epoch_permutation,
    write_records,
)
from tenplex_jax.data.arrayrecord import write_array_record  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  import grain  # noqa: PLC0415 - the baseline

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/bench_packing.json")
  p.add_argument("--samples", type=int, default=8192)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--rows", type=int, default=32, help="rows per global batch B")
  p.add_argument("--bins", type=int, default=32, help="open rows K / Grain's packing bins")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  n, L, B, K = args.samples, args.seq_len, args.rows, args.bins
  rng = np.random.default_rng(0)
  lengths = rng.integers(8, L + 1, n)
  seqs = [rng.integers(1, 1000, k).astype(np.int32) for k in lengths]
  samples = [{"tokens": s} for s in seqs]
  total = int(lengths.sum())

  def grain_pack():
    # No read threads: on this machine Grain's default 16 threads make it ~3x slower.
    ds = grain.MapDataset.source(samples).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": L}, num_packing_bins=K, shuffle_bins=False)
    real = rows = 0
    for batch in ds.batch(B, drop_remainder=False):
      real += int((batch["tokens_segment_ids"] > 0).sum())
      rows += batch["tokens"].shape[0]
    return real, rows

  def ours(shard_count=1, keep=None):
    it = PackedIterator(samples, seq_len=L, rows_per_batch=B, seed=0, shuffle=False,
                        num_epochs=1, max_open_rows=K, shard_count=shard_count, keep=keep,
                        lengths=None if keep else lengths)
    real = rows = 0
    for batch in it:
      real += int(batch["mask"].sum())
      rows += batch["tokens"].shape[0]
    return real, rows

  workdir = tempfile.mkdtemp(prefix="tenplex_bench_packing_")
  ar_paths = []
  per = -(-n // 4)
  for k in range(4):
    path = os.path.join(workdir, f"t.array_record-{k:05d}-of-00004")
    write_array_record(path, (s.tobytes() for s in seqs[k * per:(k + 1) * per]))
    ar_paths.append(path)
  tpxr = os.path.join(workdir, "t.tpxr")
  write_records(tpxr, (s.tobytes() for s in seqs))
  ar_reader = DatasetReader(build_index(ar_paths))
  tpxr_reader = DatasetReader(build_index([tpxr]))
  grain_source = grain.sources.ArrayRecordDataSource(ar_paths)
  order = epoch_permutation(0, 0, n).tolist()

  def read_all(src):
    for i in order:
      src[i]

  cases = {
      "pack: Grain FirstFitPackIterDataset (baseline)": grain_pack,
      "pack: PackedIterator, 1 shard": ours,
      "pack: PackedIterator, 1 of 4 shards": lambda: ours(4),
      "pack: PackedIterator, 1 shard, keep= filter": lambda: ours(1, lambda s: True),
      "read: Grain ArrayRecordDataSource (baseline)": lambda: read_all(grain_source),
      "read: DatasetReader over ArrayRecord": lambda: read_all(ar_reader),
      "read: DatasetReader over .tpxr": lambda: read_all(tpxr_reader),
  }
  times: dict[str, list[float]] = {k: [] for k in cases}
  out: dict[str, object] = {}
  for _ in range(args.repeats):
    for name, fn in cases.items():  # interleaved
      t0 = time.perf_counter()
      got = fn()
      times[name].append(time.perf_counter() - t0)
      out[name] = got
  for name in ("pack: Grain FirstFitPackIterDataset (baseline)", "pack: PackedIterator, 1 shard",
               "pack: PackedIterator, 1 shard, keep= filter"):
    if out[name][0] != total:  # every token packed once, none cut
      raise SystemExit(f"{name}: packed {out[name][0]} real tokens, expected {total}")
  results = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    base = statistics.median(times[("pack: Grain FirstFitPackIterDataset (baseline)"
                                    if name.startswith("pack") else
                                    "read: Grain ArrayRecordDataSource (baseline)")])
    row = {"median_s": med, "vs_baseline": base / med}
    if name.startswith("pack"):
      real, rows = out[name]
      row.update(tokens_per_s=total / med, rows=rows, fill=real / (rows * L),
                 real_tokens=real)
    else:
      row.update(samples_per_s=n / med)
    results[name] = row
  ar_reader.close()
  tpxr_reader.close()

  load = os.getloadavg()
  print(f"{n} sequences of 8..{L} tokens ({total} tokens), L={L}, B={B}, K={K}; median of "
        f"{args.repeats}, interleaved; {os.cpu_count()} CPUs, load {load[0]:.1f}")
  w = max(len(k) for k in results)
  print(f"{'case':<{w}}  {'median s':>9}  {'throughput':>14}  {'x baseline':>10}  {'fill':>6}")
  for name, r in results.items():
    thr = (f"{r['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in r
           else f"{r['samples_per_s']:,.0f} smp/s")
    fill = f"{r['fill']:.3f}" if "fill" in r else ""
    print(f"{name:<{w}}  {r['median_s']:>9.3f}  {thr:>14}  {r['vs_baseline']:>9.2f}x  {fill:>6}")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"config": {"samples": n, "seq_len": L, "rows": B, "bins": K,
                          "repeats": args.repeats, "cpus": os.cpu_count(),
                          "loadavg": load, "python": platform.python_version(),
                          "grain": grain.__version__ if hasattr(grain, "__version__") else None},
               "results": results}, f, indent=1)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
