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
import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import operator
import os
import re
import shutil
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import google_crc32c
import numpy as np

from tenplex_jax.errors import ChecksumError, StoreError, UsageError
from tenplex_jax.layout import PTC, Box, dtype_of_name
from tenplex_jax.store import private

# tensorstore (0.1-0.2 s to import) loads where a read or write uses it: a
# store server reads the chunks of format 2 without it.
if TYPE_CHECKING:
  import tensorstore as ts

__all__ = ["ChunkMaps", "HostStore", "SnapshotWriter", "check_step",
           "check_tensor_path", "crc32c", "gc", "parse_index", "format_box",
           "parse_box", "round_id", "zarr_metadata"]

FORMAT = "tenplex_jax.store"
VERSION = 3  # 3: rounds (``seq``), manifest and CURRENT checksums
_CHUNK_BYTES = 16 << 20  # chunks at most this big (split along dim 0)
_WRITE_THREADS = 4  # concurrent box writers per snapshot
# snap-<step>-r<seq>-<id> (format 3); snap-<step>-<id> before.
_SNAP_NAME = re.compile(r"snap-(\d{1,10})(?:-r(\d{1,12}))?-[0-9a-f]{1,32}")
MAX_STEP = 10 ** 10 - 1  # the snapshot names hold 10 digits
_STALE_S = 600.0  # a staging dir without a lock is reclaimed after this
_log = logging.getLogger("tenplex_jax.store")


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
  import tensorstore as ts
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


# ---------------------------------------------------------------- checks


_MAX_PATH = 4096


def check_tensor_path(path: Any, what: str = "tensor path") -> str:
  """A tensor path as a store accepts it, else :class:`UsageError`.

  A path names a pytree leaf (``params/Dense_0/kernel``): a string of at
  most 4096 characters, without NUL, not absolute, without empty, ``.``
  or ``..`` components (a whole path ``.`` names a tree that is one leaf).

  Example:
    >>> check_tensor_path("params/w")
    'params/w'
    >>> check_tensor_path("../x")
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.UsageError: tensor path '../x': component '..' is not allowed
  """
  if not isinstance(path, str) or not path:
    raise UsageError(f"{what} {path!r}: must be a non-empty string")
  if len(path) > _MAX_PATH:
    raise UsageError(f"{what} {path[:40]!r}...: longer than {_MAX_PATH}"
                     " characters")
  if "\0" in path:
    raise UsageError(f"{what} {path!r}: contains NUL")
  if path == ".":
    return path
  if path.startswith("/"):
    raise UsageError(f"{what} {path!r}: absolute paths are not allowed")
  for c in path.split("/"):
    if c in ("", ".", ".."):
      raise UsageError(f"{what} {path!r}: component {c!r} is not allowed")
  return path


def check_step(step: Any) -> int:
  """A training step as snapshots record it: an integer in [0, 10**10).

  Example:
    >>> check_step(7)
    7
    >>> check_step(-1)
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.UsageError: step -1: must be in [0, 9999999999]
  """
  if isinstance(step, bool):
    raise UsageError(f"step {step!r}: must be an integer, not a bool")
  try:
    n = operator.index(step)
  except TypeError:
    raise UsageError(f"step {step!r}: must be an integer (got"
                     f" {type(step).__name__})") from None
  if not 0 <= n <= MAX_STEP:
    raise UsageError(f"step {n}: must be in [0, {MAX_STEP}]")
  return int(n)


def round_id(m: Mapping[str, Any]) -> str:
  """The round a manifest belongs to: ``<step>.<seq>.<run>``.

  A round is one save of every process of a run: the processes of a job
  number their saves (``seq``) alike, so snapshots of the same run, step
  and sequence number hold one state and are the only ones restore
  combines. Manifests before format 3 have ``seq`` 0.
  """
  return f"{int(m['step'])}.{int(m.get('seq', 0))}.{m.get('run', '')}"


def _canonical(m: Mapping[str, Any]) -> bytes:
  return json.dumps({k: v for k, v in m.items() if k != "checksum"},
                    sort_keys=True, separators=(",", ":")).encode()


def manifest_checksum(m: Mapping[str, Any]) -> str:
  """The sha256 of a manifest's canonical JSON (without ``checksum``)."""
  return "sha256:" + hashlib.sha256(_canonical(m)).hexdigest()


def check_manifest(m: Any, where: str, *, proc: int | None = None) -> dict:
  """Checks a manifest read from a store or a server: its checksum
  (format 3), its structure and every box directory (relative, inside the
  snapshot). Raises :class:`StoreError` naming ``where``."""
  if not isinstance(m, dict):
    raise StoreError(f"{where}: the manifest is not a JSON object")
  version = m.get("version")
  if not isinstance(version, int) or version < 1:
    raise StoreError(f"{where}: the manifest has no valid version")
  if version >= 3 or "checksum" in m:
    if m.get("checksum") != manifest_checksum(m):
      raise ChecksumError(f"{where}: the manifest does not match its"
                          " checksum (edited or corrupt)")
  try:
    check_step(m["step"])
    k = operator.index(m["process_index"])
    if proc is not None and k != proc:
      raise StoreError(f"manifest of process {k} stored as process {proc}")
    if not isinstance(m.get("run", ""), str) or not isinstance(
        m.get("seq", 0), int) or not isinstance(m["tensors"], dict) \
        or not isinstance(m.get("extras", {}), dict):
      raise StoreError("run, seq, tensors or extras has the wrong type")
    for path, t in m["tensors"].items():
      check_tensor_path(path)
      shape = [operator.index(n) for n in t["shape"]]
      for b in t["boxes"]:
        box = [(operator.index(lo), operator.index(hi)) for lo, hi in
               b["box"]]
        if len(box) != len(shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)):
          raise StoreError(f"{path}: box {box} is outside shape {shape}")
        check_relative(b["dir"], f"{path} box {box}")
        if "chunk_rows" in b and (operator.index(b["chunk_rows"]) < 1
                                  or not isinstance(b["crc32c"], list)):
          raise StoreError(f"{path}: box {box} has bad chunk entries")
  except UsageError as e:
    raise StoreError(f"{where}: malformed manifest: {e}") from None
  except StoreError as e:
    raise StoreError(f"{where}: malformed manifest: {e}") from None
  except (KeyError, TypeError, ValueError) as e:
    raise StoreError(f"{where}: malformed manifest: {type(e).__name__}:"
                     f" {e}") from None
  return m


