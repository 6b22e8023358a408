"""``save`` and ``restore``: moving a job's state through the host stores.

``save(tree, location)`` runs in every process of the old job: each writes
one copy of each box its devices hold, plus the job's full layout, to its
own host's store. ``restore(locations, target)`` runs in every process of
the new job: it plans the change from the saved layout to the target layout
with :func:`tenplex_jax.plan`, reads each piece its devices need exactly once
per process (host-level deduplication: a piece several local devices need is
fetched once and fanned out), from its own host's store when that holds a
copy, else from the store the plan chose, else from any other copy (a data
parallel replica, a store replica), and builds the new ``jax.Array``s.

A *host* is a store location: local directories given to ``restore`` are
this process's host; URLs are peers. Two handles to the same store (its
directory and its server's URL) are recognised by the store's id.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from tenplex_jax._hostmem import host_empty, populate
from tenplex_jax.assembly import (NewBox, fetch_pieces, fill, new_boxes, place,
                                  shards_of)
from tenplex_jax._problems import Problem
from tenplex_jax._keys import is_key, key_data_sharding
from tenplex_jax._targets import (bind_target, leaf_kind, match_saved,
                                  name_clashes, raise_tree_problems)
from tenplex_jax.errors import (NoCopyError, StoreError, TLSError, TreeError,
                                UsageError)
from tenplex_jax.plain import decode_plain, encode_plain
from tenplex_jax.locations import LOCAL, OBJECT, PEER, parse_location
from tenplex_jax.layout import (PTC, Box, Placement, slices_to_box,
                                box_volume, intersect, key_path_name,
                                relative_index)
from tenplex_jax.planner import plan
from tenplex_jax.store import checkpoint as ckpt
from tenplex_jax.store import private
from tenplex_jax.store.format import (ChunkMaps, HostStore, SnapshotWriter,
                                      chunk_shape, take_lock, check_step,
                                      check_tensor_path, ensure_store_id,
                                      from_storage, gc, next_seq,
                                      prune_snapshots,
                                      round_id, storage_of, write_current)
from tenplex_jax.store.objects import ObjectStore, upload_snapshot
from tenplex_jax.store.source import StoreCopy
from tenplex_jax.store.server import RemoteStore

__all__ = ["RestoreReport", "open_store", "restore", "restore_checkpoint",
           "restore_with_report", "save", "save_checkpoint"]

_OFFSET = 1 << 30  # old device ids are shifted so none looks "kept"


_BATCH_BYTES = 16 << 20  # pieces per request up to this many bytes
_BATCH_PIECES = 256
_OBJECT_WORKERS = 32  # pieces in flight when a source is object storage


def _split_rows(box: Box, dest: np.ndarray, held: Box | None,
                rows: int | None):
  """Splits a large piece along dim 0 into parts of about ``_BATCH_BYTES``,
  at the chunk boundaries of the stored box ``held`` (``rows`` rows per
  chunk) where known, so requests and server buffers stay bounded, big
  pieces are read in parallel, and no chunk is read twice."""
  if not box or dest.nbytes <= _BATCH_BYTES or box[0][1] - box[0][0] < 2:
    return [(box, dest)]
  lo, hi = box[0]
  row = dest.nbytes // (hi - lo)
  step = max(1, _BATCH_BYTES // max(1, row))
  base = lo
  if held is not None and rows:
    step = rows * max(1, step // rows)
    base = held[0][0]
  out = []
  a = lo
  while a < hi:
    z = min(hi, base + (a - base) // step * step + step)
    out.append((((a, z),) + tuple(box[1:]), dest[a - lo:z - lo]))
    a = z
  return out


def open_store(location: str, *, timeout: float = 30.0, retries: int = 2,
               token: str | None = None, ca_file: str | None = None):
  """The store handle (a :class:`~tenplex_jax.store.handle.StoreHandle`) of
  a location (see :func:`tenplex_jax.locations.parse_location`):
  :class:`HostStore` for a
  directory, :class:`RemoteStore` for a store server's ``http(s)://HOST:PORT``
  (``token``: the job's store token, default the ``TENPLEX_JAX_STORE_TOKEN``
  environment variable; ``ca_file``: the CA that TLS servers are verified
  against, default ``$TENPLEX_JAX_STORE_CA``; with one set, ``http://`` is
  refused), :class:`~tenplex_jax.store.objects.ObjectStore` for
  ``s3://BUCKET/PREFIX`` or ``gs://BUCKET/PREFIX``.

  Raises:
    UsageError: the location's scheme is unknown.
  """
  loc = parse_location(location)
  if loc.kind == PEER:
    return RemoteStore(loc.target, timeout=timeout, retries=retries,
                       token=token, ca_file=ca_file)
  if loc.kind == OBJECT:
    return ObjectStore(loc.target)
  return HostStore(loc.target)


# The JSON form of plain leaves (shared with the store's readers).
_encode_extra, _decode_extra = encode_plain, decode_plain


def _is_none(x) -> bool:
  return x is None


def _snapshot_items(tree):
  """(ptc, extras, [(path, layout info, [(box, host array)])])."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
  clashes = name_clashes(flat)
  if clashes:
    raise TreeError(
        "save: leaves are stored by path name, and these name more than one"
        " leaf (a dict key holds '/'); one would be saved over the other: "
        + "; ".join(f"{n!r}: {ks}" for n, ks in clashes))
  sds = {}
  extras = {}
  arrays = []
  bad = []
  for kp, leaf in flat:
    name = key_path_name(kp)
    try:
      check_tensor_path(name, "leaf path")
    except UsageError as e:
      bad.append(str(e))
      continue
    if isinstance(leaf, jax.Array):
      sds[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                       sharding=leaf.sharding)
      impl = None
      data = leaf
      if is_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        data = jax.random.key_data(leaf)
      seen = set()
      boxes = []
      for shard in data.addressable_shards:
        box = slices_to_box(shard.index, leaf.shape)
        if box in seen:
          continue
        seen.add(box)
        boxes.append((box, shard.data))
      arrays.append((name, leaf, impl, boxes))
    else:
      try:
        extras[name] = _encode_extra(leaf)
      except TypeError as e:
        bad.append(f"{name}: {e}")
  if bad:
    raise TreeError(
        f"save: {len(bad)} leaves cannot be stored (leaves must be jax"
        " Arrays, numpy arrays or scalars, or None/bool/int/float/complex/"
        "str): " + "; ".join(bad))
  ptc = PTC.from_tree({k: v for k, v in sds.items()}) if sds else PTC((), ())
  # PTC.from_tree names leaves of this flat dict by its keys already.
  return ptc, extras, arrays


def run_id(run: str | None = None) -> str:
  """The run id ``save`` records: ``run``, else the ``TENPLEX_RUN``
  environment variable (``tenplex-jax launch`` sets one per generation,
  shared by all the generation's processes), else in a multi-process job
  an id its processes share through ``jax.distributed``'s key-value store,
  else ``""``."""
  if run is None:
    run = os.environ.get("TENPLEX_RUN") or _job_run()
  return str(run)


_AUTO_RUN: list[str] = []


