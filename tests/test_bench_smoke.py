"""Smoke test of benchmarks/bench_reshard.py: quick mode, one transition.

No timing assertions: it checks that the benchmark runs end to end, that the
resharded values and shardings are checked, and that the JSON has its fields.
"""

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


def test_bench_pipeline_quick(tmp_path):
  """benchmarks/bench_pipeline.py --quick: every layout runs and gives the
  data-parallel step's loss; the JSON has the step times and the bubble."""
  out = tmp_path / "pipe.json"
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_pipeline.py"), "--quick",
       "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  doc = json.loads(out.read_text())
  cases = {"data-parallel", "pipeline 2x2"}
  assert set(doc["step_s"]) == set(doc["loss"]) == cases
  assert all(v > 0 for v in doc["step_s"].values())
  assert doc["loss_max_rel_diff"] < 1e-5
  by_m = doc["bubble"]["2"]["by_microbatches"]
  assert {m: round(v["theory"], 6) for m, v in by_m.items()} == {"2": round(1 / 3, 6),
                                                                   "4": 0.2}
  assert all(v["stack_s"] > 0 for v in by_m.values())
