"""tenplex_jax.orbax against checkpoints written by stock Orbax.

Every checkpoint here is written by orbax-checkpoint itself
(StandardCheckpointer, PyTreeCheckpointer with OCDBT on/off and zarr v3/v2,
CheckpointManager + StandardSave, the v1 API's save and
training.Checkpointer); restores are compared bitwise with what
Orbax restores onto the same target, shardings with the target, and the
checkpoint directory is hashed before and after every read.
"""

import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax
from tenplex_jax import orbax as tor
from tenplex_jax.errors import NoCopyError, TreeError, UsageError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixtures.lm1b_state import SMALL, abstract_state, make_mesh, make_state  # noqa: E402
import procs  # noqa: E402

KEY = jax.random.key(0).dtype


def dir_hash(d):
  h = hashlib.sha256()
  for root, dirs, files in os.walk(d):
    dirs.sort()
    for f in sorted(files):
      p = os.path.join(root, f)
      h.update(os.path.relpath(p, d).encode())
      with open(p, "rb") as fh:
        h.update(fh.read())
    h.update(("|".join(dirs)).encode())
  return h.hexdigest()


def mesh_of(shape, names, first=0):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[first:first + n]).reshape(shape), names)


def small_tree(mesh):
  """Keys, bfloat16, int8, 0-d leaves, a partially replicated matrix."""
  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))
  w = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48) / 7
  keys = jax.random.split(jax.random.key(3), 8)
  return {
      "params": {"dense": {"kernel": put(w, P("data", "model")),
                           "bias": put(jnp.linspace(0, 1, 48,
                                                    dtype=jnp.bfloat16),
                                       P("model"))},
                 "emb": put(jnp.arange(96, dtype=jnp.int8).reshape(16, 6),
                            P(None, None))},
      "keys": jax.device_put(keys, NamedSharding(mesh, P("data"))),
      "rng": jax.random.key(11),
      "count": put(jnp.int32(42), P()),
  }


def target_of(tree, mesh, specs):
  def one(kp, x):
    name = tenplex_jax.key_path_name(kp)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        mesh, specs.get(name, P())))
  return jax.tree_util.tree_map_with_path(one, tree)


def check_same(got, want, target):
  gl, wl, tl = (jax.tree_util.tree_leaves(t) for t in (got, want, target))
  assert len(gl) == len(wl) == len(tl)
  for g, w, t in zip(gl, wl, tl):
    assert g.dtype == t.dtype and g.shape == t.shape
    assert g.sharding == t.sharding, (g.sharding, t.sharding)
    if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    for a, b in zip(g.addressable_shards, w.addressable_shards):
      assert a.index == b.index
      assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()


VARIANTS = {
    "standard": lambda d, t: _std(d, t),
    "pytree-ocdbt-zarr3": lambda d, t: _pytree(d, t, True, True),
    "pytree-ocdbt-zarr2": lambda d, t: _pytree(d, t, True, False),
    "pytree-files-zarr3": lambda d, t: _pytree(d, t, False, True),
    "pytree-files-zarr2": lambda d, t: _pytree(d, t, False, False),
    "manager": lambda d, t: _mgr(d, t),
    "v1-save": lambda d, t: _v1(d, t),
    "v1-training": lambda d, t: _v1_training(d, t),
}


def _v1(d, tree):  # Orbax's v1 API: <path>/orbax.checkpoint + item "state"
  from orbax.checkpoint import v1 as ocp1
  ocp1.save(os.path.join(d, "ck"), tree)
  return os.path.join(d, "ck"), None


def _v1_training(d, tree):  # v1's manager: <path>/<step>/state
  from orbax.checkpoint import v1 as ocp1
  with ocp1.training.Checkpointer(os.path.join(d, "mgr")) as c:
    c.save(3, tree)
  return os.path.join(d, "mgr"), 3


def _std(d, tree):
  c = ocp.StandardCheckpointer()
  c.save(os.path.join(d, "ck"), tree)
  c.wait_until_finished()
  c.close()
  return os.path.join(d, "ck"), None


def _pytree(d, tree, ocdbt, zarr3):
  c = ocp.PyTreeCheckpointer(use_ocdbt=ocdbt, use_zarr3=zarr3)
  c.save(os.path.join(d, "ck"), tree)
  c.close()
  return os.path.join(d, "ck"), None