def _job_run() -> str:
  """A run id shared by this job's processes when nothing names one: in a
  multi-process job, the first process to ask stores a fresh id in
  ``jax.distributed``'s key-value store and every process reads that one
  (each incarnation of a job has its own coordination service, so its own
  id). ``""`` in a single-process job, or if the store is unavailable."""
  if _AUTO_RUN:
    return _AUTO_RUN[0]
  run = ""
  if jax.process_count() > 1:
    try:
      from jax._src import distributed
      client = distributed.global_state.client
      if client is not None:
        key = "tenplex_jax/store/run"
        try:
          client.key_value_set(key, f"auto-{int(time.time())}-"
                               f"{uuid.uuid4().hex[:8]}")
        except Exception:  # another process set it first
          pass
        run = str(client.blocking_key_value_get(key, 60_000))
    except Exception:  # no coordination service: one unnamed run
      run = ""
  _AUTO_RUN.append(run)
  return run


def save(tree: Any, location: str, *, step: int = 0, mode: str = "local",
         central: str | None = None, replicas: int = 0,
         peers: Sequence[str] | None = None, keep: int = 2,
         run: str | None = None, delete_arrays: bool = False) -> str:
  """Writes this process's shards and the job's layout to its host store.

  Call it in every process of the job (no collectives are used). Each
  process writes one copy of each distinct box its devices hold.

  Args:
    tree: the state: a pytree of ``jax.Array``s (PRNG keys included) and
      plain leaves (``None``, bools, ints, floats, complex numbers,
      strings, numpy scalars and small numpy arrays), which are stored in
      the manifest and restored as saved.
    location: this host's store directory (e.g. under ``/dev/shm``), or
      ``s3://BUCKET/PREFIX`` / ``gs://BUCKET/PREFIX`` (every process
      uploads its snapshot; the round commits by its manifest, written
      last: see docs/store.md); another scheme raises :class:`UsageError`.
    step: the training step, recorded in the manifest: an integer in
      [0, 10**10), checked before anything is written. Saving a step
      again in the same run is a new round (see below).
    mode: ``"local"`` (each process writes to its own host's store) or
      ``"central"`` (every process sends its shards to the one store
      ``central``, a directory or a store server URL: Tenplex-Central).
    central: the central store, for ``mode="central"``.
    replicas: also copy this process's snapshot to the stores of the next
      ``replicas`` processes (round robin over ``peers``).
    peers: every process's store location, in process order (needed for
      ``replicas``).
    keep: snapshots kept per process, the new one included (older ones
      are deleted after the new one is committed; 0 keeps all). The
      default 2 keeps the previous round, so that if a process dies while
      the processes save a round, restore finds the previous round
      complete; it costs up to twice the state's size on each host.
    run: the run (job incarnation) saving, the same in all its processes:
      restore never combines snapshots of one step written by different
      runs. Default: the ``TENPLEX_RUN`` environment variable (set per
      generation by ``tenplex-jax launch``), else ``""`` (a single run).
    delete_arrays: delete each ``jax.Array`` of ``tree``
      (``jax.Array.delete``) as soon as its shards are written (a leaf
      that appears at several paths once all of them are), for a save
      after which this process does not use the state (a save for a
      resize): the memory each array held is free for the rest of the
      save, so the snapshot's pages reuse it instead of growing the
      process's footprint by the state's size first (a directory or
      object-storage store; to a store server, once the upload is done).
      Once it returns every array of ``tree`` is deleted (after a failure,
      some may be).

  Every call is one *round*: the processes of a run number their saves
  alike (1, 2, ...), and the manifest records ``(run, step, seq)``;
  restore combines only the snapshots of one round, never a mix (a
  process that died before its save leaves that round incomplete, and the
  previous round, kept by ``keep=2``, is restored). Staging directories
  of interrupted saves are reclaimed first (see :func:`gc`).

  Returns:
    The committed snapshot's directory (or the central server's answer).

  Raises:
    TreeError: some leaf is none of the above (names every such path).
    UsageError: ``step`` is not an integer in [0, 10**10).
    UnsafePathError: the store directory, one above it or its ``procs/``
      directories belong to another user or are writable by group or
      others (nothing is written; see docs/store.md, Security). What
      ``save`` writes is private: directories 0700, files 0600.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> snap = save({"w": jnp.ones((2, 2)), "step": 7}, d, step=7)
    >>> HostStore(d).manifest()["extras"]
    {'step': 7}
  """
  step = check_step(step)
  if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
    raise UsageError(f"keep={keep!r}: must be an integer >= 0")
  proc = jax.process_index()
  nproc = jax.process_count()
  run = run_id(run)
  ptc, extras, arrays = _snapshot_items(tree)
  if mode not in ("local", "central"):
    raise UsageError(f"mode must be 'local' or 'central', not {mode!r}")
  if mode == "central":
    if not central:
      raise UsageError("mode='central' needs central=<dir or URL>")
    target = central
  else:
    target = location
  loc = parse_location(target)
  target = loc.target
  seq = next_seq(target, proc, run)
  if loc.kind == PEER:
    out = _upload(RemoteStore(target), proc, nproc, step, ptc, extras,
                  arrays, mode, keep, run, seq)
    if delete_arrays:  # once the whole upload is done
      for leaf in {id(x): x for _, x, _, _ in arrays}.values():
        leaf.delete()
    return out
  if loc.kind == OBJECT:
    # No rename on object storage: the snapshot is written here, then
    # uploaded chunks first and its manifest (the commit) last.
    tmp = tempfile.mkdtemp(prefix="tenplex-jax-upload-")
    try:
      local = _write_snapshot(tmp, proc, nproc, step, seq, run, ptc, extras,
                              arrays, mode, keep=0,
                              delete_arrays=delete_arrays)
      snap = upload_snapshot(target, tmp, proc, local, keep=keep)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  else:
    snap = _write_snapshot(target, proc, nproc, step, seq, run, ptc, extras,
                           arrays, mode, keep=keep,
                           delete_arrays=delete_arrays)
  if replicas:
    if not peers or len(peers) < 2:
      raise StoreError(f"replicas={replicas} needs peers=[every process's"
                       " store location]")
    for k in range(1, min(replicas, len(peers) - 1) + 1):
      replicate(snap, proc, peers[(proc + k) % len(peers)], keep=keep)
  return snap


def _write_snapshot(root, proc, nproc, step, seq, run, ptc, extras, arrays,
                    mode, *, keep, delete_arrays=False):
  w = SnapshotWriter(root, proc, step=step, seq=seq, run=run)
  # delete_arrays: a leaf is deleted once the writes of every path holding
  # it are done, one leaf behind the writes submitted (the pool stays busy).
  uses = collections.Counter(id(leaf) for _, leaf, _, _ in arrays)
  pending: list = []  # (leaf, its writes' futures), oldest first

  def release(upto: int) -> None:
    while len(pending) > upto:
      leaf, futs = pending.pop(0)
      for f in futs:
        try:
          f.result()
        except Exception:  # noqa: BLE001 - commit raises it, as a StoreError
          pass
      uses[id(leaf)] -= 1
      if not uses[id(leaf)]:
        leaf.delete()
  try:
    for name, leaf, impl, boxes in arrays:
      t = ptc[name]
      w.declare(name, dtype=t.dtype, itemsize=t.itemsize, shape=t.shape,
                key_impl=impl)
      futs = [w.add(name, box, np.asarray(data)) for box, data in boxes]
      if delete_arrays:
        del boxes[:]  # the shards' arrays, held here
        pending.append((leaf, [f for f in futs if f is not None]))
        release(1)
    out = w.commit(ptc_json=ptc.to_json(), extras=extras,
                   num_processes=nproc, mode=mode, keep=keep, run=run)
    release(0)
    return out
  except BaseException:
    w.abort()
    raise


