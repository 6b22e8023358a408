"""The store's fast data path: chunk files written by ``write_zarr3`` and
read by ``HostStore.read_into`` / ``POST /read``, checked against
tensorstore, bitwise, with small chunks so that pieces cross chunk
boundaries and the last chunk is padded."""

import os
import threading

import google_crc32c
import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import store
from tenplex_jax.store import (ChecksumError, HostStore, RemoteStore, StoreError,
                               make_server)
from tenplex_jax.store import api, format as fmt

from test_store import DTYPES, _bits, _value


@pytest.fixture
def small_chunks(monkeypatch):
  monkeypatch.setattr(fmt, "_CHUNK_BYTES", 24)
  monkeypatch.setattr(api, "_BATCH_BYTES", 64)


@pytest.fixture
def served(tmp_path):
  d = str(tmp_path / "store")
  os.makedirs(d)
  srv = make_server(d, 0)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  rs = RemoteStore(f"http://127.0.0.1:{srv.server_address[1]}", timeout=5,
                   retries=0)
  yield d, srv, rs
  rs.close()
  srv.shutdown()
  srv.server_close()


def test_crc32c_is_castagnoli_on_any_buffer_without_copies():
  data = np.random.default_rng(0).integers(0, 256, 100_003, np.uint8)
  want = google_crc32c.value(data.tobytes())
  assert fmt.crc32c(data) == want
  assert fmt.crc32c(memoryview(data)) == want
  assert fmt.crc32c(bytearray(data.tobytes())) == want
  assert fmt.crc32c(data[5000:], fmt.crc32c(data[:5000])) == want
  assert fmt.crc32c(data[:100_000].view(np.uint32)) == \
      google_crc32c.value(data[:100_000].tobytes())
  assert fmt.crc32c(b"") == 0 and fmt.crc32c(b"123456789") == 0xE3069283
  with pytest.raises(ValueError, match="contiguous"):
    fmt.crc32c(data[::2])


@pytest.mark.parametrize("shape", [(13, 3), (5,), (), (4, 3, 2)])
def test_write_zarr3_is_what_tensorstore_reads(tmp_path, small_chunks, shape):
  x = np.random.default_rng(1).integers(0, 2**16, shape).astype(np.uint16)
  path = str(tmp_path / "a")
  rows, crcs = fmt.write_zarr3(path, x)
  got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                "path": path},
                 "open": True}).result().read().result()
  np.testing.assert_array_equal(got, x)
  n = -(-shape[0] // rows) if shape else 1
  assert len(crcs) == n and (n > 1 or len(shape) < 2)


def test_every_dtype_bitwise_through_small_chunks_and_sub_boxes(
    tmp_path, small_chunks, served):
  d, srv, rs = served
  src = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("d", "t"))
  dst = Mesh(np.array(jax.devices()[2:8]).reshape(2, 3), ("d", "t"))
  tree, target = {}, {}
  for i, dt in enumerate(DTYPES):
    x = _value(dt, (12, 6), i)
    tree[dt] = jax.device_put(x, NamedSharding(src, P("d")))
    # Rows and columns both change: strided and row-contiguous pieces.
    target[dt] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        dst, P("t", "d")))
  keys = jax.random.split(jax.random.key(5), 12)
  tree["key"] = jax.device_put(keys, NamedSharding(src, P("d")))
  target["key"] = jax.ShapeDtypeStruct(keys.shape, keys.dtype,
                                       sharding=NamedSharding(dst, P("t")))
  store.save(tree, d, step=4)
  m = HostStore(d).manifest()
  assert all(len(b["crc32c"]) > 1 for t in m["tensors"].values()
             for b in t["boxes"])  # several chunks per box
  url = rs.url
  for loc in ([d], [url]):
    out, rep = store.restore_with_report(loc, target)
    for k in target:
      a, b = (jax.random.key_data(out[k]), jax.random.key_data(tree[k])) \
          if k == "key" else (out[k], tree[k])
      assert out[k].sharding == target[k].sharding, k
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{k} {loc}")
    assert rep.network_bytes + rep.local_bytes == sum(
        v.nbytes for v in tree.values())
  assert srv.stats["bytes_sent"] == rep.network_bytes
  assert HostStore(d).verify() == []


