"""Single-process tests of the tensor store: dtypes, sub-tensor reads,
checksums, atomic snapshots, the store server and its errors."""

import os
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import store
from tenplex_jax.store import (ChecksumError, HostStore, RemoteStore, StoreError,
                               make_server, parse_index)

DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
          "int4", "uint4", "int8", "uint16", "int32", "bool", "complex64"]


def _mesh(n, shape, names=("d", "t"), start=0):
  return Mesh(np.array(jax.devices()[start:start + n]).reshape(shape), names)


def _value(dtype, shape, seed=0):
  rng = np.random.default_rng(seed)
  if dtype == "bool":
    return rng.integers(0, 2, shape).astype(bool)
  if dtype in ("int4", "uint4"):
    lo = -8 if dtype == "int4" else 0
    return rng.integers(lo, lo + 16, shape).astype(getattr(ml_dtypes, dtype))
  dt = jnp.dtype(dtype)
  if jnp.issubdtype(dt, jnp.integer):
    return rng.integers(0, 100, shape).astype(dt)
  if jnp.issubdtype(dt, jnp.complexfloating):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
            ).astype(dt)
  return rng.standard_normal(shape).astype(dt)


def _bits(a):
  a = np.asarray(a).reshape(-1)
  return a.view(np.uint8)


@pytest.fixture
def sdir(tmp_path):
  return str(tmp_path / "store")


def test_every_dtype_round_trips_bitwise_onto_a_new_layout(sdir):
  src, dst = _mesh(4, (2, 2)), _mesh(4, (1, 4), start=4)
  tree, target = {}, {}
  for i, dt in enumerate(DTYPES):
    x = _value(dt, (8, 4), i)
    tree[dt] = jax.device_put(x, NamedSharding(src, P("t", "d")))
    target[dt] = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                      sharding=NamedSharding(dst, P(None, "t")))
  tree["scalar"] = jax.device_put(np.float32(3.5), NamedSharding(src, P()))
  target["scalar"] = jax.ShapeDtypeStruct((), jnp.float32,
                                          sharding=NamedSharding(dst, P()))
  tree["empty"] = jax.device_put(np.zeros((0, 4), np.int32),
                                 NamedSharding(src, P(None, "d")))
  target["empty"] = jax.ShapeDtypeStruct((0, 4), jnp.int32,
                                         sharding=NamedSharding(dst, P()))
  keys = jax.random.split(jax.random.key(3), 4)
  tree["key"] = jax.device_put(keys, NamedSharding(src, P("t")))
  target["key"] = jax.ShapeDtypeStruct(keys.shape, keys.dtype,
                                       sharding=NamedSharding(dst, P("t")))
  tree.update(step=12, name="run", lr=0.5, table=np.arange(3))
  target.update(step=0, name="", lr=0.0, table=np.zeros(3, np.int64))
  store.save(tree, sdir, step=12)
  out, rep = store.restore_with_report([sdir], target)
  for k, t in target.items():
    if isinstance(t, jax.ShapeDtypeStruct):
      assert out[k].sharding == t.sharding, k
      assert out[k].dtype == t.dtype and out[k].shape == t.shape, k
      a, b = (jax.random.key_data(out[k]), jax.random.key_data(tree[k])) \
          if k == "key" else (out[k], tree[k])
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=k)
  assert (out["step"], out["name"], out["lr"]) == (12, "run", 0.5)
  np.testing.assert_array_equal(out["table"], np.arange(3))
  assert rep.network_bytes == 0 and rep.local_bytes > 0


def test_sub_tensor_reads_by_slice_and_string_form(sdir):
  x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
  a = jax.device_put(x, NamedSharding(_mesh(2, (1, 2)), P(None, "t")))
  store.save({"params": {"w": a}}, sdir)
  st = HostStore(sdir)
  assert st.list() == ["params/w"]
  (info,) = st.describe()
  assert info.boxes == (((0, 6), (0, 4)), ((0, 6), (4, 8)))
  assert info.nbytes == x.nbytes and info.dtype == "float32"
  np.testing.assert_array_equal(st.read("params/w", "[:, 2:4]"), x[:, 2:4])
  np.testing.assert_array_equal(st.read("params/w", (slice(1, 3), 5)),
                                x[1:3, 5:6])
  np.testing.assert_array_equal(st.read("params/w", "[4:, 4:8]"), x[4:, 4:])
  # A range spanning two boxes is assembled from both (store read).
  np.testing.assert_array_equal(st.read("params/w", "[:, 2:6]"), x[:, 2:6])
  np.testing.assert_array_equal(st.read("params/w"), x)
  with pytest.raises(StoreError, match="no tensor 'nope'"):
    st.read("nope")
  assert parse_index("[:, 2:4]", (6, 8)) == ((0, 6), (2, 4))
  assert parse_index("[..., -1]", (6, 8)) == ((0, 6), (7, 8))
  with pytest.raises(StoreError, match="unit-step"):
    parse_index("[::2]", (6,))
  with pytest.raises(StoreError, match="rank 2"):
    parse_index("[1, 2, 3]", (6, 8))


