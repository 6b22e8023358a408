"""The CPU fast path hands its new shard buffers to jax without a copy."""

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import tenplex_jax
from tenplex_jax._hostmem import host_empty as _aligned_empty

DTYPES = [np.float32, ml_dtypes.bfloat16, np.bool_, ml_dtypes.int4,
          ml_dtypes.float8_e4m3fn, np.uint32, np.complex64]


def _meshes():
  """The 8 devices, a (data 4, tensor 2) and a (data 2, tensor 4) mesh."""
  devs = np.array(jax.devices()[:8])
  return (devs, Mesh(devs.reshape(4, 2), ("data", "tensor")),
          Mesh(devs.reshape(2, 4), ("data", "tensor")))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (1 << 18,)])
def test_aligned_empty(dtype, shape):
  b = _aligned_empty(shape, dtype)
  assert b.shape == shape and b.dtype == np.dtype(dtype)
  assert b.flags.c_contiguous and b.flags.writeable
  assert b.ctypes.data % 64 == 0 or b.size == 0


def test_large_buffer_is_aliased_not_copied():
  b = _aligned_empty((1 << 20,), np.float32)
  b[...] = 1.0
  y = jax.device_put(b, jax.devices()[1], may_alias=True)
  y.block_until_ready()
  assert y.unsafe_buffer_pointer() == b.ctypes.data


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reshard_values_and_shardings(dtype):
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  b = Mesh(devs[:4].reshape(1, 4), ("data", "tensor"))
  rng = np.random.default_rng(0)
  host = rng.integers(0, 7, size=(64, 256)).astype(dtype)
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  target = NamedSharding(b, P(None, "tensor"))
  y = tenplex_jax.reshard({"w": x}, {"w": target}, method="cpu")["w"]
  assert y.sharding.is_equivalent_to(target, 2)
  got = np.asarray(y)
  assert got.dtype == host.dtype
  assert np.array_equal(got.view(np.uint8) if got.dtype.itemsize else got,
                        host.view(np.uint8) if host.dtype.itemsize else host)
  for s in y.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])


def test_host_buffers_are_recycled_once_jax_drops_them():
  import gc
  from tenplex_jax import _hostmem
  gc.collect()  # earlier tests' buffers back to the pool, then freed
  _hostmem.collect_dropped_buffers()
  _hostmem.release_host_pool()
  devs, a, b = _meshes()
  host = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  # 1 MiB shards (mapped), none of them an old box (which would be shared).
  target = NamedSharding(b, P(("data", "tensor")))
  y = tenplex_jax.reshard(x, target, method="cpu")
  before = _hostmem.host_pool_stats()
  assert before["idle_bytes"] == 0
  held = np.asarray(y.addressable_shards[0].data)  # a view keeps it alive
  del y
  gc.collect()
  mid = _hostmem.host_pool_stats()
  assert 0 < mid["idle_bytes"]
  # Of a fresh copy of the source (the same source would take the blocks
  # back with their bytes, see below).
  x2 = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  z = tenplex_jax.reshard(x2, target, method="cpu")
  after = _hostmem.host_pool_stats()
  assert after["reused"] > mid["reused"]
  # Recycled buffers hold the right values; the view still sees its own.
  assert np.array_equal(np.asarray(z), host)
  assert np.array_equal(held, host[0:256])
  assert _hostmem.release_host_pool() >= 0
  assert _hostmem.host_pool_stats()["idle_bytes"] == 0


