"""Executing a plan in one process: move pieces, assemble new shards.

Two executors share one plan:

* ``cpu`` (fast path, CPU devices): a device buffer is host memory shared
  by all CPU devices of the process, so each distinct new box is written at
  most once: a box an old shard held exactly is aliased, any other is one
  host allocation filled by one ``memcpy`` per piece from zero-copy views of
  the old shards, and every device holding the box adopts that buffer
  without a further copy. No XLA program is compiled.
* ``generic`` (any backend): each piece is sliced on its source device,
  copied to the destination device, and the pieces are concatenated there;
  arrays between plain NamedShardings in groups of one class and dtype, by
  two SPMD programs per group (cut and pack over the source mesh, unpack and
  join over the target mesh) and one transfer per packed buffer, others by
  one cut and one join program per device.

Both reuse an old shard's buffer untouched wherever a device keeps exactly
the box it had; where a box only changes device, ``generic`` moves it with
its packed group (or whole, on the per-device executor) and ``cpu`` aliases
it. Neither depends on
``jax.device_put`` between meshes (which can stall on simulated CPU devices
with many arrays in flight).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import gc
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from tenplex_jax._keys import is_key as _is_key
from tenplex_jax._keys import key_data_sharding, wrap_keys
from tenplex_jax._hostmem import (collect_dropped_buffers, host_empty_leased,
                                  host_reclaim, populate_range)
from tenplex_jax._problems import raise_problems
from tenplex_jax._targets import default_memory_kind, match_targets
from tenplex_jax.errors import LayoutError, ReshardError
from tenplex_jax.layout import (PTC, dtype_info, placement_by_arithmetic,
                                box_volume, intersect, key_path_name,
                                placement_of, sharding_from_description)
from tenplex_jax.planner import Plan, Template, fmt_bytes, plan, plan_template

__all__ = ["ReshardReport", "key_data_sharding", "reshard", "reshard_with_report",
           "resolve_targets"]


@dataclasses.dataclass(frozen=True)
class ReshardReport:
  """What a reshard moved and how long each phase took.

  Attributes:
    n_tensors: arrays in the state.
    state_bytes: bytes of one copy of the state.
    moved_bytes: bytes that arrived at a device from another device.
    lower_bound_bytes: bytes of new shards their devices did not hold.
    local_bytes: bytes of new shards that stayed where they were.
    naive_bytes: bytes moved had every new shard been shipped whole.
    reused_shards: shards whose buffer was kept as it was (no copy).
    method: the executor used, ``cpu`` or ``generic``; ``kept`` when every
      target device already held its new shard and nothing was planned or
      copied (the arrays are rebuilt from the old shards).
    seconds: time per phase (``layout``, ``plan``, ``transfer``, ``total``);
      on the ``kept`` path all of it is ``layout``.
    aliased_shards: (``cpu`` path) new shards that copied nothing because
      their buffer is shared, read-only, with an old shard that held exactly
      their box, with another new shard of the same box (a replica), or
      with the same box of an earlier result of the same source arrays
      that is still alive (see ``reshard``).
    copied_bytes: (``cpu`` path) bytes written into new host buffers: each
      distinct new box that no old shard held exactly, once per process
      however many devices hold it; ``0`` on the ``kept`` path, ``None`` on
      the ``generic`` path (which copies per device).
    host_staged: (``generic`` path) arrays built through the host: their
      device programs were not compiled yet (the host tier: a cold call
      compiles nothing; see ``reshard``), or XLA cannot slice their dtype.
    plan: the plan that was executed; ``None`` on the ``kept`` path. (On
      the CPU path it is built when first read: the executor plans arrays
      by class and does not need it.)
    cached: layouts, plan and per-array programs came from an earlier
      reshard between the same layouts (then ``seconds['plan']`` is 0).
  """

  n_tensors: int
  state_bytes: int
  moved_bytes: int
  lower_bound_bytes: int
  local_bytes: int
  naive_bytes: int
  reused_shards: int
  method: str
  seconds: Mapping[str, float]
  aliased_shards: int = 0
  copied_bytes: int | None = None
  host_staged: int = 0
  _plan: Plan | Callable[[], Plan] | None = dataclasses.field(
      default=None, repr=False, compare=False)
  cached: bool = False

  @property
  def plan(self) -> Plan | None:
    p = self._plan
    if p is not None and not isinstance(p, Plan):
      p = p()
      object.__setattr__(self, "_plan", p)
    return p

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name != "_plan"}
    d["seconds"] = dict(self.seconds)
    return d

  def __str__(self) -> str:
    f = fmt_bytes
    s = self.seconds
    return (f"resharded {self.n_tensors} arrays ({f(self.state_bytes)}):"
            f" moved {f(self.moved_bytes)} (lower bound"
            f" {f(self.lower_bound_bytes)}, naive {f(self.naive_bytes)}),"
            f" kept {f(self.local_bytes)} in place,"
            f" {self.reused_shards} shards reused,"
            f" {self.aliased_shards} shared"
            + (f", copied {f(self.copied_bytes)}"
               if self.copied_bytes is not None else "")
            + (f", {self.host_staged} through the host"
               if self.host_staged else "")
            + f"; {self.method} path;"
            f" layout {s.get('layout', 0) * 1e3:.1f} ms, plan"
            f" {s.get('plan', 0) * 1e3:.1f} ms, transfer"
            f" {s.get('transfer', 0) * 1e3:.1f} ms")


def resolve_targets(tree: Any, target: Any, *, mesh=None
                    ) -> tuple[list, Callable]:
  """Pairs every leaf of ``tree`` with its target sharding.

  Args:
    tree: the state.
    target: a sharding tree as ``jax.device_put`` takes it (see
      :func:`tenplex_jax._targets.match_targets`: one target, or a prefix
      tree of ``Sharding``/``PartitionSpec``/``Device``/``None``, boxes
      transparent), or a :class:`PTC` whose tensors are matched by key path.
    mesh: the mesh for ``PartitionSpec`` targets (default: the one in
      context).

  Returns:
    ``(items, rebuild)``: ``items`` is a list of ``(path, leaf, sharding or
    None)`` and ``rebuild(new_leaves)`` puts leaves back in the structure.

  Raises:
    LayoutError: the structures differ, an array has no target, a sharding
      is given for a non-array, or (for a PTC) shapes or dtypes differ; all
      problems are reported together, grouped, each with its leaf path.
  """
  problems = []
  if isinstance(target, PTC):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    items = []
    used = set()
    cache: dict[str, Sharding] = {}
    for path, leaf in flat:
      name = key_path_name(path)
      if not isinstance(leaf, jax.Array):
        items.append((name, leaf, None))
        continue
      t = target.by_path.get(name)
      if t is None:
        problems.append(f"{name}: no layout for this array in the target PTC")
        items.append((name, leaf, None))
        continue
      used.add(name)
      dtype, _ = dtype_info(leaf.dtype)
      if tuple(leaf.shape) != t.shape or dtype != t.dtype:
        problems.append(f"{name}: array is {dtype}{list(leaf.shape)}, target"
                        f" layout is {t.dtype}{list(t.shape)}")
      if t.sharding is None:
        problems.append(f"{name}: the target layout has no sharding"
                        " description to rebuild")
        items.append((name, leaf, None))
        continue
      k = repr(sorted(t.sharding.items()))
      if k not in cache:
        cache[k] = sharding_from_description(t.sharding, name)
      items.append((name, leaf, cache[k]))
    extra = sorted(set(target.paths) - used)
    if extra:
      problems.append(f"target layout has tensors the state lacks: {extra}")
    rebuild = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)
  else:
    return match_targets(tree, target, mesh=mesh)
  if problems:
    raise_problems(LayoutError, "cannot reshard", problems)
  return items, rebuild


def _pick(move, rotation: int, have) -> int | None:
  """The planned source of ``move``, else the next replica this process has."""
  n = len(move.sources)
  for k in range(n):
    src = move.sources[(rotation + k) % n]
    if src in have:
      return src
  return None


def _copy_threads() -> int:
  v = os.environ.get("TENPLEX_JAX_COPY_THREADS")
  if v is not None:
    try:
      return max(1, int(v))
    except ValueError as e:
      raise ValueError(f"TENPLEX_JAX_COPY_THREADS must be an integer, not"
                       f" {v!r}") from e
  return max(1, min(8, len(os.sched_getaffinity(0))))


_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
_copy_pool_size = 0
_copy_pool_pid = 0  # a forked child must not use its parent's (dead) threads
_copy_pool_lock = threading.Lock()


def _reset_after_fork() -> None:
  global _copy_pool, _copy_pool_size, _copy_pool_lock
  _copy_pool, _copy_pool_size = None, 0
  _copy_pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
_THREADED_MIN_BYTES = 64 << 20
# Bands of fresh buffers are populated, then copied, a band at a time: at
# most this many bytes, so that populating and copying interleave (512 MiB
# into fresh memory on 2 threads: 0.13-0.15 s in 4-8 MiB bands, 0.16 s in
# 32 MiB ones; on held-out states 8, 16 and 32 MiB were within noise).
_BAND_MAX_BYTES = 16 << 20
# Smaller fresh buffers are faulted page by page: on two held-out states of
# 1,285 and 1,780 arrays the copy stage took 0.78-1.04x its time when
# populating from 64 KiB against from 1 MiB, and 1.01-1.12x from 16 KiB
# against from 64 KiB.
_POPULATE_MIN_BYTES = 64 << 10
# Pieces under this are copied by the calling thread, outside the bands: a
# copy of less than 16 KiB is mostly Python work under the GIL. Above it the
# copy and its page faults dominate and go to the bands (at 256 KiB, the
# 16,527 pieces under it in r2507.06, 245 MB of its 379, were all copied on
# one thread: cold 0.95-1.61 s against 0.75-0.83 s at 16 KiB).
_SMALL_PIECE_BYTES = 16 << 10
_SMALL_PIECE_COST = 8 << 10  # a small piece's Python work, in bytes copied


_ROW_UNIT_MAX = 64  # bytes: shorter strided rows are copied as one element
_WIDE = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
         8: np.dtype(np.uint64)}


def _widened(dst: np.ndarray, src: np.ndarray) -> tuple:
  """``dst`` and ``src`` (same shape) viewed for a bitwise copy in the
  widest unit their innermost rows allow: a strided row of at most
  ``_ROW_UNIT_MAX`` bytes as one raw (void) element, else the widest
  unsigned integer of at most 8 bytes.

  numpy copies a strided array row by row along the last axis, so short
  rows cost a loop iteration per few bytes: a (15,916,852, 2) int8 box cut
  from (., 4) columns took 0.18 s, and 7 ms viewed as (., 1) uint16.
  """
  item = dst.dtype.itemsize
  if dst.ndim == 0 or dst.size == 0:
    return dst, src
  if dst.strides[-1] != item or src.strides[-1] != item:
    return dst, src
  run = dst.shape[-1] * item
  if (dst.ndim > 1 and dst.shape[-1] > 1 and run <= _ROW_UNIT_MAX
      and not (dst.flags.c_contiguous and src.flags.c_contiguous)):
    # A whole short row as one raw element: numpy then runs one strided
    # loop over the rows instead of a loop per row (rows of 16 bytes copied
    # 2.9x faster than as two uint64, of 32 bytes 1.5x, of 64 bytes 1.2x).
    unit = np.dtype(f"V{run}")
    return dst.view(unit), src.view(unit)
  if item >= 8:
    return dst, src
  for w in (8, 4, 2):
    if (w > item and run % w == 0
        and dst.ctypes.data % w == 0 and src.ctypes.data % w == 0
        and all(t % w == 0 for t in dst.strides[:-1])
        and all(t % w == 0 for t in src.strides[:-1])):
      return dst.view(_WIDE[w]), src.view(_WIDE[w])
  return dst, src


def _copy_all(copies, fresh=frozenset()) -> None:
  """Runs the piece copies ``(buf, idx, src)``; large batches over several
  threads.

  numpy releases the GIL while it copies, so threads overlap both the copies
  and the first-touch page faults of the new buffers. On the 2-core
  benchmark VM, 2 threads took the cold tensor 2->4 reshard of 1 GiB from
  0.55-0.68 s to 0.26-0.57 s (when the cores were not busy with other work).

  ``fresh``: the ids of the buffers whose pages may not be resident yet (new
  blocks of at least ``_POPULATE_MIN_BYTES``, see ``host_empty_leased``;
  C-contiguous, as it hands them out). The thread that writes a band of such
  a buffer first makes its pages resident in one system call
  (``populate_range``), then copies: a page fault per 4 KiB page costs
  about twice the kernel time of populating the same pages in one call.
  512 MiB copied into fresh memory on the 2-core VM: 0.21-0.31 s faulted
  by the copies on 2 threads, 0.13-0.15 s populated band by band (8 MiB)
  and copied on 2 threads (0.16-0.26 s populated whole on one thread
  before the copies; present pages cost 0.14 us each to populate again,
  so recycled blocks are not).
  """
  global _copy_pool, _copy_pool_size, _copy_pool_pid
  n = _copy_threads()
  # Small pieces are copied by this thread while the others copy the large
  # ones: a small copy is mostly Python work under the GIL, which threads
  # would only pass back and forth (r0.16's 18,440 pieces are ~800 bytes on
  # average; see _SMALL_PIECE_BYTES).
  small = [c for c in copies if c[2].nbytes < _SMALL_PIECE_BYTES]
  large = ([c for c in copies if c[2].nbytes >= _SMALL_PIECE_BYTES]
           if len(small) < len(copies) else [])
  total = sum(src.nbytes for _, _, src in large)
  if n == 1 or total < _THREADED_MIN_BYTES:
    for buf, idx, src in small:
      buf[idx] = src
    populated = set()
    for buf, idx, src in large:
      if id(buf) in fresh and id(buf) not in populated:
        populated.add(id(buf))
        populate_range(buf.ctypes.data, buf.nbytes)
      dst, src = _widened(buf[idx], src)
      dst[...] = src
    return
  # Tasks of (destination view, source view) pairs, each a band of rows of
  # one new buffer, so that no two threads write the same pages; a band of
  # a fresh buffer populated first by the thread that copies it.
  tasks = _row_bands(large, max(1, min(_BAND_MAX_BYTES, total // (4 * n))),
                     fresh)
  # n lanes over n threads, this one included: lane 0 is this thread's,
  # after the small copies, which count towards its load (their bytes and,
  # per piece, about what copying 8 KiB costs). A pool thread per lane would
  # leave n + 1 threads copying on n cores.
  lanes: list[list] = [[] for _ in range(n)]
  load = [0] * n
  load[0] = sum(src.nbytes + _SMALL_PIECE_COST for _, _, src in small)
  for nbytes, pairs, span in sorted(tasks, key=lambda t: -t[0]):  # greedy
    i = load.index(min(load))
    if span is not None:
      lanes[i].append((None, span))
    lanes[i].extend(pairs)
    load[i] += nbytes

  def run(lane):
    for dst, src in lane:
      if dst is None:
        populate_range(*src)
      else:
        dst[...] = src

  with _copy_pool_lock:
    if (_copy_pool is None or _copy_pool_size < n - 1
        or _copy_pool_pid != os.getpid()):
      _copy_pool = concurrent.futures.ThreadPoolExecutor(
          n - 1, thread_name_prefix="tenplex-copy")
      _copy_pool_size, _copy_pool_pid = n - 1, os.getpid()
    pool = _copy_pool
  futures = [pool.submit(run, lane) for lane in lanes[1:] if lane]
  try:
    for buf, idx, src in small:
      buf[idx] = src
    run(lanes[0])
  finally:
    for f in futures:
      f.result()


def _rows_of(idx) -> tuple | None:
  """``(start, stop)`` where ``idx`` (an index into a new buffer) starts with
  a unit-step slice of concrete bounds on its first axis, else None."""
  if not (isinstance(idx, tuple) and idx and isinstance(idx[0], slice)):
    return None
  sl = idx[0]
  if sl.step not in (None, 1) or sl.start is None or sl.stop is None:
    return None
  return sl.start, sl.stop


def _row_bands(large, step: int, fresh=frozenset()) -> list:
  """The copies ``(buf, idx, src)`` as tasks ``(bytes, [(dst, src), ...],
  span)``: each new buffer's rows cut into bands of about ``step`` bytes, a
  band holding every piece's part in those rows; ``span``: for a band of a
  buffer in ``fresh`` (ids), ``(address, bytes)`` of its rows, to populate
  before the copies (see _copy_all), else None.

  Threads that copied pieces instead of bands wrote the same pages where a
  box is glued from pieces side by side (columns): two threads faulting in
  one page both trap, and on the 2-core VM a held-out state's copy took 1.5x
  the page faults of a single thread (170,000 against 109,000 for 433 MiB)
  and nearly half again its CPU time.
  """
  by_buf: dict[int, tuple] = {}
  tasks = []
  for buf, idx, src in large:
    span = _rows_of(idx) if buf.ndim else None
    if span is not None:
      by_buf.setdefault(id(buf), (buf, []))[1].append((span, idx, src))
      continue
    dst, src = _widened(buf[idx], src)  # a whole piece, cut along its rows
    if src.ndim == 0 or src.nbytes <= step or src.shape[0] < 2:
      tasks.append((src.nbytes, [(dst, src)], None))
      continue
    rows = max(1, src.shape[0] * step // src.nbytes)
    for a in range(0, src.shape[0], rows):
      part = src[a:a + rows]
      tasks.append((part.nbytes, [(dst[a:a + rows], part)], None))
  for buf, pieces in by_buf.values():
    nbytes = sum(src.nbytes for _, _, src in pieces)
    n_rows = buf.shape[0]
    bands = max(1, min(n_rows, nbytes // step))
    base = row_bytes = 0
    if id(buf) in fresh and n_rows:
      base, row_bytes = buf.ctypes.data, buf.nbytes // n_rows
    for j in range(bands):
      r0, r1 = n_rows * j // bands, n_rows * (j + 1) // bands
      pairs, band_bytes = [], 0
      for (a, b), idx, src in pieces:
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
          part = src[lo - a:hi - a]
          pairs.append(_widened(buf[(slice(lo, hi),) + idx[1:]], part))
          band_bytes += part.nbytes
      if pairs:
        span = ((base + r0 * row_bytes, (r1 - r0) * row_bytes) if row_bytes
                else None)
        tasks.append((band_bytes, pairs, span))
  return tasks


# -- building new arrays -------------------------------------------------------

try:  # one C++ call per array: reuses same-device shards, adopts host views
  from jax._src import array as _jarray
  from jax._src import core as _jcore
  from jax._src.interpreters import pxla as _pxla
  from jax._src.lib import _jax as _xc
  _batched = _pxla.batched_device_put
  _batched_xc = _xc.batched_device_put  # what _batched calls, minus checks
  _ArrayImpl = _jarray.ArrayImpl
  _aval = lambda shape, dtype, s: _jcore.update_aval_with_sharding(
      _jcore.ShapedArray(shape, dtype), s)
except (ImportError, AttributeError):  # pragma: no cover - older/newer jax
  _batched = None

_AVALS: dict = {}  # (dtype, sharding, rank) -> an aval on that sharding
_AVALS_MAX = 4096


def _aval_of(shape: tuple, dtype, s: Sharding):
  """``_aval(shape, dtype, s)``, from an aval of the same (dtype, sharding,
  rank) with its shape replaced: one aval built per array, not two."""
  k = (dtype, s, len(shape))
  t = _AVALS.get(k)
  if t is None:
    if len(_AVALS) >= _AVALS_MAX:
      _AVALS.clear()
    t = _AVALS[k] = _aval(shape, dtype, s)
    return t
  if t.shape == shape:
    return t
  if _AVAL_CREATE is not None and all(type(n) is int for n in shape):
    return _AVAL_CREATE(shape, t.dtype, t.weak_type, t.sharding,
                        t.manual_axis_type, t.memory_space)
  return t.update(shape=shape)


def _aval_create_checked():
  """``ShapedArray._create`` where it builds, from a template's fields, the
  very aval ``update(shape=...)`` does (checked once, on this jax), else
  None."""
  if _batched is None:  # pragma: no cover - older/newer jax
    return None
  try:
    create = _jcore.ShapedArray._create
    t = _aval((2, 4), np.dtype(np.float32), None)  # no devices at import
    got = create((6, 4), t.dtype, t.weak_type, t.sharding,
                 t.manual_axis_type, t.memory_space)
  except Exception:  # pragma: no cover - other jax versions' fields
    return None
  return create if got is t.update(shape=(6, 4)) else None


# jax's interned constructor of an aval from its fields, without
# ShapedArray.__new__'s canonicalisation and sharding checks (a template's
# fields are canonical already): 3.6 us a call against update()'s 8-10 us.
_AVAL_CREATE = _aval_create_checked()


def _make_array(shape: tuple, dtype, sharding: Sharding, xs: list,
                devices, kept: bool = False) -> jax.Array:
  """One array on ``sharding`` from its per-device shards.

  ``xs[i]`` is the shard of ``devices[i]``: a ``jax.Array`` on that device
  (adopted as it is) or a host ``ndarray`` (adopted without a copy on CPU
  devices where it is 64-byte aligned and contiguous, else copied).
  ``kept``: every ``xs[i]`` is a single-device ``jax.Array`` on
  ``devices[i]`` (the caller took it from that device), so the array is
  made of them directly.
  ``jax.make_array_from_single_device_arrays`` plus a ``jax.device_put`` per
  host buffer does the same through about ten Python frames per shard; this
  is jax's own batched path (``pxla.batched_device_put``, what
  ``jax.device_put`` uses to place a sharded array), without the checks
  that it repeats per shard for what the caller knows (a warm reshard of
  many small arrays calls it per array).
  """
  if _batched is not None and sharding.is_fully_addressable:
    aval = _aval_of(tuple(shape), dtype, sharding)
    if kept:
      return _ArrayImpl(aval, sharding, list(xs), committed=True,
                        _skip_checks=True)
    if not any(isinstance(x, jax.Array) for x in xs):
      return _batched_xc(aval, sharding, xs, list(devices), True)
    return _batched(aval, sharding, xs, devices)
  arrs = [x if isinstance(x, jax.Array) else
          jax.device_put(x, d, may_alias=True) for x, d in zip(xs, devices)]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrs)


def _shards_of(x: jax.Array) -> dict:
  """``{device id: single-device array}`` of ``x``'s addressable shards."""
  arrays = getattr(x, "_arrays", None)  # jax's own list, no Shard objects
  if arrays is not None:
    ids = _device_ids(x.sharding)
    if len(ids) == len(arrays):
      return dict(zip(ids, arrays))
  return {s.device.id: s.data for s in x.addressable_shards}