def _mgr(d, tree):
  with ocp.CheckpointManager(os.path.join(d, "mgr")) as m:
    m.save(5, args=ocp.args.StandardSave(tree))
    m.save(9, args=ocp.args.StandardSave(tree))
    m.wait_until_finished()
  return os.path.join(d, "mgr"), 9


def orbax_restore(path, target):
  loc = tor.locate(path)
  c = ocp.StandardCheckpointer()
  try:
    return c.restore(loc.item, target)
  finally:
    c.close()


NEW = {"params/dense/kernel": P(None, "t"), "params/dense/bias": P("t"),
       "keys": P("t"), "params/emb": P("t")}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inspect_and_restore_every_variant(tmp_path, variant):
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = small_tree(mesh)
  path, step = VARIANTS[variant](str(tmp_path), tree)
  before = dir_hash(path)
  info = tor.inspect(path)
  assert info["step"] == step
  want = {tenplex_jax.key_path_name(kp): x
          for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  assert set(info["tensors"]) == set(want)
  for name, x in want.items():
    t = info["tensors"][name]
    assert t["shape"] == list(x.shape) and t["dtype"] == str(x.dtype), name
  k = info["tensors"]["params/dense/kernel"]
  assert k["chunk_shape"] == [16, 24] and k["nbytes"] == 64 * 48 * 4
  assert info["format"]["ocdbt"] == ("files" not in variant)
  # The saved layout, as a PTC, is the layout the arrays had.
  saved = tenplex_jax.PTC.from_json(info["layout"])
  live = tenplex_jax.PTC.from_tree(tree)
  for t in live:
    assert saved[t.path].placement == t.placement, t.path
  # Restore onto 4 devices, tensor=4, against Orbax's own restore.
  new = mesh_of((4,), ("t",), first=4)
  target = target_of(tree, new, NEW)
  got = tor.restore(path, target)
  check_same(got, orbax_restore(path, target), target)
  assert dir_hash(path) == before  # nothing that only reads writes


def test_composite_save_with_a_json_item(tmp_path):
  """A ``Composite`` save of arrays and a ``JsonSave`` item: the array item
  is the one restored when none is named (columns on other devices,
  bitwise); naming the JSON item says it holds no arrays, naming none that
  exists lists the items; nothing is written."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  state = {"w": jax.device_put(w, NamedSharding(mesh, P("x")))}
  d = str(tmp_path / "ck")
  with ocp.CheckpointManager(d) as mgr:
    mgr.save(5, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"lr": 0.1})))
    mgr.wait_until_finished()
  before = dir_hash(d)
  s = NamedSharding(Mesh(np.array(jax.devices()[4:6]), ("y",)), P(None, "y"))
  target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=s)}
  for item in (None, "state"):
    out = tor.restore(d, target, item=item)
    assert out["w"].sharding == s
    np.testing.assert_array_equal(np.asarray(out["w"]).view(np.uint32),
                                  w.view(np.uint32))
  with pytest.raises(UsageError, match=r"5/meta holds no arrays .*"
                     r"items with arrays: \['state'\]"):
    tor.restore(d, target, item="meta")
  with pytest.raises(UsageError, match=r"has no item 'nope'; items: "
                     r"\['state'\]"):
    tor.restore(d, target, item="nope")
  assert dir_hash(d) == before


def test_paths_steps_items_and_errors(tmp_path):
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = small_tree(mesh)
  mgr, _ = _mgr(str(tmp_path), tree)
  assert tor.inspect(mgr)["steps"] == [5, 9]
  assert tor.inspect(mgr, step=5)["step"] == 5
  assert tor.inspect(os.path.join(mgr, "5"))["step"] == 5
  assert tor.inspect(os.path.join(mgr, "9", "default"))["step"] == 9
  with pytest.raises(UsageError, match="no step 7"):
    tor.inspect(mgr, step=7)
  with pytest.raises(UsageError, match="not an Orbax checkpoint"):
    tor.inspect(str(tmp_path))
  target = target_of(tree, mesh_of((2,), ("t",)), {})
  target["params"]["dense"]["kernel"] = jax.ShapeDtypeStruct(
      (64, 40), jnp.float32, sharding=target["keys"].sharding)
  target["extra"] = target["count"]
  with pytest.raises(TreeError) as e:
    tor.restore(mgr, target)
  msg = str(e.value)
  assert "params/dense/kernel: the target is float32[64, 40], the checkpoint" \
      " saved float32[64, 48]" in msg, msg
  assert "extra: the target is int32[], the checkpoint saved nothing at this" \
      " path" in msg, msg
  # A misspelt path: the saved path spelt nearly the same is named.
  target = target_of(tree, mesh_of((2,), ("t",)), {})
  target["params"]["dense"]["kernal"] = target["params"]["dense"].pop("kernel")
  with pytest.raises(TreeError) as e:
    tor.restore(mgr, target)
  assert "params/dense/kernal: the target is float32[64, 48], the checkpoint" \
      " saved nothing at this path (saved with a similar path:" \
      " ['params/dense/kernel'])" in str(e.value), str(e.value)


def test_plain_leaves_and_boxed_targets(tmp_path):
  mesh = mesh_of((2,), ("t",))
  w = jax.device_put(jnp.arange(12.0).reshape(4, 3),
                     NamedSharding(mesh, P("t")))
  path, _ = _std(str(tmp_path), {"w": w, "step": 7, "lr": 0.5})
  s = NamedSharding(mesh_of((4,), ("t",)), P("t"))
  boxed = {"w": nn.LogicallyPartitioned(
      jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=s), ("x", None)),
      "step": 0, "lr": 0.0, "note": "kept"}
  out = tor.restore(path, boxed)
  assert isinstance(out["w"], nn.LogicallyPartitioned)
  assert out["w"].value.sharding == s
  assert out["w"].value.tolist() == w.tolist()
  assert out["step"] == 7 and isinstance(out["step"], int)
  assert out["lr"] == 0.5 and out["note"] == "kept"


@pytest.fixture(scope="module")
def lm1b_ckpt(tmp_path_factory):
  """lm1b's small train state, saved by stock Orbax on 8 devices."""
  d = str(tmp_path_factory.mktemp("lm1b"))
  mesh = make_mesh((2, 2, 2))
  state, _ = make_state(mesh, SMALL)
  with ocp.CheckpointManager(os.path.join(d, "mgr")) as m:
    m.save(100, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  return os.path.join(d, "mgr"), state


def lm1b_target(state, mesh, rules):
  abstract, _ = abstract_state(SMALL)
  logical = nn.get_partition_spec(abstract)
  shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)
  shardings = jax.tree_util.tree_map(
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      shardings, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  abstract = jax.tree_util.tree_map(
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
      if isinstance(x, jax.ShapeDtypeStruct) else x, abstract, shardings)


@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 1, 1)],
                         ids=["tensor4", "data2"])