def check_relative(rel: Any, what: str) -> str:
  """A path read from a manifest: relative, no ``..``, no NUL."""
  if not isinstance(rel, str) or not rel or "\0" in rel \
      or rel.startswith("/") or any(c in ("", ".", "..")
                                    for c in rel.split("/")):
    raise StoreError(f"{what}: directory {rel!r} is not a relative path"
                     " inside the snapshot")
  return rel


def inside(base: str, rel: str, what: str) -> str:
  """``base/rel``, resolved (symbolic links followed), which must stay
  under ``base`` (resolved too); else :class:`StoreError`."""
  check_relative(rel, what)
  b = os.path.realpath(base)
  full = os.path.realpath(os.path.join(b, rel))
  if not full.startswith(b + os.sep):
    raise StoreError(f"{what}: {rel!r} resolves to {full}, outside {b}")
  return full


def _current_text(name: str) -> str:
  return f"{name}\n{hashlib.sha256(name.encode()).hexdigest()[:16]}\n"


def read_current(pdir: str) -> str | None:
  """The snapshot name ``pdir/CURRENT`` names, checked (its checksum line,
  the name's form); None if there is no ``CURRENT``.

  Raises:
    StoreError: ``CURRENT`` is torn, edited or names no snapshot form.
  """
  try:
    with open(os.path.join(pdir, "CURRENT"), "rb") as f:
      raw = f.read(4096)
  except FileNotFoundError:
    return None
  except OSError as e:
    raise StoreError(f"{pdir}/CURRENT is unreadable: {e}") from e
  return parse_current(raw, pdir)


def parse_current(raw: bytes, pdir: str) -> str:
  """The snapshot name in the bytes ``raw`` of ``pdir/CURRENT``, checked
  (see :func:`read_current`)."""
  try:
    lines = raw.decode("ascii").split("\n")
  except UnicodeDecodeError:
    raise StoreError(f"{pdir}/CURRENT is corrupt (not ASCII)") from None
  name = lines[0].strip()
  if _SNAP_NAME.fullmatch(name) is None:
    raise StoreError(f"{pdir}/CURRENT is corrupt: {name[:80]!r} is no"
                     " snapshot name")
  if len(lines) > 1 and lines[1].strip() and \
      lines[1].strip() != _current_text(name).split("\n")[1]:
    raise StoreError(f"{pdir}/CURRENT does not match its checksum")
  if len(lines) <= 1 or not lines[1].strip():
    if _SNAP_NAME.fullmatch(name).group(2) is not None:  # format 3 name
      raise StoreError(f"{pdir}/CURRENT is torn (no checksum line)")
  return name


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
  dt = dtype_of_name(dtype_name)
  if arr.dtype == dt:
    return arr
  arr = np.ascontiguousarray(arr).reshape(arr.shape)
  if arr.dtype.itemsize != dt.itemsize:  # extra trailing dim
    out = arr.view(dt)
    return out.reshape(arr.shape[:-1])
  return arr.view(dt)


def _quote(path: str) -> str:
  """A tensor path as a relative directory: each component percent-quoted,
  ``.``/``..``/empty components escaped, so no name leaves ``data/``."""
  out = []
  for p in path.split("/"):
    q = urllib.parse.quote(p, safe="")
    out.append(q.replace(".", "%2E") if q in ("", ".", "..") else q)
  return "/".join(x or "%00" for x in out)


def chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
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
              "chunk_shape": chunk_shape(shape, itemsize)}},
          "data_type": storage,
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "crc32c"}],
      },
  }


