"""The Fig. 2a example: elastic resume equals the static curve, a naive resume does not."""

import importlib.util
import pathlib
import sys

import numpy as np

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data_resize_loss_curve.py"


def _load():
  spec = importlib.util.spec_from_file_location("data_resize_loss_curve", _PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # flax dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def test_elastic_resume_follows_static_curve_naive_diverges(tmp_path):
  ex = _load()
  result = ex.run(num_samples=100, batch=16, epochs=2, workdir=str(tmp_path))
  c = result["curves"]
  assert len(c["static"]) == len(c["elastic"]) == len(c["naive"]) == 2 * 7
  assert c["elastic"] == c["static"]  # bit for bit
  assert result["elastic_max_abs_diff"] == 0.0
  r = result["resize_step"]
  assert c["naive"][:r] == c["static"][:r]
  assert result["naive_max_abs_diff"] > 1e-3
  assert not np.allclose(c["naive"][r:], c["static"][r:])
  ex.plot(result, str(tmp_path / "curve.png"))
  assert (tmp_path / "curve.png").stat().st_size > 1000


def test_benchmark_runs_and_writes_json(tmp_path):
  import json
  import subprocess
  bench = _PATH.parents[1] / "benchmarks" / "bench_data.py"
  out = tmp_path / "bench.json"
  proc = subprocess.run([sys.executable, str(bench), "--out", str(out), "--samples", "300",
                         "--batch", "32", "--repeats", "1", "--compute-ms", "0.5",
                         "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads(out.read_text())["results"]
  assert "memmap loop (baseline)" in results and "ElasticIterator(reader, prefetch=4)" in results
  assert all(v["samples_per_s"] > 0 for v in results.values())
