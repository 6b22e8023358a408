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
