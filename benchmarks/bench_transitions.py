"""Benchmark: reshard/remesh against jax.device_put on held-out transitions.

Two suites, every (case, method) in a FRESH process (no prefaulting unless
``--prefault-gib``), methods interleaved, each process under a timeout so a
``device_put`` that aborts or stalls is recorded and cannot take the run
down:

* ``random``: ``--n`` (default 30) seeded random transitions from
  ``random_transitions.py`` (``--seed``): random meshes over subsets and
  permutations of 8 CPU devices, several axes per dimension, rows <->
  columns, replication changes, float32/bfloat16/int8, leaves of 1 KiB to
  256 MiB, 10-2,000 leaves, 512-640 MiB per state.
* ``lm1b``: flax's lm1b train state (``tests/fixtures/lm1b_state.py``,
  ``LARGE``: 1.08 GiB, 197 leaves, adamw, lm1b's logical rules) moved
  between lm1b meshes ``(data, fsdp, tensor)``. The state is initialised
  once by flax (in its own process) and saved to /dev/shm; each worker
  rebuilds exactly that state (same tree, values and shardings) from it.

Per process: the *cold* time is the first call (layouts, plan, compilation
and first-touch page faults included) and its peak RSS rise; the *warm* time
is the same transition on a fresh copy of the source state (median of up to
3 calls, as many as fit in 1 s, the same rule for every method). ``reshard``'s values are checked bitwise and its
shardings against the target, outside the timed region.

Run (about 10 minutes, < 6 GiB)::

  python benchmarks/bench_transitions.py --seed 0

and ``--repeat 3`` for medians of 3 fresh processes per method and case
(rounds interleaved; each process's own figures kept under ``runs``), so
that one slow process on a shared machine does not decide a case;
``--suite random|lm1b`` for one suite, ``--cases r0.16 2,4,1->1,8,1``
for some cases only (with ``--out`` elsewhere, to keep the full run's
results). Each process also records its CPU time (``cold_cpu_seconds``,
``warm_cpu_seconds``, all threads), which other work on a shared machine
disturbs less than wall time.

Our package is measured as installed: its bytecode compiled first (what pip
does when it installs a wheel, and how jax itself is installed here), since
a first call imports ``tenplex_jax.reshard`` and an editable install under
``PYTHONDONTWRITEBYTECODE=1`` (as on the project's VMs) would otherwise
compile 2,700 lines of source inside the timed call: 50-80 ms against 12 ms
from bytecode. ``--bytecode as-found`` skips that; each worker records
whether the module came from bytecode (``package_bytecode``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(ROOT, "tests")):
  if p not in sys.path:
    sys.path.insert(0, p)

import random_transitions as rt  # noqa: E402
from bench_reshard import PeakMemory, prefault  # noqa: E402

LM1B_CASES = (("1,8,1", "2,4,1"), ("1,8,1", "1,2,4"), ("2,4,1", "1,8,1"),
              ("2,2,2", "1,4,2"))
WARM_BUDGET = 1.0  # warm calls (fresh sources) repeat, up to 3, while their
# total is under this; the median counts (one sample of a 0.2 s call swung
# 2x at load 20)


def _jax():
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  return jax


def _fresh_copy(jax, tree):
  """A copy of every array (same shardings), made without compiling."""
  def cp(x):
    if not isinstance(x, jax.Array):
      return x
    shards = [jax.device_put(s.data, s.device, may_alias=False)
              for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding,
                                                    shards)
  return jax.tree.map(cp, tree)


# -- the two suites' states -----------------------------------------------------


def _random_case(jax, seed: int, index: int):
  from jax.sharding import NamedSharding
  t = rt.make_transition(seed, index)
  devs = jax.devices()
  src, dst = t.src.build(devs), t.dst.build(devs)
  state, targets, hosts = {}, {}, {}
  for k, leaf in enumerate(t.leaves):
    name = f"l{k:04d}"
    host = rt.host_value(leaf, k)
    s = NamedSharding(src, rt.pspec(leaf.src_spec))
    state[name] = jax.make_array_from_callback(
        leaf.shape, s, lambda idx, h=host: h[idx].copy())
    targets[name] = NamedSharding(dst, rt.pspec(leaf.dst_spec))
    hosts[name] = host
  return state, targets, hosts, None


def _lm1b_tree(size):
  import flax.linen as nn
  from fixtures import lm1b_state as L
  abstract, _ = L.abstract_state(size)
  unbox = lambda t: __import__("jax").tree.map(
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      t, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  return L, nn, abstract, unbox


def _lm1b_shardings(jax, L, nn, abstract, unbox, mesh):
  logical = nn.get_partition_spec(abstract)
  sh = nn.logical_to_mesh_sharding(logical, mesh, L.LM1B_RULES)
  ref = unbox(abstract)
  return jax.tree.unflatten(jax.tree.structure(ref), jax.tree.leaves(sh))


def _lm1b_prepare(path: str, size_name: str) -> None:
  """Initialises lm1b's state with flax once and saves its leaves."""
  jax = _jax()
  import numpy as np
  from fixtures import lm1b_state as L
  size = getattr(L, size_name)
  state, _ = L.make_state(L.make_mesh((1, 8, 1)), size)
  for k, x in enumerate(jax.tree.leaves(state)):
    np.save(os.path.join(path, f"{k:04d}.npy"), np.asarray(x))


