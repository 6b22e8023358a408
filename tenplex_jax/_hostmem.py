"""Host buffers for new CPU-device shards: aligned, recycled.

A CPU device's buffer is host memory, so the CPU executor of
:func:`tenplex_jax.reshard` fills a host buffer and hands it to the device
without a copy (``jax.device_put(buf, dev, may_alias=True)``, which XLA's CPU
client honours for 64-byte aligned buffers). Writing into freshly mapped
memory costs a page fault per page, which on virtual machines costs as much
as the copy itself, so large buffers are

* mapped anonymously (sizes rounded up to 4 KiB), with 4 KiB pages unless
  ``TENPLEX_JAX_HUGEPAGES=1`` advises ``MADV_HUGEPAGE``. On the benchmark VMs
  (Firecracker guests with free page reporting) a first touch of huge pages
  costs either 4x less than of small ones (0.2 against 0.5-1.1 s/GiB) or
  2-3x more, by process, as the kernel hands out 2 MiB blocks that the host
  has or has not taken back; small pages cost the same every time;
* mapped only from 32 MiB up: from 16 KiB to 32 MiB they come from the C
  heap (``malloc``, without the huge-page advice numpy's allocator gives),
  which serves them from memory the process freed and that is still
  resident where it can, so that they cost no page faults at all, as XLA's
  own allocations (``jax.device_put``'s) do; under 16 KiB from numpy;
* populated in one system call when the caller writes every byte next
  (``host_empty(..., populate=True)``: a restore's new shards), instead of
  a fault per 4 KiB page (the restore core's CPU rose by about a quarter
  when its buffers came from the C heap, faulted page by page, instead of
  ``MAP_POPULATE`` mappings): a heap block's pages that are not resident
  yet with ``MADV_POPULATE_WRITE`` (Linux 5.14+; memory the heap reuses is
  resident already, so the peak stays that of the heap), a mapping with
  ``MAP_POPULATE``;
* recycled from 16 KiB up: when jax frees a device buffer built on one, the
  block (pages already faulted in) goes back to a free list that the next
  reshard reuses (:func:`collect_dropped_buffers` makes jax let go of it
  before that reshard allocates). Small shards need it as much as large
  ones: freed to ``malloc``, a dropped result's 128 KiB shards were partly
  trimmed back to the kernel and faulted in again by every call (1,000
  pages a call for a 34 MiB state),
  up to a cap (``TENPLEX_JAX_HOST_POOL_GIB``, default 4 GiB of idle memory;
  ``0`` turns recycling off). :func:`release_host_pool` frees idle buffers;
* taken back with their bytes: an idle block keeps what its last taker
  wrote until it is handed out again, so a caller that knows that take (a
  reshard of the same, immutable, source arrays after its result was
  dropped) gets the block back without copying (:func:`host_reclaim`).

Buffers handed out are uninitialised; the caller overwrites every byte.
``tenplex_jax.store.restore`` takes its destination buffers from here too.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import math
import mmap
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["collect_dropped_buffers", "host_empty", "host_empty_leased",
           "host_pool_stats", "host_reclaim", "populate", "populate_range",
           "release_host_pool"]

_ALIGN = 64  # XLA's CPU client aliases host buffers aligned to 64 bytes.
_PAGE = mmap.PAGESIZE  # mappings are rounded up to whole (small) pages
_MIN_POOLED = 16 << 10  # smaller buffers come from numpy's allocator
_MIN_MAPPED = 32 << 20  # glibc's largest threshold for serving from its heap
_MIN_POPULATED = 1 << 20  # host_empty(populate=True) populates from here
_HUGE = os.environ.get("TENPLEX_JAX_HUGEPAGES", "0") == "1"


_cap_parsed: tuple = (None, 0)  # (the variable's text, its bytes)


def _cap_bytes() -> int:
  # Called per buffer (720 times in a warm call of a 105-array state):
  # parsed only when the variable's text changes.
  v = os.environ.get("TENPLEX_JAX_HOST_POOL_GIB", "4")
  global _cap_parsed
  if _cap_parsed[0] == v:
    return _cap_parsed[1]
  try:
    gib = float(v)
  except ValueError as e:
    raise ValueError(f"TENPLEX_JAX_HOST_POOL_GIB must be a number of GiB,"
                     f" not {v!r}") from e
  _cap_parsed = (v, max(0, int(gib * (1 << 30))))
  return _cap_parsed[1]


try:
  _libc = ctypes.CDLL(None)
  _libc.malloc.restype = ctypes.c_void_p
  _libc.malloc.argtypes = [ctypes.c_size_t]
  _libc.free.restype = None
  _libc.free.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError):  # pragma: no cover - no C heap to call
  _libc = None

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
try:
  _madvise = _libc.madvise
  _madvise.restype = ctypes.c_int
  _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except AttributeError:  # pragma: no cover - no madvise to call
  _madvise = None


def populate_range(start: int, size: int) -> None:
  """Faults in the whole pages of ``[start, start + size)`` that are not
  resident yet, in one system call (``MADV_POPULATE_WRITE``); nothing where
  the kernel has no such advice. Releases the GIL (a ``ctypes`` call).

  Pages partly outside the range are left alone, so threads that populate
  neighbouring ranges never fault in each other's pages."""
  lo = -(-start // _PAGE) * _PAGE
  hi = (start + size) // _PAGE * _PAGE
  if hi > lo and _madvise is not None:
    _madvise(lo, hi - lo, _MADV_POPULATE_WRITE)


def populate(buf: np.ndarray) -> None:
  """Makes the pages of ``buf`` (a :func:`host_empty` array the caller
  writes whole next) resident in one system call instead of a page fault
  per 4 KiB page; pages already resident (a recycled block) cost nothing.

  ``host_empty(..., populate=True)`` does the same when it allocates; a
  caller that has something to start first (a restore from a bucket starts
  its requests) allocates unpopulated and calls this after.
  """
  if buf.nbytes >= _MIN_POPULATED and buf.flags.c_contiguous:
    populate_range(buf.ctypes.data, buf.nbytes)


class _HeapBlock:
  """``size`` bytes from the C heap (``malloc``), 64-byte aligned, in
  ``buf``. Unlike numpy's allocator, nothing advises huge pages for it."""

  __slots__ = ("raw", "buf", "_size")

  def __init__(self, size: int):
    raw = _libc.malloc(size + _ALIGN)
    if not raw:
      raise MemoryError(f"cannot allocate a host buffer of {size} bytes")
    self.raw = raw
    self._size = size
    self.buf = (ctypes.c_char * size).from_address(raw + (-raw) % _ALIGN)

  def __len__(self) -> int:
    return self._size

  def populate(self) -> None:
    """Faults in the whole pages of the block that are not resident yet,
    in one system call (``MADV_POPULATE_WRITE``; pages the C heap reuses
    are already there); nothing where the kernel has no such advice."""
    populate_range(ctypes.addressof(self.buf), self._size)

  def close(self) -> None:
    raw, self.raw = self.raw, 0
    if raw:
      _libc.free(raw)


class _Pool:
  """Free blocks (mappings or heap blocks) by size; returns arrive through
  a lock-free deque.

  Every take of a block is a lease with its own number. A block that comes
  back keeps the bytes its last lease wrote until it is taken again, so a
  caller that knows the lease (:func:`host_reclaim`) can take it back, bytes
  and all, as long as nobody took it since.
  """

  def __init__(self):
    self._lock = threading.Lock()
    # size -> {id(block): (block, the lease it came back from)}
    self._free: dict[int, dict] = collections.defaultdict(dict)
    self._free_bytes = 0
    # Finalizers run whenever jax drops a buffer, possibly while this thread
    # holds the lock, so they only append here; the lock holder drains it.
    self._returned: collections.deque = collections.deque()
    self._leases = itertools.count(1)
    self.mapped = 0
    self.reused = 0
    self.reclaimed = 0

  def _drain(self, cap: int) -> None:
    returned, free = self._returned, self._free
    while returned:
      size, m, lease = returned.popleft()
      if self._free_bytes + size <= cap:
        free[size][id(m)] = (m, lease)
        self._free_bytes += size
      else:
        m.close()

  def take(self, size: int, populate: bool = False, cap: int | None = None):
    """``(block, lease, new)``: a free block of ``size`` bytes (``new``
    false), else a new one: from the C heap under ``_MIN_MAPPED`` (where
    the C library has a heap), else mapped; with ``populate``, a new
    block's pages made resident at once. ``cap``: the pool's cap in bytes
    (default: read from the environment)."""
    if cap is None:
      cap = _cap_bytes()
    with self._lock:
      self._drain(cap)
      lease = next(self._leases)
      free = self._free.get(size)
      if free:
        self._free_bytes -= size
        self.reused += 1
        return free.popitem()[1][0], lease, False
      self.mapped += 1
    if size < _MIN_MAPPED and _libc is not None:
      block = _HeapBlock(size)
      if populate:
        block.populate()
      return block, lease, True
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
      flags |= getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, size, flags=flags)
    if _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
      try:
        m.madvise(mmap.MADV_HUGEPAGE)
      except OSError:  # kernels without transparent huge pages
        pass
    return m, lease, True

  def reclaim(self, block_id: int, size: int, lease: int, cap: int):
    """``(block, new lease)`` if the block that lease ``lease`` took is idle
    here and was not taken since, else ``None``."""
    with self._lock:
      self._drain(cap)
      free = self._free.get(size)
      hit = free.get(block_id) if free else None
      if hit is None or hit[1] != lease:
        return None
      del free[block_id]
      self._free_bytes -= size
      self.reclaimed += 1
      return hit[0], next(self._leases)

  def give_back(self, m, size: int | None = None, lease: int = 0) -> None:
    """Returns block ``m`` (of ``size`` bytes, taken by ``lease``)."""
    self._returned.append((len(m) if size is None else size, m, lease))

  def release(self) -> int:
    with self._lock:
      self._drain(0)
      n = self._free_bytes
      for ms in self._free.values():
        for m, _ in ms.values():
          m.close()
      self._free.clear()
      self._free_bytes = 0
    return n

  def stats(self) -> dict:
    with self._lock:
      self._drain(_cap_bytes())
      return {"idle_bytes": self._free_bytes, "mapped": self.mapped,
              "reused": self.reused, "reclaimed": self.reclaimed}


