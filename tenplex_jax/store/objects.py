"""Stores on object storage: ``s3://BUCKET/PREFIX`` and ``gs://BUCKET/PREFIX``.

The same layout as a store directory (``STORE_ID``, ``procs/<k>/<snapshot>/
manifest.json``, zarr3 chunk files with crc32c trailers, ``CURRENT``), one
object per file.

Writing (:func:`upload_snapshot`): :func:`tenplex_jax.store.save` writes
the snapshot into a local temporary directory as for a local store, then
uploads its chunk files, then its ``manifest.json``, then ``CURRENT``.
Object stores have no rename, so the manifest is the commit: readers see
only snapshots whose manifest exists, and the manifest is written after
every chunk it names. A save killed half-way leaves chunk objects without
a manifest, which no restore uses (the previous round stays the newest)
and :func:`gc_objects` deletes.

Reading (:class:`ObjectStore`): one listing when the handle opens; small
objects (manifests, ``CURRENT``, ``STORE_ID``) through tensorstore's ``s3``
kvstore on S3 (all of a store's at once when its rounds are listed), through
fsspec on GCS; chunk files through tensorstore's ``s3``/``gcs`` kvstore,
each fetched whole (a chunk
is at most 16 MiB and is checked against its crc32c before its bytes are
used) and only once per restore. Reading never creates or changes an
object.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from tenplex_jax.cloud import (KvListing, Listing, filesystem, fs_path,
                               kvstore_spec, location_error, split_url)
from tenplex_jax.errors import ChecksumError, StoreError
from tenplex_jax._hostmem import host_empty
from tenplex_jax.store.format import (ChunkMaps, ChunkWalk, HostStore, crc32c,
                                      is_snapshot_name, parse_current,
                                      snap_key, zarr_metadata)

# tensorstore loads in the functions that use it: ``tenplex-jax store
# serve`` imports this module (the CLI's) and never does.

__all__ = ["ObjectStore", "gc_objects", "upload_snapshot"]

# Chunk paths are resolved against this stand-in root (ChunkWalk checks that
# a box's directory stays inside its snapshot), then mapped to object keys.
_KEYROOT = "/tenplex-jax-object-keys"
_RETRIES = {"max_retries": 3, "initial_delay": "0.1s", "max_delay": "1s"}
_TIMEOUT_S = 120.0
# Chunk bytes a restore fetches ahead of its copies (announced by
# ObjectStore.prefetch): enough requests in flight to keep a server busy,
# and the restore's memory beyond its new shards bounded by it.
_AHEAD_BYTES = 256 << 20
_WHERES = 1 << 14  # boxes whose place ObjectStore._where remembers


class _Fetch:
  """One chunk object a restore announced (:meth:`ObjectStore.prefetch`):
  the announced reads still to use it, and, once started, its buffer and
  the tensorstore write that fills it."""

  __slots__ = ("fname", "walk", "ci", "crc", "what", "uses", "buf", "done",
               "checked", "dropped", "lock")

  def __init__(self, fname, walk, ci, crc, what):
    self.fname, self.walk, self.ci, self.crc, self.what = \
        fname, walk, ci, crc, what
    self.uses = 0
    self.buf = self.done = None
    self.checked = self.dropped = False
    self.lock = threading.Lock()

  @property
  def nbytes(self) -> int:
    return self.walk.chunk_bytes


class ObjectStore(HostStore):
  """Reads a store on object storage (never writes to it).

  Args:
    url: ``s3://BUCKET/PREFIX`` or ``gs://BUCKET/PREFIX``.

  Attributes:
    bytes_fetched: bytes read from the bucket by this handle (listings
      not counted; small objects read ahead counted once read).

  Raises:
    LocationError: the bucket does not exist, the credentials are refused
      or the server does not answer (one line naming the location).
  """

  remote = True

  def __init__(self, url: str):
    scheme, bucket, key = split_url(url)
    self.scheme = scheme
    self.root = self.url = f"{scheme}://{bucket}" + (f"/{key}" if key else "")
    self._snap_manifests: dict[str, dict] = {}
    self._arrays: dict[str, Any] = {}
    self._lock = threading.Lock()
    self._kv = None
    self._ctx = None
    self._zarrs: dict[str, Any] = {}  # box directory -> tensorstore array
    # Chunk objects announced by prefetch and not done with: their reads
    # start in announcement order, _AHEAD_BYTES at most ahead of the
    # copies, and each buffer is reused once its last read is done.
    self._fetches: dict[str, _Fetch] = {}
    self._queue: collections.deque = collections.deque()  # not started
    self._announced: collections.Counter = collections.Counter()
    self._ahead = 0  # bytes of started fetches not done with
    self._spare: dict[tuple, list] = {}  # free chunk buffers by shape
    self._chunk_bytes = 0
    self._wheres: dict[tuple, tuple] = {}  # see _where
    self._snap_names: dict[int, list[str]] = {}  # see _names
    # S3: listed and small objects read through the kvstore the chunks
    # use (tensorstore's threads, no SDK session to build). GCS: fsspec
    # (emulators ignore the offsets of tensorstore's GCS listing).
    self._tree = KvListing(self.root, self._kvstore(), _TIMEOUT_S) \
        if scheme == "s3" else Listing(self.root)
    self._prefetch_small([self.root + "/STORE_ID"])

  @property
  def bytes_fetched(self) -> int:
    return self._chunk_bytes + self._tree.bytes_read

  def _prefetch_small(self, urls) -> None:
    pre = getattr(self._tree, "prefetch", None)  # KvListing's
    if pre is not None:
      pre(urls)

  def all_rounds(self):
    # Every CURRENT and manifest it reads, requested at once (S3).
    urls = []
    for p in self.procs():
      pdir = self._pdir(p)
      urls.append(pdir + "/CURRENT")
      urls += [f"{pdir}/{n}/manifest.json" for n in self._names(p)]
    self._prefetch_small(urls)
    return super().all_rounds()

  def _rel(self, path: str) -> str:
    rel = self._tree.rel(path)
    if rel is None:
      raise StoreError(f"{path} is not inside store {self.root}")
    return rel

  def _listdir(self, path: str) -> list[str]:
    return self._tree.listdir(path)

  def _exists(self, path: str) -> bool:
    return self._tree.isfile(path) or self._tree.isdir(path)

  def _read_small(self, path: str) -> bytes:
    return self._tree.read(path)

  def _current(self, pdir: str) -> str | None:
    try:
      raw = self._read_small(pdir + "/CURRENT")
    except FileNotFoundError:
      return None
    return parse_current(raw[:4096], pdir)

  def _names(self, proc: int) -> list[str]:
    # Only committed snapshots: the manifest is written last. Of the
    # listing made when the handle opened, so found once per process.
    with self._lock:
      got = self._snap_names.get(proc)
    if got is None:
      pdir = self._pdir(proc)
      got = [n for n in super()._names(proc)
             if self._exists(f"{pdir}/{n}/manifest.json")]
      with self._lock:
        self._snap_names[proc] = got
    return list(got)

  def is_store(self) -> bool:
    return self._tree.isfile(self.root + "/STORE_ID") or \
        self._tree.isdir(self.root + "/procs")

  def require_store(self) -> None:
    if not self.is_store():
      raise StoreError(f"{self.root} is not a tenplex_jax store (no STORE_ID"
                       " and no procs/ objects)")

  @property
  def store_id(self) -> str:
    try:
      sid = self._read_small(self.root + "/STORE_ID")[:200].decode().strip()
    except (FileNotFoundError, UnicodeDecodeError):
      sid = ""
    if not sid:
      raise StoreError(f"{self.root} is not a tenplex_jax store (no"
                       " STORE_ID)")
    return sid

  def identity(self) -> str:
    try:
      return self.store_id
    except StoreError:
      return "url:" + self.root

  def _array(self, snap: str, rel: str):
    raise StoreError(f"store {self.root}: {snap} is in store format 1,"
                     " which object storage does not hold")

  def _kvstore(self):
    import tensorstore as ts
    ctx = self._context()  # the chunk reads' too: one connection pool
    with self._lock:
      if self._kv is None:
        try:
          self._kv = ts.KvStore.open(
              kvstore_spec(self.root), context=ctx).result(
                  timeout=_TIMEOUT_S)
        except Exception as e:
          raise location_error(self.root, e, "opening") from e
      return self._kv

  def _context(self):
    import tensorstore as ts
    with self._lock:
      if self._ctx is None:
        retries = "s3_request_retries" if self.scheme == "s3" \
            else "gcs_request_retries"
        self._ctx = ts.Context({retries: _RETRIES,
                                "cache_pool": {"total_bytes_limit": 0}})
      return self._ctx

  def _zarr(self, fname: str, w: ChunkWalk):
    """The box directory of chunk object ``fname`` as a tensorstore zarr3
    array (its metadata from the manifest: no request)."""
    d = fname.rsplit("/c/", 1)[0] if "/c/" in fname else fname[:-2]
    with self._lock:
      arr = self._zarrs.get(d)
    if arr is not None:
      return arr
    import tensorstore as ts
    meta = zarr_metadata(w.hshape, w.storage.name, w.storage.itemsize)
    meta["chunk_grid"]["configuration"]["chunk_shape"] = \
        [w.rows] + [max(1, n) for n in w.hshape[1:]]
    spec = {"driver": "zarr3", "kvstore": kvstore_spec(f"{self.root}/"
                                                       f"{self._rel(d)}"),
            "metadata": meta, "fill_missing_data_reads": False}
    try:
      arr = ts.open(spec, open=True, read=True, assume_metadata=True,
                    context=self._context()).result(timeout=_TIMEOUT_S)
    except Exception as e:
      raise location_error(d, e, "opening") from e
    with self._lock:
      return self._zarrs.setdefault(d, arr)

  def _start(self, f: _Fetch, buf: np.ndarray):
    """Starts filling ``buf`` (the chunk's shape) with chunk ``f.ci``:
    tensorstore reads the object whole, checks its crc32c trailer and
    writes its rows straight into ``buf`` (no intermediate copy)."""
    import tensorstore as ts
    w = f.walk
    lo = f.ci * w.rows
    hi = min(lo + w.rows, w.hshape[0])
    arr = self._zarr(f.fname, w)
    src = arr[lo:hi].translate_to[(0,) * w.ndim]
    with self._lock:
      self._chunk_bytes += w.chunk_bytes + 4
    return ts.array(buf[:hi - lo], copy=False, write=True).write(src)

  def _finish(self, f: _Fetch, buf: np.ndarray, done) -> np.ndarray:
    """Waits for ``done`` (filling ``buf``) and checks the chunk against the
    manifest's crc32c; returns its payload (uint8)."""
    w = f.walk
    try:
      done.result(timeout=_TIMEOUT_S)
    except StoreError:
      raise
    except Exception as e:
      msg = str(e)
      if "NOT_FOUND" in msg:
        raise StoreError(f"{f.what}: chunk object {f.fname} is missing"
                         ) from e
      if "DATA_LOSS" in msg or "Not enough data" in msg or \
          "Digest mismatch" in msg:
        raise ChecksumError(f"{f.what}: chunk checksum mismatch (crc32c):"
                            f" {msg[:200]}") from e
      raise location_error(f.fname, e, f"reading {f.what}") from e
    flat = buf.reshape(-1).view(np.uint8)
    valid = (min(f.ci * w.rows + w.rows, w.hshape[0]) - f.ci * w.rows) \
        * w.row_bytes
    # The object's padding rows are zeros (as written): part of the crc.
    got = crc32c(np.zeros(w.chunk_bytes - valid, np.uint8),
                 crc32c(flat[:valid])) if valid < w.chunk_bytes \
        else crc32c(flat)
    if got != f.crc:
      raise ChecksumError(f"{f.what}: chunk checksum mismatch (crc32c)")
    return flat

  def _buffer(self, w: ChunkWalk) -> np.ndarray:
    shape = (w.rows,) + w.hshape[1:]
    with self._lock:
      free = self._spare.get((shape, w.storage))
      if free:
        return free.pop()
    # From the recycled host buffers (a later restore reuses them too);
    # not populated here: tensorstore's threads fault its pages in as they
    # write, off the thread that announces the reads.
    return host_empty(shape, w.storage)

  def _pump(self) -> None:
    """Starts announced fetches in order while under ``_AHEAD_BYTES``."""
    while True:
      with self._lock:
        while self._queue and (self._queue[0].done is not None
                               or self._queue[0].dropped):
          self._queue.popleft()  # started by its read, or not needed
        if not self._queue or (self._ahead and
                               self._ahead + self._queue[0].nbytes
                               > _AHEAD_BYTES):
          return
        f = self._queue.popleft()
      self._begin(f)

  def _begin(self, f: _Fetch) -> None:
    with f.lock:
      if f.done is not None:
        return
      with self._lock:
        self._ahead += f.nbytes
      f.buf = self._buffer(f.walk)
      try:
        f.done = self._start(f, f.buf)
      except StoreError as e:
        f.done = _Failed(e)

  def _fetched(self, f: _Fetch) -> np.ndarray:
    """The checked payload of announced chunk ``f``, started now if the
    window has not reached it yet."""
    self._begin(f)
    with f.lock:
      if not f.checked:
        self._finish(f, f.buf, f.done)
        f.checked = True
      return f.buf.reshape(-1).view(np.uint8)

  def _used(self, f: _Fetch) -> None:
    """One announced read is done with ``f``; after the last its buffer is
    reused and the next announced fetch starts."""
    with self._lock:
      f.uses -= 1
      if f.uses > 0:
        return
      self._fetches.pop(f.fname, None)
      f.dropped = True
      if f.done is not None:
        self._ahead -= f.nbytes
        if f.checked:  # finished: nothing writes into it any more
          self._spare.setdefault(
              (f.buf.shape, f.buf.dtype), []).append(f.buf)
      f.buf = None
    self._pump()

  def _load_chunk(self, fname: str, chunk_bytes: int, crc: int,
                  what: str, w: ChunkWalk | None = None,
                  ci: int = 0) -> np.ndarray:
    """Fetches chunk object ``fname`` whole and checks it (size, crc32c
    trailer, the manifest's crc32c): a read nothing announced."""
    if w is not None and w.ndim:
      f = _Fetch(fname, w, ci, crc, what)
      buf = np.empty((w.rows,) + w.hshape[1:], w.storage)
      return self._finish(f, buf, self._start(f, buf))
    key = self._rel(fname)
    try:
      r = self._kvstore().read(key).result(timeout=_TIMEOUT_S)
    except Exception as e:
      raise location_error(fname, e, f"reading {what}") from e
    if r.state != "value":
      raise StoreError(f"{what}: chunk object {fname} is missing")
    data = np.frombuffer(r.value, np.uint8)
    with self._lock:
      self._chunk_bytes += data.nbytes
    if data.nbytes != chunk_bytes + 4:
      raise ChecksumError(f"{what}: chunk checksum mismatch: the chunk"
                          f" object has {data.nbytes} bytes, not"
                          f" {chunk_bytes + 4}")
    payload = data[:chunk_bytes]
    got = crc32c(payload)
    if got != int.from_bytes(data[chunk_bytes:].tobytes(), "little") \
        or got != crc:
      raise ChecksumError(f"{what}: chunk checksum mismatch (crc32c)")
    return payload

  def prefetch(self, path, box, *, proc=None, step=None, round=None
               ) -> None:
    """Announces a :meth:`read_into` of the same box: the chunk objects it
    needs are fetched in announcement order, each once, up to
    ``_AHEAD_BYTES`` ahead of the reads (each straight into a buffer that
    is reused once the last announced read of its chunk is done); that
    read then takes its bytes from there, and any error surfaces there. A
    restore announces every piece before reading, so that the transfer
    runs ahead of the copies and checks."""
    try:
      proc, t, b, held, snap, w = self._where(path, box, proc, step, round)
    except StoreError:  # read_into raises it with its context
      return
    if w is None or not w.ndim or 0 in w.hshape:
      return
    with self._lock:
      self._announced[_read_key(snap, path, box)] += 1
      for c in w.chunks:
        fname = snap + c.fname[len(_KEYROOT):]
        f = self._fetches.get(fname)
        if f is None:
          f = self._fetches[fname] = _Fetch(fname, w, c.c0 // w.rows,
                                            c.crc, c.what)
          self._queue.append(f)
        f.uses += 1
    self._pump()

  def _where(self, path, box, proc, step, round):
    """:meth:`_locate` and the box's :class:`ChunkWalk` (None: not in
    chunk files), remembered per handle: the listing and the manifests
    are read once when the handle opens, so the answer cannot change, and
    a restore asks twice per piece (:meth:`prefetch`, :meth:`read_into`):
    the snapshot's round, the box and the chunk list are found once."""
    key = (path, tuple(tuple(int(x) for x in r) for r in box), proc, step,
           round)
    with self._lock:
      got = self._wheres.get(key)
    if got is not None:
      return got
    proc, t, b, held, snap = self._locate(path, box, proc, step, round)
    w = ChunkWalk.of(self.root, path, box, proc, t, b, held, _KEYROOT) \
        if "chunk_rows" in b else None
    got = (proc, t, b, held, snap, w)
    with self._lock:
      if len(self._wheres) >= _WHERES:
        self._wheres.clear()
      self._wheres[key] = got
    return got

  def drop_prefetched(self) -> None:
    """Forgets the announced fetches no read took, and the spare buffers
    (after a restore)."""
    with self._lock:
      fetches = list(self._fetches.values())
      self._fetches.clear()
      self._queue.clear()
      self._announced.clear()
      self._ahead = 0
      self._spare.clear()
    for f in fetches:  # a buffer still being written stays tensorstore's
      f.dropped = True
      f.buf = None

  def read_into(self, path, box, dest, *, proc=None, maps=None, step=None,
                round=None) -> int:
    """Reads sub-box ``box`` of ``path`` (storage dtype) into ``dest``:
    each chunk it touches is fetched whole once per ``maps`` (one
    restore), checked, and its rows copied into ``dest``. See
    :meth:`HostStore.read_into`."""
    proc, t, b, held, snap, w = self._where(path, box, proc, step, round)
    storage = np.dtype(t["storage"])
    shape = tuple(hi - lo for lo, hi in box) + tuple(t["extra"])
    if dest.shape != shape or dest.dtype != storage:
      raise StoreError(f"{path} box {list(box)}: destination is"
                       f" {dest.dtype}{list(dest.shape)}, needs"
                       f" {storage}{list(shape)}")
    if 0 in shape:
      return 0
    if w is None:
      self._array(snap, b["dir"])
    maps = ChunkMaps() if maps is None else maps
    key = _read_key(snap, path, box)
    with self._lock:  # an announced read takes its chunks' fetches
      announced = self._announced.get(key, 0) > 0
      if announced:
        self._announced[key] -= 1
    for c in w.chunks:
      fname = snap + c.fname[len(_KEYROOT):]
      with self._lock:
        f = self._fetches.get(fname) if announced else None
      try:
        if f is not None:
          data = self._fetched(f)
        else:
          data = maps.payload(
              fname, w.chunk_bytes, c.crc, c.what,
              load=lambda *a, ci=c.c0 // w.rows: self._load_chunk(
                  *a, w=w, ci=ci))
        part = dest[c.r0 - w.lo:c.r1 - w.lo] if w.ndim else dest
        part[...] = w.rows_of(data, c) if w.ndim \
            else data.view(w.storage).reshape(())
      finally:
        if f is not None:
          self._used(f)
    return dest.nbytes

  def read_storage(self, path, box, *, proc=None, step=None, round=None
                   ) -> np.ndarray:
    """Reads sub-box ``box`` of ``path`` in its storage dtype (see
    :meth:`read_into`)."""
    _, t, _, _, _ = self._locate(path, box, proc, step, round)
    box = tuple(tuple(r) for r in box)
    out = np.empty(tuple(hi - lo for lo, hi in box) + tuple(t["extra"]),
                   np.dtype(t["storage"]))
    self.read_into(path, box, out, proc=proc, step=step, round=round)
    return out

  def read_segments(self, *args, **kwargs):
    raise StoreError(f"store {self.root}: a store server serves local"
                     " directories only")


