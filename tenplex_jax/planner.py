"""The reconfiguration planner: split, re-partition (move), merge.

``plan(src, dst)`` is a pure function of two layouts. For every tensor it

1. **splits**: cuts every new box on the grid of the old boxes, so each piece
   lies inside exactly one old box;
2. **re-partitions**: for every destination device and piece, chooses where
   the piece comes from: the device itself if it already holds it (a local
   copy, no movement), else a replica in the same process, else the replica
   that keeps the bytes sent per device and per process balanced (the least
   loaded, found with two levels of heaps: O(log replicas) per piece);
3. **merges**: the pieces of a destination box are assembled into the new
   shard.

Only pieces a device does not already hold move, so the bytes moved equal the
lower bound (for each destination device, the bytes of its new shard that it
did not hold before). Tensors with the same (shape, old placement, new
placement) are planned once (the itemsize scales every load alike, so it
changes no choice); replica choices then rotate from tensor to tensor so that
their traffic spreads over the replicas. Planning time and memory grow
linearly in devices and tensors: a move's replicas are a view of its pool
(:class:`Move`), not a copy.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import heapq
import itertools
import json
from collections.abc import Iterator, Sequence

from tenplex_jax.errors import PlanError
from tenplex_jax.layout import PTC, Box, Placement, box_volume, intersect

__all__ = ["Group", "Move", "Plan", "Ring", "Template", "Transfer", "plan"]


class Ring(Sequence):
  """A pool of replicas read cyclically from one of them: ``pool[start:] +
  pool[:start]``, without the copy (every move drawing from a pool shares
  it). Compares equal to the tuple of its items.

  >>> r = Ring((3, 5, 7, 9), 2)
  >>> tuple(r), r[0], r[-1], len(r), 5 in r, r == (7, 9, 3, 5)
  ((7, 9, 3, 5), 7, 5, 4, True, True)
  """

  __slots__ = ("_pool", "_start")

  def __init__(self, pool: tuple[int, ...], start: int = 0):
    self._pool = pool
    self._start = start

  def __len__(self) -> int:
    return len(self._pool)

  def __getitem__(self, k):
    if isinstance(k, slice):
      return tuple(self)[k]
    n = len(self._pool)
    if not -n <= k < n:
      raise IndexError(f"index {k} out of range for {n} replicas")
    return self._pool[(self._start + k) % n]

  def __iter__(self):
    yield from self._pool[self._start:]
    yield from self._pool[:self._start]

  def __contains__(self, x) -> bool:
    return x in self._pool

  def __eq__(self, other) -> bool:
    if isinstance(other, Ring):
      if self._pool is other._pool:
        return self._start == other._start
    elif not isinstance(other, tuple):
      return NotImplemented
    return len(self) == len(other) and tuple(self) == tuple(other)

  def __hash__(self) -> int:
    return hash(tuple(self))

  def __repr__(self) -> str:
    return repr(tuple(self))


@dataclasses.dataclass(frozen=True)
class Move:
  """One piece of a destination shard and where it comes from.

  Attributes:
    box: the piece, in global coordinates of the tensor.
    src_box: index of the source box that contains the piece.
    dst: the destination device id.
    sources: the devices the piece may come from, preferred first: ``(dst,)``
      for a local copy, else the replicas of the source box in the
      destination's process (all of them if it has none) as a :class:`Ring`
      that starts at the least loaded one and goes on in device order;
      ``src`` is ``sources[rotation % len(sources)]`` for a tensor's
      rotation.
  """

  box: Box
  src_box: int
  dst: int
  sources: Sequence[int]

  def source(self, rotation: int = 0) -> int:
    return self.sources[rotation % len(self.sources)]

  @property
  def local(self) -> bool:
    return len(self.sources) == 1 and self.sources[0] == self.dst


@dataclasses.dataclass(frozen=True)
class Transfer:
  """A piece of one tensor sent from ``src`` to ``dst`` (``src == dst``: local).

  Attributes:
    path: the tensor's key path.
    box: the piece, in global coordinates.
    src: the source device id.
    dst: the destination device id.
    nbytes: the piece's size in bytes.
  """

  path: str
  box: Box
  src: int
  dst: int
  nbytes: int

  @property
  def local(self) -> bool:
    return self.src == self.dst


class _Choices:
  """The moves of one (shape, old placement, new placement) class, compactly:
  per move (in merge order of every destination device, devices in the new
  placement's order) its sources; :class:`Move` objects are made on demand."""

  def __init__(self, merges, dst: Placement, sources: list, moved: int,
               local: int):
    self.merges = merges
    self.dst = dst
    self.sources = sources
    self.moved_elems = moved
    self.local_elems = local
    self._start: dict[int, int] | None = None
    self._by_dst: dict[int, tuple[Move, ...]] = {}
    self._moves: tuple[Move, ...] | None = None

  def moves_to(self, device: int) -> tuple[Move, ...]:
    got = self._by_dst.get(device)
    if got is not None:
      return got
    j = self.dst.box_of_device.get(device)
    if j is None:
      return ()
    if self._start is None:
      start, at = {}, 0
      for pieces, devs in zip(self.merges, self.dst.holders):
        for d in devs:
          start[d] = at
          at += len(pieces)
      self._start = start
    at, src = self._start[device], self.sources
    got = tuple(Move(piece, i, device, _sources(src[at + k]))
                for k, (piece, i) in enumerate(self.merges[j]))
    self._by_dst[device] = got
    return got

  @property
  def moves(self) -> tuple[Move, ...]:
    if self._moves is None:
      out, src, at = [], self.sources, 0
      for pieces, devs in zip(self.merges, self.dst.holders):
        for d in devs:
          for piece, i in pieces:
            out.append(Move(piece, i, d, _sources(src[at])))
            at += 1
      self._moves = tuple(out)
    return self._moves


@dataclasses.dataclass(frozen=True, eq=False)
class Template:
  """The plan of one (shape, itemsize, old placement, new placement) class.

  Attributes:
    shape: the tensors' shape.
    itemsize: bytes per element.
    merges: for every new box (in the new placement's order), its pieces
      (``(piece box, source box index)``), which tile the new box.
    moves: per destination device, its moves in merge order, preferred
      source first in each move's ``sources`` (made on first use; templates
      that differ only in itemsize share them).
  """

  shape: tuple[int, ...]
  itemsize: int
  merges: tuple[tuple[tuple[Box, int], ...], ...]
  _choices: _Choices = dataclasses.field(repr=False)

  @property
  def moves(self) -> tuple[Move, ...]:
    return self._choices.moves

  @property
  def moved_bytes(self) -> int:
    return self._choices.moved_elems * self.itemsize

  @property
  def local_bytes(self) -> int:
    return self._choices.local_elems * self.itemsize

  def moves_to(self, device: int) -> tuple[Move, ...]:
    return self._choices.moves_to(device)

  def __eq__(self, other) -> bool:
    if not isinstance(other, Template):
      return NotImplemented
    return (self.shape == other.shape and self.itemsize == other.itemsize
            and self.merges == other.merges and (
                self._choices is other._choices or self.moves == other.moves))

  def __hash__(self) -> int:
    return hash((self.shape, self.itemsize, len(self.merges)))


@dataclasses.dataclass(frozen=True)
class Group:
  """Tensors planned by one template; tensor ``i`` uses rotation ``i``."""

  template: Template
  paths: tuple[str, ...]


def _grid(boxes: Sequence[Box], ndim: int):
  """Per dim, the sorted distinct intervals; None if boxes are no grid."""
  per_dim = [sorted({b[d] for b in boxes}) for d in range(ndim)]
  n = 1
  for ivs in per_dim:
    n *= len(ivs)
  if n != len(boxes):
    return None
  for ivs in per_dim:
    for (a0, a1), (b0, b1) in zip(ivs, ivs[1:]):
      if a1 > b0:  # overlapping intervals: not a grid
        return None
  return per_dim


def _split(dst_box: Box, src_boxes: Sequence[Box], grid, index_of) -> list:
  """Cuts ``dst_box`` on the source grid: [(piece, source box index)]."""
  if grid is None:  # general (non-grid) boxes: pairwise intersection
    out = []
    for i, b in enumerate(src_boxes):
      p = intersect(dst_box, b)
      if p is not None:
        out.append((p, i))
    return out
  ranges = []
  for d, (lo, hi) in enumerate(dst_box):
    ivs = grid[d]
    starts = [iv[0] for iv in ivs]
    j = max(bisect.bisect_right(starts, lo) - 1, 0)
    hits = []
    while j < len(ivs) and (ivs[j][0] < hi or (lo == hi and ivs[j][0] == lo)):
      a, b = ivs[j]
      piece = (max(a, lo), min(b, hi))
      if piece[1] > piece[0] or (lo == hi and a == b == lo):
        hits.append((piece, ivs[j]))
      j += 1
    ranges.append(hits)
  out = []
  for combo in itertools.product(*ranges):
    piece = tuple(c[0] for c in combo)
    src = tuple(c[1] for c in combo)
    out.append((piece, index_of[src]))
  return out


def _merges(shape, src: Placement, dst: Placement, path: str):
  """Every new box cut on the old boxes: per new box, [(piece, old box)]."""
  grid = _grid(src.boxes, len(shape))
  index_of = {b: i for i, b in enumerate(src.boxes)}
  merges = []
  for dbox in dst.boxes:
    pieces = _split(dbox, src.boxes, grid, index_of)
    covered = sum(box_volume(p) for p, _ in pieces)
    if covered != box_volume(dbox):
      raise PlanError(f"{path}: new box {dbox} is covered by {covered} of"
                      f" {box_volume(dbox)} elements of the old layout")
    merges.append(tuple(pieces))
  return tuple(merges)


def _ring_starts(pool: tuple[int, ...]) -> dict[int, tuple]:
  """Per replica of ``pool``, the (pool, position) its Ring starts at."""
  return dict(zip(pool, zip(itertools.repeat(pool), range(len(pool)))))


def _sources(kept) -> Sequence[int]:
  """A move's sources from what _choose keeps: device or (pool, start)."""
  return Ring(*kept) if type(kept) is tuple else (kept,)


def _choose(merges, src: Placement, dst: Placement,
            process_of: dict[int, int]) -> _Choices:
  """Picks the source of every move: the device itself if it holds the
  piece, else the least loaded replica in its process, else the least
  loaded replica, by (elements sent by the device, elements sent by its
  process, device id).

  Loads are kept in two levels of heaps: per old box and process, its
  replicas by (device load, id); per old box, one entry per process with
  its least loaded replica. A process's load grows when any of its devices
  sends, which leaves that process's entries in other boxes' heaps low;
  loads only grow, so a low entry is fixed when it reaches the top (lazy
  update). Each pick is O(log replicas) amortised.
  """
  pget = process_of.get
  src_box_of = src.box_of_device
  heapreplace = heapq.heapreplace
  sent_proc = collections.defaultdict(int)
  # Per old box: {process: [(load, device)]}, the heap over its processes
  # [(load, process load, device, process)] and _ring_starts of all its
  # replicas (both made on first use). A move's sources are kept as
  # (pool, start), or the device for a local copy, and become a Ring (or
  # (device,)) in Move.sources.
  pools: dict[int, list] = {}
  near_rings: dict[tuple, dict] = {}  # (old box, process) -> _ring_starts
  sources: list = []
  append = sources.append
  moved = local = 0
  if src == dst:  # every device keeps its shard
    for pieces, devs in zip(merges, dst.holders):
      sources.extend(devs)
      local += box_volume(pieces[0][0]) * len(devs)
    return _Choices(merges, dst, sources, 0, local)
  src_get = src_box_of.get
  for pieces, devs in zip(merges, dst.holders):
    state = [[i, box_volume(p), None] for p, i in pieces]
    for dev, held, proc in zip(devs, map(src_get, devs), map(pget, devs)):
      for st in state:
        i, nb, pool = st
        if held == i:
          append(dev)
          local += nb
          continue
        moved += nb
        if pool is None:
          pool = pools.get(i)
          if pool is None:
            g: dict = {}
            for h in src.holders[i]:
              g.setdefault(pget(h), []).append((0, h))
            for heap in g.values():
              heapq.heapify(heap)
            pool = pools[i] = [g, None, None]
          st[2] = pool
        g = pool[0]
        near = g.get(proc)
        if near is not None:  # a replica in the destination's process
          load, h = near[0]
          heapreplace(near, (load + nb, h))
          sent_proc[proc] += nb
          rings = near_rings.get((i, proc))
          if rings is None:
            rings = near_rings[(i, proc)] = _ring_starts(
                tuple(h for h in src.holders[i] if pget(h) == proc))
          append(rings[h])
          continue
        top = pool[1]
        if top is None:
          top = [(q[0][0], sent_proc[p], q[0][1], p) for p, q in g.items()]
          heapq.heapify(top)
          pool[1], pool[2] = top, _ring_starts(src.holders[i])
        while True:  # the least loaded replica; fix low entries on the way
          load, pl, h, p = top[0]
          q = g[p]
          e = q[0]
          spl = sent_proc[p]
          if e[1] == h and e[0] == load and spl == pl:
            break
          heapreplace(top, (e[0], spl, e[1], p))
        heapreplace(q, (load + nb, h))
        spl += nb
        sent_proc[p] = spl
        e = q[0]
        heapreplace(top, (e[0], spl, e[1], p))
        append(pool[2][h])
  return _Choices(merges, dst, sources, moved, local)


def plan_template(shape, itemsize, src: Placement, dst: Placement,
                  process_of: dict[int, int], path: str) -> Template:
  merges = _merges(shape, src, dst, path)
  return Template(tuple(shape), itemsize, merges,
                  _choose(merges, src, dst, process_of))


def _lower_bound_elems(src: Placement, dst: Placement) -> int:
  """Elements of new shards their devices did not hold before (independent
  of any plan: one box intersection per (new box, old box held) pair)."""
  src_of = src.box_of_device
  total = 0
  for box, devs in zip(dst.boxes, dst.holders):
    vol = box_volume(box)
    for i, n in collections.Counter(map(src_of.get, devs)).items():
      kept = 0
      if i is not None:
        common = intersect(box, src.boxes[i])
        kept = 0 if common is None else box_volume(common)
      total += (vol - kept) * n
  return total


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """A reconfiguration plan between two layouts (see :func:`plan`).

  Attributes:
    src: the old layout.
    dst: the new layout.
    groups: tensors planned together, each with its template.
    lower_bound_bytes: for each destination device, the bytes of its new
      shard that it did not already hold, summed.
  """

  src: PTC
  dst: PTC
  groups: tuple[Group, ...]
  lower_bound_bytes: int

  @functools.cached_property
  def _where(self) -> dict[str, tuple[Template, int]]:
    return {p: (g.template, i) for g in self.groups
            for i, p in enumerate(g.paths)}

  def template(self, path: str) -> tuple[Template, int]:
    """The template planning tensor ``path`` and its replica rotation."""
    return self._where[path]

  @functools.cached_property
  def moved_bytes(self) -> int:
    """Bytes that arrive at a device from another device."""
    return sum(g.template.moved_bytes * len(g.paths) for g in self.groups)

  @functools.cached_property
  def local_bytes(self) -> int:
    """Bytes of new shards that stay on the device that held them."""
    return sum(g.template.local_bytes * len(g.paths) for g in self.groups)

  @property
  def naive_bytes(self) -> int:
    """Bytes moved by shipping the whole state: every new shard sent whole."""
    return self.moved_bytes + self.local_bytes

  def transfers(self, path: str | None = None) -> Iterator[Transfer]:
    """Every piece movement (local copies included), optionally of one tensor."""
    groups = self.groups
    for g in groups:
      t = g.template
      for i, p in enumerate(g.paths):
        if path is not None and p != path:
          continue
        for m in t.moves:
          yield Transfer(p, m.box, m.source(i), m.dst,
                         box_volume(m.box) * t.itemsize)

  @functools.cached_property
  def traffic(self) -> dict:
    """Bytes sent and received per device and per (src, dst) process pair."""
    sent = collections.Counter()
    recv = collections.Counter()
    pairs = collections.Counter()
    proc = {**self.src.process_of, **self.dst.process_of}
    for g in self.groups:
      t = g.template
      n = len(g.paths)
      for m in t.moves:
        if m.local:
          continue
        nb = box_volume(m.box) * t.itemsize
        recv[m.dst] += nb * n
        # Rotation i picks sources[i % L]: count how often each is picked
        # (the first min(n, L) sources only).
        L = len(m.sources)
        for k in range(min(n, L)):
          s = m.sources[k]
          times = n // L + (1 if k < n % L else 0)
          sent[s] += nb * times
          pairs[(proc.get(s), proc.get(m.dst))] += nb * times
    return {"sent": dict(sent), "received": dict(recv), "process_pairs":
            dict(pairs)}

  def summary(self) -> str:
    """A readable table: bytes per device, per process pair, totals."""
    tr = self.traffic
    lines = [
        f"tenplex_jax plan: {len(self.src)} tensors, "
        f"{len(self.src.devices)} -> {len(self.dst.devices)} devices, "
        f"{len(self.groups)} distinct tensor plans",
        "",
        f"{'device':>8} {'process':>8} {'received':>14} {'sent':>14}",
    ]
    proc = {**self.src.process_of, **self.dst.process_of}
    for d in sorted(set(self.src.devices) | set(self.dst.devices)):
      lines.append(f"{d:>8} {proc.get(d, '-'):>8} "
                   f"{fmt_bytes(tr['received'].get(d, 0)):>14} "
                   f"{fmt_bytes(tr['sent'].get(d, 0)):>14}")
    lines += ["", f"{'from process':>12} {'to process':>10} {'bytes':>14}"]
    for (a, b), nb in sorted(tr["process_pairs"].items()):
      lines.append(f"{a:>12} {b:>10} {fmt_bytes(nb):>14}")
    lines += [
        "",
        f"state size (one copy)   {fmt_bytes(self.src.nbytes):>14}",
        f"moved between devices   {fmt_bytes(self.moved_bytes):>14}",
        f"lower bound             {fmt_bytes(self.lower_bound_bytes):>14}",
        f"kept in place           {fmt_bytes(self.local_bytes):>14}",
        f"naive (ship every shard){fmt_bytes(self.naive_bytes):>14}",
    ]
    if self.naive_bytes:
      lines.append(f"moved / naive           "
                   f"{self.moved_bytes / self.naive_bytes:>14.1%}")
    return "\n".join(lines)

  def to_json(self) -> str:
    """The plan as JSON: totals, and per template its merges and moves."""
    return json.dumps({
        "format": "tenplex_jax.Plan",
        "version": 1,
        "moved_bytes": self.moved_bytes,
        "lower_bound_bytes": self.lower_bound_bytes,
        "local_bytes": self.local_bytes,
        "naive_bytes": self.naive_bytes,
        "groups": [{
            "paths": list(g.paths),
            "shape": list(g.template.shape),
            "itemsize": g.template.itemsize,
            "merges": [[[[list(r) for r in p], i] for p, i in m]
                       for m in g.template.merges],
            "moves": [{"box": [list(r) for r in m.box], "src_box": m.src_box,
                       "dst": m.dst, "sources": list(m.sources)}
                      for m in g.template.moves],
        } for g in self.groups],
    })


def fmt_bytes(n: float) -> str:
  """``1536`` -> ``'1.50 KiB'``.

  >>> fmt_bytes(1536)
  '1.50 KiB'
  """
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return str(n)




def check_compatible(src: PTC, dst: PTC) -> None:
  """Raises PlanError unless both layouts hold the same tensors.

  Every problem is reported together: missing or extra paths, and per path
  the shape and dtype that differ.
  """
  problems = []
  sp, dp = set(src.paths), set(dst.paths)
  if sp - dp:
    problems.append(f"only in the old layout: {sorted(sp - dp)}")
  if dp - sp:
    problems.append(f"only in the new layout: {sorted(dp - sp)}")
  for t in src:
    u = dst.by_path.get(t.path)
    if u is None:
      continue
    if t.shape != u.shape:
      problems.append(f"{t.path}: shape {t.shape} in the old layout, "
                      f"{u.shape} in the new")
    if t.dtype != u.dtype or t.itemsize != u.itemsize:
      problems.append(f"{t.path}: dtype {t.dtype} in the old layout, "
                      f"{u.dtype} in the new")
  if problems:
    raise PlanError("layouts do not match:\n  " + "\n  ".join(problems))


def plan(src: PTC, dst: PTC) -> Plan:
  """Plans the reconfiguration from layout ``src`` to layout ``dst``.

  A pure function: no devices, no I/O. Tensors are matched by path.

  Args:
    src: the current layout.
    dst: the target layout.

  Returns:
    The :class:`Plan`; its ``moved_bytes`` equals its ``lower_bound_bytes``.

  Raises:
    PlanError: the layouts hold different tensors, shapes or dtypes.

  Example:
    >>> from tenplex_jax.layout import named_layout, ptc_from_layouts
    >>> a = ptc_from_layouts([named_layout("w", (8, 8), "float32",
    ...     mesh_shape={"data": 2, "tensor": 2}, spec=(None, "tensor"))])
    >>> b = ptc_from_layouts([named_layout("w", (8, 8), "float32",
    ...     mesh_shape={"data": 1, "tensor": 4}, spec=(None, "tensor"))])
    >>> p = plan(a, b)
    >>> p.moved_bytes == p.lower_bound_bytes
    True
    >>> p.moved_bytes  # devices 1 and 2 each fetch an 8 x 2 float32 piece
    128
  """
  check_compatible(src, dst)
  process_of = {**src.process_of, **dst.process_of}
  cache: dict[tuple, Template] = {}
  members: dict[tuple, list[str]] = {}
  classes: dict[tuple, tuple[_Choices, int]] = {}
  for t in src:
    u = dst.by_path[t.path]
    key = (t.shape, t.itemsize, t.placement, u.placement)
    if key not in cache:
      ckey = (t.shape, t.placement, u.placement)
      if ckey not in classes:
        t.placement.check_tiles(t.shape, t.path)
        u.placement.check_tiles(u.shape, t.path)
        merges = _merges(t.shape, t.placement, u.placement, t.path)
        classes[ckey] = (_choose(merges, t.placement, u.placement, process_of),
                         _lower_bound_elems(t.placement, u.placement))
      choices = classes[ckey][0]
      cache[key] = Template(tuple(t.shape), t.itemsize, choices.merges,
                            choices)
      members[key] = []
    members[key].append(t.path)
  lower = sum(classes[(k[0], k[2], k[3])][1] * k[1] * len(v)
              for k, v in members.items())
  groups = tuple(Group(cache[k], tuple(v)) for k, v in members.items())
  return Plan(src, dst, groups, lower)