@functools.lru_cache(maxsize=4096)
def _device_ids(sharding: Sharding) -> tuple:
  return tuple(d.id for d in _device_order(sharding))


def _addressable_ids(sharding: Sharding) -> set:
  return {d.id for d in sharding.addressable_devices}


def _device_order(sharding: Sharding) -> tuple:
  """The sharding's addressable devices in the order its shards are given."""
  try:
    return tuple(sharding._addressable_device_assignment)
  except AttributeError:  # pragma: no cover - other jax versions
    return tuple(sorted(sharding.addressable_devices, key=lambda d: d.id))


_ALIGN = 64  # XLA's CPU client adopts host memory aligned to 64 bytes


def _aliasable(v: np.ndarray) -> bool:
  """Whether XLA's CPU client adopts ``v`` without a copy."""
  return v.flags.c_contiguous and v.ctypes.data % _ALIGN == 0


class _Record:
  """A record of named fields, made without the code generation of a
  dataclass: ``dataclasses.dataclass`` compiles each class's methods when
  its module is imported (0.7-1.3 ms a class), and importing this module
  is part of a process's first reshard. Not for public classes."""

  __slots__ = ()

  def __init__(self, *values):
    """The fields' values, in the order of ``__slots__``, all given."""
    if len(values) != len(self.__slots__):
      raise TypeError(f"{type(self).__name__} takes {len(self.__slots__)}"
                      f" fields {self.__slots__}, got {len(values)}")
    for k, v in zip(self.__slots__, values):
      setattr(self, k, v)

  def __repr__(self) -> str:
    fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
    return f"{type(self).__name__}({fields})"


class _LeafProgram(_Record):
  """How one array's new shards are made; built once per transition.

  Attributes:
    devices: the target's addressable devices, in the order of ``outs``.
    outs: per device, ``("keep", device id)`` (the device keeps its shard)
      or ``("box", i)`` (the device holds new box ``boxes[i]``).
    boxes: per distinct new box that some device does not keep:
      ``(shape, pieces)`` with ``pieces`` a tuple of ``(source device,
      index in the source shard, index in the new box, (starts, limits) in
      the source shard, starts in the new box)``; a box of one piece lies
      inside one old shard.
    reused: devices that keep their shard.
    alias: groups of ``boxes`` (each inside one old shard, together all of
      it) that the CPU executor may adopt as views of that shard.
  """

  __slots__ = ("devices", "outs", "boxes", "reused", "alias")

  # One per array of a class-planned call: assigned field by field, 0.34 us
  # against _Record's loop's 1.2 us.
  def __init__(self, devices: tuple, outs: tuple, boxes: tuple,
               reused: frozenset, alias: tuple):
    self.devices = devices
    self.outs = outs
    self.boxes = boxes
    self.reused = reused
    self.alias = alias


def _leaf_program(path: str, template: Template, rotation: int, src_place,
                  dst_place, sharding: Sharding, have: set,
                  cpu: bool = False) -> _LeafProgram:
  """The :class:`_LeafProgram` of one array; ``have``: the source devices
  this process addresses. Raises ReshardError if a piece is held only by
  devices of other processes."""
  src_boxes, src_box_of = src_place.boxes, src_place.box_of_device
  outs, boxes, slot, reused = [], [], {}, set()
  whole: dict[int, tuple] = {}  # new box inside one old box -> (src, box)
  devices = _device_order(sharding)
  for dev in devices:
    bi = dst_place.box_of_device[dev.id]
    dbox = dst_place.boxes[bi]
    moves = template.moves_to(dev.id)
    if (len(moves) == 1 and src_boxes[moves[0].src_box] == dbox
        and src_box_of.get(dev.id) == moves[0].src_box and dev.id in have):
      outs.append(("keep", dev.id))
      reused.add(dev.id)
      continue
    if bi not in slot:
      pieces = []
      for m in moves:
        near = ([h for h in src_place.holders[m.src_box] if h in have]
                if cpu and len(moves) == 1 else None)
        if near:
          # Inside one old box: always the same replica of it (also for a
          # device that holds another), so that the new boxes aliasing it
          # keep one old buffer alive, not one per replica.
          src = min(near)
        elif dev.id in m.sources and dev.id in have:
          src = dev.id  # a device's own memory first
        else:
          src = _pick(m, rotation, have)
          if src is None:
            raise ReshardError(
                f"{path}: device {dev.id} needs piece {list(m.box)} held only"
                f" on devices {list(m.sources)}, none addressable from"
                f" process {jax.process_index()}; moving data across"
                " processes needs tenplex_jax.store (save, then restore in"
                " the new job)")
        sb = src_boxes[m.src_box]
        s_starts = tuple(a - w for (a, _), (w, _) in zip(m.box, sb))
        s_limits = tuple(b - w for (_, b), (w, _) in zip(m.box, sb))
        d_starts = tuple(a - w for (a, _), (w, _) in zip(m.box, dbox))
        d_limits = tuple(b - w for (_, b), (w, _) in zip(m.box, dbox))
        if len(moves) == 1:
          whole[len(boxes)] = (src, m.src_box)
        pieces.append((src, _index(s_starts, s_limits),
                       _index(d_starts, d_limits), (s_starts, s_limits),
                       d_starts))
      slot[bi] = len(boxes)
      boxes.append((tuple(b - a for a, b in dbox), tuple(pieces)))
    outs.append(("box", slot[bi]))
  # New boxes may alias parts of an old buffer only where, together, they
  # cover all of it: then the old buffer kept alive holds exactly their
  # bytes, and nothing is wasted once the old array is gone (a new shard
  # that aliased a quarter of a buffer would pin the other three quarters).
  # In such a group, a box whose view is not 64-byte aligned is copied and
  # the others are still shared, as jax.device_put shares them: the old
  # buffer then holds the copied box's bytes a second time while it lives.
  by_src: dict[tuple, list] = collections.defaultdict(list)
  for k, key in whole.items():
    by_src[key].append(k)
  alias = []
  for (src, sb), ks in by_src.items():
    vol = sum(math.prod(boxes[k][0]) for k in ks)
    if vol == box_volume(src_boxes[sb]):
      alias.append(tuple(ks))
  return _LeafProgram(devices, tuple(outs), tuple(boxes), frozenset(reused),
                      tuple(alias))


def _index(starts: tuple, limits: tuple) -> tuple:
  """A numpy index (a view, also of a 0-d array; see relative_index)."""
  return tuple(map(slice, starts, limits)) + (Ellipsis,)


def _host_view(a: jax.Array) -> np.ndarray:
  """A single-device CPU array's buffer as an ndarray, without a copy.

  ``np.asarray(a)`` ends in the same call after a few Python frames, which
  cost more than the call itself when an array has many small shards.
  """
  try:
    v, _ = a._single_device_array_to_np_array_did_copy()
  except AttributeError:  # pragma: no cover - other jax versions
    return np.asarray(a)
  return v