def _upload(remote: RemoteStore, proc, nproc, step, ptc, extras, arrays,
            mode, keep=2, run="", seq=1):
  tensors = {}
  boxes = []
  chunks = []
  nbytes = 0
  for name, leaf, impl, bxs in arrays:
    t = ptc[name]
    storage, extra = storage_of(t.dtype, t.itemsize)
    tensors[name] = {"dtype": t.dtype, "itemsize": t.itemsize,
                     "shape": list(t.shape), "key_impl": impl}
    for box, data in bxs:
      a = np.asarray(data)
      a = np.ascontiguousarray(a).view(storage)
      shape = [b - a_ for a_, b in box] + list(extra)
      boxes.append((name, [list(r) for r in box], a.nbytes, storage, shape))
      chunks.append(a)
      nbytes += a.nbytes
  header = {"step": step, "job": ptc.to_json(), "extras": extras,
            "num_processes": nproc, "mode": mode, "tensors": tensors,
            "boxes": boxes, "keep": keep, "run": run, "seq": seq}
  return remote.upload(proc, header, iter(chunks), nbytes)["snapshot"]


def replicate(snapshot: str, proc: int, dest: str, *, keep: int = 2
              ) -> None:
  """Copies a committed snapshot of process ``proc`` to store ``dest`` (a
  directory, or a store server URL), atomically; ``dest`` then keeps the
  newest ``keep`` snapshots of ``proc`` (as :func:`save`).

  ``dest`` may be object storage (``s3://``, ``gs://``; see
  :func:`save`); ``snapshot`` must be a local store's.
  """
  if parse_location(snapshot).kind != LOCAL:
    raise UsageError(f"replicate: {snapshot} is not a local snapshot"
                     " directory")
  loc = parse_location(dest)
  dest = loc.target
  if loc.kind == OBJECT:
    upload_snapshot(dest, os.path.dirname(os.path.dirname(os.path.dirname(
        snapshot))), proc, snapshot, keep=keep)
    return
  if loc.kind == PEER:
    src = HostStore(os.path.dirname(os.path.dirname(os.path.dirname(
        snapshot))))
    m = src.snap_manifest(proc, snapshot)
    rid = round_id(m)
    tensors = {p: {k: t[k] for k in ("dtype", "itemsize", "shape",
                                     "key_impl")}
               for p, t in m["tensors"].items()}
    boxes, chunks, nbytes = [], [], 0
    for p, t in m["tensors"].items():
      for b in t["boxes"]:
        box = tuple(tuple(r) for r in b["box"])
        a = src.read_storage(p, box, proc=proc, round=rid)
        boxes.append((p, b["box"], a.nbytes, a.dtype.name, list(a.shape)))
        chunks.append(a)
        nbytes += a.nbytes
    header = {"step": m["step"], "job": m["job"], "extras": m["extras"],
              "num_processes": m["num_processes"], "mode": "replica",
              "tensors": tensors, "boxes": boxes, "keep": keep,
              "run": m.get("run", ""), "seq": m.get("seq", 0)}
    RemoteStore(dest).upload(proc, header, iter(chunks), nbytes)
    return
  pdir = os.path.join(dest, "procs", str(proc))
  # A local ``dest`` is checked as save checks its store (UnsafePathError),
  # and the copy is private (0700/0600) whatever the source's modes.
  private.check_dir(dest)  # before anything is made there
  private.makedirs(pdir)
  ensure_store_id(dest)
  gc(dest)  # checks again, what exists now
  name = os.path.basename(snapshot)
  uid = uuid.uuid4().hex[:8]
  lock = os.path.join(pdir, f".lock-{uid}")
  fd = take_lock(lock)  # gc leaves the staging copy alone meanwhile
  try:
    staging = os.path.join(pdir, f".staging-{uid}")
    try:
      private.copytree(snapshot, staging)  # 0700/0600 whatever the source
      final = os.path.join(pdir, name)
      if os.path.exists(final):
        shutil.rmtree(staging)
      else:
        os.rename(staging, final)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
  finally:
    os.unlink(lock)
    os.close(fd)
  write_current(pdir, name)
  prune_snapshots(pdir, name, keep)


@dataclasses.dataclass(frozen=True)
class RestoreReport:
  """What one process's restore read, from where, and how long it took.

  Attributes:
    process_index: this process (of the new job).
    step: the restored step.
    n_tensors: arrays restored.
    state_bytes: bytes of one copy of the state.
    local_bytes: bytes read from this host's store(s).
    network_bytes: payload bytes read from peer store servers.
    planned_network_bytes: bytes of the distinct pieces this process's
      devices need whose planned source is on another host.
    host_lower_bound_bytes: bytes this host's devices need that no copy on
      this host held (what must cross the network at least).
    device_piece_bytes: bytes of all pieces of this process's devices, with
      duplicates across devices (what device-level reads would fetch).
    per_source_bytes: bytes read per store (directory or URL).
    fallbacks: reads that failed and were served by another copy.
    lost_processes: old processes no reachable store holds.
    from_checkpoint: the state came from the Orbax checkpoint.
    steps_lost: training steps lost: the newest step any store holds minus
      the restored step (an older complete snapshot, or the checkpoint).
    seconds: per phase (``manifest``, ``plan``, ``read``, ``build``,
      ``total``).
    dead_sources: store locations that did not answer, when the restore
      started or while it read (a killed peer); its reads moved to other
      copies.
  """

  process_index: int
  step: int
  n_tensors: int
  state_bytes: int
  local_bytes: int
  network_bytes: int
  planned_network_bytes: int
  host_lower_bound_bytes: int
  device_piece_bytes: int
  per_source_bytes: Mapping[str, int]
  fallbacks: tuple[str, ...]
  lost_processes: tuple[int, ...]
  from_checkpoint: bool
  steps_lost: int
  seconds: Mapping[str, float]
  dead_sources: tuple[str, ...] = ()

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["per_source_bytes"] = dict(self.per_source_bytes)
    d["seconds"] = dict(self.seconds)
    d["fallbacks"] = list(self.fallbacks)
    d["lost_processes"] = list(self.lost_processes)
    d["dead_sources"] = list(self.dead_sources)
    return d

  def __str__(self) -> str:
    mib = 1 << 20
    return (f"process {self.process_index} restored step {self.step}:"
            f" {self.n_tensors} arrays, {self.local_bytes / mib:.1f} MiB"
            f" local, {self.network_bytes / mib:.1f} MiB over the network"
            f" (host lower bound {self.host_lower_bound_bytes / mib:.1f}"
            f" MiB), {len(self.fallbacks)} fallbacks, in"
            f" {self.seconds.get('total', 0):.2f} s")


class _Source:
  """One reachable store: its handles and the snapshots it holds.

  ``rounds``: old process -> round id -> manifest, every kept snapshot
  whose manifest checks out; ``problems``: what was left out and why.
  """

  def __init__(self, name: str, handle, rounds: dict[int, dict[str, dict]],
               local: bool, problems=()):
    self.name = name
    self.handle = handle
    self.rounds = rounds
    self.local = local
    self.problems = list(problems)


