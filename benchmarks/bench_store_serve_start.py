"""Start of a store server: ``python -m tenplex_jax store serve`` to its
ready file, what the launcher pays per host of every multi-process job.

Each round starts one server from each source tree in turn (``--tree
NAME=PATH``, run with ``PYTHONPATH=PATH`` in a new directory; default: this
checkout), on an empty store directory, port 0, and records

* ``wall_s``: from ``Popen`` to the ready file (polled every 2 ms);
* ``cpu_s``: the server's user + system CPU until then (``/proc/PID/stat``,
  read as the ready file appears);
* ``jax``: whether the process imported jax (``/proc/PID/maps`` maps
  jaxlib's extension);

then stops it (SIGTERM to its group, SIGKILL after 10 s). A first round,
not recorded, writes the trees' bytecode caches. Medians per tree. Hold the bench lock: ``flock /work/.bench.lock python3 ...``.

Usage: python benchmarks/bench_store_serve_start.py --tree main=/tmp/main \\
  --tree branch=. --reps 7 --out benchmarks/bench_store_serve_start_result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tenplex_jax.runtime.launch import _stop_servers  # noqa: E402
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _maps_jaxlib(pid: int) -> bool:
  with open(f"/proc/{pid}/maps") as f:
    return "jaxlib" in f.read()


def start_once(tree: str, work: str, timeout: float = 120.0) -> dict:
  """Starts a server from ``tree`` on a new directory under ``work``."""
  d = tempfile.mkdtemp(dir=work)
  ready = os.path.join(d, "ready")
  env = {k: v for k, v in os.environ.items()
         if k not in ("TENPLEX_JAX_STORE_TOKEN", "TENPLEX_JAX_STORE_CA")}
  env["PYTHONPATH"] = os.path.abspath(tree)
  t0 = time.perf_counter()
  p = subprocess.Popen(
      [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
       os.path.join(d, "store"), "--port", "0", "--ready-file", ready],
      env=env, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True)  # cwd: ``-m`` puts it first on sys.path
  try:
    while not os.path.exists(ready):
      if p.poll() is not None:
        raise RuntimeError(f"{tree}: the server exited ({p.returncode})")
      if time.perf_counter() - t0 > timeout:
        raise RuntimeError(f"{tree}: no ready file after {timeout} s")
      time.sleep(0.002)
    wall = time.perf_counter() - t0
    cpu = _cpu_s(p.pid)
    jax = _maps_jaxlib(p.pid)
  finally:
    _stop_servers([p])  # the launcher's stop: SIGTERM, SIGKILL, reap
    shutil.rmtree(d, ignore_errors=True)
  return {"wall_s": wall, "cpu_s": cpu, "jax": jax}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tree", action="append", default=[],
                  help="NAME=PATH of a source tree (repeatable)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  trees = dict(t.split("=", 1) for t in args.tree) or {"this": ROOT}
  runs = {name: [] for name in trees}
  work = tempfile.mkdtemp(prefix="tenplex-serve-start-")
  try:
    for name, tree in trees.items():
      start_once(tree, work)  # bytecode caches
    for _ in range(args.reps):
      for name, tree in trees.items():
        runs[name].append(start_once(tree, work))
  finally:
    shutil.rmtree(work, ignore_errors=True)
  out = {
      "machine": f"{platform.node()} {os.cpu_count()} CPUs",
      "python": sys.version.split()[0],
      "trees": trees,
      "reps": args.reps,
      "runs": runs,
      "median": {name: {
          "wall_s": round(statistics.median(r["wall_s"] for r in rs), 3),
          "cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 3),
          "jax": sorted({r["jax"] for r in rs})} for name, rs in runs.items()},
  }
  print(json.dumps(out["median"], indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