def _run_cpu(prog: _LeafProgram, x: jax.Array, copies: list,
             fresh: set | None = None) -> tuple:
  """The CPU executor for one array: every CPU device's buffer is host memory.

  * A device that keeps its box keeps its buffer.
  * A new box that lies inside one old shard, as a contiguous and aligned
    stretch of its memory (the old box itself, or rows of it), is not copied
    at all: the new device's buffer aliases the old one (read-only; jax never
    writes into a buffer it did not allocate, and does not donate it).
  * Any other box is assembled once per process, piece by piece, into one
    host buffer that all the devices holding that box share; the piece
    copies are appended to ``copies`` (run later, for all arrays at once),
    unless an earlier reshard of the same array filled that box and its
    bytes are still there (see ``_FILLED``).

  So the bytes written are those of the distinct new boxes that no device
  held, not of every replica: a replicated (data-parallel) target costs one
  copy, not one per device.

  ``fresh``: where the ids of new host buffers of at least
  ``_POPULATE_MIN_BYTES`` (pages maybe not resident yet) are added, for
  :func:`_copy_all` to populate.

  Returns ``(xs, shards, filled, copied bytes)``: ``xs`` for
  :func:`_make_array` (host buffers are filled only once ``copies`` ran).
  """
  shards = _shards_of(x)
  views: dict[int, np.ndarray] = {}

  def view(d: int) -> np.ndarray:  # zero-copy
    v = views.get(d)
    if v is None:
      v = views[d] = _host_view(shards[d])
    return v

  built: list = [None] * len(prog.boxes)
  filled = copied = 0
  for group in prog.alias:
    for k in group:
      src, idx = prog.boxes[k][1][0][:2]
      v = view(src)[idx]
      if _aliasable(v):  # an unaligned member is copied, the others not
        built[k] = v
  records, reclaimed = _earlier_boxes(prog, x, built)
  made = []
  for k, (shape, pieces) in enumerate(prog.boxes):
    if built[k] is not None:
      continue
    buf, token, new = host_empty_leased(shape, x.dtype)
    if new and fresh is not None and buf.nbytes >= _POPULATE_MIN_BYTES:
      fresh.add(id(buf))
    for src, idx, at, _, _ in pieces:
      copies.append((buf, at, view(src)[idx]))
    built[k] = buf
    made.append((k, buf, token))
    filled += 1
    copied += buf.nbytes
  if made or reclaimed:
    _remember_boxes(prog, x, records, made)
  xs = [shards[a] if kind == "keep" else built[a] for kind, a in prog.outs]
  return xs, shards, filled, copied


# The boxes an array's last CPU reshard filled: (array id, program id) ->
# (weak reference to the array, the program, per filled box (box index,
# weak reference to the buffer's base, byte offset in it, the lease of its
# pooled block or None)). A jax array never changes, and jax never writes
# into a host buffer it adopted, so while the same source array is alive
# and not deleted, a reshard of it through the same program takes those
# boxes' bytes again instead of copying them:
#
# * where the buffer is alive (the last result, or a part of it, is still
#   held), it adopts that buffer, as ``jax.device_put`` hands out views of
#   the host copy it keeps of an array it gathered;
# * where the result was dropped, its buffer's block went back to the host
#   pool (``_hostmem``) with its bytes; if nobody took the block since, it
#   is taken back (``host_reclaim``), bytes and all.
#
# Nothing here keeps an array or a buffer alive, nor holds memory that the
# pool would not hold anyway.
_FILLED: dict = {}
_FILLED_MAX = 1 << 16


def _earlier_boxes(prog: _LeafProgram, x: jax.Array, built: list
                   ) -> tuple[list, bool]:
  """Fills ``built`` with the boxes an earlier reshard of ``x`` through
  ``prog`` filled, where their bytes are still there (see ``_FILLED``).

  Returns ``(records, reclaimed)``: the ``_FILLED`` records of the boxes
  taken, and whether a dropped one was taken back from the pool (its
  record is new).
  """
  hit = _FILLED.get((id(x), id(prog)))
  if hit is None or hit[0]() is not x or hit[1] is not prog:
    return [], False
  if x.is_deleted():
    return [], False
  records, reclaimed = [], False
  for rec in hit[2]:
    k, ref, off, token = rec
    if built[k] is not None:
      continue
    shape = prog.boxes[k][0]
    base = ref()
    if base is not None:
      built[k] = np.ndarray(shape, x.dtype, buffer=base, offset=off)
      records.append(rec)
      continue
    got = None if token is None else host_reclaim(token, shape, x.dtype)
    if got is not None:
      built[k], token = got
      records.append((k, weakref.ref(built[k].base), 0, token))
      reclaimed = True
  return records, reclaimed


def _remember_boxes(prog: _LeafProgram, x: jax.Array, records: list,
                    made: list) -> None:
  refs = list(records)
  for k, buf, token in made:
    base = buf.base
    if not isinstance(base, np.ndarray):
      return  # not a view of an array, as host_empty hands out
    # A contiguous view as long as its (contiguous) base starts where the
    # base does; only then is ``.ctypes`` (1.5 us a call) skipped.
    off = (0 if base.nbytes == buf.nbytes and base.flags.c_contiguous
           and buf.flags.c_contiguous
           else buf.ctypes.data - base.ctypes.data)
    refs.append((k, weakref.ref(base), off, token))
  if len(_FILLED) >= _FILLED_MAX:
    for key in [k for k, v in _FILLED.items() if v[0]() is None]:
      del _FILLED[key]
    if len(_FILLED) >= _FILLED_MAX:
      _FILLED.clear()
  _FILLED[id(x), id(prog)] = (weakref.ref(x), prog, tuple(refs))


# -- the generic executor: one compiled program per device ---------------------


# XLA:CPU canonicalises NaNs where it slices or concatenates some narrow
# floats (bfloat16 with the classic emitters, float8_e5m2): a signalling NaN
# came back quiet and a bfloat16 NaN lost its payload. The executors' programs
# only move bytes, so they move such floats as unsigned integers of the same
# width, bitcast in the program on the way in and out.
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _as_bits(x):
  """``x`` bitcast to the unsigned integers of its width, if a float."""
  dt = np.dtype(x.dtype)
  if (jnp.issubdtype(dt, jnp.floating) and dt.itemsize in _BITS
      and not _sub_byte(dt)):
    return jax.lax.bitcast_convert_type(x, _BITS[dt.itemsize])
  return x


def _from_bits(x, dtype):
  """Undoes :func:`_as_bits` for an array of ``dtype``."""
  return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _cut_impl(spec, *arrays):
  return tuple(_from_bits(jax.lax.slice(_as_bits(arrays[i]), starts, limits),
                          arrays[i].dtype)
               for i, starts, limits in spec)


def _glue_impl(spec, *pieces):
  """Per new shard: its pieces (grid order), joined by concatenation."""
  outs = []
  for _, parts in spec:
    items = [(starts, _as_bits(pieces[i])) for i, starts in parts]

    def join(items, d):
      if len(items) == 1:
        return items[0][1]
      starts = sorted({st[d] for st, _ in items})
      cols = [join([it for it in items if it[0][d] == a], d + 1)
              for a in starts]
      return cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=d)

    outs.append(_from_bits(join(items, 0), pieces[parts[0][0]].dtype))
  return tuple(outs)


_cut = jax.jit(_cut_impl, static_argnums=0)
_glue = jax.jit(_glue_impl, static_argnums=0)
# These programs only move bytes (slices and concatenations), which XLA's
# optimisation passes cannot make faster; on CPU they took most of the
# compile time (19.7 s -> 2.9 s for one program of 256 slices here). On CPU
# devices XLA's MLIR fusion emitters took 3.5-4x the compile CPU time of its
# classic emitters for them (40 slices: 0.38 -> 0.10 s; 40 joins: 0.51 ->
# 0.12 s; results bitwise equal), so they are off for these programs. Nor
# is their code split into parts generated in parallel: the split cost more
# than it saved on these small modules (lm1b SMALL's 10 group programs: 0.86
# -> 0.53-0.63 s of compile CPU).
_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}
_FAST_COMPILE_CPU = {**_FAST_COMPILE, "xla_cpu_use_fusion_emitters": False,
                     "xla_cpu_parallel_codegen_split_count": 1}
_programs: collections.OrderedDict = collections.OrderedDict()
_PLAIN_JIT = object()
_PROGRAMS_MAX = 256


try:  # glibc: hands the free pages of every malloc arena back to the kernel
  import ctypes
  _malloc_trim = ctypes.CDLL(None).malloc_trim
  _malloc_trim.argtypes = [ctypes.c_size_t]
  _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not glibc
  _malloc_trim = None


def _trim_heap() -> None:
  """Returns the C heap's free pages to the kernel after compiling.

  XLA compiles on the threads of :func:`_ensure_group_programs`, each with
  a malloc arena of its own; what a compile frees stays resident in those
  arenas, where the results (allocated on other threads) cannot reuse it.
  On lm1b SMALL's cold generic call that was ~20 MiB of the peak above the
  78 MiB of results (the peak RSS rise 95-109 MiB, ``jax.device_put``'s
  84-88). ``malloc_trim(0)`` gives back every free page of every arena
  (the compiles' and any the process freed before the call), in ~20 ms
  there; it runs only after a compile, never on a warm call. A no-op
  without glibc."""
  if _malloc_trim is not None:
    _malloc_trim(0)


def _compile(lowered, platform: str):
  """``lowered`` compiled with the fast options its platform takes."""
  opts = (_FAST_COMPILE_CPU if platform == "cpu" else
          _FAST_COMPILE if platform in ("gpu", "cuda", "rocm") else None)
  if opts is not None:
    try:
      return lowered.compile(compiler_options=opts)
    except Exception:  # a backend without these options
      pass
  return lowered.compile()


# Tiered compilation. The fast options above keep a cold call short, but
# their code copies slower: on 8 CPU devices lm1b SMALL's warm generic call
# took 0.080 s (median of 20) against 0.055 s with the same programs at
# XLA's optimisation level 1, ``pieces`` 0.028 s against 0.022 s, while
# level 1 made the cold call 1.9x and 1.2x longer (0.46 -> 0.87 s, 0.48 ->
# 0.59 s; ``jax.device_put``'s cold lm1b call takes 0.60 s). So a cold call
# compiles fast and remembers how to lower each program; when a later call
# uses the program again (a transition that repeats; a one-off resize
# costs nothing more), one background thread of the lowest priority lowers
# and compiles it again with these options, starting each compile only
# while no reshard call runs, and swaps it into the cache. The programs
# only slice, reshape and concatenate, so either code gives the same bits.
# Only on CPU devices, where it was measured (no GPU was lent to measure it
# there). ``TENPLEX_JAX_RECOMPILE=0`` turns it off. Lowering again, not
# keeping the lowered modules: each held its own MLIR context, ~2.4 MiB
# (101 kept raised a held-out state's RSS by 244 MiB).
_RECOMPILE_OPTIONS = {
    "cpu": {**_FAST_COMPILE_CPU, "xla_backend_optimization_level": 1}}
# Programs compiled fast, not yet used again: key -> (lower, platform,
# install); bounded like the caches they shadow.
_recompile_later: collections.OrderedDict = collections.OrderedDict()
_RECOMPILE_LATER_MAX = 1024
_recompile_jobs: collections.deque = collections.deque()
_recompile_cv = threading.Condition()
_recompile_thread: threading.Thread | None = None
_resharding = 0  # reshard calls in progress; the thread waits for none
# At most this many recompiled executables alive: XLA:CPU maps each
# executable's kernels into memory mappings of their own, ~22 a program at
# level 0 and ~40 at level 1 on a held-out state (196 programs: 4,256 and
# 7,797 mappings), against the kernel's 65,530 a process; beyond it the
# programs keep their fast code.
_RECOMPILED_MAX = 256
_recompiled: weakref.WeakSet = weakref.WeakSet()


def _recompiles(platform: str) -> bool:
  """Whether programs of ``platform`` are recompiled (asked when a program
  is remembered and again when it is queued: the switch may change in
  between)."""
  v = os.environ.get("TENPLEX_JAX_RECOMPILE", "1")
  if v not in ("0", "1"):
    raise ValueError(f"TENPLEX_JAX_RECOMPILE must be 0 or 1, not {v!r}")
  return v == "1" and platform in _RECOMPILE_OPTIONS


def _recompile_on_reuse(key, lower: Callable, platform: str, install
                        ) -> None:
  """Remembers a program compiled fast: its reuse (:func:`_reused`) queues
  it for :func:`_queue_recompile`."""
  if not _recompiles(platform):
    return
  with _recompile_cv:
    _recompile_later[key] = (lower, platform, install)
    while len(_recompile_later) > _RECOMPILE_LATER_MAX:
      _recompile_later.popitem(last=False)


def _reused(key) -> None:
  """A cached program ``key`` runs again: its recompile is queued (once)."""
  if not _recompile_later:
    return
  with _recompile_cv:
    job = _recompile_later.pop(key, None)
  if job is not None:
    _queue_recompile(*job)


# The generic executor's host tier (see _build_generic): the programs whose
# compile has been queued (once each; until installed, calls build their
# arrays through the host).
_compile_queued: collections.OrderedDict = collections.OrderedDict()


def _generic_cold() -> str:
  """How the generic executor builds arrays whose programs are not compiled
  yet: ``host`` (the default) or ``compile`` (``TENPLEX_JAX_GENERIC_COLD``)."""
  v = os.environ.get("TENPLEX_JAX_GENERIC_COLD", "host")
  if v not in ("host", "compile"):
    raise ValueError("TENPLEX_JAX_GENERIC_COLD must be 'host' or 'compile',"
                     f" not {v!r}")
  return v


# Platforms whose host tier is never slower than the device programs: CPU
# devices, whose shards are host memory (the host tier reads them in place
# and copies each moved byte at most once, the programs cut, send and glue:
# warm calls 0.037-2.3 s against 0.011-0.22 s in docs/benchmarks.md). Their
# programs are never compiled for the host tier (they would cost compile
# time on the cores a job trains on, and be timed once, slower, before the
# host tier was chosen again).
_HOST_ONLY = frozenset({"cpu"})


def _needed(key, lower: Callable, platform: str, install) -> None:
  """A call that repeats a transition built arrays through the host for
  want of program ``key``: its compile is queued (:func:`_queue_recompile`
  with ``new``), once; never on :data:`_HOST_ONLY` platforms."""
  if platform in _HOST_ONLY:
    return
  with _recompile_cv:
    if key in _compile_queued:
      return
    _compile_queued[key] = None
    while len(_compile_queued) > _RECOMPILE_LATER_MAX:
      _compile_queued.popitem(last=False)
  _queue_recompile(lower, platform, install, new=True)


class _Resharding:
  """Marks a reshard call in progress: recompiles wait until none is."""

  def __enter__(self):
    global _resharding
    with _recompile_cv:
      _resharding += 1

  def __exit__(self, *exc):
    global _resharding
    with _recompile_cv:
      _resharding -= 1
      _recompile_cv.notify_all()


def _queue_recompile(lower: Callable, platform: str, install,
                     new: bool = False) -> None:
  """On the background thread, compiles the programs ``lower()`` returns
  (lowered modules) with ``_RECOMPILE_OPTIONS[platform]``, then calls
  ``install`` with the executables (in order) to swap them into a cache.

  ``new``: programs not compiled yet (the host tier's, see
  :func:`_build_generic`): compiled whatever ``TENPLEX_JAX_RECOMPILE`` says
  and on every platform, with those options where the recompiles would
  use them, else with :func:`_compile`'s."""
  global _recompile_thread
  if not new and not _recompiles(platform):
    return
  with _recompile_cv:
    _recompile_jobs.append((lower, platform, install, new))
    if _recompile_thread is None:
      _recompile_thread = threading.Thread(
          target=_recompile_loop, name="tenplex-recompile")
      _recompile_thread.start()
    _recompile_cv.notify_all()


def _recompile_loop() -> None:
  try:
    _recompile_jobs_run()
  finally:  # if something failed unexpectedly, waiters still wake
    with _recompile_cv:
      if _recompile_thread is threading.current_thread():
        _recompile_thread_ends()


def _recompile_thread_ends() -> None:
  """Drops the queue and marks no recompile thread running, waking the
  waiters; called with ``_recompile_cv`` held."""
  global _recompile_thread
  _recompile_jobs.clear()
  _recompile_thread = None
  _recompile_cv.notify_all()