def _gather(locations: Sequence[str], timeout: float, retries: int,
            token: str | None = None, ca_file: str | None = None):
  """(reachable sources, one per store id; {location: error} of the rest).

  Reads only: a directory that is not a store is reported, never made one.
  A TLS failure (plain HTTP while TLS is configured, a certificate that
  does not verify) is a configuration error, not a dead peer: raised.
  """
  by_id: dict[str, _Source] = {}
  unreachable = {}

  def probe(loc):  # (handle, error): each location's manifests, in parallel
    h = None
    try:
      h = open_store(loc, timeout=timeout, retries=retries, token=token,
                     ca_file=ca_file)
      if isinstance(h, HostStore):
        h.require_store()
        sid = h.identity()
      else:
        sid = h.store_id or "url:" + h.url
      return (h, sid, *h.all_rounds()), None
    except (private.UnsafePathError, StoreError) as e:
      close = getattr(h, "close", None)
      if close:
        close()
      return None, e

  if len(locations) > 1:
    with ThreadPoolExecutor(min(len(locations), 8)) as ex:
      probed = list(ex.map(probe, locations))
  else:
    probed = [probe(loc) for loc in locations]
  fatal = next((e for _, e in probed if isinstance(e, (
      private.UnsafePathError, TLSError))), None)
  if fatal is not None:  # refused, not unreachable: the operator must fix it
    for got, _ in probed:
      close = got and getattr(got[0], "close", None)
      if close:
        close()
    raise fatal
  for loc, (got, err) in zip(locations, probed):
    if err is not None:
      unreachable[loc] = str(err)
      continue
    h, sid, ms, problems = got
    local = isinstance(h, HostStore) and not h.remote
    src = _Source(loc, h, {k: {round_id(m): m for m in v}
                           for k, v in ms.items()}, local,
                  [f"{loc}: {p}" for p in problems])
    old = by_id.get(sid)
    if old is None or (local and not old.local):
      by_id[sid] = src
      if old is not None:
        _close([old])
    else:
      _close([src])
  return list(by_id.values()), unreachable


def _all_rounds(sources) -> list[tuple[str, int, str, int]]:
  """Every round the stores hold, newest first (by step, then the newest
  ``created`` time of its snapshots, then the sequence number): (round
  id, step, run, seq)."""
  info: dict[str, list] = {}
  for s in sources:
    for by_round in s.rounds.values():
      for rid, m in by_round.items():
        e = info.setdefault(rid, [m["step"], 0.0, int(m.get("seq", 0)),
                                  m.get("run", "")])
        e[1] = max(e[1], float(m.get("created", 0.0)))
  order = sorted(info, key=lambda r: (info[r][0], info[r][1], info[r][2]),
                 reverse=True)
  return [(r, info[r][0], info[r][3], info[r][2]) for r in order]


def _saved_state(sources, rid, wanted):
  """What the stores hold of round ``rid``: (holding: old process ->
  sources, a manifest, the saved layout, tensor infos, lost old
  processes, the layout of the surviving copies (of the ``wanted``
  paths), old device -> host, lost boxes). The snapshots of one round
  must agree on the job's layout and plain leaves, else :class:`StoreError`
  (they are not one state)."""
  holding: dict[int, list[_Source]] = collections.defaultdict(list)
  job = None
  for s in sorted(sources, key=lambda s: not s.local):
    for k, by_round in s.rounds.items():
      m = by_round.get(rid)
      if m is not None:
        if job is not None and (m["job"] != job["job"]
                                or m["extras"] != job["extras"]):
          raise StoreError(f"round {rid}: the snapshot of process {k} in"
                           f" {s.name} disagrees with the others on the"
                           " layout or the plain leaves")
        holding[k].append(s)
        job = job or m
  src_ptc = PTC.from_json(job["job"])
  tinfo = {}
  for k, srcs in holding.items():
    for p, t in srcs[0].rounds[k][rid]["tensors"].items():
      tinfo.setdefault(p, t)
  lost = tuple(sorted({p for _, p in src_ptc.processes} - set(holding)))
  host_ids = {id(s): i for i, s in enumerate(sources)}
  # Old layout: only devices whose process still has a copy; ids shifted.
  old_proc = src_ptc.process_of
  src_host = {}
  for d, k in src_ptc.processes:
    if k in holding:
      src_host[d + _OFFSET] = host_ids[id(holding[k][0])]
  tensors = []
  missing = []
  for t in src_ptc:
    if t.path not in wanted:  # not in the target: not read
      continue
    holders = []
    for box, hs in zip(t.placement.boxes, t.placement.holders):
      alive = tuple(h + _OFFSET for h in hs if old_proc[h] in holding)
      if not alive:
        missing.append(f"{t.path} box {list(box)} (held by devices"
                       f" {list(hs)} of processes"
                       f" {sorted({old_proc[h] for h in hs})})")
      holders.append(alive or (hs[0] + _OFFSET,))
    tensors.append(dataclasses.replace(
        t, placement=Placement(t.placement.boxes, tuple(holders))))
  src2 = PTC(tuple(tensors), tuple(sorted(src_host.items())))
  return holding, job, src_ptc, tinfo, lost, src2, src_host, missing


def _match_target(target, src_ptc, extras, step, mesh=None):
  """Matches the target's leaves with the saved state
  (:func:`tenplex_jax._targets.match_saved`).

  Returns ``(flat, treedef, arrays, values)``: the flattened target, the
  ``ShapeDtypeStruct`` of each array to restore (on a concrete sharding), by
  path, and the value of every other leaf, by its position in ``flat``.
  Raises :class:`TreeError` naming every leaf that does not fit.
  """
  saved = {t.path: t for t in src_ptc}
  where = f"step {step}"
  flat, treedef, slots, bad = match_saved(
      target, saved, where=where, mesh=mesh, aliases=False, key_data=False,
      values={k: v for k, v in extras.items() if v is not None})
  arrays, values = {}, {}
  for x in slots:
    name, leaf = x.path, x.leaf
    if x.array and x.saved is not None:
      arrays[name] = leaf
    elif x.array:
      if name in extras and extras[name] is not None:
        try:
          values[x.index] = _plain_to_array(_decode_extra(extras[name]), leaf)
        except ValueError as e:
          bad.append(Problem(name, str(e), "a saved value does not fit its"
                             " target"))
      else:
        bad.append(Problem(
            name, f"the target is {leaf_kind(leaf)}, {where} saved nothing"
            f" at this path (saved arrays: {list(saved)[:6]})",
            f"the target has arrays where {where} saved nothing"))
    elif name in extras:  # a plain leaf (or a placeholder): the saved value
      values[x.index] = _decode_extra(extras[name])
    elif name in saved:
      t = saved[name]
      sds = isinstance(leaf, jax.ShapeDtypeStruct)
      bad.append(Problem(
          name, f"the target is {leaf_kind(leaf)}"
          f"{' without a sharding' if sds else ''}, {where} saved an array"
          f" {t.dtype}{list(t.shape)}; give a jax.ShapeDtypeStruct with a"
          " sharding on the new mesh, or leave the path out of the target to"
          " skip it", "the target has no sharding where an array is saved"))
    elif isinstance(leaf, jax.ShapeDtypeStruct):
      bad.append(Problem(
          name, f"the target is {leaf_kind(leaf)} without a sharding and"
          f" {where} saved nothing at this path", "the target has no"
          " sharding and nothing is saved"))
    else:  # nothing saved here: the target's value passes through
      values[x.index] = leaf
  raise_tree_problems("the restore target does not match the saved state",
                      bad)
  return flat, treedef, arrays, values


