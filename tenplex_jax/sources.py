"""Sources of boxes: the places a box of a tensor can be read from.

A *source* holds some boxes of some tensors (a live array's shards, a host
store, a peer's store server, a store replica, an Orbax checkpoint) and can
read any sub-box of a box it holds into a caller's buffer. Restoring onto a
target layout is then the same for every source (see :func:`assemble`):

  plan(source layout, target layout) -> for each distinct new box this
  process's devices hold, its pieces (one per source box it overlaps) ->
  read every piece into its place in one host buffer per new box -> place
  the buffers on the devices.

Implemented here: the interface (:class:`Source`, :class:`SourceTensor`);
the sources :class:`StoreSource` (one round of a store directory) and
:class:`StoreCopy` (one old process's snapshot in this host's store or a
peer's store server; :class:`tenplex_jax.orbax.OrbaxSource` reads an Orbax
checkpoint); and the steps every restore shares: :func:`fetch_pieces`
(read each piece from its ranked sources, falling back to the next one),
:func:`place` (host buffers -> arrays, one batched transfer),
:func:`host_buffer`, and :func:`assemble` (the whole restore over one
source). ``tenplex_jax.store.restore`` ranks :class:`StoreCopy` objects per
piece and uses :func:`fetch_pieces` and :func:`place`.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures as cf
import dataclasses
import math
import mmap
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenplex_jax._targets import match_saved, raise_tree_problems
from tenplex_jax.errors import NoCopyError, StoreError, UnreachableError
from tenplex_jax.layout import (PTC, Box, Placement, TensorLayout, box_volume,
                                relative_index)
from tenplex_jax.plain import decode_plain
from tenplex_jax.planner import plan
from tenplex_jax.reshard import key_data_sharding

__all__ = ["AssembleReport", "Source", "SourceTensor", "StoreCopy",
           "StoreSource", "assemble", "fetch_pieces", "host_buffer",
           "match_target", "place"]

# Preference of a source kind (lower first) when several hold a piece.
DEVICE, HOST, PEER, REPLICA, PERSISTENT = range(5)


@dataclasses.dataclass(frozen=True)
class SourceTensor:
  """One tensor as a source holds it.

  Attributes:
    path: the key path name (``params/Dense_0/kernel``).
    shape: the logical shape (a PRNG key array's shape, without key data).
    dtype: the logical dtype's name (``float32``, ``bfloat16``, ``key<fry>``).
    storage: the numpy dtype of the stored elements (``uint32`` key data).
    extra: trailing stored dimensions beyond ``shape`` (key data: ``(2,)``).
    boxes: the boxes the source can read cheaply, tiling ``shape`` (for a
      checkpoint: its chunks); any sub-box of one of them can be read.
    key_impl: the PRNG implementation (``threefry2x32``) of a key array.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  storage: np.dtype
  extra: tuple[int, ...] = ()
  boxes: tuple[Box, ...] = ()
  key_impl: str | None = None

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape + self.extra) * self.storage.itemsize

  @property
  def stored_shape(self) -> tuple[int, ...]:
    return self.shape + self.extra