def _recompile_jobs_run() -> None:
  # Linux: the lowest priority, for this thread alone. Not SCHED_IDLE: a
  # thread that never runs while the cores are busy could hold the
  # interpreter lock (jax's Python around each compile) for as long.
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
  except (AttributeError, OSError):  # pragma: no cover - not Linux
    pass
  main = threading.main_thread()
  while True:
    with _recompile_cv:
      # Never beside a reshard call (its own work and compiles come first).
      while _resharding and main.is_alive():
        _recompile_cv.wait(1.0)
      # A process that is exiting waits for the compile in progress only.
      if not _recompile_jobs or not main.is_alive():
        # in the same hold of the lock as the last look at the queue: a
        # job queued after it starts a thread of its own
        _recompile_thread_ends()
        return
      lower, platform, install, new = _recompile_jobs.popleft()
    level1 = (_recompiles(platform) and len(_recompiled) < _RECOMPILED_MAX)
    if not level1 and not new:
      continue
    try:
      lowered = lower()
      made: dict = {}  # a program listed twice is compiled once
      for lo in lowered:
        if id(lo) not in made:
          made[id(lo)] = (
              lo.compile(compiler_options=_RECOMPILE_OPTIONS[platform])
              if level1 else _compile(lo, platform))
      exes = [made[id(lo)] for lo in lowered]
      if level1:
        _recompiled.update(made.values())
      del made, lowered
      install(exes)
      del exes
    except Exception:  # pylint: disable=broad-except
      continue  # the fast programs stay
    with _recompile_cv:
      idle = not _recompile_jobs
    if idle:
      _trim_heap()


def _wait_recompiles(timeout: float | None = None) -> bool:
  """Waits until no recompile is queued or running; ``False`` on timeout."""
  with _recompile_cv:
    return _recompile_cv.wait_for(lambda: _recompile_thread is None,
                                  timeout)


def _reset_recompile_after_fork() -> None:
  global _recompile_cv, _recompile_thread, _resharding
  _recompile_jobs.clear()
  _recompile_later.clear()
  _compile_queued.clear()
  _recompile_cv, _recompile_thread = threading.Condition(), None
  _resharding = 0


os.register_at_fork(after_in_child=_reset_recompile_after_fork)


def _program_key(fn, spec, dev, avals) -> tuple:
  return (fn, spec, dev, tuple((tuple(s), d) for s, d in avals))


def _ensure_programs(jobs: list) -> None:
  """Compiles the programs of ``jobs`` (``(fn, spec, device, avals)``,
  ``avals`` a tuple of ``(shape, dtype)``) that are not cached yet, several
  at once: XLA compiles without Python's lock, so a cold transition costs
  about its largest program's compile time per core, not the sum."""
  todo, seen = [], set()
  for fn, spec, dev, avals in jobs:
    key = _program_key(fn, spec, dev, avals)
    if key in _programs:
      _programs.move_to_end(key)
      _reused(key)
      continue
    if key in seen:
      continue
    seen.add(key)
    todo.append((key, _lower_program(*key)[0], dev.platform))
  if not todo:
    return
  n = min(len(todo), _copy_threads())
  if n <= 1:
    exes = [_compile(lo, p) for _, lo, p in todo]
  else:
    with concurrent.futures.ThreadPoolExecutor(
        n, thread_name_prefix="tenplex-compile") as pool:
      exes = list(pool.map(lambda t: _compile(t[1], t[2]), todo))
  for (key, _, platform), exe in zip(todo, exes):
    _programs[key] = exe
    _recompile_on_reuse(key, functools.partial(_lower_program, *key),
                        platform, functools.partial(_install_program, key))
  del todo  # the lowered modules (an MLIR context each), then the trim
  _trim_heap()
  while len(_programs) > max(_PROGRAMS_MAX, len(jobs)):
    _programs.popitem(last=False)


def _lower_program(fn, spec, dev, avals) -> list:
  """``fn(spec, *avals)`` on ``dev`` lowered through a jit of its own.

  jax caches the executables compiled from a lowering (per compiler
  options) for as long as the lowering lives, and a lowering of ``fn``
  itself lives in ``fn``'s cache: ``_programs`` and ``_RECOMPILED_MAX``
  would not be what bounds them. (Not measured to matter: the extra memory
  mappings a held-out state's recompiles added came from the level-1
  executables themselves, ~40 each against ~22.)"""
  return [jax.jit(fn.__wrapped__, static_argnums=0).lower(spec, *(
      jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))
      for s, d in avals))]


def _programs_ready(jobs) -> bool:
  """Whether every program of ``jobs`` (see :func:`_ensure_programs`) is
  compiled; those that are not are reported to :func:`_needed`."""
  ready = True
  with _transitions_lock:
    missing = [key for key in (_program_key(*j) for j in jobs)
               if key not in _programs]
  for key in dict.fromkeys(missing):
    ready = False
    _needed(key, functools.partial(_lower_program, *key), key[2].platform,
            functools.partial(_install_new_program, key))
  return ready


def _install_new_program(key, exes: list) -> None:
  with _transitions_lock:
    if key not in _programs:
      _programs[key] = exes[0]
      while len(_programs) > _PROGRAMS_MAX:
        _programs.popitem(last=False)


# The installs hold no reference to the executables they replace (a queued
# or remembered job would keep an evicted one alive); whatever is cached
# under a key is the same program.
def _install_program(key, exes: list) -> None:
  with _transitions_lock:
    old = _programs.get(key)
    if old is not None and old is not _PLAIN_JIT:  # not evicted
      _programs[key] = exes[0]


def _run_program(fn, spec, dev, args: list) -> tuple:
  """Runs ``fn(spec, *args)`` on ``dev`` with its cached program (compiled
  here if :func:`_ensure_programs` did not)."""
  avals = tuple((tuple(a.shape), a.dtype) for a in args)
  key = _program_key(fn, spec, dev, avals)
  exe = _programs.get(key)
  if exe is None:
    _ensure_programs([(fn, spec, dev, avals)])
    exe = _programs[key]
  if exe is _PLAIN_JIT:
    return fn(spec, *args)
  try:
    return exe(*args)
  except (ValueError, TypeError):  # arguments in non-default layouts (e.g.
    _programs[key] = _PLAIN_JIT  # int4) or weak types: jit picks itself
    return fn(spec, *args)


@dataclasses.dataclass(frozen=True)
class _GenericSchedule:
  """What the generic executor runs for one batch of arrays, independent of
  their values (so a repeated transition reuses it).

  A piece is named by a ref: ``("w", k, d)``, the whole shard of array
  ``k`` on device ``d``, or ``("c", d, i)``, output ``i`` of the cut
  program of device ``d``.

  Attributes:
    cuts: per source device, ``(device, inputs, spec, avals)``: ``inputs``
      the ``(array, device id)`` shards the program takes.
    sends: ``(ref, device)``: pieces that a device needs from another.
    glues: per destination device, ``(device, refs, spec, avals)``.
    outs: per array, per target device: ``("keep", device id)``, ``("ref",
      ref, device)`` (a piece that is the whole new shard) or ``("glue",
      device id, output index)``.
    jobs: the programs, for :func:`_ensure_programs`.
  """

  cuts: tuple
  sends: tuple
  glues: tuple
  outs: tuple
  jobs: tuple


def _generic_schedule(batch: list) -> _GenericSchedule:
  cuts: dict = {}  # source device id -> [device, {(k, d): slot}, spec, avals]
  per_array = []
  for k, (prog, x) in enumerate(batch):
    shards = _shards_of(x)
    per_box = []
    for shape, pieces in prog.boxes:
      refs = []
      for src, _, _, (starts, limits), at in pieces:
        arr = shards[src]
        if limits == tuple(arr.shape) and not any(starts):
          refs.append((("w", k, src), at, tuple(arr.shape), src))
          continue
        c = cuts.get(src)
        if c is None:
          c = cuts[src] = [next(iter(arr.devices())), {}, [], []]
        if (k, src) not in c[1]:
          c[1][k, src] = len(c[1])
          c[3].append((tuple(arr.shape), arr.dtype))
        c[2].append((c[1][k, src], starts, limits))
        refs.append((("c", src, len(c[2]) - 1), at,
                     tuple(b - a for a, b in zip(starts, limits)), src))
      per_box.append((tuple(shape), refs))
    per_array.append((prog, x.dtype, per_box))
  sends: dict = {}
  glues: dict = {}  # destination device id -> [device, refs, spec, avals]
  outs_all = []
  for prog, dtype, per_box in per_array:
    outs = []
    for dev, (kind, a) in zip(prog.devices, prog.outs):
      if kind == "keep":
        outs.append(("keep", a))
        continue
      shape, refs = per_box[a]
      for r, _, _, src in refs:
        if src != dev.id:
          sends.setdefault((r, dev.id), (r, dev))
      if len(refs) == 1 and refs[0][2] == shape:
        outs.append(("ref", refs[0][0], dev))
        continue
      g = glues.get(dev.id)
      if g is None:
        g = glues[dev.id] = [dev, [], [], []]
      parts = []
      for r, at, pshape, _ in refs:
        parts.append((len(g[1]), at))
        g[1].append(r)
        g[3].append((pshape, dtype))
      g[2].append((shape, tuple(parts)))
      outs.append(("glue", dev.id, len(g[2]) - 1))
    outs_all.append(tuple(outs))
  cut_list = tuple((c[0], tuple(c[1]), tuple(c[2]), tuple(c[3]))
                   for c in cuts.values())
  glue_list = tuple((g[0], tuple(g[1]), tuple(g[2]), tuple(g[3]))
                    for g in glues.values())
  jobs = tuple([(_cut, spec, dev, avals) for dev, _, spec, avals in cut_list]
               + [(_glue, spec, dev, avals)
                  for dev, _, spec, avals in glue_list])
  return _GenericSchedule(cut_list, tuple(sends.values()), glue_list,
                          tuple(outs_all), jobs)


_SCHEDULES: collections.OrderedDict = collections.OrderedDict()
_SCHEDULES_MAX = 32


def _cached_schedule(batch: list) -> _GenericSchedule:
  """The batch's schedule, built once per (programs, array signatures)."""
  key = tuple((id(prog), x.shape, x.dtype, x.sharding) for prog, x in batch)
  with _transitions_lock:
    hit = _SCHEDULES.get(key)
    if hit is not None and all(a is b for a, (b, _) in zip(hit[0], batch)):
      _SCHEDULES.move_to_end(key)
      return hit[1]
  sched = _generic_schedule(batch)
  with _transitions_lock:
    # The programs are kept with it: their ids stay theirs while it lives.
    _SCHEDULES[key] = (tuple(prog for prog, _ in batch), sched)
    while len(_SCHEDULES) > _SCHEDULES_MAX:
      _SCHEDULES.popitem(last=False)
  return sched


try:  # one C++ call copies many single-device arrays (jax.device_put's own)
  from jax._src.lib import xla_client as _xc
  _batched_copy = _xc.batched_copy_array_to_devices_with_sharding
  _REUSE = _xc.ArrayCopySemantics.REUSE_INPUT
except (ImportError, AttributeError):  # pragma: no cover - other jax versions
  _batched_copy = None


@functools.lru_cache(maxsize=4096)
def _on_device(dev) -> tuple:
  s = SingleDeviceSharding(dev)
  return s, s._internal_device_list.addressable_device_list


def _send(arrays: list, devices: list) -> list:
  """``jax.device_put(arrays, devices)`` for single-device arrays, in one
  call: ``jax.device_put`` of a list dispatches each array through about
  ten Python frames (170 us each here; lm1b SMALL sends 3,552 pieces)."""
  if _batched_copy is None:
    return jax.device_put(arrays, devices)
  try:
    on = [_on_device(d) for d in devices]
    return _batched_copy(arrays, [d for _, d in on], [s for s, _ in on],
                         [_REUSE] * len(arrays))
  except (TypeError, AttributeError):  # pragma: no cover - other jax
    return jax.device_put(arrays, devices)


def _run_generic(batch: list) -> list:
  """The generic executor (any backend) over many arrays at once.

  Three batched steps for all arrays of ``batch`` (``(program, array)``
  pairs): on every source device, one compiled program cuts all the pieces
  that leave it (whole shards travel uncut); one ``jax.device_put`` moves
  every piece to its destination device; on every destination device, one
  compiled program places the pieces of all its new shards. So the number
  of XLA compilations is at most one per device and step, independent of the
  number of pieces and arrays, and zero when the same transition ran before;
  the programs a transition needs are compiled concurrently, and what to run
  (the schedule) is worked out once per transition.

  Returns, per array, ``(xs, shards)`` for :func:`_make_array`.
  """
  sched = _cached_schedule(batch)
  shards = [_shards_of(x) for _, x in batch]
  _ensure_programs(sched.jobs)
  got: dict = {}
  for dev, inputs, spec, _ in sched.cuts:
    d = dev.id
    for i, piece in enumerate(_run_program(
        _cut, spec, dev, [shards[k][s] for k, s in inputs])):
      got["c", d, i] = piece

  def ref(r):
    return got[r] if r[0] == "c" else shards[r[1]][r[2]]
  moved: dict = {}
  if sched.sends:
    arrays = _send([ref(r) for r, _ in sched.sends],
                   [dev for _, dev in sched.sends])
    moved = {(r, dev.id): a for (r, dev), a in zip(sched.sends, arrays)}

  def on(r, dev):
    a = moved.get((r, dev.id))
    return ref(r) if a is None else a
  glued = {dev.id: _run_program(_glue, spec, dev, [on(r, dev) for r in refs])
           for dev, refs, spec, _ in sched.glues}
  made = []
  for k, outs in enumerate(sched.outs):
    xs = []
    for o in outs:
      if o[0] == "keep":
        xs.append(shards[k][o[1]])
      elif o[0] == "ref":
        xs.append(on(o[1], o[2]))
      else:
        xs.append(glued[o[1]][o[2]])
    made.append((xs, shards[k]))
  return made


# -- the generic executor by class: two SPMD programs per group of arrays -------
#
# Between two plain NamedShardings an array's boxes are unions of equal
# sub-blocks (see _UnitClass), and which source device sends which sub-block
# to which target device depends only on the shardings and the rank, not on
# the shape. So arrays of one (source sharding, target sharding, rank, dtype)
# move together: one SPMD program over the source mesh cuts every array's
# shard into its sub-blocks and packs sub-block ``j`` of all of them into one
# flat buffer per device; one transfer per (source device, target device,
# sub-block) moves the packed buffers; one SPMD program over the target mesh
# unpacks them and joins each array's sub-blocks into its new shard. The
# number of transfers and program launches is that of one array per group,
# not per array (lm1b SMALL with its 5 classes in 5 groups: 128 transfers and
# 10 launches per call, against 3,552 and 147 with one array per program; cut
# by bytes as below, 19 groups of 5 signatures); on CPU, where a cut slices,
# that of one array per run of at most _CONCAT_FUSE_CPU members (see
# _chunks: larger packed buffers cost a temporary copy); a large group's
# runs are sent and glued one after another (_RUNS_APART_MIN). A group holds at most
# _GROUP_SLICES sub-block slices per program and half the bytes allowed in
# flight (a sixteenth of the bytes the targets receive, replicas counted,
# 4-256 MiB; all of them up to 16 MiB), so no program grows with the state;
# groups run one after another within that bound, each one's packed copies
# let go once used, so a call holds its results and a bounded part of the
# state twice more, not three copies of it. A group's programs are compiled
# once per (shardings, dtype, member shapes), and a class splits into groups
# of one signature where it can (_uniform_split), so they share their
# programs.

