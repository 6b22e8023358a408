"""The linear-time planner against the planner it replaced
(benchmarks/plan_reference.py), on random small layouts (hypothesis).

Everything the old planner decided is kept: the same pieces (merges), the
same moves in the same order, the same local copies, the same chosen source
for every move (so the same transfers of rotation 0 and the same loads
after every pick), the same replicas to fall back on, the same byte totals.
What changed is only the order of the fallback replicas after the chosen
one: the old planner sorted every pool by load for every move (O(replicas)
per move, 590 s at 65,536 devices); a move's sources are now the pool read
cyclically from the chosen replica (a view, O(1) per move).
"""

import math
import os
import sys

from hypothesis import given, settings, strategies as st

from tenplex_jax import plan
from tenplex_jax.layout import box_volume, named_layout, ptc_from_layouts
from tenplex_jax.planner import Ring

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from plan_reference import reference_moves  # noqa: E402
from test_planner import mesh_and_spec  # noqa: E402  (the same random meshes)


def _parts(mesh, spec, d):
  e = spec[d]
  axes = () if e is None else ((e,) if isinstance(e, str) else e)
  return math.prod(mesh[a] for a in axes)


@st.composite
def layout_pairs(draw):
  """A few tensors between two random meshes over random device ids, with
  processes of 1-4 devices or a random device -> process map."""
  ndim = draw(st.integers(0, 3))
  src_mesh, src_spec, n_src = draw(mesh_and_spec(ndim))
  dst_mesh, dst_spec, n_dst = draw(mesh_and_spec(ndim))
  shape = [math.lcm(_parts(src_mesh, src_spec, d), _parts(dst_mesh, dst_spec, d))
           * draw(st.integers(0, 3)) for d in range(ndim)]
  rnd = draw(st.randoms())
  pool = list(range(max(n_src, n_dst) + draw(st.integers(0, 4))))
  src_ids, dst_ids = rnd.sample(pool, n_src), rnd.sample(pool, n_dst)
  if draw(st.booleans()):
    procs = draw(st.sampled_from([1, 2, 4]))
  else:
    n_proc = draw(st.integers(1, 4))
    procs = {d: rnd.randrange(n_proc) for d in pool}
  a, b = [], []
  for k in range(draw(st.integers(1, 4))):
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
    a.append(named_layout(f"t{k}", shape, dtype, mesh_shape=src_mesh,
                          spec=src_spec, device_ids=src_ids))
    b.append(named_layout(f"t{k}", shape, dtype, mesh_shape=dst_mesh,
                          spec=dst_spec, device_ids=dst_ids))
  return ptc_from_layouts(a, procs), ptc_from_layouts(b, procs)


@settings(max_examples=400, deadline=None)
@given(layout_pairs())
def test_plan_keeps_every_decision_of_the_old_planner(pair):
  src, dst = pair
  p = plan(src, dst)
  old = reference_moves(src, dst)
  process_of = {**src.process_of, **dst.process_of}
  moved = local = 0
  for t in src:
    tpl, rot = p.template(t.path)
    merges, moves = old[t.path]
    assert tpl.merges == merges
    assert len(tpl.moves) == len(moves)
    holders = t.placement.holders
    for m, (box, src_box, dev, sources) in zip(tpl.moves, moves):
      assert (m.box, m.src_box, m.dst) == (box, src_box, dev)
      assert m.local == (sources == (dev,))
      assert m.sources[0] == sources[0]  # the same pick, the same loads
      assert len(m.sources) == len(sources)
      assert set(m.sources) == set(sources)
      assert m in tpl.moves_to(dev)
      nb = box_volume(box) * t.itemsize
      if m.local:
        local += nb
        continue
      moved += nb
      # The rest: the pool (same-process replicas, else all) in device
      # order, read on from the chosen one.
      assert isinstance(m.sources, Ring)
      near = tuple(h for h in holders[src_box]
                   if process_of.get(h) == process_of.get(dev))
      ring = near or holders[src_box]
      k = ring.index(sources[0])
      assert tuple(m.sources) == ring[k:] + ring[:k]
    # Rotation 0's transfers are the old planner's.
    if rot == 0:
      got = [(tr.box, tr.src, tr.dst) for tr in p.transfers(t.path)]
      assert got == [(box, s[0], dev) for box, _, dev, s in moves]
  assert p.moved_bytes == moved == p.lower_bound_bytes
  assert p.local_bytes == local


def test_templates_that_differ_in_itemsize_share_choices():
  a = [named_layout(f"w{k}", (8, 8), dt, mesh_shape={"r": 4}, spec=())
       for k, dt in enumerate(["float32", "int8", "bfloat16"])]
  b = [named_layout(f"w{k}", (8, 8), dt, mesh_shape={"x": 4}, spec=("x",),
                    device_ids=[4, 5, 6, 7])
       for k, dt in enumerate(["float32", "int8", "bfloat16"])]
  src, dst = ptc_from_layouts(a), ptc_from_layouts(b)
  p = plan(src, dst)
  assert len(p.groups) == 3
  t32, t8, t16 = (p.template(f"w{k}")[0] for k in range(3))
  assert t32.moves == t8.moves == t16.moves
  assert (t32.moved_bytes, t8.moved_bytes, t16.moved_bytes) == (256, 64, 128)
  old = reference_moves(src, dst)
  for k in range(3):
    assert [m.sources[0] for m in p.template(f"w{k}")[0].moves] == [
        s[0] for _, _, _, s in old[f"w{k}"][1]]
