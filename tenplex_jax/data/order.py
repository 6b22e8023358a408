"""The global sample order: a pure function of (seed, epoch, num_samples).

Nothing here depends on devices, processes or workers. Step ``t`` of an
epoch consumes the global positions ``[t * B, (t + 1) * B)`` of that epoch's
order, where ``B`` is the constant global batch size. The last step of an
epoch is padded with masked slots (sample id ``-1``) so every global batch has
``B`` slots and every sample is used exactly once per epoch. Shard ``i`` of
``n`` reads a contiguous part of each global batch (see :func:`shard_bounds`).
"""

from __future__ import annotations

import numpy as np

from tenplex_jax.errors import DataError

PAD_ID = -1
"""The sample id of a padded (masked) slot."""


def _check_nonneg_int(name: str, value: object) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise DataError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
  if value < 0:
    raise DataError(f"{name} must be >= 0, got {value}")
  return int(value)


def check_pos_int(name: str, value: object) -> int:
  value = _check_nonneg_int(name, value)
  if value == 0:
    raise DataError(f"{name} must be >= 1, got 0")
  return value


MAX_SAMPLES = 1 << 40
"""The largest source an epoch order is built for (an epoch permutes all ids)."""


def source_length(source: object) -> int:
  """``len(source)`` of a random-access source, checked to be usable for epochs.

  Raises:
    DataError: the source has no ``len``/``[]``, is empty, or is too long for
      an epoch order (a Grain ``MapDataset.repeat()`` without a count has
      ``len == sys.maxsize``): the iterators make the epochs themselves.

  Example:
    >>> source_length([1, 2])
    2
  """
  try:
    n = len(source)
    source.__getitem__  # noqa: B018 - random access is required
  except (TypeError, AttributeError):
    raise DataError(
        f"source must be random-access (len() and [i]), got {type(source).__name__}") from None
  if n == 0:
    raise DataError("source is empty; expected at least one sample")
  if n > MAX_SAMPLES:
    raise DataError(
        f"source has {n} samples, more than the {MAX_SAMPLES} an epoch order is built for "
        "(an infinite Grain MapDataset, e.g. .repeat() without a count?): pass the finite "
        "dataset and let the iterator's num_epochs repeat it")
  return int(n)


def epoch_seed_sequence(seed: int, epoch: int) -> np.random.SeedSequence:
  """The numpy seed sequence of one epoch: ``SeedSequence(seed, spawn_key=(epoch,))``.

  This is the same stream numpy's ``SeedSequence(seed).spawn(...)`` would give
  the ``epoch``-th child, so the seed of an epoch depends on (seed, epoch) only.

  Args:
    seed: the job's data seed (a non-negative int).
    epoch: the epoch number (0-based).

  Returns:
    A ``numpy.random.SeedSequence``.

  Example:
    >>> ss = epoch_seed_sequence(0, 3)
    >>> ss.spawn_key
    (3,)
  """
  seed = _check_nonneg_int("seed", seed)
  epoch = _check_nonneg_int("epoch", epoch)
  return np.random.SeedSequence(seed, spawn_key=(epoch,))


