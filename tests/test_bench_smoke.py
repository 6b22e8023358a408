"""Smoke tests of benchmarks/bench_reshard.py (quick mode, one transition)
and of one bench_warm.py worker; bench_transitions.py's medians.

No timing assertions: it checks that the benchmark runs end to end, that the
resharded values and shardings are checked, and that the JSON has its fields.
"""

import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_reshard_quick(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_reshard.py"),
       "--quick", "--transitions", "tensor2to4", "--methods", "reshard,memcpy",
       "--out", str(out), "--timeout", "120"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  doc = json.loads(out.read_text())
  assert doc["state_bytes"] > 0 and doc["size_gib"] > 0
  assert set(doc["transitions"]) == {"tensor2to4"}
  by = {r["method"]: r for r in doc["results"]}
  assert set(by) == {"reshard", "memcpy"}
  for r in by.values():
    assert r["ok"], r
    assert r["transition"] == "tensor2to4"
    for k in ("cold_seconds", "warm_seconds", "moved_bytes"):
      assert r[k] > 0, (r["method"], k, r[k])
    assert r["peak_bytes"] >= 0
  rs = by["reshard"]
  assert rs["check"] == "ok" and rs["check_warm"] == "ok"
  assert rs["moved_bytes"] == by["memcpy"]["moved_bytes"]
  assert rs["cold_extra"]["lower_bound_bytes"] == rs["moved_bytes"]
  s = doc["summary"]["tensor2to4"]
  assert s["warm_reshard_over_memcpy"] > 0


def test_bench_warm_worker_fresh_source(tmp_path):
  # One worker of benchmarks/bench_warm.py: the source replaced by a fresh
  # copy before each call, values checked, the executor path recorded.
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_warm.py"),
       "--calls", "2", "--worker", "small-shards", "reshard", "dropped",
       "fresh"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["values_ok"] and r["source"] == "fresh", r
  assert r["paths"] == ["cpu", "cpu"], r
  assert len(r["seconds"]) == len(r["cpu_seconds"]) == 2
  assert all(t > 0 for t in r["seconds"]), r


def _benchmark(name):
  """A script of benchmarks/, imported as a module."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.pop(0)


def test_bench_transitions_combines_processes_by_median():
  bt = _benchmark("bench_transitions")
  runs = [{"ok": True, "cold_seconds": c, "cold_cpu_seconds": c + 1,
           "warm_seconds": w, "warm_cpu_seconds": w, "process_seconds": 9,
           "cold_peak_bytes": p, "warm_peak_bytes": p, "check": "ok"}
          for c, w, p in ((0.5, 0.2, 10), (0.1, 0.4, 30), (0.3, 0.3, 20))]
  got = bt.combine_runs(runs)
  assert got["cold_seconds"] == 0.3 and got["warm_seconds"] == 0.3
  assert got["cold_cpu_seconds"] == 1.3
  assert got["cold_peak_bytes"] == 30 and got["check"] == "ok"
  assert [r["cold_seconds"] for r in got["runs"]] == [0.5, 0.1, 0.3]
  # one bad check or one failed process decides the case
  bad = bt.combine_runs(runs[:2] + [dict(runs[2], check="x: values differ")])
  assert bad["check"] == "x: values differ"
  failed = bt.combine_runs(runs[:1] + [{"ok": False, "failure": "stalled"}])
  assert not failed["ok"] and failed["failure"] == "stalled"
  assert len(failed["runs"]) == 2


def test_determinism_tables_render_a_committed_run():
  # The committed 100M run (before the CPU seconds were recorded) renders as
  # docs/determinism.md's tables: a row per cell, the temp memory in MiB and
  # the ratios of the JSON's medians and minima.
  rd = _benchmark("render_determinism_md")
  with open(os.path.join(ROOT, "benchmarks",
                         "bench_determinism_100m_result.json")) as f:
    doc = json.load(f)
  mem, times = rd.memory_table(doc).splitlines(), rd.time_table(doc).splitlines()
  assert len(mem) == len(times) == 2 + 16
  assert mem[0].startswith("| dtype | layout | V/n | temp MiB: plain / plain_acc / det")
  assert "| float32 | dp | 8 | 384 / 384 / 1152 / - | 1.00 | 3.00 | - | 3.00 |" in mem
  row = next(r for r in doc["rows"] if (r["dtype"], r["layout"],
                                        r["workers_per_device"]) == ("float32", "dp", 1))
  plain, det = row["seconds"]["plain"], row["seconds"]["det"]
  line = next(l for l in times if l.startswith("| float32 | dp | 1 |"))
  assert f"| {plain:.2f} / {row['min_seconds']['plain']:.2f} |" in line
  assert f"| {det / plain:.2f} / " in line
  assert "100m float32 dp V/n=8 (ms): plain " in rd.profile_lines(doc)
  # a run without plain (plain_acc_cond against plain_acc) is compared with plain_acc
  with open(os.path.join(ROOT, "benchmarks",
                         "bench_determinism_100m_s30_cond_result.json")) as f:
    cond = json.load(f)
  head = rd.time_table(cond).splitlines()[0]
  assert head.startswith("| dtype | layout | V/n | plain_acc s (med / min) |"
                         " plain_acc_cond / plain_acc (med / min / CPU) |"), head
  assert "| float32 | dp | 8 | 384 / 384 / 1176 | 1.00 | 3.06 |" in rd.memory_table(cond)
  assert rd.kernel_table(cond) == ""  # recorded from the thirty-first session on
  # A run that recorded the kernel's share: its system seconds and minor
  # faults per step by method, and the allocator settings it ran with.
  with open(os.path.join(ROOT, "benchmarks",
                         "bench_determinism_100m_s31_arena1_2_result.json")) as f:
    kern = json.load(f)
  table = rd.kernel_table(kern).splitlines()
  assert len(table) == 2 + len(kern["rows"]) == 4
  row = next(r for r in kern["rows"] if r["layout"] == "fsdp")
  line = next(l for l in table if l.startswith("| float32 | fsdp | 8 |"))
  assert f"| {row['glibc_tunables']} |" in line and "arena_max=1" in line
  assert " / ".join(str(round(row["minor_faults"][m] / 1000))
                    for m in ("plain", "plain_acc", "det")) in line
  assert table[-1] in rd.render(kern)