def _plain_to_array(v, sds):
  """A saved plain value (e.g. ``step``) as an array on ``sds``'s sharding."""
  a = np.asarray(v)
  dt = np.dtype(sds.dtype)
  if a.dtype.hasobject or is_key(sds) or a.shape != tuple(sds.shape):
    raise ValueError(f"the target is {leaf_kind(sds)}, the saved value is"
                     f" {leaf_kind(v)}")
  b = a.astype(dt)
  if not np.array_equal(b.astype(a.dtype), a, equal_nan=a.dtype.kind in "fc"):
    raise ValueError(f"the saved value {v!r} does not fit the target"
                     f" dtype {dt.name}")
  return jax.make_array_from_callback(b.shape, sds.sharding,
                                      lambda idx: b[idx])


class _Fallback(Exception):
  """The stores hold no complete copy: restore from the checkpoint."""

  def __init__(self, why: str, step: int | None, lost=(), fallbacks=(),
               dead=(), cause: BaseException | None = None):
    super().__init__(why)
    self.why, self.step, self.lost = why, step, tuple(lost)
    self.fallbacks, self.dead, self.cause = (tuple(fallbacks), tuple(dead),
                                             cause)


def _vote(mine: int) -> int:
  """The largest of every process's ``mine`` (0 ok, 1 checkpoint, 2 error),
  so that all processes take the same path (Orbax restores collectively)."""
  votes = multihost_utils.process_allgather(np.array([mine], np.int32))
  return int(np.max(votes))


def restore_with_report(locations: Sequence[str] | str, target: Any, *,
                        step: int | None = None,
                        checkpoint: str | None = None,
                        timeout: float = 30.0, retries: int = 2,
                        workers: int = 8, token: str | None = None,
                        ca_file: str | None = None,
                        mesh: jax.sharding.Mesh | None = None
                        ) -> tuple[Any, RestoreReport]:
  """Like :func:`restore`, and also returns a :class:`RestoreReport`.

  With ``checkpoint`` in a multi-process job, the processes agree (one
  small collective) on whether every one of them could restore from the
  stores; if any could not, all restore from the checkpoint.
  """
  t0 = time.perf_counter()
  target = bind_target(target, mesh)  # shardings on an AbstractMesh
  if isinstance(locations, str):
    locations = [locations]
  me = jax.process_index()
  agree = bool(checkpoint) and jax.process_count() > 1
  if step is not None:
    step = check_step(step)
  sources = []
  try:
    try:
      sources, unreachable = _gather(locations, timeout, retries, token,
                                     ca_file)
      out, vote = _restore(sources, unreachable, target, step, checkpoint,
                           workers, t0, me), 0
    except _Fallback as e:
      out, vote = e, 1
    except BaseException:
      if agree:
        _vote(2)
      raise
  finally:
    _close(sources)
  if agree:
    worst = _vote(vote)
    if worst == 2:
      raise StoreError("another process of the job failed to restore (see"
                       " its error); this process stops too")
    if worst == 1 and vote == 0:
      _, rep = out
      out = _Fallback("another process of the job found no complete copy"
                      " in the stores, so every process restores from the"
                      " checkpoint", rep.step + rep.steps_lost,
                      rep.lost_processes, rep.fallbacks, rep.dead_sources)
  if isinstance(out, _Fallback):
    if out.cause is not None and not checkpoint:
      raise out.cause
    return _from_checkpoint(checkpoint, target, out, t0, locations)
  return out


def _choose_round(sources, unreachable, target, step, checkpoint, fallbacks,
                  dead):
  """The round to restore: ``(round id, its step, the newest step any
  store holds, _saved_state of it)``; what was passed over goes to
  ``fallbacks``. Raises :class:`_Fallback` when no round has a copy of
  every box (or the checkpoint is newer than the newest that has)."""
  # Every kept round (run, step, save sequence) of every process, newest
  # first. Without a step, the newest round of which every box has a copy
  # (an incomplete newer one is reported as steps lost); snapshots of
  # different rounds are never combined.
  rounds = _all_rounds(sources)
  if step is not None:
    step = check_step(step)
    rounds = [r for r in rounds if r[1] == step]
  if not rounds:
    problems = [m for src in sources for m in src.problems]
    where = f" ({'; '.join(problems[:3])})" if problems else ""
    why = ("no store holds a snapshot" if step is None
           else f"no store holds step {step}") + where
    if unreachable:
      why += "; unreachable: " + "; ".join(unreachable.values())
    raise _Fallback(why, step, (), fallbacks, dead)
  newest = rounds[0][1] if step is None else step
  wanted = {key_path_name(kp) for kp, x in
            jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_none)[0]
            if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))}
  reason = None
  for rid, st, run, seq in rounds:
    try:
      saved = _saved_state(sources, rid, wanted)
    except StoreError as e:
      reason = reason or (str(e), st, ())
      continue
    if not saved[-1]:
      break
    holding, job, src_ptc, tinfo, lost, src2, src_host, missing = saved
    why = (f"processes {list(lost)} of the saved job have no surviving"
           f" copy of round {rid!r} (step {st}, save {seq} of run"
           f" {run!r}) in any store ({len(missing)} boxes lost, e.g."
           f" {missing[0]})")
    runs = sorted({r for _, s2, r, _ in rounds if s2 == st})
    if len(runs) > 1:
      why = (f"step {st} mixes snapshots of different runs {runs}, none of"
             " which covers every box: " + why)
    if unreachable:
      why += "; unreachable: " + "; ".join(unreachable.values())
    reason = reason or (why, st, lost)
  else:
    raise _Fallback(reason[0], reason[1], reason[2], fallbacks, dead)
  step = st
  if step < newest:
    ck = ckpt.latest_step(checkpoint) if checkpoint else None
    if ck is not None and ck > step:  # the checkpoint is newer: use it
      raise _Fallback(reason[0] + f"; checkpoint step {ck} is newer than"
                      f" the newest complete snapshot (step {step})",
                      newest, reason[2], fallbacks, dead)
    fallbacks.append(reason[0] + f"; restored the newest complete snapshot,"
                     f" step {step}")
  elif reason is not None:
    fallbacks.append(reason[0] + f"; restored the previous complete round"
                     f" {rid!r} of step {step}")
  return rid, step, newest, saved


