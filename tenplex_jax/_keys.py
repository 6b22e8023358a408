"""Typed PRNG key arrays: telling them apart, their key data's sharding, and
wrapping key data back as keys on the sharding the target gave.

Key arrays move as their key data (``uint32[..., 2]`` for threefry), which has
trailing dimensions the keys lack; these helpers are shared by reshard, the
stores, Orbax restores and job arrays.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import (NamedSharding, PartitionSpec, Sharding,
                          SingleDeviceSharding)

from tenplex_jax.errors import LayoutError

__all__ = ["is_key", "key_data_sharding", "wrap_keys"]


def is_key(x: Any) -> bool:
  """Whether ``x`` (an array, or anything with a ``dtype``) holds typed PRNG
  keys.

  >>> is_key(jax.random.key(0)), is_key(jax.random.key_data(jax.random.key(0)))
  (True, False)
  """
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def key_data_sharding(sharding: Sharding, ndim: int, extra: int) -> Sharding:
  """The sharding of ``key_data(k)`` for keys ``k`` sharded by ``sharding``
  (``ndim``: the keys' rank; ``extra``: the key data's trailing dimensions).

  >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  >>> key_data_sharding(s, 1, 1) == s
  True
  """
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec) + extra)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec),
                         memory_kind=sharding.memory_kind)
  if isinstance(sharding, SingleDeviceSharding):
    return sharding
  raise LayoutError(f"PRNG key arrays support NamedSharding and"
                    f" SingleDeviceSharding, not {type(sharding).__name__}")


def wrap_keys(data: jax.Array, impl: Any,
              sharding: Sharding | None = None) -> jax.Array:
  """``data`` (key data) wrapped as PRNG keys of ``impl``, on ``sharding``
  (the keys' sharding, as the target gave it) when that is given.

  ``jax.random.wrap_key_data`` derives the keys' sharding from the data's,
  and not the same way everywhere: on a one-device mesh it keeps the data's
  spec (keys of shape ``(4,)`` on ``P('a')`` came back on
  ``P('a', None)``), elsewhere it pads it to the keys' rank. The keys are
  put on ``sharding`` itself, over the same device buffers (no copy).

  >>> s = jax.sharding.NamedSharding(jax.make_mesh((1,), ("a",)),
  ...                                PartitionSpec("a"))
  >>> data = jax.device_put(jax.numpy.zeros((4, 2), "uint32"),
  ...                       key_data_sharding(s, 1, 1))
  >>> wrap_keys(data, "threefry2x32", s).sharding == s
  True
  """
  keys = jax.random.wrap_key_data(data, impl=impl)
  if sharding is None or keys.sharding == sharding:
    return keys
  return jax.make_array_from_single_device_arrays(
      keys.shape, sharding, [s.data for s in keys.addressable_shards])