def test_batched_read_returns_the_right_bytes(served):
  d, srv, rs = served
  x = np.arange(12 * 8, dtype=np.float32).reshape(12, 8)
  y = _value("bfloat16", (6, 4), 3)
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("d", "t"))
  store.save({"x": jax.device_put(x, NamedSharding(mesh, P("d"))),
              "y": jax.device_put(y, NamedSharding(mesh, P(None, "d")))}, d)
  a = np.empty((3, 8), np.uint32)
  b = np.empty((2, 3), np.uint32)
  big = np.zeros((6, 5), np.uint16)
  c = big[:, 1:3]  # not C-contiguous: filled through a buffer
  pieces = [(0, "x", ((1, 4), (0, 8)), a), (0, "x", ((2, 4), (5, 8)), b),
            (0, "y", ((0, 6), (0, 2)), c)]
  assert rs.read_into(pieces) == a.nbytes + b.nbytes + c.nbytes
  np.testing.assert_array_equal(a.view(np.float32), x[1:4])
  np.testing.assert_array_equal(b.view(np.float32), x[2:4, 5:8])
  np.testing.assert_array_equal(c, np.asarray(y)[:, :2].view(np.uint16))
  assert big[:, 0].sum() == 0 and big[:, 3:].sum() == 0
  assert srv.stats["requests"] == 1 and srv.stats["pieces"] == 3
  assert srv.stats["bytes_sent"] == rs.bytes_received
  # A box that no snapshot holds: 404 for the whole batch, connection kept.
  with pytest.raises(StoreError, match="HTTP 404.*no box of 'x'"):
    rs.read_into([(0, "x", ((0, 1), (0, 8)), np.empty((1, 8), np.uint32)),
                  (0, "x", ((5, 7), (0, 8)), np.empty((2, 8), np.uint32))])
  rs.read_into(pieces[:1])


def _chunk(d, path, box_dir="b0", key="c/0/0"):
  st = HostStore(d)
  return os.path.join(st.snapshot_dir(0), "data", path, box_dir, key)