def _rank_copies(filled, the_plan, dst_ptc, saved, rid, my_host, maps):
  """Who serves each piece of the ``filled`` new boxes (see
  :func:`tenplex_jax.assembly.fill`): one :class:`StoreCopy` per (store,
  old process) snapshot of round ``rid``, ranked. Returns the
  :func:`tenplex_jax.assembly.fetch_pieces` jobs (large pieces split at
  chunk rows), the new box each job's destination lies in (in order, so
  that jobs ranked on stand-ins can be bound to the real buffers, see
  :func:`_bind`) and, for the report, the planned network bytes, the host
  lower bound and the bytes of every device's pieces."""
  holding, _, src_ptc, tinfo, _, src2, src_host, _ = saved
  old_proc = src_ptc.process_of
  # Ranked: the plan's choice first, then other replicas, this host's
  # stores before peers and buckets.
  copies: dict[tuple[int, int], StoreCopy] = {}

  def copy_of(s, k):
    c = copies.get((id(s), k))
    if c is None:
      c = copies[(id(s), k)] = StoreCopy(s.name, s.handle, k, rid,
                                         s.rounds[k][rid], maps)
    return c

  jobs = []  # (path, box, destination view, candidates, piece key)
  homes = []  # the new box each job's destination lies in
  planned_net = host_lb = dev_piece = 0
  local_boxes: dict[str, list[Box]] = {}  # old boxes this host's stores hold
  for nb, _, views in filled:
    t = dst_ptc[nb.path]
    tpl, rot = the_plan.template(nb.path)
    s_t = src2[nb.path]
    info = tinfo[nb.path]
    here = local_boxes.get(nb.path)
    if here is None:
      here = local_boxes[nb.path] = [
          box for box, hs in zip(s_t.placement.boxes, s_t.placement.holders)
          if any(src_host[h] == my_host for h in hs)]
    # Host lower bound: this box minus what this host's stores held.
    kept = 0
    for box in here:
      c = intersect(nb.box, box)
      kept += 0 if c is None else box_volume(c)
    host_lb += (box_volume(nb.box) - kept) * t.itemsize
    dev_piece += box_volume(nb.box) * t.itemsize * len(nb.holders)
    moves = {m.box: m for m in tpl.moves_to(nb.holders[0])}
    for piece, si, view in views:
      m = moves[piece]
      L = len(m.sources)
      cands = []
      for dev in (m.sources[(rot + j) % L] for j in range(L)):
        for s in holding[old_proc[dev - _OFFSET]]:
          c = copy_of(s, old_proc[dev - _OFFSET])
          if c not in cands:
            cands.append(c)
      cands.sort(key=lambda c: c.preference)  # own host first (stable)
      if not cands[0].local:
        planned_net += view.nbytes
      held = s_t.placement.boxes[si]
      rows = chunk_shape(tuple(b - a for a, b in held)
                          + tuple(info["extra"]),
                          np.dtype(info["storage"]).itemsize)[0] \
          if held else None
      for sub, part in _split_rows(piece, view, held, rows):
        jobs.append((nb.path, sub, part, cands, (nb.path, piece)))
        homes.append(nb.box)
  return jobs, homes, planned_net, host_lb, dev_piece


def _bind(jobs, homes, bufs):
  """The ``jobs`` of :func:`_rank_copies`, ranked on stand-ins, with each
  destination the real view: a piece's part of its new box's buffer in
  ``bufs`` (keyed ``(path, box)``; the same view :func:`fill` and
  :func:`_split_rows` give, as both only slice the box)."""
  return [(path, sub, bufs[(path, home)][relative_index(sub, home)], cands,
           key)
          for (path, sub, _, cands, key), home in zip(jobs, homes)]


# A restore of at least this many bytes per process (CPU devices) reads
# its shards straight into buffers that XLA allocated (see _owned_arrays).
_OWNED_MIN_BYTES = 256 << 20
_ZEROS: dict = {}  # (shapes, dtypes, shardings): the jitted zeros program
# The zeros program's output, run ahead (compile_restore(allocate=True)):
# at most one key, taken by the next restore with that key.
_AHEAD: dict = {}


def _owned_arrays(dst_sds: Mapping[str, Any], tinfo: Mapping[str, dict],
                  state_bytes: int) -> dict[str, jax.Array]:
  """The restore's new arrays, allocated by XLA (zeros, one program for
  all), by path, for the leaves a restore can read straight into: CPU
  devices, no key data, the storage dtype as wide as the logical one.

  A buffer XLA allocated is the array's own: a step that donates the array
  writes its result in place. An array built on a host buffer
  (``device_put(..., may_alias=True)``, the other leaves' path) is not:
  XLA leaves it alone and gives the step's outputs fresh memory, which on
  these VMs costs a page fault per 4 KiB page (the first step after a
  1.13 GiB restore took 0.96 s of CPU against 0.40 s for the next ones).
  Only from ``_OWNED_MIN_BYTES`` per process (the zeros program is one more
  compile, or a persistent cache hit); the same choice in every process
  (it runs the program collectively)."""
  if state_bytes < _OWNED_MIN_BYTES * jax.process_count():
    _AHEAD.clear()  # held for a larger layout: this restore reads none
    return {}
  names = []
  for name, sds in dst_sds.items():
    info = tinfo[name]
    if (info.get("key_impl") or tuple(info["extra"])
        or np.dtype(info["storage"]).itemsize != np.dtype(sds.dtype).itemsize
        or any(d.platform != "cpu" for d in sds.sharding.device_set)):
      continue
    names.append(name)
  if not names:
    _AHEAD.clear()
    return {}
  key = tuple((tuple(dst_sds[n].shape), jax.numpy.dtype(dst_sds[n].dtype),
               dst_sds[n].sharding) for n in names)
  arrays = _AHEAD.pop(key, None)  # allocated ahead (compile_restore)
  _AHEAD.clear()  # another layout's: freed before this one allocates
  if arrays is None:
    arrays = _zeros_program(key)()
  jax.block_until_ready(arrays)  # written by the reads next
  return dict(zip(names, arrays))


def _zeros_program(key: tuple, compiled: bool = False):
  """The zeros program of ``_owned_arrays`` for ``key`` (per array: shape,
  dtype, sharding), kept per process; ``compiled``: compiled now (ahead of
  time) if it is not yet."""
  fn = _ZEROS.get(key)
  if fn is None:
    if len(_ZEROS) > 16:
      _ZEROS.clear()
    specs = [(s, d) for s, d, _ in key]
    fn = _ZEROS[key] = jax.jit(
        lambda: tuple(jax.numpy.zeros(s, d) for s, d in specs),
        out_shardings=tuple(sh for _, _, sh in key))
  if compiled and not isinstance(fn, jax.stages.Compiled):
    fn = _ZEROS[key] = fn.lower().compile()
  return fn


def compile_restore(target: Any, mesh: jax.sharding.Mesh | None = None,
                    *, allocate: bool = False) -> bool:
  """Compiles, ahead of a restore onto ``target``, the program that
  allocates the arrays it reads into (``_owned_arrays``: CPU devices, from
  ``_OWNED_MIN_BYTES`` per process), or loads it from jax's persistent
  compilation cache, so that the restore only runs it. A process that
  waits for its turn (a group started ahead of a resize) calls it before
  waiting. It assumes every array leaf of ``target`` is saved in its own
  dtype; a restore that finds otherwise compiles its own program, as
  without this call. Returns whether a program was compiled or loaded.

  ``allocate=False`` allocates nothing (the restore runs the program and
  faults the pages in). ``allocate=True`` also runs it now: the arrays
  (zeros, every page faulted in) are held for the next restore with the
  same layout, which reads into them instead of allocating; the process
  holds the restored state's size (its share) more until then. The next
  restore frees them if its layout differs, :func:`release_restore` (or
  the process's exit) if none comes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compile_restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    False
  """
  target = bind_target(target, mesh)
  key = []
  for _, x in jax.tree_util.tree_flatten_with_path(target)[0]:
    sh = getattr(x, "sharding", None)
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or sh is None:
      continue
    if (jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        or any(d.platform != "cpu" for d in sh.device_set)):
      continue
    key.append((tuple(x.shape), jax.numpy.dtype(x.dtype), sh))
  total = sum(int(np.prod(s)) * d.itemsize for s, d, _ in key)
  if not key or total < _OWNED_MIN_BYTES * jax.process_count():
    return False
  key = tuple(key)
  fn = _zeros_program(key, compiled=True)
  if allocate:
    _AHEAD.clear()
    arrays = fn()
    jax.block_until_ready(arrays)  # every page written (faulted in) now
    _AHEAD[key] = arrays
  return True


def release_restore() -> None:
  """Frees the arrays ``compile_restore(..., allocate=True)`` holds for a
  restore that will not come (e.g. a group prepared ahead that is
  dropped); nothing if none are held.

  Example:
    >>> release_restore()
  """
  _AHEAD.clear()


