"""Reading Orbax checkpoints: where the item is, what it holds, its boxes.

Layout of what current orbax-checkpoint writes (0.12), which this reads:

* a ``CheckpointManager`` directory holds one directory per step, named
  ``<step>`` (or ``<prefix>_<step>``, maybe zero padded), each with a
  ``_CHECKPOINT_METADATA`` file and one directory per item (``default``
  for a single ``StandardSave``/``PyTreeSave`` item);
* an *item* directory (also what ``StandardCheckpointer.save(path)``
  writes) holds ``_METADATA`` (the tree: per leaf its keys, value type and
  write shape; ``use_ocdbt``; ``use_zarr3``), ``_sharding`` (per leaf, keyed
  by the base64 of its parameter name ``a.b.c``, the saved sharding as JSON),
  ``array_metadatas/process_<i>`` (chunk shapes; ``random_key_impl`` of PRNG
  key arrays, stored as their ``uint32`` key data), and the arrays: with
  OCDBT one key-value store (``manifest.ocdbt`` plus ``d/`` and
  ``ocdbt.process_<i>/``), without it one directory per parameter; each
  array is zarr v3 (``zarr.json``) or zarr v2 (``.zarray``).

Everything here opens files read-only. A checkpoint may also be on object
storage (``s3://BUCKET/DIR``, ``gs://BUCKET/DIR``, e.g. uploaded object by
object with ``aws s3 sync``): its objects are listed once
(:class:`tenplex_jax.cloud.Listing`), the JSON files read through fsspec and
the arrays through tensorstore's ``s3``/``gcs`` kvstore (under ``ocdbt``
when the checkpoint uses it).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from tenplex_jax._targets import shared_names
from tenplex_jax.cloud import (Listing, download, kvstore_spec,
                               location_error)
from tenplex_jax.errors import StoreError, TreeError, UsageError
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.layout import (PTC, Box, Placement, TensorLayout,
                                named_placement)
from tenplex_jax.sources import PERSISTENT, Source, SourceTensor

__all__ = ["Location", "OrbaxSource", "inspect", "locate"]

_STEP_RE = re.compile(r"^(?:(.*)_)?(\d+)$")
_TMP = ".orbax-checkpoint-tmp"
_REMOTE_CACHE = 512 << 20  # decoded chunks kept when reading from a bucket
_MERGE_GAP = 1 << 20  # byte ranges of one object closer than this: one read
_WHOLE = 1 / 1.1  # an object whose needed part is at least this: read whole
_PART = 32 << 20  # a ranged read of a bucket object, at most
_STREAMS = 4  # objects (or ranged reads) fetched at once while staging
# How tensorstore reads a local checkpoint's files: mapped ("memmap"), so
# that zstd decodes straight from the page cache, instead of read(2) into a
# fresh buffer per chunk, a copy plus a page fault per 4 KiB of it (1 GiB
# restored: CPU 0.1-0.15 s less, about a third of the kernel time outside
# the new shards' own page faults; tensorstore maps files of about 1 MiB and
# more, smaller ones are still read). Checkpoint files are never modified once
# written (Orbax renames a finished step into place; deleting a file while
# it is mapped is safe); the staged copy of a bucket's checkpoint, which
# grows while it is read, is read with read(2).
_LOCAL_FILE_IO = {"mode": "memmap"}


@dataclasses.dataclass(frozen=True)
class Location:
  """Where an item of an Orbax checkpoint lives (see :func:`locate`).

  Attributes:
    item: the item directory (holds ``_METADATA`` and the arrays).
    step: the step, when the item sits in a step directory.
    step_dir: that step directory.
    manager_dir: the ``CheckpointManager`` directory holding it, if any.
  """

  item: str
  step: int | None = None
  step_dir: str | None = None
  manager_dir: str | None = None
  files: Any = dataclasses.field(default=None, compare=False, repr=False)


class _LocalFiles:
  """The local file system, as :class:`tenplex_jax.cloud.Listing` answers
  for a bucket."""

  isfile = staticmethod(os.path.isfile)
  isdir = staticmethod(os.path.isdir)
  listdir = staticmethod(os.listdir)

  @staticmethod
  def read(path: str) -> bytes:
    with open(path, "rb") as f:
      return f.read()


_LOCAL = _LocalFiles()


def _files_of(path) -> tuple[str, Any]:
  """(the path, absolute or a URL; its file system)."""
  loc = parse_location(path)
  if loc.kind == OBJECT:
    return loc.target, Listing(loc.target)
  if loc.kind != LOCAL:
    raise UsageError(f"{path}: an Orbax checkpoint is read from a directory,"
                     " s3://BUCKET/DIR or gs://BUCKET/DIR, not a store"
                     " server")
  return os.path.abspath(loc.target), _LOCAL


def _is_item(d: str, fs=_LOCAL) -> bool:
  return any(fs.isfile(os.path.join(d, f))
             for f in ("_METADATA", "manifest.ocdbt"))


def _items_of(d: str, fs=_LOCAL) -> list[str]:
  try:
    names = sorted(fs.listdir(d))
  except OSError:
    return []
  return [n for n in names if _TMP not in n
          and fs.isdir(os.path.join(d, n))
          and _is_item(os.path.join(d, n), fs)]


_COMMIT = "commit_success.txt"


def _steps_of(d: str, fs=_LOCAL, unfinished: dict | None = None
              ) -> dict[int, str]:
  """A ``CheckpointManager`` directory's finalized steps: ``{step: dir}``.

  As Orbax's own manager reads them: a step whose save is still running or
  failed is left out. Locally Orbax writes a step under a temporary name and
  renames it when done; on GCS it writes the step in place and
  ``commit_success.txt`` last, so a ``gs://`` step without that file is not
  finished. Such steps go to ``unfinished`` where given.
  """
  out = {}
  try:
    names = fs.listdir(d)
  except OSError:
    return out
  commit = parse_location(d).scheme == "gs"
  for n in names:
    m = _STEP_RE.match(n)
    full = os.path.join(d, n)
    if m and _TMP not in n and fs.isdir(full) and (
        _is_item(full, fs) or _items_of(full, fs)):
      if commit and not fs.isfile(os.path.join(full, _COMMIT)):
        if unfinished is not None:
          unfinished.setdefault(int(m.group(2)), full)
        continue
      out.setdefault(int(m.group(2)), full)
  return out


def _pick_item(step_dir: str, item: str | None, fs=_LOCAL) -> str:
  items = _items_of(step_dir, fs)
  if item is not None:
    if item not in items:
      where = os.path.join(step_dir, item)
      if fs.isdir(where):  # e.g. a JsonSave item of a Composite save
        raise UsageError(
            f"{where} holds no arrays (no _METADATA or manifest.ocdbt: not an"
            f" array item, such as a JsonSave item); items with arrays:"
            f" {items}")
      raise UsageError(f"{step_dir} has no item {item!r}; items: {items}")
    return os.path.join(step_dir, item)
  if "default" in items:
    return os.path.join(step_dir, "default")
  if len(items) == 1:
    return os.path.join(step_dir, items[0])
  raise UsageError(f"{step_dir} holds items {items}; name one with item=")


def locate(path: str, *, step: int | None = None,
           item: str | None = None) -> Location:
  """Finds the item directory of an Orbax checkpoint.

  Args:
    path: a ``CheckpointManager`` directory (its newest step, or ``step``),
      a step directory, or an item directory.
    step: the step to read from a manager directory.
    item: the item to read from a step (default: ``default``, or the only
      item).

  Returns:
    The :class:`Location`.

  Raises:
    UsageError: ``path`` is not an Orbax checkpoint, the step does not
      exist, or the item is ambiguous.

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> d = tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(d) as m:
    ...   for step in (5, 10):
    ...     _ = m.save(step, args=ocp.args.StandardSave({"w": jnp.ones(2)}))
    >>> loc = locate(d)
    >>> loc.step, os.path.relpath(loc.item, d), locate(d, step=5).step
    (10, '10/default', 5)
  """
  path, fs = _files_of(path)
  if not fs.isdir(path):
    raise UsageError(f"{path}: no such directory")

  def one_step(loc: Location, what: str) -> Location:
    # a step or item directory holds one step: a step= that names another
    # (or an item= naming another item of its step) is refused, never
    # ignored; a bare checkpoint directory has no step to contradict
    if step is not None and loc.step is not None and loc.step != step:
      raise UsageError(
          f"{path} is {what} of step {loc.step}, not step {step}; give the"
          " CheckpointManager directory to pick a step")
    if item is not None and what == "an item directory" \
        and loc.step_dir not in (None, loc.item) \
        and os.path.basename(path.rstrip("/")) != item:
      raise UsageError(
          f"{path} is the item {os.path.basename(path.rstrip('/'))!r}, not"
          f" {item!r}; give its step directory to pick an item")
    return loc

  if _is_item(path, fs):
    what = "an item directory"
    parent = os.path.dirname(path)
    m = _STEP_RE.match(os.path.basename(parent))
    if m and fs.isfile(os.path.join(parent, "_CHECKPOINT_METADATA")):
      return one_step(Location(path, int(m.group(2)), parent,
                               os.path.dirname(parent), fs), what)
    m = _STEP_RE.match(os.path.basename(path))
    if m and fs.isfile(os.path.join(path, "_CHECKPOINT_METADATA")) \
        and _steps_of(parent, fs):
      return one_step(Location(path, int(m.group(2)), path, parent, fs),
                      "the step directory")
    return one_step(Location(path, files=fs), what)
  unfinished: dict[int, str] = {}
  steps = _steps_of(path, fs, unfinished)
  if not steps and not unfinished and _items_of(path, fs):  # a step dir
    m = _STEP_RE.match(os.path.basename(path))
    return one_step(Location(_pick_item(path, item, fs),
                             int(m.group(2)) if m else None,
                             path, os.path.dirname(path) if m else None, fs),
                    "the step directory")
  if step in unfinished or (step is None and not steps and unfinished):
    n = step if step is not None else max(unfinished)
    raise UsageError(
        f"step {n} of {path} is not finished: no {_COMMIT} (its save is still"
        " running, or failed), so Orbax's CheckpointManager does not list it"
        " either; finished steps: " + str(sorted(steps)))
  if not steps:
    raise UsageError(
        f"{path} is not an Orbax checkpoint: no _METADATA or manifest.ocdbt"
        " (an item), no item directories (a step), no step directories (a"
        " CheckpointManager directory)")
  if step is None:
    step = max(steps)
  if step not in steps:
    raise UsageError(f"{path} has no step {step}; steps: {sorted(steps)}")
  d = steps[step]
  return Location(d if _is_item(d, fs) else _pick_item(d, item, fs), step, d,
                  path, fs)


def read_json(path: str, fs=None) -> Any:
  fs = _LOCAL if fs is None else fs
  try:
    return json.loads(fs.read(path))
  except FileNotFoundError:
    return None
  except StoreError:
    raise
  except (OSError, ValueError) as e:
    raise StoreError(f"{path}: cannot read: {e}") from e


def _key_extra(impl: str) -> tuple[tuple[int, ...], str]:
  k = jax.random.key(0, impl=impl)
  return tuple(jax.random.key_data(k).shape), str(k.dtype)


@dataclasses.dataclass
class TreeEntry:
  name: str  # key path name, '/'-joined
  param: str  # Orbax's parameter name, '.'-joined
  keys: list  # [{"key": ..., "key_type": ...}] as in _METADATA
  value_type: str


def _tree_entries(meta: Mapping | None, listed: list[str]) -> list[TreeEntry]:
  if meta and "tree_metadata" in meta:
    out = []
    for v in meta["tree_metadata"].values():
      keys = v.get("key_metadata") or []
      vm = v.get("value_metadata") or {}
      ks = [str(k["key"]) for k in keys]
      # "." only for a bare leaf (no keys); a key "" stays "" as in
      # key_path_name
      out.append(TreeEntry("/".join(ks) if keys else ".", ".".join(ks), keys,
                        str(vm.get("value_type"))))
    return out
  return [TreeEntry(p.replace(".", "/"), p,
                 [{"key": k, "key_type": 2} for k in p.split(".")],
                 "jax.Array") for p in listed]


ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


def _check_names(entries: list[TreeEntry], where: str) -> None:
  """Refuses a tree in which two saved leaves have one path name (a dict
  key holding ``/``, such as ``{"a/b": x, "a": {"b": y}}``): leaves are
  matched by ``/``-joined path, so one of them would be restored from the
  other's data."""
  clash = shared_names(
      (e.name, repr(tuple(str(k["key"]) for k in e.keys))) for e in entries)
  if clash:
    raise TreeError(
        f"{where}: saved leaves share a path name (a dict key holds '/'), "
        "so they cannot be told apart: " + "; ".join(
            f"{n!r} is each of {', '.join(ks)}" for n, ks in clash))


