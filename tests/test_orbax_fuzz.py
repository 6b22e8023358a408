"""Regressions found by fuzzing ``tenplex_jax.orbax`` with stock Orbax
checkpoints (random trees, dtypes, shardings, save methods and targets).

Each checkpoint is written by orbax-checkpoint itself; values are compared
bitwise with Orbax's own restore into the same target.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import orbax as tor
from tenplex_jax.errors import TreeError, UsageError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_orbax import dir_hash as _dir_hash  # noqa: E402




def _save(path, tree):
  with ocp.StandardCheckpointer() as c:
    c.save(path, tree)


def _target(tree, sharding):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      tree)


def _bits(x):
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def test_convert_bool_leaf(tmp_path):
  """A bool leaf converts (zarr v3 wants a JSON boolean fill value; 0 made
  tensorstore refuse the array) and restores bitwise, also through Orbax."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  mask = jnp.asarray(np.random.default_rng(0).random((8, 3)) < 0.5)
  tree = {"mask": jax.device_put(mask, NamedSharding(mesh, P("x"))),
          "w": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))}
  src = str(tmp_path / "src")
  _save(src, tree)
  before = _dir_hash(src)
  new = Mesh(np.array(jax.devices()[4:6]), ("y",))
  target = {"mask": jax.ShapeDtypeStruct((8, 3), jnp.bool_,
                                         sharding=NamedSharding(new,
                                                                P(None, None))),
            "w": jax.ShapeDtypeStruct((8,), jnp.float32,
                                      sharding=NamedSharding(new, P("y")))}
  dst = str(tmp_path / "dst")
  tor.convert(src, dst, target)
  assert _dir_hash(src) == before
  ours = tor.restore(dst, target)
  theirs = ocp.StandardCheckpointer().restore(dst, target)
  for k in tree:
    assert ours[k].dtype == tree[k].dtype
    assert ours[k].sharding == target[k].sharding
    np.testing.assert_array_equal(_bits(ours[k]), _bits(tree[k]))
    np.testing.assert_array_equal(_bits(theirs[k]), _bits(tree[k]))


def test_restore_empty_string_key(tmp_path):
  """A dict key ``""`` is restored (Orbax restores it) and listed as ``""``
  by inspect, not as ``"."`` (the name of a bare, keyless leaf)."""
  tree = {"": jnp.arange(4.0), "a": jnp.ones(2, jnp.int8)}
  path = str(tmp_path / "c")
  _save(path, tree)
  before = _dir_hash(path)
  s = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
  target = _target(tree, s)
  ours = tor.restore(path, target)
  theirs = ocp.StandardCheckpointer().restore(path, target)
  assert sorted(tor.inspect(path)["tensors"]) == ["", "a"]
  for k in tree:
    assert ours[k].sharding == s
    np.testing.assert_array_equal(_bits(ours[k]), _bits(theirs[k]))
    np.testing.assert_array_equal(_bits(ours[k]), _bits(tree[k]))
  assert _dir_hash(path) == before


def test_restore_bare_leaf_still_named_dot(tmp_path):
  """A checkpoint of one bare array (no keys) keeps the name ``.``."""
  path = str(tmp_path / "c")
  ocp.PyTreeCheckpointer().save(path, jnp.arange(6.0))
  assert list(tor.inspect(path)["tensors"]) == ["."]
  s = jax.sharding.SingleDeviceSharding(jax.devices()[3])
  out = tor.restore(path, jax.ShapeDtypeStruct((6,), jnp.float32, sharding=s))
  np.testing.assert_array_equal(np.asarray(out), np.arange(6.0))
  assert out.sharding == s


