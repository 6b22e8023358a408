"""Probe: where a warm generic reshard's peak RSS rise goes, against
``jax.device_put``'s (issue 26, item 4).

Each (case, method, setting) runs in a fresh process (8 CPU devices,
``NPROC`` 16 as in ``bench_generic.py``, whose cases it uses): a cold call,
then ``--calls`` warm calls, each on a fresh copy of the source with the
previous result dropped and the C heap trimmed first (``malloc_trim(0)``,
as ``bench_generic.py --trim-first``). Per warm call it records

* the peak RSS rise (``VmHWM`` reset through ``/proc/self/clear_refs``
  after the trim, less the RSS then) and the call's wall seconds;
* at the end of the call, with the result alive: the RSS added to the
  process's main heap (``[heap]``: glibc's main arena, which serves the
  calling thread), to the per-thread malloc arenas (64 MiB-aligned
  anonymous mappings: what XLA's device threads allocate in) and to other
  mappings, from ``/proc/self/smaps``; and the bytes of device buffers
  alive then that were not alive before the call (the results);
* with ``--stages`` (generic only; each transfer blocked on, so its time is
  not the call's): RSS and new buffer bytes before and after every batch
  of transfers.

Settings (generic only, ablations, none of them the library's behaviour):
``--runs-of N`` packs N arrays per packed buffer on CPU instead of
``_CONCAT_FUSE_CPU``; ``--trim-stages`` waits for every buffer and trims
the heap before each batch of transfers (so memory freed by the previous
stage is given back, not left resident).

For ``generic`` it also prints each group program's XLA temporaries
(``memory_analysis().temp_size_in_bytes``, per device).

Run: ``flock /work/.bench.lock python benchmarks/probe_generic_peak.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(ROOT, "tests")):
  if p not in sys.path:
    sys.path.insert(0, p)


def _rss_by_kind() -> dict:
  """Resident KiB by mapping kind: main heap, malloc arenas, other."""
  out = {"heap": 0, "arenas": 0, "other": 0}
  kind = None
  with open("/proc/self/smaps") as f:
    for line in f:
      parts = line.split()
      if parts[0].endswith(":"):
        if parts[0] == "Rss:" and kind is not None:
          out[kind] += int(parts[1])
        continue
      lo, hi = (int(v, 16) for v in parts[0].split("-"))
      name = parts[5] if len(parts) > 5 else ""
      kind = ("heap" if name == "[heap]" else
              "arenas" if not name and lo % (64 << 20) == 0
              and hi - lo <= 64 << 20 else "other")
  return out


def _buffers(jax) -> dict:
  """``{buffer address: bytes}`` of every live device buffer."""
  out = {}
  for a in jax.live_arrays():
    for s in a.addressable_shards:
      try:
        out[s.data.unsafe_buffer_pointer()] = s.data.nbytes
      except Exception:  # deleted or not addressable
        pass
  return out


def worker(case: str, method: str, calls: int, runs_of: int, trim: bool,
           stages: bool) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  import importlib
  import tenplex_jax as tj
  import bench_generic as B
  from bench_transitions import _fresh_copy
  R = importlib.import_module("tenplex_jax.reshard")
  libc = ctypes.CDLL(None)
  if runs_of:
    R._CONCAT_FUSE_CPU = runs_of
  state, target = B._case(jax, case)
  jax.block_until_ready(state)
  call = ((lambda s: tj.reshard(s, target, method="generic"))
          if method == "generic" else (lambda s: jax.device_put(s, target)))
  marks: list = []
  ref: dict = {}

  def mark(label):
    if "bufs" not in ref:  # the cold call
      return
    new = sum(n for p, n in _buffers(jax).items() if p not in ref["bufs"])
    marks.append((label, round(B._status_kib("VmRSS") / 1024 - ref["rss"], 1),
                  round(new / 2**20, 1)))
  send = R._send

  def hooked(arrays, devices):
    if trim or stages:
      jax.block_until_ready(list(jax.live_arrays()))
    if trim:
      libc.malloc_trim(0)
    if stages:
      mark("before transfers")
    out = send(arrays, devices)
    if stages:
      jax.block_until_ready(out)
      mark("after transfers")
    return out
  R._send = hooked
  jax.block_until_ready(call(_fresh_copy(jax, state)))  # cold
  temps = []
  if method == "generic":
    for cut, glues, _ in R._GROUP_EXES.values():
      for name, exe in [("cut", cut)] + [("glue", g) for g in glues]:
        m = exe.memory_analysis()
        temps.append((name, m.output_size_in_bytes, m.temp_size_in_bytes))
  rows = []
  for _ in range(calls):
    fresh = _fresh_copy(jax, state)
    jax.block_until_ready(fresh)
    ref["bufs"] = _buffers(jax)
    libc.malloc_trim(0)
    by0 = _rss_by_kind()
    base = B._peak_reset()
    ref["rss"] = base / 2**20
    marks.clear()
    t0 = time.perf_counter()
    res = jax.block_until_ready(call(fresh))
    dt = time.perf_counter() - t0
    rise = B._peak_rise(base)
    by1 = _rss_by_kind()
    new = sum(n for p, n in _buffers(jax).items() if p not in ref["bufs"])
    rows.append({"seconds": dt, "peak_rss_rise_mib": rise / 2**20,
                 "end_rss_mib": {k: (by1[k] - by0[k]) / 1024 for k in by1},
                 "new_buffer_mib": new / 2**20, "stages": list(marks)})
    del fresh, res
  return {"case": case, "method": method, "runs_of": runs_of,
          "trim_stages": trim, "program_temps": temps, "calls": rows}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="pieces,lm1b")
  ap.add_argument("--calls", type=int, default=6)
  ap.add_argument("--settings", default="device_put,generic,generic:trim,"
                  "generic:runs1:trim",
                  help="comma-separated method[:trim][:runsN][:stages]")
  ap.add_argument("--rounds", type=int, default=1,
                  help="repeat the settings in turn, alternating")
  ap.add_argument("--out", default=None)
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    case, setting = args.worker.split("/")
    parts = setting.split(":")
    runs = next((int(p[4:]) for p in parts if p.startswith("runs")), 0)
    print(json.dumps(worker(case, parts[0], args.calls, runs,
                            "trim" in parts, "stages" in parts)))
    return 0
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"]
                              if env.get("PYTHONPATH") else "")
  env["NPROC"] = str(max(16, int(env.get("NPROC", "0") or 0)))
  results = []
  for _ in range(args.rounds):
    for case in args.cases.split(","):
      for setting in args.settings.split(","):
        p = subprocess.run([sys.executable, os.path.abspath(__file__),
                            "--calls", str(args.calls), "--worker",
                            f"{case}/{setting}"], env=env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
          print(case, setting, "failed:", p.stderr.strip().splitlines()[-1:])
          continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["setting"] = setting
        results.append(r)
        c = r["calls"]
        print(f"{case:7s} {setting:22s} rise MiB "
              + " ".join(f"{x['peak_rss_rise_mib']:.1f}" for x in c)
              + " | end heap/arenas/other MiB "
              + " ".join("{heap:.0f}/{arenas:.0f}/{other:.0f}".format(
                  **x["end_rss_mib"]) for x in c)
              + f" | new buffers {c[-1]['new_buffer_mib']:.1f} MiB | ms "
              + " ".join(f"{x['seconds'] * 1e3:.0f}" for x in c), flush=True)
        t = [x for x in r["program_temps"] if x[2]]
        if t:
          print("   programs with temporaries (name, out B, temp B per"
                " device):", t)
        for label, rss, new in c[-1]["stages"]:
          print(f"   {label:17s} RSS {rss:6.1f} MiB  new buffers {new:6.1f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"load": os.getloadavg(), "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
