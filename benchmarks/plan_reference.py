"""The planner's replica choice as it was before it scaled linearly (kept
for tests/test_planner_reference.py and the "before" column of
benchmarks/bench_plan.py; not used by the library).

It sorted every pool of replicas by load for every move: O(moves x replicas
x log replicas) time and an O(moves x replicas) output, 590 s at 65,536
devices. ``reference_moves(src, dst)`` returns, per tensor path, the old
template's ``(merges, moves)`` with each move as ``(box, src_box, dst,
sources)`` and ``sources`` the full pool sorted by load (preferred first).
"""

from __future__ import annotations

import collections

from tenplex_jax.errors import PlanError
from tenplex_jax.layout import PTC, box_volume
from tenplex_jax.planner import _grid, _split


def reference_template(shape, itemsize, src, dst, process_of, path):
  """The old ``plan_template``, verbatim but for its return value."""
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
          moves.append((piece, i, dev, (dev,)))
          continue
        holders = src.holders[i]
        near = [h for h in holders if process_of.get(h) == proc]
        pool = near or list(holders)
        pool.sort(key=lambda h: (sent_dev[h], sent_proc[process_of.get(h)], h))
        nb = box_volume(piece) * itemsize
        sent_dev[pool[0]] += nb
        sent_proc[process_of.get(pool[0])] += nb
        moves.append((piece, i, dev, tuple(pool)))
  return tuple(merges), tuple(moves)


def reference_moves(src: PTC, dst: PTC) -> dict:
  """Per path: the old planner's (merges, moves), one template per class."""
  process_of = {**src.process_of, **dst.process_of}
  cache, out = {}, {}
  for t in src:
    u = dst.by_path[t.path]
    key = (t.shape, t.itemsize, t.placement, u.placement)
    if key not in cache:
      cache[key] = reference_template(t.shape, t.itemsize, t.placement,
                                      u.placement, process_of, t.path)
    out[t.path] = cache[key]
  return out