def _lm1b_case(jax, path: str, size_name: str, src: str, dst: str):
  import numpy as np
  L, nn, abstract, unbox = _lm1b_tree(getattr(
      __import__("fixtures.lm1b_state", fromlist=["x"]), size_name))
  smesh = L.make_mesh(tuple(int(v) for v in src.split(",")))
  dmesh = L.make_mesh(tuple(int(v) for v in dst.split(",")))
  s_sh = _lm1b_shardings(jax, L, nn, abstract, unbox, smesh)
  d_sh = _lm1b_shardings(jax, L, nn, abstract, unbox, dmesh)
  ref = unbox(abstract)
  flat, tdef = jax.tree.flatten(ref)
  hosts = [np.load(os.path.join(path, f"{k:04d}.npy"), mmap_mode="r")
           for k in range(len(flat))]
  leaves = [jax.make_array_from_callback(
      h.shape, s, lambda idx, h=h: np.array(h[idx]))
      for h, s in zip(hosts, jax.tree.leaves(s_sh))]
  state = jax.tree.unflatten(tdef, leaves)
  names = [f"l{k:04d}" for k in range(len(flat))]
  return (state, d_sh, dict(zip(names, hosts)), dmesh)


# -- one worker: one case, one method ------------------------------------------


def _call(jax, method: str, targets, mesh):
  import tenplex_jax as tj
  if method == "reshard":
    return lambda st: tj.reshard(st, targets)
  if method == "remesh":
    return lambda st: tj.remesh(st, mesh)[0]
  if method == "device_put":
    return lambda st: jax.device_put(st, targets)
  raise ValueError(method)


def _check(jax, new, targets, hosts) -> str:
  import numpy as np
  flat = jax.tree.leaves(new)
  tflat = jax.tree.leaves(targets)
  bad = []
  for (name, host), x, s in zip(sorted(hosts.items()), flat, tflat):
    if not x.sharding.is_equivalent_to(s, x.ndim):
      bad.append(f"{name}: sharding {x.sharding} != {s}")
    for sh in x.addressable_shards:
      a = np.asarray(sh.data)
      b = np.asarray(host[sh.index])
      if a.shape != b.shape or not np.array_equal(
          np.ascontiguousarray(a).view(np.uint8),
          np.ascontiguousarray(b).view(np.uint8)):
        bad.append(f"{name}: values differ on device {sh.device.id}")
        break
  return "ok" if not bad else "; ".join(bad[:3])