def _writable(arr: jax.Array, storage: np.dtype) -> dict[int, np.ndarray]:
  """Writable views, in the storage dtype, of each addressable shard's
  buffer of the CPU array ``arr``, by device id."""
  out = {}
  for s in arr.addressable_shards:
    shape = tuple(s.data.shape)
    n = int(np.prod(shape)) * storage.itemsize
    if n == 0:
      out[s.device.id] = np.empty(shape, storage)
      continue
    raw = (ctypes.c_ubyte * n).from_address(s.data.unsafe_buffer_pointer())
    out[s.device.id] = np.frombuffer(raw, storage).reshape(shape)
  return out


def _restore(sources, unreachable, target, step, checkpoint, workers, t0,
             me):
  fallbacks = list(unreachable.values())
  for s in sources:
    fallbacks.extend(s.problems)  # snapshots left out (bad manifests)
  dead = set(unreachable)
  rid, step, newest, saved = _choose_round(
      sources, unreachable, target, step, checkpoint, fallbacks, dead)
  holding, job, src_ptc, tinfo, lost, src2, _, _ = saved
  extras = job["extras"]
  host_ids = {id(s): i for i, s in enumerate(sources)}
  my_host = next((host_ids[id(s)] for s in sources if s.local), -1)
  # New layout (physical: what each device must hold).
  flat, treedef, dst_sds, values = _match_target(target, src_ptc, extras,
                                                step)
  dst_ptc = PTC.from_tree(dst_sds)
  dst2 = PTC(dst_ptc.tensors, tuple(
      (d, my_host if p == me else -(p + 1)) for d, p in dst_ptc.processes))
  t1 = time.perf_counter()
  the_plan = plan(src2, dst2)
  t2 = time.perf_counter()  # "read" from here: buffers, ranking, reads
  # The distinct new boxes this process's devices hold (the restore core,
  # tenplex_jax.assembly), each in one aligned host buffer (storage dtype;
  # large ones recycled, see tenplex_jax._hostmem) that becomes the device
  # buffer without another copy (CPU devices alias aligned host memory).
  mine = {d.id for d in jax.local_devices()}
  bufs: dict[tuple[str, Box], np.ndarray] = {}
  maps = ChunkMaps()  # local chunks, each mapped and checked once
  buckets = [s.handle for s in sources
             if isinstance(s.handle, HostStore) and s.handle.remote]

  # The copies are ranked once, on stand-ins of the new boxes (same
  # shapes, no memory), before any buffer exists; the jobs are bound to
  # the real buffers once those are allocated (_bind).
  def stand_in(nb: NewBox) -> np.ndarray:
    info = tinfo[nb.path]
    return np.broadcast_to(np.empty((), np.dtype(info["storage"])),
                           nb.shape + tuple(info["extra"]))

  try:  # the chunk maps closed and the announced fetches dropped if
    # anything fails before the reads (which do both after)
    boxes = list(new_boxes(the_plan, dst_ptc, mine))
    ranked, homes, planned_net, host_lb, dev_piece = _rank_copies(
        fill(boxes, stand_in), the_plan, dst_ptc, saved, rid, my_host, maps)
    if buckets:
      # Reads from a bucket wait on the network, not on this host: every
      # piece the first-choice copies read is announced before anything
      # else (ObjectStore.prefetch), so that the chunk objects are fetched
      # in the order the pieces are read, a bounded window ahead of the
      # copies, while the new arrays are allocated (XLA's zeros program: a
      # compile and a pass over the state, 0.2-0.5 s for 1 GiB here) and
      # populated.
      for path, box, _, cands, _ in ranked:
        if cands and cands[0].name not in dead:
          pre = getattr(cands[0], "prefetch", None)
          if pre is not None:
            pre(path, box)
    # Large states on CPU: XLA's own buffers, so that the first step after
    # the restore can donate them (_owned_arrays).
    owned = _owned_arrays(dst_sds, tinfo, dst_ptc.nbytes)
    views = {name: _writable(a, np.dtype(tinfo[name]["storage"]))
             for name, a in owned.items()}

    def alloc(nb: NewBox) -> np.ndarray:
      info = tinfo[nb.path]
      if nb.path in views:  # the first holder's buffer; copied to the others
        buf = bufs[(nb.path, nb.box)] = views[nb.path][nb.holders[0]]
        return buf
      # Every byte is written next (the pieces tile the box): populated
      # below, once a bucket's requests are on their way.
      buf = bufs[(nb.path, nb.box)] = host_empty(
          nb.shape + tuple(info["extra"]), np.dtype(info["storage"]))
      return buf

    for nb in boxes:
      alloc(nb)
    jobs = _bind(ranked, homes, bufs)
    del ranked, homes
    per_source = collections.Counter()
    counts = {"local": 0, "net": 0}
    if buckets:
      workers = max(workers, _OBJECT_WORKERS)  # more reads in flight
    # The new boxes' pages made resident in one call each (while a bucket
    # answers the requests above) instead of a fault per page as they fill.
    for buf in bufs.values():
      populate(buf)
  except BaseException:
    maps.close()
    for h in buckets:
      h.drop_prefetched()
    raise
  try:
    served, errs = fetch_pieces(jobs, workers=workers, dead=dead,
                                batch_bytes=_BATCH_BYTES,
                                batch_pieces=_BATCH_PIECES)
  except StoreError as e:
    gone = {k for k, srcs in holding.items()
            if all(s.name in dead for s in srcs)}
    raise _Fallback(str(e), step, sorted(set(lost) | gone), fallbacks,
                    sorted(dead), cause=e) from e
  finally:
    maps.close()
    for h in buckets:
      h.drop_prefetched()
  fallbacks.extend(errs)
  for src, job in served:
    nb = job[2].nbytes
    per_source[src.name] += nb
    counts["local" if src.local else "net"] += nb
  local_bytes, net_bytes = counts["local"], counts["net"]
  t4 = time.perf_counter()
  # Place each distinct new box on its devices (one batched transfer).
  leaves, built = [], {}
  for i, (kp, leaf) in enumerate(flat):
    if i in values:
      continue
    name = key_path_name(kp)
    info = tinfo[name]
    if name in owned:  # read in place; a box several devices hold: copied
      t = dst_ptc[name]
      for d, view in views[name].items():
        src = bufs.get((name, t.shard_box(d)))
        if src is not None and src is not view:
          np.copyto(view, src)
      built[i] = owned[name]
      continue
    extra = tuple(info["extra"])
    key_impl = info.get("key_impl")
    t = dst_ptc[name]
    sharding = dst_sds[name].sharding
    if key_impl:
      sharding = key_data_sharding(sharding, len(t.shape), len(extra))
    hosts = shards_of(t, sharding, bufs, lambda box: np.empty(  # empty box
        tuple(b - a for a, b in box) + extra, np.dtype(info["storage"])))
    leaves.append((i, (tuple(t.shape) + extra, sharding,
                       {d: from_storage(h, info["dtype"])
                        for d, h in hosts.items()}, key_impl,
                       dst_sds[name].sharding)))
  built.update(zip([i for i, _ in leaves], place([x for _, x in leaves])))
  bufs.clear()
  views.clear()
  out_leaves = [values[i] if i in values else built[i]
                for i in range(len(flat))]
  tree = jax.tree_util.tree_unflatten(treedef, out_leaves)
  t5 = time.perf_counter()
  report = RestoreReport(
      process_index=me, step=step, n_tensors=len(dst_ptc),
      state_bytes=dst_ptc.nbytes, local_bytes=local_bytes,
      network_bytes=net_bytes, planned_network_bytes=planned_net,
      host_lower_bound_bytes=host_lb, device_piece_bytes=dev_piece,
      per_source_bytes=dict(per_source), fallbacks=tuple(fallbacks),
      lost_processes=lost, from_checkpoint=False, steps_lost=newest - step,
      seconds={"manifest": t1 - t0, "plan": t2 - t1, "read": t4 - t2,
               "build": t5 - t4, "total": t5 - t0},
      dead_sources=tuple(sorted(dead)))
  return tree, report


