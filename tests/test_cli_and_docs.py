"""The CLI's core verbs, and every public docstring example (doctest)."""

import doctest
import importlib
import json
import pkgutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax
from tenplex_jax import PTC
from tenplex_jax.cli import main


def test_plan_verb_prints_summary(tmp_path, capsys):
  devs = jax.devices()
  a = Mesh(np.array(devs).reshape(4, 2), ("data", "tensor"))
  b = Mesh(np.array(devs[:4]).reshape(1, 4), ("data", "tensor"))

  def tree(mesh):
    return {"w": jax.ShapeDtypeStruct((64, 32), np.float32,
                                      sharding=NamedSharding(mesh, P(None, "tensor")))}

  (tmp_path / "a.json").write_text(PTC.from_tree(tree(a)).to_json())
  (tmp_path / "b.json").write_text(PTC.from_tree(tree(b)).to_json())
  assert main(["plan", "--from", str(tmp_path / "a.json"),
               "--to", str(tmp_path / "b.json")]) == 0
  out = capsys.readouterr().out
  assert "lower bound" in out and "moved between devices" in out
  assert main(["plan", "--from", str(tmp_path / "a.json"), "--to",
               str(tmp_path / "b.json"), "--json"]) == 0
  d = json.loads(capsys.readouterr().out)
  assert d["moved_bytes"] == d["lower_bound_bytes"] > 0


@pytest.mark.xdist_group("lm_fast_stage_change")
def test_demo_verb_runs_and_matches_static(tmp_path, capsys):
  # The LM trainer's run (the schedule of tests/test_pipeline_lm.py, whose
  # compiled steps it shares: one xdist group, that test first): a stage
  # change 2 -> 4 on 8 -> 4 devices.
  out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
  assert main(["demo", "--steps", "4", "--schedule",
               "0:stage=2,data=2,tensor=2 2:stage=4,mb=2", "--json",
               str(out_json), "--plot", str(out_png)]) == 0
  out = capsys.readouterr().out
  assert out.count("re-meshed onto data=1 x fsdp=1 x stage=4 x tensor=1") == 1
  assert "max |loss - loss of a run that never resized|" in out
  d = json.loads(out_json.read_text())
  assert [r["mesh"]["stage"] for r in d["elastic"]] == [2, 2, 4, 4]
  np.testing.assert_allclose(d["losses"], d["static_losses"], rtol=1e-5)
  assert len(d["reports"]) == 1 and all(
      r["reshard"]["moved_bytes"] == r["reshard"]["lower_bound_bytes"] > 0
      for r in d["reports"])
  assert out_png.stat().st_size > 10_000


def _modules():
  for info in pkgutil.walk_packages(tenplex_jax.__path__, "tenplex_jax."):
    if info.name.endswith("__main__"):
      continue
    yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS
                           | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0
