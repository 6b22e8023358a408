"""The reconfiguration planner: split, re-partition (move), merge.

``plan(src, dst)`` is a pure function of two layouts. For every tensor it

1. **splits**: cuts every new box on the grid of the old boxes, so each piece
   lies inside exactly one old box;
2. **re-partitions**: for every destination device and piece, chooses where
   the piece comes from: the device itself if it already holds it (a local
   copy, no movement), else a replica in the same process, else the replica
   that keeps the bytes sent per device and per process balanced;
3. **merges**: the pieces of a destination box are assembled into the new
   shard.

Only pieces a device does not already hold move, so the bytes moved equal the
lower bound (for each destination device, the bytes of its new shard that it
did not hold before). Tensors with the same (shape, itemsize, old placement,
new placement) are planned once; replica choices then rotate from tensor to
tensor so that their traffic spreads over the replicas.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import json
from collections.abc import Iterator, Sequence

from tenplex_jax.errors import PlanError
from tenplex_jax.layout import PTC, Box, Placement, TensorLayout, box_volume, intersect

__all__ = ["Group", "Move", "Plan", "Template", "Transfer", "plan"]


@dataclasses.dataclass(frozen=True)
class Move:
  """One piece of a destination shard and where it comes from.

  Attributes:
    box: the piece, in global coordinates of the tensor.
    src_box: index of the source box that contains the piece.
    dst: the destination device id.
    sources: the devices the piece may come from, preferred first; ``src``
      is ``sources[rotation % len(sources)]`` for a tensor's rotation.
  """

  box: Box
  src_box: int
  dst: int
  sources: tuple[int, ...]

  def source(self, rotation: int = 0) -> int:
    return self.sources[rotation % len(self.sources)]

  @property
  def local(self) -> bool:
    return self.sources == (self.dst,)


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


@dataclasses.dataclass(frozen=True)
class Template:
  """The plan of one (shape, itemsize, old placement, new placement) class.

  Attributes:
    shape: the tensors' shape.
    itemsize: bytes per element.
    merges: for every new box (in the new placement's order), its pieces
      (``(piece box, source box index)``), which tile the new box.
    moves: per destination device, its moves in merge order, preferred
      source first in each move's ``sources``.
  """

  shape: tuple[int, ...]
  itemsize: int
  merges: tuple[tuple[tuple[Box, int], ...], ...]
  moves: tuple[Move, ...]

  @functools.cached_property
  def moved_bytes(self) -> int:
    return sum(box_volume(m.box) for m in self.moves
               if not m.local) * self.itemsize

  def moves_to(self, device: int) -> tuple[Move, ...]:
    return self._by_dst.get(device, ())

  @functools.cached_property
  def _by_dst(self) -> dict[int, tuple[Move, ...]]:
    out = collections.defaultdict(list)
    for m in self.moves:
      out[m.dst].append(m)
    return {k: tuple(v) for k, v in out.items()}


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


def _plan_template(shape, itemsize, src: Placement, dst: Placement,
                   process_of: dict[int, int], path: str) -> Template:
  ndim = len(shape)
  grid = _grid(src.boxes, ndim)
  index_of = {b: i for i, b in enumerate(src.boxes)}
  merges = []
  for dbox in dst.boxes:
    pieces = _split(dbox, src.boxes, grid, index_of)
    covered = sum(box_volume(p) for p, _ in pieces)
    if covered != box_volume(dbox):
      raise PlanError(f"{path}: new box {dbox} is covered by {covered} of"
                      f" {box_volume(dbox)} elements of the old layout")
    merges.append(tuple(pieces))
  src_box_of = src.box_of_device
  sent_dev: collections.Counter = collections.Counter()
  sent_proc: collections.Counter = collections.Counter()
  moves = []
  for j, devs in enumerate(dst.holders):
    for dev in devs:
      held = src_box_of.get(dev)
      proc = process_of.get(dev)
      for piece, i in merges[j]:
        if held == i:
          moves.append(Move(piece, i, dev, (dev,)))
          continue
        holders = src.holders[i]
        near = [h for h in holders if process_of.get(h) == proc]
        pool = near or list(holders)
        # Least-loaded first: bytes sent by the device, then by its process.
        pool.sort(key=lambda h: (sent_dev[h], sent_proc[process_of.get(h)], h))
        nb = box_volume(piece) * itemsize
        sent_dev[pool[0]] += nb
        sent_proc[process_of.get(pool[0])] += nb
        moves.append(Move(piece, i, dev, tuple(pool)))
  return Template(tuple(shape), itemsize, tuple(merges), tuple(moves))


def _lower_bound(t_src: TensorLayout, t_dst: TensorLayout) -> int:
  """Bytes of new shards their devices did not hold before (independent of
  any plan: one box intersection per destination device)."""
  total = 0
  for box, devs in zip(t_dst.placement.boxes, t_dst.placement.holders):
    vol = box_volume(box)
    for d in devs:
      old = t_src.shard_box(d)
      kept = 0
      if old is not None:
        common = intersect(box, old)
        kept = 0 if common is None else box_volume(common)
      total += vol - kept
  return total * t_src.itemsize


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
    return sum(box_volume(m.box) * g.template.itemsize * len(g.paths)
               for g in self.groups for m in g.template.moves if m.local)

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
        # Rotation i picks sources[i % L]: count how often each is picked.
        L = len(m.sources)
        for k, s in enumerate(m.sources):
          times = n // L + (1 if k < n % L else 0)
          if times:
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
  bounds: dict[tuple, int] = {}
  for t in src:
    u = dst.by_path[t.path]
    key = (t.shape, t.itemsize, t.placement, u.placement)
    if key not in cache:
      t.placement.check_tiles(t.shape, t.path)
      u.placement.check_tiles(u.shape, t.path)
      cache[key] = _plan_template(t.shape, t.itemsize, t.placement,
                                  u.placement, process_of, t.path)
      members[key] = []
      bounds[key] = _lower_bound(t, u)
    members[key].append(t.path)
  lower = sum(bounds[k] * len(v) for k, v in members.items())
  groups = tuple(Group(cache[k], tuple(v)) for k, v in members.items())
  return Plan(src, dst, groups, lower)