class Source(abc.ABC):
  """A place boxes can be read from.

  Subclasses say which tensors (and which boxes of them) they hold and read
  a sub-box of one held box into a buffer. ``preference`` ranks sources of
  the same piece (lower is tried first): ``DEVICE`` < ``HOST`` < ``PEER`` <
  ``REPLICA`` < ``PERSISTENT``. ``whole_boxes`` says that reading any part
  of a held box costs reading all of it (compressed chunks).
  """

  name: str = "source"
  preference: int = PERSISTENT
  # Reading any part of one of its boxes costs reading the whole box (a
  # compressed or checksummed chunk): :func:`assemble` then reads the part
  # of a box that this process's pieces cover once, and copies the pieces.
  whole_boxes: bool = False

  @abc.abstractmethod
  def tensors(self) -> Mapping[str, SourceTensor]:
    """The tensors this source holds, by path."""

  @abc.abstractmethod
  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    """Reads ``box`` (global coordinates, within one held box) of tensor
    ``path`` into ``out`` (shape: the box's, then ``extra``; dtype: the
    storage dtype, or another numeric dtype to convert to)."""

  def read_async(self, path: str, box: Box, out: np.ndarray):
    """Starts :meth:`read_into`; returns an object whose ``result()`` waits.
    The default reads synchronously."""
    self.read_into(path, box, out)
    return _Done()

  def close(self) -> None:
    """Releases open handles; the default holds none."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class _Done:

  def result(self):
    return None


class StoreSource(Source):
  """One round of a tenplex_jax store snapshot (a store directory on this
  host) as a source of boxes; read-only.

  Its tensors are the saving job's arrays, each with the boxes the round's
  snapshots in this store hold (one per saved distinct shard), read from
  the chunk files with their checksums checked
  (:meth:`tenplex_jax.store.HostStore.read_into`); plain leaves the job
  saved that are numbers or numeric numpy arrays (``step``) are 0-d (or
  small) tensors of one box, and :attr:`plain` holds every plain leaf.

  Args:
    root: the store directory.
    step: the step to read (default: the newest round whose every box this
      store holds).
    round: a round id (see ``tenplex-jax store ls``), before ``step``.

  Raises:
    StoreError: ``root`` is not a store.
    NoCopyError: no round (of ``step``) has all its boxes here (names the
      newest round's first missing box).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from tenplex_jax.store import save
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jnp.arange(6.0), "step": 4}, d, step=4)
    >>> with StoreSource(d) as src:
    ...   t = src.tensors()["w"]
    ...   out = np.empty(2, t.storage); src.read_into("w", ((1, 3),), out)
    >>> src.step, t.shape, out.tolist(), src.plain["step"]
    (4, (6,), [1.0, 2.0], 4)
  """

  preference = HOST

  def __init__(self, root: str, *, step: int | None = None,
               round: str | None = None):
    from tenplex_jax.store.format import HostStore, round_id
    self.store = HostStore(root)
    self.store.require_store()
    self.name = f"store:{self.store.root}"
    by_proc, _ = self.store.all_rounds()
    rounds: dict[str, dict[int, dict]] = {}
    for k, ms in by_proc.items():
      for m in ms:
        rounds.setdefault(round_id(m), {})[k] = m

    def order(rid):
      ms = list(rounds[rid].values())
      return (ms[0]["step"], max(float(m.get("created", 0)) for m in ms),
              int(ms[0].get("seq", 0)))

    cands = sorted(rounds, key=order, reverse=True)
    if round is not None:
      cands = [r for r in cands if r == round]
    elif step is not None:
      cands = [r for r in cands
               if next(iter(rounds[r].values()))["step"] == step]
    why = None
    for rid in cands:
      missing = _missing_boxes(rounds[rid])
      if not missing:
        break
      why = why or (f"round {rid} misses {len(missing)} boxes, e.g."
                    f" {missing[0]}")
    else:
      what = (f"round {round!r}" if round is not None else
              f"step {step}" if step is not None else "a snapshot")
      raise NoCopyError(f"store {self.store.root} holds no complete copy of"
                        f" {what}" + (f": {why}" if why else ""))
    self.round = rid
    self.manifests = rounds[rid]
    first = next(iter(self.manifests.values()))
    self.step = int(first["step"])
    self.job = PTC.from_json(first["job"])
    self.plain = {k: decode_plain(v) for k, v in first["extras"].items()}
    self._held: dict[str, list[tuple[Box, int]]] = {}
    info: dict[str, dict] = {}
    for k, m in sorted(self.manifests.items()):
      for path, t in m["tensors"].items():
        info.setdefault(path, t)
        for b in t["boxes"]:
          self._held.setdefault(path, []).append(
              (tuple(tuple(r) for r in b["box"]), k))
    self._tensors: dict[str, SourceTensor] = {}
    for t in self.job:
      i = info[t.path]
      if i.get("key_impl"):
        storage = np.dtype(i["storage"])
      else:
        storage = np.dtype(jnp.dtype(i["dtype"]))
      self._tensors[t.path] = SourceTensor(
          t.path, tuple(t.shape), i["dtype"], storage, tuple(i["extra"]),
          tuple(dict.fromkeys(t.placement.boxes)), i.get("key_impl"))
    self._storage = {p: np.dtype(i["storage"]) for p, i in info.items()}
    self._values: dict[str, np.ndarray] = {}
    for path, v in self.plain.items():
      a = None
      if isinstance(v, (bool, int, float)) and not isinstance(v, complex):
        a = np.asarray(v, np.int64 if type(v) is int else None)
      elif isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biuf":
        a = np.asarray(v)
      if a is not None and path not in self._tensors:
        self._values[path] = a
        self._tensors[path] = SourceTensor(
            path, a.shape, a.dtype.name, a.dtype,
            boxes=(tuple((0, n) for n in a.shape),))

  def tensors(self) -> Mapping[str, SourceTensor]:
    return self._tensors

  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    if path in self._values:
      out[...] = self._values[path][tuple(slice(a, b) for a, b in box)]
      return
    storage = self._storage[path]
    t = self._tensors[path]
    proc = next((k for held, k in self._held.get(path, ())
                 if all(h0 <= a and b <= h1
                        for (a, b), (h0, h1) in zip(box, held))), None)
    if proc is None:
      raise StoreError(f"{self.name}: no box of {path!r} holds {list(box)}")
    if out.dtype == t.storage and out.dtype.itemsize == storage.itemsize:
      self.store.read_into(path, box, out.view(storage), proc=proc,
                           round=self.round)
      return
    tmp = np.empty(out.shape, storage)  # another dtype: read, then cast
    self.store.read_into(path, box, tmp, proc=proc, round=self.round)
    out[...] = tmp.view(t.storage)


class StoreCopy(Source):
  """Old process ``proc``'s snapshot of one round in one store: this host's
  store directory (``HOST``, read with ``preadv``/memory maps and checked
  chunk by chunk) or a peer's store server (``PEER``, read over HTTP, many
  pieces per request: :meth:`read_batch`). The restart restore
  (``tenplex_jax.store.restore``) ranks these per piece and reads through
  :func:`fetch_pieces`.

  Args:
    name: the store's location (directory or URL), for reports.
    handle: its ``HostStore`` or ``RemoteStore``.
    proc: the old process whose snapshot is read.
    round: the round id.
    manifest: that snapshot's manifest.
    maps: a local store's ``ChunkMaps`` shared by one restore (a chunk
      several pieces share is mapped and checked once).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from tenplex_jax.store import HostStore, save
    >>> from tenplex_jax.store.format import round_id
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jnp.arange(4.0)}, d, step=1)
    >>> m = HostStore(d).manifest(0)
    >>> c = StoreCopy(d, HostStore(d), 0, round_id(m), m)
    >>> out = np.empty(2, np.uint32); c.read_into("w", ((2, 4),), out)
    >>> c.preference == HOST, out.view(np.float32).tolist()
    (True, [2.0, 3.0])
  """

  def __init__(self, name: str, handle, proc: int, round: str,
               manifest: Mapping, maps=None):
    from tenplex_jax.store.format import HostStore
    self.name = name
    self.handle = handle
    self.proc = proc
    self.round = round
    self.manifest = manifest
    self.maps = maps
    # Box-by-box reads (a directory, or an object-storage bucket) or many
    # pieces per request (a peer's store server).
    self.direct = isinstance(handle, HostStore)
    self.local = self.direct and not handle.remote
    self.preference = HOST if self.local else (
        PERSISTENT if self.direct else PEER)

  def tensors(self) -> Mapping[str, SourceTensor]:
    out = {}
    for path, t in self.manifest["tensors"].items():
      out[path] = SourceTensor(
          path, tuple(t["shape"]), t["dtype"], np.dtype(t["storage"]),
          tuple(t["extra"]), tuple(tuple(tuple(r) for r in b["box"])
                                   for b in t["boxes"]), t.get("key_impl"))
    return out

  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    """Reads in the storage dtype (``out``: the box's shape, then the
    trailing key-data dimensions)."""
    if self.direct:
      self.handle.read_into(path, box, out, proc=self.proc, maps=self.maps,
                            round=self.round)
    else:
      self.read_batch([(path, box, out)])

  def read_batch(self, items) -> None:
    """Reads ``[(path, box, out), ...]``: one request to a peer."""
    if self.direct:
      for path, box, out in items:
        self.read_into(path, box, out)
      return
    self.handle.read_into([(self.proc, path, box, out)
                           for path, box, out in items], round=self.round)


class _Single(Exception):
  """Internal: read a batch piece by piece."""


def _direct(src) -> bool:
  """Whether ``src`` serves one piece per read (a directory, a bucket),
  each read then a task of its own, as opposed to many per request."""
  return getattr(src, "direct", src.local)


def _batches(jobs, batch_bytes: int, batch_pieces: int):
  """Groups jobs by their first source into requests of bounded size, then
  interleaves the groups (every peer is read from at once)."""
  groups: dict[int, list] = {}
  for job in jobs:
    groups.setdefault(id(job[3][0]), []).append(job)
  per_group = []
  for group in groups.values():
    out = []
    per_group.append(out)
    cur, nb = [], 0
    for job in group:
      if cur and (nb + job[2].nbytes > batch_bytes
                  or len(cur) >= batch_pieces or _direct(job[3][0])):
        out.append(cur)
        cur, nb = [], 0
      cur.append(job)
      nb += job[2].nbytes
    if cur:
      out.append(cur)
  out = []
  for i in range(max((len(g) for g in per_group), default=0)):
    out.extend(g[i] for g in per_group if i < len(g))
  return out


def fetch_pieces(jobs, *, workers: int = 8, dead: set | None = None,
                 batch_bytes: int = 16 << 20, batch_pieces: int = 256):
  """Reads pieces from ranked sources, falling back to the next source of a
  piece when one fails ("try the next source", in one place).

  Args:
    jobs: ``(path, box, destination view, [sources, best first], key)``;
      sources are :class:`Source` objects with ``name`` and ``local``; one
      with ``read_batch`` serves several pieces per request.
    workers: requests in flight.
    dead: names of sources known dead; a source that raises
      :class:`UnreachableError` is added, and skipped from then on.
    batch_bytes, batch_pieces: bound on one request.

  Returns:
    ``[(source that served it, job), ...]`` and the errors that were
    fallen back from.

  Raises:
    StoreError: every source of some piece failed (names them all).

  Example:
    >>> class Broken(Source):
    ...   name, local = "broken", True
    ...   def tensors(self): return {}
    ...   def read_into(self, path, box, out):
    ...     raise StoreError("disk on fire")
    >>> class Zeros(Broken):
    ...   name = "zeros"
    ...   def read_into(self, path, box, out): out[...] = 0
    >>> out = np.ones(3)
    >>> served, errs = fetch_pieces([("w", ((0, 3),), out,
    ...                               [Broken(), Zeros()], None)])
    >>> served[0][0].name, out.tolist(), errs
    ('zeros', [0.0, 0.0, 0.0], ['disk on fire'])
  """
  dead = set() if dead is None else dead

  def fetch_one(job, errs):
    path, box, dest, cands, _ = job
    skipped = []
    for src in cands:
      if src.name in dead:  # a peer that died earlier in this restore
        skipped.append(f"{src.name} (dead earlier in this restore)")
        continue
      try:
        src.read_into(path, box, dest)
        return src
      except UnreachableError as e:
        dead.add(src.name)
        errs.append(str(e))
      except StoreError as e:
        errs.append(str(e))
    raise StoreError(f"{path} box {list(box)}: every copy failed:\n  "
                     + "\n  ".join(errs + skipped))

  def fetch(batch):
    errs = []
    src = batch[0][3][0]
    try:
      if _direct(src) or len(batch) == 1 or src.name in dead or \
          not hasattr(src, "read_batch"):
        raise _Single()
      src.read_batch([(path, box, dest) for path, box, dest, _, _ in batch])
      served = [(src, job) for job in batch]
    except (StoreError, _Single) as e:
      if isinstance(e, UnreachableError):
        dead.add(src.name)
      if isinstance(e, StoreError):
        errs.append(str(e))
      served = [(fetch_one(job, errs), job) for job in batch]
    return served, errs

  served_all, errs_all = [], []
  pool = cf.ThreadPoolExecutor(max_workers=max(1, workers))
  try:
    for served, errs in pool.map(fetch, _batches(jobs, batch_bytes,
                                                 batch_pieces)):
      errs_all.extend(errs)
      served_all.extend(served)
  except BaseException:
    pool.shutdown(wait=True, cancel_futures=True)
    raise
  finally:
    pool.shutdown(wait=True)
  return served_all, errs_all


def place(leaves) -> list:
  """Turns host buffers into ``jax.Array`` objects, every shard of every
  leaf in one batched ``jax.device_put`` (CPU devices alias aligned
  buffers).

  Args:
    leaves: ``(shape, sharding, {device id: host buffer}, key impl)`` per
      array, in the physical form (a PRNG key array's key data and its
      sharding; ``key impl`` then names the implementation to wrap it in).

  Returns:
    The arrays, in order.

  Example:
    >>> import jax
    >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> [a] = place([((3,), s, {jax.devices()[0].id: np.arange(3.0)}, None)])
    >>> a.tolist(), a.sharding == s
    ([0.0, 1.0, 2.0], True)
  """
  bufs, devs, spans = [], [], []
  for shape, sharding, hosts, _ in leaves:
    lo = len(bufs)
    for d in sorted(sharding.addressable_devices, key=lambda d: d.id):
      bufs.append(hosts[d.id])
      devs.append(d)
    spans.append((lo, len(bufs)))
  shards = jax.device_put(bufs, devs, may_alias=True) if bufs else []
  del bufs
  out = []
  for (shape, sharding, _, impl), (lo, hi) in zip(leaves, spans):
    arr = jax.make_array_from_single_device_arrays(tuple(shape), sharding,
                                                   shards[lo:hi])
    if impl:
      arr = jax.random.wrap_key_data(arr, impl=impl)
    out.append(arr)
  return out


def _missing_boxes(manifests: Mapping[int, dict]) -> list[str]:
  """The job's boxes that none of a round's snapshots ``manifests`` holds."""
  job = PTC.from_json(next(iter(manifests.values()))["job"])
  held: dict[str, set] = collections.defaultdict(set)
  for m in manifests.values():
    for path, t in m["tensors"].items():
      held[path].update(tuple(tuple(r) for r in b["box"])
                        for b in t["boxes"])
  out = []
  for t in job:
    for box in dict.fromkeys(t.placement.boxes):
      if box not in held[t.path] and box_volume(box):
        out.append(f"{t.path} box {[list(r) for r in box]}")
  return out


@dataclasses.dataclass(frozen=True)
class AssembleReport:
  """What :func:`assemble` read.

  Attributes:
    process_index: this process.
    n_tensors: tensors restored.
    new_shard_bytes: bytes of the distinct new boxes this process holds.
    read_bytes: bytes of the pieces read from the source (each piece once
      per process).
    pieces: pieces read.
    reads: reads issued to the source: one per source box when the source
      reads whole boxes (``Source.whole_boxes``: the pieces of one box are
      read together, then copied), else one per piece.
    seconds: ``plan``, ``read``, ``build`` and ``total``.
  """

  process_index: int
  n_tensors: int
  new_shard_bytes: int
  read_bytes: int
  pieces: int
  seconds: Mapping[str, float]
  reads: int = 0

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _is_key_dtype(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def match_target(target: Any, held: Mapping[str, SourceTensor], *,
                 mesh: jax.sharding.Mesh | None = None):
  """Pairs the array leaves of ``target`` with the tensors a source holds
  (:func:`tenplex_jax._targets.match_saved`).

  Args:
    target: a pytree; leaves that are ``jax.Array``s or
      ``jax.ShapeDtypeStruct``s with a sharding are restored (a sharding on
      an ``AbstractMesh`` is bound to ``mesh`` or the mesh in context), any
      other leaf (a Python number, ``None``, a ``ShapeDtypeStruct`` without
      a sharding) is a *plain* leaf.
    held: the source's tensors.
    mesh: the concrete mesh for shardings on an ``AbstractMesh``.

  Returns:
    ``(flat, treedef, arrays, plain)``: the flattened target, ``arrays``
    maps leaf index -> (saved path or ``None`` for a zero-size array,
    target leaf on a concrete sharding), ``plain`` maps leaf index -> saved
    path (or ``None`` when nothing is saved there).

  Raises:
    TreeError: some array leaves are not in the source or their shape
      differs (every such leaf is named, with both shapes and dtypes); a
      dtype may differ (the source reads with a cast), a PRNG key's may not.
  """
  flat, treedef, slots, problems = match_saved(
      target, held, where="the checkpoint", mesh=mesh, cast=True)
  raise_tree_problems("the target does not match the checkpoint", problems)
  arrays = {x.index: (x.saved if math.prod(x.leaf.shape) else None, x.leaf)
            for x in slots if x.array}  # Orbax stores no zero-size arrays
  plain = {x.index: x.saved for x in slots if not x.array}
  return flat, treedef, arrays, plain


def _physical(leaf) -> tuple[jax.ShapeDtypeStruct, str | None]:
  """The leaf as stored: a key array's key data, with its sharding."""
  if _is_key_dtype(leaf.dtype):
    data = jax.eval_shape(jax.random.key_data, leaf)
    s = key_data_sharding(leaf.sharding, leaf.ndim, data.ndim - leaf.ndim)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=s), \
        _impl_name(leaf.dtype)
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                              sharding=leaf.sharding), None