def epoch_permutation(seed: int, epoch: int, num_samples: int, *,
                      shuffle: bool = True) -> np.ndarray:
  """The order of the global sample ids in one epoch.

  The permutation is ``Generator(PCG64(epoch_seed_sequence(seed, epoch)))
  .permutation(num_samples)``: a function of ``(seed, epoch, num_samples)``
  only. With ``shuffle=False`` it is ``arange(num_samples)`` in every epoch.

  Args:
    seed: the job's data seed (a non-negative int).
    epoch: the epoch number (0-based).
    num_samples: the number of samples in the dataset.
    shuffle: whether to shuffle; keyword-only.

  Returns:
    An int64 array of shape ``(num_samples,)`` holding each id exactly once.

  Example:
    >>> p = epoch_permutation(0, 0, 5)
    >>> sorted(p.tolist())
    [0, 1, 2, 3, 4]
    >>> bool((p == epoch_permutation(0, 0, 5)).all())
    True
    >>> epoch_permutation(0, 1, 4, shuffle=False).tolist()
    [0, 1, 2, 3]
  """
  num_samples = _check_nonneg_int("num_samples", num_samples)
  ss = epoch_seed_sequence(seed, epoch)
  if not shuffle:
    return np.arange(num_samples, dtype=np.int64)
  rng = np.random.Generator(np.random.PCG64(ss))
  return rng.permutation(num_samples).astype(np.int64, copy=False)


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
  """The number of global steps of one epoch: ``ceil(num_samples / B)``.

  Args:
    num_samples: the number of samples in the dataset (>= 1).
    global_batch_size: the constant global batch size B (>= 1).

  Returns:
    The step count; the last step is padded when B does not divide N.

  Example:
    >>> steps_per_epoch(10, 4)
    3
    >>> steps_per_epoch(8, 4)
    2
  """
  num_samples = check_pos_int("num_samples", num_samples)
  global_batch_size = check_pos_int("global_batch_size", global_batch_size)
  return -(-num_samples // global_batch_size)


def shard_bounds(global_batch_size: int, shard_index: int,
                 shard_count: int) -> tuple[int, int]:
  """The slots ``[start, stop)`` of a global batch that one shard reads.

  Split rule: with ``B = q * n + r``, shard ``i`` reads ``q + 1`` slots if
  ``i < r`` and ``q`` slots otherwise, in shard order, so concatenating the
  parts of shards ``0 .. n-1`` gives the global batch. When ``n`` divides
  ``B`` every shard reads ``B / n`` slots. A shard may read 0 slots if
  ``n > B``.

  Args:
    global_batch_size: the constant global batch size B (>= 1).
    shard_index: this shard's index i, ``0 <= i < n``.
    shard_count: the number of data-parallel shards n (>= 1).

  Returns:
    ``(start, stop)`` positions inside the global batch.

  Example:
    >>> [shard_bounds(10, i, 4) for i in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
  """
  b = check_pos_int("global_batch_size", global_batch_size)
  n = check_pos_int("shard_count", shard_count)
  i = _check_nonneg_int("shard_index", shard_index)
  if i >= n:
    raise DataError(
        f"shard_index must be < shard_count, got shard_index={i} with shard_count={n}")
  q, r = divmod(b, n)
  start = i * q + min(i, r)
  return start, start + q + (1 if i < r else 0)


def global_batch_ids(seed: int, epoch: int, step: int, num_samples: int,
                     global_batch_size: int, *, shuffle: bool = True,
                     permutation: np.ndarray | None = None) -> np.ndarray:
  """The global sample ids of one step, ``-1`` in padded slots.

  Step ``t`` holds positions ``[t * B, (t + 1) * B)`` of the epoch order;
  positions ``>= num_samples`` (only in the last step) are padded with ``-1``.

  Args:
    seed: the job's data seed.
    epoch: the epoch number (0-based).
    step: the step within the epoch, ``0 <= step < steps_per_epoch``.
    num_samples: the number of samples N.
    global_batch_size: the constant global batch size B.
    shuffle: whether epochs are shuffled; keyword-only.
    permutation: the epoch order if already computed (must equal
      ``epoch_permutation(seed, epoch, num_samples, shuffle=shuffle)``);
      keyword-only, saves recomputing it.

  Returns:
    An int64 array of shape ``(B,)``.

  Example:
    >>> global_batch_ids(0, 0, 2, 10, 4, shuffle=False).tolist()
    [8, 9, -1, -1]
  """
  steps = steps_per_epoch(num_samples, global_batch_size)
  step = _check_nonneg_int("step", step)
  if step >= steps:
    raise DataError(
        f"step must be < steps_per_epoch={steps} (num_samples={num_samples}, "
        f"global_batch_size={global_batch_size}), got step={step}")
  if permutation is None:
    permutation = epoch_permutation(seed, epoch, num_samples, shuffle=shuffle)
  out = np.full(global_batch_size, PAD_ID, dtype=np.int64)
  part = permutation[step * global_batch_size:(step + 1) * global_batch_size]
  out[:part.shape[0]] = part
  return out


def shard_batch_ids(seed: int, epoch: int, step: int, num_samples: int,
                    global_batch_size: int, shard_index: int, shard_count: int,
                    *, shuffle: bool = True,
                    permutation: np.ndarray | None = None) -> np.ndarray:
  """The global sample ids one shard reads at one step (``-1`` if padded).

  Equal to ``global_batch_ids(...)[start:stop]`` with
  ``(start, stop) = shard_bounds(B, shard_index, shard_count)``.

  Args:
    seed: the job's data seed.
    epoch: the epoch number (0-based).
    step: the step within the epoch.
    num_samples: the number of samples N.
    global_batch_size: the constant global batch size B.
    shard_index: this shard's index i.
    shard_count: the number of shards n.
    shuffle: whether epochs are shuffled; keyword-only.
    permutation: the precomputed epoch order; keyword-only.

  Returns:
    An int64 array of this shard's slots.

  Example:
    >>> shard_batch_ids(0, 0, 2, 10, 4, 1, 2, shuffle=False).tolist()
    [-1, -1]
  """
  start, stop = shard_bounds(global_batch_size, shard_index, shard_count)
  ids = global_batch_ids(seed, epoch, step, num_samples, global_batch_size,
                         shuffle=shuffle, permutation=permutation)
  return ids[start:stop]