def _flip(path, at):
  with open(path, "r+b") as f:
    f.seek(at)
    v = f.read(1)
    f.seek(at)
    f.write(bytes([v[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["payload", "trailer", "truncate",
                                    "swap"])
def test_corruption_is_detected_by_every_reader(served, damage):
  d, srv, rs = served
  x = np.arange(64 * 4, dtype=np.int32).reshape(64, 4)
  store.save({"v": jax.device_put(x, jax.devices()[0]),
              "w": jax.device_put(x + 1, jax.devices()[0])}, d)
  chunk = _chunk(d, "v")
  if damage == "payload":
    _flip(chunk, 77)
  elif damage == "trailer":
    _flip(chunk, os.path.getsize(chunk) - 2)
  elif damage == "truncate":
    os.truncate(chunk, os.path.getsize(chunk) - 9)
  else:  # a valid chunk of other data: its trailer matches, the manifest not
    with open(_chunk(d, "w"), "rb") as f, open(chunk, "wb") as g:
      g.write(f.read())
  st = HostStore(d)
  with pytest.raises(ChecksumError, match="checksum"):
    st.read_into("v", ((0, 2), (0, 4)), np.empty((2, 4), np.uint32))
  with pytest.raises(ChecksumError, match="checksum"):  # strided, mapped
    st.read_into("v", ((3, 5), (1, 2)), np.empty((4, 2), np.uint32)[:2, :1],
                 maps=fmt.ChunkMaps())
  with pytest.raises(ChecksumError, match="checksum"):  # whole chunk, preadv
    st.read_into("v", ((0, 64), (0, 4)), np.empty((64, 4), np.uint32))
  with pytest.raises(ChecksumError, match="checksum"):
    rs.read_into([(0, "v", ((3, 5), (1, 2)), np.empty((2, 1), np.uint32))])
  assert any("v box" in p for p in st.verify())
  if damage != "swap":  # tensorstore checks only the trailer
    with pytest.raises(StoreError):
      st.read("v")
  np.testing.assert_array_equal(st.read("w"), x + 1)


def test_strided_local_reads_map_each_shared_chunk_once(tmp_path,
                                                        small_chunks):
  d = str(tmp_path / "s")
  x = np.arange(10 * 6, dtype=np.uint16).reshape(10, 6)  # 12-byte rows
  store.save({"x": jax.device_put(x, jax.devices()[0]),
              "s": jax.device_put(np.uint32(7), jax.devices()[0])}, d)
  st = HostStore(d)
  assert st.storage_info("x", ((0, 10), (0, 6)))[2] == 2  # 2 rows a chunk
  maps = fmt.ChunkMaps()
  big = np.zeros((10, 8), np.uint16)
  # Three column pieces of the same rows (several chunks, the last one
  # partial): every chunk is mapped and checked once for all three.
  for a, z in ((0, 1), (1, 4), (4, 6)):
    assert st.read_into("x", ((1, 9), (a, z)), big[1:9, a:z],
                        maps=maps) == 8 * (z - a) * 2
  np.testing.assert_array_equal(big[1:9, :6], x[1:9])
  assert not big[0].any() and not big[9].any() and not big[:, 6:].any()
  assert maps.mapped == 5  # chunks 0..4 (rows 0-9)
  # Whole chunks into a contiguous destination: preadv, no map.
  whole = np.empty((4, 6), np.uint16)
  st.read_into("x", ((2, 6), (0, 6)), whole, maps=maps)
  np.testing.assert_array_equal(whole, x[2:6])
  part = np.empty((3, 6), np.uint16)  # some rows of chunks: from the maps
  st.read_into("x", ((3, 6), (0, 6)), part)
  np.testing.assert_array_equal(part, x[3:6])
  s = np.empty((), np.uint32)
  st.read_into("s", (), s)
  assert int(s) == 7
  assert st.read_into("x", ((3, 3), (0, 6)), np.empty((0, 6), np.uint16)) == 0
  maps.close()


@pytest.mark.parametrize("gather", [8, 1 << 20])
def test_strided_pieces_go_through_small_gather_blocks(served, monkeypatch,
                                                       gather):
  from tenplex_jax.store import server as srv_mod
  monkeypatch.setattr(srv_mod, "_GATHER_BYTES", gather)
  d, srv, rs = served
  x = np.arange(40 * 7, dtype=np.uint32).reshape(40, 7)
  store.save({"x": jax.device_put(x, jax.devices()[0])}, d)
  dest = np.zeros((40, 9), np.uint32)
  pieces = [(0, "x", ((0, 40), (0, 3)), dest[:, 0:3]),
            (0, "x", ((0, 40), (3, 7)), dest[:, 3:7]),
            (0, "x", ((5, 9), (1, 2)), dest[5:9, 8:9])]
  rs.read_into(pieces)
  np.testing.assert_array_equal(dest[:, :7], x)
  np.testing.assert_array_equal(dest[5:9, 8], x[5:9, 1])
  assert not dest[:, 7].any()


def test_restore_buffers_come_from_the_host_pool(tmp_path):
  from tenplex_jax import _hostmem
  d = str(tmp_path / "p")
  x = np.arange(3 << 18, dtype=np.float32).reshape(768, 1024)  # 3 MiB
  mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
  store.save({"x": jax.device_put(x, NamedSharding(mesh, P(None, "t"))),
              "z": jax.device_put(np.zeros((0, 3), np.float32),
                                  jax.devices()[0])}, d)
  dst = Mesh(np.array(jax.devices()[2:5]), ("t",))
  before = _hostmem.host_pool_stats()
  out = store.restore([d], {
      "x": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(dst, P("t"))),
      "z": jax.ShapeDtypeStruct((0, 3), np.float32,
                                sharding=NamedSharding(dst, P()))})
  after = _hostmem.host_pool_stats()
  np.testing.assert_array_equal(np.asarray(out["x"]), x)
  assert out["z"].shape == (0, 3)
  assert (after["mapped"] + after["reused"]
          - before["mapped"] - before["reused"]) >= 1
  for s in out["x"].addressable_shards:
    assert s.data.unsafe_buffer_pointer() % 64 == 0


def test_large_restore_reads_into_buffers_a_donating_step_reuses(
    tmp_path, monkeypatch):
  """From ``_OWNED_MIN_BYTES`` (set to 0 here) a restore reads the shards
  of plain arrays straight into buffers XLA allocated: bitwise the saved
  values (a box several devices hold copied to each, a bfloat16 leaf
  stored as integers), and a jitted step that donates the restored arrays
  writes its results into the same buffers (one built on a host buffer
  would get fresh ones). Key data keeps the host-buffer path."""
  import jax.numpy as jnp
  d = str(tmp_path / "o")
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  h = np.arange(32).astype(jnp.bfloat16)
  state = {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
           "r": jax.device_put(np.arange(16, dtype=np.float32),
                               NamedSharding(mesh, P())),
           "h": jax.device_put(h, NamedSharding(mesh, P("b"))),
           "k": jax.random.key(3)}
  store.save(state, d, step=7)
  dst = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
  target = {
      "w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                sharding=NamedSharding(dst, P("y", None))),
      "r": jax.ShapeDtypeStruct((16,), np.float32,
                                sharding=NamedSharding(dst, P("x"))),
      "h": jax.ShapeDtypeStruct(h.shape, h.dtype,
                                sharding=NamedSharding(dst, P())),
      "k": jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                sharding=NamedSharding(dst, P()))}
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 0)
  made = []
  real = api._owned_arrays
  monkeypatch.setattr(api, "_owned_arrays",
                      lambda *a: made.append(real(*a)) or made[-1])
  out = store.restore([d], target)
  assert sorted(made[0]) == ["h", "r", "w"]
  for k in ("w", "r", "h"):
    want = np.asarray(state[k])
    for s in out[k].addressable_shards:
      assert np.asarray(s.data).tobytes() == want[s.index].tobytes(), k
  np.testing.assert_array_equal(jax.random.key_data(out["k"]),
                                jax.random.key_data(state["k"]))
  arrays = {k: out[k] for k in ("w", "r", "h")}
  ptrs = {k: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
          for k, a in arrays.items()}
  step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t),
                 donate_argnums=0)
  new = step(arrays)
  assert {k: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
          for k, a in new.items()} == ptrs
  np.testing.assert_array_equal(np.asarray(new["w"]), w * 2)
  # Below the size, the host-buffer path (no XLA program).
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1 << 40)
  out = store.restore([d], target)
  assert made[-1] == {}
  np.testing.assert_array_equal(np.asarray(out["w"]), w)