# tensorstore's threads that decode chunks and copy them into place, unless
# the caller asks for fewer (see ``copy_threads``).
COPY_THREADS = max(8, 2 * (os.cpu_count() or 1))


class OrbaxSource(Source):
  """An Orbax checkpoint item as a source of boxes (read through tensorstore,
  read-only).

  Its boxes are the saved chunks (Orbax writes one chunk per saved shard
  unless told otherwise); any box of any tensor can be read.

  Args:
    path: see :func:`locate`.
    step: the step of a manager directory (default: the newest).
    item: the item of a step (default: ``default`` or the only one).
    cache_bytes: tensorstore's cache of decoded chunks (0: none; on object
      storage 0 means 512 MiB, so that a chunk several new shards share is
      fetched once, not once per shard).
    copy_threads: tensorstore's threads that decode chunks and copy them
      into place (default ``COPY_THREADS``: 8, or 2 per core). Each keeps
      the buffers it decoded into in its own malloc arena once freed, so
      more threads than reads in flight only add memory (see
      :func:`tenplex_jax.orbax.restore`). Fewer than the default also
      bound local file reads at once to as many (else 64).

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> d = tempfile.mkdtemp() + "/ck"
    >>> c = ocp.StandardCheckpointer(); c.save(d, {"w": jnp.arange(6.0)})
    >>> c.wait_until_finished(); c.close()
    >>> with OrbaxSource(d) as src:
    ...   t = src.tensors()["w"]
    ...   out = np.empty(2, t.storage); src.read_into("w", ((2, 4),), out)
    >>> t.shape, t.dtype, out.tolist()
    ((6,), 'float32', [2.0, 3.0])
  """

  preference = PERSISTENT
  whole_boxes = True  # a chunk is decoded whole, whatever part is read
  # read_parts_async: the reads of parts of one chunk go in one tensorstore
  # batch, which reads and decodes the chunk once for all of them (also with
  # a cache limit of 0): each piece goes straight into place.
  shared_reads = True

  def __init__(self, path: str, *, step: int | None = None,
               item: str | None = None, cache_bytes: int = 0,
               copy_threads: int | None = None):
    self.location = locate(path, step=step, item=item)
    d = self.location.item
    self.fs = self.location.files or _LOCAL
    self.name = f"orbax:{d}"
    self.meta = read_json(os.path.join(d, "_METADATA"), self.fs)
    self.ocdbt = bool(self.meta.get("use_ocdbt", True)) if self.meta \
        else self.fs.isfile(os.path.join(d, "manifest.ocdbt"))
    zarr3 = self.meta.get("use_zarr3") if self.meta else None
    # Where the checkpoint says every chunk was written (those equal to the
    # fill value too, as Orbax writes them now), a chunk that is not there
    # is damage and a read of it an error, as in Orbax's restore; where it
    # does not say so (older checkpoints), such a chunk reads as zeros.
    self._all_chunks = bool(self.meta and self.meta.get(
        "store_array_data_equal_to_fill_value"))
    # Fewer decode threads than the default (a small restore): as few file
    # reads at once, whose buffers also stay in their threads' arenas.
    few = copy_threads is not None and copy_threads < COPY_THREADS
    self._ctx = ts.Context({
        "file_io_concurrency": {"limit": copy_threads if few else 64},
        "data_copy_concurrency": {"limit": copy_threads or COPY_THREADS},
        "cache_pool": {"total_bytes_limit": int(
            cache_bytes or (_REMOTE_CACHE if self.fs is not _LOCAL else 0))},
        "cache_pool#ocdbt": {"total_bytes_limit": 32 << 20},
        **({"file_io_mode": _LOCAL_FILE_IO} if self.fs is _LOCAL else {}),
    })
    listed = [] if self.meta else self._list_params()
    self.entries = _tree_entries(self.meta, listed)
    _check_names(self.entries, self.location.item)
    # Orbax's parameter name of each leaf, by path name (unique: checked)
    self.params = {e.name: e.param for e in self.entries}
    self.array_meta = self._array_metadatas()
    self.shardings = self._shardings()
    self._stores: dict[str, Any] = {}
    self._staged: dict[str, tuple[Any, frozenset]] = {}
    self._stage_dir: str | None = None
    self._run: _Staging | None = None
    self.staged_bytes = 0
    self._tensors: dict[str, SourceTensor] | None = None
    self._zarr3 = zarr3
    self.others = {e.name: e.value_type for e in self.entries
                   if e.value_type not in ARRAY_TYPES}
    self._values: dict[str, Any] | None = None

  def saved_values(self) -> dict[str, Any]:
    """The checkpoint's strings by path: Orbax writes them, whatever the
    array format, to the item's ``_strings.json`` keyed by parameter name
    (its ``StringHandler``); read on first use."""
    if self._values is None:
      names = {e.param: e.name for e in self.entries
               if e.value_type == "string"}
      raw = read_json(os.path.join(self.location.item, "_strings.json"),
                      self.fs) if names else None
      self._values = {names[p]: v for p, v in (raw or {}).items()
                      if p in names and isinstance(v, str)}
    return self._values

  # -- metadata ------------------------------------------------------------
  def _kvstore(self, param: str | None) -> dict:
    d = self.location.item
    remote = self.fs is not _LOCAL
    if self.ocdbt:
      kv = {"driver": "ocdbt",
            "base": kvstore_spec(d) if remote else f"file://{d}/",
            "cache_pool": "cache_pool#ocdbt"}
      if param is not None:
        kv["path"] = param + "/"
      return kv
    if remote:
      return kvstore_spec(os.path.join(d, param) if param else d)
    return {"driver": "file", "path": f"{d}/" + (f"{param}/" if param else "")}

  def _list_params(self) -> list[str]:
    if self.ocdbt:
      kv = ts.KvStore.open(self._kvstore(None), context=self._ctx).result()
      keys = [k.decode() for k in kv.list().result()]
    else:
      d, fs = self.location.item, self.fs
      keys = [f"{n}/{f}" for n in fs.listdir(d)
              if fs.isdir(os.path.join(d, n))
              for f in fs.listdir(os.path.join(d, n))]
    return sorted({k.rsplit("/", 1)[0] for k in keys
                   if k.endswith("/zarr.json") or k.endswith("/.zarray")})

  def _array_metadatas(self) -> dict[str, dict]:
    d = os.path.join(self.location.item, "array_metadatas")
    out = {}
    if self.fs.isdir(d):
      for n in sorted(self.fs.listdir(d)):
        m = read_json(os.path.join(d, n), self.fs) or {}
        for a in m.get("array_metadatas", []):
          a = a.get("array_metadata", a)
          out.setdefault(a.get("param_name"), a)
    return out

  def _shardings(self) -> dict[str, dict]:
    raw = read_json(os.path.join(self.location.item, "_sharding"),
                     self.fs) or {}
    out = {}
    for k, v in raw.items():
      try:
        param = base64.urlsafe_b64decode(k + "=" * (-len(k) % 4)).decode()
        out[param] = json.loads(v) if isinstance(v, str) else v
      except (ValueError, UnicodeDecodeError):
        continue
    return out

  def _spec(self, param: str, zarr3: bool) -> dict:
    return self._array_spec("zarr3" if zarr3 else "zarr",
                            self._kvstore(param))

  def _array_spec(self, driver: str, kvstore: dict) -> dict:
    """A tensorstore spec reading one array of this checkpoint (or of its
    staged local copy) through ``kvstore``."""
    return {"driver": driver, "kvstore": kvstore,
            "recheck_cached_data": False, "recheck_cached_metadata": False,
            **({"fill_missing_data_reads": False} if self._all_chunks
               else {})}

  def _open_all(self) -> None:
    arrays = [e for e in self.entries if e.value_type in ARRAY_TYPES]
    tries = [self._zarr3] if self._zarr3 is not None else [True, False]
    pending = {e.name: (e, [ts.open(self._spec(e.param, z), read=True,
                                    open=True, context=self._ctx)
                            for z in tries]) for e in arrays}
    tensors = {}
    for name, (e, futs) in pending.items():
      store, errs = None, []
      for f in futs:
        try:
          store = f.result()
          break
        except Exception as err:  # noqa: BLE001 - try the other zarr version
          errs.append(str(err))
      if store is None:
        raise StoreError(f"{self.location.item}: cannot open array {e.param}"
                         f" ({name}): {'; '.join(errs)}")
      self._stores[name] = store
      tensors[name] = self._tensor(e, store)
    self._tensors = tensors

  def _tensor(self, e: TreeEntry, store) -> SourceTensor:
    shape = tuple(int(n) for n in store.shape)
    storage = np.dtype(store.dtype.numpy_dtype)
    ext = (self.array_meta.get(e.param) or {}).get("ext_metadata") or {}
    impl = ext.get("random_key_impl")
    extra: tuple[int, ...] = ()
    dtype = storage.name
    if impl:
      extra, dtype = _key_extra(impl)
      shape = shape[:len(shape) - len(extra)]
    chunk = None
    try:
      chunk = store.chunk_layout.read_chunk.shape
    except (AttributeError, ValueError):
      pass
    if chunk is None or any(c is None for c in chunk):
      chunk = shape + extra
    chunk = tuple(max(1, int(c)) for c in chunk)[:len(shape)]
    return SourceTensor(e.name, shape, dtype, storage, extra,
                        _grid(shape, chunk), impl)

  def tensors(self) -> Mapping[str, SourceTensor]:
    if self._tensors is None:
      self._open_all()
    return self._tensors

  # -- staging (an OCDBT checkpoint on object storage) ----------------------
  @property
  def remote(self) -> bool:
    """Whether the checkpoint is on object storage."""
    return self.fs is not _LOCAL

  def stage(self, needs: Mapping[str, Any]) -> int:
    """Copies the parts of an OCDBT checkpoint on object storage that the
    boxes ``needs`` (tensor path -> boxes, logical coordinates) touch into
    a private local directory, with few large requests, and reads those
    tensors from there.

    OCDBT packs every chunk of a process into a few large data files; read
    chunk by chunk, a restore makes one ranged request per chunk (a
    thousand for 1 GiB), which S3-compatible servers that read a whole
    object to serve a range of it (moto) turn into minutes. Here the
    b-tree is read once (``tensorstore.ocdbt.dump``) to find each needed
    chunk's byte range; the ranges of one data file are merged across gaps
    under 1 MiB; a file of which at least 1/1.1 is needed is streamed whole
    in one request, any other gets one ranged request per merged range
    (cut at 32 MiB); the b-tree nodes and manifests come too. The local
    copy holds the fetched ranges at their offsets (sparse files), so
    tensorstore reads it as a local checkpoint; it is removed by
    :meth:`close`. A read of a chunk that was not staged goes to the
    bucket. Nothing is written to the bucket.

    The manifests and the files holding b-tree nodes are fetched before
    this returns; the chunks' bytes stream in the background, up to
    ``_STREAMS`` requests at once, while the restore reads: a read of a
    staged chunk waits until its bytes are in the local copy (a streamed
    file fills from its start), and :meth:`read_order` gives when each
    chunk is expected, so that :func:`tenplex_jax.assembly.assemble` reads
    chunks as they arrive (the transfer and the decoding overlap).

    Returns:
      The bytes it fetches (also ``staged_bytes``), some of them after it
      returns; 0 when there is nothing to stage (a local or non-OCDBT
      checkpoint, or no boxes).
    """
    if not self.remote or not self.ocdbt or self._stage_dir is not None:
      return 0
    tensors = self.tensors()
    want: dict[str, tuple[str, int, frozenset | None]] = {}
    for name, boxes in needs.items():
      t = tensors.get(name)
      if t is None:
        continue
      param = self.params[name]
      chunk = tuple(b - a for a, b in t.boxes[0]) if t.shape else ()
      ids = set()
      for box in boxes:
        if any(b <= a for a, b in box):
          continue
        ids.update(itertools.product(*[range(a // c, -(-b // c))
                                       for (a, b), c in zip(box, chunk)]))
      if ids or not t.shape:
        want[param] = (name, len(t.shape), frozenset(ids) if t.shape
                       else None)
    if not want:
      return 0
    d = self.location.item
    try:
      ranges, staged, where, node_files = self._chunk_ranges(d, want)
    except StoreError:
      raise
    except Exception as e:  # noqa: BLE001 - one line naming the location
      raise location_error(d, e, "reading the OCDBT b-tree") from e
    base = ts.KvStore.open(kvstore_spec(d), context=self._ctx).result()
    fetched = 0
    root_dir = tempfile.mkdtemp(prefix="tenplex-orbax-stage-")
    self._stage_dir = root_dir
    listing = self.fs
    prefix = listing.rel(d)
    pre = prefix + "/" if prefix else ""
    for rel in sorted(listing.files):  # the manifests, whole
      if rel.startswith(pre) and rel.rsplit("/", 1)[-1] == "manifest.ocdbt":
        local = os.path.join(root_dir, rel[len(pre):])
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fetched += download(os.path.join(d, rel[len(pre):]), local)
    # Jobs: ("whole", key, local, 0, size) streams an object;
    # ("part", key, local, lo, hi) is one ranged request.
    now: list[tuple] = []  # before the b-tree is opened: the nodes' files
    later: list[tuple] = []  # in the background
    for key, rs in sorted(ranges.items()):
      local = os.path.join(root_dir, key)
      os.makedirs(os.path.dirname(local), exist_ok=True)
      size = listing.sizes.get(pre + key)
      merged = _merge(rs, _MERGE_GAP)
      need = sum(b - a for a, b in merged)
      jobs = now if key in node_files else later
      if size is not None and need >= size * _WHOLE:
        jobs.append(("whole", key, local, 0, size))
        continue
      with open(local, "wb") as f:
        if size is not None:
          f.truncate(size)
      for a, b in merged:
        for lo in range(a, b, _PART):
          jobs.append(("part", key, local, lo, min(b, lo + _PART)))
    # Whole files first, the largest first (they take longest), then the
    # ranged parts in order.
    later.sort(key=lambda j: (j[0] != "whole", -(j[4] - j[3])))
    run = _Staging(d, base, later)
    try:
      for job in now:
        fetched += run.fetch(job)
    except BaseException:
      run.close()
      raise
    fetched += sum(hi - lo for _, _, _, lo, hi in later)
    # When each staged chunk is expected: the jobs run _STREAMS at a time in
    # order at equal rates; a streamed file's byte arrives at its offset.
    free = [0.0] * _STREAMS
    at: dict[str, list[tuple[int, int, float, int]]] = {}
    for i, (kind, key, _, lo, hi) in enumerate(later):
      w = free.index(min(free))
      start = free[w]
      free[w] += hi - lo
      at.setdefault(key, []).append((lo, hi, start, i))
    for name, chunks in where.items():
      marks = {}
      for idx, (key, lo, hi) in chunks.items():
        jobs = [(i, start, jlo, jhi) for jlo, jhi, start, i in at.get(key, ())
                if jlo < hi and lo < jhi]
        if not jobs:
          continue
        if later[jobs[0][0]][0] == "whole":  # a streamed file: its prefix
          i, start, _, _ = jobs[0]
          marks[idx] = ((i,), later[i][2], hi, start + hi)
        else:  # ranged parts: all of those it spans
          marks[idx] = (tuple(j[0] for j in jobs), None, hi,
                        max(start + jhi - jlo for _, start, jlo, jhi in jobs))
      run.marks[name] = marks
    self._run = run
    run.start()
    kv = {"driver": "ocdbt", "base": f"file://{root_dir}/"}
    futs = {}
    for param, (name, _, ids) in want.items():
      driver = self._stores[name].spec().to_json()["driver"]
      spec = self._array_spec(driver, dict(kv, path=param + "/"))
      futs[name] = (ts.open(spec, read=True, open=True,
                            context=self._stage_ctx()),
                    None if ids is None else frozenset(staged[name]))
    for name, (fut, ids) in futs.items():
      self._staged[name] = (fut.result(), ids)
    self.staged_bytes = fetched
    return fetched

  def read_order(self, path: str, index: int) -> float:
    """When box ``index`` of ``path`` is expected in the local copy while
    :meth:`stage` still fetches it (bytes fetched before it, as the jobs
    run); 0 for a box read from elsewhere."""
    run = self._run
    if run is None or path not in run.marks:
      return 0.0
    t = self.tensors()[path]
    chunk = tuple(b - a for a, b in t.boxes[0])
    idx = tuple(a // c for (a, _), c in zip(t.boxes[index], chunk))
    m = run.marks[path].get(idx)
    return 0.0 if m is None else m[3]

  def _chunk_ranges(self, d: str, want: Mapping
                    ) -> tuple[dict, dict, dict, set]:
    """Walks the OCDBT b-tree of item ``d`` once: the byte ranges (per
    object, relative to ``d``) of the b-tree nodes and of the chunks
    ``want`` names; per tensor the chunk indices found; per tensor and
    chunk index its (object, start, end); the objects holding b-tree
    nodes or metadata values (fetched before the local copy is opened)."""
    base = ts.KvStore.open(kvstore_spec(d), context=self._ctx).result()
    ranges: dict[str, list[tuple[int, int]]] = {}
    nodes: set[str] = set()

    def add(loc: str) -> tuple[str, int, int]:
      # "<kind>:<base path>:<file>:<offset>:<length>"
      head, off, n = loc.rsplit(":", 2)
      _, prefix, f = head.split(":", 2)
      r = (int(off), int(off) + int(n))
      ranges.setdefault(prefix + f, []).append(r)
      return prefix + f, r[0], r[1]

    manifest = ts.ocdbt.dump(base).result()
    for v in manifest.get("version_tree_nodes") or []:
      loc = v.get("location") if isinstance(v, dict) else None
      if loc:
        nodes.add(add(loc)[0])
    root = (manifest.get("versions") or [{}])[-1].get("root") or {}
    todo = [root["location"]] if root.get("location") else []
    staged: dict[str, set] = {name: set() for name, _, _ in want.values()}
    where: dict[str, dict] = {name: {} for name, _, _ in want.values()}
    while todo:
      loc = todo.pop()
      nodes.add(add(loc)[0])
      node = ts.ocdbt.dump(base, loc).result()
      prefix = node.get("key_prefix", b"")
      prefix = prefix.decode() if isinstance(prefix, bytes) else str(prefix)
      for e in node.get("entries", []):
        refs = [v for v in e.values() if isinstance(v, str)
                and v.startswith("btreenode:")]
        if refs:
          todo.extend(refs)
          continue
        ref = e.get("indirect_value")
        key = e.get("key", b"")
        key = prefix + (key.decode() if isinstance(key, bytes)
                        else str(key))
        param, _, suffix = key.rpartition("/")
        hit = want.get(param)
        if hit is None:
          continue
        name, rank, ids = hit
        idx = _chunk_index(suffix)
        if ids is not None and idx is not None and len(idx) >= rank:
          if idx[:rank] not in ids:
            continue
          staged[name].add(idx[:rank])
        if ref:
          loc = add(ref)
          if idx is not None and len(idx) >= rank:
            where[name][idx[:rank]] = loc
          elif idx is None:
            # A metadata value (zarr.json, .zarray) not inlined in the
            # b-tree (tensorstore's default inlines values of at most 100
            # bytes): the local copy is opened before the background jobs
            # fill it, so its file is fetched first, as the nodes' are.
            nodes.add(loc[0])
    return ranges, staged, where, nodes

  def _stage_ctx(self):
    import tensorstore as ts
    return ts.Context({
        "file_io_concurrency": {"limit": 64},
        "data_copy_concurrency": {"limit": COPY_THREADS},
        "cache_pool": {"total_bytes_limit": 0},
        "cache_pool#ocdbt": {"total_bytes_limit": 32 << 20},
    })

  # -- reading -------------------------------------------------------------
  def _view(self, path: str, box: Box, dtype: np.dtype):
    if self._tensors is None:
      self.tensors()
    store = self._stores[path]
    local = self._staged.get(path)
    if local is not None and box and local[1] is not None:
      t = self._tensors[path]
      chunk = tuple(b - a for a, b in t.boxes[0])
      ids = list(itertools.product(
          *[range(a // c, -(-b // c))
            for (a, b), c in zip(box[:len(chunk)], chunk)]))
      if all(i in local[1] for i in ids):
        self._run.wait(path, ids)
        store = local[0]
    elif local is not None:
      self._run.wait(path, [()])
      store = local[0]
    if box:
      store = store[tuple(slice(a, b) for a, b in box)]
    if store.rank:
      store = store.translate_to[0]
    if dtype != store.dtype.numpy_dtype:
      store = store.astype(dtype)
    return store

  def read_async(self, path: str, box: Box, out: np.ndarray):
    src = self._view(path, box, out.dtype)
    fut = ts.array(out, copy=False, write=True).write(src)
    return _Read(fut, self, path) if self._all_chunks else fut

  def read_parts_async(self, path: str, parts) -> list:
    # One batch: the chunk is read when it is submitted, once for all parts
    # (started one by one, a part whose read ended before the next one
    # started would read and decode the chunk again).
    batch = ts.Batch()
    try:
      futs = [ts.array(out, copy=False, write=True).write(
          self._view(path, box, out.dtype), batch=batch)
              for box, out in parts]
    finally:
      batch.submit()
    return [_Read(f, self, path) for f in futs] if self._all_chunks else futs

  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    self.read_async(path, box, out).result()

  def close(self) -> None:
    if self._run is not None:
      self._run.close()
      self._run = None
    self._stores.clear()
    self._staged.clear()
    self._tensors = None
    if self._stage_dir is not None:
      shutil.rmtree(self._stage_dir, ignore_errors=True)
      self._stage_dir = None

  # -- the saved layout ----------------------------------------------------
  def saved_layout(self) -> PTC | None:
    """The layout the arrays had when saved, from ``_sharding``, as a PTC
    (devices by the ids Orbax recorded; Orbax does not record which
    process held a device, so every device is given process 0); ``None``
    when no sharding is recorded."""
    out, devices = [], set()
    for name, t in self.tensors().items():
      param = self.params[name]
      desc = sharding_from_orbax(self.shardings.get(param), len(t.shape))
      if desc is None:
        continue
      if desc["kind"] == "single":
        placement = Placement((tuple((0, n) for n in t.shape),),
                              ((desc["device"],),))
      else:
        try:
          placement = named_placement(
              name, t.shape, tuple(zip(desc["axis_names"], desc["mesh_shape"])),
              tuple(tuple(s) if isinstance(s, list) else s
                    for s in desc["spec"]), tuple(desc["device_ids"]))
        except Exception:  # noqa: BLE001 - a spec this cannot model
          continue
      devices.update(d for h in placement.holders for d in h)
      itemsize = t.storage.itemsize * math.prod(t.extra)
      out.append(TensorLayout(name, t.shape, t.dtype, itemsize, placement,
                              desc))
    if not out:
      return None
    return PTC(tuple(out), tuple((d, 0) for d in sorted(devices)))


class _Read:
  """A read's future whose ``result()`` names the leaf of a chunk that is
  missing from a checkpoint that says it wrote every chunk (tensorstore's
  ``NOT_FOUND``), as a :class:`StoreError`; any other error as it is."""

  __slots__ = ("fut", "src", "path")

  def __init__(self, fut, src: OrbaxSource, path: str):
    self.fut, self.src, self.path = fut, src, path

  def result(self):
    try:
      return self.fut.result()
    except ValueError as e:
      if not str(e).startswith("NOT_FOUND"):
        raise
      raise StoreError(
          f"{self.src.location.item}: leaf {self.path} (array"
          f" {self.src.params.get(self.path, self.path)}): a"
          f" chunk is missing, though the checkpoint says every chunk was"
          f" written (store_array_data_equal_to_fill_value): the checkpoint"
          f" is damaged or incomplete, and Orbax's restore refuses it too"
          f" ({e})") from e


class _Cancelled(Exception):
  """Internal: the staging was closed while a file still streamed."""


class _Staging:
  """The background fetches of :meth:`OrbaxSource.stage`: runs the jobs
  ``_STREAMS`` at a time, and tells a read when its chunks are there.

  ``marks[tensor][chunk index]`` is ``(jobs, streamed file or None, end,
  expected)``: the chunk is there once the jobs ``jobs`` ended, or, for a
  streamed file, once the file holds its first ``end`` bytes.
  """

  def __init__(self, item: str, base, jobs: list[tuple]):
    self.item = item
    self.base = base
    self.jobs = jobs
    self.marks: dict[str, dict] = {}
    self.done: set[int] = set()
    self.error: BaseException | None = None
    self.cond = threading.Condition()
    self.waiting: dict[str, int] = {}  # streamed file -> bytes a read needs
    self.closed = False
    self.pool: cf.ThreadPoolExecutor | None = None
    self.futures: list = []

  def start(self) -> None:
    if not self.jobs:
      return
    self.pool = cf.ThreadPoolExecutor(min(_STREAMS, len(self.jobs)),
                                      thread_name_prefix="tenplex-stage")
    self.futures = [self.pool.submit(self._run, i)
                    for i in range(len(self.jobs))]

  def _progress_of(self, local: str):
    """The progress callback of the stream into ``local``: wakes a reader
    only once the bytes it waits for are there (not at every block)."""

    def progress() -> None:
      if self.closed:
        raise _Cancelled()
      need = self.waiting.get(local)
      if need is not None and _size(local) >= need:
        with self.cond:
          self.cond.notify_all()

    return progress

  def fetch(self, job: tuple, progress=None) -> int:
    """Fetches one job now; the bytes fetched."""
    kind, key, local, lo, hi = job
    url = os.path.join(self.item, key)
    if kind == "whole":
      return download(url, local, progress)
    try:
      r = self.base.read(key, byte_range=slice(lo, hi)).result()
    except Exception as e:  # noqa: BLE001 - one line naming the object
      raise location_error(url, e, "reading") from e
    if r.state != "value" or len(r.value) != hi - lo:
      raise StoreError(f"{url}: bytes {lo}-{hi} of the checkpoint's"
                       f" data file could not be read ({r.state},"
                       f" {len(r.value)} bytes)")
    fd = os.open(local, os.O_WRONLY)
    try:
      os.pwrite(fd, r.value, lo)
    finally:
      os.close(fd)
    return hi - lo

  def _run(self, i: int) -> None:
    try:
      if self.closed or self.error is not None:
        return
      self.fetch(self.jobs[i], self._progress_of(self.jobs[i][2]))
      with self.cond:
        self.done.add(i)
        self.cond.notify_all()
    except BaseException as e:  # noqa: BLE001 - handed to the reader
      with self.cond:
        if self.error is None and not self.closed:
          self.error = e
        self.cond.notify_all()

  def wait(self, path: str, ids) -> None:
    """Waits until the chunks ``ids`` of tensor ``path`` are there."""
    marks = self.marks.get(path)
    if not marks:
      return
    with self.cond:
      for idx in ids:
        m = marks.get(idx)
        if m is None:
          continue
        jobs, streamed, end, _ = m
        while not self.done.issuperset(jobs):
          if self.error is not None:
            raise StoreError(f"{self.item}: staging the checkpoint"
                             f" failed: {self.error}") from self.error
          if streamed is not None:
            if _size(streamed) >= end:
              break
            self.waiting[streamed] = end
          self.cond.wait(0.05)
        if streamed is not None:
          self.waiting.pop(streamed, None)

  def close(self) -> None:
    """Stops the fetches (a streamed file at its next block) and waits
    for them."""
    self.closed = True
    if self.pool is not None:
      for f in self.futures:
        f.cancel()
      self.pool.shutdown(wait=True)
      self.pool = None


def _size(path: str) -> int:
  try:
    return os.stat(path).st_size
  except FileNotFoundError:
    return 0


def _chunk_index(suffix: str) -> tuple[int, ...] | None:
  """The grid index in a zarr chunk key's last part (``1.0``, ``1/0``,
  ``c/1/0``, ``c.1.0``); None for a metadata key."""
  if suffix == "c":
    return ()
  if suffix[:2] in ("c/", "c."):
    suffix = suffix[2:]
  try:
    return tuple(int(p) for p in re.split(r"[./]", suffix))
  except ValueError:
    return None


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
  """Sorted byte ranges, overlapping ones and those closer than ``gap``
  merged."""
  out: list[list[int]] = []
  for a, b in sorted(ranges):
    if out and a <= out[-1][1] + gap:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def _grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[Box, ...]:
  ranges = []
  for n, c in zip(shape, chunk):
    ranges.append([(a, min(a + c, n)) for a in range(0, n, c)] or [(0, 0)])
  return tuple(itertools.product(*ranges))


def sharding_from_orbax(s: Mapping | None, ndim: int | None = None
                        ) -> dict | None:
  """Orbax's sharding JSON -> tenplex_jax's sharding description.

  ``ndim``: the logical rank; a PRNG key array's recorded spec (of its key
  data) loses its trailing unsharded entries.
  """
  if not s:
    return None
  kind = s.get("sharding_type")
  if kind == "NamedSharding":
    spec = list(s.get("partition_spec") or [])
    if ndim is not None:
      while len(spec) > ndim and spec[-1] is None:
        spec.pop()
    ids = np.array(_mesh_ids(s["device_mesh"]["mesh"]))
    return {"kind": "named", "axis_names": list(s["axis_names"]),
            "mesh_shape": [int(n) for n in s["shape"]],
            "device_ids": [int(i) for i in ids.reshape(-1)],
            "axis_types": [str(t).split(".")[-1]
                           for t in s.get("axis_types") or []] or None,
            "spec": spec,
            "memory_kind": s.get("memory_kind")}
  if kind == "SingleDeviceSharding":
    m = re.search(r"(\d+)$", str(s.get("device_str", "")))
    if m:
      return {"kind": "single", "device": int(m.group(1)),
              "memory_kind": s.get("memory_kind")}
  return None


def _mesh_ids(mesh):
  if isinstance(mesh, dict):
    return int(mesh["id"])
  return [_mesh_ids(m) for m in mesh]


def _spec_text(desc: Mapping | None) -> str:
  if desc is None:
    return "-"
  if desc["kind"] == "single":
    return f"device {desc['device']}"
  mesh = "x".join(f"{a}={n}" for a, n in zip(desc["axis_names"],
                                             desc["mesh_shape"]))
  spec = ", ".join("None" if e is None else (e if isinstance(e, str)
                                             else "(" + ",".join(e) + ")")
                   for e in desc["spec"])
  return f"P({spec}) on {mesh}"


def inspect(path: str, *, step: int | None = None,
            item: str | None = None) -> dict:
  """Describes an Orbax checkpoint without modifying it.

  Args:
    path: a ``CheckpointManager`` directory (newest step), a step directory
      or an item directory.
    step: the step of a manager directory.
    item: the item of a step.

  Returns:
    A JSON-able dict: ``item``, ``step`` (int or None), ``steps`` (of the
    manager directory), ``format`` (``ocdbt``, ``zarr``, ``handler``),
    ``tensors`` (per key path: ``shape``, ``dtype``, ``storage_dtype``,
    ``chunk_shape``, ``chunks``, ``nbytes``, ``sharding`` (tenplex_jax's
    description of the saved sharding, or None), ``spec`` (readable)),
    ``others`` (non-array leaves and their Orbax value type), ``nbytes``,
    and ``layout``: the saved layout as PTC JSON (a dict), or None.

  Example:
    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> d = tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(d) as m:
    ...   _ = m.save(7, args=ocp.args.StandardSave({"w": jnp.ones((4, 2))}))
    >>> info = inspect(d)
    >>> info["step"], info["tensors"]["w"]["shape"], info["nbytes"]
    (7, [4, 2], 32)
  """
  with OrbaxSource(path, step=step, item=item) as src:
    tensors = {}
    for name, t in src.tensors().items():
      param = src.params[name]
      desc = sharding_from_orbax(src.shardings.get(param), len(t.shape))
      chunk = [b - a for a, b in t.boxes[0]] if t.boxes else []
      tensors[name] = {
          "shape": list(t.shape), "dtype": t.dtype,
          "storage_dtype": t.storage.name, "param": param,
          "chunk_shape": chunk, "chunks": len(t.boxes),
          "nbytes": t.nbytes, "sharding": desc, "spec": _spec_text(desc),
          **({"key_impl": t.key_impl} if t.key_impl else {})}
    layout = src.saved_layout()
    loc = src.location
    zarr = (3 if src._zarr3 else 2) if src._zarr3 is not None else None
    if zarr is None and src._stores:
      zarr = 3 if next(iter(src._stores.values())).spec().to_json()[
          "driver"] == "zarr3" else 2
    ck = read_json(os.path.join(loc.step_dir or loc.item,
                                 "_CHECKPOINT_METADATA"), src.fs) or {}
    unfinished: dict[int, str] = {}
    steps = (sorted(_steps_of(loc.manager_dir, src.fs, unfinished))
             if loc.manager_dir else None)
    return {
        "item": loc.item, "step": loc.step, "steps": steps,
        # saves still running or failed (gs:// steps without their commit
        # file), which neither Orbax's manager nor restore reads
        **({"unfinished_steps": sorted(unfinished)} if unfinished else {}),
        "format": {"ocdbt": src.ocdbt, "zarr": zarr,
                   "handler": ck.get("item_handlers")},
        "tensors": tensors, "others": src.others,
        "nbytes": sum(t["nbytes"] for t in tensors.values()),
        "layout": None if layout is None else json.loads(layout.to_json()),
    }
