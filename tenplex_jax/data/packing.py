"""Filtering and sequence packing with exactly-once samples, for any shard count.

Grain's ``ElasticIterator`` keeps one global index as its state, so it refuses
``filter`` (a filtered position is no longer a fixed number of samples) and
requires the global batch to divide by the shard count; MaxText turns
sequence packing off with it. :class:`PackedIterator` keeps both: the packed
global batches are a deterministic function of the global sample stream, and
the state holds what a shard boundary cannot recompute (the partly filled
rows), so a resize between any two steps continues the same stream.

**The stream.** Epoch ``e`` visits sample ids in
:func:`tenplex_jax.data.epoch_permutation` order. A sample is *accepted* if
the source does not return ``None`` for it (a filtered Grain ``MapDataset``
does), ``keep(sample)`` is true (if given) and it has at least one token. An
accepted sample of ``n`` tokens becomes the pieces ``[0, L)``, ``[L, 2L)``,
... of at most ``L = seq_len`` tokens.

**Packing (first fit over a bounded set of open rows).** Each piece goes into
the first open row with room for it; a row that becomes exactly full is
complete. If no open row has room, a new row is opened; when ``max_open_rows``
rows are already open, the oldest one is completed first. Complete rows queue
up in order; global step ``t`` takes the next ``rows_per_batch`` of them. When
an epoch's stream ends, its open rows are completed in order, and the epoch's
last batch is padded with empty rows. Batches never span epochs.

**Shards.** Every shard runs the same packer on the global stream (which needs
each sample's length and acceptance) and materialises only its rows,
:func:`tenplex_jax.data.shard_bounds` ``(rows_per_batch, i, n)``. With
``lengths`` given and no ``keep``, the plan needs no reads and a shard reads
only the samples of its own rows; otherwise each shard reads every sample the
global batch considers (the plan needs their lengths and the filter's verdict).

**State.** :meth:`PackedIterator.get_state` is a JSON-able dict: the epoch,
the stream position, the open rows and the complete rows not yet emitted (as
``[sample_id, start, length]`` pieces), and what identifies the order. It is
the same on every shard and restores under any shard count.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tenplex_jax.data import order
from tenplex_jax.data.iterator import STATE_VERSION, check_state
from tenplex_jax.errors import DataError

_KIND = "packed"


def _tokens_of(sample: Any, field: str, sample_id: int) -> np.ndarray:
  if isinstance(sample, dict):
    if field not in sample:
      raise DataError(f"sample {sample_id} has keys {sorted(sample)}; expected a {field!r} key "
                      "(pass field=... to name the token key)")
    sample = sample[field]
  arr = np.asarray(sample)
  if arr.ndim != 1:
    raise DataError(f"sample {sample_id}: tokens must be 1-D, got shape {arr.shape}")
  return arr


def pack_rows(lengths: Sequence[int], seq_len: int, max_open_rows: int,
              *, flush: bool = True) -> list[list[tuple[int, int, int]]]:
  """Packs sequences of the given lengths in order; the rows of pieces.

  The stand-alone form of the packer :class:`PackedIterator` runs (one
  stream, no batches): sample ``k`` is the ``k``-th length; a zero length is
  skipped. Each row is a list of ``(sample, start, length)`` pieces.

  Args:
    lengths: token counts, in stream order.
    seq_len: the row length L.
    max_open_rows: how many rows may be open at once (>= 1).
    flush: keyword-only; complete the still-open rows at the end.

  Returns:
    The complete rows, in completion order.

  Example:
    >>> pack_rows([3, 2, 4, 1], seq_len=4, max_open_rows=2)
    [[(0, 0, 3)], [(2, 0, 4)], [(1, 0, 2), (3, 0, 1)]]
    >>> pack_rows([6], seq_len=4, max_open_rows=1)
    [[(0, 0, 4)], [(0, 4, 2)]]
  """
  packer = _Packer(seq_len, max_open_rows, [], [])
  for k, n in enumerate(lengths):
    packer.add(k, int(n))
  if flush:
    packer.flush()
  return [[tuple(p) for p in row] for row in packer.ready]


class _Packer:
  """First-fit packing into at most ``max_open`` open rows of ``seq_len`` tokens."""

  def __init__(self, seq_len: int, max_open: int, open_rows: list, ready: list):
    self.seq_len = seq_len
    self.max_open = max_open
    self.open = open_rows   # rows: lists of [sample_id, start, length]
    self.ready = ready      # complete rows, in order
    self.used = [sum(p[2] for p in row) for row in open_rows]

  def add(self, sample_id: int, n: int) -> None:
    for start in range(0, n, self.seq_len):
      self._place([sample_id, start, min(self.seq_len, n - start)])

  def _place(self, piece: list) -> None:
    length = piece[2]
    for k, used in enumerate(self.used):
      if used + length <= self.seq_len:
        self.open[k].append(piece)
        self.used[k] += length
        if self.used[k] == self.seq_len:
          self.ready.append(self.open.pop(k))
          self.used.pop(k)
        return
    if len(self.open) >= self.max_open:
      self.ready.append(self.open.pop(0))
      self.used.pop(0)
    if length == self.seq_len:
      self.ready.append([piece])
    else:
      self.open.append([piece])
      self.used.append(length)

  def flush(self) -> None:
    self.ready.extend(self.open)
    self.open[:] = []
    self.used[:] = []


class PackedIterator:
  """Filtered, packed batches: this shard's rows of each global batch; resumes anywhere.

  Each batch is a dict of ``(rows, seq_len)`` arrays, ``rows`` being this
  shard's part of the ``rows_per_batch`` rows of the global batch:

  * ``"tokens"``: the packed tokens (``pad_id`` after the last piece);
  * ``"segment_ids"``: int32, ``1, 2, ...`` per piece within a row, 0 = padding;
  * ``"positions"``: int32, the token's position within its piece;
  * ``"sample_ids"``: int64, the global sample id of each token, -1 = padding;
  * ``"source_pos"``: int32, the token's index in its original sample (a piece
    of a long sample starts at a multiple of ``seq_len``), -1 = padding;
  * ``"mask"``: bool, ``segment_ids > 0``.

  For next-token training with row length L+1, use ``tokens[:, :-1]`` as
  inputs, ``tokens[:, 1:]`` as targets, and weight a position by
  ``segment_ids[:, 1:] == segment_ids[:, :-1]`` and ``segment_ids[:, 1:] > 0``
  (the target is in the same piece).

  The global batches (the shards' rows concatenated in shard order) depend on
  ``(source, seed, seq_len, rows_per_batch, max_open_rows, keep, shuffle)``
  only, never on the shard count; each accepted sample's tokens appear exactly
  once per epoch, split into pieces of at most ``seq_len`` tokens.

  Args:
    source: random-access samples (``len`` and ``[i]``): dicts holding
      ``field``, or 1-D token arrays; ``None`` marks a filtered sample (a Grain
      ``MapDataset`` after ``.filter``).
    seq_len: the row length L; keyword-only.
    rows_per_batch: rows per global batch B.
    seed: the data seed (the epoch order).
    shard_index: this shard's index i.
    shard_count: the number of shards n (any n >= 1; a shard may get 0 rows).
    keep: a predicate on a sample; False drops it (same on every shard).
    lengths: each sample's token count, if known without reading (e.g. from
      a dataset index); with ``keep=None`` a shard then reads only its rows'
      samples.
    field: the token key of dict samples.
    max_open_rows: rows open for first-fit at once (default ``rows_per_batch``).
    num_epochs: stop after this many epochs (None: never).
    shuffle: shuffle each epoch.
    pad_id: the token in padding positions.
    dtype: the tokens' dtype.
    auto_commit: count a step as completed when its batch is returned
      (otherwise only :meth:`commit` does).
    fingerprint: identifies the dataset in the state (default
      ``source.fingerprint`` if it has one).

  Example:
    >>> src = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    >>> it = PackedIterator(src, seq_len=4, rows_per_batch=2, seed=0, shuffle=False,
    ...                     num_epochs=1, keep=lambda s: len(s) != 2)
    >>> [b["tokens"].tolist() for b in it]
    [[[6, 7, 8, 9], [1, 2, 3, 10]], [[11, 0, 0, 0], [0, 0, 0, 0]]]
    >>> it.get_state()["epoch"]
    1
  """

  def __init__(self, source: Any, *, seq_len: int, rows_per_batch: int, seed: int,
               shard_index: int = 0, shard_count: int = 1,
               keep: Callable[[Any], bool] | None = None,
               lengths: Sequence[int] | np.ndarray | None = None, field: str = "tokens",
               max_open_rows: int | None = None, num_epochs: int | None = None,
               shuffle: bool = True, pad_id: int = 0, dtype: Any = np.int32,
               auto_commit: bool = True, fingerprint: str | None = None):
    num_samples = order.source_length(source)
    self._seq_len = order.check_pos_int("seq_len", seq_len)
    self._rows = order.check_pos_int("rows_per_batch", rows_per_batch)
    self._bounds = order.shard_bounds(self._rows, shard_index, shard_count)
    self._max_open = order.check_pos_int(
        "max_open_rows", self._rows if max_open_rows is None else max_open_rows)
    order.epoch_seed_sequence(seed, 0)  # validates seed
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 0):
      raise DataError(f"num_epochs must be None or an int >= 0, got {num_epochs!r}")
    if lengths is not None:
      lengths = np.asarray(lengths)
      if lengths.shape != (num_samples,) or not np.issubdtype(lengths.dtype, np.integer):
        raise DataError(f"lengths must be {num_samples} ints (one per sample), got shape "
                        f"{lengths.shape} dtype {lengths.dtype}")
      if num_samples and lengths.min() < 0:
        raise DataError(f"lengths must be >= 0; sample {int(lengths.argmin())} has "
                        f"{int(lengths.min())}")
    self.source = source
    self.num_samples = int(num_samples)
    self.seed = int(seed)
    self.shard_index, self.shard_count = int(shard_index), int(shard_count)
    self.keep = keep
    self.lengths = lengths
    self.field = field
    self.num_epochs = num_epochs
    self.shuffle = bool(shuffle)
    self.pad_id = pad_id
    self.dtype = np.dtype(dtype)
    self.auto_commit = bool(auto_commit)
    self.fingerprint = fingerprint if fingerprint is not None else getattr(
        source, "fingerprint", None)
    self._perm: tuple[int, np.ndarray] | None = None
    # Positions of the yielded-but-uncommitted steps, oldest first; [0] is committed.
    self._positions: collections.deque = collections.deque(
        [{"epoch": 0, "position": 0, "step": 0, "open": [], "ready": []}])
    self.reads = 0

  @classmethod
  def for_process(cls, source: Any, **kwargs: Any) -> PackedIterator:
    """An iterator whose shard is this JAX process: ``jax.process_index()`` of the count.

    Example:
      >>> it = PackedIterator.for_process([[1, 2]], seq_len=2, rows_per_batch=1, seed=0)
      >>> (it.shard_index, it.shard_count)
      (0, 1)
    """
    return cls(source, shard_index=jax.process_index(), shard_count=jax.process_count(),
               **kwargs)

  @property
  def shard_rows(self) -> tuple[int, int]:
    """The rows ``[start, stop)`` of each global batch that this shard reads."""
    return self._bounds

  # -- planning ----------------------------------------------------------------

  def _permutation(self, epoch: int) -> np.ndarray:
    if self._perm is None or self._perm[0] != epoch:
      self._perm = (epoch, order.epoch_permutation(self.seed, epoch, self.num_samples,
                                                   shuffle=self.shuffle))
    return self._perm[1]

  def _read(self, sample_id: int, cache: dict) -> Any:
    if sample_id not in cache:
      cache[sample_id] = self.source[sample_id]
      self.reads += 1
    return cache[sample_id]

  def _accepted_length(self, sample_id: int, cache: dict) -> int:
    if self.lengths is not None and self.keep is None:
      return int(self.lengths[sample_id])
    sample = self._read(sample_id, cache)
    if sample is None or (self.keep is not None and not self.keep(sample)):
      return 0
    if self.lengths is not None:
      return int(self.lengths[sample_id])
    return int(_tokens_of(sample, self.field, sample_id).shape[0])

  def _plan(self, pos: dict, cache: dict) -> tuple[list, dict]:
    """The global rows of the step at ``pos`` and the position after it."""
    perm = self._permutation(pos["epoch"])
    packer = _Packer(self._seq_len, self._max_open, copy.deepcopy(pos["open"]),
                     copy.deepcopy(pos["ready"]))
    p = pos["position"]
    while len(packer.ready) < self._rows and p < self.num_samples:
      sid = int(perm[p])
      p += 1
      packer.add(sid, self._accepted_length(sid, cache))
    if p >= self.num_samples:
      packer.flush()
    rows, rest = packer.ready[:self._rows], packer.ready[self._rows:]
    if p >= self.num_samples and not rest:
      nxt = {"epoch": pos["epoch"] + 1, "position": 0, "step": 0, "open": [], "ready": []}
    else:
      nxt = {"epoch": pos["epoch"], "position": p, "step": pos["step"] + 1,
             "open": packer.open, "ready": rest}
    return rows, nxt

  def global_rows(self, state: dict | None = None) -> list[list[tuple[int, int, int]]]:
    """The pieces ``(sample_id, start, length)`` of each row of the next global batch.

    Reads samples only when the plan needs them (see the module doc).

    Example:
      >>> it = PackedIterator([[1, 2], [3], [4, 5, 6]], seq_len=3, rows_per_batch=2,
      ...                     seed=0, shuffle=False)
      >>> it.global_rows()
      [[(0, 0, 2), (1, 0, 1)], [(2, 0, 3)]]
    """
    pos = self._positions[-1] if state is None else self._position_of(state)
    rows, _ = self._plan(pos, {})
    return [[tuple(p) for p in row] for row in rows]

  def _materialise(self, rows: list, cache: dict) -> dict[str, np.ndarray]:
    start, stop = self._bounds
    k = stop - start
    shape = (k, self._seq_len)
    tokens = np.full(shape, self.pad_id, self.dtype)
    seg = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    sids = np.full(shape, order.PAD_ID, np.int64)
    src_pos = np.full(shape, -1, np.int32)
    for r in range(k):
      g = start + r
      if g >= len(rows):
        break
      col = 0
      for s, (sid, first, n) in enumerate(rows[g], 1):
        sample = self._read(sid, cache)
        if sample is None:
          raise DataError(
              f"source returned None for sample {sid}, which the plan accepted: with a "
              "filtered source (a Grain MapDataset after .filter) do not pass lengths= "
              "without keep=, so the plan reads each sample")
        toks = _tokens_of(sample, self.field, sid)
        if self.lengths is not None and toks.shape[0] != self.lengths[sid]:
          raise DataError(f"sample {sid} has {toks.shape[0]} tokens, but lengths[{sid}] "
                          f"says {int(self.lengths[sid])}; the plan would drop or invent "
                          "tokens")
        tokens[r, col:col + n] = toks[first:first + n]
        seg[r, col:col + n] = s
        positions[r, col:col + n] = np.arange(n)
        sids[r, col:col + n] = sid
        src_pos[r, col:col + n] = np.arange(first, first + n)
        col += n
    return {"tokens": tokens, "segment_ids": seg, "positions": positions,
            "sample_ids": sids, "source_pos": src_pos, "mask": seg > 0}

  # -- iteration -------------------------------------------------------------

  def _finished(self, pos: dict) -> bool:
    return self.num_epochs is not None and pos["epoch"] >= self.num_epochs

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    pos = self._positions[-1]
    if self._finished(pos):
      raise StopIteration
    cache: dict = {}
    rows, nxt = self._plan(pos, cache)
    batch = self._materialise(rows, cache)
    self._positions.append(nxt)
    if self.auto_commit:
      self._positions.popleft()
    return batch

  def commit(self, steps: int = 1) -> None:
    """Marks the oldest ``steps`` returned-but-uncommitted steps as completed.

    Example:
      >>> it = PackedIterator([[1], [2], [3]], seq_len=1, rows_per_batch=1, seed=0,
      ...                     auto_commit=False)
      >>> _ = next(it); it.get_state()["step"]
      0
      >>> it.commit(); it.get_state()["step"]
      1
    """
    pending = len(self._positions) - 1
    if not isinstance(steps, int) or steps < 0 or steps > pending:
      raise DataError(f"commit(steps={steps!r}) exceeds the {pending} step(s) returned but "
                      "not committed")
    for _ in range(steps):
      self._positions.popleft()

  # -- state -----------------------------------------------------------------

  def _identity(self) -> dict[str, Any]:
    return {"kind": _KIND, "seed": self.seed, "seq_len": self._seq_len,
            "rows_per_batch": self._rows, "max_open_rows": self._max_open,
            "num_samples": self.num_samples, "shuffle": self.shuffle}

  def get_state(self) -> dict[str, Any]:
    """A JSON-able dict: the first step not completed and the rows it carries over.

    Keys: ``version``, ``kind``, ``seed``, ``seq_len``, ``rows_per_batch``,
    ``max_open_rows``, ``num_samples``, ``shuffle``, ``fingerprint``,
    ``epoch``, ``step`` (within the epoch), ``position`` (the next stream
    position), ``open`` and ``ready`` (rows of ``[sample_id, start, length]``).
    The same on every shard.

    Example:
      >>> it = PackedIterator([[1, 2], [3]], seq_len=4, rows_per_batch=1, seed=0,
      ...                     shuffle=False)
      >>> _ = next(it); s = it.get_state(); (s["epoch"], s["position"], s["open"])
      (1, 0, [])
    """
    pos = self._positions[0]
    return {"version": STATE_VERSION, **self._identity(), "fingerprint": self.fingerprint,
            "epoch": pos["epoch"], "step": pos["step"], "position": pos["position"],
            "open": copy.deepcopy(pos["open"]), "ready": copy.deepcopy(pos["ready"])}

  def _position_of(self, state: Any) -> dict:
    check_state(state, ("epoch", "step", "position", "open", "ready"), self._identity(),
                self.fingerprint)
    epoch, step, p = state["epoch"], state["step"], state["position"]
    if not all(isinstance(v, int) and v >= 0 for v in (epoch, step, p)) \
        or p > self.num_samples:
      raise DataError(f"state position epoch={epoch!r} step={step!r} position={p!r} is "
                      f"invalid; expected ints >= 0 and position <= {self.num_samples}")
    for name in ("open", "ready"):
      for row in state[name]:
        for piece in row:
          if (len(piece) != 3 or not 0 <= piece[0] < self.num_samples or piece[1] < 0
              or not 0 < piece[2] <= self._seq_len):
            raise DataError(f"state {name} row {row!r}: piece {piece!r} is not "
                            f"[sample_id < {self.num_samples}, start, 0 < length <= "
                            f"{self._seq_len}]")
    return {"epoch": epoch, "step": step, "position": p,
            "open": [[list(pc) for pc in row] for row in state["open"]],
            "ready": [[list(pc) for pc in row] for row in state["ready"]]}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a state of :meth:`get_state`, under this iterator's shard count.

    Raises:
      DataError: the state is malformed, or its seed, sizes, sample count,
        shuffle flag or dataset fingerprint differ from this iterator's.

    Example:
      >>> src = [[1, 2, 3], [4], [5, 6]]
      >>> a = PackedIterator(src, seq_len=4, rows_per_batch=2, seed=1, shard_count=2)
      >>> _ = next(a); s = a.get_state()
      >>> b = PackedIterator(src, seq_len=4, rows_per_batch=2, seed=1, shard_count=1)
      >>> b.set_state(s); b.get_state() == s
      True
    """
    self._positions = collections.deque([self._position_of(state)])

  def close(self) -> None:
    """Nothing to release (no threads); present for symmetry with ElasticIterator."""

  def __enter__(self) -> PackedIterator:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