def test_corrupt_chunk_is_detected_by_checksum(sdir):
  x = np.arange(64, dtype=np.int32)
  store.save({"v": jax.device_put(x, jax.devices()[0])}, sdir)
  st = HostStore(sdir)
  snap = st.snapshot_dir(0)
  chunk = os.path.join(snap, "data", "v", "b0", "c", "0")
  with open(chunk, "r+b") as f:
    f.seek(17)
    b = f.read(1)
    f.seek(17)
    f.write(bytes([b[0] ^ 1]))
  with pytest.raises(ChecksumError, match="v box"):
    HostStore(sdir).read("v")
  assert HostStore(sdir).verify()  # reports the problem
  tgt = {"v": jax.ShapeDtypeStruct((64,), jnp.int32,
                                   sharding=NamedSharding(_mesh(1, (1, 1)), P()))}
  with pytest.raises(StoreError, match="every copy failed"):
    store.restore([sdir], tgt)


def test_failed_save_never_replaces_a_good_snapshot(sdir):
  good = jax.device_put(np.ones(4, np.float32), jax.devices()[0])
  store.save({"w": good}, sdir, step=1)

  bad = {"w": good, "z": jax.device_put(np.ones(4), jax.devices()[0])}
  orig = store.format.SnapshotWriter.add

  def failing(self, path, box, data):
    if path == "z":
      raise OSError("disk full")
    return orig(self, path, box, data)

  store.format.SnapshotWriter.add = failing
  try:
    with pytest.raises(OSError, match="disk full"):
      store.save(bad, sdir, step=2)
  finally:
    store.format.SnapshotWriter.add = orig
  st = HostStore(sdir)
  assert st.manifest()["step"] == 1 and st.list() == ["w"]
  pdir = os.path.join(sdir, "procs", "0")
  assert not [n for n in os.listdir(pdir) if n.startswith(".staging")]


def test_server_sub_box_reads_and_errors(sdir):
  x = np.arange(12 * 6, dtype=np.float32).reshape(12, 6)
  store.save({"w": jax.device_put(x, NamedSharding(_mesh(2, (2, 1)),
                                                   P("d")))}, sdir, step=3)
  srv = make_server(sdir, 0)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  url = f"http://127.0.0.1:{srv.server_address[1]}"
  try:
    rs = RemoteStore(url, timeout=2, retries=1)
    assert rs.store_id == HostStore(sdir).store_id
    assert rs.manifests()[0]["step"] == 3
    got = rs.read_storage("w", ((7, 9), (2, 5)), proc=0).view(np.float32)
    np.testing.assert_array_equal(got, x[7:9, 2:5])
    assert rs.bytes_received == got.nbytes  # exactly the sub-box
    with pytest.raises(StoreError, match="HTTP 404.*no tensor 'q'"):
      rs.read_storage("q", ((0, 1),), proc=0)
    # Concurrent reads share the server.
    outs = [None] * 8

    def rd(i):
      outs[i] = rs.read_storage("w", ((i, i + 1), (0, 6)), proc=0)

    ts = [threading.Thread(target=rd, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for i, o in enumerate(outs):
      np.testing.assert_array_equal(o.view(np.float32), x[i:i + 1])
  finally:
    srv.shutdown()
    srv.server_close()
    rs.close()
  # The peer is gone mid-recovery: a clear error naming the URL and tensor.
  with pytest.raises(StoreError, match=f"{url} is unreachable.*w box"):
    rs.read_storage("w", ((0, 1), (0, 6)), proc=0)
  rs.close()


@pytest.mark.parametrize("delete_arrays", [False, True])
def test_central_mode_uploads_to_one_store(tmp_path, delete_arrays):
  """(``delete_arrays``: the array is deleted once uploaded, and the
  upload is the array's bytes all the same.)"""
  central = str(tmp_path / "central")
  srv = make_server(central, 0)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  url = f"http://127.0.0.1:{srv.server_address[1]}"
  try:
    x = _value("bfloat16", (8, 8))
    a = jax.device_put(x, NamedSharding(_mesh(4, (2, 2)), P("d", "t")))
    store.save({"w": a, "step": 5}, str(tmp_path / "unused"), step=5,
               mode="central", central=url, delete_arrays=delete_arrays)
    assert a.is_deleted() == delete_arrays
    assert srv.stats["bytes_received"] == x.nbytes
    assert not os.path.exists(tmp_path / "unused")
    tgt = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        _mesh(2, (1, 2), start=6), P(None, "t"))), "step": 0}
    out, rep = store.restore_with_report([url], tgt)
    np.testing.assert_array_equal(_bits(out["w"]), _bits(x))
    assert out["step"] == 5 and rep.network_bytes == x.nbytes
  finally:
    srv.shutdown()
    srv.server_close()