@pytest.mark.parametrize("rows", [16, 2048])  # 64 KiB and 8 MiB shards
def test_a_dropped_result_is_reused_by_the_next_call_without_a_collection(
    rows):
  # jaxlib releases the host array behind a freed device buffer from a
  # cycle-collector callback; the reshard drops that queue itself, so the
  # next call reuses every buffer of a result dropped just before it, with
  # the collector off as it is during a reshard.
  import gc
  from tenplex_jax import _hostmem
  devs, a, b = _meshes()
  host = np.arange(rows * 1024 * 8, dtype=np.float32).reshape(rows * 8, 1024)
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  target = NamedSharding(b, P(("data", "tensor")))  # 8 new shards
  # A fresh copy of the source next: its bytes are not those of the
  # dropped result, so the blocks are reused, not taken back as they were.
  x2 = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  was = gc.isenabled()
  gc.collect()
  gc.disable()
  try:
    y = tenplex_jax.reshard(x, target, method="cpu")
    del y
    before = _hostmem.host_pool_stats()
    z = tenplex_jax.reshard(x2, target, method="cpu")
    after = _hostmem.host_pool_stats()
  finally:
    if was:
      gc.enable()
  assert after["mapped"] == before["mapped"]  # no new block
  assert after["reused"] - before["reused"] == 8
  assert after["reclaimed"] == before["reclaimed"]
  assert np.array_equal(np.asarray(z), host)


def test_host_pool_off_and_bad_setting(monkeypatch):
  from tenplex_jax import _hostmem
  monkeypatch.setenv("TENPLEX_JAX_HOST_POOL_GIB", "lots")
  with pytest.raises(ValueError, match="TENPLEX_JAX_HOST_POOL_GIB"):
    _hostmem.host_empty((1 << 20,), np.float32)
  monkeypatch.setenv("TENPLEX_JAX_HOST_POOL_GIB", "0")
  _hostmem.release_host_pool()
  b = _hostmem.host_empty((1 << 20,), np.float32)
  del b
  assert _hostmem.host_pool_stats()["idle_bytes"] == 0


@pytest.mark.parametrize("threads,small", [("1", 0), ("3", 0), ("3", 1024)])
def test_threaded_copies_are_bitwise(monkeypatch, threads, small):
  from tenplex_jax import _hostmem
  R = importlib.import_module("tenplex_jax.reshard")
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", threads)
  monkeypatch.setattr(R, "_THREADED_MIN_BYTES", 0)  # thread even tiny copies
  # small > 0: pieces under it are copied by the calling thread meanwhile.
  monkeypatch.setattr(R, "_SMALL_PIECE_BYTES", small)
  # "w"'s new boxes (24 KiB) come from new pool blocks: populated first.
  monkeypatch.setattr(R, "_POPULATE_MIN_BYTES", 0)
  spans = []
  monkeypatch.setattr(R, "populate_range",
                      lambda a, n: spans.append(n) or _hostmem.populate_range(a, n))
  _hostmem.collect_dropped_buffers()
  _hostmem.release_host_pool()
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  b = Mesh(devs[::-1].reshape(2, 4), ("data", "tensor"))
  rng = np.random.default_rng(1)
  tree = {
      "w": rng.standard_normal((512, 96)).astype(np.float32),
      "v": rng.integers(0, 255, (40, 16, 3)).astype(np.uint8),
      "s": np.float32(3.5),
      "e": np.zeros((0, 8), np.float32),
  }
  src = {"w": P("data", "tensor"), "v": P(None, "tensor"), "s": P(),
         "e": P(None, "tensor")}
  dst = {"w": P("data", "tensor"), "v": P("tensor", None), "s": P(),
         "e": P(None, "tensor")}
  x = {k: jax.device_put(v, NamedSharding(a, src[k])) for k, v in tree.items()}
  y = tenplex_jax.reshard(x, {k: NamedSharding(b, p) for k, p in dst.items()},
                          method="cpu")
  for k, v in tree.items():
    assert np.array_equal(np.asarray(y[k]), v)
    for s in y[k].addressable_shards:
      assert np.array_equal(np.asarray(s.data), v[s.index])
  assert sum(spans) >= 8 * 256 * 24 * 4  # "w"'s 8 new boxes, every band


def test_bad_copy_threads_setting(monkeypatch):
  R = importlib.import_module("tenplex_jax.reshard")
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", "many")
  with pytest.raises(ValueError, match="TENPLEX_JAX_COPY_THREADS"):
    R._copy_threads()