@pytest.mark.parametrize("ocdbt", [False, True])
def test_convert_empty_string_key(tmp_path, ocdbt):
  """A dict key ``""`` (Orbax's parameter ``""``, the item's root) converts;
  the result restores bitwise through us and through Orbax."""
  tree = {"": jnp.arange(8.0), "a": jnp.arange(6, dtype=jnp.int32)}
  src = str(tmp_path / "src")
  _save(src, tree)
  before = _dir_hash(src)
  s = NamedSharding(Mesh(np.array(jax.devices()[2:4]), ("x",)), P("x"))
  target = _target(tree, s)
  dst = str(tmp_path / "dst")
  tor.convert(src, dst, target, ocdbt=ocdbt)
  assert _dir_hash(src) == before
  ours = tor.restore(dst, target)
  theirs = ocp.StandardCheckpointer().restore(dst, target)
  for k in tree:
    assert ours[k].sharding == s
    np.testing.assert_array_equal(_bits(ours[k]), _bits(tree[k]))
    np.testing.assert_array_equal(_bits(theirs[k]), _bits(tree[k]))


@pytest.mark.parametrize("saved,wanted", [
    ("float32", "int8"), ("float32", "bool"), ("int8", "float32"),
    ("bfloat16", "float32"), ("float32", "bfloat16"), ("uint8", "int32")])
def test_restore_casts_like_orbax(tmp_path, saved, wanted):
  """A target dtype other than the saved one is a cast, bitwise what Orbax's
  restore into the same target gives (docs/orbax.md)."""
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((8, 6)) * 100).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  tree = {"w": jax.device_put(jnp.asarray(x).astype(saved),
                              NamedSharding(mesh, P("x")))}
  path = str(tmp_path / "c")
  _save(path, tree)
  new = Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("a", "b"))
  s = NamedSharding(new, P("b", "a"))
  target = {"w": jax.ShapeDtypeStruct((8, 6), jnp.dtype(wanted), sharding=s)}
  ours = tor.restore(path, target)["w"]
  theirs = ocp.StandardCheckpointer().restore(path, target)["w"]
  assert ours.dtype == jnp.dtype(wanted) and ours.sharding == s
  np.testing.assert_array_equal(_bits(ours), _bits(theirs))


def test_convert_refuses_a_cast_naming_the_leaf(tmp_path):
  """``convert`` does not cast: a target dtype other than the saved one is
  a ``TreeError`` naming the leaf and both dtypes."""
  src = str(tmp_path / "src")
  _save(src, {"p": {"w": jnp.ones((4, 2), jnp.bfloat16)}})
  s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"p": {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32,
                                            sharding=s)}}
  with pytest.raises(TreeError) as e:
    tor.convert(src, str(tmp_path / "dst"), target)
  assert "p/w: the target is float32[4, 2], the source saved bfloat16[4, 2]" \
      in str(e.value)
  assert not os.path.exists(tmp_path / "dst")


@pytest.mark.parametrize("ocdbt", [False, True])
def test_keys_holding_a_slash_that_collide_are_refused(tmp_path, ocdbt):
  """``{"a/b": x, "a": {"b": y}}``: Orbax keeps the two leaves apart
  (parameters ``a/b`` and ``a.b``); matched by ``/``-joined path they are
  one name, and the restore put ``x`` into ``a/b`` silently. Now a
  ``TreeError`` names the path and both key tuples; a key holding ``/``
  that collides with nothing still restores bitwise."""
  s = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  bad = str(tmp_path / "bad")
  tree = {"a/b": jnp.arange(4.0), "a": {"b": jnp.arange(4.0) + 100}}
  ocp.PyTreeCheckpointer(use_ocdbt=ocdbt).save(bad, tree)
  before = _dir_hash(bad)
  with pytest.raises(TreeError) as e:
    tor.restore(bad, _target(tree, s))
  assert ("saved leaves share a path name (a dict key holds '/'), so they "
          "cannot be told apart: 'a/b' is each of ") in str(e.value)
  assert "('a', 'b')" in str(e.value) and "('a/b',)" in str(e.value)
  assert _dir_hash(bad) == before
  good = str(tmp_path / "good")
  tree = {"a/b": jnp.arange(4.0), "c": {"b": jnp.arange(4.0) + 100}}
  ocp.PyTreeCheckpointer(use_ocdbt=ocdbt).save(good, tree)
  out = tor.restore(good, _target(tree, s))
  for k, v in (("a/b", tree["a/b"]), ("c", tree["c"]["b"])):
    got = out[k] if k == "a/b" else out[k]["b"]
    assert got.sharding == s
    np.testing.assert_array_equal(_bits(got), _bits(v))