def test_restore_without_any_copy_raises_no_copy_error(tmp_path):
  tgt = {"w": jax.ShapeDtypeStruct((2,), jnp.float32,
                                   sharding=NamedSharding(_mesh(1, (1, 1)), P()))}
  os.makedirs(tmp_path / "empty")
  with pytest.raises(store.NoCopyError, match="no store holds a snapshot"):
    store.restore([str(tmp_path / "empty")], tgt)


def test_non_array_leaves_round_trip_as_saved(sdir):
  sh = NamedSharding(_mesh(2, (2,), ("d",)), P("d"))
  rep = NamedSharding(_mesh(2, (2,), ("d",), start=2), P())
  tree = {"w": jax.device_put(np.arange(4, dtype=np.float32), sh),
          "none": None, "step": 12, "lr": 0.25, "name": "run", "on": True,
          "z": 1 - 2j, "nan": float("nan"), "big": 2**70,
          "f32": np.float32(1.5), "bf16": ml_dtypes.bfloat16(2.5),
          "table": np.arange(3, dtype=np.int16), "words": np.array(["a", "bc"]),
          "nested": (1, None, "x")}
  store.save(tree, sdir, step=12)
  # Placeholders of any kind (None included) take the saved value; a path
  # that was not saved passes through; the saved None stays None.
  target = {k: None for k in tree}
  target["w"] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep)
  target["nested"] = (0, 0, "")
  target["none"] = 0
  target["new"] = "kept"
  out = store.restore([sdir], target)
  assert out["w"].sharding == rep
  np.testing.assert_array_equal(out["w"], np.arange(4, dtype=np.float32))
  for k in ("none", "step", "lr", "name", "on", "z", "big", "nested"):
    assert out[k] == tree[k] and type(out[k]) is type(tree[k]), k
  assert out["new"] == "kept" and np.isnan(out["nan"])
  for k in ("f32", "bf16", "table", "words"):
    assert type(out[k]) is type(tree[k]) and out[k].dtype == tree[k].dtype, k
    np.testing.assert_array_equal(out[k], tree[k])
  # jax.eval_shape turns a Python int into a ShapeDtypeStruct without a
  # sharding: it takes the saved value; with a sharding, the saved scalar
  # becomes an array on it.
  abstract = jax.eval_shape(lambda: {"step": 0, "lr": 0.0})
  assert store.restore([sdir], abstract) == {"step": 12, "lr": 0.25}
  got = store.restore([sdir], {"step": jax.ShapeDtypeStruct(
      (), jnp.int32, sharding=rep)})["step"]
  assert got.sharding == rep and got.dtype == jnp.int32 and int(got) == 12
  # A live array as a target leaf is a layout: the saved value is restored.
  live = jax.device_put(np.zeros(4, np.float32), rep)
  got = store.restore([sdir], {"w": live})["w"]
  np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))


