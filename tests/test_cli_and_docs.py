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


def test_demo_verb_runs_and_matches_static(tmp_path, capsys):
  out_json = tmp_path / "demo.json"
  assert main(["demo", "--steps", "12", "--schedule", "0:4x2,4:2x2,8:2x4",
               "--json", str(out_json)]) == 0
  out = capsys.readouterr().out
  assert out.count("re-meshed onto") == 2
  d = json.loads(out_json.read_text())
  np.testing.assert_allclose(d["losses"], d["static_losses"], rtol=1e-5)
  assert all(r["reshard"]["moved_bytes"] == r["reshard"]["lower_bound_bytes"]
             for r in d["reports"])


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
