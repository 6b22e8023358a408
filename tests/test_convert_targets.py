"""Conversion targets that say nothing are errors, never a silent copy in the
saved layout: a layout JSON of the wrong shape, an unknown key, a rule whose
regex matches no tensor (unless ``--allow-unmatched``, then a warning naming
it). Each case checks the exit status, the one error line and that the
destination was not created."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tenplex_jax.orbax as tor
from tenplex_jax.cli import main
from tenplex_jax.errors import LayoutError, TreeError, UnmatchedRuleWarning

STATE = {"params": {"dense": {"kernel": np.arange(32.0, dtype=np.float32)
                              .reshape(8, 4),
                              "bias": np.zeros(4, np.float32)}},
         "step": 2}
RULES = [["params/.*/kernel", [None, "tensor"]]]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  d = tmp_path_factory.mktemp("src")
  return tor.save(jax.tree.map(jnp.asarray, STATE), str(d / "ck"), step=2)


BAD = [
    # (layout JSON, words the one error line must hold)
    ({"params/dense/kernel": [None, "tensor"]},
     ["names no layout", "params/dense/kernel", '"mesh"']),
    ({"rules": RULES}, ["needs 'mesh'"]),
    ({"mesh": {"tensor": 2}, "rules": RULES, "devices_per_proces": 2},
     ["unknown keys ['devices_per_proces']", "mesh", "rules"]),
    ({"mesh": {"tensor": "two"}, "rules": RULES}, ["needs 'mesh'", "two"]),
    ({"mesh": {"tensor": 2}, "rules": [["params/.*/kernel"]]},
     ["rule 0 must be [regex,"]),
    ({"mesh": {"tensor": 2}, "rules": [["params/(", [None]]]},
     ["rule 0", "does not compile"]),
    ([["params/.*/kernel", [None, "tensor"]]], ["names no layout", "list"]),
    ({"mesh": {"tensor": 2}, "rules": [["params/.*/kernal", [None, "tensor"]],
                                       *RULES]},
     ["rules match no tensor", "'params/.*/kernal' (rule 0)",
      "--allow-unmatched"]),
]


@pytest.mark.parametrize("layout,words", BAD)
def test_cli_rejects_layouts_that_say_nothing(src, tmp_path, capsys, layout,
                                              words):
  lj = tmp_path / "layout.json"
  lj.write_text(json.dumps(layout))
  dst = tmp_path / "dst"
  assert main(["ckpt", "convert", src, str(dst), "--layout", str(lj),
               "--quiet"]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("tenplex-jax: error: "), err
  for w in words:
    assert w in lines[0], (w, err)
  assert not dst.exists() and os.listdir(tmp_path) == ["layout.json"]


@pytest.mark.parametrize("layout,words", BAD)
def test_python_api_rejects_them_too(src, tmp_path, layout, words):
  with pytest.raises(LayoutError) as e:
    tor.convert(src, str(tmp_path / "dst"), layout, progress=False)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  assert not os.path.exists(tmp_path / "dst")


def test_allow_unmatched_warns_naming_the_rule(src, tmp_path, capsys):
  layout = {"mesh": {"tensor": 2},
            "rules": [["params/.*/kernal", [None, "tensor"]], *RULES]}
  lj = tmp_path / "layout.json"
  lj.write_text(json.dumps(layout))
  dst = tmp_path / "dst"
  assert main(["ckpt", "convert", src, str(dst), "--layout", str(lj),
               "--quiet", "--allow-unmatched"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["tensors"] == 3  # kernel, bias, step
  assert err.strip().splitlines() == [err.strip()], err
  assert err.startswith("tenplex-jax: warning: layout rules match no tensor:"
                        " 'params/.*/kernal' (rule 0)"), err
  # The rules that matched applied.
  assert tor.inspect(str(dst))["tensors"]["params/dense/kernel"][
      "chunk_shape"] == [8, 2]
  with pytest.warns(UnmatchedRuleWarning, match=r"'params/\.\*/kernal'"):
    tor.convert(src, str(tmp_path / "dst2"), layout, allow_unmatched=True,
                progress=False)


def test_tree_targets_are_matched_like_restore_targets(src, tmp_path):
  mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
  s = NamedSharding(mesh, P(None, "tensor"))
  sds = jax.ShapeDtypeStruct
  # A tree leaf that is no sharded ShapeDtypeStruct names its path.
  with pytest.raises(TreeError, match=r"params/dense/bias: the target leaf"
                     r" is str .replicated., not a jax.ShapeDtypeStruct"):
    tor.convert(src, str(tmp_path / "a"), {"params": {"dense": {
        "kernel": sds((8, 4), jnp.float32, sharding=s),
        "bias": "replicated"}}}, progress=False)
  with pytest.raises(TreeError, match=r"params/dense/kernel: the target is"
                     r" float32\[8, 2\], the source saved float32\[8, 4\]"):
    tor.convert(src, str(tmp_path / "b"), {"params": {"dense": {
        "kernel": sds((8, 2), jnp.float32, sharding=s)}}}, progress=False)
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(
      tmp_path / "b")
  # Shardings on an AbstractMesh, bound to the mesh in context.
  abstract = NamedSharding(mesh.abstract_mesh, P(None, "tensor"))
  with jax.set_mesh(mesh):
    tor.convert(src, str(tmp_path / "c"), {"params": {"dense": {
        "kernel": sds((8, 4), jnp.float32, sharding=abstract)}}},
        progress=False)
  assert tor.inspect(str(tmp_path / "c"))["tensors"]["params/dense/kernel"][
      "chunk_shape"] == [8, 2]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = tor.restore(str(tmp_path / "c"), {"params": {"dense": {
        "kernel": sds((8, 4), jnp.float32, sharding=s)}}})
  np.testing.assert_array_equal(np.asarray(out["params"]["dense"]["kernel"]),
                                STATE["params"]["dense"]["kernel"])


def test_tree_target_plain_leaves_keep_the_saved_layout(src, tmp_path):
  """An abstract state whose scalars have no sharding (jax.eval_shape
  without a mesh) converts: those leaves keep their saved layout; a
  PartitionSpec where a sharded ShapeDtypeStruct belongs is an error."""
  mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
  s = NamedSharding(mesh, P(None, "tensor"))
  sds = jax.ShapeDtypeStruct
  target = {"params": {"dense": {"kernel": sds((8, 4), jnp.float32,
                                               sharding=s),
                                 "bias": sds((4,), jnp.float32)}},
            "step": 0}
  tor.convert(src, str(tmp_path / "a"), target, progress=False)
  t = tor.inspect(str(tmp_path / "a"))["tensors"]
  assert t["params/dense/kernel"]["chunk_shape"] == [8, 2]
  assert t["params/dense/bias"]["chunk_shape"] == [4]
  target["params"]["dense"]["bias"] = P("tensor")
  with pytest.raises(TreeError, match=r"params/dense/bias: the target leaf is"
                     r" PartitionSpec\('tensor',\), not a"):
    tor.convert(src, str(tmp_path / "b"), target, progress=False)
  assert not os.path.exists(tmp_path / "b")


def test_the_console_entry_exits_2_with_one_line(src, tmp_path):
  """Through ``python -m tenplex_jax``: a tree of per-tensor specs as the
  layout (the mistake of the issue) exits 2 with one error line, nothing
  on stdout, no destination."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": ""}
  lj = tmp_path / "layout.json"
  lj.write_text(json.dumps({"params/dense/kernel": [None, "tensor"]}))
  dst = tmp_path / "dst"
  p = subprocess.run([sys.executable, "-m", "tenplex_jax", "ckpt", "convert",
                      src, str(dst), "--layout", str(lj)], env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p
  assert p.stdout == "", p
  assert p.stderr.startswith("tenplex-jax: error: the target names no"
                             " layout") and p.stderr.count("\n") == 1, p
  assert not dst.exists()