def _cpu_seconds() -> float:
  """CPU time of this process, all threads (less sensitive than wall time
  to other work on a shared machine)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def worker(args) -> None:
  jax = _jax()
  res = {"stage": "start", "ok": False}

  def dump():
    with open(args.result, "w") as f:
      json.dump(res, f)

  dump()
  suite, method = args.worker[0], args.worker[-1]
  if suite == "random":
    state, targets, hosts, mesh = _random_case(jax, args.seed,
                                               int(args.worker[1]))
  else:
    state, targets, hosts, mesh = _lm1b_case(
        jax, args.lm1b_dir, args.lm1b_size, args.worker[1], args.worker[2])
  jax.block_until_ready(state)
  import importlib.util
  spec = importlib.util.find_spec("tenplex_jax.reshard")
  res["package_bytecode"] = bool(spec and spec.cached
                                 and os.path.exists(spec.cached))
  call = _call(jax, method, targets, mesh)
  if args.prefault_gib:
    res["prefault_seconds"] = prefault(args.prefault_gib)
  mem = PeakMemory()
  gc.collect()
  mem.reset()
  res["stage"] = "cold"
  dump()
  c0 = _cpu_seconds()
  t0 = time.perf_counter()
  new = jax.block_until_ready(call(state))
  res["cold_seconds"] = time.perf_counter() - t0
  res["cold_cpu_seconds"] = _cpu_seconds() - c0
  res["cold_peak_bytes"] = mem.peak_above_base()
  if method != "device_put":
    res["check"] = _check(jax, new, targets, hosts)
  res["stage"] = "warm"
  dump()
  del new
  warm, peaks, warm_cpu = [], [], []
  for _ in range(3):
    fresh = _fresh_copy(jax, state)
    jax.block_until_ready(fresh)
    gc.collect()
    mem.reset()
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    new = jax.block_until_ready(call(fresh))
    warm.append(time.perf_counter() - t0)
    warm_cpu.append(_cpu_seconds() - c0)
    peaks.append(mem.peak_above_base())
    del new, fresh
    if sum(warm) >= WARM_BUDGET:
      break
  res["warm_calls"] = warm
  res["warm_seconds"] = statistics.median(warm)
  res["warm_cpu_seconds"] = statistics.median(warm_cpu)
  res["warm_peak_bytes"] = max(peaks)
  res["ok"] = True
  res["stage"] = "done"
  dump()


# -- the driver -----------------------------------------------------------------


def run_one(worker_args: list[str], args, timeout: float) -> dict:
  fd, rpath = tempfile.mkstemp(prefix="bench_tr_", suffix=".json")
  os.close(fd)
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"]
                              if env.get("PYTHONPATH") else "")
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", *worker_args,
         "--result", rpath, "--seed", str(args.seed), "--lm1b-size",
         args.lm1b_size, "--prefault-gib", str(args.prefault_gib or 0)]
  if args.lm1b_dir:
    cmd += ["--lm1b-dir", args.lm1b_dir]
  t0 = time.perf_counter()
  err, rc = "", None
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    _, err = proc.communicate(timeout=timeout)
    rc = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)
    _, err = proc.communicate()
  except BaseException:  # interrupted: never leave a worker behind
    os.killpg(proc.pid, 9)
    proc.communicate()
    raise
  wall = time.perf_counter() - t0
  try:
    with open(rpath) as f:
      res = json.load(f)
  except (OSError, ValueError):
    res = {"ok": False, "stage": "start"}
  finally:
    os.unlink(rpath)
  res["process_seconds"] = wall
  if not res.get("ok"):
    tail = [l for l in (err or "").strip().splitlines() if l.strip()][-3:]
    res["stderr_tail"] = tail
    if rc is None:
      res["failure"] = (f"stalled in the {res.get('stage')} call, killed"
                        f" after {wall:.0f} s")
    else:
      why = "rendezvous" if "rendezvous" in (err or "").lower() else f"rc {rc}"
      res["failure"] = f"aborted in the {res.get('stage')} call ({why})"
  return res


def compile_bytecode() -> None:
  """Compiles the package's modules to bytecode beside their sources
  (``__pycache__``, as pip does for a wheel); untimed, before any worker."""
  import compileall
  compileall.compile_dir(os.path.join(ROOT, "tenplex_jax"), quiet=1)


def _ratio(dp, ours):
  return None if dp is None or not ours else dp / ours


def summarize(cases: list[dict], ours: str) -> dict:
  out = {}
  for phase in ("cold", "warm"):
    rs = [c["ratio"][ours][phase] for c in cases
          if c["ratio"].get(ours, {}).get(phase) is not None]
    out[phase] = ({"worst": min(rs), "median": statistics.median(rs),
                   "n": len(rs)} if rs else None)
  peak = [c["results"][ours]["cold_peak_bytes"]
          - c["results"]["device_put"]["cold_peak_bytes"] for c in cases
          if c["results"]["device_put"].get("ok")
          and c["results"][ours].get("ok")]
  out["peak_rise_over_device_put_max_bytes"] = max(peak) if peak else None
  out["device_put_failed"] = [c["case"] for c in cases
                              if not c["results"]["device_put"].get("ok")]
  out["ours_failed"] = [c["case"] for c in cases
                        if not c["results"][ours].get("ok")
                        or c["results"][ours].get("check") != "ok"]
  return out


def _mib(b):
  return "-" if b is None else f"{b / (1 << 20):.0f}"


def _s(r, k):
  return f"{r[k]:.3f}" if r.get("ok") and r.get(k) is not None else "-"


def markdown(doc: dict) -> str:
  lines = []
  for suite, sd in doc["suites"].items():
    methods = sd["methods"]
    ours = [m for m in methods if m != "device_put"]
    lines.append(f"\n**{suite}** ({sd['label']})\n")
    head = "| case | what |"
    for m in methods:
      head += f" {m} cold s | {m} warm s | {m} peak MiB |"
    for m in ours:
      head += f" dp/{m} cold | dp/{m} warm |"
    lines.append(head)
    lines.append("|" + "---|" * (head.count("|") - 1))
    for c in sd["cases"]:
      row = f"| {c['case']} | {c['what']} |"
      for m in methods:
        r = c["results"][m]
        if not r.get("ok"):
          row += f" {r.get('failure', 'failed')} | | |"
          continue
        row += (f" {_s(r, 'cold_seconds')} | {_s(r, 'warm_seconds')} |"
                f" {_mib(r.get('cold_peak_bytes'))} |")
      for m in ours:
        rr = c["ratio"].get(m, {})
        row += "".join(f" {rr[p]:.2f} |" if rr.get(p) else " - |"
                       for p in ("cold", "warm"))
      lines.append(row)
    for m in ours:
      s = sd["summary"][m]
      parts = []
      for p in ("cold", "warm"):
        if s[p]:
          parts.append(f"{p}: worst {s[p]['worst']:.2f}x, median"
                       f" {s[p]['median']:.2f}x over {s[p]['n']} cases")
      parts.append("peak RSS rise minus device_put's, max:"
                   f" {_mib(s['peak_rise_over_device_put_max_bytes'])} MiB")
      if s["device_put_failed"]:
        parts.append(f"device_put failed on {s['device_put_failed']}")
      if s["ours_failed"]:
        parts.append(f"{m} FAILED on {s['ours_failed']}")
      lines.append(f"\ndevice_put time / {m} time: " + "; ".join(parts))
  return "\n".join(lines) + "\n"


def combine_runs(runs: list[dict]) -> dict:
  """One method's result on one case from its fresh processes ``runs``.

  Times are the medians over the processes (the cold call's, and of each
  process's warm median), CPU seconds likewise, peak memory the largest;
  ``runs`` keeps every process's own figures. A method that failed in any
  process failed on the case (its first failure is reported).
  """
  failed = [r for r in runs if not r.get("ok")]
  if failed:
    out = dict(failed[0])
  else:
    out = dict(runs[0])
    for k in ("cold_seconds", "cold_cpu_seconds", "warm_seconds",
              "warm_cpu_seconds", "process_seconds"):
      vals = [r[k] for r in runs if r.get(k) is not None]
      if vals:
        out[k] = statistics.median(vals)
    for k in ("cold_peak_bytes", "warm_peak_bytes"):
      vals = [r[k] for r in runs if r.get(k) is not None]
      if vals:
        out[k] = max(vals)
    checks = [r.get("check") for r in runs if "check" in r]
    if checks:
      bad = [c for c in checks if c != "ok"]
      out["check"] = bad[0] if bad else "ok"
  out["runs"] = [{k: r.get(k) for k in (
      "ok", "cold_seconds", "cold_cpu_seconds", "warm_seconds",
      "cold_peak_bytes", "check", "failure") if k in r} for r in runs]
  return out


def run_suite(name: str, cases: list, methods: list, args,
              partial=None) -> dict:
  from rich.progress import Progress
  out = []
  repeat = max(1, args.repeat)
  with Progress(transient=False) as prog:
    task = prog.add_task(f"{name}", total=len(cases) * len(methods) * repeat)
    for i, (case, what, wargs, timeout) in enumerate(cases):
      runs: dict = {m: [] for m in methods}
      for k in range(repeat):
        # interleaved: the order alternates between cases and rounds
        order = methods if (i + k) % 2 == 0 else methods[::-1]
        for m in order:
          if runs[m] and not runs[m][-1].get("ok"):
            prog.advance(task)  # failed once: not run (nor stalled) again
            continue
          runs[m].append(run_one([*wargs, m], args, timeout))
          prog.advance(task)
      results = {m: (combine_runs(runs[m]) if repeat > 1 else runs[m][0])
                 for m in methods}
      dp = results["device_put"]
      ratio = {}
      for m in methods:
        if m == "device_put":
          continue
        r = results[m]
        ratio[m] = {p: (_ratio(dp.get(f"{p}_seconds"), r.get(f"{p}_seconds"))
                        if dp.get("ok") and r.get("ok") else None)
                    for p in ("cold", "warm")}
      out.append({"case": case, "what": what, "results": results,
                  "ratio": ratio})
      if partial is not None:
        partial(name, out)
      nan = float("nan")
      msg = " ".join(f"{m}={results[m].get('cold_seconds', nan):.3f}"
                     f"/{results[m].get('warm_seconds', nan):.3f}"
                     f" (cpu {results[m].get('cold_cpu_seconds', nan):.3f}"
                     f"/{results[m].get('warm_cpu_seconds', nan):.3f})"
                     for m in methods)
      if repeat > 1:
        msg += "; cold per process: " + ", ".join(
            f"{m} " + "/".join(f"{r['cold_seconds']:.3f}" for r in runs[m]
                               if r.get("cold_seconds") is not None)
            for m in methods)
      prog.console.print(f"{case}: {what}: cold/warm s {msg}"
                         + "".join(f" [{m}: {results[m].get('failure')}]"
                                   for m in methods
                                   if not results[m].get("ok")))
  ours = [m for m in methods if m != "device_put"]
  return {"methods": methods, "cases": out,
          "summary": {m: summarize(out, m) for m in ours}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--suite", default="all", choices=("all", "random", "lm1b"))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--n", type=int, default=30, help="random transitions")
  ap.add_argument("--cases", nargs="*", default=None,
                  help="run only these cases, by their names in the table"
                  " (e.g. --cases r0.16 r0.08 2,4,1->1,8,1); default all")
  ap.add_argument("--lm1b-size", default="LARGE", choices=("SMALL", "LARGE"))
  ap.add_argument("--repeat", type=int, default=1,
                  help="fresh processes per method and case, interleaved;"
                  " times are their medians (default 1)")
  ap.add_argument("--timeout", type=float, default=120.0,
                  help="seconds per process before it counts as stalled")
  ap.add_argument("--prefault-gib", type=float, default=0.0,
                  help="prefault this much memory in each worker first"
                  " (reported separately; headline runs use 0)")
  ap.add_argument("--bytecode", default="compiled",
                  choices=("compiled", "as-found"),
                  help="compile tenplex_jax's bytecode before the run, as a"
                  " wheel install does (default), or leave it as found")
  ap.add_argument("--out", default=os.path.join(HERE,
                                                "bench_transitions_result.json"))
  ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
  ap.add_argument("--result", help=argparse.SUPPRESS)
  ap.add_argument("--lm1b-dir", help=argparse.SUPPRESS)
  ap.add_argument("--prepare-lm1b", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.prepare_lm1b:
    _lm1b_prepare(args.prepare_lm1b, args.lm1b_size)
    return 0
  if args.bytecode == "compiled":
    compile_bytecode()
  t_start = time.perf_counter()
  load0 = os.getloadavg()
  doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "command": " ".join([os.path.basename(sys.executable),
                              os.path.relpath(__file__, ROOT),
                              *(argv if argv is not None else sys.argv[1:])]),
         "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                     "mem_gib": os.sysconf("SC_PAGE_SIZE")
                     * os.sysconf("SC_PHYS_PAGES") / (1 << 30),
                     "loadavg_start": load0},
         "prefault_gib": args.prefault_gib, "bytecode": args.bytecode,
         "suites": {}}
  def partial(name, cases):  # results so far, in case the run is cut short
    with open(args.out + ".partial", "w") as f:
      json.dump({**doc, "partial_suite": name, "partial_cases": cases}, f)

  picked = lambda name: args.cases is None or name in args.cases
  medians = (f", medians of {args.repeat} fresh processes per method"
             if args.repeat > 1 else "")  # in both suites' labels
  random_cases = []
  for i in range(args.n):
    t = rt.make_transition(args.seed, i)
    if picked(t.name):
      random_cases.append((t.name, t.describe(), ["random", str(i)],
                           args.timeout))
  lm1b_cases = [(a, b) for a, b in LM1B_CASES if picked(f"{a}->{b}")]
  if args.suite in ("all", "random") and random_cases:
    doc["suites"]["random"] = run_suite("random", random_cases,
                                        ["reshard", "device_put"], args,
                                        partial)
    doc["suites"]["random"]["label"] = (
        f"seed {args.seed}, {args.n} transitions, 8 CPU devices" + medians
        + ("" if args.cases is None else
           f", only {len(random_cases)} of them"))
  if args.suite in ("all", "lm1b") and lm1b_cases:
    d = tempfile.mkdtemp(prefix="tenplex_lm1b_", dir="/dev/shm"
                         if os.path.isdir("/dev/shm") else None)
    try:
      args.lm1b_dir = d
      env = dict(os.environ)
      env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"]
                                  if env.get("PYTHONPATH") else "")
      subprocess.run([sys.executable, os.path.abspath(__file__),
                      "--prepare-lm1b", d, "--lm1b-size", args.lm1b_size],
                     env=env, check=True, timeout=600)
      cases = [(f"{a}->{b}", f"lm1b {args.lm1b_size} (data,fsdp,tensor)"
                f" ({a}) -> ({b})", ["lm1b", a, b], args.timeout)
               for a, b in lm1b_cases]
      doc["suites"]["lm1b"] = run_suite(
          "lm1b", cases, ["reshard", "remesh", "device_put"], args, partial)
      doc["suites"]["lm1b"]["label"] = (
          f"flax lm1b {args.lm1b_size} train state, 8 CPU devices" + medians)
    finally:
      shutil.rmtree(d, ignore_errors=True)
  doc["machine"]["loadavg_end"] = os.getloadavg()
  doc["wall_seconds"] = time.perf_counter() - t_start
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(doc, f, indent=1)
  if os.path.exists(args.out + ".partial"):
    os.unlink(args.out + ".partial")
  md = markdown(doc)
  print(md)
  print(f"wall {doc['wall_seconds']:.0f} s, load {load0} ->"
        f" {doc['machine']['loadavg_end']}; results in {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