def _impl_name(dtype) -> str:
  tag = str(dtype)[4:-1]
  for name in ("threefry2x32", "rbg", "unsafe_rbg"):
    if str(jax.random.key(0, impl=name).dtype)[4:-1] == tag:
      return name
  return tag


# False: every piece is its own read, as before source boxes were grouped
# (kept for benchmarks/bench_orbax.py's before/after comparison).
_GROUP_READS = True

_OFFSET = 1 << 30  # source "devices" (its boxes) never look like new ones


def source_layout(tensors: Mapping[str, SourceTensor],
                  dtypes: Mapping[str, tuple[str, int]] | None = None) -> PTC:
  """The layout of ``tensors`` as a PTC: each held box is a "device"
  ``2**30 + i`` of process ``-1`` (a source outside the job).

  ``dtypes`` overrides a tensor's ``(dtype name, itemsize)`` (a target read
  with a cast is planned in the target's dtype).
  """
  out = []
  for path, t in tensors.items():
    boxes = tuple(b + tuple((0, e) for e in t.extra) for b in t.boxes)
    holders = tuple((_OFFSET + i,) for i in range(len(boxes)))
    dt, size = (dtypes or {}).get(path, (t.storage.name, t.storage.itemsize))
    out.append(TensorLayout(path, t.stored_shape, dt, size,
                            Placement(boxes, holders)))
  n = max((len(t.boxes) for t in tensors.values()), default=0)
  return PTC(tuple(out), tuple((_OFFSET + i, -1) for i in range(n)))


