"""The restore core: one assembly path from sources of boxes to new shards.

Every restore runs the same steps, written once here:

  plan(source layout, target layout)
    -> :func:`new_boxes`: the distinct new boxes the selected devices hold
       (a box several of this process's devices hold is read once), each
       with its pieces (one per source box it overlaps)
    -> :func:`fill`: one host buffer per new box, a view of it per piece
    -> reads, into those views; *who serves a piece* is the one pluggable
       part: :func:`read_source` (one :class:`~tenplex_jax.sources.Source`,
       reads pipelined, a box read whole read once for all its pieces) or
       :func:`fetch_pieces` (ranked copies of a piece in several stores,
       batched per peer, falling back to the next copy)
    -> placement: :func:`place` turns the buffers into ``jax.Array``\\ s in
       one batched transfer (CPU devices alias them: no copy).

Its users: :func:`assemble` (one source onto a target tree:
``tenplex_jax.orbax.restore``, a store round as a
:class:`tenplex_jax.store.source.StoreSource`), the store restore
(``tenplex_jax.store.restore``: ranks
:class:`tenplex_jax.store.source.StoreCopy` objects per piece and adds its
round choice, fallbacks and report) and ``tenplex_jax.orbax.convert`` (all
new boxes, each written as a chunk of the new checkpoint instead of
placed). Device buffers come from the one host allocator,
:func:`tenplex_jax._hostmem.host_empty`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from tenplex_jax._hostmem import host_empty
from tenplex_jax._keys import is_key, key_data_sharding, wrap_keys
from tenplex_jax._problems import Problem
from tenplex_jax._targets import (match_saved, other_memory_kind,
                                  raise_tree_problems)
from tenplex_jax.errors import StoreError, UnreachableError
from tenplex_jax.layout import (PTC, Box, Placement, TensorLayout, box_volume,
                                key_path_name, relative_index)
from tenplex_jax.planner import Plan, plan
from tenplex_jax.sources import Source, SourceTensor

__all__ = ["AssembleReport", "NewBox", "ReadStats", "assemble", "fetch_pieces",
           "fill", "match_target", "new_boxes", "place", "read_source",
           "shards_of", "source_layout"]


# -- plan -> distinct new boxes -> buffers -----------------------------------
@dataclasses.dataclass(frozen=True)
class NewBox:
  """One distinct new box of a tensor, as the selected devices hold it.

  Attributes:
    path: the tensor.
    box: the box, in the plan's coordinates.
    index: its index in the tensor's new placement.
    holders: the selected devices that hold it, in id order.
    pieces: ``(piece box, source box index)``, tiling ``box`` (the plan's
      merges).
  """

  path: str
  box: Box
  index: int
  holders: tuple[int, ...]
  pieces: tuple[tuple[Box, int], ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.box)


def new_boxes(the_plan: Plan, dst: PTC,
              devices: Collection[int] | None = None,
              order: Callable[[str, int], float] | None = None
              ) -> Iterator[NewBox]:
  """The distinct new boxes of ``dst`` that ``devices`` hold (every box
  when ``None``), tensor by tensor in ``dst``'s order, each once however
  many of the devices hold it.

  With ``order`` (:meth:`Source.read_order`: when a source box can be
  read), tensors come by when the last source box they need can be read,
  and each new box's pieces by when theirs can (a source still fetching
  its boxes is read as they arrive).
  """
  tensors = list(dst)
  if order is not None:
    def ready(t) -> float:
      tpl, _ = the_plan.template(t.path)
      return max((order(t.path, si) for m in tpl.merges for _, si in m),
                 default=0.0)
    tensors.sort(key=ready)
  for t in tensors:
    tpl, _ = the_plan.template(t.path)
    for i, (box, hs) in enumerate(zip(t.placement.boxes,
                                      t.placement.holders)):
      sel = tuple(sorted(hs if devices is None else
                         (h for h in hs if h in devices)))
      if sel:
        pieces = tpl.merges[i]
        if order is not None:
          pieces = tuple(sorted(pieces, key=lambda p: order(t.path, p[1])))
        yield NewBox(t.path, box, i, sel, pieces)


# A filled new box: (box, its buffer, [(piece, source box index, view)]).
Filled = tuple[NewBox, np.ndarray, list[tuple[Box, int, np.ndarray]]]


def fill(boxes: Iterable[NewBox], alloc: Callable[[NewBox], np.ndarray]
         ) -> Iterator[Filled]:
  """Allocates each new box's buffer (``alloc``; trailing dimensions beyond
  the box, such as key data, are whole) as it is reached, and gives the
  view of every non-empty piece in it."""
  for nb in boxes:
    buf = alloc(nb)
    views = []
    for piece, si in nb.pieces:
      view = buf[relative_index(piece, nb.box)]
      if view.size:
        views.append((piece, si, view))
    yield nb, buf, views


def shards_of(t: TensorLayout, sharding: jax.sharding.Sharding,
              bufs: Mapping[tuple[str, Box], np.ndarray],
              missing: Callable[[Box], np.ndarray] | None = None
              ) -> dict[int, np.ndarray]:
  """Each addressable device's host buffer: its new box's in ``bufs``
  (keyed ``(path, box)``), else ``missing(box)`` (an empty box)."""
  out = {}
  for d in sharding.addressable_devices:
    box = t.shard_box(d.id)
    buf = bufs.get((t.path, box))
    out[d.id] = missing(box) if buf is None else buf
  return out


def place(leaves) -> list:
  """Turns host buffers into ``jax.Array`` objects, every shard of every
  leaf in one batched ``jax.device_put`` (CPU devices alias aligned
  buffers).

  Args:
    leaves: ``(shape, sharding, {device id: host buffer}, key impl, keys'
      sharding)`` per array, in the physical form (a PRNG key array's key
      data and its sharding; ``key impl`` then names the implementation to
      wrap it in, and the keys are put on the keys' sharding, the target's:
      see :func:`tenplex_jax._keys.wrap_keys`; both unused where ``key
      impl`` is ``None``).

  Returns:
    The arrays, in order.

  Example:
    >>> import jax
    >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> [a] = place([((3,), s, {jax.devices()[0].id: np.arange(3.0)}, None,
    ...                None)])
    >>> a.tolist(), a.sharding == s
    ([0.0, 1.0, 2.0], True)
  """
  bufs, devs, spans = [], [], []
  for shape, sharding, hosts, _, _ in leaves:
    lo = len(bufs)
    kind = other_memory_kind(sharding)
    for d in sorted(sharding.addressable_devices, key=lambda d: d.id):
      bufs.append(hosts[d.id])
      # a target in another memory of the device (e.g. "pinned_host", an
      # offloaded optimizer state): the shard goes to that memory
      devs.append(d if kind is None else
                  jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
    spans.append((lo, len(bufs)))
  shards = jax.device_put(bufs, devs, may_alias=True) if bufs else []
  del bufs
  out = []
  for (shape, sharding, _, impl, keys_sharding), (lo, hi) in zip(leaves,
                                                                spans):
    arr = jax.make_array_from_single_device_arrays(tuple(shape), sharding,
                                                   shards[lo:hi])
    if impl:
      arr = wrap_keys(arr, impl, keys_sharding)
    out.append(arr)
  return out


# -- reads: one source -------------------------------------------------------
# False: every piece is its own read, as before source boxes were grouped
# (kept for benchmarks/bench_orbax.py's before/after comparison).
_GROUP_READS = True


# From a source with ``shared_reads``, a box's pieces go straight into
# place when they average at least this many bytes; smaller ones are copied
# out of a scratch buffer. A tensorstore read costs about 20 us of the
# Python thread and, on tensorstore's threads, about 50 us more (futures,
# locks, the strided copy's set-up: perf on the 2-core VM); a 64 KiB
# piece's copy costs 17 us, a 1 MiB one's 230 us. A 1 GiB checkpoint saved
# with Orbax's sub-chunking (512 KiB chunks, 128 KiB pieces into columns)
# restored 10% faster through the scratch buffer, one saved without it
# (512 KiB pieces) 5% slower (docs/orbax.md).
_DIRECT_PIECE = 256 << 10


@dataclasses.dataclass
class ReadStats:
  """What :func:`read_source` read: ``pieces``, their ``bytes``, and the
  ``reads`` of the source (the pieces of one box read together, one box
  read, count once)."""

  pieces: int = 0
  bytes: int = 0
  reads: int = 0


def read_source(source: Source, filled: Iterable[Filled], *,
                inflight_bytes: int = 32 << 20,
                stats: ReadStats | None = None,
                min_reads: int = 2) -> ReadStats:
  """Reads every piece of ``filled`` from ``source`` into its view.

  Reads overlap (``Source.read_async``), with at most ``inflight_bytes`` of
  source boxes being read at once, but always ``min_reads`` (default two,
  so that two cores decode; 1 makes the bound strict but for a box larger
  than it). From a source whose boxes are read whole
  (``Source.whole_boxes``: compressed chunks) the pieces one source box
  gives the boxes of one tensor are read together: from a source whose
  reads of parts of one box started together share one read of it
  (``Source.shared_reads``, ``Source.read_parts_async``: tensorstore, one
  batch) each piece is read straight into its place (the box is decoded
  once, the copies run on the source's threads) unless the pieces are
  small (under 32 KiB on average); from any other, and for small pieces,
  the part of the box they cover is read once into a scratch buffer, then
  copied into place. Boxes are consumed lazily, so that their buffers are
  allocated while earlier reads run.
  """
  held = source.tensors()
  whole = _GROUP_READS and getattr(source, "whole_boxes", False)
  shared = whole and getattr(source, "shared_reads", False)
  st = ReadStats() if stats is None else stats
  pending: collections.deque = collections.deque()
  inflight = 0

  def issue(path, reads, cost, tmp=None, scatter=()):
    """Starts ``reads`` ((box, out) of one source box) together."""
    nonlocal inflight
    while len(pending) >= min_reads and inflight + cost > inflight_bytes:
      retire()
    futs: list = []
    pending.append((futs, cost, tmp, scatter))  # started reads, also on error
    inflight += cost
    if len(reads) == 1:
      futs.append(source.read_async(path, *reads[0]))
    else:
      futs.extend(source.read_parts_async(path, reads))
    st.reads += 1

  def retire():
    nonlocal inflight
    futs, c, tmp, scatter = pending.popleft()
    for f in futs:
      f.result()
    for index, view in scatter:  # one source box read, copied to its pieces
      view[...] = tmp[index]
    inflight -= c

  try:
    for path, items in itertools.groupby(filled, key=lambda x: x[0].path):
      t = held[path]
      rank = len(t.shape)  # pieces are read by their logical box
      per = t.storage.itemsize * math.prod(t.extra)
      by_src: dict[int, list] = {}  # source box -> [(piece, view)]
      for _, _, views in items:
        for piece, si, view in views:
          st.pieces += 1
          st.bytes += view.nbytes
          if whole:  # issued once this tensor's boxes are known, below
            by_src.setdefault(si, []).append((piece, view))
          else:
            issue(path, [(piece[:rank], view)],
                  box_volume(t.boxes[si]) * per)
      for si, group in by_src.items():
        cost = box_volume(t.boxes[si]) * per
        if len(group) == 1 or (shared and sum(
            v.nbytes for _, v in group) >= _DIRECT_PIECE * len(group)):
          # One piece, or a source that reads one box once for all the
          # parts read together: every piece straight into its place.
          issue(path, [(p[:rank], v) for p, v in group], cost)
          continue
        # Several pieces lie in one source box: read the part of it they
        # cover once (a compressed chunk is decoded once, not once per
        # piece), then copy each piece to its place.
        ubox = tuple((min(p[k][0] for p, _ in group),
                      max(p[k][1] for p, _ in group))
                     for k in range(len(group[0][0])))
        tmp = np.empty(tuple(b - a for a, b in ubox), group[0][1].dtype)
        issue(path, [(ubox[:rank], tmp)], cost, tmp,
              [(relative_index(p, ubox), v) for p, v in group])
    while pending:
      retire()
  finally:
    for futs, _, _, _ in pending:  # an error: let outstanding reads finish
      for f in futs:
        try:
          f.result()
        except Exception:  # noqa: BLE001 - the first error is raised
          pass
  return st


# -- reads: ranked copies ----------------------------------------------------
class _Single(Exception):
  """Internal: read a batch piece by piece."""


def _direct(src) -> bool:
  """Whether ``src`` serves one piece per read (a directory, a bucket), as
  opposed to many per request."""
  return getattr(src, "direct", src.local)


def _batches(jobs, batch_bytes: int, batch_pieces: int, direct_bytes: int):
  """Groups jobs by their first source into tasks of bounded size, then
  interleaves the groups (every peer is read from at once): a request of up
  to ``batch_bytes`` and ``batch_pieces`` to a source that serves many pieces
  per request; consecutive pieces of a direct source (read one by one) up
  to ``direct_bytes`` together, so that small pieces do not cost a task
  (a thread's wake-up) each."""
  groups: dict[int, list] = {}
  for job in jobs:
    groups.setdefault(id(job[3][0]), []).append(job)
  per_group = []
  for group in groups.values():
    out = []
    per_group.append(out)
    cur, nb = [], 0
    direct = _direct(group[0][3][0])
    limit = direct_bytes if direct else batch_bytes
    for job in group:
      if cur and (nb + job[2].nbytes > limit or len(cur) >= batch_pieces):
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
                 batch_bytes: int = 16 << 20, batch_pieces: int = 256,
                 direct_bytes: int = 1 << 20):
  """Reads pieces from ranked sources, falling back to the next source of a
  piece when one fails ("try the next source", in one place).

  Args:
    jobs: ``(path, box, destination view, [sources, best first], key)``;
      sources are :class:`~tenplex_jax.sources.Source` objects with
      ``name`` and ``local``; one with ``read_batch`` serves several pieces
      per request.
    workers: requests in flight.
    dead: names of sources known dead; a source that raises
      :class:`UnreachableError` is added, and skipped from then on.
    batch_bytes, batch_pieces: bound on one request.
    direct_bytes: pieces of a source that reads one piece at a time (a
      directory, a bucket: ``direct``, by default ``local``) are grouped
      into tasks of up to this many bytes (and ``batch_pieces``); a larger
      piece is a task of its own. A single task runs in the calling thread.

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
  tasks = _batches(jobs, batch_bytes, batch_pieces, direct_bytes)
  if len(tasks) <= 1:  # no thread to start and wake for one task
    for served, errs in map(fetch, tasks):
      errs_all.extend(errs)
      served_all.extend(served)
    return served_all, errs_all
  pool = cf.ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks))))
  try:
    for served, errs in pool.map(fetch, tasks):
      errs_all.extend(errs)
      served_all.extend(served)
  except BaseException:
    pool.shutdown(wait=True, cancel_futures=True)
    raise
  finally:
    pool.shutdown(wait=True)
  return served_all, errs_all


# -- one source onto a target tree -------------------------------------------
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
    reads: reads of the source: one per source box when the source reads
      whole boxes (``Source.whole_boxes``: the pieces of one box are read
      together, the box once: into a scratch buffer, then copied, or, from
      a source with ``shared_reads``, straight into place), else one per
      piece.
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
  if is_key(leaf):
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


def assemble(source: Source, target: Any, *, inflight_bytes: int = 32 << 20,
             mesh: jax.sharding.Mesh | None = None, min_reads: int = 2
             ) -> tuple[Any, AssembleReport]:
  """Restores ``target``'s arrays from ``source``; call in every process.

  Each process reads only the boxes its own devices hold: per tensor, the
  plan from the source's boxes to the target layout gives each distinct new
  box's pieces (a new box is read once per process, into one 64-byte
  aligned host buffer, even when several local devices hold it), and the
  pieces are read straight into their place in that buffer
  (:func:`read_source`: reads overlap, at most ``inflight_bytes`` of source
  boxes at once; a box read whole is read once for all its pieces). The
  buffers then become the device buffers in one batched ``jax.device_put``
  (CPU devices alias them: no copy).

  Args:
    source: where the boxes come from.
    target: a pytree of ``jax.ShapeDtypeStruct``s with shardings (or live
      arrays, or Flax boxes holding them). Plain leaves take the saved value
      at their path when there is one (a whole-array read), else pass
      through.
    inflight_bytes: bound on the source bytes being read at once.
    min_reads: reads kept in flight even past ``inflight_bytes`` (see
      :func:`read_source`).
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
  _check_plain_types(source, flat, plain, held)
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
  bufs: dict[tuple[str, Box], np.ndarray] = {}

  def alloc(nb: NewBox) -> np.ndarray:
    # Every byte is written next (the pieces tile the box): populated.
    buf = bufs[(nb.path, nb.box)] = host_empty(
        nb.shape, phys[nb.path].dtype, populate=True)
    return buf

  mine = {d.id for d in jax.local_devices()}
  ordered = type(source).read_order is not Source.read_order
  st = read_source(source, fill(new_boxes(
      the_plan, dst, mine, source.read_order if ordered else None), alloc),
                   inflight_bytes=inflight_bytes, min_reads=min_reads)
  new_bytes = sum(b.nbytes for b in bufs.values())
  t2 = time.perf_counter()
  # Every shard of every leaf in one batched transfer, then the arrays.
  order = list(arrays)
  built = dict(zip(order, place([
      (phys[saved].shape, phys[saved].sharding,
       shards_of(dst[saved], phys[saved].sharding, bufs), impls[saved],
       leaf.sharding)
      for saved, leaf in (arrays[i] for i in order)])))
  bufs.clear()
  out = []
  for i, (kp, leaf) in enumerate(flat):
    if i in built:
      out.append(built[i])
    elif i in empty:
      out.append(_empty_array(leaf))
    elif plain.get(i) is not None:
      out.append(_plain(source, held[plain[i]], leaf))
    elif isinstance(leaf, str):  # a saved string, if there is one
      out.append(source.saved_values().get(key_path_name(kp), leaf))
    else:
      out.append(leaf)
  built.clear()
  tree = jax.tree_util.tree_unflatten(treedef, out)
  t3 = time.perf_counter()
  return tree, AssembleReport(
      process_index=jax.process_index(), n_tensors=len(dst),
      new_shard_bytes=new_bytes, read_bytes=st.bytes, pieces=st.pieces,
      reads=st.reads, seconds={"plan": t1 - t0, "read": t2 - t1,
                               "build": t3 - t2, "total": t3 - t0})


