"""A store's snapshots as sources of boxes (:class:`tenplex_jax.sources.Source`).

:class:`StoreSource` is one round of a store directory (what
``tenplex_jax.orbax.convert`` exports and :func:`tenplex_jax.assembly.assemble`
restores from); :class:`StoreCopy` is one old process's snapshot of a round
in this host's store, a peer's store server or an object-storage bucket, the
unit the store restore (``tenplex_jax.store.restore``) ranks per piece.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from tenplex_jax.errors import NoCopyError, StoreError
from tenplex_jax.layout import PTC, Box, box_volume
from tenplex_jax.plain import decode_plain
from tenplex_jax.sources import HOST, PEER, PERSISTENT, Source, SourceTensor
from tenplex_jax.store.format import HostStore, round_id

__all__ = ["StoreCopy", "StoreSource"]


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

  def saved_values(self) -> dict[str, str]:
    """The round's strings by path (kept in its manifest)."""
    return {p: v for p, v in self.plain.items() if isinstance(v, str)}

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
  :func:`tenplex_jax.assembly.fetch_pieces`.

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
    trailing key-data dimensions), or converts to ``out``'s numeric dtype
    from the tensor's own (``int8``, ``bfloat16``; not a PRNG key's)."""
    t = self.manifest["tensors"][path]
    storage = np.dtype(t["storage"])
    if out.dtype != storage:
      if t.get("key_impl") or str(t["dtype"]).startswith("key<"):
        raise StoreError(f"{self.name}: {path!r} is a PRNG key array; it"
                         f" reads only as its key data ({storage}), not"
                         f" {out.dtype}")
      tmp = np.empty(out.shape, storage)  # read, then cast
      self.read_into(path, box, tmp)
      out[...] = tmp.view(jnp.dtype(t["dtype"]))
      return
    if self.direct:
      self.handle.read_into(path, box, out, proc=self.proc, maps=self.maps,
                            round=self.round)
    else:
      self.read_batch([(path, box, out)])

  def prefetch(self, path: str, box: Box) -> None:
    """Starts fetching what :meth:`read_into` of ``box`` will need, where
    the handle can (a bucket); nothing otherwise."""
    pre = getattr(self.handle, "prefetch", None) if self.direct else None
    if pre is not None:
      pre(path, box, proc=self.proc, round=self.round)

  def read_batch(self, items) -> None:
    """Reads ``[(path, box, out), ...]``: one request to a peer."""
    if self.direct:
      for path, box, out in items:
        self.read_into(path, box, out)
      return
    self.handle.read_into([(self.proc, path, box, out)
                           for path, box, out in items], round=self.round)



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
