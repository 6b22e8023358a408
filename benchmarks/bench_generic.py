"""Benchmark: the generic executor (the path GPUs and TPUs take) on CPU devices.

Counts XLA compilations (jax's ``/jax/core/compile/backend_compile_duration``
monitoring events) and times ``reshard(..., method="generic")`` against
``jax.device_put`` on the same transitions, each (case, method) in a fresh
process, cold (first call) and warm (the same transition five times in a
row, each on a fresh copy of the source, the previous result dropped; then
five more with the previous call's result alive while the next runs, as a
job holding its state; every call's wall and CPU time, peak RSS rise and,
minor page faults kept, medians reported):

* ``lm1b``: flax's lm1b train state (``SMALL``, 51 MiB, 125 leaves) from
  ``(data, fsdp, tensor) = (1, 8, 1)`` to ``(1, 2, 4)`` over the devices in
  reverse order (every leaf moves).
* ``pieces``: 32 float32 arrays of 256 x (256 + 8 i), rows over 8 devices ->
  columns over the 8 devices reversed (8 pieces per new shard, 2,048 pieces).

Cold calls also record their CPU seconds and XLA compile seconds (the
events' durations summed; compiles may overlap). Every call records its
peak RSS rise: the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the call) less its RSS just before
the call, also as a multiple of the state's bytes (each method's result is
a second copy of the state in host memory, so about 1x is the least). The compile-time budget
checked per case: the generic path's compile seconds at most
``device_put``'s whole cold call, with its cold call no slower and its warm
call within 1.2x of ``device_put``'s; and, call by call in both warm
series, no warm call slower than the cold call nor than ``device_put``'s
warm call of the same index.

Every worker runs with ``NPROC`` (the CPU client's thread-pool size) at
least 16: at its default, max(cores, devices) = 8 threads on this 2-core VM,
``jax.device_put``'s lm1b call (all-to-all programs over groups of 4
devices) sometimes left one participant of a collective without a thread
and XLA aborted the process after 40 s (3 of 3 runs under load; 0 of 3 with
16 threads). Both methods get the same pool.

``--trim-first`` calls glibc's ``malloc_trim(0)`` in every worker just
before each call's RSS baseline (see ``_peak_reset``), for every method.

``--alternate N`` adds, per case, one process timing N rounds of warm calls
that alternate the two methods call by call (see ``worker_alternate``).

``--baseline-src DIR`` adds a ``generic (before)`` row per case: the same
worker importing ``tenplex_jax`` from ``DIR`` (e.g. ``git archive main
tenplex_jax | tar -x -C DIR``), so before and after come from one run.

``--held-out SEED:N`` adds the first N transitions of
``benchmarks/random_transitions.py``'s seed SEED as cases (``heldout:SEED:I``;
targets on subsets and other devices, column and 2-D layouts, mixed sizes)
and prints the median and worst ratios over them. ``--compile-cold`` adds a
``generic (compile)`` row per case: ``TENPLEX_JAX_GENERIC_COLD=compile``,
the cold call compiling its programs (the executor before its host tier).
Every method's cold result is checked bit for bit and on its target.

Run: ``python benchmarks/bench_generic.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
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

EVENT = "/jax/core/compile/backend_compile_duration"
WARM_CALLS = 5
PAUSE = 2.0  # seconds between the calls of the paused warm series


def _case(jax, name):
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = jax.devices()
  if name.startswith("heldout:"):  # heldout:SEED:INDEX
    from bench_transitions import _random_case  # the same states as there
    _, seed, idx = name.split(":")
    tree, target, _, _ = _random_case(jax, int(seed), int(idx))
    return tree, target
  if name == "pieces":
    a = Mesh(np.array(devs), ("x",))
    b = Mesh(np.array(devs[::-1]), ("x",))
    tree = {f"w{i:02d}": jax.device_put(
        np.arange(256 * (256 + 8 * i), dtype=np.float32).reshape(256, -1),
        NamedSharding(a, P("x"))) for i in range(32)}
    return tree, {k: NamedSharding(b, P(None, "x")) for k in tree}
  import flax.linen as nn
  from fixtures import lm1b_state as L
  state, _ = L.make_state(L.make_mesh((1, 8, 1)), L.SMALL)
  abstract, _ = L.abstract_state(L.SMALL)
  sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract),
                                   L.make_mesh((1, 2, 4), devs[::-1]),
                                   L.LM1B_RULES)
  return state, jax.tree.unflatten(jax.tree.structure(state),
                                   jax.tree.leaves(sh))


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def _peak_reset() -> int:
  """Resets the process's peak RSS to its RSS now; returns that RSS.

  With ``--trim-first`` (every method's workers alike) the C heap's free
  pages go back to the kernel first (glibc ``malloc_trim(0)``), so memory
  the process freed before the call (building the state) is not resident
  at the reset and cannot be reused: the rise is then the call's own
  footprint, which the generic executor's trim after compiling cannot lower
  by giving back memory freed before the call."""
  if os.environ.get("TENPLEX_BENCH_TRIM_FIRST"):
    import ctypes
    ctypes.CDLL(None).malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return _status_kib("VmRSS") << 10


def _peak_rise(base: int) -> int:
  return (_status_kib("VmHWM") << 10) - base


def worker(case: str, method: str) -> dict:
  src = os.environ.get("TENPLEX_BENCH_SRC")
  if src:  # the executor before, for --baseline-src
    sys.path.insert(0, src)
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  import tenplex_jax as tj
  state, target = _case(jax, case)
  jax.block_until_ready(state)
  import threading
  n = [0]
  secs = [0.0]
  re_n = [0]  # the generic executor's background recompiles
  re_secs = [0.0]

  def listen(ev, d, **kw):
    if ev != EVENT:
      return
    if threading.current_thread().name == "tenplex-recompile":
      re_n[0] += 1
      re_secs[0] += d
    else:
      n[0] += 1
      secs[0] += d
  jax.monitoring.register_event_duration_secs_listener(listen)
  call = ((lambda s: tj.reshard(s, target, method="generic"))
          if method == "generic" else (lambda s: jax.device_put(s, target)))
  out = {"case": case, "method": method,
         "leaves": len(jax.tree.leaves(state)),
         "bytes": sum(x.nbytes for x in jax.tree.leaves(state))}
  base = _peak_reset()
  t0 = time.perf_counter()
  c0 = time.process_time()
  res = jax.block_until_ready(call(state))
  out["cold_seconds"] = time.perf_counter() - t0
  out["cold_cpu_seconds"] = time.process_time() - c0
  out["cold_peak_rss_rise"] = _peak_rise(base)
  import numpy as np
  out["bitwise"] = all(
      a.sharding == t and np.asarray(a).tobytes() == np.asarray(x).tobytes()
      for a, x, t in zip(jax.tree.leaves(res), jax.tree.leaves(state),
                         jax.tree.leaves(target)))
  del res
  out["cold_compiles"] = n[0]
  # XLA compile seconds, summed over the compiles (which may overlap).
  out["cold_compile_seconds"] = secs[0]
  n[0] = 0
  warm, warm_cpu, warm_rise, warm_flt = _warm_series(jax, call, state, False)
  mid = len(warm) // 2  # medians
  out["warm_seconds"] = sorted(warm)[mid]
  out["warm_cpu_seconds"] = sorted(warm_cpu)[mid]
  out["warm_peak_rss_rise"] = sorted(warm_rise)[mid]
  out["cold_peak_rss_over_state"] = out["cold_peak_rss_rise"] / out["bytes"]
  out["warm_peak_rss_over_state"] = out["warm_peak_rss_rise"] / out["bytes"]
  out["warm_all_seconds"] = warm
  out["warm_all_cpu_seconds"] = warm_cpu
  out["warm_all_peak_rss_rise"] = warm_rise
  out["warm_all_minor_faults"] = warm_flt
  # The same, each call with the previous call's result alive (as a job
  # holding its state), after one untimed call whose result the first
  # timed call finds alive.
  alive, alive_cpu, alive_rise, alive_flt = _warm_series(jax, call, state,
                                                         True)
  out["warm_alive_all_seconds"] = alive
  out["warm_alive_all_cpu_seconds"] = alive_cpu
  out["warm_alive_all_peak_rss_rise"] = alive_rise
  out["warm_alive_all_minor_faults"] = alive_flt
  out["warm_alive_seconds"] = sorted(alive)[mid]
  out["warm_alive_peak_rss_rise"] = sorted(alive_rise)[mid]
  # Calls PAUSE seconds apart (a job trains between two resizes; the
  # generic executor's background recompile, if any, runs meanwhile).
  paused, _, paused_rise, _ = _warm_series(jax, call, state, False,
                                           pause=PAUSE)
  out["warm_paused_all_seconds"] = paused
  out["warm_paused_seconds"] = sorted(paused)[mid]
  out["warm_paused_peak_rss_rise"] = sorted(paused_rise)[mid]
  out["warm_compiles"] = n[0]
  out["recompiles"] = re_n[0]
  out["recompile_seconds"] = re_secs[0]
  return out


def _warm_series(jax, call, state, keep: bool, pause: float = 0.0) -> tuple:
  """WARM_CALLS timed calls in a row, each on a fresh copy of ``state``:
  per call its wall seconds, CPU seconds, peak RSS rise and minor page
  faults. With ``keep`` the previous call's result stays alive while the
  next call runs (one untimed call first makes the first one's), else it
  is dropped before the next call's copy is made. ``pause``: seconds of
  sleep before each call (untimed)."""
  import resource
  from bench_transitions import _fresh_copy
  prev = jax.block_until_ready(call(_fresh_copy(jax, state))) if keep else None
  wall, cpu, rise, faults = [], [], [], []
  for _ in range(WARM_CALLS):
    time.sleep(pause)
    fresh = _fresh_copy(jax, state)
    jax.block_until_ready(fresh)
    base = _peak_reset()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = jax.block_until_ready(call(fresh))
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    rise.append(_peak_rise(base))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    del fresh
    prev = res if keep else None
    del res
  del prev
  return wall, cpu, rise, faults


def worker_alternate(case: str, rounds: int) -> dict:
  """Both methods in one process, warm, call by call: a cold call of each
  first (compiles), then ``rounds`` rounds of one generic and one
  ``device_put`` call (the order swapped every round), each on a fresh
  copy of the source, the previous result dropped. The two methods then
  see the same process, heap and load, which fresh processes per method do
  not (their warm times differ by more than the methods do under load)."""
  import statistics
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  import tenplex_jax as tj
  from bench_transitions import _fresh_copy
  state, target = _case(jax, case)
  jax.block_until_ready(state)
  calls = {"generic": lambda s: tj.reshard(s, target, method="generic"),
           "device_put": lambda s: jax.device_put(s, target)}
  for call in calls.values():
    jax.block_until_ready(call(state))
  times = {m: [] for m in calls}
  for i in range(rounds):
    for m in (("generic", "device_put") if i % 2 == 0 else
              ("device_put", "generic")):
      fresh = _fresh_copy(jax, state)
      jax.block_until_ready(fresh)
      _peak_reset()
      t0 = time.perf_counter()
      res = jax.block_until_ready(calls[m](fresh))
      times[m].append(time.perf_counter() - t0)
      del res, fresh
  g, d = times["generic"], times["device_put"]
  return {"case": case, "rounds": rounds, "seconds": times,
          "median_seconds": {m: statistics.median(v) for m, v in
                             times.items()},
          "generic_over_device_put": (statistics.median(g)
                                      / statistics.median(d)),
          "each_round_generic_over_device_put": [a / b for a, b in zip(g, d)]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cases", default="lm1b,pieces",
                  help="lm1b, pieces, heldout:SEED:INDEX (a transition of"
                  " benchmarks/random_transitions.py)")
  ap.add_argument("--held-out", default=None, metavar="SEED:N",
                  help="adds the first N transitions of SEED as cases")
  ap.add_argument("--compile-cold", action="store_true",
                  help="adds a 'generic (compile)' row per case: the generic"
                  " executor with TENPLEX_JAX_GENERIC_COLD=compile (cold"
                  " calls compile their programs, as before the host tier)")
  ap.add_argument("--out", default=os.path.join(HERE,
                                                "bench_generic_result.json"))
  ap.add_argument("--timeout", type=float, default=300)
  ap.add_argument("--baseline-src", default=None,
                  help="a directory holding the tenplex_jax package to time"
                  " as 'generic (before)' in the same run")
  ap.add_argument("--trim-first", action="store_true",
                  help="malloc_trim(0) before every timed call's RSS"
                  " baseline, in every method's workers")
  ap.add_argument("--alternate", type=int, default=0, metavar="N",
                  help="also time N rounds of warm calls alternating the"
                  " two methods in one process per case")
  ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--worker-alternate", nargs=2, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(*args.worker)))
    return 0
  if args.worker_alternate:
    case, rounds = args.worker_alternate
    print(json.dumps(worker_alternate(case, int(rounds))))
    return 0
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"]
                              if env.get("PYTHONPATH") else "")
  env["NPROC"] = str(max(16, int(env.get("NPROC", "0") or 0)))
  env.pop("TENPLEX_BENCH_SRC", None)
  env.pop("TENPLEX_BENCH_TRIM_FIRST", None)
  if args.trim_first:
    env["TENPLEX_BENCH_TRIM_FIRST"] = "1"
  methods = ["generic", "device_put"]
  if args.compile_cold:
    methods.append("generic (compile)")
  if args.baseline_src:
    methods.append("generic (before)")
  cases = [c for c in args.cases.split(",") if c]
  if args.held_out:
    seed, n = args.held_out.split(":")
    cases += [f"heldout:{seed}:{i}" for i in range(int(n))]
  args.cases = ",".join(cases)
  rows = []
  for case in cases:
    for method in methods:
      wenv = dict(env)
      wenv.pop("TENPLEX_JAX_GENERIC_COLD", None)
      if method == "generic (compile)":
        wenv["TENPLEX_JAX_GENERIC_COLD"] = "compile"
      if method == "generic (before)":
        wenv["TENPLEX_BENCH_SRC"] = os.path.abspath(args.baseline_src)
      try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__),
                            "--worker", case, method.split()[0]], env=wenv,
                           capture_output=True, text=True,
                           timeout=args.timeout)
        r = (json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0
             else {"case": case, "method": method,
                   "failure": p.stderr.strip().splitlines()[-1:]})
      except subprocess.TimeoutExpired:
        r = {"case": case, "method": method, "failure": "timeout"}
      r["method"] = method
      rows.append(r)
      print(json.dumps(r))
  checks = {}
  for case in args.cases.split(","):
    g, d = (next((r for r in rows if r["case"] == case and r["method"] == m
                  and "failure" not in r), None)
            for m in ("generic", "device_put"))
    if g is None or d is None:
      continue
    # The compile-time budget: the generic path's XLA compile time on a
    # cold transition may be at most device_put's whole cold call.
    checks[case] = {
        "cold_generic_over_device_put": g["cold_seconds"] / d["cold_seconds"],
        "warm_generic_over_device_put": g["warm_seconds"] / d["warm_seconds"],
        "compile_seconds": g["cold_compile_seconds"],
        "compile_budget_seconds": d["cold_seconds"],
        "compile_budget_met": g["cold_compile_seconds"] <= d["cold_seconds"],
        "cold_not_slower": g["cold_seconds"] <= d["cold_seconds"],
        "warm_within_1_2x": g["warm_seconds"] <= 1.2 * d["warm_seconds"],
        # Call by call (the i-th warm call of each method's process).
        "warm_each_generic_over_device_put": [
            a / b for a, b in zip(g["warm_all_seconds"],
                                  d["warm_all_seconds"])],
        "warm_alive_generic_over_device_put": (
            g["warm_alive_seconds"] / d["warm_alive_seconds"]),
        "warm_alive_each_generic_over_device_put": [
            a / b for a, b in zip(g["warm_alive_all_seconds"],
                                  d["warm_alive_all_seconds"])],
        # Item 2 of issue 26, call by call, both series: no warm call
        # slower than the same process's cold call, nor than device_put's
        # warm call of the same index and series.
        "warm_each_not_slower_than_cold": all(
            w <= g["cold_seconds"] for w in
            g["warm_all_seconds"] + g["warm_alive_all_seconds"]),
        "warm_each_not_slower_than_device_put": all(
            a <= b for a, b in zip(
                g["warm_all_seconds"] + g["warm_alive_all_seconds"],
                d["warm_all_seconds"] + d["warm_alive_all_seconds"])),
        "warm_paused_generic_over_device_put": (
            g["warm_paused_seconds"] / d["warm_paused_seconds"]),
        "warm_paused_each_generic_over_device_put": [
            a / b for a, b in zip(g["warm_paused_all_seconds"],
                                  d["warm_paused_all_seconds"])],
        "warm_paused_within_1_2x": (g["warm_paused_seconds"]
                                    <= 1.2 * d["warm_paused_seconds"]),
        "warm_alive_peak_rss_below": (g["warm_alive_peak_rss_rise"]
                                      <= d["warm_alive_peak_rss_rise"]),
        "warm_cpu_generic_over_device_put": (
            g["warm_cpu_seconds"] / d["warm_cpu_seconds"]),
        "cold_cpu_generic_over_device_put": (
            g["cold_cpu_seconds"] / d["cold_cpu_seconds"]),
        "cold_peak_rss_generic_over_device_put": (
            g["cold_peak_rss_rise"] / max(1, d["cold_peak_rss_rise"])),
        "warm_peak_rss_generic_over_device_put": (
            g["warm_peak_rss_rise"] / max(1, d["warm_peak_rss_rise"])),
        "cold_peak_rss_below": (g["cold_peak_rss_rise"]
                                <= d["cold_peak_rss_rise"]),
        "warm_peak_rss_below": (g["warm_peak_rss_rise"]
                                <= d["warm_peak_rss_rise"])}
    b = next((r for r in rows if r["case"] == case
              and r["method"] == "generic (before)" and "failure" not in r),
             None)
    if b is not None:
      checks[case].update({
          "before_cold_over_device_put": b["cold_seconds"] / d["cold_seconds"],
          "before_warm_over_device_put": b["warm_seconds"] / d["warm_seconds"],
          "before_cold_peak_rss_over_device_put": (
              b["cold_peak_rss_rise"] / max(1, d["cold_peak_rss_rise"]))})
    print(f"{case}: generic / device_put cold"
          f" {checks[case]['cold_generic_over_device_put']:.2f}, warm"
          f" {checks[case]['warm_generic_over_device_put']:.2f} (CPU seconds:"
          f" cold {checks[case]['cold_cpu_generic_over_device_put']:.2f},"
          f" warm {checks[case]['warm_cpu_generic_over_device_put']:.2f});"
          " compile"
          f" {g['cold_compile_seconds']:.2f} s against a budget of"
          f" {d['cold_seconds']:.2f} s (device_put's cold call):"
          f" {'met' if checks[case]['compile_budget_met'] else 'NOT met'};"
          f" peak RSS rise cold {g['cold_peak_rss_rise'] / 2**20:.0f} against"
          f" {d['cold_peak_rss_rise'] / 2**20:.0f} MiB, warm"
          f" {g['warm_peak_rss_rise'] / 2**20:.0f} against"
          f" {d['warm_peak_rss_rise'] / 2**20:.0f} MiB (previous result alive:"
          f" {g['warm_alive_peak_rss_rise'] / 2**20:.0f} against"
          f" {d['warm_alive_peak_rss_rise'] / 2**20:.0f} MiB, warm"
          f" {checks[case]['warm_alive_generic_over_device_put']:.2f}x;"
          f" {PAUSE:g} s apart: warm"
          f" {checks[case]['warm_paused_generic_over_device_put']:.2f}x)")
  alternate = []
  for case in args.cases.split(",") if args.alternate else ():
    try:
      p = subprocess.run([sys.executable, os.path.abspath(__file__),
                          "--worker-alternate", case, str(args.alternate)],
                         env=env, capture_output=True, text=True,
                         timeout=args.timeout)
      r = (json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0
           else {"case": case, "failure": p.stderr.strip().splitlines()[-1:]})
    except subprocess.TimeoutExpired:
      r = {"case": case, "failure": "timeout"}
    alternate.append(r)
    if "failure" in r:
      print(f"{case}, alternating: {r['failure']}")
      continue
    print(f"{case}, alternating in one process, {r['rounds']} rounds:"
          f" generic {r['median_seconds']['generic']:.3f} s,"
          f" device_put {r['median_seconds']['device_put']:.3f} s (medians),"
          f" {r['generic_over_device_put']:.2f}x; rounds: "
          + ", ".join(f"{x:.2f}" for x in
                      r["each_round_generic_over_device_put"]))
  held = [c for c in checks if c.startswith("heldout:")]
  summary = {}
  if held:
    def spread(key: str) -> dict:
      v = sorted(checks[c][key] for c in held)
      return {"median": v[len(v) // 2], "worst": v[-1]}
    summary = {k: spread(k) for k in (
        "cold_generic_over_device_put", "warm_generic_over_device_put",
        "warm_alive_generic_over_device_put",
        "warm_paused_generic_over_device_put",
        "cold_peak_rss_generic_over_device_put")}
    summary["cases"] = len(held)
    summary["all_met"] = {k: all(checks[c][k] for c in held) for k in (
        "cold_not_slower", "warm_within_1_2x", "warm_each_not_slower_than_cold",
        "warm_each_not_slower_than_device_put", "cold_peak_rss_below",
        "compile_budget_met")}
    print(f"held-out ({len(held)} transitions), generic / device_put:"
          + "".join(f" {k} median {v['median']:.2f} worst {v['worst']:.2f};"
                    for k, v in summary.items() if isinstance(v, dict)
                    and "median" in v)
          + f" met: {summary['all_met']}")
  doc = {"load": os.getloadavg(), "trim_first": args.trim_first,
         "results": rows, "checks": checks, "held_out": summary,
         "alternate": alternate}
  with open(args.out, "w") as f:
    json.dump(doc, f, indent=1)
  print("| case | method | cold s | cold compiles | warm s (median) |"
        " warm s, call by call | warm s, previous result alive |"
        f" warm s, {PAUSE:g} s apart |"
        " warm compiles (background recompiles, s) |"
        " peak RSS rise cold / warm / warm alive, MiB (x state) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "failure" in r:
      print(f"| {r['case']} | {r['method']} | {r['failure']} | | | | | | | |")
      continue
    print(f"| {r['case']} ({r['leaves']} arrays, {r['bytes'] >> 20} MiB) |"
          f" {r['method']} | {r['cold_seconds']:.3f}"
          f"{'' if r.get('bitwise') else ' (NOT bitwise)'} |"
          f" {r['cold_compiles']} |"
          f" {r['warm_seconds']:.3f} |"
          f" {', '.join(f'{w:.3f}' for w in r['warm_all_seconds'])} |"
          f" {', '.join(f'{w:.3f}' for w in r['warm_alive_all_seconds'])} |"
          f" {', '.join(f'{w:.3f}' for w in r['warm_paused_all_seconds'])} |"
          f" {r['warm_compiles']} ({r['recompiles']},"
          f" {r['recompile_seconds']:.2f}) |"
          f" {r['cold_peak_rss_rise'] / 2**20:.0f}"
          f" ({r['cold_peak_rss_over_state']:.2f}) /"
          f" {r['warm_peak_rss_rise'] / 2**20:.0f}"
          f" ({r['warm_peak_rss_over_state']:.2f}) /"
          f" {r['warm_alive_peak_rss_rise'] / 2**20:.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