def test_a_step_or_item_that_the_path_contradicts_is_refused(tmp_path):
  # step= and item= pick within a manager or step directory; a path that is
  # already one step's (or one item's) directory used to ignore them and
  # restore that step silently.
  d = str(tmp_path / "ckpt")
  with ocp.CheckpointManager(d) as m:
    for step in (5, 10):
      m.save(step, args=ocp.args.StandardSave(
          {"w": jnp.full((2,), float(step))}))
  s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tgt = {"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=s)}
  before = _dir_hash(d)
  assert float(tor.restore(d, tgt, step=5)["w"][0]) == 5.0
  assert float(tor.restore(f"{d}/10", tgt, step=10)["w"][0]) == 10.0
  assert float(tor.restore(f"{d}/10/default", tgt, item="default")["w"][0]) \
      == 10.0
  with pytest.raises(UsageError, match=r"/10 is the step directory of "
                     "step 10, not step 5; give the CheckpointManager"):
    tor.restore(f"{d}/10", tgt, step=5)
  with pytest.raises(UsageError, match=r"/10/default is an item "
                     "directory of step 10, not step 5"):
    tor.restore(f"{d}/10/default", tgt, step=5)
  with pytest.raises(UsageError, match=r"/10/default is the item "
                     "'default', not 'other'"):
    tor.restore(f"{d}/10/default", tgt, item="other")
  assert _dir_hash(d) == before


@pytest.mark.parametrize("ocdbt", [False, True])
def test_sub_chunked_save_restores_and_converts_bitwise(tmp_path, ocdbt):
  """A checkpoint saved with Orbax's sub-chunking (``SaveArgs(
  chunk_byte_size=...)``: several chunks per saved shard, what Orbax
  advises for restores into other layouts) restores into columns on other
  devices and replicated, bitwise what was saved and what Orbax's own
  restore gives; converted to columns it restores bitwise through Orbax."""
  rng = np.random.default_rng(7)
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  rows = NamedSharding(mesh, P("x"))
  tree = {"w": rng.standard_normal((16, 24)).astype(np.float32),
          "e": rng.standard_normal((8, 12)).astype(jnp.bfloat16),
          "t": rng.integers(-100, 100, (12, 8)).astype(np.int8)}
  state = {k: jax.device_put(v, rows) for k, v in tree.items()}
  src = str(tmp_path / "src")
  with ocp.PyTreeCheckpointer(use_ocdbt=ocdbt) as c:
    c.save(src, state, save_args=jax.tree.map(
        lambda _: ocp.SaveArgs(chunk_byte_size=96), state))
  w = tor.inspect(src)["tensors"]["w"]
  assert np.prod(w["chunk_shape"]) < 16 * 24 // 4, w  # chunks < a shard
  before = _dir_hash(src)
  new = Mesh(np.array(jax.devices()[5:7]), ("y",))
  for s in (NamedSharding(new, P(None, "y")), NamedSharding(new, P())):
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
              for k, v in tree.items()}
    ours = tor.restore(src, target)
    theirs = ocp.PyTreeCheckpointer().restore(src, args=ocp.args.PyTreeRestore(
        restore_args=jax.tree.map(
            lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)))
    for k, v in tree.items():
      assert ours[k].sharding == s and ours[k].dtype == v.dtype
      np.testing.assert_array_equal(_bits(ours[k]), _bits(v))
      np.testing.assert_array_equal(_bits(theirs[k]), _bits(v))
  cols = NamedSharding(new, P(None, "y"))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=cols)
            for k, v in tree.items()}
  dst = str(tmp_path / "dst")
  tor.convert(src, dst, target, ocdbt=ocdbt, progress=False)
  assert _dir_hash(src) == before  # the source only read
  back = ocp.PyTreeCheckpointer().restore(dst, args=ocp.args.PyTreeRestore(
      restore_args=jax.tree.map(
          lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)))
  for k, v in tree.items():
    assert back[k].sharding == cols
    np.testing.assert_array_equal(_bits(back[k]), _bits(v))