def test_bad_trees_name_every_leaf_and_the_numbers(sdir):
  sh = NamedSharding(_mesh(2, (2,), ("d",)), P("d"))
  rep = NamedSharding(_mesh(1, (1,), ("d",)), P())
  with pytest.raises(store.TreeError, match=r"2 leaves cannot be stored.*"
                     r"b/1/c: a numpy array of Python objects; opt: a"
                     r" builtins.object"):
    store.save({"opt": object(), "b": [1, {"c": np.array([None])}]}, sdir)
  store.save({"w": jax.device_put(np.arange(4, dtype=np.float32), sh),
              "step": 7, "lr": 0.5}, sdir, step=7)
  sds = jax.ShapeDtypeStruct
  with pytest.raises(store.TreeError) as e:
    store.restore([sdir], {
        "w": sds((5,), jnp.float32, sharding=sh),
        "step": sds((), jnp.int8, sharding=rep),  # 7 fits int8: fine
        "lr": sds((), jnp.int32, sharding=rep),
        "extra": sds((2,), jnp.float32, sharding=sh)})
  msg = str(e.value)
  assert "(3 leaves)" in msg, msg
  assert "w: the target is float32[5], step 7 saved float32[4]" in msg
  assert "lr: the saved value 0.5 does not fit the target dtype int32" in msg
  assert "extra: the target is float32[2], step 7 saved nothing" in msg
  with pytest.raises(store.TreeError, match=r"w: the target is float32\[4\]"
                     " without a sharding, step 7 saved an array"):
    store.restore([sdir], {"w": sds((4,), jnp.float32)})
  with pytest.raises(store.TreeError, match="w: the target is int 0, step 7"
                     r" saved an array float32\[4\]"):
    store.restore([sdir], {"w": 0})
  # Leaving a saved array out of the target skips it.
  assert store.restore([sdir], {"step": None}) == {"step": 7}


def test_leaves_sharing_a_path_name_are_refused_not_overwritten(sdir):
  # A dict key holding "/" names the leaf a/b like {"a": {"b": ...}} does:
  # saving both would keep one leaf's data for the two, and a target holding
  # both would restore them from one saved array.
  rep = NamedSharding(_mesh(1, (1,), ("d",)), P())
  x = jax.device_put(np.arange(4, dtype=np.float32), rep)
  y = jax.device_put(np.arange(4, dtype=np.float32) + 10, rep)
  with pytest.raises(store.TreeError, match=r"save: .*'a/b': \['a'\]\['b'\]"
                     r" and \['a/b'\]"):
    store.save({"a/b": x, "a": {"b": y}}, sdir, step=1)
  assert not os.path.exists(sdir) or not os.listdir(sdir)
  # Either key alone (and unrelated leaves named with "/") stays fine.
  store.save({"a/b": x, "c": {"d": y}}, sdir, step=1)
  sds = lambda: jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep)
  out = store.restore([sdir], {"a/b": sds(), "c": {"d": sds()}})
  np.testing.assert_array_equal(_bits(out["a/b"]), _bits(x))
  np.testing.assert_array_equal(_bits(out["c"]["d"]), _bits(y))
  with pytest.raises(store.TreeError, match=r"a/b: target leaves \['a'\]"
                     r"\['b'\] and \['a/b'\] share this path name"):
    store.restore([sdir], {"a/b": sds(), "a": {"b": sds()}})


def test_save_with_delete_arrays_frees_each_array_and_restores_bitwise(sdir):
  """``save(..., delete_arrays=True)`` (a save for a resize, as
  ``save_and_exit``'s): every array of the tree is deleted once the save
  returns, a leaf held at two paths (as Adam's zero moments at init) and a
  PRNG key array included, and the snapshot restores bitwise what the
  arrays held, onto another layout."""
  src, dst = _mesh(4, (2, 2)), _mesh(4, (1, 4), start=4)
  want, tree, target = {}, {}, {}
  for i, dt in enumerate(["float32", "bfloat16", "int8"]):
    x = _value(dt, (8, 4), i)
    want[dt] = x
    tree[dt] = jax.device_put(x, NamedSharding(src, P("t", "d")))
    target[dt] = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                      sharding=NamedSharding(dst, P(None, "t")))
  tree["again"] = tree["float32"]  # the same array at a second path
  want["again"], target["again"] = want["float32"], target["float32"]
  keys = jax.random.split(jax.random.key(3), 4)
  want["key"] = np.asarray(jax.random.key_data(keys))
  tree["key"] = jax.device_put(keys, NamedSharding(src, P("t")))
  target["key"] = jax.ShapeDtypeStruct(keys.shape, keys.dtype,
                                       sharding=NamedSharding(dst, P("t")))
  tree["step"], target["step"] = 5, 0
  arrays = [v for v in tree.values() if isinstance(v, jax.Array)]
  store.save(tree, sdir, step=5, delete_arrays=True)
  assert all(a.is_deleted() for a in arrays)
  out = store.restore([sdir], target)
  for k, w in want.items():
    assert out[k].sharding == target[k].sharding, k
    got = jax.random.key_data(out[k]) if k == "key" else out[k]
    np.testing.assert_array_equal(_bits(got), _bits(w), err_msg=k)
  assert out["step"] == 5
