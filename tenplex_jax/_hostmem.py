"""Host buffers for new CPU-device shards: aligned, recycled.

A CPU device's buffer is host memory, so the CPU executor of
:func:`tenplex_jax.reshard` fills a host buffer and hands it to the device
without a copy (``jax.device_put(buf, dev, may_alias=True)``, which XLA's CPU
client honours for 64-byte aligned buffers). Writing into freshly mapped
memory costs a page fault per page, which on virtual machines costs as much
as the copy itself, so large buffers are

* mapped anonymously (sizes rounded up to 4 KiB), with 4 KiB pages unless
  ``TENPLEX_JAX_HUGEPAGES=1`` advises ``MADV_HUGEPAGE``: on the benchmark VM
  first touch of 512 MiB in huge pages took 1.3-4.2 s wall and 0.4-1.6 s of
  kernel time against 1.35-1.65 s and 0.3 s in 4 KiB pages (3 alternated
  rounds, load 17-21; huge pages had been the faster ones earlier in the
  VM's life, so this is the host's state, not a law), and
* recycled: when jax frees a device buffer built on one, the mapping (pages
  already faulted in) goes back to a free list that the next reshard reuses,
  up to a cap (``TENPLEX_JAX_HOST_POOL_GIB``, default 4 GiB of idle memory;
  ``0`` turns recycling off). :func:`release_host_pool` unmaps idle buffers.

Buffers handed out are uninitialised; the caller overwrites every byte.
``tenplex_jax.store.restore`` takes its destination buffers from here too.
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import threading
import weakref

import numpy as np

__all__ = ["host_empty", "host_pool_stats", "release_host_pool"]

_ALIGN = 64  # XLA's CPU client aliases host buffers aligned to 64 bytes.
_PAGE = mmap.PAGESIZE  # mappings are rounded up to whole (small) pages
_MIN_MAPPED = 1 << 20  # smaller buffers come from numpy's allocator
_HUGE = os.environ.get("TENPLEX_JAX_HUGEPAGES", "0") == "1"


def _cap_bytes() -> int:
  v = os.environ.get("TENPLEX_JAX_HOST_POOL_GIB", "4")
  try:
    gib = float(v)
  except ValueError as e:
    raise ValueError(f"TENPLEX_JAX_HOST_POOL_GIB must be a number of GiB,"
                     f" not {v!r}") from e
  return max(0, int(gib * (1 << 30)))


class _Pool:
  """Free mappings by size; returns arrive through a lock-free deque."""

  def __init__(self):
    self._lock = threading.Lock()
    self._free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
    self._free_bytes = 0
    # Finalizers run whenever jax drops a buffer, possibly while this thread
    # holds the lock, so they only append here; the lock holder drains it.
    self._returned: collections.deque[mmap.mmap] = collections.deque()
    self.mapped = 0
    self.reused = 0

  def _drain(self, cap: int) -> None:
    while self._returned:
      m = self._returned.popleft()
      if self._free_bytes + len(m) <= cap:
        self._free[len(m)].append(m)
        self._free_bytes += len(m)
      else:
        m.close()

  def take(self, size: int) -> mmap.mmap:
    cap = _cap_bytes()
    with self._lock:
      self._drain(cap)
      free = self._free.get(size)
      if free:
        self._free_bytes -= size
        self.reused += 1
        return free.pop()
      self.mapped += 1
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
      try:
        m.madvise(mmap.MADV_HUGEPAGE)
      except OSError:  # kernels without transparent huge pages
        pass
    return m

  def give_back(self, m: mmap.mmap) -> None:
    self._returned.append(m)

  def release(self) -> int:
    with self._lock:
      self._drain(0)
      n = self._free_bytes
      for ms in self._free.values():
        for m in ms:
          m.close()
      self._free.clear()
      self._free_bytes = 0
    return n

  def stats(self) -> dict:
    with self._lock:
      self._drain(_cap_bytes())
      return {"idle_bytes": self._free_bytes, "mapped": self.mapped,
              "reused": self.reused}


_POOL = _Pool()


def _after_fork_in_child() -> None:
  # The lock may have been held by another thread at fork time; the mappings
  # themselves are private copies in the child and stay usable.
  _POOL._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def host_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised C-contiguous array, 64-byte aligned, for a device buffer.

  Args:
    shape: the array's shape.
    dtype: any numpy dtype (``ml_dtypes`` ones included).

  Returns:
    A writable array. At 1 MiB and above it lives in its own mapping, which
    returns to the pool when the array (and any jax buffer aliasing it) is
    gone.

  Example:
    >>> b = host_empty((4, 3), np.float32)
    >>> b.shape, b.dtype, b.ctypes.data % 64
    ((4, 3), dtype('float32'), 0)
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes < _MIN_MAPPED:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)
  m = _POOL.take(-(-nbytes // _PAGE) * _PAGE)
  flat = np.frombuffer(m, dtype=np.uint8, count=nbytes)
  if _cap_bytes() > 0:
    weakref.finalize(flat, _POOL.give_back, m)
  return flat.view(dtype).reshape(shape)


def release_host_pool() -> int:
  """Unmaps the idle recycled buffers; returns how many bytes were freed."""
  return _POOL.release()


def host_pool_stats() -> dict:
  """``idle_bytes`` held for reuse, and counts of ``mapped``/``reused`` takes."""
  return _POOL.stats()