def _check_plain_types(source: Source, flat, plain, held) -> None:
  """A string target leaf where an array or number is saved, or a number
  target leaf where a string is saved, is a :class:`TreeError` naming the
  leaf and both types (before anything is read), not a silent mix-up."""
  problems = []
  strings = None
  for i, (kp, leaf) in enumerate(flat):
    if i not in plain:
      continue
    saved = plain[i]
    if saved is not None and isinstance(leaf, str):
      t = held[saved]
      problems.append(Problem(key_path_name(kp), (
          f"the target is a string, the checkpoint saved {t.dtype}"
          f"{list(t.shape)}"), "the target is a string, an array is saved"))
    elif saved is None and isinstance(leaf, (bool, int, float, complex)):
      if strings is None:
        strings = source.saved_values()
      name = key_path_name(kp)
      if isinstance(strings.get(name), str):
        problems.append(Problem(name, (
            f"the target is {type(leaf).__name__} {leaf!r}, the checkpoint"
            f" saved a string"), "the target is a number, a string is saved"))
  raise_tree_problems("the target does not match the checkpoint", problems)


def _empty_array(leaf):
  sds, impl = _physical(leaf)
  arr = jax.make_array_from_callback(
      sds.shape, sds.sharding, lambda idx: np.zeros(
          [len(range(*s.indices(n))) for s, n in zip(idx, sds.shape)]
          + list(sds.shape[len(idx):]), sds.dtype))
  if not impl:
    return arr
  return wrap_keys(arr, impl, leaf.sharding)


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