def _close(sources) -> None:
  for s in sources:
    close = getattr(s.handle, "close", None)
    if close:
      close()


def restore(locations: Sequence[str] | str, target: Any, **kwargs) -> Any:
  """Restores a saved state onto the target layout; call in every process.

  Args:
    locations: store directories (this host's), store server URLs
      (``http://127.0.0.1:PORT`` or ``https://HOST:PORT``, peers) and/or
      object-storage stores (``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``);
      a location with another scheme raises :class:`UsageError`.
    target: a pytree of ``jax.ShapeDtypeStruct``s with shardings on the new
      mesh (a live ``jax.Array`` counts as its layout). Any other leaf (a
      placeholder such as ``0`` or ``None``, or a ``ShapeDtypeStruct``
      without a sharding, as ``jax.eval_shape`` makes of Python ints)
      takes the saved plain value of its path, as saved; with nothing saved
      there it passes through. Saved arrays not in the target are not read.
    **kwargs: ``step`` (default: the newest), ``checkpoint`` (an Orbax
      checkpoint directory to fall back to when no copy survives),
      ``timeout``, ``retries``, ``workers``, ``token`` (the store
      servers' token; default the ``TENPLEX_JAX_STORE_TOKEN`` environment
      variable), ``ca_file`` (the CA file ``https://`` servers are verified
      against; default ``$TENPLEX_JAX_STORE_CA``; with one set, ``http://``
      locations are refused with :class:`TLSError`), ``mesh`` (the concrete
      mesh for target shardings on an ``AbstractMesh``, as ``nnx.eval_shape``
      gives under ``jax.set_mesh``; default: the mesh in context).

  Restores one round (see :func:`save`): the newest whose boxes all have
  a copy, never a mix of rounds. Reads only: nothing is written to the
  locations.

  Returns:
    The state on the target layout, bitwise equal to what was saved.

  Raises:
    NoCopyError: some piece has no surviving copy and no checkpoint is given.
    StoreError: every copy of a needed piece failed (names hosts and paths).
    UnsafePathError: a store directory given, one above it or its
      ``procs/`` directories belong to another user or are writable by
      group or others (nothing is read from it; see docs/store.md,
      Security).
    TreeError: the target does not match the saved state (names every
      mismatching leaf with the saved and the target shape, dtype or type).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jnp.arange(4.0), "step": 3}, d, step=3)
    >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    >>> out = restore([d], {"w": jax.ShapeDtypeStruct((4,), jnp.float32,
    ...                                               sharding=s), "step": 0})
    >>> out["w"].tolist(), out["step"], out["w"].sharding == s
    ([0.0, 1.0, 2.0, 3.0], 3, True)
  """
  return restore_with_report(locations, target, **kwargs)[0]


def save_checkpoint(directory: str, tree: Any, step: int) -> str:
  """Saves ``tree`` as ``directory/step_<step>`` with Orbax; call in every
  process. Returns the checkpoint path.

  On object storage (``s3://BUCKET/DIR``, ``gs://...``) a single process
  writes the Orbax checkpoint locally and uploads it (its commit markers
  last); in a multi-process job every process saves its own shards to the
  tenplex store ``DIR/tenplex-store`` instead (:func:`save`, ``keep=2``:
  the round commits by its manifests, written last) and the path returned
  is its snapshot's.

  ``directory`` (if made here) and ``step_<step>`` are made ``0700``, so
  other users cannot reach the files Orbax writes inside (with its own
  default modes).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from tenplex_jax.store import latest_step
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(d, {"w": jnp.ones(3)}, 5)
    >>> latest_step(d)
    5
  """
  if jax.process_count() > 1 and \
      parse_location(directory).kind == OBJECT:
    # Orbax 0.12 writes no s3:// path, and a checkpoint written locally
    # holds only this host's shards: each process uploads its own to the
    # tenplex store, the round committed by the manifests, written last.
    return save(tree, ckpt.store_url(directory), step=step, keep=2)
  return ckpt.save_orbax_checkpoint(directory, tree, step)


def restore_checkpoint(directory: str, target: Any) -> tuple[Any, int]:
  """Restores the newest checkpoint in ``directory`` onto ``target``
  (ShapeDtypeStructs with shardings); returns ``(tree, step)``.

  Reads any user's Orbax checkpoint as
  :func:`tenplex_jax.store.checkpoint.restore_orbax_checkpoint` does (which
  kinds, each process reading only its own devices' boxes).

  On object storage, the tenplex store ``directory/tenplex-store`` when
  its newest complete round is newer than the Orbax checkpoints there
  (:func:`restore`: every plain leaf as saved, each process reading only
  the boxes its devices need).

  Raises:
    NoCopyError: ``directory`` holds no Orbax checkpoint (nor store).
  """
  in_store = ckpt.store_step(directory)
  if in_store is not None:
    orbax_step = ckpt.orbax_step(directory)
    if orbax_step is None or in_store > orbax_step:
      tree, report = restore_with_report([ckpt.store_url(directory)],
                                         target)
      return tree, report.step
  return ckpt.restore_orbax_checkpoint(directory, target)


def _from_checkpoint(checkpoint, target, fb: _Fallback, t0, locations):
  dead = f" (dead: {list(fb.dead)})" if fb.dead else ""
  if not checkpoint:
    err = NoCopyError(f"cannot restore from stores {list(locations)}{dead}:"
                      f" {fb.why}; no checkpoint= to fall back to")
    err.dead_sources = tuple(fb.dead)
    raise err
  try:
    tree, ck_step = restore_checkpoint(checkpoint, target)
  except NoCopyError as e:
    err = NoCopyError(f"cannot restore from stores {list(locations)}{dead}:"
                      f" {fb.why}; and {e}")
    err.dead_sources = tuple(fb.dead)
    raise err from e
  lost_steps = 0 if fb.step is None else max(0, fb.step - ck_step)
  t1 = time.perf_counter()
  dst = PTC.from_tree({key_path_name(kp): leaf for kp, leaf in
                       jax.tree_util.tree_flatten_with_path(target)[0]
                       if isinstance(leaf, jax.ShapeDtypeStruct)
                       and leaf.sharding is not None})
  report = RestoreReport(
      process_index=jax.process_index(), step=ck_step, n_tensors=len(dst),
      state_bytes=dst.nbytes, local_bytes=0, network_bytes=0,
      planned_network_bytes=0, host_lower_bound_bytes=0,
      device_piece_bytes=0, per_source_bytes={},
      fallbacks=tuple(fb.fallbacks) + (fb.why,), lost_processes=fb.lost,
      from_checkpoint=True, steps_lost=lost_steps,
      seconds={"total": t1 - t0}, dead_sources=fb.dead)
  return tree, report