_ALIGN = 64  # XLA's CPU client aliases host buffers aligned to 64 bytes
_MAPPED = 1 << 20  # buffers from this size on get their own mapping


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised, C-contiguous, 64-byte aligned host buffer for one
  new shard (a CPU device aliases it, see ``jax.device_put(may_alias=)``).

  From 1 MiB on it is its own anonymous mapping of small pages, populated
  when mapped (``MAP_POPULATE``: one system call instead of a page fault
  per 4 KiB); the mapping is unmapped when the array (and any jax buffer
  aliasing it) is gone. Not huge pages: on this project's shared
  (virtual) machine, faulting in transparent huge pages cost 1.5-3x the
  system time of small pages populated at map time whenever the kernel
  had to compact memory for them (most runs), and far less only when free
  huge pages were at hand; a restore was dominated by it
  (``docs/orbax.md``, ``bench_orbax.py --pages``).

  Example:
    >>> b = host_buffer((512, 1024), np.float32)
    >>> b.shape, b.dtype, b.ctypes.data % 64, b.flags.writeable
    ((512, 1024), dtype('float32'), 0, True)
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes < _MAPPED:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap,
                                                          "MAP_POPULATE", 0)
  m = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, flags=flags)
  return np.frombuffer(m, dtype=np.uint8, count=nbytes).view(dtype).reshape(
      shape)