def _read_key(snap: str, path: str, box) -> tuple:
  return snap, path, tuple(tuple(r) for r in box)


class _Failed:
  """A fetch that could not start: raises its error when waited for."""

  def __init__(self, error: Exception):
    self.error = error

  def result(self, timeout=None):
    raise self.error


def _walk(local: str):
  for d, _, files in os.walk(local):
    for f in sorted(files):
      full = os.path.join(d, f)
      yield full, os.path.relpath(full, local).replace(os.sep, "/")


def upload_snapshot(url: str, local_root: str, proc: int, local_snap: str,
                    *, keep: int) -> str:
  """Uploads a committed local snapshot of process ``proc`` (in store
  directory ``local_root``) to the store at ``url``; returns the snapshot's
  URL.

  Order: ``STORE_ID`` (a new id) if the store has none, every chunk object, then the
  manifest (the commit), then ``CURRENT``; then this process's snapshots
  beyond ``keep`` (and those of an abandoned run, as a local save) are
  deleted, each manifest first. An upload that fails raises
  :class:`LocationError` and commits nothing.
  """
  scheme, _, _ = split_url(url)
  fs = filesystem(scheme)
  base = fs_path(url)
  name = os.path.basename(local_snap)
  pkey = f"procs/{int(proc)}"
  try:
    if not fs.exists(f"{base}/STORE_ID"):  # a new store: its own id
      fs.pipe_file(f"{base}/STORE_ID", uuid.uuid4().hex.encode())
    files = [(full, rel) for full, rel in _walk(local_snap)
             if rel != "manifest.json"]
    if files:
      fs.put([f for f, _ in files],
             [f"{base}/{pkey}/{name}/{r}" for _, r in files])
    fs.put_file(os.path.join(local_snap, "manifest.json"),
                f"{base}/{pkey}/{name}/manifest.json")
    fs.put_file(os.path.join(local_root, pkey, "CURRENT"),
                f"{base}/{pkey}/CURRENT")
  except Exception as e:
    raise location_error(url, e, f"uploading snapshot {name}") from e
  _prune(url, fs, base, int(proc), name, keep)
  return f"{url}/{pkey}/{name}"