_POOL = _Pool()


def _after_fork_in_child() -> None:
  # The lock may have been held by another thread at fork time; the mappings
  # themselves are private copies in the child and stay usable.
  _POOL._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def host_empty(shape: tuple[int, ...], dtype, *,
               populate: bool = False) -> np.ndarray:
  """An uninitialised C-contiguous array, 64-byte aligned, for a device buffer.

  Args:
    shape: the array's shape.
    dtype: any numpy dtype (``ml_dtypes`` ones included).
    populate: the caller writes every byte of it next (a restore's new
      shards): the pages of a new block of ``_MIN_POPULATED`` (1 MiB) or
      more are then made resident in one system call instead of a page
      fault per 4 KiB page (a heap block's with ``MADV_POPULATE_WRITE``,
      a mapping's with ``MAP_POPULATE``; as they would be after the
      write); a recycled block is already populated.

  Returns:
    A writable array. At 16 KiB and above it lives in its own block (mapped
    from 32 MiB up, else from the C heap), which returns to the pool when
    the array (and any jax buffer aliasing it) is gone.

  Example:
    >>> b = host_empty((4, 3), np.float32)
    >>> b.shape, b.dtype, b.ctypes.data % 64
    ((4, 3), dtype('float32'), 0)
  """
  return host_empty_leased(shape, dtype, populate)[0]


