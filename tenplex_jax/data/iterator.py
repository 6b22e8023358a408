"""The elastic iterator: this shard's part of each global batch, resumable anywhere.

Every global batch is a function of (seed, epoch, step, N, B) only
(:mod:`tenplex_jax.data.order`); a shard reads a contiguous part of it. The
state (:meth:`ElasticIterator.get_state`) is the position of the first step
that is not completed, plus what identifies the order and the dataset, so it
is the same on every shard and restores under any shard count.

When a step counts as completed:

* ``auto_commit=True`` (default): when its batch is handed to the consumer,
  i.e. returned by ``next()``. For the loop ``for batch in it: train(batch)``
  a ``get_state()`` inside or after the loop counts exactly the batches the
  loop has received. Batches prefetched by the background thread but not yet
  returned are never counted, so a restart from the state loses nothing and
  repeats nothing.
* ``auto_commit=False``: only when you call :meth:`ElasticIterator.commit`
  (e.g. after the optimizer step). Use this when something pulls batches
  ahead of training (a device-prefetch wrapper, an async pipeline).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tenplex_jax.data import order
from tenplex_jax.data.rng import sample_key_data
from tenplex_jax.errors import DataError

STATE_VERSION = 1
_RESERVED = ("ids", "mask", "rng")
_END = object()


class _Raised:

  def __init__(self, exc: BaseException):
    self.exc = exc


def _as_array_template(sample: Any) -> Any:
  if isinstance(sample, dict):
    return {k: np.zeros_like(np.asarray(v)) for k, v in sample.items()}
  if isinstance(sample, (bytes, bytearray)):
    return b""
  if isinstance(sample, str):
    return ""
  return np.zeros_like(np.asarray(sample))


def _stack(values: list, template: Any) -> np.ndarray:
  if isinstance(template, (bytes, str)):
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
  if not values:
    t = np.asarray(template)
    return np.empty((0,) + t.shape, dtype=t.dtype)
  return np.stack([np.asarray(v) for v in values])


class ElasticIterator:
  """Yields this shard's part of each global batch; resumes under any shard count.

  Each batch is a dict:

  * for a source whose samples are dicts: one stacked array per key;
  * otherwise (arrays, scalars): the stacked samples under ``"data"``
    (bytes and str samples: a 1-D object array);
  * ``"ids"``: int64 global sample ids of the slots, ``-1`` for a padded slot;
  * ``"mask"``: bool, True for real samples (``ids >= 0``);
  * ``"rng"`` (only with ``with_rng=True``): uint32 key data ``(k, 2)`` of
    :func:`tenplex_jax.data.sample_key` per slot; ``jax.random.wrap_key_data``
    turns it back into keys.

  Padded slots hold zeros shaped like a real sample. The template is a real
  sample of the same batch, else one read earlier, else ``source[0]`` (the
  only read of a sample this shard does not own; it happens only when this
  shard's very first batch holds no real sample).

  Order: epoch ``e`` is :func:`order.epoch_permutation(seed, e, N)`; step
  ``t`` is positions ``[t*B, (t+1)*B)``, the last step padded with ``-1``;
  shard ``i`` of ``n`` reads slots :func:`order.shard_bounds(B, i, n)`.
  Iteration stops after ``num_epochs`` epochs (never if None).

  Prefetch: with ``prefetch > 0`` a background thread builds the next
  batches in the order they will be consumed (the order is known) into a
  queue of at most ``prefetch`` batches; ``read_threads > 1`` reads the
  samples of a batch in parallel. An exception in the thread is raised by
  ``next()`` (iterating again retries from the same step). :meth:`close`
  (or leaving a ``with`` block) stops and joins the thread.

  Args:
    source: a random-access dataset: ``len(source)`` and ``source[i]`` (a
      list, a numpy array, a :class:`tenplex_jax.data.DatasetReader`).
    global_batch_size: the constant global batch size B; keyword-only.
    seed: the data seed; keyword-only.
    shard_index: this shard's index i (e.g. ``jax.process_index()``).
    shard_count: the number of data-parallel shards n.
    num_epochs: stop after this many epochs; None runs forever.
    shuffle: shuffle each epoch (``False``: the file order every epoch).
    prefetch: batches to prefetch in a background thread (0: read inline).
    read_threads: threads reading the samples of one batch.
    auto_commit: count a step as completed when its batch is returned.
    with_rng: add ``"rng"`` per-sample keys to each batch.
    fingerprint: identifies the dataset in the state; defaults to
      ``source.fingerprint`` if the source has one, else None (then only
      ``num_samples`` is checked on restore).

  Example:
    >>> it = ElasticIterator(list(range(10)), global_batch_size=4, seed=0,
    ...                      shard_index=1, shard_count=2, shuffle=False, num_epochs=1)
    >>> [b["data"].tolist() for b in it]
    [[2, 3], [6, 7], [0, 0]]
    >>> it.get_state()["epoch"], it.get_state()["step"]
    (1, 0)
  """

  def __init__(self, source: Any, *, global_batch_size: int, seed: int,
               shard_index: int = 0, shard_count: int = 1,
               num_epochs: int | None = None, shuffle: bool = True,
               prefetch: int = 2, read_threads: int = 1, auto_commit: bool = True,
               with_rng: bool = False, fingerprint: str | None = None):
    num_samples = order.source_length(source)
    self._steps = order.steps_per_epoch(num_samples, global_batch_size)
    order.shard_bounds(global_batch_size, shard_index, shard_count)  # validates
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 0):
      raise DataError(f"num_epochs must be None or an int >= 0, got {num_epochs!r}")
    order.epoch_seed_sequence(seed, 0)  # validates seed
    if not isinstance(prefetch, int) or prefetch < 0:
      raise DataError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if not isinstance(read_threads, int) or read_threads < 1:
      raise DataError(f"read_threads must be an int >= 1, got {read_threads!r}")
    self.source = source
    self.num_samples = int(num_samples)
    self.global_batch_size = int(global_batch_size)
    self.seed = int(seed)
    self.shard_index = int(shard_index)
    self.shard_count = int(shard_count)
    self.num_epochs = num_epochs
    self.shuffle = bool(shuffle)
    self.prefetch = prefetch
    self.read_threads = read_threads
    self.auto_commit = bool(auto_commit)
    self.with_rng = bool(with_rng)
    self.fingerprint = fingerprint if fingerprint is not None else getattr(
        source, "fingerprint", None)
    self._yielded = (0, 0)    # (epoch, step) of the next batch to return
    self._committed = (0, 0)  # (epoch, step) of the first step not completed
    self._template: Any = None
    self._perm_cache: tuple[int, np.ndarray] | None = None
    self._perm_lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._queue: queue.Queue | None = None
    self._stop: threading.Event | None = None
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._closed = False

  @classmethod
  def for_process(cls, source: Any, **kwargs: Any) -> ElasticIterator:
    """An iterator whose shard is this JAX process: ``jax.process_index()`` of ``jax.process_count()``.

    Each process then reads only its own part of every global batch.

    Example:
      >>> it = ElasticIterator.for_process(list(range(4)), global_batch_size=2, seed=0)
      >>> (it.shard_index, it.shard_count)
      (0, 1)
    """
    return cls(source, shard_index=jax.process_index(), shard_count=jax.process_count(),
               **kwargs)

  # -- positions -------------------------------------------------------------

  @property
  def steps_per_epoch(self) -> int:
    """Global steps per epoch, ``ceil(N / B)``."""
    return self._steps

  def _advance(self, pos: tuple[int, int], steps: int = 1) -> tuple[int, int]:
    g = pos[0] * self._steps + pos[1] + steps
    return divmod(g, self._steps)

  def _finished(self, pos: tuple[int, int]) -> bool:
    return self.num_epochs is not None and pos[0] >= self.num_epochs

  # -- reading ---------------------------------------------------------------

  def _permutation(self, epoch: int) -> np.ndarray:
    with self._perm_lock:
      if self._perm_cache is None or self._perm_cache[0] != epoch:
        self._perm_cache = (epoch, order.epoch_permutation(
            self.seed, epoch, self.num_samples, shuffle=self.shuffle))
      return self._perm_cache[1]

  def shard_ids(self, epoch: int, step: int) -> np.ndarray:
    """The global sample ids this shard reads at ``(epoch, step)`` (``-1``: padded).

    Example:
      >>> it = ElasticIterator(list(range(10)), global_batch_size=4, seed=0, shuffle=False)
      >>> it.shard_ids(0, 2).tolist()
      [8, 9, -1, -1]
    """
    return order.shard_batch_ids(self.seed, epoch, step, self.num_samples,
                                 self.global_batch_size, self.shard_index, self.shard_count,
                                 shuffle=self.shuffle, permutation=self._permutation(epoch))

  def _read(self, ids: list[int]) -> list:
    if self._pool is not None and len(ids) > 1:
      return list(self._pool.map(self.source.__getitem__, ids))
    return [self.source[i] for i in ids]

  def _make_batch(self, epoch: int, step: int) -> dict[str, np.ndarray]:
    ids = self.shard_ids(epoch, step)
    mask = ids >= 0
    samples = self._read([int(i) for i in ids[mask]])
    for i, sample in zip(ids[mask].tolist(), samples):
      if sample is None:
        raise DataError(
            f"source returned None for sample {i} (epoch {epoch} step {step}): a filtered "
            "Grain MapDataset? ElasticIterator needs every sample (its batches are fixed "
            "positions); use PackedIterator, which skips None samples, for filtering")
    if samples:
      template = _as_array_template(samples[0])
      self._template = template
    elif self._template is not None:
      template = self._template
    else:
      template = self._template = _as_array_template(self.source[0])
    it = iter(samples)
    if isinstance(template, dict):
      for s in samples:
        if not isinstance(s, dict) or s.keys() != template.keys():
          raise DataError(
              f"samples at epoch {epoch} step {step} have different structures: "
              f"expected dict keys {sorted(template)}, got {type(s).__name__} "
              f"{sorted(s) if isinstance(s, dict) else ''}")
      clash = [k for k in template if k in _RESERVED]
      if clash:
        raise DataError(f"sample keys {clash} clash with the batch keys {list(_RESERVED)}")
      slots = [next(it) if m else template for m in mask]
      batch = {k: _stack([s[k] for s in slots], template[k]) for k in template}
    else:
      slots = [next(it) if m else template for m in mask]
      batch = {"data": _stack(slots, template)}
    batch["ids"] = ids.copy()
    batch["mask"] = mask
    if self.with_rng:
      batch["rng"] = sample_key_data(self.seed, epoch, ids)
    return batch

  # -- prefetch thread -------------------------------------------------------

  @staticmethod
  def _produce(ref: weakref.ref, start: tuple[int, int], q: queue.Queue,
               stop: threading.Event) -> None:
    # Holds the iterator only through a weak reference between batches, so an
    # iterator dropped without close() is collected and its thread stops.

    def put(item: Any) -> bool:
      while not stop.is_set():
        try:
          q.put(item, timeout=0.05)
          return True
        except queue.Full:
          continue
      return False

    pos = start
    while not stop.is_set():
      it = ref()
      if it is None:
        return
      try:
        if it._finished(pos):
          item = _END
        else:
          item = (pos, it._make_batch(*pos))
          pos = it._advance(pos)
      except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        item = _Raised(exc)
      del it
      if not put(item) or item is _END or isinstance(item, _Raised):
        return

  def _start(self) -> None:
    if self.read_threads > 1 and self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          self.read_threads, thread_name_prefix="tenplex-data-read")
    if self.prefetch == 0 or self._thread is not None:
      return
    self._queue = queue.Queue(maxsize=self.prefetch)
    self._stop = threading.Event()
    self._thread = threading.Thread(
        target=ElasticIterator._produce,
        args=(weakref.ref(self), self._yielded, self._queue, self._stop),
        name=f"tenplex-data-prefetch-{self.shard_index}", daemon=True)
    self._thread.start()

  def _stop_thread(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    while self._thread.is_alive():
      try:  # unblock a producer waiting on a full queue
        while True:
          self._queue.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=0.05)
    self._thread = self._queue = self._stop = None

  @property
  def prefetch_alive(self) -> bool:
    """Whether the background prefetch thread is running."""
    return self._thread is not None and self._thread.is_alive()

  # -- iteration -------------------------------------------------------------

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._closed:
      raise DataError("the iterator is closed")
    if self._finished(self._yielded):
      raise StopIteration
    self._start()
    if self._thread is None:
      batch = self._make_batch(*self._yielded)
    else:
      item = self._queue.get()
      if item is _END:
        self._stop_thread()
        raise StopIteration
      if isinstance(item, _Raised):
        self._stop_thread()
        raise item.exc
      pos, batch = item
      if pos != self._yielded:  # a bug guard, not user input
        raise DataError(f"prefetched step {pos} but expected {self._yielded}")
    self._yielded = self._advance(self._yielded)
    if self.auto_commit:
      self._committed = self._yielded
    return batch

  def commit(self, steps: int = 1) -> None:
    """Marks the oldest ``steps`` returned-but-uncommitted steps as completed.

    Only needed with ``auto_commit=False``; with auto-commit every returned
    batch is already committed and this raises if ``steps`` > 0.

    Example:
      >>> it = ElasticIterator(list(range(8)), global_batch_size=2, seed=0,
      ...                      auto_commit=False, prefetch=0)
      >>> _, _ = next(it), next(it)
      >>> it.get_state()["step"]
      0
      >>> it.commit(); it.get_state()["step"]
      1
    """
    g_c = self._committed[0] * self._steps + self._committed[1]
    g_y = self._yielded[0] * self._steps + self._yielded[1]
    if not isinstance(steps, int) or steps < 0 or g_c + steps > g_y:
      raise DataError(
          f"commit(steps={steps!r}) exceeds the {g_y - g_c} step(s) returned but not "
          "committed")
    self._committed = self._advance(self._committed, steps)

  # -- state -----------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    """A JSON-able dict: the first step not yet completed and what fixes the order.

    The same on every shard (it holds no shard index or count). Keys:
    ``version``, ``seed``, ``global_batch_size``, ``num_samples``, ``shuffle``,
    ``fingerprint``, ``epoch``, ``step`` (within the epoch) and
    ``samples_seen`` (real samples in completed steps, for logging).

    Example:
      >>> it = ElasticIterator(list(range(5)), global_batch_size=2, seed=3, prefetch=0)
      >>> _ = next(it)
      >>> s = it.get_state(); (s["epoch"], s["step"], s["samples_seen"])
      (0, 1, 2)
    """
    epoch, step = self._committed
    seen = epoch * self.num_samples + min(step * self.global_batch_size, self.num_samples)
    return {"version": STATE_VERSION, "seed": self.seed,
            "global_batch_size": self.global_batch_size, "num_samples": self.num_samples,
            "shuffle": self.shuffle, "fingerprint": self.fingerprint,
            "epoch": int(epoch), "step": int(step), "samples_seen": int(seen)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a state of :meth:`get_state`, under this iterator's shard count.

    Prefetched batches are dropped and the prefetch thread restarts at the
    state's step on the next ``next()``.

    Raises:
      DataError: the state is malformed, or its seed, global batch size,
        number of samples, shuffle flag or dataset fingerprint differ.

    Example:
      >>> a = ElasticIterator(list(range(8)), global_batch_size=4, seed=1, shard_count=2)
      >>> _ = next(a); s = a.get_state(); a.close()
      >>> b = ElasticIterator(list(range(8)), global_batch_size=4, seed=1, shard_count=1)
      >>> b.set_state(s); b.get_state() == s
      True
    """
    mine = self.get_state()
    check_state(state, ("epoch", "step"),
                {k: mine[k] for k in ("seed", "global_batch_size", "num_samples", "shuffle")},
                self.fingerprint)
    epoch, step = state["epoch"], state["step"]
    if (not isinstance(epoch, int) or not isinstance(step, int) or epoch < 0
        or not 0 <= step < self._steps):
      raise DataError(f"state position epoch={epoch!r} step={step!r} is invalid; expected "
                      f"epoch >= 0 and 0 <= step < {self._steps}")
    self._stop_thread()
    self._yielded = self._committed = (epoch, step)

  # -- shutdown --------------------------------------------------------------

  def close(self) -> None:
    """Stops and joins the prefetch thread; the iterator cannot be used afterwards."""
    self._stop_thread()
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None
    self._closed = True

  def __enter__(self) -> ElasticIterator:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __del__(self) -> None:
    stop = getattr(self, "_stop", None)
    if stop is not None:
      stop.set()


def check_state(state: Any, position_keys: Sequence[str], identity: dict[str, Any],
                fingerprint: str | None) -> None:
  """Checks a data iterator's saved state against the iterator restoring it.

  The state must be a dict with ``version`` (:data:`STATE_VERSION`), every key
  of ``position_keys`` and ``identity``, the same ``identity`` values, and the
  same ``fingerprint`` where both have one. Raises :class:`DataError` naming
  every mismatch.

  Example:
    >>> check_state({"version": 1, "step": 0, "seed": 2}, ("step",), {"seed": 3}, None)
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.DataError: state does not match this iterator: seed: state has 2, iterator has 3
  """
  if not isinstance(state, dict):
    raise DataError(f"state must be a dict from get_state(), got {type(state).__name__}")
  missing = [k for k in ("version", *identity, *position_keys) if k not in state]
  if missing:
    raise DataError(f"state is missing keys {missing}; got keys {sorted(state)}")
  if state["version"] != STATE_VERSION:
    raise DataError(f"state version {state['version']!r} is not supported; expected "
                    f"{STATE_VERSION}")
  diffs = [f"{k}: state has {state[k]!r}, iterator has {v!r}"
           for k, v in identity.items() if state[k] != v]
  fp = state.get("fingerprint")
  if fp is not None and fingerprint is not None and fp != fingerprint:
    diffs.append(f"fingerprint: state has {fp!r}, iterator's dataset has "
                 f"{fingerprint!r} (a different dataset or index)")
  if diffs:
    raise DataError("state does not match this iterator: " + "; ".join(diffs))