def assemble(source: Source, target: Any, *, inflight_bytes: int = 32 << 20,
             mesh: jax.sharding.Mesh | None = None
             ) -> tuple[Any, AssembleReport]:
  """Restores ``target``'s arrays from ``source``; call in every process.

  Each process reads only the boxes its own devices hold: per tensor, the
  plan from the source's boxes to the target layout gives each distinct new
  box's pieces (a new box is read once per process, into one 64-byte
  aligned host buffer, even when several local devices hold it), and the
  pieces are read straight into their place in that buffer; from a source
  whose boxes are read whole (``Source.whole_boxes``: an Orbax checkpoint's
  compressed chunks), the pieces one source box gives this process are
  read together, that box decoded once, then copied into place. Buffers are
  allocated box by box (leaf by leaf from such a source) while earlier
  reads run; reads overlap, with at most ``inflight_bytes`` of source boxes
  being decoded at once (but always two, so that two cores decode). The
  buffers then become the device buffers in one batched ``jax.device_put``
  (CPU devices alias them: no copy).

  Args:
    source: where the boxes come from.
    target: a pytree of ``jax.ShapeDtypeStruct``s with shardings (or live
      arrays, or Flax boxes holding them). Plain leaves take the saved value
      at their path when there is one (a whole-array read), else pass
      through.
    inflight_bytes: bound on the source bytes being read at once.
    mesh: the concrete mesh for target shardings on an ``AbstractMesh``
      (default: the mesh in context, ``jax.set_mesh``).

  Returns:
    ``(tree, report)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> class Ramp(Source):  # a source holding one tensor in two boxes
    ...   def tensors(self):
    ...     return {"w": SourceTensor("w", (4,), "float32",
    ...                               np.dtype(np.float32),
    ...                               boxes=(((0, 2),), ((2, 4),)))}
    ...   def read_into(self, path, box, out):
    ...     out[...] = np.arange(*box[0], dtype=out.dtype)
    >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> tree, rep = assemble(Ramp(), {"w": jax.ShapeDtypeStruct(
    ...     (4,), jnp.float32, sharding=s)})
    >>> tree["w"].tolist(), rep.pieces, rep.read_bytes
    ([0.0, 1.0, 2.0, 3.0], 2, 16)
  """
  t0 = time.perf_counter()
  held = source.tensors()
  flat, treedef, arrays, plain = match_target(target, held, mesh=mesh)
  phys, impls, dtypes = {}, {}, {}
  empty = {i for i, (saved, _) in arrays.items() if saved is None}
  for i in empty:
    arrays.pop(i)
  for i, (saved, leaf) in arrays.items():
    sds, impl = _physical(leaf)
    phys[saved] = sds
    impls[saved] = impl
    dt = np.dtype(sds.dtype)
    dtypes[saved] = (dt.name, dt.itemsize)
  used = {saved: held[saved] for saved, _ in arrays.values()}
  dst = PTC.from_tree(phys)
  the_plan = plan(source_layout(used, dtypes), dst)
  t1 = time.perf_counter()
  mine = {d.id for d in jax.local_devices()}
  bufs: dict[tuple[str, Box], np.ndarray] = {}
  new_bytes = read = n = inflight = reads = 0
  pending: collections.deque = collections.deque()
  whole = _GROUP_READS and getattr(source, "whole_boxes", False)

  def issue(path, box, out, cost, scatter=()):
    nonlocal inflight, reads
    while len(pending) >= 2 and inflight + cost > inflight_bytes:
      retire()
    pending.append((source.read_async(path, box, out), cost, out, scatter))
    inflight += cost
    reads += 1

  def retire():
    nonlocal inflight
    f, c, tmp, scatter = pending.popleft()
    f.result()
    for index, view in scatter:  # one source box read, copied to its pieces
      view[...] = tmp[index]
    inflight -= c

  try:
    for t in dst:
      tpl, _ = the_plan.template(t.path)
      sbox = used[t.path]
      src_boxes = [b + tuple((0, e) for e in sbox.extra) for b in sbox.boxes]
      item = sbox.storage.itemsize
      dtype = np.dtype(phys[t.path].dtype)
      rank = len(sbox.shape)  # pieces are read by their logical box
      by_src: dict[int, list] = {}  # source box -> [(piece, view)]
      for bi, (dbox, holders) in enumerate(zip(t.placement.boxes,
                                               t.placement.holders)):
        if not any(h in mine for h in holders):
          continue
        buf = host_buffer(tuple(b - a for a, b in dbox), dtype)
        bufs[(t.path, dbox)] = buf
        new_bytes += buf.nbytes
        for piece, si in tpl.merges[bi]:
          view = buf[relative_index(piece, dbox)]
          if not view.size:
            continue
          read += view.nbytes
          n += 1
          if whole:  # issued once this tensor's boxes are known, below
            by_src.setdefault(si, []).append((piece, view))
          else:
            issue(t.path, piece[:rank], view,
                  box_volume(src_boxes[si]) * item)
      for si, group in by_src.items():
        cost = box_volume(src_boxes[si]) * item
        if len(group) == 1:
          piece, view = group[0]
          issue(t.path, piece[:rank], view, cost)
          continue
        # Several pieces of this process's new boxes lie in one source box:
        # read the part of it they cover once (a compressed chunk is decoded
        # once, not once per piece), then copy each piece to its place.
        ubox = tuple((min(p[k][0] for p, _ in group),
                      max(p[k][1] for p, _ in group))
                     for k in range(len(group[0][0])))
        tmp = np.empty(tuple(b - a for a, b in ubox), dtype)
        issue(t.path, ubox[:rank], tmp, cost,
              [(relative_index(p, ubox), v) for p, v in group])
    while pending:
      retire()
  finally:
    for f, _, _, _ in pending:  # an error: let outstanding reads finish first
      try:
        f.result()
      except Exception:  # noqa: BLE001 - the first error is raised
        pass
  t2 = time.perf_counter()
  # Every shard of every leaf in one batched transfer, then the arrays.
  order = list(arrays)
  built = dict(zip(order, place([
      (phys[saved].shape, phys[saved].sharding,
       {d.id: bufs[(saved, dst[saved].shard_box(d.id))]
        for d in phys[saved].sharding.addressable_devices}, impls[saved])
      for saved, _ in (arrays[i] for i in order)])))
  bufs.clear()
  out = []
  for i, (kp, leaf) in enumerate(flat):
    if i in built:
      out.append(built[i])
    elif i in empty:
      out.append(_empty_array(leaf))
    elif plain.get(i) is not None:
      out.append(_plain(source, held[plain[i]], leaf))
    else:
      out.append(leaf)
  built.clear()
  tree = jax.tree_util.tree_unflatten(treedef, out)
  t3 = time.perf_counter()
  return tree, AssembleReport(
      process_index=jax.process_index(), n_tensors=len(dst),
      new_shard_bytes=new_bytes, read_bytes=read, pieces=n, reads=reads,
      seconds={"plan": t1 - t0, "read": t2 - t1, "build": t3 - t2,
               "total": t3 - t0})


def _empty_array(leaf):
  sds, impl = _physical(leaf)
  arr = jax.make_array_from_callback(
      sds.shape, sds.sharding, lambda idx: np.zeros(
          [len(range(*s.indices(n))) for s, n in zip(idx, sds.shape)]
          + list(sds.shape[len(idx):]), sds.dtype))
  return jax.random.wrap_key_data(arr, impl=impl) if impl else arr


def _plain(source: Source, t: SourceTensor, leaf):
  """A plain leaf's saved value: the whole array, as a number when the
  target leaf is one."""
  whole = tuple((0, n) for n in t.shape)
  buf = np.empty(t.stored_shape, t.storage)
  source.read_into(t.path, whole, buf)
  if t.key_impl:
    return jax.random.wrap_key_data(buf, impl=t.key_impl)
  if isinstance(leaf, bool):
    return bool(buf)
  if isinstance(leaf, int):
    return int(buf)
  if isinstance(leaf, float):
    return float(buf)
  if isinstance(leaf, jax.ShapeDtypeStruct):  # no sharding: a host array
    return buf.astype(leaf.dtype, copy=False)
  return buf