def test_snapshots_are_fsynced_except_on_memory_file_systems(tmp_path,
                                                            monkeypatch):
  synced = []
  real = os.fsync

  def spy(fd):
    import stat
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    synced.append((os.readlink(f"/proc/self/fd/{fd}"), is_dir))
    return real(fd)

  monkeypatch.setattr(os, "fsync", spy)
  x = np.arange(4096, dtype=np.float32).reshape(64, 64)
  mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
  tree = {"x": jax.device_put(x, NamedSharding(mesh, P(None, "t")))}
  monkeypatch.setenv("TENPLEX_JAX_STORE_FSYNC", "1")
  d = str(tmp_path / "disk")
  store.save(tree, d)
  files = [p for p, is_dir in synced if not is_dir]
  dirs = [p for p, is_dir in synced if is_dir]
  chunks = [p for p in files if "/data/x/" in p]
  assert len(chunks) == 2  # one chunk file per saved box
  assert any(p.endswith("manifest.json") for p in files)
  assert any(p.endswith(os.path.join("procs", "0")) for p in dirs)
  assert any("/data/x/b0" in p for p in dirs)  # the chunks' directories
  out = store.restore([d], {"x": jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P("t")))})
  np.testing.assert_array_equal(np.asarray(out["x"]), x)
  # Auto: tmpfs (/dev/shm) is lost in a crash anyway, so nothing is synced.
  monkeypatch.delenv("TENPLEX_JAX_STORE_FSYNC")
  assert fmt.needs_fsync("/dev/shm/anything") is False
  synced.clear()
  import shutil
  import tempfile
  shm = tempfile.mkdtemp(dir="/dev/shm")
  try:
    store.save(tree, shm)
  finally:
    shutil.rmtree(shm, ignore_errors=True)
  assert synced == []