def test_copy_threads_work_in_a_forked_child(monkeypatch):
  import multiprocessing as mp
  R = importlib.import_module("tenplex_jax.reshard")
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", "2")
  monkeypatch.setattr(R, "_THREADED_MIN_BYTES", 0)
  monkeypatch.setattr(R, "_SMALL_PIECE_BYTES", 0)
  src = np.arange(4096, dtype=np.float32).reshape(64, 64)
  a = np.empty_like(src)
  R._copy_all([(a, (), src[:, :]), (a[:1], (), src[:1])])  # pool started here
  ctx = mp.get_context("fork")
  q = ctx.Queue()

  def child():
    b = np.empty_like(src)
    R._copy_all([(b[:32], (), src[:32]), (b[32:], (), src[32:])])
    q.put(bool(np.array_equal(b, src)))

  p = ctx.Process(target=child)
  p.start()
  try:
    assert q.get(timeout=30) is True
  finally:
    p.join(10)
    if p.is_alive():
      p.kill()


@pytest.mark.parametrize("seed", range(6))
def test_copy_bands_give_no_two_threads_the_same_bytes(seed):
  # Boxes glued from pieces side by side (columns), on top of each other
  # (rows) and whole, cut into bands of rows: every task's destinations are
  # disjoint from every other task's, and running the tasks fills each new
  # buffer with exactly the bytes its pieces say. A band of a fresh buffer
  # populates exactly its rows' bytes first: inside that buffer, disjoint
  # from every other band's, and holding all of its copies' destinations.
  R = importlib.import_module("tenplex_jax.reshard")
  rng = np.random.default_rng(seed)
  copies, want = [], []
  for _ in range(int(rng.integers(1, 5))):
    rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 9)) * 3
    src = rng.integers(0, 1 << 30, (rows, cols)).astype(np.int32)
    buf = np.zeros((rows, cols), np.int32)
    want.append((buf, src))
    cuts = sorted(set(rng.integers(1, max(2, cols), 2).tolist()) - {cols})
    edges = [0, *cuts, cols]
    for c0, c1 in zip(edges, edges[1:]):  # column pieces
      r_edges = [0, int(rng.integers(0, rows + 1)), rows]
      for r0, r1 in zip(r_edges, r_edges[1:]):  # each maybe cut in rows too
        if r1 > r0:
          copies.append((buf, (slice(r0, r1), slice(c0, c1), Ellipsis),
                         src[r0:r1, c0:c1]))
  extra = np.zeros(7, np.int64)  # a whole-buffer piece with an empty index
  copies.append((extra, (), np.arange(7, dtype=np.int64)))
  step = int(rng.integers(16, 400))
  fresh = {id(b) for b, _ in want[::2]}
  tasks = R._row_bands(copies, step, fresh)
  views = [d for _, pairs, _ in tasks for d, _ in pairs]
  owner = [k for k, (_, pairs, _) in enumerate(tasks) for _ in pairs]
  for i in range(len(views)):
    for j in range(i + 1, len(views)):
      if owner[i] != owner[j]:
        assert not np.shares_memory(views[i], views[j], max_work=None)
  spans = []
  for nbytes, pairs, span in tasks:
    assert nbytes == sum(s.nbytes for _, s in pairs)
    bases = {id(d.base if d.base is not None else d) for d, _ in pairs}
    if bases & fresh:
      buf = next(b for b, _ in want[::2] if id(b) in bases)
      lo, size = span
      assert buf.ctypes.data <= lo and lo + size <= buf.ctypes.data + buf.nbytes
      for d, _ in pairs:
        first, last = np.lib.array_utils.byte_bounds(d)
        assert lo <= first and last <= lo + size
      spans.append((lo, lo + size))
    else:
      assert span is None
    for d, s in pairs:
      d[...] = s
  spans.sort()
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  assert sum(hi - lo for lo, hi in spans) == sum(b.nbytes for b, _ in want[::2])
  for buf, src in want:
    assert np.array_equal(buf, src)
  assert np.array_equal(extra, np.arange(7))
  assert sum(t[0] for t in tasks) == sum(c[2].nbytes for c in copies)


def _ptrs(x):
  return {s.device.id: s.data.unsafe_buffer_pointer() for s in
          x.addressable_shards}


