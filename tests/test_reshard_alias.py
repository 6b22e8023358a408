"""The CPU fast path hands its new shard buffers to jax without a copy."""

import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax
from tenplex_jax._hostmem import host_empty as _aligned_empty

DTYPES = [np.float32, ml_dtypes.bfloat16, np.bool_, ml_dtypes.int4,
          ml_dtypes.float8_e4m3fn, np.uint32, np.complex64]


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
  _hostmem.release_host_pool()
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  b = Mesh(devs.reshape(2, 4), ("data", "tensor"))
  host = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)
  x = jax.device_put(host, NamedSharding(a, P("data", "tensor")))
  target = NamedSharding(b, P("tensor", "data"))  # 1 MiB shards: mapped
  y = tenplex_jax.reshard(x, target, method="cpu")
  before = _hostmem.host_pool_stats()
  assert before["idle_bytes"] == 0
  held = np.asarray(y.addressable_shards[0].data)  # a view keeps it alive
  del y
  gc.collect()
  mid = _hostmem.host_pool_stats()
  assert 0 < mid["idle_bytes"]
  z = tenplex_jax.reshard(x, target, method="cpu")
  after = _hostmem.host_pool_stats()
  assert after["reused"] > mid["reused"]
  # Recycled buffers hold the right values; the view still sees its own.
  assert np.array_equal(np.asarray(z), host)
  assert np.array_equal(held, host[0:512, 0:512])
  assert _hostmem.release_host_pool() >= 0
  assert _hostmem.host_pool_stats()["idle_bytes"] == 0


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


@pytest.mark.parametrize("threads", ["1", "3"])
def test_threaded_copies_are_bitwise(monkeypatch, threads):
  R = sys.modules["tenplex_jax.reshard"]
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", threads)
  monkeypatch.setattr(R, "_THREADED_MIN_BYTES", 0)  # thread even tiny copies
  devs = np.array(jax.devices()[:8])
  a = Mesh(devs.reshape(4, 2), ("data", "tensor"))
  b = Mesh(devs[::-1].reshape(2, 4), ("data", "tensor"))
  rng = np.random.default_rng(1)
  tree = {
      "w": rng.standard_normal((64, 48)).astype(np.float32),
      "v": rng.integers(0, 255, (40, 16, 3)).astype(np.uint8),
      "s": np.float32(3.5),
      "e": np.zeros((0, 8), np.float32),
  }
  src = {"w": P("data", "tensor"), "v": P(None, "tensor"), "s": P(),
         "e": P(None, "tensor")}
  dst = {"w": P("tensor", "data"), "v": P("tensor", None), "s": P(),
         "e": P(None, "tensor")}
  x = {k: jax.device_put(v, NamedSharding(a, src[k])) for k, v in tree.items()}
  y = tenplex_jax.reshard(x, {k: NamedSharding(b, p) for k, p in dst.items()},
                          method="cpu")
  for k, v in tree.items():
    assert np.array_equal(np.asarray(y[k]), v)
    for s in y[k].addressable_shards:
      assert np.array_equal(np.asarray(s.data), v[s.index])


def test_bad_copy_threads_setting(monkeypatch):
  R = sys.modules["tenplex_jax.reshard"]
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", "many")
  with pytest.raises(ValueError, match="TENPLEX_JAX_COPY_THREADS"):
    R._copy_threads()


def test_copy_threads_work_in_a_forked_child(monkeypatch):
  import multiprocessing as mp
  R = sys.modules["tenplex_jax.reshard"]
  monkeypatch.setenv("TENPLEX_JAX_COPY_THREADS", "2")
  monkeypatch.setattr(R, "_THREADED_MIN_BYTES", 0)
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