def host_empty_leased(shape: tuple[int, ...], dtype, populate: bool = False
                      ) -> tuple[np.ndarray, tuple | None, bool]:
  """:func:`host_empty`, the lease of its block for :func:`host_reclaim`
  (``None`` for a buffer that is not pooled), and whether the block is new
  (not recycled, so its pages may not be resident yet; ``False`` under
  16 KiB, where numpy's allocator serves it)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes < _MIN_POOLED:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape), None, False
  cap = _cap_bytes()
  size = -(-nbytes // _PAGE) * _PAGE
  populate = populate and nbytes >= _MIN_POPULATED
  block, lease, new = _POOL.take(size, populate, cap)
  return (*_lend(block, size, lease, nbytes, cap, shape, dtype),
          new and not populate)


def _lend(block, size: int, lease: int, nbytes: int, cap: int, shape,
          dtype) -> tuple[np.ndarray, tuple | None]:
  heap = type(block) is _HeapBlock
  flat = np.frombuffer(block.buf if heap else block, dtype=np.uint8,
                       count=nbytes)
  token = None
  if cap > 0 or heap:  # a mapping closes with its last view; a heap
    ref = weakref.ref(flat, _on_drop)  # block does not
    _LIVE[id(ref)] = (ref, block, size if cap > 0 else 0, lease)
    if cap > 0:
      token = (id(block), size, lease)
  return flat.view(dtype).reshape(shape), token


def host_reclaim(token: tuple, shape: tuple[int, ...], dtype
                 ) -> tuple[np.ndarray, tuple] | None:
  """The buffer of lease ``token`` again, with the bytes it held, if its
  block came back to the pool and nobody took it since; else ``None``.

  ``shape`` and ``dtype`` must be those the token's buffer had. Returns
  ``(array, new token)``; the array is based on a new view of the block
  (its own lifetime, as :func:`host_empty`'s).
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  block_id, size, lease = token
  cap = _cap_bytes()
  got = _POOL.reclaim(block_id, size, lease, cap)
  if got is None:
    return None
  return _lend(got[0], size, got[1], nbytes, cap, shape, dtype)


# The blocks handed out, by the id of a weak reference (kept here) to the
# array every view of them is based on; when that array goes, the block
# returns to the pool (or is freed). A plain weak reference with a callback
# costs less than a ``weakref.finalize`` (its registry and atexit
# bookkeeping): a warm reshard of a 105-array state takes 240 buffers, and
# host_empty and the return of 240 buffers took 1.26 ms with finalizers,
# 0.83 ms without. Callbacks run in whichever thread drops the last view,
# so they only append to the pool's lock-free deque.
_LIVE: dict = {}


def _on_drop(ref) -> None:
  entry = _LIVE.pop(id(ref), None)
  if entry is None:
    return
  _, block, size, lease = entry
  if size:
    _POOL.give_back(block, size, lease)
  else:
    block.close()


# jaxlib's collector of deferred Python references (no public name), looked
# up on first use: importing this module does not import jax (a store
# server's process takes host buffers from here and never loads it).
_collect_deferred: Any = None


def _deferred_collector() -> Any:
  global _collect_deferred
  if _collect_deferred is None:
    lib = sys.modules.get("jax._src.lib")
    if lib is None:  # jax not loaded: no jax buffer holds a host block
      return None
    _collect_deferred = getattr(getattr(lib, "_jax", None),
                                "collect_garbage", None) or _no_collector
  return _collect_deferred


def _no_collector() -> None:  # pragma: no cover - another jaxlib layout
  pass


def collect_dropped_buffers() -> None:
  """Drops the Python objects that freed jax buffers still hold.

  When jax frees a device buffer that aliases a host array (every buffer
  :func:`host_empty` hands out), jaxlib does not release the array at once:
  it queues the reference and drops the queue from a cycle-collector
  callback. Until then the array, and its pooled block, stay taken, so a
  result dropped just before the next reshard would not be recycled and
  that call would fault in fresh pages for all of it (512 MiB: 131,000
  faults, 3x the time of a call that reuses them). Cheap: one call into
  jaxlib, which runs the same code at every collection.
  """
  collect = _deferred_collector()
  if collect is not None:
    collect()


def release_host_pool() -> int:
  """Unmaps the idle recycled buffers; returns how many bytes were freed."""
  return _POOL.release()


def host_pool_stats() -> dict:
  """``idle_bytes`` held for reuse, and counts of ``mapped``/``reused``
  takes and of ``reclaimed`` buffers (:func:`host_reclaim`)."""
  return _POOL.stats()