def test_replicas_share_one_buffer_and_copy_once():
  # (data 4, tensor 2) -> (data 2, tensor 4): 4 new column boxes, each held
  # by 2 devices; none of them is an old box, so each is copied once.
  devs, a, b = _meshes()
  host = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
  x = jax.device_put(host, NamedSharding(a, P(None, "tensor")))
  target = NamedSharding(b, P(None, "tensor"))
  y, rep = tenplex_jax.reshard_with_report(x, target, method="cpu")
  assert y.sharding.is_equivalent_to(target, 2)
  assert np.array_equal(np.asarray(y), host)
  for s in y.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])
  by_box: dict = {}
  for s in y.addressable_shards:
    box = tuple((i.start, i.stop) for i in s.index)
    by_box.setdefault(box, set()).add(s.data.unsafe_buffer_pointer())
  assert len(by_box) == 4 and all(len(p) == 1 for p in by_box.values())
  assert rep.copied_bytes == host.nbytes  # one copy, not two
  assert rep.aliased_shards == 4 and rep.reused_shards == 0
  assert rep.moved_bytes == rep.lower_bound_bytes  # the plan is unchanged


def test_a_box_some_device_held_is_aliased_not_copied():
  # data 2 -> 4 over 4 -> 8 devices: every new box is an old box.
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs[:4].reshape(2, 2), ("data", "tensor"))
  b = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  host = np.arange(32 * 512, dtype=np.float32).reshape(32, 512)
  x = jax.device_put(host, NamedSharding(a, P(None, "tensor")))
  old = _ptrs(x)
  y, rep = tenplex_jax.reshard_with_report(
      x, NamedSharding(b, P(None, "tensor")), method="cpu", donate=True)
  assert rep.copied_bytes == 0 and rep.moved_bytes > 0
  assert rep.reused_shards == 4 and rep.aliased_shards == 4
  assert set(_ptrs(y).values()) == set(old.values())
  del x  # the source's memory lives on in the new array
  junk = [jax.device_put(np.full(host.shape, 7.0, np.float32), d)
          for d in jax.devices()]
  assert np.array_equal(np.asarray(y), host)
  del junk


def test_shared_buffers_are_never_written_by_donation():
  """jax does not donate a buffer it did not allocate: a jitted step that
  donates the resharded state writes its outputs elsewhere, so replicas
  sharing memory, and the old arrays they alias, keep their values."""
  devs, a, b = _meshes()
  host = np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024)
  x = jax.device_put(host, NamedSharding(a, P(None, "tensor")))
  y = tenplex_jax.reshard(x, NamedSharding(b, P(None, "tensor")),
                          method="cpu")
  z_target = NamedSharding(b, P(None, "tensor"))
  step = jax.jit(lambda v: v * 2 + 1, donate_argnums=0,
                 out_shardings=z_target)
  shared = set(_ptrs(y).values())
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "donated buffers were not usable"
    z = step(y)
  assert np.array_equal(np.asarray(z), host * 2 + 1)
  assert not shared & set(_ptrs(z).values())
  # And donating the old array leaves a new one that aliases it intact
  # (devices 4..7 swap column halves: each new box is another's old box).
  x2 = jax.device_put(host, NamedSharding(a, P(None, "tensor")))
  swapped = Mesh(devs[[5, 4, 7, 6]].reshape(2, 2), ("data", "tensor"))
  y2, rep = tenplex_jax.reshard_with_report(
      x2, NamedSharding(swapped, P(None, "tensor")), method="cpu")
  assert rep.aliased_shards == 4 and rep.copied_bytes == 0
  assert set(_ptrs(y2).values()) <= set(_ptrs(x2).values())
  step_old = jax.jit(lambda v: v * 0, donate_argnums=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    step_old(x2).block_until_ready()
  assert np.array_equal(np.asarray(y2), host)


def test_an_alias_of_a_pooled_buffer_keeps_it_out_of_the_pool():
  """A new shard that aliases a buffer the pool handed out earlier keeps that
  buffer alive: once the older arrays are gone, later reshards (which take
  buffers from the pool and overwrite them) never write into it."""
  import gc
  from tenplex_jax import _hostmem
  _hostmem.release_host_pool()
  devs, a, b = _meshes()
  host = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048)
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  # y: 8 pooled 1 MiB buffers; z: the same boxes on other devices (aliased).
  y = tenplex_jax.reshard(x, NamedSharding(b, P(("data", "tensor"))),
                          method="cpu")
  rot = Mesh(devs[[1, 2, 3, 4, 5, 6, 7, 0]].reshape(2, 4), ("data", "tensor"))
  z, rep = tenplex_jax.reshard_with_report(
      y, NamedSharding(rot, P(("data", "tensor"))), method="cpu")
  assert rep.aliased_shards == 8 and rep.copied_bytes == 0
  del y
  gc.collect()
  # Churn the pool: reshards that take 1 MiB buffers and fill them with
  # other values. A new source each time: a reshard of the same source
  # again would take its dropped result's blocks back bytes and all (host
  # reclaim, nothing written), where the run's timing lets it.
  for k in range(3):
    other = jax.device_put(-host - k, NamedSharding(a, P("data", "tensor")))
    w = tenplex_jax.reshard(other, NamedSharding(b, P(("data", "tensor"))),
                            method="cpu")
    del w
    gc.collect()
  assert _hostmem.host_pool_stats()["reused"] > 0
  assert np.array_equal(np.asarray(z), host)
  for s in z.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])


