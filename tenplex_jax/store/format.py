"""The on-disk tensor store of one host: snapshots of sub-tensors on tensorstore.

A store is a directory (e.g. under ``/dev/shm``) that holds, per process of a
job whose data it keeps, atomic *snapshots*::

  DIR/STORE_ID                     a random id naming this store (the "host")
  DIR/procs/<k>/CURRENT            name of process k's current snapshot
  DIR/procs/<k>/<snapshot>/manifest.json
  DIR/procs/<k>/<snapshot>/data/params/Dense_0/kernel/b<i>/   zarr3 array

Each snapshot holds one copy of every box (distinct shard) that process ``k``
held, as a zarr3 array written with tensorstore, plus a JSON manifest: the
job's full layout (``PTC.to_json()``), the boxes held, the step, and the
non-array leaves. Every chunk carries a crc32c checksum (zarr3 ``crc32c``
codec) that every read verifies (tensorstore's, and the fast path
:meth:`HostStore.read_into`); the manifest also records each chunk's crc32c,
which reads and :meth:`HostStore.verify` check too.

The chunk files are written by :func:`write_zarr3` (one ``writev`` per
chunk from the array's own memory) in exactly the layout tensorstore's zarr3
driver writes, and the data path of restores reads them with ``preadv``
into the destination buffers; tensorstore reads the same arrays for
:meth:`HostStore.read` and for stores written by format version 1 (which
tensorstore wrote).

Arrays are stored as unsigned integers of the same itemsize (bfloat16 as
uint16, float8 and int4 as uint8, bool as uint8, PRNG keys as their uint32
key data), so every dtype round-trips bitwise.

Snapshots are written into a staging directory and renamed into place; the
``CURRENT`` pointer is replaced atomically last, so a half-written snapshot
never replaces a good one. The ``keep`` newest snapshots of each process are
kept (``snap-<step>-<id>/`` next to ``CURRENT``); every read can name the
step of the snapshot to read (default: ``CURRENT``), so a restore can use an
older step of which every process still has a copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import json
import math
import mmap
import os
import re
import shutil
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import google_crc32c
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from tenplex_jax.errors import ChecksumError, StoreError
from tenplex_jax.layout import PTC, Box

__all__ = ["ChunkMaps", "HostStore", "SnapshotWriter", "crc32c",
           "parse_index", "format_box", "parse_box"]

FORMAT = "tenplex_jax.store"
_CHUNK_BYTES = 16 << 20  # chunks at most this big (split along dim 0)
_WRITE_THREADS = 4  # concurrent box writers per snapshot
_SNAP_NAME = re.compile(r"snap-(\d+)-[0-9a-f]+")


def crc32c(data: Any, value: int = 0) -> int:
  """CRC-32C (Castagnoli, as in the zarr3 ``crc32c`` codec) of a buffer.

  Hardware accelerated (``google-crc32c``) and without copying the data:
  any C-contiguous buffer (numpy array, ``bytearray``, ``memoryview``).

  Args:
    data: the bytes to checksum.
    value: the running checksum to extend (0 to start).

  Example:
    >>> crc32c(b"123456789") == 0xE3069283
    True
  """
  a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
  if not a.flags.c_contiguous:
    raise ValueError("crc32c needs a C-contiguous buffer")
  if a.nbytes == 0:
    return value
  if a.nbytes < 4096:
    return google_crc32c.extend(value, a.tobytes())
  # google_crc32c takes only objects without a release hook (bytes); a
  # ctypes array over the same memory is one, and copies nothing. ``a``
  # stays referenced (and its memory alive) for the whole call.
  view = (ctypes.c_char * a.nbytes).from_address(a.ctypes.data)
  return google_crc32c.extend(value, view)


def _context() -> ts.Context:
  return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                     "data_copy_concurrency": {"limit": 4},
                     "file_io_concurrency": {"limit": 8}})


_CTX = None
_CTX_LOCK = threading.Lock()


def ts_context() -> ts.Context:
  global _CTX
  with _CTX_LOCK:
    if _CTX is None:
      _CTX = _context()
    return _CTX


# ---------------------------------------------------------------- indices


def parse_index(index: Any, shape: Sequence[int]) -> Box:
  """Turns a numpy-style index or the paper's string form into a box.

  Accepts a string like ``"[:, 2:4]"``, a tuple of slices and ints, a single
  slice, or a box (``((start, stop), ...)``). Ints select one element of a
  dimension (kept as a length-1 range). Steps other than 1 are refused.

  Example:
    >>> parse_index("[:, 2:4]", (3, 8))
    ((0, 3), (2, 4))
    >>> parse_index((slice(1, None), 5), (3, 8))
    ((1, 3), (5, 6))

  Raises:
    StoreError: the index is malformed or out of range for ``shape``.
  """
  shape = tuple(int(n) for n in shape)
  if isinstance(index, str):
    text = index.strip()
    if text.startswith("[") and text.endswith("]"):
      text = text[1:-1]
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    items = []
    for p in parts:
      if p in ("", ":", "..."):
        if p == "...":
          items.append(Ellipsis)
        else:
          items.append(slice(None))
        continue
      if ":" in p:
        bits = p.split(":")
        if len(bits) > 3 or (len(bits) == 3 and bits[2].strip() not in
                             ("", "1")):
          raise StoreError(f"index {index!r}: only unit-step ranges are"
                           f" supported, got {p!r}")
        try:
          lo = int(bits[0]) if bits[0].strip() else None
          hi = int(bits[1]) if bits[1].strip() else None
        except ValueError:
          raise StoreError(f"index {index!r}: {p!r} is not a range") from None
        items.append(slice(lo, hi))
      else:
        try:
          items.append(int(p))
        except ValueError:
          raise StoreError(f"index {index!r}: {p!r} is not an int or a"
                           " range") from None
    index = tuple(items)
  if isinstance(index, (slice, int, np.integer)) or index is Ellipsis:
    index = (index,)
  index = tuple(index)
  if index and all(isinstance(r, (tuple, list)) and len(r) == 2
                   for r in index):
    index = tuple(slice(int(a), int(b)) for a, b in index)
  if Ellipsis in index:
    k = index.index(Ellipsis)
    fill = len(shape) - (len(index) - 1)
    index = index[:k] + (slice(None),) * fill + index[k + 1:]
  if len(index) > len(shape):
    raise StoreError(f"index {index} has {len(index)} entries but the tensor"
                     f" has rank {len(shape)} (shape {shape})")
  box = []
  for d, n in enumerate(shape):
    s = index[d] if d < len(index) else slice(None)
    if isinstance(s, (int, np.integer)):
      i = int(s) + (n if s < 0 else 0)
      if not 0 <= i < n:
        raise StoreError(f"index {int(s)} is out of range for dimension {d}"
                         f" of size {n} (shape {shape})")
      box.append((i, i + 1))
      continue
    if not isinstance(s, slice):
      raise StoreError(f"unsupported index entry {s!r} for dimension {d}")
    if s.step not in (None, 1):
      raise StoreError(f"dimension {d}: only unit-step slices are supported,"
                       f" got step {s.step}")
    lo, hi, _ = s.indices(n)
    box.append((lo, max(lo, hi)))
  return tuple(box)


def format_box(box: Box) -> str:
  """The URL form of a box: ``0:4,2:4`` (empty for a 0-d tensor)."""
  return ",".join(f"{a}:{b}" for a, b in box)


def parse_box(text: str) -> Box:
  if not text:
    return ()
  out = []
  for part in text.split(","):
    a, b = part.split(":")
    out.append((int(a), int(b)))
  return tuple(out)


# ---------------------------------------------------------------- dtypes


def storage_of(dtype_name: str, itemsize: int) -> tuple[str, tuple[int, ...]]:
  """The unsigned storage dtype and extra trailing dims of a logical dtype."""
  if dtype_name.startswith("key<"):
    return "uint32", (itemsize // 4,)
  if itemsize in (1, 2, 4, 8):
    return f"uint{8 * itemsize}", ()
  if itemsize % 8 == 0:
    return "uint64", (itemsize // 8,)
  raise StoreError(f"dtype {dtype_name} with itemsize {itemsize} has no"
                   " storage type")


def to_storage(arr: np.ndarray, storage: str, extra: tuple[int, ...]
               ) -> np.ndarray:
  arr = np.ascontiguousarray(arr).reshape(arr.shape)
  if arr.dtype == np.dtype(storage) and not extra:
    return arr
  if extra and arr.dtype == np.dtype(storage):  # key data already
    return arr
  out = arr.view(np.dtype(storage))
  if extra:
    out = out.reshape(arr.shape + extra)
  return out


def from_storage(arr: np.ndarray, dtype_name: str) -> np.ndarray:
  """Views storage integers as the logical dtype (keys stay key data)."""
  if dtype_name.startswith("key<"):
    return arr
  dt = jnp.dtype(dtype_name)
  if arr.dtype == dt:
    return arr
  arr = np.ascontiguousarray(arr).reshape(arr.shape)
  if arr.dtype.itemsize != dt.itemsize:  # extra trailing dim
    out = arr.view(dt)
    return out.reshape(arr.shape[:-1])
  return arr.view(dt)


def _quote(path: str) -> str:
  return "/".join(urllib.parse.quote(p, safe="") or "%00"
                  for p in path.split("/"))


def _chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
  if not shape:
    return []
  row = max(1, math.prod(shape[1:]) * itemsize)
  rows = max(1, min(shape[0], _CHUNK_BYTES // row)) if shape[0] else 1
  return [rows] + [max(1, n) for n in shape[1:]]


def _zarr_spec(path: str, shape: tuple[int, ...], storage: str,
               itemsize: int) -> dict:
  return {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": path},
      "metadata": {
          "shape": list(shape),
          "chunk_grid": {"name": "regular", "configuration": {
              "chunk_shape": _chunk_shape(shape, itemsize)}},
          "data_type": storage,
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "crc32c"}],
      },
  }


def _zarr_metadata(shape: tuple[int, ...], storage: str,
                   itemsize: int) -> dict:
  """The ``zarr.json`` tensorstore writes for :func:`_zarr_spec`."""
  return {"chunk_grid": {"configuration": {
              "chunk_shape": _chunk_shape(shape, itemsize)},
                         "name": "regular"},
          "chunk_key_encoding": {"name": "default"},
          "codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                     {"name": "crc32c"}],
          "data_type": storage, "fill_value": 0, "node_type": "array",
          "shape": list(shape), "zarr_format": 3}


def _chunk_key(i: int, ndim: int) -> str:
  """The zarr3 default key of chunk ``i`` along dim 0 (other dims whole)."""
  return "c" if ndim == 0 else "c/" + "/".join([str(i)] + ["0"] * (ndim - 1))


def _write_all(fd: int, bufs: list) -> None:
  bufs = [memoryview(b).cast("B") for b in bufs if len(memoryview(b))]
  while bufs:
    n = os.writev(fd, bufs)
    while bufs and n >= len(bufs[0]):
      n -= len(bufs[0])
      bufs.pop(0)
    if bufs and n:
      bufs[0] = bufs[0][n:]


def _read_all(fd: int, bufs: list, offset: int) -> int:
  """``preadv`` until every buffer is full; returns the bytes read."""
  bufs = [memoryview(b).cast("B") for b in bufs if len(memoryview(b))]
  total = 0
  while bufs:
    n = os.preadv(fd, bufs, offset)
    if n == 0:
      break
    offset += n
    total += n
    while bufs and n >= len(bufs[0]):
      n -= len(bufs[0])
      bufs.pop(0)
    if bufs and n:
      bufs[0] = bufs[0][n:]
  return total


def _open_chunk(fname: str, chunk_bytes: int, what: str) -> tuple[int, int]:
  """Opens a chunk file for reading; ``(fd, size)`` once its size is right
  (payload plus the 4-byte crc32c trailer), else closes it and raises."""
  try:
    fd = os.open(fname, os.O_RDONLY)
  except OSError as e:
    raise StoreError(f"{what}: cannot open {fname}: {e}") from e
  try:
    size = os.fstat(fd).st_size
  except OSError as e:
    os.close(fd)
    raise StoreError(f"{what}: cannot stat {fname}: {e}") from e
  if size != chunk_bytes + 4:
    os.close(fd)
    raise ChecksumError(f"{what}: chunk checksum mismatch: the chunk file"
                        f" has {size} bytes, not {chunk_bytes + 4}")
  return fd, size


def _pread_chunk(fname: str, part: np.ndarray, chunk_bytes: int, crc: int,
                 what: str) -> None:
  """Reads a whole chunk file with ``preadv`` into ``part`` (C-contiguous,
  ``chunk_bytes``) and checks it against its trailer and ``crc``."""
  fd, _ = _open_chunk(fname, chunk_bytes, what)
  try:
    flat = part.reshape(-1)  # a view: ``part`` is C-contiguous
    tail = bytearray(4)
    got = _read_all(fd, [flat, tail], 0)
  finally:
    os.close(fd)
  c = crc32c(flat)
  if got != chunk_bytes + 4 or c != int.from_bytes(tail, "little") \
      or c != crc:
    raise ChecksumError(f"{what}: chunk checksum mismatch (crc32c)")


def write_zarr3(path: str, data: np.ndarray, *, fsync: bool = False
                ) -> tuple[int, list[int]]:
  """Writes ``data`` (C-contiguous, unsigned storage dtype) as a zarr3 array.

  Exactly the layout tensorstore's ``zarr3`` driver writes for
  :func:`_zarr_spec` (``zarr.json``, chunks of at most ``_CHUNK_BYTES`` split
  along dim 0, each chunk's bytes followed by their little-endian crc32c,
  the last chunk padded with the fill value 0), so tensorstore reads it and
  verifies the checksums; but the bytes go from ``data`` to the file with
  one ``writev`` per chunk and no intermediate copy.

  Returns:
    (rows per chunk, the crc32c of each chunk).
  """
  shape = data.shape
  itemsize = data.dtype.itemsize
  meta = _zarr_metadata(shape, data.dtype.name, itemsize)
  os.makedirs(path)
  with open(os.path.join(path, "zarr.json"), "w") as f:
    json.dump(meta, f)
  chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
  rows = chunk[0] if chunk else 1
  row_bytes = math.prod(shape[1:]) * itemsize if shape else itemsize
  n = math.ceil(shape[0] / rows) if shape else 1
  crcs = []
  flat = data.reshape(-1).view(np.uint8)
  for i in range(n):
    part = flat[i * rows * row_bytes:(i + 1) * rows * row_bytes]
    pad = np.zeros(rows * row_bytes - part.nbytes, np.uint8)
    c = crc32c(pad, crc32c(part))
    crcs.append(c)
    fname = os.path.join(path, _chunk_key(i, len(shape)))
    os.makedirs(os.path.dirname(fname), exist_ok=True)
    fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      _write_all(fd, [part, pad, c.to_bytes(4, "little")])
      if fsync:
        os.fsync(fd)
    finally:
      os.close(fd)
  return rows, crcs


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """One chunk file a sub-box read touches, and the rows it gives."""
  fname: str
  crc: int
  what: str  # names the chunk in errors
  c0: int  # the chunk's first row, relative to the held box
  r0: int  # the rows of the sub-box in it (relative to the held box)
  r1: int


@dataclasses.dataclass(frozen=True)
class _ChunkWalk:
  """Where a sub-box of a held box lies in the held box's chunk files
  (format version 2: ``chunk_rows`` rows of the held box per file)."""
  storage: np.dtype
  hshape: tuple[int, ...]  # the held box in storage (extra dims included)
  rows: int  # rows per chunk
  row_bytes: int
  lo: int  # the sub-box's first row, relative to the held box
  inner: tuple[slice, ...]  # the sub-box in the other dims
  whole_rows: bool  # the sub-box spans whole rows
  chunks: tuple[_Chunk, ...]

  @property
  def ndim(self) -> int:
    return len(self.hshape)

  @property
  def chunk_bytes(self) -> int:
    return self.rows * self.row_bytes

  @classmethod
  def of(cls, root: str, path: str, box: Box, proc: int, t: dict, b: dict,
         held: Box, snap: str) -> _ChunkWalk:
    extra = tuple((0, e) for e in t["extra"])
    sbox, sheld = tuple(box) + extra, tuple(held) + extra
    hshape = tuple(h1 - h0 for h0, h1 in sheld)
    storage = np.dtype(t["storage"])
    rows = int(b["chunk_rows"])
    ndim = len(hshape)
    lo, hi = (sbox[0][0] - sheld[0][0], sbox[0][1] - sheld[0][0]) \
        if ndim else (0, 1)
    d = os.path.join(snap, b["dir"])
    chunks = tuple(
        _Chunk(os.path.join(d, _chunk_key(ci, ndim)), b["crc32c"][ci],
               f"store {root}: {path} box {list(held)} (process {proc},"
               f" {b['dir']}, chunk {ci})",
               ci * rows, max(lo, ci * rows), min(hi, ci * rows + rows))
        for ci in range(lo // rows, -(-hi // rows)))
    return cls(
        storage=storage, hshape=hshape, rows=rows,
        row_bytes=(math.prod(hshape[1:]) if ndim else 1) * storage.itemsize,
        lo=lo,
        inner=tuple(slice(a - h0, z - h0)
                    for (a, z), (h0, _) in zip(sbox[1:], sheld[1:])),
        whole_rows=all(z - a == n
                       for (a, z), n in zip(sbox[1:], hshape[1:])),
        chunks=chunks)

  def rows_of(self, data: np.ndarray, c: _Chunk) -> np.ndarray:
    """The sub-box's part of chunk ``c`` (its payload ``data``), a view."""
    cview = data.view(self.storage).reshape((self.rows,) + self.hshape[1:])
    return cview[(slice(c.r0 - c.c0, c.r1 - c.c0),) + self.inner]