def test_chunk_maps_resolve_a_directory_once_and_follow_links_in_full(tmp_path,
                                                                      monkeypatch):
  snap = tmp_path / "snap"
  (snap / "a" / "b").mkdir(parents=True)
  (snap / "a" / "c").mkdir()
  (tmp_path / "out").mkdir()
  os.symlink(snap / "a" / "b", snap / "a" / "in")  # a link that stays inside
  os.symlink(tmp_path / "out", snap / "a" / "out")  # one that leads out
  base, rels = str(snap), ["a/b", "a/c", "a/in"]
  want = {rel: fmt.inside(base, rel, "t") for rel in rels}
  assert want["a/in"] == os.path.realpath(snap / "a" / "b")
  calls = []
  real = os.path.realpath
  monkeypatch.setattr(os.path, "realpath",
                      lambda p, **kw: calls.append(p) or real(p, **kw))
  maps = fmt.ChunkMaps()
  for _ in range(10):
    for rel in rels[:2]:
      assert maps.inside(base, rel, "t") == want[rel]
  assert len(calls) == 1  # the base, once; a/b and a/c need no realpath
  assert maps.inside(base, "a/in", "t") == want["a/in"]  # a link: in full
  with pytest.raises(StoreError, match="outside"):
    maps.inside(base, "a/out", "t")
  with pytest.raises(StoreError, match="not a relative path"):
    maps.inside(base, "a/../a/b", "t")


def test_reads_with_one_chunk_maps_find_the_snapshot_and_box_once(tmp_path,
                                                                   monkeypatch):
  d = str(tmp_path / "store")
  os.makedirs(d)
  value = np.arange(64, dtype=np.float32)
  store.save({"w": jax.numpy.asarray(value)}, d, step=1)
  hs = HostStore(d)
  rid = fmt.round_id(hs.manifest(0))
  counts = {"realpath": 0, "names": 0}
  real, names = os.path.realpath, HostStore._names

  def count_realpath(p, **kw):
    counts["realpath"] += 1
    return real(p, **kw)

  def count_names(self, proc):
    counts["names"] += 1
    return names(self, proc)

  monkeypatch.setattr(os.path, "realpath", count_realpath)
  monkeypatch.setattr(HostStore, "_names", count_names)
  maps = fmt.ChunkMaps()
  out = np.zeros(64, np.uint32)
  for i in range(0, 64, 4):  # 16 pieces of the one box
    hs.read_into("w", ((i, i + 4),), out[i:i + 4], proc=0, maps=maps, round=rid)
  maps.close()
  np.testing.assert_array_equal(out.view(np.float32), value)
  assert counts == {"realpath": 1, "names": 1}