@pytest.mark.parametrize("ocdbt", [False, True])
def test_saved_strings_restore_and_convert(tmp_path, ocdbt):
  """Orbax keeps a tree's strings in the item's ``_strings.json``: a string
  target leaf takes the saved string (a top-level and a nested one; one
  where nothing is saved passes through), and ``convert`` carries them, so
  that stock Orbax restores the converted checkpoint whole (before, it
  listed the strings in ``_METADATA`` without their file and Orbax's
  restore failed)."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  tree = {"w": jax.device_put(w, NamedSharding(mesh, P("x"))),
          "name": "hello", "cfg": {"act": "gelu"}, "lr": 0.5}
  src = str(tmp_path / "src")
  with ocp.PyTreeCheckpointer(use_ocdbt=ocdbt) as c:
    c.save(src, tree)
  before = _dir_hash(src)
  s = NamedSharding(Mesh(np.array(jax.devices()[4:6]), ("y",)), P(None, "y"))
  target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=s),
            "name": "", "cfg": {"act": "", "extra": "kept"}, "lr": 0.0}
  out = tor.restore(src, target)
  assert out["name"] == "hello" and out["cfg"] == {"act": "gelu",
                                                   "extra": "kept"}
  # A type mix-up is an error naming the leaf and both types.
  with pytest.raises(TreeError, match="name: the target is int 0, the"
                     " checkpoint saved a string"):
    tor.restore(src, {"name": 0})
  with pytest.raises(TreeError, match=r"lr: the target is a string, the"
                     r" checkpoint saved float64\[\]"):
    tor.restore(src, {"lr": ""})
  assert out["lr"] == 0.5 and isinstance(out["lr"], float)
  np.testing.assert_array_equal(_bits(out["w"]), _bits(w))
  dst = str(tmp_path / "dst")
  tor.convert(src, dst, {"w": target["w"]}, ocdbt=ocdbt, progress=False)
  assert _dir_hash(src) == before
  with ocp.PyTreeCheckpointer() as c:
    back = c.restore(dst, args=ocp.args.PyTreeRestore(restore_args={
        "w": ocp.ArrayRestoreArgs(sharding=s), "name": ocp.RestoreArgs(),
        "cfg": {"act": ocp.RestoreArgs()}, "lr": ocp.RestoreArgs()}))
  assert back["name"] == "hello" and back["cfg"] == {"act": "gelu"}
  assert float(back["lr"]) == 0.5 and back["w"].sharding == s
  np.testing.assert_array_equal(_bits(back["w"]), _bits(w))


@pytest.mark.parametrize("dtype", ["complex64", "float8_e4m3fn", "int4"])
def test_convert_narrow_and_complex_dtypes(tmp_path, dtype):
  """Leaves Orbax saves in these dtypes convert into columns on other
  devices (complex needs zarr v3's [re, im] zero as its fill value;
  tensorstore refused 0) and restore bitwise through Orbax and through us."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  x = np.arange(48).reshape(8, 6) % 7 - 3
  v = (x + 1j * x if dtype == "complex64" else x).astype(jnp.dtype(dtype))
  tree = {"a": jax.device_put(v, NamedSharding(mesh, P("x")))}
  src = str(tmp_path / "src")
  _save(src, tree)
  s = NamedSharding(Mesh(np.array(jax.devices()[4:6]), ("y",)), P(None, "y"))
  target = _target(tree, s)
  dst = str(tmp_path / "dst")
  tor.convert(src, dst, target, progress=False)
  theirs = ocp.StandardCheckpointer().restore(dst, target)["a"]
  ours = tor.restore(dst, target)["a"]
  for got in (theirs, ours):
    assert got.dtype == v.dtype and got.sharding == s
    np.testing.assert_array_equal(_bits(got), _bits(v))