def test_lm1b_state_onto_other_meshes(lm1b_ckpt, shape):
  path, state = lm1b_ckpt
  before = dir_hash(path)
  mesh = make_mesh(shape, jax.devices()[8 - int(np.prod(shape)):])
  rules = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"),
           ("heads", "tensor"))
  target = lm1b_target(state, mesh, rules)
  got, rep = tor.restore_with_report(path, target)
  check_same(got, orbax_restore(path, target), target)
  # Host memory: one buffer per distinct new box of this process.
  distinct = sum(
      sum(np.prod([b - a for a, b in box]) * x.dtype.itemsize
          for box in tenplex_jax.PTC.from_tree({"x": x})["x"].placement.boxes)
      for x in jax.tree_util.tree_leaves(target))
  assert rep.new_shard_bytes == distinct == rep.read_bytes
  assert dir_hash(path) == before


def test_convert_is_restored_by_stock_orbax(tmp_path, lm1b_ckpt):
  path, state = lm1b_ckpt
  before = dir_hash(path)
  mesh = make_mesh((1, 1, 4), jax.devices()[4:])
  rules = (("mlp", "tensor"), ("vocab", "tensor"), ("heads", "tensor"))
  target = lm1b_target(state, mesh, rules)
  layout = tenplex_jax.PTC.from_tree(target)
  lj = tmp_path / "layout.json"
  lj.write_text(layout.to_json())
  dst = str(tmp_path / "out")
  from tenplex_jax.cli import main
  assert main(["ckpt", "convert", path, dst, "--layout", str(lj),
               "--memory-limit", "4MiB", "--quiet"]) == 0
  assert dir_hash(path) == before
  info = tor.inspect(dst)
  assert info["step"] == 100
  for t in layout:  # every new shard is whole chunks
    c = info["tensors"][t.path]["chunk_shape"]
    for box in t.placement.boxes:
      assert all(a % n == 0 and (b - a) % n == 0
                 for (a, b), n in zip(box, c)), t.path
    assert np.prod(c) * t.itemsize <= max(1 << 20, (4 << 20) // 16)
  with ocp.CheckpointManager(dst) as m:
    got = m.restore(100, args=ocp.args.StandardRestore(target))
  check_same(got, orbax_restore(path, target), target)
  with ocp.CheckpointManager(dst) as m:  # no target: the recorded shardings
    bare = m.restore(100)
  want = {tenplex_jax.key_path_name(kp): t for kp, t in
          jax.tree_util.tree_flatten_with_path(target)[0]}
  got_bare = {tenplex_jax.key_path_name(kp): x for kp, x in
              jax.tree_util.tree_flatten_with_path(bare)[0]}
  assert set(got_bare) == set(want)
  for name, x in got_bare.items():
    assert x.sharding == want[name].sharding, (name, x.sharding,
                                                want[name].sharding)
  with pytest.raises(UsageError, match="exists"):
    tor.convert(path, dst, layout)


def test_convert_mesh_rules_without_devices(tmp_path):
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = small_tree(mesh)
  path, _ = _pytree(str(tmp_path), tree, True, True)
  spec = {"mesh": {"x": 2, "t": 4},
          "rules": [["params/dense/kernel", [None, "t"]], ["keys", ["x"]]]}
  rep = tor.convert(path, str(tmp_path / "out"), spec, memory_limit="1MiB")
  assert rep["tensors"] == 6
  info = tor.inspect(str(tmp_path / "out"))
  assert info["tensors"]["params/dense/kernel"]["chunk_shape"] == [64, 12]
  assert info["tensors"]["keys"]["spec"] == "P(x) on x=2xt=4"
  new = mesh_of((2, 4), ("x", "t"))
  target = target_of(tree, new, {"params/dense/kernel": P(None, "t"),
                                 "keys": P("x")})
  got = ocp.StandardCheckpointer().restore(str(tmp_path / "out"), target)
  check_same(got, orbax_restore(path, target), target)
  with pytest.raises(tenplex_jax.LayoutError, match="params/dense/kernel"):
    tor.convert(path, str(tmp_path / "bad"),
                {"mesh": {"t": 5}, "rules": [["params/dense/kernel",
                                              [None, "t"]]]})
  assert not os.path.exists(tmp_path / "bad")


def test_scan_and_unscan_layers(tmp_path):
  mesh = mesh_of((2,), ("t",))
  layers = {f"layers_{i}": {
      "w": jax.device_put(jnp.full((4, 6), i, jnp.float32) + jnp.arange(6.0),
                          NamedSharding(mesh, P(None, "t"))),
      "b": jax.device_put(jnp.arange(6, dtype=jnp.bfloat16) * i,
                          NamedSharding(mesh, P()))} for i in range(3)}
  tree = {"params": {"decoder": layers, "emb": jnp.ones((5, 2))}}
  path, _ = _std(str(tmp_path), tree)
  src = tor.OrbaxSource(path)
  mapping = tor.scan_mapping(list(src.tensors()), axis=1)
  src.close()
  assert mapping["params/decoder/layers/w"]["stack"][2] == \
      "params/decoder/layers_2/w"
  scanned = str(tmp_path / "scanned")
  tor.convert(path, scanned, {"mesh": {"t": 2}, "rules": [
      [".*/layers/w", [None, None, "t"]]]}, mapping=mapping)
  s = NamedSharding(mesh, P(None, None, "t"))
  r = NamedSharding(mesh, P())
  target = {"params": {"decoder": {"layers": {
      "w": jax.ShapeDtypeStruct((4, 3, 6), jnp.float32, sharding=s),
      "b": jax.ShapeDtypeStruct((6, 3), jnp.bfloat16, sharding=r)}},
      "emb": jax.ShapeDtypeStruct((5, 2), jnp.float32, sharding=r)}}
  got = ocp.StandardCheckpointer().restore(scanned, target)
  want_w = np.stack([np.asarray(layers[f"layers_{i}"]["w"])
                     for i in range(3)], axis=1)
  assert np.asarray(got["params"]["decoder"]["layers"]["w"]).tobytes() == \
      want_w.tobytes()
  assert got["params"]["decoder"]["layers"]["w"].sharding == s
  # And back: scanned -> per-layer, equal to the original leaves.
  with tor.OrbaxSource(scanned) as src2:
    back = tor.unscan_mapping(src2.tensors(), axis=1)
  unscanned = str(tmp_path / "unscanned")
  tor.convert(scanned, unscanned, {"mesh": {"t": 1}}, mapping=back)
  tgt = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=r), tree)
  again = tor.restore(unscanned, tgt)
  for a, b in zip(jax.tree_util.tree_leaves(again),
                  jax.tree_util.tree_leaves(tree)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  with pytest.raises(TreeError, match="cannot stack"):
    tor.MappedSource(tor.OrbaxSource(path), {"x": {"stack": [
        "params/decoder/layers_0/w", "params/decoder/layers_0/b"]}})


def test_store_falls_back_to_any_orbax_checkpoint(tmp_path):
  from tenplex_jax import store
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = small_tree(mesh)
  ck, _ = _mgr(str(tmp_path), tree)
  target = target_of(tree, mesh_of((4,), ("t",)), NEW)
  assert store.latest_step(ck) == 9
  got, step = store.restore_checkpoint(ck, target)
  assert step == 9
  check_same(got, orbax_restore(ck, target), target)
  with pytest.raises(NoCopyError, match="no Orbax checkpoint"):
    store.restore_checkpoint(str(tmp_path / "nothing"), target)


def test_store_snapshot_exported_for_stock_orbax(tmp_path):
  """A store snapshot -> an Orbax checkpoint, box by box (no devices, no
  restore first), with and without OCDBT: stock Orbax restores it bitwise;
  the store is only read; the same snapshot restores through the shared
  assemble path."""
  from tenplex_jax import assembly, store
  from tenplex_jax.store.source import StoreSource
  from tenplex_jax.cli import main
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = dict(small_tree(mesh), step=7, opt=(
      {"n": None}, jax.device_put(jnp.float32(0.5), NamedSharding(mesh, P()))))
  d = str(tmp_path / "store")
  store.save(tree, d, step=7)
  before = dir_hash(d)
  t_mesh = mesh_of((2,), ("t",), first=2)
  target = target_of({k: v for k, v in tree.items() if k != "step"}, t_mesh,
                     NEW)
  target["step"] = 0
  target["opt"] = ({"n": None}, target["opt"][1])
  # Python: onto mesh rules; CLI: the saved layout.
  rep = tor.convert(d, str(tmp_path / "tp"), {
      "mesh": {"t": 2}, "rules": [["params/dense/kernel", [None, "t"]]]},
      memory_limit="1MiB", progress=False)
  assert rep["dst"].endswith(os.path.join("tp", "7", "default"))
  assert tor.inspect(str(tmp_path / "tp"))["tensors"]["params/dense/kernel"][
      "chunk_shape"] == [64, 24]
  assert main(["ckpt", "convert", d, str(tmp_path / "same"), "--ocdbt",
               "--quiet"]) == 0
  assert tor.inspect(str(tmp_path / "same"))["format"]["ocdbt"]
  assert not tor.inspect(str(tmp_path / "tp"))["format"]["ocdbt"]
  assert dir_hash(d) == before
  want = jax.tree_util.tree_leaves(tree)
  for out in ("tp", "same"):
    c = ocp.StandardCheckpointer()
    got = c.restore(str(tmp_path / out / "7" / "default"), target)
    c.close()
    assert got["step"] == 7 and isinstance(got["step"], int)
    assert got["opt"][0] == {"n": None}
    for g, w in zip(jax.tree_util.tree_leaves(got), want):
      if isinstance(w, jax.Array):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
          g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
  # The store as a source of boxes: assemble onto the target.
  with StoreSource(d) as src:
    got, arep = assembly.assemble(src, target)
  def arrays(t):
    return dict({k: v for k, v in t.items() if k not in ("step", "opt")},
                o=t["opt"][1])

  want_tree = orbax_restore(str(tmp_path / "same"), target)
  check_same(arrays(got), arrays(want_tree), arrays(target))
  assert got["step"] == 7 and got["opt"][0] == {"n": None}
  assert arep.read_bytes == arep.new_shard_bytes
  with pytest.raises(NoCopyError, match="step 8"):
    StoreSource(d, step=8)
  # (strings are exported: test_store_strings_exported_for_stock_orbax)
  store.save({"c": 1 + 2j}, str(tmp_path / "s2"), step=1)
  with pytest.raises(TreeError, match=r"c: complex \(1\+2j\)"):
    tor.convert(str(tmp_path / "s2"), str(tmp_path / "s2o"))
  assert not os.path.exists(tmp_path / "s2o")


def test_save_and_cli_inspect(tmp_path, capsys):
  mesh = mesh_of((4, 2), ("data", "model"))
  tree = small_tree(mesh)
  item = tor.save(tree, str(tmp_path / "m"), step=3)
  assert item.endswith(os.path.join("3", "default"))
  from tenplex_jax.cli import main
  assert main(["ckpt", "inspect", str(tmp_path / "m"), "--json"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info["step"] == 3 and info["tensors"]["rng"]["dtype"] == "key<fry>"
  assert main(["ckpt", "inspect", str(tmp_path / "m")]) == 0
  table = capsys.readouterr().out
  assert "params/dense/kernel" in table and "12.0 KiB" in table
  assert "P(data, model) on data=4xmodel=2" in table


def test_nnx_state(tmp_path):
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), (None, "model")))
      self.l2 = nnx.Linear(32, 8, rngs=rngs)
      self.rngs = rngs

  mesh = mesh_of((4, 2), ("data", "model"))
  with jax.set_mesh(mesh):
    state = nnx.state(Model(nnx.Rngs(0)))
  path, _ = _std(str(tmp_path), state)
  new = mesh_of((4,), ("model",))
  with jax.set_mesh(new):
    abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
  target = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          new, P(*([None] * (a.ndim - 1)), "model") if a.ndim == 2 else P())),
      abstract)
  got = tor.restore(path, target)
  want = orbax_restore(path, target)
  assert jax.tree_util.tree_structure(got) == \
      jax.tree_util.tree_structure(want)
  for g, w, t in zip(*(jax.tree_util.tree_leaves(x)
                       for x in (got, want, target))):
    assert g.sharding == t.sharding, (g.sharding, t.sharding)
    if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
  # Convert to that layout (target given as the nnx abstract state), then
  # stock Orbax restores the converted checkpoint.
  dst = str(tmp_path / "conv")
  tor.convert(path, dst, target)
  again = orbax_restore(dst, target)
  for g, w in zip(jax.tree_util.tree_leaves(again),
                  jax.tree_util.tree_leaves(want)):
    if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
  assert tor.inspect(dst)["tensors"]["l1/kernel/value"]["chunk_shape"] == \
      [16, 8]