class ChunkMaps:
  """Read-only memory maps of chunk files, each checked against its crc32c
  once.

  One per restore (or per server request): a chunk that several pieces
  share is mapped and checksummed once, and its bytes are copied (or sent)
  straight from the mapping, without a temporary chunk buffer. Each chunk
  file's size is checked before it is mapped (a short file would raise
  SIGBUS on access), and its payload is checked against the crc32c trailer
  and the manifest's crc32c before any of its bytes are used. Safe to use
  from several threads; the maps are unmapped when the last view of them
  is gone (after :meth:`close`).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._maps: dict[str, list] = {}  # file -> [lock, payload or None]
    self.mapped = 0  # chunk files mapped (and checksummed)

  def payload(self, fname: str, chunk_bytes: int, crc: int,
              what: str) -> np.ndarray:
    """The verified payload of chunk file ``fname`` (uint8, read-only).

    Raises:
      ChecksumError: the file has the wrong size or fails its checksum.
      StoreError: the file cannot be opened or mapped.
    """
    with self._lock:
      entry = self._maps.get(fname)
      if entry is None:
        entry = self._maps[fname] = [threading.Lock(), None]
    with entry[0]:
      if entry[1] is None:
        entry[1] = _map_chunk(fname, chunk_bytes, crc, what)
        with self._lock:
          self.mapped += 1
      return entry[1]

  def close(self) -> None:
    """Forgets the maps (each is unmapped once no view of it is left)."""
    with self._lock:
      self._maps.clear()


def _map_chunk(fname: str, chunk_bytes: int, crc: int,
               what: str) -> np.ndarray:
  """Maps a chunk file read-only and checks it in full (size first)."""
  fd, size = _open_chunk(fname, chunk_bytes, what)
  try:
    # MAP_POPULATE: the pages are all read (checksummed) next, so map them
    # in one call instead of one fault per page.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
  except OSError as e:
    raise StoreError(f"{what}: cannot map {fname}: {e}") from e
  finally:
    os.close(fd)
  data = np.frombuffer(mm, np.uint8, chunk_bytes)
  got = crc32c(data)
  if got != int.from_bytes(mm[chunk_bytes:], "little") or got != crc:
    raise ChecksumError(f"{what}: chunk checksum mismatch (crc32c)")
  return data


# ---------------------------------------------------------------- writing


_VOLATILE_FS = {"tmpfs", "ramfs", "devtmpfs"}


def needs_fsync(path: str) -> bool:
  """Whether files under ``path`` must be fsynced to survive a host crash.

  ``TENPLEX_JAX_STORE_FSYNC=1``/``0`` decides; otherwise everything but
  memory file systems (tmpfs such as /dev/shm, ramfs), which a crash loses
  anyway, is fsynced.
  """
  v = os.environ.get("TENPLEX_JAX_STORE_FSYNC")
  if v is not None:
    return v not in ("0", "false", "no", "")
  path = os.path.realpath(path)
  best, fstype = "", None
  try:
    with open("/proc/mounts") as f:
      for line in f:
        parts = line.split()
        if len(parts) < 3:
          continue
        mnt = parts[1].replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and \
            len(mnt) > len(best):
          best, fstype = mnt, parts[2]
  except OSError:
    return True
  return fstype not in _VOLATILE_FS


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


class SnapshotWriter:
  """Writes one process's snapshot into a store directory, atomically.

  ``add`` writes boxes (asynchronously, through tensorstore); ``commit``
  waits for them, writes the manifest, renames the staging directory into
  place and swaps the ``CURRENT`` pointer. ``abort`` removes the staging
  directory. Used by :func:`tenplex_jax.store.save` and by the store server
  for uploads (central mode, store replicas).
  """

  def __init__(self, root: str, proc: int, *, step: int,
               fsync: bool | None = None):
    self.root = os.path.abspath(root)
    # A committed snapshot must survive a host crash: its chunks, manifest
    # and directory entries reach the disk before CURRENT names it.
    self.fsync = needs_fsync(self.root) if fsync is None else bool(fsync)
    self.proc = int(proc)
    self.step = int(step)
    self.pdir = os.path.join(self.root, "procs", str(self.proc))
    os.makedirs(self.pdir, exist_ok=True)
    ensure_store_id(self.root)
    self.name = f"snap-{self.step:010d}-{uuid.uuid4().hex[:8]}"
    self.staging = os.path.join(self.pdir, f".staging-{self.name}")
    os.makedirs(self.staging)
    self.tensors: dict[str, dict] = {}
    self._futures: list = []
    self._pool: cf.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()
    self.nbytes = 0

  def _drain(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def declare(self, path: str, *, dtype: str, itemsize: int,
              shape: Sequence[int], key_impl: str | None = None) -> None:
    storage, extra = storage_of(dtype, itemsize)
    with self._lock:
      self.tensors.setdefault(path, {
          "dtype": dtype, "itemsize": int(itemsize),
          "shape": [int(n) for n in shape], "storage": storage,
          "extra": list(extra), "key_impl": key_impl, "boxes": []})

  def add(self, path: str, box: Box, data: np.ndarray) -> None:
    """Writes ``data`` (logical dtype or storage dtype) as box ``box``.

    The write runs on a thread pool and reads ``data`` in place (no copy):
    ``data`` must not change until :meth:`commit`.
    """
    t = self.tensors[path]
    extra = tuple(t["extra"])
    data = to_storage(np.asarray(data), t["storage"], extra)
    want = tuple(b - a for a, b in box) + extra
    if data.shape != want:
      raise StoreError(f"{path}: box {box} needs shape {want}, got"
                       f" {data.shape}")
    with self._lock:
      i = len(t["boxes"])
      rel = f"data/{_quote(path)}/b{i}"
      entry = {"box": [list(r) for r in box], "dir": rel,
               "nbytes": int(data.nbytes)}
      t["boxes"].append(entry)
      self.nbytes += data.nbytes
    if data.size == 0:
      return
    if self._pool is None:
      self._pool = cf.ThreadPoolExecutor(_WRITE_THREADS,
                                         thread_name_prefix="tenplex-write")
    dest = os.path.join(self.staging, rel)

    def write():
      entry["chunk_rows"], entry["crc32c"] = write_zarr3(dest, data,
                                                         fsync=self.fsync)

    self._futures.append(self._pool.submit(write))

  def commit(self, *, ptc_json: str, extras: Mapping[str, Any] | None = None,
             num_processes: int = 1, mode: str = "local",
             keep: int = 1, run: str = "") -> str:
    """Finishes the snapshot; returns its directory.

    Args:
      ptc_json: the saving job's full layout.
      extras: the non-array leaves (JSON).
      num_processes: processes of the saving job.
      mode: how the snapshot was written (``local``, ``central``,
        ``replica``).
      keep: snapshots of this process kept, this one included (0: all).
        Before that, this process's other snapshots of this step or a
        later one are deleted: they belong to a run that was abandoned
        when the job restored an older step.
      run: the run (job incarnation) that wrote the snapshot, shared by
        all its processes; restore never combines snapshots of one step
        from different runs ("": unnamed, as manifests without a run).
    """
    try:
      for f in self._futures:
        f.result()
    except Exception as e:
      self.abort()
      raise StoreError(f"writing snapshot {self.staging} failed: {e}") from e
    self._drain()
    manifest = {
        "format": FORMAT, "version": 2, "step": self.step,
        "process_index": self.proc, "num_processes": int(num_processes),
        "mode": mode, "created": time.time(), "nbytes": self.nbytes,
        "run": str(run or ""),
        "job": json.loads(ptc_json) if isinstance(ptc_json, str) else ptc_json,
        "tensors": self.tensors, "extras": dict(extras or {}),
    }
    with open(os.path.join(self.staging, "manifest.json"), "w") as f:
      json.dump(manifest, f)
      if self.fsync:
        f.flush()
        os.fsync(f.fileno())
    if self.fsync:  # the chunk files' directory entries
      for d, _, _ in os.walk(self.staging, topdown=False):
        _fsync_dir(d)
    final = os.path.join(self.pdir, self.name)
    os.rename(self.staging, final)
    tmp = os.path.join(self.pdir, f".CURRENT.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
      f.write(self.name)
      if self.fsync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(self.pdir, "CURRENT"))
    if self.fsync:
      _fsync_dir(self.pdir)
    prune_snapshots(self.pdir, self.name, keep)
    return final

  def abort(self) -> None:
    for f in self._futures:  # let in-flight writes land before deleting
      try:
        f.result()
      except Exception:
        pass
    self._futures = []
    self._drain()
    shutil.rmtree(self.staging, ignore_errors=True)


def prune_snapshots(pdir: str, current: str, keep: int) -> None:
  """Deletes a process's snapshots around its new current one.

  First every other snapshot of the current one's step or a later one (a
  run abandoned when the job restored an older step), then all but the
  newest ``keep`` (0: none).

  Args:
    pdir: the process's directory (``DIR/procs/<k>``).
    current: the name of the snapshot just committed (never deleted).
    keep: snapshots kept, ``current`` included.
  """
  step = int(_SNAP_NAME.fullmatch(current).group(1))
  snaps = []
  for n in sorted(os.listdir(pdir)):
    m = _SNAP_NAME.fullmatch(n)
    if m is None or n == current:
      continue
    if int(m.group(1)) >= step:
      shutil.rmtree(os.path.join(pdir, n), ignore_errors=True)
    else:
      snaps.append(n)
  snaps.append(current)
  for old in snaps[:-keep] if keep else []:
    shutil.rmtree(os.path.join(pdir, old), ignore_errors=True)


def ensure_store_id(root: str) -> str:
  path = os.path.join(root, "STORE_ID")
  try:
    with open(path) as f:
      return f.read().strip()
  except FileNotFoundError:
    pass
  os.makedirs(root, exist_ok=True)
  sid = uuid.uuid4().hex
  tmp = f"{path}.{sid[:8]}"
  with open(tmp, "w") as f:
    f.write(sid)
  try:
    os.link(tmp, path)  # atomic create-if-absent
  except FileExistsError:
    pass
  os.unlink(tmp)
  with open(path) as f:
    return f.read().strip()


# ---------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """What a store holds of one tensor (see :meth:`HostStore.describe`)."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  boxes: tuple[Box, ...]
  nbytes: int
  proc: int
  step: int


