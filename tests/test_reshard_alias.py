"""The CPU fast path hands its new shard buffers to jax without a copy."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax
from tenplex_jax.reshard import _aligned_empty

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
