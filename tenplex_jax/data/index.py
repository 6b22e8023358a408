"""The dataset index: per sample, (file id, byte offset, byte length) as int64.

An index covers ``.npy`` files, ``.npz`` archives (every member stored
uncompressed; each member is its own entry of the file table, named
``path::member``), record files (:mod:`tenplex_jax.data.records`) and
ArrayRecord files (:mod:`tenplex_jax.data.arrayrecord`; their records sit in
compressed chunks, so an entry is ``(file_id, record_index, byte_length)``
and the reader fetches the record by its index). An
array is split along axis 0: sample ``j`` of an array is its row ``j``, one
contiguous byte range. Samples are numbered in the order files (and npz
members) are given, rows in order.

On disk (:func:`save_index`) an index is two files in a directory:

* ``index.npy``: an ``(N, 3)`` int64 array of ``(file_id, offset, length)``,
  loaded memory-mapped, so offsets have no 4 GiB limit and N can be large;
* ``index.json``: the file table (path, npz member, kind, dtype, row shape,
  file size), ``num_samples`` and the ``fingerprint``.

The fingerprint is the sha256 of the file names (base names and members, so a
moved dataset keeps it), their kinds, sizes, dtypes and row shapes, and the
bytes of the index array. An iterator state records it, and restoring that
state over a different dataset fails with :class:`DataError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import threading
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tenplex_jax.data import arrayrecord as arrayrecord_lib
from tenplex_jax.data import records as records_lib
from tenplex_jax.errors import DataError

INDEX_ARRAY = "index.npy"
INDEX_HEADER = "index.json"
_FORMAT = "tenplex-data-index"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class FileEntry:
  """One entry of an index's file table.

  Attributes:
    path: the file's absolute path.
    member: the npz member name (without ``.npy``), or None.
    kind: ``"npy"``, ``"npz"``, ``"records"`` or ``"array_record"``.
    size: the file size in bytes when indexed.
    dtype: the row dtype as ``numpy.lib.format.dtype_to_descr`` (None for
      records and ArrayRecord records).
    row_shape: the shape of one sample (row), ``()`` for records.

  Example:
    >>> FileEntry(path="/d/b.npz", member="x", kind="npz", size=1, dtype="<f4").name
    'b.npz::x'
  """
  path: str
  member: str | None
  kind: str
  size: int
  dtype: Any = None
  row_shape: tuple[int, ...] = ()

  @property
  def name(self) -> str:
    """``basename`` or ``basename::member``; what the fingerprint hashes."""
    base = os.path.basename(self.path)
    return base if self.member is None else f"{base}::{self.member}"

  def to_json(self) -> dict:
    return {"path": self.path, "member": self.member, "kind": self.kind,
            "size": self.size, "dtype": self.dtype, "row_shape": list(self.row_shape)}

  @classmethod
  def from_json(cls, d: dict) -> FileEntry:
    return cls(path=d["path"], member=d["member"], kind=d["kind"], size=int(d["size"]),
               dtype=d["dtype"], row_shape=tuple(int(x) for x in d["row_shape"]))


@dataclasses.dataclass(frozen=True, eq=False)
class DatasetIndex:
  """A dataset index: a file table and an ``(N, 3)`` int64 array of byte ranges.

  Attributes:
    files: the file table; ``entries[:, 0]`` indexes into it.
    entries: ``(file_id, offset, length)`` per sample, int64 (maybe a memmap).
    fingerprint: sha256 hex of the file table and the entries
      (:func:`index_fingerprint`).

  Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "a.npy"), np.zeros((3, 2), np.float32))
    >>> idx = build_index([os.path.join(d, "a.npy")])
    >>> len(idx), idx.entries.dtype, idx.files[0].row_shape
    (3, dtype('int64'), (2,))
  """
  files: tuple[FileEntry, ...]
  entries: np.ndarray
  fingerprint: str

  @property
  def num_samples(self) -> int:
    """The number of samples N."""
    return int(self.entries.shape[0])

  def __len__(self) -> int:
    return self.num_samples


def index_fingerprint(files: Sequence[FileEntry], entries: np.ndarray) -> str:
  """The sha256 hex digest of a file table and its entries.

  Hashes, per file, its name (base name and member), kind, size, dtype and row
  shape, then the little-endian int64 bytes of ``entries``.

  Args:
    files: the file table.
    entries: the ``(N, 3)`` int64 entries.

  Returns:
    A 64-character hex string.

  Example:
    >>> f = FileEntry(path="/d/a.tpxr", member=None, kind="records", size=10)
    >>> e = np.array([[0, 8, 2]], dtype=np.int64)
    >>> len(index_fingerprint([f], e))
    64
    >>> index_fingerprint([f], e) == index_fingerprint([f], e + 1)
    False
  """
  h = hashlib.sha256()
  table = [[f.name, f.kind, f.size, f.dtype, list(f.row_shape)] for f in files]
  h.update(json.dumps(table, sort_keys=True).encode())
  arr = np.ascontiguousarray(entries, dtype="<i8")
  h.update(struct.pack("<q", arr.shape[0]))
  # Hash in chunks so a memory-mapped index is not copied whole.
  chunk = 1 << 20
  for start in range(0, arr.shape[0], chunk):
    h.update(arr[start:start + chunk].tobytes())
  return h.hexdigest()


def _read_npy_header(f, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  if version == (2, 0):
    return np.lib.format.read_array_header_2_0(f)
  raise DataError(f"{where}: unsupported .npy format version {version}; expected 1.0 or 2.0")


def _array_entries(f, where: str, base: int, size: int) -> tuple[Any, tuple[int, ...], list]:
  """Parses an npy header at the current position; returns dtype, row shape, ranges."""
  shape, fortran, dtype = _read_npy_header(f, where)
  data_start = f.tell()
  if dtype.hasobject:
    raise DataError(f"{where}: dtype {dtype} holds Python objects; expected a plain dtype")
  if len(shape) == 0:
    raise DataError(f"{where}: a 0-d array cannot be split into samples; expected ndim >= 1")
  if fortran and len(shape) > 1:
    raise DataError(
        f"{where}: Fortran-ordered array of shape {shape} has non-contiguous rows; "
        "expected C order (save np.ascontiguousarray(x))")
  row_shape = tuple(int(s) for s in shape[1:])
  row_bytes = int(dtype.itemsize) * int(np.prod(row_shape, dtype=np.int64))
  rows = int(shape[0])
  end = data_start + rows * row_bytes
  if base + end > size:
    raise DataError(
        f"{where}: header says {rows} rows of {row_bytes} bytes ending at byte "
        f"{base + end}, but the file has {size} bytes")
  offsets = base + data_start + np.arange(rows, dtype=np.int64) * np.int64(row_bytes)
  descr = np.lib.format.dtype_to_descr(dtype)
  return json.loads(json.dumps(descr)), row_shape, [(offsets, row_bytes)]


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


def _index_file(path: str) -> list[tuple[FileEntry, np.ndarray]]:
  size = os.path.getsize(path)
  out = []
  if path.endswith(".npy"):
    with open(path, "rb") as f:
      dtype, row_shape, [(offsets, row_bytes)] = _array_entries(f, path, 0, size)
    entry = FileEntry(path=path, member=None, kind="npy", size=size, dtype=dtype,
                      row_shape=row_shape)
    out.append((entry, _triples(offsets, row_bytes)))
  elif path.endswith(".npz"):
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
      for info in zf.infolist():
        where = f"{path}::{info.filename}"
        if info.compress_type != zipfile.ZIP_STORED:
          raise DataError(
              f"{where}: member is compressed; byte ranges need stored members "
              "(save with np.savez, not np.savez_compressed)")
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        sig, *_rest, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if sig != b"PK\x03\x04":
          raise DataError(f"{where}: bad zip local header signature {sig!r}")
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        f.seek(start)
        dtype, row_shape, [(offsets, row_bytes)] = _array_entries(f, where, 0, size)
        member = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        entry = FileEntry(path=path, member=member, kind="npz", size=size, dtype=dtype,
                          row_shape=row_shape)
        out.append((entry, _triples(offsets, row_bytes)))
  elif path.endswith(".tpxr"):
    ranges = np.array(list(records_lib.scan_records(path)), dtype=np.int64).reshape(-1, 2)
    trip = np.zeros((ranges.shape[0], 3), dtype=np.int64)
    trip[:, 1:] = ranges
    out.append((FileEntry(path=path, member=None, kind="records", size=size), trip))
  elif arrayrecord_lib.is_array_record(path):
    lengths = arrayrecord_lib.scan_array_record(path)
    trip = np.zeros((lengths.shape[0], 3), dtype=np.int64)
    trip[:, 1] = np.arange(lengths.shape[0])
    trip[:, 2] = lengths
    out.append((FileEntry(path=path, member=None, kind="array_record", size=size), trip))
  else:
    raise DataError(f"{path!r}: unknown file type; expected .npy, .npz, .tpxr (records) or "
                    ".array_record (ArrayRecord, optionally with a -NNNNN-of-NNNNN suffix)")
  return out


def _triples(offsets: np.ndarray, row_bytes: int) -> np.ndarray:
  trip = np.zeros((offsets.shape[0], 3), dtype=np.int64)
  trip[:, 1] = offsets
  trip[:, 2] = row_bytes
  return trip


def _sample_kind(f: FileEntry) -> str:
  if f.kind in ("records", "array_record"):
    return "a record (bytes)"
  dtype = np.lib.format.descr_to_dtype(f.dtype)
  return f"shape {tuple(f.row_shape)} dtype {dtype}"


def _check_uniform(files: Sequence[FileEntry], entries: np.ndarray) -> None:
  """Every sample of one dataset must have one shape and dtype (the
  iterator stacks samples into batches): raises :class:`DataError` naming
  the first file whose samples differ from the first file's, the global
  index of its first sample, and both shapes and dtypes.

  Example:
    >>> a = FileEntry("a.npy", None, "npy", 1, "<f4", (2,))
    >>> b = FileEntry("b.npy", None, "npy", 1, "<f4", (3,))
    >>> _check_uniform([a, b], np.array([[0, 0, 8], [1, 0, 12]]))
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.DataError: b.npy: sample 1 (its first) has shape (3,) dtype float32, but sample 0 (the first, in a.npy) has shape (2,) dtype float32; every sample of one dataset must have one shape and dtype (index the files as separate datasets, or reshape them)
  """
  if not files:
    return
  first = _sample_kind(files[0])
  for k, f in enumerate(files[1:], 1):
    if _sample_kind(f) == first:
      continue
    ids = np.asarray(entries[:, 0])
    at = np.flatnonzero(ids == k)
    sample = int(at[0]) if at.size else int(np.count_nonzero(ids < k))
    raise DataError(
        f"{f.name}: sample {sample} (its first) has {_sample_kind(f)}, but"
        f" sample 0 (the first, in {files[0].name}) has {first}; every"
        " sample of one dataset must have one shape and dtype (index the"
        " files as separate datasets, or reshape them)")


def build_index(paths: Sequence[str | os.PathLike], *,
                mixed: bool = False) -> DatasetIndex:
  """Builds the index of a list of ``.npy``, ``.npz``, ``.tpxr`` and ArrayRecord files.

  Only headers (npy headers, zip local headers, record length prefixes) are
  read, never whole arrays; an ArrayRecord file is read once (its records'
  lengths are not stored apart from the compressed chunks).

  Args:
    paths: the data files, in sample order.
    mixed: keyword-only; allow samples of different shapes, dtypes or kinds
      (records and arrays) in one index, for random access through
      :class:`DatasetReader` only: :class:`ElasticIterator` stacks samples
      into batches and cannot batch them. Default: refuse them.

  Returns:
    A :class:`DatasetIndex` held in memory (see :func:`save_index`).

  Raises:
    DataError: a file has an unknown type, a compressed npz member, an object
      dtype, a Fortran-ordered array, or a truncated body; or (unless
      ``mixed``) the samples of two files or npz members differ in shape or
      dtype (or records and arrays are mixed), naming the file, its first
      sample and both shapes and dtypes.

  Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "a.npy"), np.arange(6, dtype=np.int32).reshape(3, 2))
    >>> idx = build_index([os.path.join(d, "a.npy")])
    >>> idx.num_samples, idx.entries[1].tolist()
    (3, [0, 136, 8])
  """
  if not paths:
    raise DataError("build_index needs at least one file, got none")
  files: list[FileEntry] = []
  parts: list[np.ndarray] = []
  for p in paths:
    path = os.path.abspath(os.fspath(p))
    if not os.path.isfile(path):
      raise DataError(f"{os.fspath(p)!r} is not a file")
    for entry, trip in _index_file(path):
      trip[:, 0] = len(files)
      files.append(entry)
      parts.append(trip)
  entries = np.concatenate(parts, axis=0) if parts else np.zeros((0, 3), np.int64)
  if not mixed:
    _check_uniform(files, entries)
  return DatasetIndex(files=tuple(files), entries=entries,
                      fingerprint=index_fingerprint(files, entries))


def save_index(index: DatasetIndex, out_dir: str | os.PathLike) -> str:
  """Writes ``index.npy`` and ``index.json`` into ``out_dir`` (created if needed).

  Args:
    index: the index to save.
    out_dir: the directory.

  Returns:
    The directory path.

  Example:
    >>> import tempfile, os
    >>> from tenplex_jax.data.records import write_records
    >>> d = tempfile.mkdtemp()
    >>> _ = write_records(os.path.join(d, "r.tpxr"), [b"a", b"bc"])
    >>> idx = build_index([os.path.join(d, "r.tpxr")])
    >>> out = save_index(idx, os.path.join(d, "idx"))
    >>> load_index(out).fingerprint == idx.fingerprint
    True
  """
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  np.save(os.path.join(out_dir, INDEX_ARRAY), np.ascontiguousarray(index.entries, "<i8"))
  header = {"format": _FORMAT, "version": _VERSION, "num_samples": index.num_samples,
            "fingerprint": index.fingerprint, "files": [f.to_json() for f in index.files]}
  with open(os.path.join(out_dir, INDEX_HEADER), "w") as f:
    json.dump(header, f, indent=1)
  return out_dir


def load_index(index_dir: str | os.PathLike, *, data_root: str | os.PathLike | None = None,
               verify: bool = True) -> DatasetIndex:
  """Loads an index saved by :func:`save_index`; the entries are memory-mapped.

  Args:
    index_dir: the directory holding ``index.json`` and ``index.npy``.
    data_root: keyword-only; if given, data files are looked up as
      ``data_root/<base name>`` instead of their recorded paths (a moved dataset).
    verify: keyword-only; recompute the fingerprint and compare it with the
      recorded one (reads the whole index once).

  Returns:
    The :class:`DatasetIndex`.

  Raises:
    DataError: the header is not an index header, or the fingerprint differs.

  Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "a.npy"), np.zeros((4, 3)))
    >>> _ = save_index(build_index([os.path.join(d, "a.npy")]), d)
    >>> load_index(d).num_samples
    4
  """
  index_dir = os.fspath(index_dir)
  header_path = os.path.join(index_dir, INDEX_HEADER)
  try:
    with open(header_path) as f:
      header = json.load(f)
  except FileNotFoundError:
    raise DataError(f"no index at {index_dir!r}: {INDEX_HEADER} is missing") from None
  if header.get("format") != _FORMAT or header.get("version") != _VERSION:
    raise DataError(
        f"{header_path!r}: expected format {_FORMAT!r} version {_VERSION}, got "
        f"{header.get('format')!r} version {header.get('version')!r}")
  files = tuple(FileEntry.from_json(d) for d in header["files"])
  if data_root is not None:
    files = tuple(dataclasses.replace(f, path=os.path.join(os.fspath(data_root),
                                                           os.path.basename(f.path)))
                  for f in files)
  entries = np.load(os.path.join(index_dir, INDEX_ARRAY), mmap_mode="r")
  if entries.ndim != 2 or entries.shape[1] != 3 or entries.dtype != np.int64:
    raise DataError(
        f"{index_dir!r}: {INDEX_ARRAY} must be (N, 3) int64, got {entries.shape} {entries.dtype}")
  fingerprint = header["fingerprint"]
  if verify:
    actual = index_fingerprint(files, entries)
    if actual != fingerprint:
      raise DataError(
          f"{index_dir!r}: recorded fingerprint {fingerprint[:16]}... does not match the "
          f"index contents ({actual[:16]}...); the index files were changed")
  return DatasetIndex(files=files, entries=entries, fingerprint=fingerprint)


Fallback = Callable[[int], Any] | Any


class DatasetReader:
  """Random access to the samples of an index: ``len(reader)``, ``reader[i]``.

  Each ``reader[i]`` does one ranged read (``os.pread``) of sample ``i``'s
  bytes from its local file (an ArrayRecord record: one random-access read
  of its record index) and decodes it: a row of a plain array is a numpy
  array of the row shape; a row of a structured array is a dict of its fields;
  a record is ``bytes`` (or ``decode_record(bytes)``).

  Reader preference: the local file first; if it is missing or shorter than
  the index says, each of ``fallbacks`` in order (another host's reader, then
  remote storage): a fallback is a random-access source (``fallback[i]``) or a
  callable ``fallback(i)`` returning the decoded sample. ``stats`` counts
  reads per place. Reads are thread-safe.

  Args:
    index: a :class:`DatasetIndex` or a directory saved by :func:`save_index`.
    fallbacks: keyword-only; sources tried in order when the local read fails.
    decode_record: keyword-only; applied to record payloads.

  Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "a.npy"), np.arange(6).reshape(3, 2))
    >>> r = DatasetReader(build_index([os.path.join(d, "a.npy")]))
    >>> len(r), r[2].tolist(), r.stats["local"]
    (3, [4, 5], 1)
    >>> r.close()
  """

  def __init__(self, index: DatasetIndex | str | os.PathLike, *,
               fallbacks: Sequence[Fallback] = (),
               decode_record: Callable[[bytes], Any] | None = None):
    if not isinstance(index, DatasetIndex):
      index = load_index(index)
    self.index = index
    self.fallbacks = tuple(fallbacks)
    self.decode_record = decode_record
    self._dtypes = [None if f.dtype is None else np.lib.format.descr_to_dtype(f.dtype)
                    for f in index.files]
    # A plain ndarray view of the (maybe memory-mapped) entries: no copy, and
    # row lookups skip np.memmap's per-slice overhead.
    self._entries = np.asarray(index.entries)
    self._row_shapes = [f.row_shape for f in index.files]
    self._fds: dict[int, int] = {}
    self._ar_readers: dict[int, tuple[Any, threading.Lock]] = {}
    self._lock = threading.Lock()
    self.stats = {"local": 0, "fallback": [0] * len(self.fallbacks), "missing_local": 0}

  @property
  def fingerprint(self) -> str:
    """The index fingerprint (what an iterator state records)."""
    return self.index.fingerprint

  def __len__(self) -> int:
    return self.index.num_samples

  def _fd(self, file_id: int) -> int:
    fd = self._fds.get(file_id)
    if fd is None:
      with self._lock:
        fd = self._fds.get(file_id)
        if fd is None:
          fd = os.open(self.index.files[file_id].path, os.O_RDONLY)
          self._fds[file_id] = fd
    return fd

  def _check_id(self, i: Any) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise DataError(f"sample id must be an int, got {i!r} ({type(i).__name__})")
    n = self.index.num_samples
    if not 0 <= i < n:
      raise IndexError(f"sample id {i} out of range for a dataset of {n} samples")
    return int(i)

  def read_bytes(self, i: int) -> bytes:
    """The raw bytes of sample ``i`` from its local file (one ranged read).

    Args:
      i: the global sample id.

    Returns:
      The sample's bytes.

    Raises:
      OSError: the local file is missing or shorter than the index says.

    Example:
      >>> import tempfile, os
      >>> d = tempfile.mkdtemp()
      >>> np.save(os.path.join(d, "a.npy"), np.arange(4, dtype=np.uint8))
      >>> DatasetReader(build_index([os.path.join(d, "a.npy")])).read_bytes(3)
      b'\\x03'
    """
    i = self._check_id(i)
    return self._read(i)[1]

  def _ar_reader(self, file_id: int) -> tuple[Any, threading.Lock]:
    got = self._ar_readers.get(file_id)
    if got is None:
      with self._lock:
        got = self._ar_readers.get(file_id)
        if got is None:
          got = (arrayrecord_lib.open_reader(self.index.files[file_id].path),
                 threading.Lock())
          self._ar_readers[file_id] = got
    return got

  def _read_array_record(self, i: int, file_id: int, record: int, length: int) -> bytes:
    reader, lock = self._ar_reader(file_id)
    with lock:
      if record >= reader.num_records():
        raise OSError(f"{self.index.files[file_id].path!r}: sample {i} is record {record}, "
                      f"but the file has {reader.num_records()} records")
      (data,) = reader.read([record])
    if len(data) != length:
      raise OSError(f"{self.index.files[file_id].path!r}: record {record} (sample {i}) has "
                    f"{len(data)} bytes, but the index says {length}")
    return data

  def _read(self, i: int) -> tuple[int, bytes]:
    file_id, offset, length = self._entries[i].tolist()
    if self.index.files[file_id].kind == "array_record":
      return file_id, self._read_array_record(i, file_id, offset, length)
    fd = self._fd(file_id)
    chunks = []
    got = 0
    while got < length:
      chunk = os.pread(fd, length - got, offset + got)
      if not chunk:
        raise OSError(
            f"{self.index.files[file_id].path!r}: sample {i} needs bytes "
            f"[{offset}, {offset + length}) but the file ends before byte {offset + got + 1}")
      chunks.append(chunk)
      got += len(chunk)
    return file_id, (chunks[0] if len(chunks) == 1 else b"".join(chunks))

  def decode(self, i: int, data: bytes) -> Any:
    """Decodes sample ``i``'s bytes (a row array, a dict of fields, or a record).

    Example:
      >>> import tempfile, os
      >>> d = tempfile.mkdtemp()
      >>> np.save(os.path.join(d, "a.npy"), np.arange(4, dtype=np.uint8).reshape(2, 2))
      >>> r = DatasetReader(build_index([os.path.join(d, "a.npy")]))
      >>> r.decode(1, b"\\x07\\x08").tolist()
      [7, 8]
    """
    return self._decode(int(self._entries[i, 0]), data)

  def _decode(self, file_id: int, data: bytes) -> Any:
    dtype = self._dtypes[file_id]
    if dtype is None:
      return data if self.decode_record is None else self.decode_record(data)
    row = np.frombuffer(data, dtype=dtype).reshape(self._row_shapes[file_id])
    if dtype.names:
      return {name: np.array(row[name]) for name in dtype.names}
    return row.copy()

  def __getitem__(self, i: int) -> Any:
    i = self._check_id(i)
    try:
      file_id, data = self._read(i)
    except OSError as local_error:
      with self._lock:
        self.stats["missing_local"] += 1
      errors = [f"local: {local_error}"]
      for k, fb in enumerate(self.fallbacks):
        try:
          sample = fb(i) if callable(fb) and not hasattr(fb, "__getitem__") else fb[i]
        except Exception as e:  # noqa: BLE001 - try the next place, report all below
          errors.append(f"fallback {k}: {type(e).__name__}: {e}")
          continue
        with self._lock:
          self.stats["fallback"][k] += 1
        return sample
      raise DataError(f"sample {i} could not be read from any place: " + "; ".join(errors)) \
          from local_error
    with self._lock:
      self.stats["local"] += 1
    return self._decode(file_id, data)

  def close(self) -> None:
    """Closes the cached file descriptors and ArrayRecord readers."""
    with self._lock:
      for fd in self._fds.values():
        os.close(fd)
      self._fds.clear()
      for reader, lock in self._ar_readers.values():
        with lock:
          reader.close()
      self._ar_readers.clear()

  def __enter__(self) -> DatasetReader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