class HostStore:
  """Reads the snapshots of a store directory.

  Example:
    >>> import tempfile, numpy as np, jax
    >>> from tenplex_jax.store import save, HostStore
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jax.numpy.arange(8.0).reshape(2, 4)}, d)
    >>> store = HostStore(d)
    >>> store.list()
    ['w']
    >>> store.read("w", "[:, 2:4]").tolist()
    [[2.0, 3.0], [6.0, 7.0]]
  """

  def __init__(self, root: str):
    self.root = os.path.abspath(root)
    if not os.path.isdir(self.root):
      raise StoreError(f"store directory {self.root} does not exist")
    self._manifests: dict[int, tuple[str, dict]] = {}
    self._snap_manifests: dict[str, dict] = {}
    self._arrays: dict[str, Any] = {}
    self._lock = threading.Lock()

  @property
  def store_id(self) -> str:
    return ensure_store_id(self.root)

  def procs(self) -> list[int]:
    """Processes (of the saving job) with a committed snapshot here."""
    d = os.path.join(self.root, "procs")
    if not os.path.isdir(d):
      return []
    return sorted(int(n) for n in os.listdir(d)
                  if n.isdigit() and
                  os.path.exists(os.path.join(d, n, "CURRENT")))

  def snapshots(self, proc: int) -> dict[int, str]:
    """Every committed snapshot of process ``proc`` held here: step ->
    snapshot directory (``CURRENT``'s for its step, else the newest name).

    Older snapshots are those :meth:`SnapshotWriter.commit` kept
    (``keep``); a snapshot deleted meanwhile by a newer commit is left out.
    """
    pdir = os.path.join(self.root, "procs", str(proc))
    try:
      names = sorted(n for n in os.listdir(pdir) if n.startswith("snap-"))
    except FileNotFoundError:
      return {}
    out = {}
    for n in names:
      m = _SNAP_NAME.fullmatch(n)
      if m and os.path.exists(os.path.join(pdir, n, "manifest.json")):
        out[int(m.group(1))] = os.path.join(pdir, n)
    try:
      cur = self.snapshot_dir(proc)
    except StoreError:
      return {}  # not committed (CURRENT is written last)
    m = _SNAP_NAME.fullmatch(os.path.basename(cur))
    if m:
      out[int(m.group(1))] = cur
    return dict(sorted(out.items()))

  def snapshot_dir(self, proc: int, step: int | None = None) -> str:
    """The directory of process ``proc``'s snapshot of ``step`` (default:
    its ``CURRENT`` snapshot)."""
    pdir = os.path.join(self.root, "procs", str(proc))
    try:
      with open(os.path.join(pdir, "CURRENT")) as f:
        cur = os.path.join(pdir, f.read().strip())
    except FileNotFoundError:
      raise StoreError(f"store {self.root} holds no snapshot of process"
                       f" {proc} (it holds {self.procs()})") from None
    if step is None:
      return cur
    m = _SNAP_NAME.fullmatch(os.path.basename(cur))
    if m and int(m.group(1)) == int(step):
      return cur
    snap = self.snapshots(proc).get(int(step))
    if snap is None:
      raise StoreError(f"store {self.root} holds no snapshot of step {step}"
                       f" of process {proc} (it holds steps"
                       f" {sorted(self.snapshots(proc))})")
    return snap

  def manifest(self, proc: int | None = None, step: int | None = None
               ) -> dict:
    """The manifest of process ``proc``'s snapshot of ``step`` (default:
    its current snapshot; process default: the only or the lowest process
    held)."""
    if proc is None:
      procs = self.procs()
      if not procs:
        raise StoreError(f"store {self.root} is empty")
      proc = procs[0]
    snap = self.snapshot_dir(proc, step)
    if step is not None:
      return self._snap_manifest(proc, snap)
    with self._lock:
      cached = self._manifests.get(proc)
      if cached and cached[0] == snap:
        return cached[1]
    m = self._read_manifest(proc, snap)
    with self._lock:
      self._manifests[proc] = (snap, m)
    return m

  def _snap_manifest(self, proc: int, snap: str) -> dict:
    with self._lock:
      m = self._snap_manifests.get(snap)
    if m is None:
      m = self._read_manifest(proc, snap)
      with self._lock:
        self._snap_manifests[snap] = m
    return m

  def _read_manifest(self, proc: int, snap: str) -> dict:
    try:
      with open(os.path.join(snap, "manifest.json")) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      raise StoreError(f"store {self.root}: manifest of process {proc}"
                       f" ({snap}) is unreadable: {e}") from e

  def manifests(self) -> dict[int, dict]:
    """The manifest of each process's current snapshot."""
    return {p: self.manifest(p) for p in self.procs()}

  def all_manifests(self) -> dict[int, dict[int, dict]]:
    """Every kept snapshot's manifest: process -> step -> manifest (the
    current snapshot's included)."""
    out = {}
    for p in self.procs():
      cur = self.manifest(p)
      by_step = {}
      for st, snap in self.snapshots(p).items():
        try:
          by_step[st] = self._snap_manifest(p, snap)
        except StoreError:
          if not os.path.exists(snap):  # deleted by a newer commit
            continue
          raise
      by_step[cur["step"]] = cur
      out[p] = dict(sorted(by_step.items()))
    return out

  def list(self, proc: int | None = None) -> list[str]:
    """Tensor paths held (of one process's snapshot)."""
    return list(self.manifest(proc)["tensors"])

  def describe(self, proc: int | None = None) -> list[TensorInfo]:
    """Per tensor: shape, dtype, the boxes held and their bytes."""
    m = self.manifest(proc)
    return [TensorInfo(p, tuple(t["shape"]), t["dtype"],
                       tuple(tuple(tuple(r) for r in b["box"])
                             for b in t["boxes"]),
                       sum(b["nbytes"] for b in t["boxes"]),
                       m["process_index"], m["step"])
            for p, t in m["tensors"].items()]

  def ptc(self, proc: int | None = None) -> PTC:
    """The saving job's full layout."""
    return PTC.from_json(self.manifest(proc)["job"])

  def _array(self, snap: str, rel: str):
    key = os.path.join(snap, rel)
    with self._lock:
      arr = self._arrays.get(key)
    if arr is None:
      spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": key},
              "open": True}
      try:
        arr = ts.open(spec, context=ts_context(), read=True).result()
      except Exception as e:
        raise StoreError(f"store {self.root}: cannot open {key}: {e}") from e
      with self._lock:
        self._arrays[key] = arr
    return arr

  def read_storage(self, path: str, box: Box, *, proc: int | None = None,
                   step: int | None = None) -> np.ndarray:
    """Reads sub-box ``box`` of tensor ``path`` in its storage dtype (from
    the snapshot of ``step``, default: the current one).

    Raises:
      ChecksumError: a chunk fails its checksum.
      StoreError: the tensor or box is not held here.
    """
    proc, t, b, held, snap = self._locate(path, box, proc, step)
    shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
    if math.prod(shape) == 0:
      return np.empty(shape, np.dtype(t["storage"]))
    arr = self._array(snap, b["dir"])
    idx = tuple(slice(lo - h0, hi - h0)
                for (lo, hi), (h0, _) in zip(box, held))
    try:
      return arr[idx].read().result()
    except Exception as e:
      msg = str(e)
      if any(w in msg.lower() for w in ("crc32c", "checksum", "digest")):
        raise ChecksumError(
            f"store {self.root}: {path} box {list(held)} (process {proc},"
            f" {b['dir']}): chunk checksum mismatch: {msg}") from e
      raise StoreError(f"store {self.root}: reading {path} box {box}"
                       f" failed: {msg}") from e

  def _locate(self, path: str, box: Box, proc: int | None,
              step: int | None = None) -> tuple[int, dict, dict, Box, str]:
    """(proc, tensor entry, box entry, held box, snapshot directory) of the
    box containing ``box`` (in the snapshot of ``step``)."""
    if proc is None:
      proc = self._proc_holding(path, box, step)
    snap = self.snapshot_dir(proc, step)
    m = self._snap_manifest(proc, snap) if step is not None \
        else self.manifest(proc)
    t = m["tensors"].get(path)
    if t is None:
      raise StoreError(f"store {self.root} (process {proc}) holds no tensor"
                       f" {path!r}")
    for b in t["boxes"]:
      held = tuple(tuple(r) for r in b["box"])
      if len(box) == len(held) and all(
          h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(box, held)):
        return proc, t, b, held, snap
    raise StoreError(f"store {self.root} (process {proc}) holds no box of"
                     f" {path!r} containing {list(box)}")

  def storage_info(self, path: str, box: Box, *, proc: int | None = None,
                   step: int | None = None
                   ) -> tuple[np.dtype, tuple[int, ...], int | None, Box]:
    """(storage dtype, shape of ``box`` in storage, rows per chunk of the
    box holding it or None, that held box)."""
    proc, t, b, held, _ = self._locate(path, box, proc, step)
    shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
    return np.dtype(t["storage"]), shape, b.get("chunk_rows"), held

  def read_into(self, path: str, box: Box, dest: np.ndarray, *,
                proc: int | None = None, maps: ChunkMaps | None = None,
                step: int | None = None) -> int:
    """Reads sub-box ``box`` of ``path`` (storage dtype) into ``dest``.

    The fast data path of restores: a chunk that the box covers whole, with
    its rows contiguous in ``dest``, is read with ``preadv`` straight into
    ``dest``; any other part (a column range, strided in the chunk's rows,
    or some rows of a chunk) is copied straight from a memory map of the
    chunk file into ``dest`` (no temporary chunk buffer). Every chunk
    touched is checked in full against its crc32c trailer and the
    manifest's crc32c before its bytes are used. Snapshots of older
    versions are read through tensorstore.

    Args:
      path: the tensor.
      box: the sub-box, inside one box held here.
      dest: the destination, storage dtype, the box's shape (a view).
      proc: the saving process whose snapshot to read (default: any).
      maps: the chunk maps of this restore (see :class:`ChunkMaps`), so
        that a chunk several pieces share is mapped and checked once;
        default: maps for this call only.
      step: the step of the snapshot to read (default: the current one).

    Returns:
      The bytes of ``box``.

    Raises:
      ChecksumError: a chunk fails its checksum (or has the wrong size).
      StoreError: the tensor or box is not held here, or a file is missing.
    """
    proc, t, b, held, snap = self._locate(path, box, proc, step)
    extra = tuple(t["extra"])
    storage = np.dtype(t["storage"])
    shape = tuple(hi - lo for lo, hi in box) + extra
    if dest.shape != shape or dest.dtype != storage:
      raise StoreError(f"{path} box {list(box)}: destination is"
                       f" {dest.dtype}{list(dest.shape)}, needs"
                       f" {storage}{list(shape)}")
    if math.prod(shape) == 0:
      return 0
    if "chunk_rows" not in b:  # written by tensorstore (format version 1)
      dest[...] = self.read_storage(path, box, proc=proc, step=step)
      return dest.nbytes
    w = _ChunkWalk.of(self.root, path, box, proc, t, b, held, snap)
    own = maps is None
    if own:
      maps = ChunkMaps()
    try:
      for c in w.chunks:
        part = dest[c.r0 - w.lo:c.r1 - w.lo] if w.ndim else dest
        if w.whole_rows and c.r0 == c.c0 and c.r1 == c.c0 + w.rows \
            and part.flags.c_contiguous:
          _pread_chunk(c.fname, part, w.chunk_bytes, c.crc, c.what)
          continue
        data = maps.payload(c.fname, w.chunk_bytes, c.crc, c.what)
        part[...] = w.rows_of(data, c) if w.ndim \
            else data.view(w.storage).reshape(())
    finally:
      if own:
        maps.close()
    return dest.nbytes

  def read_segments(self, path: str, box: Box, *, proc: int | None = None,
                    maps: ChunkMaps | None = None, step: int | None = None
                    ) -> list:
    """The bytes of sub-box ``box`` of ``path`` (storage dtype, C order) as
    a list of segments to send one after the other.

    What the store server sends: chunk files are memory-mapped (through
    ``maps``, so a chunk several pieces of a request share is mapped and
    checked once) and every chunk touched is checked in full against its
    crc32c (trailer and manifest) first. Each segment is a view of a
    mapping, no copy: rows that are contiguous in a chunk as one
    C-contiguous ``memoryview``, other sub-boxes (column ranges) as a
    strided numpy array, which the sender gathers in small blocks. Snapshots
    of older versions are read through tensorstore. ``step``: the step of
    the snapshot to read (default: the current one).

    Raises:
      ChecksumError: a chunk fails its checksum (or has the wrong size).
      StoreError: the tensor or box is not held here, or a file is missing.
    """
    proc, t, b, held, snap = self._locate(path, box, proc, step)
    extra = tuple(t["extra"])
    if math.prod(tuple(hi - lo for lo, hi in box) + extra) == 0:
      return []
    if "chunk_rows" not in b:
      return [self.read_storage(path, box, proc=proc,
                                step=step).reshape(-1)]
    w = _ChunkWalk.of(self.root, path, box, proc, t, b, held, snap)
    if maps is None:
      maps = ChunkMaps()
    out = []
    for c in w.chunks:
      data = maps.payload(c.fname, w.chunk_bytes, c.crc, c.what)
      if w.whole_rows:
        out.append(memoryview(data[(c.r0 - c.c0) * w.row_bytes:
                                   (c.r1 - c.c0) * w.row_bytes]))
      else:
        out.append(w.rows_of(data, c))
    return out

  def _proc_holding(self, path: str, box: Box, step: int | None = None
                    ) -> int:
    for p in self.procs():
      if step is not None and step not in self.snapshots(p):
        continue
      t = self.manifest(p, step)["tensors"].get(path)
      if t is None:
        continue
      for b in t["boxes"]:
        held = b["box"]
        if len(held) == len(box) and all(
            h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(box, held)):
          return p
    raise StoreError(f"store {self.root} holds no box of {path!r} containing"
                     f" {list(box)}")

  def read(self, path: str, index: Any = None, *, proc: int | None = None
           ) -> np.ndarray:
    """Reads a sub-tensor by numpy-style index or string form ``"[:, 2:4]"``.

    The sub-tensor must lie inside one box held here. PRNG keys come back
    as their key data.
    """
    t = None
    for p in ([proc] if proc is not None else self.procs()):
      t = self.manifest(p)["tensors"].get(path)
      if t is not None:
        break
    if t is None:
      raise StoreError(f"store {self.root} holds no tensor {path!r}")
    box = parse_index(slice(None) if index is None else index, t["shape"]) \
        if t["shape"] else ()
    return from_storage(self.read_storage(path, box, proc=proc), t["dtype"])

  def verify(self) -> list[str]:
    """Checks every chunk of every box against its crc32c (trailer and
    manifest; older snapshots: tensorstore's check and the manifest crc32);
    returns the problems."""
    problems = []
    for p in self.procs():
      m = self.manifest(p)
      for path, t in m["tensors"].items():
        for b in t["boxes"]:
          box = tuple(tuple(r) for r in b["box"])
          try:
            if "chunk_rows" in b:
              shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
              self.read_into(path, box, np.empty(shape, t["storage"]),
                             proc=p)
              continue
            data = self.read_storage(path, box, proc=p)
          except StoreError as e:
            problems.append(str(e))
            continue
          if data.size and zlib.crc32(
              memoryview(np.ascontiguousarray(data)).cast("B")) != b["crc32"]:
            problems.append(f"{self.root}: {path} box {list(box)} (process"
                            f" {p}) does not match its manifest crc32")
    return problems