def zarr_metadata(shape: tuple[int, ...], storage: str,
                   itemsize: int) -> dict:
  """The ``zarr.json`` tensorstore writes for :func:`_zarr_spec`."""
  return {"chunk_grid": {"configuration": {
              "chunk_shape": chunk_shape(shape, itemsize)},
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
  meta = zarr_metadata(shape, data.dtype.name, itemsize)
  private.makedirs(path, exist_ok=False)
  with private.open_private(os.path.join(path, "zarr.json")) as f:
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
    private.makedirs(os.path.dirname(fname))
    fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                 private.FILE_MODE)
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
class ChunkWalk:
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
         held: Box, snap: str, maps: ChunkMaps | None = None) -> ChunkWalk:
    """The walk of sub-box ``box`` of ``held`` (box entry ``b`` of tensor
    entry ``t``) in snapshot directory ``snap``; ``maps``: the chunk maps
    of the read, which resolve each box directory once for all its pieces
    (else resolved here)."""
    extra = tuple((0, e) for e in t["extra"])
    sbox, sheld = tuple(box) + extra, tuple(held) + extra
    hshape = tuple(h1 - h0 for h0, h1 in sheld)
    storage = np.dtype(t["storage"])
    rows = int(b["chunk_rows"])
    ndim = len(hshape)
    lo, hi = (sbox[0][0] - sheld[0][0], sbox[0][1] - sheld[0][0]) \
        if ndim else (0, 1)
    d = (maps.inside if maps is not None else inside)(
        snap, b["dir"], f"store {root}: {path} box {list(held)}")
    crcs = b["crc32c"]
    if len(crcs) < -(-hi // rows) or rows < 1:
      raise StoreError(f"store {root}: {path} box {list(held)} (process"
                       f" {proc}): the manifest lists {len(crcs)} chunk"
                       f" checksums, the box needs {-(-hi // max(rows, 1))}")
    chunks = tuple(
        _Chunk(os.path.join(d, _chunk_key(ci, ndim)), int(crcs[ci]),
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
    self._dirs: dict[tuple[str, str], str] = {}  # (base, rel) -> resolved
    self._memo: dict = {}  # see memo
    self._plain: set[str] = set()  # resolved paths found to be no link
    self.mapped = 0  # chunk files mapped (and checksummed)

  def inside(self, base: str, rel: str, what: str) -> str:
    """:func:`inside`, each ``(base, rel)`` resolved once for these maps:
    a restore reads many pieces of one box directory, and resolving it
    (``realpath``: an ``lstat`` per component of both paths) for each cost
    more than reading the pieces of a small state."""
    key = (base, rel)
    got = self._dirs.get(key)
    if got is None:
      check_relative(rel, what)
      b = self._dirs.get((base, ""))
      if b is None:
        b = os.path.realpath(base)
      got, plain = b, []
      for c in rel.split("/"):  # b is resolved: only rel's parts to check
        got = os.path.join(got, c)
        if got in self._plain:
          continue
        if os.path.islink(got):  # a link: resolved (and checked) in full
          got, plain = inside(base, rel, what), []
          break
        plain.append(got)
      with self._lock:
        self._dirs[(base, "")] = b
        self._dirs[key] = got
        self._plain.update(plain)
    return got

  def memo(self, key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, once per ``key`` for these maps (what one restore finds
    the same for each of its pieces, e.g. a round's snapshot directory)."""
    got = self._memo.get(key)
    if got is None:
      got = make()
      with self._lock:
        self._memo[key] = got
    return got

  def payload(self, fname: str, chunk_bytes: int, crc: int,
              what: str, load=None) -> np.ndarray:
    """The verified payload of chunk file ``fname`` (uint8, read-only);
    ``load(fname, chunk_bytes, crc, what)`` reads and checks it (default:
    a memory map of the local file).

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
        entry[1] = (load or _map_chunk)(fname, chunk_bytes, crc, what)
        with self._lock:
          self.mapped += 1
      return entry[1]

  def close(self) -> None:
    """Forgets the maps (each is unmapped once no view of it is left), the
    resolved directories and what :meth:`memo` kept."""
    with self._lock:
      self._maps.clear()
      self._dirs.clear()
      self._memo.clear()
      self._plain.clear()


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


_SEQ: dict[tuple[str, int, str], int] = {}
_SEQ_LOCK = threading.Lock()


def next_seq(root: str, proc: int, run: str) -> int:
  """This process's next save sequence number for ``(store, proc, run)``.

  Every process of a run saves the same rounds in the same order, so their
  k-th saves (counted from 1 in each process) form round k; the number is
  recorded in the manifest (``seq``) and restore combines only snapshots
  of one ``(run, step, seq)``.
  """
  key = (root if "://" in root else os.path.realpath(root), int(proc),
         str(run))
  with _SEQ_LOCK:
    _SEQ[key] = _SEQ.get(key, 0) + 1
    return _SEQ[key]


class SnapshotWriter:
  """Writes one process's snapshot into a store directory, atomically.

  ``add`` writes boxes (on a thread pool); ``commit`` waits for them,
  writes the checksummed manifest, renames the staging directory into
  place and swaps the ``CURRENT`` pointer. ``abort`` removes the staging
  directory. Used by :func:`tenplex_jax.store.save` and by the store server
  for uploads (central mode, store replicas).

  While it writes, the writer holds an exclusive ``flock`` on
  ``procs/<k>/.lock-<name>``: :func:`gc` (run by every new writer, and
  by ``tenplex-jax store gc``) reclaims only staging directories whose lock
  no live process holds (a save killed with SIGKILL releases it).

  The store root is checked first (:func:`tenplex_jax.store.private.
  check_dir`: :class:`~tenplex_jax.errors.UnsafePathError` for a directory
  another user could tamper with); what it makes is private: directories
  0700, files 0600 (and stricter under a stricter umask).

  Args:
    root: the store directory.
    proc: the saving process.
    step: the training step (checked: an integer in [0, 10**10)).
    seq: the round's sequence number in its run (default: the next of
      :func:`next_seq` for ``run``).
    run: the run, when ``seq`` is drawn here (default: the one given to
      :meth:`commit`, drawn then).
    fsync: force fsyncs on or off (default: by file system).
  """

  def __init__(self, root: str, proc: int, *, step: int,
               seq: int | None = None, run: str | None = None,
               fsync: bool | None = None):
    self.step = check_step(step)
    self.proc = operator.index(proc)
    if self.proc < 0:
      raise UsageError(f"process index {self.proc} is negative")
    self.root = os.path.abspath(root)
    self.run = run
    if seq is None and run is not None:
      seq = next_seq(self.root, self.proc, run)
    self.seq = None if seq is None else operator.index(seq)
    # A committed snapshot must survive a host crash: its chunks, manifest
    # and directory entries reach the disk before CURRENT names it.
    self.fsync = needs_fsync(self.root) if fsync is None else bool(fsync)
    self.pdir = os.path.join(self.root, "procs", str(self.proc))
    private.check_dir(self.root)  # before anything is made there
    private.makedirs(self.pdir)
    private.check_dir(self.root)  # again: one made by another meanwhile
    ensure_store_id(self.root)
    self.reclaimed = gc(self.root)
    if self.reclaimed["bytes"]:
      _log.warning("store %s: reclaimed %d bytes of %d interrupted saves",
                   self.root, self.reclaimed["bytes"],
                   len(self.reclaimed["removed"]))
    self.uid = uuid.uuid4().hex[:8]
    self.name = None  # known at commit (the sequence number may be drawn then)
    self._lockfd = take_lock(os.path.join(self.pdir, f".lock-{self.uid}"))
    self.staging = os.path.join(self.pdir, f".staging-{self.uid}")
    try:
      os.mkdir(self.staging, private.DIR_MODE)
    except BaseException:
      self._release()
      raise
    self.tensors: dict[str, dict] = {}
    self._futures: list = []
    self._pool: cf.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()
    self.nbytes = 0

  def _release(self) -> None:
    if self._lockfd is not None:
      try:
        os.unlink(os.path.join(self.pdir, f".lock-{self.uid}"))
      except OSError:
        pass
      os.close(self._lockfd)
      self._lockfd = None

  def _drain(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def declare(self, path: str, *, dtype: str, itemsize: int,
              shape: Sequence[int], key_impl: str | None = None) -> None:
    check_tensor_path(path)
    storage, extra = storage_of(dtype, itemsize)
    with self._lock:
      self.tensors.setdefault(path, {
          "dtype": dtype, "itemsize": int(itemsize),
          "shape": [int(n) for n in shape], "storage": storage,
          "extra": list(extra), "key_impl": key_impl, "boxes": []})

  def add(self, path: str, box: Box, data: np.ndarray
          ) -> cf.Future | None:
    """Writes ``data`` (logical dtype or storage dtype) as box ``box``.

    The write runs on a thread pool and reads ``data`` in place (no copy):
    ``data`` must not change until :meth:`commit`, or until the returned
    future (``None`` for an empty box) is done.
    """
    t = self.tensors[path]
    extra = tuple(t["extra"])
    data = to_storage(np.asarray(data), t["storage"], extra)
    want = tuple(b - a for a, b in box) + extra
    if data.shape != want:
      raise StoreError(f"{path}: box {box} needs shape {want}, got"
                       f" {data.shape}")
    if len(box) != len(t["shape"]) or any(
        not 0 <= a <= b <= n for (a, b), n in zip(box, t["shape"])):
      raise StoreError(f"{path}: box {list(box)} is outside shape"
                       f" {t['shape']}")
    with self._lock:
      i = len(t["boxes"])
      rel = f"data/{_quote(path)}/b{i}"
      entry = {"box": [list(r) for r in box], "dir": rel,
               "nbytes": int(data.nbytes)}
      t["boxes"].append(entry)
      self.nbytes += data.nbytes
    if data.size == 0:
      return None
    if self._pool is None:
      self._pool = cf.ThreadPoolExecutor(_WRITE_THREADS,
                                         thread_name_prefix="tenplex-write")
    dest = os.path.join(self.staging, rel)

    def write():
      entry["chunk_rows"], entry["crc32c"] = write_zarr3(dest, data,
                                                         fsync=self.fsync)

    fut = self._pool.submit(write)
    self._futures.append(fut)
    return fut

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
        Before that, this process's snapshots of a later step, and those
        of this step written by another run, are deleted: they belong to a
        run that was abandoned when the job restored an older step.
      run: the run (job incarnation) that wrote the snapshot, shared by
        all its processes; restore never combines snapshots of different
        rounds (run, step, sequence number).
    """
    try:
      for f in self._futures:
        f.result()
    except Exception as e:
      self.abort()
      raise StoreError(f"writing snapshot {self.staging} failed: {e}") from e
    try:
      self._drain()
      run = str(run or "") if self.run is None else str(self.run)
      if self.seq is None:
        self.seq = next_seq(self.root, self.proc, run)
      self.name = f"snap-{self.step:010d}-r{self.seq:06d}-{self.uid}"
      manifest = {
          "format": FORMAT, "version": VERSION, "step": self.step,
          "seq": self.seq, "process_index": self.proc,
          "num_processes": int(num_processes), "mode": mode,
          "created": time.time(), "nbytes": self.nbytes, "run": run,
          "job": json.loads(ptc_json) if isinstance(ptc_json, str)
          else ptc_json,
          "tensors": self.tensors, "extras": dict(extras or {}),
      }
      manifest["checksum"] = manifest_checksum(manifest)
      with private.open_private(os.path.join(self.staging, "manifest.json")
                                ) as f:
        json.dump(manifest, f)
        if self.fsync:
          f.flush()
          os.fsync(f.fileno())
      if self.fsync:  # the chunk files' directory entries
        for d, _, _ in os.walk(self.staging, topdown=False):
          _fsync_dir(d)
      final = os.path.join(self.pdir, self.name)
      os.rename(self.staging, final)
    except OSError as e:  # e.g. the disk is full: nothing is committed
      self.abort()
      raise StoreError(f"writing snapshot {self.staging} failed: {e}") from e
    except BaseException:
      self.abort()
      raise
    self._release()
    try:
      write_current(self.pdir, self.name, fsync=self.fsync)
    except OSError as e:
      # The snapshot is in place (restore finds it by listing); CURRENT
      # still names the previous one.
      raise StoreError(f"snapshot {final} is committed but CURRENT could"
                       f" not be updated: {e}") from e
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
    self._release()


def write_current(pdir: str, name: str, *, fsync: bool = False) -> None:
  """Points ``pdir/CURRENT`` at snapshot ``name`` (atomically, with a
  checksum line).

  Another process's :func:`gc` with a small ``min_age`` (``tenplex-jax
  store gc --min-age 0`` beside a live save) may remove the temporary file
  before it is renamed: it is then written again."""
  for _ in range(100):
    tmp = os.path.join(pdir, f".CURRENT.{uuid.uuid4().hex[:8]}")
    with private.open_private(tmp) as f:
      f.write(_current_text(name))
      if fsync:
        f.flush()
        os.fsync(f.fileno())
    try:
      os.replace(tmp, os.path.join(pdir, "CURRENT"))
      break
    except FileNotFoundError:
      continue  # the temporary file was removed by a gc: again
  else:
    raise StoreError(f"{pdir}: the temporary file for CURRENT was removed"
                     " 100 times by another process before it was renamed")
  if fsync:
    _fsync_dir(pdir)


def take_lock(path: str) -> int:
  """Creates lock file ``path`` (a fresh name) and holds its ``flock``.

  Another process's :func:`gc` may meanwhile probe the new file (it takes
  the lock for a moment to see whether a writer holds it) and, finding no
  staging directory beside it yet, unlink it: the ``flock`` here waits out
  such a probe instead of failing, and a lock file unlinked before it was
  taken is made again, so the lock held is the one at ``path``."""
  for _ in range(100):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, private.FILE_MODE)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)  # a gc probe holds it for moments
      if _still_at(path, fd):
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    except BaseException:
      os.close(fd)
      raise
    os.close(fd)  # unlinked by a gc before it was held: again
  raise StoreError(f"cannot hold lock file {path}: removed 100 times by"
                   " another process as soon as it was made")


def _still_at(path: str, fd: int) -> bool:
  """Whether the file open as ``fd`` is still the one at ``path``."""
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


def _lock_is_free(path: str, *, unlink: bool = False) -> bool:
  """Whether no live process holds the ``flock`` of lock file ``path``.

  ``unlink``: a free lock file is also unlinked, while this holds its
  ``flock`` and only if it is still the file at ``path``: a writer that
  opened the file meanwhile gets its lock only after the unlink, finds the
  file gone and makes it again (:func:`take_lock`). Unlinked after the
  probe instead, the file could be one the writer had taken meanwhile: its
  staging directory would then be guarded only by its age."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return True
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return False
      raise
    if unlink and _still_at(path, fd):
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass
    return True
  finally:
    os.close(fd)  # closing releases the lock taken here


def snap_key(name: str) -> tuple[int, int, str]:
  """(step, sequence number, uid) of a snapshot name (orders rounds)."""
  return _snap_key(name)


def is_snapshot_name(name: str) -> bool:
  """Whether ``name`` has the form of a committed snapshot's name."""
  return _SNAP_NAME.fullmatch(name) is not None


def _snap_key(name: str) -> tuple[int, int, str]:
  m = _SNAP_NAME.fullmatch(name)
  return int(m.group(1)), int(m.group(2) or 0), name


def _trash(pdir: str, name: str) -> None:
  """Deletes a snapshot: first renamed out of sight (atomic), then removed;
  an interrupted removal leaves a ``.trash-*`` that :func:`gc` reclaims."""
  t = os.path.join(pdir, f".trash-{name}-{uuid.uuid4().hex[:6]}")
  try:
    os.rename(os.path.join(pdir, name), t)
  except FileNotFoundError:
    return
  shutil.rmtree(t, ignore_errors=True)


def _manifest_run(snap: str) -> str | None:
  try:
    with open(os.path.join(snap, "manifest.json")) as f:
      return str(json.load(f).get("run", ""))
  except (OSError, ValueError, AttributeError):
    return None


def prune_snapshots(pdir: str, current: str, keep: int) -> None:
  """Deletes a process's snapshots around its new current one.

  First, if the process holds a snapshot of a later step, every other
  snapshot of the current one's step or a later one (a run abandoned when
  the job restored an older step); else the other snapshots of the
  current step written by another run or with the same or a later save
  number. Same-step snapshots of the same run with a lower save number
  stay: they are earlier rounds (a step saved twice). Then all but
  the newest ``keep`` (0: none), ordered by (step, sequence number).

  Args:
    pdir: the process's directory (``DIR/procs/<k>``).
    current: the name of the snapshot just committed (never deleted).
    keep: snapshots kept, ``current`` included.
  """
  step, seq, _ = _snap_key(current)
  run = _manifest_run(os.path.join(pdir, current))
  names = [n for n in os.listdir(pdir)
           if _SNAP_NAME.fullmatch(n) and n != current]
  went_back = any(_snap_key(n)[0] > step for n in names)
  snaps = []
  for n in names:
    st, sq, _ = _snap_key(n)
    if st > step or (st == step and (
        went_back or sq >= seq
        or _manifest_run(os.path.join(pdir, n)) != run)):
      # A later step, or this step from another run, or this step's save
      # number again or later (an earlier incarnation of a run named the
      # same): an abandoned run's snapshot.
      _trash(pdir, n)
    else:
      snaps.append(n)
  snaps.sort(key=_snap_key)
  snaps.append(current)
  for old in snaps[:-keep] if keep else []:
    _trash(pdir, old)


def _du(path: str) -> int:
  total = 0
  for d, _, files in os.walk(path):
    for f in files:
      try:
        total += os.lstat(os.path.join(d, f)).st_size
      except OSError:
        pass
  return total


def gc(root: str, *, min_age: float = _STALE_S) -> dict:
  """Reclaims what interrupted saves left in store ``root``.

  Removes, in every ``procs/<k>/``: staging directories (``.staging-*``)
  whose writer is dead (its ``flock`` on ``.lock-*`` is free: a process
  killed with SIGKILL releases it; a live save, in this or another
  process, holds it and is skipped), staging directories without a lock
  file older than ``min_age`` seconds (written before locks, or a
  pathological state), half-deleted snapshots (``.trash-*``), stale
  ``.CURRENT.*`` temporary files and free locks. Run by every new
  :class:`SnapshotWriter` and by ``tenplex-jax store gc DIR``.

  Returns:
    ``{"bytes": reclaimed, "removed": [paths], "skipped": [paths of live
    saves]}``.

  Raises:
    UnsafePathError: ``root``, a directory above it or its ``procs/``
      directories are another user's or writable by group or others
      (:func:`tenplex_jax.store.private.check_dir`); nothing is removed.

  Example:
    >>> import tempfile
    >>> gc(tempfile.mkdtemp())["bytes"]
    0
  """
  private.check_dir(root)
  out = {"bytes": 0, "removed": [], "skipped": []}
  base = os.path.join(root, "procs")
  try:
    procs = [os.path.join(base, n) for n in os.listdir(base)]
  except (FileNotFoundError, NotADirectoryError):
    return out
  now = time.time()
  for pdir in procs:
    try:
      names = os.listdir(pdir)
    except OSError:
      continue
    for n in names:
      full = os.path.join(pdir, n)
      if n.startswith(".staging-"):
        uid = n[len(".staging-"):]
        lock = os.path.join(pdir, f".lock-{uid}")
        if os.path.exists(lock):
          dead = _lock_is_free(lock)
        else:
          try:
            dead = now - os.lstat(full).st_mtime > min_age
          except FileNotFoundError:
            continue
        if not dead:
          out["skipped"].append(full)
          continue
      elif n.startswith(".trash-"):
        pass
      elif n.startswith(".CURRENT."):
        try:
          if now - os.lstat(full).st_mtime <= min_age:
            continue
        except FileNotFoundError:
          continue
      elif n.startswith(".lock-"):
        if not os.path.exists(os.path.join(pdir, ".staging-" + n[6:])):
          _lock_is_free(full, unlink=True)
        continue
      else:
        continue
      # Another process's gc or prune (the store server writing a replica
      # beside this process's save) may remove the same entry meanwhile:
      # gone is reclaimed, by whoever got there first.
      try:
        nb = _du(full) if os.path.isdir(full) else os.lstat(full).st_size
      except FileNotFoundError:
        continue
      if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full, ignore_errors=True)
      else:
        try:
          os.unlink(full)
        except FileNotFoundError:
          pass
      if n.startswith(".staging-"):
        try:
          os.unlink(os.path.join(pdir, f".lock-{n[len('.staging-'):]}"))
        except FileNotFoundError:
          pass
      out["bytes"] += nb
      out["removed"].append(full)
  return out


def read_store_id(root: str) -> str | None:
  """The id in ``root/STORE_ID``, or None (never writes)."""
  try:
    with open(os.path.join(root, "STORE_ID")) as f:
      sid = f.read(200).strip()
  except (FileNotFoundError, NotADirectoryError):
    return None
  except OSError as e:
    raise StoreError(f"store {root}: STORE_ID is unreadable: {e}") from e
  return sid or None


def ensure_store_id(root: str) -> str:
  sid = read_store_id(root)
  if sid:
    return sid
  private.makedirs(root)
  sid = uuid.uuid4().hex
  path = os.path.join(root, "STORE_ID")
  tmp = f"{path}.{sid[:8]}"
  with private.open_private(tmp) as f:
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
  """Reads the snapshots of a store directory (never writes to it).

  Raises :class:`~tenplex_jax.errors.UnsafePathError` before reading
  anything if the directory, one above it or its ``procs/`` directories
  are another user's or writable by group or others
  (:func:`tenplex_jax.store.private.check_dir`).

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

  #: whether the store is on this host (a directory), as opposed to an
  #: object-storage bucket read over the network (see ``ObjectStore``)
  remote = False

  def __init__(self, root: str):
    self.root = os.path.abspath(root)
    private.check_dir(self.root)
    if not os.path.isdir(self.root):
      raise StoreError(f"store directory {self.root} does not exist")
    self._snap_manifests: dict[str, dict] = {}
    self._arrays: dict[str, Any] = {}
    self._lock = threading.Lock()

  # The file system primitives the read side uses (object stores override
  # them): list a directory, test a path, read a small file, CURRENT.

  def _listdir(self, path: str) -> list[str]:
    """The names in directory ``path``; OSError if it cannot be listed."""
    return os.listdir(path)

  def _exists(self, path: str) -> bool:
    return os.path.exists(path)

  def _read_small(self, path: str) -> bytes:
    """The bytes of a small file (a manifest); OSError if unreadable."""
    with open(path, "rb") as f:
      return f.read()

  def _current(self, pdir: str) -> str | None:
    """The snapshot name ``pdir/CURRENT`` names (see :func:`read_current`)."""
    return read_current(pdir)

  def identity(self) -> str:
    """What tells two handles of one store apart from other stores: its
    ``STORE_ID``, else its real path."""
    return read_store_id(self.root) or "dir:" + os.path.realpath(self.root)

  def is_store(self) -> bool:
    """Whether the directory is a store (has a ``STORE_ID`` or ``procs/``)."""
    return (os.path.isfile(os.path.join(self.root, "STORE_ID"))
            or os.path.isdir(os.path.join(self.root, "procs")))

  def require_store(self) -> None:
    """Raises :class:`StoreError` unless the directory is a store."""
    if not self.is_store():
      raise StoreError(f"{self.root} is not a tenplex_jax store (no STORE_ID"
                       " and no procs/ directory)")

  @property
  def store_id(self) -> str:
    """The store's id (``STORE_ID``); :class:`StoreError` if it has none."""
    sid = read_store_id(self.root)
    if sid is None:
      raise StoreError(f"{self.root} is not a tenplex_jax store (no"
                       " STORE_ID)")
    return sid

  def _pdir(self, proc: int) -> str:
    return os.path.join(self.root, "procs", str(int(proc)))

  def procs(self) -> list[int]:
    """Processes (of the saving job) with a committed snapshot here."""
    d = os.path.join(self.root, "procs")
    try:
      top = self._listdir(d)
    except OSError:
      return []
    out = []
    for n in top:
      if not (n.isdigit() and n.isascii()):
        continue
      try:
        names = self._listdir(os.path.join(d, n))
      except OSError:
        continue
      if "CURRENT" in names or any(_SNAP_NAME.fullmatch(x) for x in names):
        out.append(int(n))
    return sorted(out)

  def _names(self, proc: int) -> list[str]:
    """Process ``proc``'s committed snapshot names, oldest first."""
    try:
      names = self._listdir(self._pdir(proc))
    except OSError:
      return []
    return sorted((n for n in names if _SNAP_NAME.fullmatch(n)),
                  key=_snap_key)

  def rounds(self, proc: int) -> tuple[list[tuple[str, dict]], list[str]]:
    """Every kept snapshot of ``proc`` whose manifest checks out, oldest
    first, as ``(directory, manifest)``; and the problems found (a torn,
    edited or malformed manifest, a bad ``CURRENT``): such snapshots are
    left out, never used."""
    out, problems = [], []
    pdir = self._pdir(proc)
    try:
      self._current(pdir)
    except StoreError as e:
      problems.append(str(e))
    for n in self._names(proc):
      snap = os.path.join(pdir, n)
      try:
        m = self.snap_manifest(proc, snap)
      except StoreError as e:
        if self._exists(snap):  # not deleted meanwhile by a new commit
          problems.append(str(e))
        continue
      if (m["step"], int(m.get("seq", 0))) != _snap_key(n)[:2] and \
          m.get("version", 0) >= 3:
        problems.append(f"{snap}: the manifest's step/seq does not match"
                        " the snapshot's name")
        continue
      out.append((snap, m))
    return out, problems

  def all_rounds(self) -> tuple[dict[int, list[dict]], list[str]]:
    """Every good kept snapshot's manifest, per process (oldest first),
    and the problems found (see :meth:`rounds`)."""
    out, problems = {}, []
    for p in self.procs():
      got, probs = self.rounds(p)
      problems += probs
      if got:
        out[p] = [m for _, m in got]
    return out, problems

  def snapshots(self, proc: int) -> dict[int, str]:
    """Every committed snapshot of process ``proc`` held here: step ->
    snapshot directory (of a step saved in several rounds, the newest).

    Older snapshots are those :meth:`SnapshotWriter.commit` kept
    (``keep``); a snapshot deleted meanwhile by a newer commit is left out.
    """
    pdir = self._pdir(proc)
    return {_snap_key(n)[0]: os.path.join(pdir, n) for n in self._names(proc)
            if self._exists(os.path.join(pdir, n, "manifest.json"))}

  def snapshot_dir(self, proc: int, step: int | None = None,
                   round: str | None = None) -> str:
    """The directory of process ``proc``'s snapshot of round ``round``
    (see :func:`round_id`), else of ``step`` (its newest round), else its
    ``CURRENT`` snapshot."""
    pdir = self._pdir(proc)
    if round is not None:
      st = round.split(".", 1)[0]
      best = None
      for n in self._names(proc):
        if str(_snap_key(n)[0]) != st:
          continue
        snap = os.path.join(pdir, n)
        try:
          m = self.snap_manifest(proc, snap)
        except StoreError:
          continue
        if round_id(m) == round and (
            best is None or float(m.get("created", 0)) > best[0]):
          best = (float(m.get("created", 0)), snap)
      if best is not None:
        return best[1]
      raise StoreError(f"store {self.root} holds no snapshot of round"
                       f" {round!r} of process {proc}")
    cur = self._current(pdir)
    if cur is None:
      raise StoreError(f"store {self.root} holds no snapshot of process"
                       f" {proc} (it holds {self.procs()})")
    cur = os.path.join(pdir, cur)
    if step is None:
      return cur
    if _snap_key(os.path.basename(cur))[0] == int(step):
      return cur
    snap = self.snapshots(proc).get(int(step))
    if snap is None:
      raise StoreError(f"store {self.root} holds no snapshot of step {step}"
                       f" of process {proc} (it holds steps"
                       f" {sorted(self.snapshots(proc))})")
    return snap

  def manifest(self, proc: int | None = None, step: int | None = None,
               round: str | None = None) -> dict:
    """The manifest of process ``proc``'s snapshot of ``round`` or ``step``
    (default: its current snapshot; process default: the only or the
    lowest process held). Checked (see :func:`check_manifest`)."""
    if proc is None:
      procs = self.procs()
      if not procs:
        self.require_store()
        raise StoreError(f"store {self.root} is empty")
      proc = procs[0]
    return self.snap_manifest(proc, self.snapshot_dir(proc, step, round))

  def snap_manifest(self, proc: int, snap: str) -> dict:
    with self._lock:
      m = self._snap_manifests.get(snap)
    if m is None:
      m = self._read_manifest(proc, snap)
      with self._lock:
        self._snap_manifests[snap] = m
    return m

  def _read_manifest(self, proc: int, snap: str) -> dict:
    where = f"store {self.root}: manifest of process {proc} ({snap})"
    try:
      m = json.loads(self._read_small(os.path.join(snap, "manifest.json")))
    except (OSError, ValueError) as e:
      raise StoreError(f"{where} is unreadable: {e}") from e
    return check_manifest(m, where, proc=proc)

  def manifests(self) -> dict[int, dict]:
    """The manifest of each process's current snapshot."""
    return {p: self.manifest(p) for p in self.procs()}

  def all_manifests(self) -> dict[int, dict[int, dict]]:
    """Every kept snapshot's good manifest: process -> step -> manifest (a
    step saved in several rounds: the newest round)."""
    rounds, _ = self.all_rounds()
    return {p: dict(sorted({m["step"]: m for m in ms}.items()))
            for p, ms in rounds.items()}

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
    key = inside(snap, rel, f"store {self.root}")
    with self._lock:
      arr = self._arrays.get(key)
    if arr is None:
      import tensorstore as ts
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
                   step: int | None = None, round: str | None = None
                   ) -> np.ndarray:
    """Reads sub-box ``box`` of tensor ``path`` in its storage dtype (from
    the snapshot of ``round`` or ``step``, default: the current one).

    Raises:
      ChecksumError: a chunk fails its checksum.
      StoreError: the tensor or box is not held here.
    """
    proc, t, b, held, snap = self._locate(path, box, proc, step, round)
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
              step: int | None = None, round: str | None = None,
              maps: ChunkMaps | None = None
              ) -> tuple[int, dict, dict, Box, str]:
    """(proc, tensor entry, box entry, held box, snapshot directory) of the
    box containing ``box`` (in the snapshot of ``round`` or ``step``);
    ``maps``: those of the read, which find a round's snapshot directory
    once for all its pieces.

    Raises:
      UsageError: ``box`` is not a box of the tensor (wrong rank, a range
        outside the shape or reversed).
      StoreError: no box here contains it.
    """
    if proc is None:
      proc = self._proc_holding(path, box, step, round)
    if maps is not None and round is not None:
      snap = maps.memo((self.root, proc, round),
                       lambda: self.snapshot_dir(proc, step, round))
    else:
      snap = self.snapshot_dir(proc, step, round)
    m = self.snap_manifest(proc, snap)
    t = m["tensors"].get(path)
    if t is None:
      raise StoreError(f"store {self.root} (process {proc}) holds no tensor"
                       f" {path!r}")
    box = _check_box(box, t["shape"], path)
    for b in t["boxes"]:
      held = tuple(tuple(r) for r in b["box"])
      if len(box) == len(held) and all(
          h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(box, held)):
        return proc, t, b, held, snap
    raise StoreError(f"store {self.root} (process {proc}) holds no box of"
                     f" {path!r} containing {list(box)}")


  def storage_info(self, path: str, box: Box, *, proc: int | None = None,
                   step: int | None = None, round: str | None = None
                   ) -> tuple[np.dtype, tuple[int, ...], int | None, Box]:
    """(storage dtype, shape of ``box`` in storage, rows per chunk of the
    box holding it or None, that held box)."""
    proc, t, b, held, _ = self._locate(path, box, proc, step, round)
    shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
    return np.dtype(t["storage"]), shape, b.get("chunk_rows"), held

  def read_into(self, path: str, box: Box, dest: np.ndarray, *,
                proc: int | None = None, maps: ChunkMaps | None = None,
                step: int | None = None, round: str | None = None) -> int:
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
      round: the round of the snapshot to read (see :func:`round_id`;
        before ``step``).

    Returns:
      The bytes of ``box``.

    Raises:
      ChecksumError: a chunk fails its checksum (or has the wrong size).
      StoreError: the tensor or box is not held here, or a file is missing.
    """
    proc, t, b, held, snap = self._locate(path, box, proc, step, round,
                                          maps)
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
      dest[...] = self.read_storage(path, box, proc=proc, step=step,
                                    round=round)
      return dest.nbytes
    own = maps is None
    if own:
      maps = ChunkMaps()
    try:
      w = ChunkWalk.of(self.root, path, box, proc, t, b, held, snap, maps)
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
                    maps: ChunkMaps | None = None, step: int | None = None,
                    round: str | None = None) -> list:
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
    proc, t, b, held, snap = self._locate(path, box, proc, step, round,
                                          maps)
    extra = tuple(t["extra"])
    if math.prod(tuple(hi - lo for lo, hi in box) + extra) == 0:
      return []
    if "chunk_rows" not in b:
      return [self.read_storage(path, box, proc=proc, step=step,
                                round=round).reshape(-1)]
    if maps is None:
      maps = ChunkMaps()
    w = ChunkWalk.of(self.root, path, box, proc, t, b, held, snap, maps)
    out = []
    for c in w.chunks:
      data = maps.payload(c.fname, w.chunk_bytes, c.crc, c.what)
      if w.whole_rows:
        out.append(memoryview(data[(c.r0 - c.c0) * w.row_bytes:
                                   (c.r1 - c.c0) * w.row_bytes]))
      else:
        out.append(w.rows_of(data, c))
    return out

  def _proc_holding(self, path: str, box: Box, step: int | None = None,
                    round: str | None = None) -> int:
    for p in self.procs():
      try:
        t = self.manifest(p, step, round)["tensors"].get(path)
      except StoreError:
        continue
      if t is None:
        continue
      for b in t["boxes"]:
        held = b["box"]
        if len(held) == len(box) and all(
            h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(box, held)):
          return p
    raise StoreError(f"store {self.root} holds no box of {path!r} containing"
                     f" {list(box)}")

  def round_of(self, path: str, proc: int | None, step: int | None,
               round: str | None) -> list[tuple[int, str, dict]]:
    """The snapshots to read ``path`` from: ``(proc, round id, tensor
    entry)`` of every process's snapshot of one round (given, else the
    newest round here that holds ``path``: by step, then save time)."""
    procs = [proc] if proc is not None else self.procs()
    if round is None and (proc is not None or step is not None):
      p0 = proc if proc is not None else next(
          (p for p in procs if self._has(p, path, step)), None)
      if p0 is None:
        raise StoreError(f"store {self.root} holds no tensor {path!r}"
                         + ("" if step is None else f" at step {step}"))
      round = round_id(self.manifest(p0, step))
    if round is None:
      best = None
      for p in procs:
        for _, m in self.rounds(p)[0]:
          if path in m["tensors"]:
            key = (m["step"], float(m.get("created", 0)), m.get("seq", 0))
            if best is None or key > best[0]:
              best = (key, round_id(m))
      if best is None:
        self.require_store()
        raise StoreError(f"store {self.root} holds no tensor {path!r}")
      round = best[1]
    out = []
    for p in procs:
      try:
        m = self.manifest(p, round=round)
      except StoreError:
        continue
      if path in m["tensors"]:
        out.append((p, round, m["tensors"][path]))
    if not out:
      raise StoreError(f"store {self.root} holds no tensor {path!r} in"
                       f" round {round!r}")
    return out

  def _has(self, proc: int, path: str, step: int | None) -> bool:
    try:
      return path in self.manifest(proc, step)["tensors"]
    except StoreError:
      return False

  def read(self, path: str, index: Any = None, *, proc: int | None = None,
           step: int | None = None, round: str | None = None) -> np.ndarray:
    """Reads a sub-tensor by numpy-style index or string form ``"[:, 2:4]"``
    (default: the whole tensor), assembled from every box of one round
    that this store holds (of every process, or of ``proc``).

    The round: ``round``, else the newest of ``step``, else the newest
    here that holds ``path``. PRNG keys come back as their key data.

    Raises:
      StoreError: the store holds no such tensor, or the boxes it holds do
        not cover the range (names the boxes held and an element missing).
    """
    entries = self.round_of(path, proc, step, round)
    t = entries[0][2]
    box = parse_index(slice(None) if index is None else index, t["shape"]) \
        if t["shape"] else ()
    extra = tuple(t["extra"])
    shape = tuple(hi - lo for lo, hi in box)
    out = np.empty(shape + extra, np.dtype(t["storage"]))
    covered = np.zeros(shape, bool)
    held_all = []
    for p, rid, te in entries:
      for b in te["boxes"]:
        held = tuple(tuple(r) for r in b["box"])
        held_all.append(held)
        c = _intersect(box, held)
        if c is None:
          continue
        rel = tuple(slice(a - w0, z - w0) for (a, z), (w0, _) in zip(c, box))
        if covered[rel].all():
          continue
        if math.prod(z - a for a, z in c):
          self.read_into(path, c, out[rel], proc=p, round=rid)
        covered[rel] = True
    if not covered.all():
      miss = tuple(int(i) + lo for i, (lo, _) in
                   zip(np.argwhere(~covered)[0], box))
      raise StoreError(
          f"store {self.root} holds boxes {held_all[:8]} of {path!r}"
          f" (shape {t['shape']}), which do not cover {list(box)}: e.g."
          f" element {list(miss)} is held by another store")
    return from_storage(out, t["dtype"])

  def verify(self) -> list[str]:
    """Checks every kept snapshot: its manifest (checksum, structure) and
    ``CURRENT``, and every chunk of every box against its crc32c (trailer
    and manifest; format 1 snapshots: tensorstore's check and the manifest
    crc32); returns the problems. A snapshot that a save beside it deletes
    meanwhile (a new commit pruning older ones) is left out, not a problem.

    Raises:
      StoreError: the directory is not a store.
    """
    self.require_store()
    problems = []
    for p in self.procs():
      snaps, probs = self.rounds(p)
      problems += probs
      for snap, m in snaps:
        rid = round_id(m)
        for path, t in m["tensors"].items():
          for b in t["boxes"]:
            box = tuple(tuple(r) for r in b["box"])
            try:
              if "chunk_rows" in b:
                shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
                self.read_into(path, box, np.empty(shape, t["storage"]),
                               proc=p, round=rid)
                continue
              data = self.read_storage(path, box, proc=p, round=rid)
            except StoreError as e:
              if self._exists(snap):  # not deleted meanwhile by a new commit
                problems.append(str(e))
              continue
            if data.size and zlib.crc32(memoryview(
                np.ascontiguousarray(data)).cast("B")) != b["crc32"]:
              problems.append(f"{self.root}: {path} box {list(box)} (process"
                              f" {p}, {snap}) does not match its manifest"
                              " crc32")
    return problems


def _intersect(a: Box, b: Box) -> Box | None:
  out = []
  for (a0, a1), (b0, b1) in zip(a, b):
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi and not (a0 == a1 == b0 == b1):
      return None
    out.append((lo, max(lo, hi)))
  return tuple(out)


def _check_box(box: Any, shape: Sequence[int], path: str) -> Box:
  """``box`` as a box of a tensor of ``shape``, else :class:`UsageError`."""
  try:
    box = tuple((operator.index(a), operator.index(z)) for a, z in box)
  except (TypeError, ValueError):
    raise UsageError(f"{path}: {box!r} is not a box ((start, stop) per"
                     " dimension)") from None
  if len(box) != len(shape):
    raise UsageError(f"{path}: box {list(box)} has rank {len(box)}, the"
                     f" tensor has shape {list(shape)}")
  for d, ((a, z), n) in enumerate(zip(box, shape)):
    if not 0 <= a <= z <= n:
      raise UsageError(f"{path}: box {list(box)}: range {a}:{z} of"
                       f" dimension {d} is outside 0:{n}")
  return box