def test_donated_source_shards_that_are_aliased_stay_valid():
  # Devices 4..7 swap column halves with donate=True: every old shard is
  # deleted (none is kept), and the new shards alias four of them.
  import gc
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  swapped = Mesh(devs[[5, 4, 7, 6]].reshape(2, 2), ("data", "tensor"))
  host = np.arange(256 * 2048, dtype=np.float32).reshape(256, 2048)
  src = NamedSharding(a, P(None, "tensor"))
  # Buffers XLA allocated (not host memory jax merely adopted).
  x = jax.jit(lambda v: v + 0, out_shardings=src)(jax.device_put(host, src))
  old = set(_ptrs(x).values())
  y, rep = tenplex_jax.reshard_with_report(
      x, NamedSharding(swapped, P(None, "tensor")), method="cpu", donate=True)
  assert x.is_deleted()
  assert rep.aliased_shards == 4 and rep.reused_shards == 0
  assert set(_ptrs(y).values()) <= old
  del x
  gc.collect()
  # New buffers from XLA's allocator and from numpy's: neither may land on
  # the memory y uses.
  junk = [jax.jit(lambda: jnp.full(host.shape, -1.0, jnp.float32),
                  out_shardings=SingleDeviceSharding(d))()
          for d in jax.devices() for _ in range(2)]
  junk += [np.full(host.shape, -2.0, np.float32) for _ in range(8)]
  jax.block_until_ready(junk[:16])
  assert np.array_equal(np.asarray(y), host)
  del junk


def test_donating_a_state_whose_kept_shards_are_aliased_elsewhere():
  # data 2 -> 4: devices 0..3 keep their buffers and 4..7 alias them, all in
  # one array; a donating step over it must not write into any of them.
  import warnings
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs[:4].reshape(2, 2), ("data", "tensor"))
  b = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  host = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
  src = NamedSharding(a, P(None, "tensor"))
  x = jax.jit(lambda v: v + 0, out_shardings=src)(jax.device_put(host, src))
  target = NamedSharding(b, P(None, "tensor"))
  y, rep = tenplex_jax.reshard_with_report(x, target, method="cpu")
  assert rep.reused_shards == 4 and rep.aliased_shards == 4
  ptrs = list(_ptrs(y).values())
  shared = {p for p in ptrs if ptrs.count(p) > 1}
  assert shared  # new devices alias the buffers old devices keep
  del x
  step = jax.jit(lambda v: v * 3 - 1, donate_argnums=0, out_shardings=target)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    z = step(y)
  assert np.array_equal(np.asarray(z), host * 3 - 1)
  # Buffers only one device holds may be donated; shared ones never are.
  assert not shared & set(_ptrs(z).values())