_SUB_BYTE = frozenset({"int4", "uint4", "int2", "uint2", "float4_e2m1fn"})
_GROUP_SLICES = 256
_PAD_WASTE = 8
_FLIGHT_MIN = 4 << 20
_FLIGHT_WHOLE = 16 << 20
_FLIGHT_MAX = 256 << 20


class _ClassMoves(_Record):
  """Where the sub-blocks of every array of one class go (shape-free).

  Attributes:
    units: sub-blocks per dimension of the whole array.
    cut_grid: offsets (in sub-blocks) of the sub-blocks of a source shard,
      in the order the cut program returns them.
    glue_counts: sub-blocks per dimension of a target box.
    glue_grid: offsets of the sub-blocks of a target box (row-major).
    devices: the target's addressable devices, in order.
    need: per target device, per sub-block of its box, ``(source device id,
      cut output index)``.
    flat_src, flat_dst: shardings of the packed buffers (one flat block per
      device of the source / target mesh).
  """

  __slots__ = ("units", "cut_grid", "glue_counts", "glue_grid", "devices",
               "need", "flat_src", "flat_dst")


def _grid(counts: tuple) -> list:
  """Every index of a grid of ``counts``, row-major."""
  out = [()]
  for c in counts:
    out = [i + (j,) for i in out for j in range(c)]
  return out


def _flat_sharding(s: NamedSharding) -> NamedSharding:
  """One block per device of ``s``'s mesh, for a 1-D array."""
  return NamedSharding(s.mesh, PartitionSpec(tuple(s.mesh.axis_names)))