def _delete(fs, base: str, pkey: str, name: str) -> None:
  fs.rm_file(f"{base}/{pkey}/{name}/manifest.json")  # uncommit first
  fs.rm(f"{base}/{pkey}/{name}", recursive=True)


def _prune(url: str, fs, base: str, proc: int, current: str,
           keep: int) -> None:
  """As :func:`tenplex_jax.store.format.prune_snapshots`, on objects."""
  st = ObjectStore(url)
  pkey = f"procs/{proc}"
  pdir = f"{st.root}/{pkey}"
  step, seq, _ = snap_key(current)

  def run_of(n):
    try:
      return st.snap_manifest(proc, f"{pdir}/{n}").get("run", "")
    except StoreError:
      return None

  run = run_of(current)
  names = [n for n in st._names(proc) if n != current]
  went_back = any(snap_key(n)[0] > step for n in names)
  kept = []
  try:
    for n in names:
      st_, sq, _ = snap_key(n)
      if st_ > step or (st_ == step and (went_back or sq >= seq
                                         or run_of(n) != run)):
        _delete(fs, base, pkey, n)
      else:
        kept.append(n)
    kept.sort(key=snap_key)
    for n in (kept[:max(0, len(kept) + 1 - keep)] if keep else []):
      _delete(fs, base, pkey, n)
  except Exception as e:
    raise location_error(url, e, "deleting old snapshots") from e