def test_an_unaligned_part_is_copied_and_the_aligned_ones_still_shared():
  # Replicated on 4 devices -> halves on 2 others: the second half starts
  # 64,008 bytes into the old buffer, not on the 64-byte boundary XLA's CPU
  # client needs to adopt memory, so it is copied; the first half is shared
  # (as jax.device_put shares it), not copied along with it.
  devs = np.array(jax.devices()[:8])
  n = 2 * (64 * 1000 + 8)
  host = (np.arange(n) % 251).astype(np.int8)
  src = NamedSharding(Mesh(devs[:4], ("x",)), P())
  x = jax.jit(lambda v: v + 0, out_shardings=src)(jax.device_put(host, src))
  target = NamedSharding(Mesh(devs[[6, 4]], ("x",)), P("x"))
  y, rep = tenplex_jax.reshard_with_report(x, target, method="cpu")
  assert rep.aliased_shards == 1 and rep.copied_bytes == n // 2
  assert y.sharding == target
  assert np.array_equal(np.asarray(y), host)
  old = set(_ptrs(x).values())
  new = _ptrs(y)
  assert new[6] in old and new[4] not in old
  for s in y.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])


@pytest.mark.parametrize("pool_gib", ["4", "0"])
def test_heap_and_mapped_blocks_are_aligned_and_recycled(monkeypatch,
                                                         pool_gib):
  import gc
  from tenplex_jax import _hostmem
  monkeypatch.setenv("TENPLEX_JAX_HOST_POOL_GIB", pool_gib)
  gc.collect()  # buffers of earlier tests go back first
  _hostmem.release_host_pool()
  sizes = (3 << 20, _hostmem._MIN_MAPPED + 4096)  # a heap block, a mapping
  for nbytes in sizes:
    gc.collect()
    idle = _hostmem.host_pool_stats()["idle_bytes"]
    b = _hostmem.host_empty((nbytes // 4,), np.float32)
    assert b.ctypes.data % 64 == 0 and b.flags.writeable
    b[...] = 7.0
    y = jax.device_put(b, jax.devices()[1], may_alias=True)
    assert y.unsafe_buffer_pointer() == b.ctypes.data  # adopted, not copied
    del b
    gc.collect()
    assert _hostmem.host_pool_stats()["idle_bytes"] == idle  # y holds it
    assert np.all(np.asarray(y) == 7.0)
    del y
    gc.collect()
  idle = _hostmem.host_pool_stats()["idle_bytes"]
  if pool_gib == "0":
    assert idle == 0
  else:
    assert idle >= sum(-(-n // 4096) * 4096 for n in sizes)
  again = _hostmem.host_empty((sizes[0] // 4,), np.float32)
  assert _hostmem.host_pool_stats()["reused"] >= (pool_gib != "0")
  del again
  _hostmem.release_host_pool()


def test_populated_blocks_are_resident_when_handed_out(monkeypatch):
  """host_empty(populate=True) (a restore's new shards, written whole next):
  the pages of a new block of 1 MiB or more (a heap block: made resident
  with MADV_POPULATE_WRITE; a mapping: MAP_POPULATE) are there when it is
  handed out, so writing it all takes (almost) no page faults; it is
  recycled like any block."""
  import gc
  import resource
  from tenplex_jax import _hostmem
  monkeypatch.setenv("TENPLEX_JAX_HOST_POOL_GIB", "4")
  gc.collect()
  _hostmem.release_host_pool()
  for nbytes in (8 << 20, _hostmem._MIN_MAPPED + (1 << 20)):
    pages = nbytes // 4096
    b = _hostmem.host_empty((nbytes // 4,), np.float32, populate=True)
    assert b.ctypes.data % 64 == 0 and b.flags.writeable
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b[...] = 3.0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < pages // 8, (nbytes, faults, pages)
    y = jax.device_put(b, jax.devices()[1], may_alias=True)
    assert y.unsafe_buffer_pointer() == b.ctypes.data
    assert np.all(np.asarray(y) == 3.0)
    del b, y
    gc.collect()
    assert _hostmem.host_pool_stats()["idle_bytes"] >= nbytes
    _hostmem.release_host_pool()


@pytest.mark.parametrize("dtype", [np.int8, ml_dtypes.bfloat16, np.bool_,
                                   ml_dtypes.int4, np.float32, np.complex64,
                                   np.float64])
def test_short_strided_rows_copied_as_one_raw_element_are_bitwise(dtype):
  # Every row length up to past _ROW_UNIT_MAX, strided on either side, from
  # random bytes (NaN payloads and all): the copy is the bytes; rows of at
  # most _ROW_UNIT_MAX bytes go as one void element each.
  R = importlib.import_module("tenplex_jax.reshard")
  rng = np.random.default_rng(5)
  item = np.dtype(dtype).itemsize
  for cols in range(1, R._ROW_UNIT_MAX // item + 3):
    raw = rng.integers(0, 256, (37, 3 * cols * item), dtype=np.uint8)
    whole = raw.view(dtype) if dtype not in (np.bool_, ml_dtypes.int4) else (
        (raw % 2).astype(dtype) if dtype is np.bool_ else
        (raw % 16 - 8).astype(np.int8).astype(dtype))
    for dst_strided in (False, True):
      src = whole[:, cols:2 * cols]
      out = np.zeros((37, 3 * cols), dtype)
      dst = out[:, cols:2 * cols] if dst_strided else np.zeros((37, cols), dtype)
      d, s_ = R._widened(dst, src)
      if 1 < cols and cols * item <= R._ROW_UNIT_MAX:
        assert d.dtype.kind == "V" and d.dtype.itemsize == cols * item
      d[...] = s_
      assert np.array_equal(dst.view(np.uint8), src.view(np.uint8)), cols


@pytest.mark.parametrize("dtype", [np.int8, ml_dtypes.bfloat16, np.bool_,
                                   ml_dtypes.int4, np.float32])
def test_short_rows_are_copied_bitwise_in_wider_units(monkeypatch, dtype):
  # Columns 2 -> rows 2 x columns 4: every piece is a strided block whose
  # rows are 2 (or 1) elements, which the copy moves as wider integers.
  R = importlib.import_module("tenplex_jax.reshard")
  monkeypatch.setattr(R, "_SMALL_PIECE_BYTES", 0)  # every piece is "large"
  devs = np.array(jax.devices()[:8])
  rng = np.random.default_rng(3)
  host = rng.integers(0, 7, size=(4096, 8)).astype(dtype)
  src = NamedSharding(Mesh(devs[[1, 7]], ("a",)), P(None, "a"))
  x = jax.device_put(host, src)
  target = NamedSharding(Mesh(devs[[3, 7, 4, 5, 6, 0, 2, 1]].reshape(2, 4),
                              ("a", "b")), P("a", "b"))
  wide = []
  real = R._widened
  monkeypatch.setattr(R, "_widened", lambda d, s: wide.append(
      real(d, s)[0].dtype.itemsize) or real(d, s))
  y = tenplex_jax.reshard(x, target, method="cpu")
  assert y.sharding == target
  assert np.array_equal(np.asarray(y).view(np.uint8), host.view(np.uint8))
  assert wide and max(wide) > np.dtype(dtype).itemsize


def test_same_source_again_adopts_the_live_earlier_result():
  # Resharding the same (unchanged, immutable) source arrays again while the
  # earlier result lives adopts that result's buffers instead of filling new
  # ones; a fresh copy of the source, or a source whose earlier result is
  # gone, is copied again. Donating the new result leaves the earlier one
  # intact (jax never writes into a host buffer it adopted).
  import gc
  devs = np.array(jax.devices()[:8])
  src = NamedSharding(Mesh(devs.reshape(2, 4), ("a", "b")), P(None, "b"))
  dst = NamedSharding(Mesh(devs[4:].reshape(4), ("a",)), P("a", None))
  hosts = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
           "s": np.arange(8 * 4, dtype=np.int8).reshape(8, 4)}
  tree = {k: jax.device_put(v, src) for k, v in hosts.items()}
  target = {k: dst for k in hosts}

  def ptrs(out):
    return {k: [s.data.unsafe_buffer_pointer() for s in v.addressable_shards]
            for k, v in out.items()}

  first, rep1 = tenplex_jax.reshard_with_report(tree, target, method="cpu")
  assert rep1.copied_bytes == sum(v.nbytes for v in hosts.values())
  second, rep2 = tenplex_jax.reshard_with_report(tree, target, method="cpu")
  assert rep2.copied_bytes == 0 and ptrs(second) == ptrs(first)
  for k, v in hosts.items():
    assert second[k].sharding == dst
    assert np.asarray(second[k]).tobytes() == v.tobytes()
  doubled = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t),
                    donate_argnums=0)(second)
  jax.block_until_ready(doubled)
  for k, v in hosts.items():
    assert np.asarray(first[k]).tobytes() == v.tobytes()
  fresh = {k: jax.device_put(v, src) for k, v in hosts.items()}
  _, rep3 = tenplex_jax.reshard_with_report(fresh, target, method="cpu")
  assert rep3.copied_bytes == rep1.copied_bytes
  del first, second, doubled
  gc.collect()
  # Boxes under 16 KiB are not pooled, so once dropped their bytes are gone.
  again, rep4 = tenplex_jax.reshard_with_report(tree, target, method="cpu")
  assert rep4.copied_bytes == rep1.copied_bytes
  for k, v in hosts.items():
    assert np.asarray(again[k]).tobytes() == v.tobytes()


def test_same_source_after_its_result_was_dropped_takes_its_bytes_back():
  # A dropped result's pooled blocks keep its bytes until the pool hands
  # them out again: resharding the same source arrays takes them back
  # instead of copying (also after the result was donated: jax never writes
  # into a host buffer it adopted). A block handed out since (here to a
  # reshard of other values into the same shapes), or freed by
  # release_host_pool, is not taken back: those boxes are copied again.
  import gc
  from tenplex_jax import _hostmem
  devs, a, b = _meshes()
  host = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
  other = -host
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  target = NamedSharding(b, P(("data", "tensor")))  # 8 boxes of 32 KiB
  gc.collect()
  _hostmem.collect_dropped_buffers()
  _hostmem.release_host_pool()

  def run(src):
    out, rep = tenplex_jax.reshard_with_report(src, target, method="cpu")
    assert out.sharding == target
    return out, rep

  y, rep1 = run(x)
  assert rep1.copied_bytes == host.nbytes
  del y
  before = _hostmem.host_pool_stats()
  z, rep2 = run(x)
  after = _hostmem.host_pool_stats()
  assert rep2.copied_bytes == 0
  assert after["reclaimed"] - before["reclaimed"] == 8
  assert after["mapped"] == before["mapped"]
  assert np.asarray(z).tobytes() == host.tobytes()
  doubled = jax.jit(lambda t: t * 2, donate_argnums=0)(z)
  jax.block_until_ready(doubled)
  del z, doubled
  w, rep3 = run(x)  # taken back again after the donation
  assert rep3.copied_bytes == 0
  assert np.asarray(w).tobytes() == host.tobytes()
  del w
  # The blocks go to a reshard of other values, then come back.
  o, _ = run(jax.device_put(other, NamedSharding(a, P("data", "tensor"))))
  assert np.asarray(o).tobytes() == other.tobytes()
  del o
  v, rep4 = run(x)
  assert rep4.copied_bytes == host.nbytes
  assert np.asarray(v).tobytes() == host.tobytes()
  del v
  _hostmem.collect_dropped_buffers()
  assert _hostmem.host_pool_stats()["idle_bytes"] >= host.nbytes
  assert _hostmem.release_host_pool() >= host.nbytes
  u, rep5 = run(x)
  assert rep5.copied_bytes == host.nbytes
  assert np.asarray(u).tobytes() == host.tobytes()
  del u
  _hostmem.collect_dropped_buffers()
  _hostmem.release_host_pool()