def test_boxed_linen_state_saved_with_its_boxes(tmp_path):
  """Orbax saves ``LogicallyPartitioned`` boxes as ``.../kernel/value``;
  boxed and unboxed targets both restore it."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

  def init():
    return Model().init(jax.random.key(0), jnp.ones((1, 4)))

  isb = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
  rules = (("mlp", "tensor"), ("embed", None))
  abstract = jax.eval_shape(init)

  def shardings(mesh):
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                       rules)
  boxed = jax.jit(init, out_shardings=shardings(
      mesh_of((4, 2), ("data", "tensor"))))()
  path, _ = _std(str(tmp_path), boxed)
  assert "params/Dense_0/kernel/value" in tor.inspect(path)["tensors"]
  new = mesh_of((1, 4), ("data", "tensor"))
  target = jax.tree_util.tree_map(
      lambda a, s: a.replace_boxed(jax.ShapeDtypeStruct(
          a.value.shape, a.value.dtype, sharding=s.unbox() if isb(s) else s))
      if isb(a) else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings(new), is_leaf=isb)
  got = tor.restore(path, target)
  want = orbax_restore(path, target)
  assert isb(got["params"]["Dense_0"]["kernel"])
  unboxed = jax.tree_util.tree_map(lambda x: x.unbox() if isb(x) else x,
                                   target, is_leaf=isb)
  got2 = tor.restore(path, unboxed)
  for g, g2, w, t in zip(*(jax.tree_util.tree_leaves(x)
                           for x in (got, got2, want, target))):
    assert g.sharding == g2.sharding == t.sharding
    assert np.asarray(g).tobytes() == np.asarray(w).tobytes() == \
        np.asarray(g2).tobytes()


def test_store_strings_exported_for_stock_orbax(tmp_path):
  """A store snapshot's strings (kept in its manifest) go to the exported
  checkpoint's ``_strings.json``, where Orbax's own restore reads them
  (before, ``convert`` refused them); the store as a source gives them to a
  string target leaf."""
  from tenplex_jax import assembly, store
  from tenplex_jax.store.source import StoreSource
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  tree = {"w": jax.device_put(w, NamedSharding(mesh, P("x"))),
          "name": "run-7", "cfg": {"act": "gelu"}, "step": 7}
  d = str(tmp_path / "store")
  store.save(tree, d, step=7)
  before = dir_hash(d)
  s = NamedSharding(Mesh(np.array(jax.devices()[4:6]), ("y",)), P(None, "y"))
  for ocdbt in (False, True):
    out = str(tmp_path / f"ck{ocdbt}")
    tor.convert(d, out, {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                                   sharding=s)},
                ocdbt=ocdbt, progress=False)
    with ocp.PyTreeCheckpointer() as c:
      got = c.restore(os.path.join(out, "7", "default"),
                      args=ocp.args.PyTreeRestore(restore_args={
                          "w": ocp.ArrayRestoreArgs(sharding=s),
                          "name": ocp.RestoreArgs(),
                          "cfg": {"act": ocp.RestoreArgs()},
                          "step": ocp.RestoreArgs()}))
    assert got["name"] == "run-7" and got["cfg"] == {"act": "gelu"}
    assert int(got["step"]) == 7 and got["w"].sharding == s
    np.testing.assert_array_equal(np.asarray(got["w"]).view(np.uint32),
                                  w.view(np.uint32))
  assert dir_hash(d) == before
  with StoreSource(d) as src:
    got, _ = assembly.assemble(src, {"name": "", "cfg": {"act": ""}})
  assert got == {"name": "run-7", "cfg": {"act": "gelu"}}


@pytest.mark.parametrize("ocdbt", [False, True])
def test_a_missing_chunk_is_an_error_where_orbax_raises(tmp_path, ocdbt):
  """Orbax's ``_METADATA`` says ``store_array_data_equal_to_fill_value``:
  every chunk was written (zeros too), so a chunk that is not there is
  damage, and Orbax's restore raises. Ours raises too (a StoreError naming
  the leaf), from restore and convert, and convert leaves no destination;
  never zeros in place of the lost data. A checkpoint whose metadata does
  not say so (older Orbax) reads a missing chunk as zeros, as Orbax does."""
  import tensorstore as ts
  from tenplex_jax.errors import StoreError
  mesh = mesh_of((8,), ("d",))
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 1
  tree = {"p": jax.device_put(x, NamedSharding(mesh, P("d")))}
  item = str(tmp_path / "c")
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)) as c:
    c.save(item, args=ocp.args.PyTreeSave(tree))
  with open(os.path.join(item, "_METADATA")) as f:
    assert json.load(f)["store_array_data_equal_to_fill_value"] is True
  # lose the chunk of rows 16-23
  if ocdbt:
    kv = ts.KvStore.open({"driver": "ocdbt",
                          "base": f"file://{item}/"}).result()
    keys = [k.decode() for k in kv.list().result()]
    victim = next(k for k in keys if k.startswith("p/")
                  and k.rsplit("/", 1)[-1] in ("c/2/0", "2.0", "2/0"))
    kv.delete_range(ts.KvStore.KeyRange(victim, victim + "\0")).result()
    assert victim not in [k.decode() for k in kv.list().result()]
  else:
    os.remove(os.path.join(item, "p", "2.0"))
  target = {"p": jax.ShapeDtypeStruct(
      (64, 32), jnp.float32,
      sharding=NamedSharding(mesh_of((2, 2), ("a", "b"), 4), P("b", "a")))}
  with pytest.raises(StoreError, match=r"leaf p \(array p\): a chunk is"
                     r" missing.*damaged or incomplete"):
    tor.restore(item, target)
  # Orbax's own restore refuses it (in a process of its own: the failing
  # restore leaves asyncio callbacks behind that would be reported, as
  # unraisable, in whichever test collects them).
  code = (
      "import jax, orbax.checkpoint as ocp\n"
      "s = jax.sharding.SingleDeviceSharding(jax.devices()[0])\n"
      "try:\n"
      "  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:\n"
      f"    c.restore({item!r}, args=ocp.args.PyTreeRestore(restore_args={{\n"
      "        'p': ocp.ArrayRestoreArgs(sharding=s)}))\n"
      "  print('RESTORED')\n"
      "except Exception as e:\n"
      "  print('REFUSED', 'NOT_FOUND' in str(e) or 'missing' in str(e))\n")
  assert procs.python(code, timeout=120, env={"JAX_PLATFORMS": "cpu"}) \
      .strip().splitlines()[-1] == "REFUSED True"
  dst = str(tmp_path / "converted")
  with pytest.raises(StoreError, match="a chunk is missing"):
    tor.convert(item, dst, target, progress=False)
  assert not os.path.exists(dst)
  # Without the metadata's promise the lost chunk reads as zeros, as Orbax
  # reads it.
  with open(os.path.join(item, "_METADATA")) as f:
    meta = json.load(f)
  meta["store_array_data_equal_to_fill_value"] = False
  with open(os.path.join(item, "_METADATA"), "w") as f:
    json.dump(meta, f)
  want = x.copy()
  want[16:24] = 0
  np.testing.assert_array_equal(np.asarray(tor.restore(item, target)["p"]),
                                want)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
    got = c.restore(item, args=ocp.args.PyTreeRestore(restore_args={
        "p": ocp.ArrayRestoreArgs(sharding=target["p"].sharding)}))
  np.testing.assert_array_equal(np.asarray(got["p"]), want)


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_restore_into_host_memory(tmp_path, kind):
  """A target in another memory of the devices (an optimizer state offloaded
  to host memory: ``NamedSharding(..., memory_kind="pinned_host")``), from a
  stock Orbax checkpoint and from a store snapshot: every array, PRNG keys
  too, lands in that memory, bitwise, with the target's sharding, as
  Orbax's restore and ``jax.device_put`` place it (before: jax refused the
  arrays, "Memory kind mismatch")."""
  from tenplex_jax import store
  mesh = mesh_of((8,), ("d",))
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  keys = jax.random.split(jax.random.key(0), 8)
  tree = {"p": jax.device_put(x, NamedSharding(mesh, P("d"))),
          "k": jax.device_put(keys, NamedSharding(mesh, P("d")))}
  with ocp.StandardCheckpointer() as c:
    c.save(str(tmp_path / "c"), tree)
  store.save(tree, str(tmp_path / "s"), step=3)
  m4 = mesh_of((2, 2), ("a", "b"), 4)
  target = {
      "p": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(
          m4, P("b", "a"), memory_kind=kind)),
      "k": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(
          m4, P("a"), memory_kind=kind))}
  with ocp.StandardCheckpointer() as c:
    ref = c.restore(str(tmp_path / "c"), target)
  for out in (tor.restore(str(tmp_path / "c"), target),
              store.restore(str(tmp_path / "s"), target)):
    for k in ("p", "k"):
      assert out[k].sharding == target[k].sharding == ref[k].sharding
      assert out[k].sharding.memory_kind == kind
      assert {s.data.sharding.memory_kind
              for s in out[k].addressable_shards} == {kind}
    np.testing.assert_array_equal(np.asarray(out["p"]).view(np.uint32),
                                  x.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(out["k"])),
                                  np.asarray(jax.random.key_data(keys)))