def _mtime(info: dict) -> float:
  for k in ("LastModified", "updated", "mtime"):
    v = info.get(k)
    if v is None:
      continue
    if hasattr(v, "timestamp"):
      return v.timestamp()
    try:
      return datetime.datetime.fromisoformat(
          str(v).replace("Z", "+00:00")).timestamp()
    except ValueError:
      continue
  return time.time()


def gc_objects(url: str, *, min_age: float = 600.0) -> dict:
  """Deletes what interrupted saves left in the store at ``url``: the
  objects of snapshots without a manifest whose newest object is older
  than ``min_age`` seconds (younger ones may be uploads in progress).

  Returns:
    ``{"removed": [snapshot URLs], "bytes": bytes deleted}``.
  """
  scheme, _, _ = split_url(url)
  fs = filesystem(scheme)
  base = fs_path(url)
  try:
    infos = fs.find(f"{base}/procs", detail=True)
  except Exception as e:
    raise location_error(url, e, "listing") from e
  snaps: dict[str, list] = {}
  for full, info in infos.items():
    parts = full[len(base) + 1:].split("/")
    if len(parts) >= 4 and parts[0] == "procs" and is_snapshot_name(parts[2]):
      snaps.setdefault("/".join(parts[:3]), []).append((parts[3:], info))
  now = time.time()
  removed, nbytes = [], 0
  for key, objs in sorted(snaps.items()):
    if any(p == ["manifest.json"] for p, _ in objs):
      continue
    if now - max(_mtime(i) for _, i in objs) < min_age:
      continue
    try:
      fs.rm(f"{base}/{key}", recursive=True)
    except Exception as e:
      raise location_error(url, e, f"deleting {key}") from e
    removed.append(f"{url}/{key}")
    nbytes += sum(int(i.get("size") or 0) for _, i in objs)
  return {"removed": removed, "bytes": nbytes}
