"""Per-sample randomness that does not depend on the device count.

Augmentations draw from a key derived from ``(seed, epoch, global sample
id)`` only, so a sample is augmented the same way whichever shard reads it:
``fold_in(fold_in(key(seed), epoch), sample_id)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tenplex_jax.errors import DataError


def _check_int(name: str, value: object, *, allow_pad: bool = False) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise DataError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
  low = -1 if allow_pad else 0
  if value < low:
    raise DataError(f"{name} must be >= {low}, got {value}")
  return int(value)


def sample_key(seed: int, epoch: int, sample_id: int) -> jax.Array:
  """The jax PRNG key of one sample in one epoch.

  ``jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), epoch),
  sample_id)``: a function of its three arguments only.

  Args:
    seed: the job's data seed (>= 0).
    epoch: the epoch number (>= 0).
    sample_id: the global sample id (>= 0; -1, the pad id, is allowed and
      gives a valid but meaningless key).

  Returns:
    A scalar typed key array (``jax.random.key``).

  Example:
    >>> k = sample_key(0, 1, 7)
    >>> bool((jax.random.key_data(k) == jax.random.key_data(sample_key(0, 1, 7))).all())
    True
    >>> bool((jax.random.key_data(k) == jax.random.key_data(sample_key(0, 2, 7))).all())
    False
  """
  seed = _check_int("seed", seed)
  epoch = _check_int("epoch", epoch)
  sample_id = _check_int("sample_id", sample_id, allow_pad=True)
  return _keys(seed, epoch, jnp.asarray([sample_id], dtype=jnp.int32))[0]


@jax.jit
def _fold_ids(base, ids):
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(ids)


def _keys(seed: int, epoch: int, ids: jax.Array) -> jax.Array:
  # The base key is built outside jit so seeds up to 2**64 - 1 are exact.
  base = jax.random.fold_in(jax.random.key(seed), epoch)
  return _fold_ids(base, ids)


def sample_keys(seed: int, epoch: int, sample_ids: np.ndarray) -> jax.Array:
  """The keys of many samples at once: ``sample_keys(...)[j] == sample_key(..., ids[j])``.

  Args:
    seed: the job's data seed.
    epoch: the epoch number.
    sample_ids: a 1-D integer array of global sample ids (-1 allowed for
      padded slots).

  Returns:
    A typed key array of shape ``sample_ids.shape``.

  Example:
    >>> ks = sample_keys(0, 1, np.array([7, 3]))
    >>> bool((jax.random.key_data(ks[0]) == jax.random.key_data(sample_key(0, 1, 7))).all())
    True
  """
  seed = _check_int("seed", seed)
  epoch = _check_int("epoch", epoch)
  ids = np.asarray(sample_ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise DataError(
        f"sample_ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
  if ids.size and (ids.min() < -1 or ids.max() >= 2**31):
    raise DataError(
        f"sample_ids must lie in [-1, 2**31), got min {ids.min()} max {ids.max()}")
  return _keys(seed, epoch, jnp.asarray(ids, dtype=jnp.int32))


def sample_key_data(seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
  """Raw key data of :func:`sample_keys` as a numpy array (what batches carry).

  Rebuild typed keys with ``jax.random.wrap_key_data(batch["rng"])``.

  Args:
    seed: the job's data seed.
    epoch: the epoch number.
    sample_ids: a 1-D integer array of global sample ids.

  Returns:
    A uint32 numpy array of shape ``(len(sample_ids), 2)`` for the default
    threefry implementation.

  Example:
    >>> sample_key_data(0, 0, np.array([1, 2])).shape
    (2, 2)
  """
  return np.asarray(jax.random.key_data(sample_keys(seed, epoch, sample_ids)))