@functools.lru_cache(maxsize=1024)
def _class_moves(src: Sharding, dst: Sharding, ndim: int
                 ) -> _ClassMoves | None:
  """The moves of rank-``ndim`` arrays from ``src`` to ``dst``, or ``None``
  (then the per-device executor moves them)."""
  if ndim == 0:
    return None
  c = _unit_class(src, dst, ndim)
  if c is None:
    return None
  if _platforms(src) != _platforms(dst) or len(_platforms(src)) != 1:
    return None
  p, q = _dim_parts(src, ndim), _dim_parts(dst, ndim)
  k = tuple(u // a for u, a in zip(c.units, p))
  h = tuple(u // a for u, a in zip(c.units, q))
  sp = placement_by_arithmetic(src, c.units)
  dp = placement_by_arithmetic(dst, c.units)
  if sp is None or dp is None:
    return None
  cut_grid = _grid(k)
  holders = {}  # unit coordinate -> (source device ids, cut output index)
  for box, devs in zip(sp.boxes, sp.holders):
    for j, off in enumerate(cut_grid):
      holders[tuple(a + o for (a, _), o in zip(box, off))] = (tuple(devs), j)
  devices = _device_order(dst)
  glue_grid = _grid(h)
  need = []
  for dev in devices:
    box = dp.boxes[dp.box_of_device[dev.id]]
    row = []
    for off in glue_grid:
      devs, j = holders[tuple(a + o for (a, _), o in zip(box, off))]
      row.append((dev.id if dev.id in devs else devs[dev.id % len(devs)], j))
    need.append(tuple(row))
  return _ClassMoves(c.units, tuple(cut_grid), h, tuple(glue_grid), devices,
                     tuple(need), _flat_sharding(src), _flat_sharding(dst))


@functools.lru_cache(maxsize=64)
def _sub_byte(dtype) -> bool:
  return np.dtype(dtype).name in _SUB_BYTE


# Arrays of a class (see _class_key) with fewer members than this take the
# per-device executor: packing them would compile a cut and a glue for each
# such class. Held-out random states (arrays laid out one by one, 393 and
# 770 classes) compiled 792 and 1,542 programs, 266 and 270 with this.
_PACK_MIN = 3


def _class_key(leaf: jax.Array, s: Sharding) -> tuple:
  return (leaf.sharding, s, leaf.ndim, leaf.dtype)


def _packed_eligible(leaf: jax.Array, s: Sharding) -> bool:
  if (type(s) is not NamedSharding or type(leaf.sharding) is not NamedSharding
      or _sub_byte(leaf.dtype)):
    return False
  m = _class_moves(leaf.sharding, s, leaf.ndim)
  return m is not None and all(n > 0 and n % u == 0
                               for n, u in zip(leaf.shape, m.units))


_GROUP_EXES: collections.OrderedDict = collections.OrderedDict()
_GROUP_EXES_MAX = 256


# XLA:CPU fuses the producers of a concatenation (here the slices of a cut)
# into it only up to this many operands. Above it every slice is a kernel of
# its own writing a temporary buffer that the concatenation then copies: the
# ``pieces`` benchmark's cut (32 arrays a packed buffer) held 1.43 MiB of
# temporaries per device (as much as its outputs), faulted in afresh on most
# calls (~740 pages a call, all ~2,900 once the heap is trimmed). So on CPU a
# packed buffer holds at most this many arrays' sub-blocks, each one fused
# kernel writing straight into its output.
_CONCAT_FUSE_CPU = 8

# A group receiving at least this many bytes (replicas counted) in several
# runs is sent and glued run by run: a batch of transfers and a glue
# program per run (runs of the same member shapes share it), each run's
# packed copies let go once sent and its received ones once glued, rather
# than all of the group's at once. The pieces benchmark (one group of
# 12 MiB, 4 runs; heap trimmed before each warm call): peak RSS rise,
# medians of 5 calls, 27-31 -> 19-22 MiB with 12 MiB of results
# (``device_put`` 10-13). Waiting for each run's glue before sending the
# next gave the same (probe: 19-21 against 17-23 MiB without), so no run
# waits. Below the bound the runs go
# together (one glue program: fewer compiles where the copies are small).
_RUNS_APART_MIN = 4 << 20


def _chunks(n: int, platform: str, cut: bool) -> list:
  """``range(n)`` (a group's members) split into the runs packed together:
  at most _CONCAT_FUSE_CPU on CPU where the cut slices (``cut``), else one
  run."""
  step = _CONCAT_FUSE_CPU if platform == "cpu" and cut else n
  return [range(i, min(n, i + step)) for i in range(0, n, step)]


def _group_programs(src: NamedSharding, dst: NamedSharding, dtype,
                    shapes: tuple) -> tuple:
  """``(cut, glues, sizes)``: the lowered SPMD programs of one group of
  arrays of ``shapes`` (one class, one dtype; see the section comment), a
  cut and the glues of its stages, and the length on one device of each
  run's packed buffers (one run per packed buffer, see :func:`_chunks`).

  The cut program returns, per sub-block of a source shard and per run of
  members, the members' sub-blocks flattened and packed in member order
  (output ``j * runs + c``). The runs are glued in stages: each run a stage
  of its own where the group receives at least _RUNS_APART_MIN bytes (one
  glue per run, shared by runs of the same member shapes), else all runs
  one stage (one glue). A stage's glue takes, per sub-block of a target
  box and run of the stage, such a packed buffer (input ``i * n + k``
  for the stage's ``k``-th of ``n`` runs) and returns its runs' members'
  new arrays. Stages are sent and glued one after another (see
  :func:`_run_generic_packed`).
  """
  moves = _class_moves(src, dst, len(shapes[0]))
  blocks = [tuple(n // u for n, u in zip(shape, moves.units))
            for shape in shapes]
  sizes = [math.prod(b) for b in blocks]
  h, ndim = moves.glue_counts, len(moves.units)
  runs = _chunks(len(shapes), next(iter(_platforms(src))),
                 len(moves.cut_grid) > 1)

  def cut_body(*xs):
    xs = [_as_bits(x) for x in xs]
    outs = []
    for off in moves.cut_grid:
      parts = [jax.lax.reshape(
          jax.lax.slice(x, tuple(o * s for o, s in zip(off, b)),
                        tuple((o + 1) * s for o, s in zip(off, b))),
          (n,)) for x, b, n in zip(xs, blocks, sizes)]
      for run in runs:
        outs.append(parts[run[0]] if len(run) == 1 else
                    jax.lax.concatenate([parts[m] for m in run], 0))
    return tuple(_from_bits(o, dtype) for o in outs)

  def join(items, d):
    if d == ndim:
      return items[0]
    step = len(items) // h[d]
    parts = [join(items[i * step:(i + 1) * step], d + 1) for i in range(h[d])]
    return parts[0] if len(parts) == 1 else jax.lax.concatenate(parts, d)

  def glue_body(stage, *flats):
    flats = [_as_bits(f) for f in flats]
    outs = []
    for k, c in enumerate(stage):
      at = 0
      for m in runs[c]:
        b, n = blocks[m], sizes[m]
        outs.append(join([jax.lax.reshape(
            jax.lax.slice(flats[i], (at,), (at + n,)), b)
            for i in range(k, len(flats), len(stage))], 0))
        at += n
    return tuple(_from_bits(o, dtype) for o in outs)

  run_sizes = tuple(sum(sizes[m] for m in run) for run in runs)
  fs, fd = moves.flat_src.spec, moves.flat_dst.spec
  n_cut = len(moves.cut_grid) * len(runs)
  n_glue = len(moves.glue_grid)
  cut = jax.jit(jax.shard_map(
      cut_body, mesh=src.mesh, in_specs=(src.spec,) * len(shapes),
      out_specs=(fs,) * n_cut, check_vma=False))
  cut = cut.lower(*(jax.ShapeDtypeStruct(s, dtype, sharding=src)
                    for s in shapes))
  received = (sum(math.prod(dst.shard_shape(s)) for s in shapes)
              * np.dtype(dtype).itemsize * len(dst.device_set))
  stages = ([(c,) for c in range(len(runs))]
            if received >= _RUNS_APART_MIN else [tuple(range(len(runs)))])
  glues: dict = {}  # stages of the same member shapes share one program

  def sig(stage):
    return tuple(tuple(shapes[m] for m in runs[c]) for c in stage)

  for st in stages:
    if sig(st) not in glues:
      n_out = sum(len(runs[c]) for c in st)
      # out_shardings: the results carry the target itself, not the
      # equivalent sharding jax derives from the program (P('b',) for a
      # target P('b', 'a') on a size-1 'a', P() for P(None, None)), so
      # they compare equal to it as device_put's and the CPU path's do (a
      # jitted step that ran on arrays of the target's sharding compiled
      # again for the derived one: jit caches by the sharding's value).
      glues[sig(st)] = jax.jit(jax.shard_map(
          functools.partial(glue_body, st), mesh=dst.mesh,
          in_specs=(fd,) * (n_glue * len(st)),
          out_specs=(dst.spec,) * n_out, check_vma=False),
          out_shardings=(dst,) * n_out).lower(*(jax.ShapeDtypeStruct(
              (run_sizes[st[i % len(st)]] * dst.mesh.size,), dtype,
              sharding=moves.flat_dst) for i in range(n_glue * len(st))))
  return cut, tuple(glues[sig(st)] for st in stages), run_sizes


def _ensure_group_programs(keys: list) -> list:
  """The compiled ``(cut, glues, sizes)`` of each group key ``(source,
  target, dtype, shapes)`` (see :func:`_group_programs`); those not cached
  yet are lowered here and compiled several at once (XLA compiles without
  Python's lock)."""
  out: dict = {}
  todo = []
  with _transitions_lock:
    for k in keys:
      hit = _GROUP_EXES.get(k)
      if hit is not None:
        _GROUP_EXES.move_to_end(k)
        out[k] = hit
  for k in out:
    _reused(("group", k))
  for k in keys:
    if k not in out and all(k != t[0] for t in todo):
      cut, glues, sizes = _group_programs(*k)
      platform = next(iter(_platforms(k[0])))
      todo.append((k, cut, glues, sizes, platform))
  if todo:
    # Each distinct program once (runs of one member shapes share a glue).
    uniq = {id(lo): (lo, t[4]) for t in todo for lo in (t[1], *t[2])}
    jobs = list(uniq.values())
    n = min(len(jobs), _copy_threads())
    if n <= 1:
      exes = [_compile(lo, p) for lo, p in jobs]
    else:
      with concurrent.futures.ThreadPoolExecutor(
          n, thread_name_prefix="tenplex-compile") as pool:
        exes = list(pool.map(lambda j: _compile(*j), jobs))
    exe = dict(zip(uniq, exes))
    done = [(t[0], exe[id(t[1])], tuple(exe[id(lo)] for lo in t[2]), t[3])
            for t in todo]
    with _transitions_lock:
      for k, cut, glues, sizes in done:
        out[k] = _GROUP_EXES[k] = (cut, glues, sizes)
      while len(_GROUP_EXES) > max(_GROUP_EXES_MAX, len(keys)):
        _GROUP_EXES.popitem(last=False)
    for t in todo:
      _recompile_on_reuse(("group", t[0]),
                          functools.partial(_lower_group, t[0]), t[4],
                          functools.partial(_install_group, t[0]))
    del jobs, todo, uniq, done
    _trim_heap()
  return [out[k] for k in keys]


def _lower_group(key) -> list:
  cut, glues, _ = _group_programs(*key)
  return [cut, *glues]


def _compiled_groups(groups: list) -> list:
  """The groups (see :func:`_groups`) whose programs are compiled; the
  others' are reported to :func:`_needed`."""
  with _transitions_lock:
    have = {g[0] for g in groups if g[0] in _GROUP_EXES}
  for k in dict.fromkeys(g[0] for g in groups if g[0] not in have):
    sizes: list = []

    def lower(k=k, sizes=sizes) -> list:
      cut, glues, got = _group_programs(*k)
      sizes[:] = [got]
      return [cut, *glues]

    def install(exes: list, k=k, sizes=sizes) -> None:
      with _transitions_lock:
        if k not in _GROUP_EXES:
          _GROUP_EXES[k] = (exes[0], tuple(exes[1:]), sizes[0])
          while len(_GROUP_EXES) > _GROUP_EXES_MAX:
            _GROUP_EXES.popitem(last=False)

    _needed(("group", k), lower, next(iter(_platforms(k[0]))), install)
  return [g for g in groups if g[0] in have]


def _install_group(key, exes: list) -> None:
  with _transitions_lock:
    old = _GROUP_EXES.get(key)
    if old is not None:  # not evicted
      _GROUP_EXES[key] = (exes[0], tuple(exes[1:]), old[2])


def _received_bytes(x: jax.Array, s: Sharding) -> int:
  """The bytes the target ``s`` holds of ``x``, every replica counted: what
  a group's received copies and results take, where ``x.nbytes`` (the
  source's) undercounts a target that copies a leaf onto several devices
  (lm1b SMALL's ``(1, 2, 4)``: 78 MiB of results from 51 MiB)."""
  shard = s.shard_shape(x.shape)
  return x.dtype.itemsize * math.prod(shard) * len(s.device_set)


def _flight_bytes(batch: list) -> int:
  """The received bytes (see :func:`_received_bytes`) of groups whose
  intermediates may be alive at once: all of them where the batch receives
  at most _FLIGHT_WHOLE (one group per class: a small state's warm call is
  its launches, 2 per group), else a sixteenth, _FLIGHT_MIN to
  _FLIGHT_MAX. Smaller groups hold less memory and cost more launches and,
  where their shapes differ, more programs (lm1b SMALL, 78 MiB received:
  groups of 7-12 MiB, bounded by a sixteenth of the source's bytes, left a
  cold call's RSS 116-120 MiB above where it started, groups of at most a
  sixteenth of the received bytes 100-105 MiB; ``jax.device_put`` 115-120)."""
  total = sum(_received_bytes(x, s) for _, x, s in batch)
  if total <= _FLIGHT_WHOLE:
    return max(total, 1)
  return min(_FLIGHT_MAX, max(_FLIGHT_MIN, total // 16))


def _uniform_split(shapes: dict, size: dict, per: int, flight: int
                   ) -> int | None:
  """How many groups of one signature a class's arrays split into, or
  ``None``: ``shapes`` maps each shape to its arrays, ``size`` to one
  array's bytes. With ``g`` groups each takes ``ceil(count / g)`` arrays of
  every shape (the last ones padded by repeating an array), so all ``g``
  share one cut and one glue program. Taken: the fewest groups of at most
  ``flight`` bytes, else the smallest groups when they hold at most twice
  the class's largest array; never more than _GROUP_SLICES slices per
  program, nor padding above 1/_PAD_WASTE of the class's bytes."""
  total = sum(len(v) * size[k] for k, v in shapes.items())
  big = max(size.values())
  best = None
  for g in range(1, max(len(v) for v in shapes.values()) + 1):
    takes = {k: -(-len(v) // g) for k, v in shapes.items()}
    if sum(takes.values()) > per:
      continue
    nbytes = sum(t * size[k] for k, t in takes.items())
    if (g * nbytes - total) * _PAD_WASTE > total:
      continue
    if nbytes <= flight:
      return g
    if best is None or nbytes < best[1]:
      best = (g, nbytes)
  if best is not None and best[1] <= 2 * big:
    return best[0]
  return None


def _groups(batch: list, flight: int) -> list:
  """``batch`` (``(program, array, target)`` triples) split into groups of
  one class and dtype, each at most _GROUP_SLICES slices per program:
  ``(key, moves, members, nbytes)`` with ``key`` the programs' cache key,
  ``members`` indices into ``batch`` (an index may repeat: padding, whose
  result is dropped) and ``nbytes`` the bytes the group's targets receive
  (see :func:`_received_bytes`), in which ``flight`` is counted too.

  A class's arrays go in groups of one signature where they can (see
  :func:`_uniform_split`): lm1b's layers, each a few arrays of a few
  shapes, split into a few equal groups that share their programs, so the
  programs compiled are those of one group per class however many groups
  the bytes in flight call for. Otherwise arrays of a shape that occurs
  several times go in equal groups of that shape alone, at most ``flight
  // 2`` bytes each (unless one array is larger), which share their
  programs; the others (each a program of its own however they are split)
  in groups of at most ``flight`` bytes."""
  by_key: dict = {}
  for n, (_, x, s) in enumerate(batch):
    by_key.setdefault(_class_key(x, s), []).append(n)
  out = []
  for (src, dst, ndim, dtype), members in by_key.items():
    moves = _class_moves(src, dst, ndim)
    per = max(1, _GROUP_SLICES // max(len(moves.cut_grid),
                                      len(moves.glue_grid)))
    by_shape: dict = {}
    for n in members:
      by_shape.setdefault(tuple(batch[n][1].shape), []).append(n)
    size = {k: _received_bytes(batch[v[0]][1], dst)
            for k, v in by_shape.items()}

    def emit(parts: list) -> None:
      """One group of ``parts``, ``(shape, members)`` in shape order."""
      idx = [n for _, run in parts for n in run]
      shapes = tuple(k for k, run in parts for _ in run)
      out.append(((src, dst, dtype, shapes), moves, idx,
                  sum(size[k] * len(run) for k, run in parts)))

    def padded(run: list, t: int, i: int) -> list:
      got = run[i * t:(i + 1) * t]
      return got + [got[-1]] * (t - len(got))

    order = sorted(by_shape)
    g = _uniform_split(by_shape, size, per, flight)
    if g is not None:
      takes = {k: -(-len(by_shape[k]) // g) for k in order}
      for i in range(g):
        # A group whose every slot is padding is not needed.
        if all(i * takes[k] >= len(by_shape[k]) for k in order):
          continue
        emit([(k, padded(by_shape[k], takes[k], i)) if
              i * takes[k] < len(by_shape[k]) else
              (k, [by_shape[k][-1]] * takes[k]) for k in order])
      continue
    mixed = []
    for k in order:
      run = by_shape[k]
      if len(run) == 1:
        mixed.append(k)
        continue
      t = max(1, min(per, (flight // 2) // size[k], len(run)))
      n_groups = -(-len(run) // t)
      t = -(-len(run) // n_groups)  # equal groups, the last one padded
      for i in range(n_groups):
        emit([(k, padded(run, t, i))])
    part, nbytes = [], 0
    for k in mixed + [None]:
      b = 0 if k is None else size[k]
      if part and (k is None or len(part) == per or nbytes + b > flight):
        emit([(m, by_shape[m]) for m in part])
        part, nbytes = [], 0
      if k is not None:
        part.append(k)
        nbytes += b
  return out


def _run_generic_packed(batch: list, flight: int | None = None,
                        groups: list | None = None) -> list:
  """The generic executor for arrays between plain NamedShardings:
  ``(program, array, target)`` triples; returns, per array, ``(new array,
  None)``, or ``(xs, shards)`` for :func:`_make_array` where a device
  keeps its old shard; ``None`` for an array in none of ``groups`` (a
  subset of :func:`_groups`'s, by default all of them).

  Group by group: cut, then stage by stage (see :func:`_group_programs`)
  send and glue, every intermediate let go as soon as the next step has it
  (a packed buffer once it is sent, the received ones once they are
  glued). Before a group is cut, the oldest groups still
  running are waited for until the groups in flight hold at most
  :func:`_flight_bytes`, so a call holds its results and up to twice that in
  packed copies, not three copies of the state (lm1b SMALL: cold peak RSS
  rise 3.6-3.9x -> 2.0-2.4x of the state, ``device_put`` 2.0x)."""
  if flight is None:
    flight = _flight_bytes(batch)
  if groups is None:
    groups = _groups(batch, flight)
  exes = _ensure_group_programs([k for k, _, _, _ in groups])
  made: list = [None] * len(batch)
  pending: list = []  # (glue outputs, bytes) of the groups in flight
  for g, ((_, _, dtype, _), moves, members, nbytes) in enumerate(groups):
    cut, glues, sizes = exes[g]
    runs = len(sizes)  # packed buffers per sub-block
    while pending and sum(b for _, b in pending) + nbytes > flight:
      jax.block_until_ready(pending.pop(0)[0])
    packed = [_shards_of(o) for o in cut(*[batch[n][1] for n in members])]
    order = _device_order(moves.flat_dst)
    stages = ([(c,) for c in range(runs)] if len(glues) == runs else
              [tuple(range(runs))])
    outs: list = []
    for glue, st in zip(glues, stages):
      sends, dests, where = [], [], []
      for dev, row in zip(moves.devices, moves.need):
        for src_id, j in row:
          if src_id != dev.id:
            for c in st:
              sends.append(packed[j * runs + c][src_id])
              dests.append(dev)
              where.append((dev.id, src_id, j * runs + c))
      moved = dict(zip(where, _send(sends, dests))) if sends else {}
      del sends
      blocks = {dev.id: [packed[j * runs + c][src_id] if src_id == dev.id
                         else moved[dev.id, src_id, j * runs + c]
                         for src_id, j in row for c in st]
                for dev, row in zip(moves.devices, moves.need)}
      for j in range(len(moves.cut_grid)):  # sent: each goes once copied
        for c in st:
          packed[j * runs + c] = None
      del moved
      ins = [_make_array((sizes[st[i % len(st)]] * len(order),), dtype,
                         moves.flat_dst, [blocks[d.id][i] for d in order],
                         list(order))
             for i in range(len(moves.glue_grid) * len(st))]
      del blocks
      outs.extend(glue(*ins))
      del ins  # the received buffers go once the glue is done
    del packed
    pending.append((outs, nbytes))
    for n, new in zip(members, outs):
      if made[n] is not None:  # padding: a repeat of an array done already
        continue
      prog, x, _ = batch[n]
      if not prog.reused:
        made[n] = (new, None)
        continue
      shards = _shards_of(x)
      new = _shards_of(new)
      made[n] = ([shards[a] if kind == "keep" else new[dev.id]
                  for dev, (kind, a) in zip(prog.devices, prog.outs)], shards)
  return made


def _every_box_stays(phys) -> bool:
  """Whether every target device already holds exactly its target box."""
  for name, leaf, s, _ in phys:
    if s is None:
      continue
    if s.memory_kind != leaf.sharding.memory_kind:  # e.g. device -> host
      return False
    dst = placement_of(s, leaf.shape, name)  # raises LayoutError naming it
    src = placement_of(leaf.sharding, leaf.shape, name)
    src_of, dst_of = src.box_of_device, dst.box_of_device
    for d, i in dst_of.items():
      j = src_of.get(d)
      if j is None or src.boxes[j] != dst.boxes[i]:
        return False
  return True


def _multi_target(items) -> set[int]:
  """Ids of arrays that appear under several paths with different targets:
  each path gets its own result, and such an array is never donated."""
  seen: dict[int, Sharding] = {}
  out: set[int] = set()
  for _, leaf, s in items:
    if s is not None:
      if seen.setdefault(id(leaf), s) != s:
        out.add(id(leaf))
  return out


def _keep_in_place(items, phys, rebuild, donate: bool, tr, t0: float,
                   t1: float, cached: bool) -> tuple[Any, ReshardReport]:
  """The no-move case: new arrays made of the old shards, nothing copied."""
  new_leaves, done = [], {}
  shared = _multi_target(items)
  reused = 0
  for (_, orig, target), (name, leaf, s, impl), devices in zip(
      items, phys, tr.progs):
    if s is None:
      new_leaves.append(orig)
      continue
    if (id(orig), target) in done:  # the same array, the same target
      new_leaves.append(done[id(orig), target])
      continue
    if leaf.sharding == s:  # already there: the array itself, as device_put
      reused += len(devices)
      done[id(orig), target] = orig
      new_leaves.append(orig)
      continue
    shards = _shards_of(leaf)
    try:
      new = _make_array(leaf.shape, leaf.dtype, s,
                        [shards[d.id] for d in devices], devices, kept=True)
    except Exception as e:
      raise ReshardError(f"{name}: resharding failed: {e}") from e
    if donate and id(orig) not in shared:
      # A key array shares its buffers with its key data (``leaf``).
      new = _donate_sources(new, shards, {d.id for d in devices},
                            leaf if impl is None else orig)
    if impl is not None:
      new = wrap_keys(new, impl, target)
    reused += len(devices)
    done[id(orig), target] = new
    new_leaves.append(new)
  t2 = time.perf_counter()
  report = ReshardReport(
      n_tensors=tr.n_tensors, state_bytes=tr.state_bytes, moved_bytes=0,
      lower_bound_bytes=0, local_bytes=tr.local_bytes,
      naive_bytes=tr.local_bytes, reused_shards=reused,
      method=tr.method if tr.method != "auto" else "kept",
      seconds={"layout": t2 - t0, "plan": 0.0, "transfer": 0.0,
               "total": t2 - t0}, copied_bytes=0, cached=cached)
  return rebuild(new_leaves), report


def _donate_sources(new: jax.Array, shards: dict, reused,
                    whole: jax.Array) -> jax.Array:
  """Deletes a donated array (its old shards ``{device id: single-device
  array}``, the array itself ``whole``) once ``new`` is built from them;
  returns ``new``, rebuilt where it shared buffers with the old array.

  The array is deleted as a whole, as jax's own donation leaves it: deleting
  only some of its shards left an array that jax's compiled-call fast path
  passed on with deleted buffers (a segfault on CPU, jax 0.10) where a
  jitted function that had run on it before was called on it again, and an
  array whose first shard lives is not even reported deleted.

  Where ``new`` keeps the old shards of the ``reused`` devices (the same
  buffers), those pass to ``new`` first: on CPU devices as zero-copy views
  of their memory (host memory, adopted without a copy; a view keeps the
  old buffer's memory alive after the old array is deleted, as the CPU
  executor's aliased boxes do). On other platforms a buffer cannot change
  hands, so an array whose shards the result keeps is left intact there:
  its other shards are freed when the caller drops it.
  """
  kept = [d for d in shards if d in reused]
  if kept:
    if any(next(iter(shards[d].devices())).platform != "cpu" for d in kept):
      return new
    new = _unshared(new, shards, set(kept))
  whole.delete()
  return new


def _unshared(new: jax.Array, shards: dict, kept: set) -> jax.Array:
  """``new`` with its shards on the ``kept`` devices (the old array's own
  CPU buffers) replaced by new buffers over the same memory."""
  arrays = []
  for d, a in _shards_of(new).items():
    if d in kept:
      a = jax.device_put(_host_view(shards[d]), next(iter(a.devices())),
                         may_alias=True)
    arrays.append(a)
  return jax.make_array_from_single_device_arrays(new.shape, new.sharding,
                                                  arrays)


_DONATE_BATCH_BYTES = 64 << 20


def _build_cpu(batch: list, phys: list, tr) -> tuple[dict, tuple]:
  """Builds the arrays ``batch`` (indices into ``phys``) on the CPU path:
  every copy of the batch in one threaded pass, then one call per array."""
  copies: list = []
  fresh: set = set()
  staged = []
  aliased = copied = 0
  for i in batch:
    name, leaf, _, _ = phys[i]
    prog = tr.progs[i]
    try:
      xs, shards, filled, nbytes = _run_cpu(prog, leaf, copies, fresh)
    except Exception as e:
      raise ReshardError(f"{name}: resharding failed: {e}") from e
    staged.append((i, xs, shards))
    aliased += sum(kind == "box" for kind, _ in prog.outs) - filled
    copied += nbytes
  try:
    _copy_all(copies, fresh)
  except Exception as e:
    raise ReshardError(f"resharding failed while copying: {e}") from e
  del copies  # drop the source views before any source is donated
  return _make_arrays(staged, phys, tr, cpu=True), (aliased, copied)


def _make_arrays(staged, phys: list, tr, cpu: bool = False) -> dict:
  """``{i: (new array, its source shards)}`` for each ``(i, new shard
  buffers, source shards)`` in ``staged``; a failure names its leaf.
  ``cpu``: staged by :func:`_run_cpu` (an array whose devices all keep
  their shards is made of those shards directly)."""
  made = {}
  for i, xs, shards in staged:
    name, leaf, s, _ = phys[i]
    if isinstance(xs, jax.Array):  # built whole (see _run_generic_packed)
      made[i] = (xs, shards)
      continue
    prog = tr.progs[i]
    try:
      made[i] = (_make_array(leaf.shape, leaf.dtype, s, xs, prog.devices,
                             kept=cpu and not prog.boxes), shards)
    except Exception as e:
      raise ReshardError(f"{name}: resharding failed: {e}") from e
  return made


# Dtypes that XLA (jaxlib 0.10, CPU) cannot compile a slice or a
# concatenation of: its code generator aborts the process (``ir_array.cc:
# Check failed: bit_offset != nullptr``), and ``jax.device_put`` between
# shardings returned wrong shards and corrupted the C heap. The generic
# executor assembles their new shards on the host, piece by piece from host
# copies of the old ones (the CPU executor's copies; on CPU devices, views),
# and transfers each to its device.
_NOT_COMPILED = frozenset({"int2", "uint2"})


def _build_generic(batch: list, phys: list, tr) -> tuple[dict, int]:
  """Builds the arrays ``batch`` on the generic path: arrays between plain
  NamedShardings by class (see _run_generic_packed), the rest per device (see
  _run_generic). Returns the arrays and how many went through the host.

  The host tier: an array whose device programs are not compiled yet is
  built as the CPU executor builds it, by the CPU executor's programs
  (``tr.progs``, planned by class): its source shards read on the host (on
  accelerators one copy each), its new boxes assembled there and put on
  their devices (``jax.device_put``'s own path between device sets). A
  transition's first call builds every array so and plans no device
  program (a one-off resize compiles nothing); a later call plans them
  (see _Transition.device_programs), runs those already compiled and
  queues the others for the background thread (see _queue_recompile).
  Once all of a batch's programs are in, the next call runs them, timed
  (its results waited for), and later calls take the faster of the two
  tiers as last measured (see ``_Transition.tiers``): on accelerators
  presumably the device programs, which never leave device memory. On CPU
  devices (see _HOST_ONLY) the host tier is never slower and nothing is
  planned or compiled for it. ``TENPLEX_JAX_GENERIC_COLD=compile``: the
  programs compiled in the call instead, and run."""
  host_tier = _generic_cold() == "host"
  spmd, rest, direct = [], [], []
  times = tr.tiers.get(tuple(batch))
  if host_tier and (times is None or all(
      _platforms(phys[i][1].sharding) | _platforms(phys[i][2]) <= _HOST_ONLY
      for i in batch)):
    # A transition's first call (a one-off resize compiles and plans no
    # device program), and every call on CPU devices (see _HOST_ONLY).
    direct = list(batch)
  else:
    for i in batch:
      leaf, s = phys[i][1], phys[i][2]
      (direct if np.dtype(leaf.dtype).name in _NOT_COMPILED else
       spmd if _packed_eligible(leaf, s) else rest).append(i)
  # A class of fewer than _PACK_MIN arrays packs nothing, yet compiles a
  # cut and a glue of its own: such arrays go to the per-device executor,
  # whose two programs per device take every one of them.
  key = {i: _class_key(phys[i][1], phys[i][2]) for i in spmd}
  classes = collections.Counter(key.values())
  rest += [i for i in spmd if classes[key[i]] < _PACK_MIN]
  spmd = [i for i in spmd if classes[key[i]] >= _PACK_MIN]
  t0 = time.perf_counter()
  try:
    out = {}
    packed = rest_items = None
    ready = True  # every program compiled
    dprogs = tr.device_programs(phys) if spmd or rest else None
    if spmd:
      packed = [(dprogs[i], phys[i][1], phys[i][2]) for i in spmd]
      flight = _flight_bytes(packed)
      groups = _groups(packed, flight)
      if host_tier:
        n = len(groups)
        groups = _compiled_groups(groups)
        ready = len(groups) == n
    if rest:
      rest_items = [(dprogs[i], phys[i][1]) for i in rest]
      if host_tier and not _programs_ready(_cached_schedule(rest_items).jobs):
        ready = False
        direct += rest
        rest_items = None
    # Every program compiled: the faster tier as measured on this batch
    # (see _Transition.tiers); the device programs are timed once first.
    if times is None:
      times = tr.tiers.setdefault(tuple(batch), [None, None])
    measure = None
    if host_tier and ready and (spmd or rest):
      if times[1] is None:
        measure = 1
      elif times[0] is not None and times[0] < times[1]:
        direct += spmd + rest
        packed = rest_items = None
    if packed is not None:
      for i, m in zip(spmd, _run_generic_packed(packed, flight, groups)):
        if m is None:
          direct.append(i)
        else:
          out[i] = m
      del packed
    if rest_items is not None:
      out.update(zip(rest, _run_generic(rest_items)))
      del rest_items
    if len(direct) == len(batch):
      measure = 0
    if direct:  # assembled on the host, as the CPU executor does
      for i in direct:
        _prefetch_to_host(tr.progs[i], phys[i][1])
      copies: list = []
      fresh: set = set()
      for i in direct:
        out[i] = _run_cpu(tr.progs[i], phys[i][1], copies, fresh)[:2]
      _copy_all(copies, fresh)
      del copies
  except Exception as e:
    names = [phys[i][0] for i in batch]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    raise ReshardError(f"resharding {', '.join(names[:3])}{more} failed:"
                       f" {e}") from e
  made = _make_arrays(((i, *out[i]) for i in batch), phys, tr)
  if measure is not None:
    if measure:
      jax.block_until_ready([m[0] for m in made.values()])
    times[measure] = time.perf_counter() - t0
  return made, len(direct)


def _prefetch_to_host(prog: _LeafProgram, x: jax.Array) -> None:
  """Starts the host copies of the source shards ``prog`` reads, where they
  are not in host memory already (all at once, before any is waited for)."""
  if "cpu" in _platforms(x.sharding):  # host memory: nothing to copy
    return
  shards = _shards_of(x)
  for src in {p[0] for _, pieces in prog.boxes for p in pieces}:
    shards[src].copy_to_host_async()


# -- transitions by class: one program per (old sharding, new sharding, rank) --


def _dim_parts(s: NamedSharding, ndim: int) -> tuple[int, ...] | None:
  """How many chunks a plain ``NamedSharding`` cuts each dimension into;
  ``None`` for anything else (the caller takes the general path)."""
  spec = s.spec
  if len(spec) > ndim:
    return None
  sizes = s.mesh.shape
  out = []
  for e in spec:
    if e is None:
      out.append(1)
      continue
    axes = (e,) if isinstance(e, str) else e
    if not isinstance(axes, tuple) or not all(
        isinstance(a, str) and a in sizes for a in axes):
      return None
    out.append(math.prod(sizes[a] for a in axes))
  return tuple(out) + (1,) * (ndim - len(spec))


class _UnitClass(_Record):
  """The move of every array of one rank between two plain NamedShardings.

  Such a sharding cuts dimension ``d`` into equal chunks, so the boxes of an
  array of shape ``n`` are those of an array of shape ``units`` (per
  dimension, the least common multiple of the old and the new number of
  chunks) scaled by ``n[d] // units[d]``. The class is planned once, in
  units, for every array it covers whatever its shape: the random
  transitions of ``benchmarks/bench_transitions.py`` have 1,657 arrays of
  1,334 distinct (shape, dtype, shardings) but 94 classes.

  Attributes:
    units: the array shape the class is planned at.
    prog: the CPU executor's :class:`_LeafProgram` at that shape.
    kept: every device of the new sharding already holds its box.
    local, lower: elements (at ``units``) that the new devices already
      hold / do not hold, summed over the new devices.
    table: per piece of ``prog`` (in order), its starts and limits in the
      source shard and in the new box, ``(pieces, 4, rank)``.
    box_units: per new box of ``prog``, its shape, ``(boxes, rank)``.
  """

  __slots__ = ("units", "prog", "kept", "local", "lower", "table",
               "box_units")


@functools.lru_cache(maxsize=4096)
def _unit_class(src: Sharding, dst: Sharding, ndim: int) -> _UnitClass | None:
  """The class of arrays of rank ``ndim`` moving from ``src`` to ``dst``
  (both fully addressable plain NamedShardings), or ``None``."""
  if (type(src) is not NamedSharding or type(dst) is not NamedSharding
      or not src.is_fully_addressable or not dst.is_fully_addressable):
    return None
  p, q = _dim_parts(src, ndim), _dim_parts(dst, ndim)
  if p is None or q is None:
    return None
  units = tuple(math.lcm(a, b) for a, b in zip(p, q))
  sp = placement_by_arithmetic(src, units)
  dp = placement_by_arithmetic(dst, units)
  if sp is None or dp is None:
    return None
  process_of = {d.id: d.process_index for d in (*src.device_set,
                                                 *dst.device_set)}
  tpl = plan_template(units, 1, sp, dp, process_of, "?")
  prog = _leaf_program("?", tpl, 0, sp, dp, dst, _addressable_ids(src),
                       cpu=True)
  src_of = sp.box_of_device
  kept, local, lower = True, 0, 0
  for box, devs in zip(dp.boxes, dp.holders):
    vol = box_volume(box)
    for d in devs:
      j = src_of.get(d)
      common = None if j is None else intersect(box, sp.boxes[j])
      held = 0 if common is None else box_volume(common)
      kept = kept and j is not None and sp.boxes[j] == box
      local += held
      lower += vol - held
  rows = [(ss, sl, ds, tuple(d + b - a for d, a, b in zip(ds, ss, sl)))
          for _, pieces in prog.boxes for _, _, _, (ss, sl), ds in pieces]
  ndim = len(units)
  table = np.array(rows, dtype=np.int64).reshape(len(rows), 4, ndim)
  box_units = np.array([shape for shape, _ in prog.boxes],
                       dtype=np.int64).reshape(len(prog.boxes), ndim)
  return _UnitClass(units, prog, kept, local, lower, table, box_units)


def _scale(c: _UnitClass, u: tuple[int, ...]) -> _LeafProgram:
  """The CPU program of an array in class ``c``, ``u[d]`` times larger than
  the class's units along dimension ``d``: every index scaled at once.

  Its pieces carry no ``(starts, limits)`` (only the CPU executor runs it).
  """
  prog = c.prog
  if not prog.boxes or not any(k != 1 for k in u):
    return prog
  uu = np.asarray(u, dtype=np.int64)
  rows = (c.table * uu).tolist()
  shapes = (c.box_units * uu).tolist()
  boxes = []
  r = 0
  for (_, pieces), shape in zip(prog.boxes, shapes):
    out = []
    for piece in pieces:
      ss, sl, ds, dl = rows[r]
      r += 1
      out.append((piece[0], (*map(slice, ss, sl), ...),
                  (*map(slice, ds, dl), ...), None, None))
    boxes.append((tuple(shape), tuple(out)))
  return _LeafProgram(prog.devices, prog.outs, tuple(boxes), prog.reused,
                      prog.alias)


def _class_of(leaf: jax.Array, s: Sharding):
  """``(class, scale)`` of an array moving to ``s``, or ``None`` (then the
  general path plans it, and raises the errors that name it)."""
  shape = leaf.shape
  c = _unit_class(leaf.sharding, s, len(shape))
  if c is None:
    return None
  u = []
  for n, k in zip(shape, c.units):
    if n <= 0 or n % k:
      return None
    u.append(n // k)
  return c, tuple(u)


@functools.lru_cache(maxsize=4096)
def _platforms(s: Sharding) -> frozenset:
  return frozenset(d.platform for d in s.device_set)


def _sds(phys: list, src: bool) -> dict:
  return {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                     sharding=leaf.sharding if src else s)
          for name, leaf, s, _ in phys if s is not None}


@dataclasses.dataclass
class _Transition:
  """Everything a reshard between two layouts needs besides the data.

  Built on the first reshard of a (source layouts, target shardings) pair
  and reused by the next ones: per-array programs and the report's figures.
  On the CPU path, arrays between plain NamedShardings are planned by class
  (see :class:`_UnitClass`), the rest through layouts and :func:`plan`; the
  whole state's :class:`Plan` is then built only when a report's ``plan`` is
  read.

  Attributes:
    kept: every target device already holds its box (nothing moves).
    method: the executor, ``cpu`` or ``generic`` (``auto`` if kept).
    progs: per item, its :class:`_LeafProgram` (on the kept path, the
      target's addressable devices; ``None`` for non-arrays); for the
      generic executor's host tier, the CPU executor's programs.
    plan_seconds: time the planning took.
    n_tensors, state_bytes, moved_bytes, lower_bound_bytes, local_bytes:
      the report's figures (on the kept path, ``local_bytes`` is all of it).
    sig: per item, ``(path, shape, dtype, sharding, target)`` (``(path,)``
      for a non-array): what the whole state's plan is built from when it
      is first asked for; ``None`` once ``plan`` is set.
    tiers: the generic executor's host tier (see :func:`_build_generic`):
      per batch, ``[seconds through the host, seconds on the devices]``
      the last time each built all of it (``None``: not yet). Once every
      program is compiled, the device programs are timed once (their
      results waited for); then the faster tier builds the batch, the
      host's timed again on each call it builds.
    device: the generic executor's device programs, per item (``progs``
      where they are those; with the host tier, planned on first use by
      :meth:`device_programs`).
  """

  kept: bool
  method: str
  progs: list
  plan_seconds: float = 0.0
  n_tensors: int = 0
  state_bytes: int = 0
  moved_bytes: int = 0
  lower_bound_bytes: int = 0
  local_bytes: int = 0
  plan: Plan | None = None
  sig: tuple | None = dataclasses.field(default=None, repr=False)
  tiers: dict = dataclasses.field(default_factory=dict, repr=False)
  device: list | None = dataclasses.field(default=None, repr=False)

  def full_plan(self) -> Plan | None:
    """The plan of the whole state (built on first use, then kept)."""
    if self.plan is None and not self.kept and self.sig is not None:
      src, dst = {}, {}
      for item in self.sig:
        if len(item) > 1:
          name, shape, dtype, s_src, s_dst = item
          src[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=s_src)
          dst[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=s_dst)
      self.plan = plan(PTC.from_tree(src), PTC.from_tree(dst))
      self.sig = None
    return self.plan

  def device_programs(self, phys: list) -> list:
    """The generic executor's per-array programs (see ``device``)."""
    if self.device is None:
      progs = _plan_programs(phys, "generic", [None] * len(phys))[0]
      with _transitions_lock:
        if self.device is None:
          self.device = progs
    return self.device

  @classmethod
  def build(cls, phys: list, method: str, sig: tuple) -> "_Transition":
    t0 = time.perf_counter()
    resolved = method
    if method == "auto":
      platforms = set()
      for _, leaf, s, _ in phys:
        if s is not None:
          platforms |= _platforms(leaf.sharding) | _platforms(s)
      resolved = "cpu" if platforms <= {"cpu"} else "generic"
    # The generic executor's host tier runs the CPU executor's programs
    # (planned by class; see _build_generic); its device programs are
    # planned when first needed.
    host = resolved == "cpu" or (resolved == "generic"
                                 and _generic_cold() == "host")
    arrays = [p for p in phys if p[2] is not None]
    classes: list = [None] * len(phys)
    if host and len({p[0] for p in arrays}) == len(arrays):
      classes = [None if s is None else _class_of(leaf, s)
                 for _, leaf, s, _ in phys]
    slow = [p if c is None else (p[0], p[1], None, p[3])
            for p, c in zip(phys, classes)]
    n = state_bytes = 0
    for _, leaf, _, _ in arrays:
      n += 1
      state_bytes += leaf.size * leaf.dtype.itemsize
    if (all(c is None or c[0].kept for c in classes)
        and _every_box_stays(slow)):
      kept_bytes = 0
      progs = []
      for (name, leaf, s, _), c in zip(phys, classes):
        if s is None:
          progs.append(None)
          continue
        progs.append(_device_order(s))
        if c is not None:
          kept_bytes += (c[0].local * math.prod(c[1])
                         * leaf.dtype.itemsize)
          continue
        dst = placement_of(s, leaf.shape, name)
        kept_bytes += sum(len(h) * box_volume(b) for b, h
                          in zip(dst.boxes, dst.holders)) * leaf.dtype.itemsize
      return cls(True, method, progs, n_tensors=n, state_bytes=state_bytes,
                 local_bytes=kept_bytes)
    progs, moved, local, the_plan = _plan_programs(
        phys, "cpu" if host else "generic", classes)
    return cls(False, resolved, progs, plan_seconds=time.perf_counter() - t0,
               n_tensors=n, state_bytes=state_bytes, moved_bytes=moved,
               lower_bound_bytes=moved, local_bytes=local, plan=the_plan,
               sig=None if the_plan is not None else sig,
               device=None if host else progs)


def _plan_programs(phys: list, kind: str, classes: list) -> tuple:
  """``(programs, moved bytes, local bytes, plan or None)`` of the arrays
  of ``phys``: per item, its :class:`_LeafProgram` for the CPU executor's
  code (``kind`` ``cpu``: the CPU executor and the generic one's host tier)
  or the generic executor's device programs (``generic``); arrays with a
  class (see :func:`_class_of`) scaled from it, the others planned."""
  n = sum(p[2] is not None for p in phys)
  slow = [p if c is None else (p[0], p[1], None, p[3])
          for p, c in zip(phys, classes)]
  moved = local = 0
  progs: list = [None] * len(phys)
  scaled: dict = {}
  for i, ((_, leaf, _, _), c) in enumerate(zip(phys, classes)):
    if c is not None:
      k = math.prod(c[1]) * leaf.dtype.itemsize
      moved += c[0].lower * k
      local += c[0].local * k
      k = (c[0], c[1])  # arrays of one signature share one program
      if k not in scaled:
        scaled[k] = _scale(*k)
      progs[i] = scaled[k]
  the_plan = None
  if any(p[2] is not None for p in slow):
    src_ptc = PTC.from_tree(_sds(slow, True))
    dst_ptc = PTC.from_tree(_sds(slow, False))
    sub = plan(src_ptc, dst_ptc)
    moved += sub.moved_bytes
    local += sub.local_bytes
    if len(src_ptc) == n:
      the_plan = sub
    memo = {}
    for i, (name, leaf, s, _) in enumerate(slow):
      if s is None:
        continue
      tpl, rot = sub.template(name)
      # Where the CPU executor's code reads the shards any replica is as
      # near as another: arrays of one template share one program whatever
      # their replica rotation.
      k = (id(tpl), rot if kind == "generic" else 0, leaf.sharding, s)
      if k not in memo:
        memo[k] = _leaf_program(
            name, tpl, k[1], src_ptc[name].placement,
            dst_ptc[name].placement, s, _addressable_ids(leaf.sharding),
            cpu=kind == "cpu")
      progs[i] = memo[k]
  return progs, moved, local, the_plan


_TRANSITIONS: collections.OrderedDict = collections.OrderedDict()
_TRANSITIONS_MAX = 32
_transitions_lock = threading.Lock()


def _cached_transition(key) -> _Transition | None:
  with _transitions_lock:
    tr = _TRANSITIONS.get(key)
    if tr is not None:
      _TRANSITIONS.move_to_end(key)
    return tr


def _remember_transition(key, tr: _Transition) -> None:
  with _transitions_lock:
    _TRANSITIONS[key] = tr
    while len(_TRANSITIONS) > _TRANSITIONS_MAX:
      _TRANSITIONS.popitem(last=False)


def _gc_paused(fn: Callable) -> Callable:
  """Runs ``fn`` with Python's cycle collector paused (then restored).

  A reshard creates a few Python objects per shard and per piece, all freed
  by reference counting; left on, the collector walks every live object
  (jax's included) many times on a large state: a third of a cold
  1,907-array reshard on the benchmark VM.

  First it hands jax the Python references that device buffers freed since
  the last call still hold (see :func:`collect_dropped_buffers`), so that
  the host buffers of a dropped result are reused, not faulted in anew.
  """
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    was = gc.isenabled()
    gc.disable()
    collect_dropped_buffers()
    try:
      return fn(*args, **kwargs)
    finally:
      if was:
        gc.enable()
  return wrapper


@_gc_paused
def reshard_with_report(tree: Any, target: Any, *, donate: bool = False,
                        method: str = "auto") -> tuple[Any, ReshardReport]:
  """Like :func:`reshard`, and also returns a :class:`ReshardReport`."""
  t0 = time.perf_counter()
  items, rebuild = resolve_targets(tree, target)
  return reshard_items(items, rebuild, donate=donate, method=method, t0=t0)


def _to_memory_kind(x: jax.Array, kind: str) -> jax.Array:
  """``x`` copied into memory ``kind`` of its devices, the layout unchanged.

  A typed key array moves as its key data: the sharding jax gives a key
  array wrapped from data sharded ``P(None)`` keeps that spec, one entry
  too many for its rank, and ``jax.device_put`` refuses it as a target.
  """
  if _is_key(x):
    data = jax.random.key_data(x)
    return jax.random.wrap_key_data(
        jax.device_put(data, data.sharding.with_memory_kind(kind)),
        impl=jax.random.key_impl(x))
  return jax.device_put(x, x.sharding.with_memory_kind(kind))


@_gc_paused
def reshard_items(items: list, rebuild: Callable, *, donate: bool = False,
                  method: str = "auto", t0: float | None = None
                  ) -> tuple[Any, ReshardReport]:
  """Reshards ``(path, leaf, sharding or None)`` items; see :func:`reshard`.

  ``rebuild(new_leaves)`` restores the caller's structure.
  """
  t0 = time.perf_counter() if t0 is None else t0
  # Memory kinds other than the devices' default (e.g. pinned_host): the
  # pieces move between devices in the default memory; a source elsewhere
  # is first put there (once per array, however many paths hold it), and
  # each new array is put into its target's memory kind last. Both are
  # transfers on one device, the layout unchanged. A source already on its
  # target is returned as it is; with ``donate`` the others are deleted
  # once every result is built, except an array that is also another
  # path's source with another target (never donated, see _multi_target).
  final_kind: dict[int, Sharding] = {}
  adjusted = []
  moved_of: dict[int, jax.Array] = {}
  never = _multi_target(items) if donate else set()
  host_sources: dict[int, jax.Array] = {}
  for i, (name, leaf, s) in enumerate(items):
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      # Also where it is on its target already: never hand it back as if
      # it held values.
      raise ReshardError(
          f"{name}: the array {leaf.dtype.name}{list(leaf.shape)} has been "
          "deleted (donated to an earlier call?): nothing to reshard")
    if s is not None and isinstance(leaf, jax.Array):
      dflt = default_memory_kind(leaf.sharding)
      if (leaf.sharding.memory_kind or dflt) != dflt:
        if leaf.sharding == s:  # already there: the array itself
          adjusted.append((name, leaf, None))
          continue
        moved = moved_of.get(id(leaf))
        if moved is None:
          moved = moved_of[id(leaf)] = _to_memory_kind(leaf, dflt)
          if donate and id(leaf) not in never:
            host_sources[id(leaf)] = leaf
        leaf = moved
      if (s.memory_kind or dflt) != dflt:
        final_kind[i] = s
        s = s.with_memory_kind(dflt)
    adjusted.append((name, leaf, s))
  with _Resharding():
    out = _reshard_default_memory(adjusted, rebuild, final_kind, donate,
                                  method, t0)
  for leaf in host_sources.values():  # donated host sources, once built
    leaf.delete()
  return out


def _reshard_default_memory(items: list, rebuild: Callable, final_kind: dict,
                            donate: bool, method: str, t0: float
                            ) -> tuple[Any, ReshardReport]:
  """:func:`reshard_items` once every source and target is in its devices'
  default memory (``final_kind``: the target, by item index, of a result
  to put into another memory kind last)."""
  if final_kind:
    inner_rebuild = rebuild

    def rebuild(leaves):
      return inner_rebuild([
          jax.device_put(x, final_kind[i]) if i in final_kind else x
          for i, x in enumerate(leaves)])
  # Physical view: PRNG keys travel as their uint32 key data.
  phys = []
  for name, leaf, s in items:
    if s is None:
      phys.append((name, leaf, None, None))
      continue
    if _is_key(leaf):
      extra = jax.random.key_data(leaf).ndim - leaf.ndim
      s_data = key_data_sharding(s, leaf.ndim, extra)
      phys.append((name, jax.random.key_data(leaf), s_data,
                   jax.random.key_impl(leaf)))
    else:
      phys.append((name, leaf, s, None))
  if method not in ("auto", "cpu", "generic"):
    raise ValueError(f"method must be 'auto', 'cpu' or 'generic', not"
                     f" {method!r}")
  # (the generic executor plans for its host tier or not: see _Transition)
  key = (method, None if method == "cpu" else _generic_cold(),
         tuple((name,) if s is None else
               (name, leaf.shape, leaf.dtype, leaf.sharding, s)
               for name, leaf, s, _ in phys))
  tr = _cached_transition(key)
  cached = tr is not None
  if tr is None:
    tr = _Transition.build(phys, method, key[2])
    _remember_transition(key, tr)
  t1 = time.perf_counter()
  if tr.kept:
    return _keep_in_place(items, phys, rebuild, donate, tr, t0, t1, cached)
  # The arrays to build (an array twice in the tree with the same target is
  # built once; with two targets, twice, and never donated), in batches:
  # one batch, or with ``donate`` batches of about _DONATE_BATCH_BYTES, each
  # batch's sources freed once it is built.
  shared = _multi_target(items)
  order, first = [], {}
  built: dict[int, Any] = {}
  reused = 0
  for i, ((_, orig, target), (_, leaf, s, _)) in enumerate(zip(items, phys)):
    if s is not None and (id(orig), target) not in first:
      first[id(orig), target] = i
      if leaf.sharding == s:  # already there: the array itself
        built[i] = orig
        reused += len(tr.progs[i].devices)
      else:
        order.append(i)
  batches, cur, cur_bytes = [], [], 0
  for i in order:
    cur.append(i)
    cur_bytes += phys[i][1].nbytes
    if donate and cur_bytes >= _DONATE_BATCH_BYTES:
      batches.append(cur)
      cur, cur_bytes = [], 0
  if cur:
    batches.append(cur)
  aliased = host_staged = 0
  copied: int | None = 0 if tr.method == "cpu" else None
  for batch in batches:
    if tr.method == "cpu":
      made, counts = _build_cpu(batch, phys, tr)
      aliased += counts[0]
      copied += counts[1]
    else:
      made, n = _build_generic(batch, phys, tr)
      host_staged += n
    for i in batch:
      name, leaf, s, impl = phys[i]
      new, shards = made[i]
      # Built whole (shards None): no old shard is part of it.
      kept = tr.progs[i].reused if shards is not None else ()
      reused += len(kept)
      if donate and id(items[i][1]) not in shared:
        # A key array shares its buffers with its key data: the key array
        # is what is deleted (whole; kept shards pass to ``new`` first).
        new = _donate_sources(
            new, _shards_of(leaf) if shards is None else shards, kept,
            leaf if impl is None else items[i][1])
      if impl is not None:
        new = wrap_keys(new, impl, items[i][2])
      built[i] = new
  new_leaves = [orig if s is None else built[first[id(orig), target]]
                for (_, orig, target), (_, _, s, _) in zip(items, phys)]
  t2 = time.perf_counter()
  report = ReshardReport(
      n_tensors=tr.n_tensors, state_bytes=tr.state_bytes,
      moved_bytes=tr.moved_bytes, lower_bound_bytes=tr.lower_bound_bytes,
      local_bytes=tr.local_bytes,
      naive_bytes=tr.moved_bytes + tr.local_bytes,
      reused_shards=reused, method=tr.method,
      seconds={"layout": (t1 - t0) - (0 if cached else tr.plan_seconds),
               "plan": 0.0 if cached else tr.plan_seconds,
               "transfer": t2 - t1, "total": t2 - t0},
      aliased_shards=aliased, copied_bytes=copied, host_staged=host_staged,
      _plan=tr.plan if tr.plan is not None else tr.full_plan,
      cached=cached)
  return rebuild(new_leaves), report


def reshard(tree: Any, target: Any, *, donate: bool = False,
            method: str = "auto") -> Any:
  """Moves every array of ``tree`` onto its target sharding.

  Values are bitwise equal and each new array's sharding is the target. Only
  pieces a device does not already hold move; a shard whose device keeps its
  box is reused without a copy. Every dtype works, ``bfloat16``, float8,
  ``int4``, ``bool``, 0-d and zero-size arrays and typed PRNG key arrays
  (``jax.random.key``) included.

  Args:
    tree: any pytree; its ``jax.Array`` leaves are resharded, other leaves
      pass through.
    target: a sharding tree as ``jax.device_put`` takes it: one target for
      every array, or a pytree that is a prefix of ``tree`` (e.g. Flax's
      ``nn.logical_to_mesh_sharding(nn.get_partition_spec(state), mesh,
      rules)``, one sharding per box; Flax boxes are transparent on both
      sides), ``None`` at non-array leaves. Targets are ``Sharding``,
      ``PartitionSpec`` (on the mesh set with ``jax.set_mesh``),
      ``jax.Device`` or ``ShapeDtypeStruct`` carrying a sharding. Each
      leaf gets its own target, also an array that appears under two paths.
      Or a :class:`PTC` (arrays matched by key path; its tensors must carry
      sharding descriptions, as ``PTC.from_tree`` records).
    donate: free each source array once its new version is built, so peak
      memory stays near one copy of the state plus one array. A failure
      then leaves the arrays already converted freed in the source tree;
      without ``donate`` a failure never touches the source. A donated
      array is deleted whole, also where the result keeps some of its
      shards (on CPU devices their memory passes to the result; on other
      platforms such an array is left intact, see ``docs/core.md``).
    method: ``"auto"`` (the CPU fast path when every device is a CPU, else
      generic), ``"cpu"`` or ``"generic"``. The generic path compiles
      nothing in a cold call: arrays whose device programs are not compiled
      yet go through the host (``jax.device_put``'s own path between device
      sets); a transition that repeats has its programs compiled in the
      background and then takes the faster of the two as measured (on CPU
      devices always the host, which compiles nothing;
      ``TENPLEX_JAX_GENERIC_COLD=compile`` compiles in the call instead).

  Returns:
    The tree with the same structure (boxes kept), every array on its
    target sharding.
    On CPU devices (which share the process's memory) the devices holding
    the same box share one read-only buffer, and a box that an old shard
    held exactly shares that shard's buffer; resharding the same source
    arrays again, while the earlier result (or part of it) lives, shares
    that result's buffers instead of copying, and once that result was
    dropped takes its idle buffers back from the host pool, bytes and all,
    where nothing took them since; see ``docs/core.md``.

  Raises:
    LayoutError: the target does not match the tree (structure, shapes,
      dtypes, shardings that do not fit); nothing has moved yet.
    ReshardError: a piece is not addressable from this process, or a device
      transfer failed; the source state is intact unless ``donate``.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:4])
    >>> a = Mesh(devs.reshape(2, 2), ("data", "tensor"))
    >>> b = Mesh(devs.reshape(1, 4), ("data", "tensor"))
    >>> x = jax.device_put(np.arange(32.0).reshape(4, 8),
    ...                    NamedSharding(a, P(None, "tensor")))
    >>> y = reshard({"w": x}, {"w": NamedSharding(b, P(None, "tensor"))})["w"]
    >>> bool((np.asarray(y) == np.asarray(x)).all()), y.sharding.spec
    (True, P(None, 'tensor'))
  """
  return reshard_with_report(tree, target, donate=donate, method=method)[0]
