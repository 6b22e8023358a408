"""Planner properties on abstract layouts (no devices): hypothesis."""

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import procs
from tenplex_jax import PlanError, plan
from tenplex_jax.layout import PTC, named_layout, ptc_from_layouts

AXES = ("a", "b", "c")


@st.composite
def mesh_and_spec(draw, ndim):
  """A random mesh (sizes from small primes) and a spec over it."""
  n_axes = draw(st.integers(1, 3))
  sizes = {AXES[i]: draw(st.sampled_from([1, 2, 3, 4])) for i in range(n_axes)}
  names = list(sizes)
  draw(st.randoms()).shuffle(names)
  spec = []
  for _ in range(ndim):
    k = draw(st.integers(0, 2))
    if k == 0 or not names:
      spec.append(None)
    elif k == 1 or len(names) < 2:
      spec.append(names.pop())
    else:
      spec.append((names.pop(), names.pop()))
  n_dev = math.prod(sizes.values())
  return sizes, tuple(spec), n_dev


@st.composite
def layout_pair(draw):
  ndim = draw(st.integers(0, 3))
  src_mesh, src_spec, n_src = draw(mesh_and_spec(ndim))
  dst_mesh, dst_spec, n_dst = draw(mesh_and_spec(ndim))
  # Dimensions divisible by both splits.
  shape = []
  for d in range(ndim):
    def parts(mesh, spec):
      e = spec[d]
      axes = () if e is None else ((e,) if isinstance(e, str) else e)
      return math.prod(mesh[a] for a in axes)
    lcm = math.lcm(parts(src_mesh, src_spec), parts(dst_mesh, dst_spec))
    shape.append(lcm * draw(st.sampled_from([0, 1, 2])) if draw(
        st.booleans()) else lcm * draw(st.integers(1, 3)))
  pool = list(range(max(n_src, n_dst) + draw(st.integers(0, 4))))
  rnd = draw(st.randoms())
  src_ids = rnd.sample(pool, n_src)
  dst_ids = rnd.sample(pool, n_dst)
  per_proc = draw(st.sampled_from([1, 2, 4]))
  itemsize_dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
  a = named_layout("t", shape, itemsize_dtype, mesh_shape=src_mesh,
                   spec=src_spec, device_ids=src_ids)
  b = named_layout("t", shape, itemsize_dtype, mesh_shape=dst_mesh,
                   spec=dst_spec, device_ids=dst_ids)
  return ptc_from_layouts([a], per_proc), ptc_from_layouts([b], per_proc)


@settings(max_examples=300, deadline=None)
@given(layout_pair())
def test_every_destination_element_covered_exactly_once(pair):
  src, dst = pair
  p = plan(src, dst)
  (g,) = p.groups
  t = dst["t"]
  for box, holders in zip(t.placement.boxes, t.placement.holders):
    for dev in holders:
      count = np.zeros([hi - lo for lo, hi in box], dtype=np.int64)
      for m in g.template.moves_to(dev):
        # Each piece lies in its source box, which the source device holds.
        src_box = src["t"].placement.boxes[m.src_box]
        for (lo, hi), (slo, shi) in zip(m.box, src_box):
          assert slo <= lo <= hi <= shi
        s = m.source(0)
        assert src["t"].placement.box_of_device[s] == m.src_box
        count[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _)
                    in zip(m.box, box))] += 1
      assert (count == 1).all()


@settings(max_examples=300, deadline=None)
@given(layout_pair())
def test_moved_bytes_equal_lower_bound(pair):
  src, dst = pair
  p = plan(src, dst)
  assert p.moved_bytes == p.lower_bound_bytes
  # The lower bound computed by brute force over elements.
  t_src, t_dst = src["t"], dst["t"]
  brute = 0
  for box, holders in zip(t_dst.placement.boxes, t_dst.placement.holders):
    cells = set(itertools.product(*[range(lo, hi) for lo, hi in box]))
    for dev in holders:
      old = t_src.shard_box(dev)
      held = set() if old is None else set(
          itertools.product(*[range(lo, hi) for lo, hi in old]))
      brute += len(cells - held)
  assert p.lower_bound_bytes == brute * t_src.itemsize
  assert p.moved_bytes + p.local_bytes == p.naive_bytes


@settings(max_examples=100, deadline=None)
@given(layout_pair())
def test_identity_plan_moves_nothing(pair):
  src, _ = pair
  p = plan(src, src)
  assert p.moved_bytes == 0
  assert all(m.local for g in p.groups for m in g.template.moves)


@settings(max_examples=100, deadline=None)
@given(layout_pair())
def test_plan_json_and_ptc_json_round_trip(pair):
  src, dst = pair
  assert PTC.from_json(src.to_json()) == src
  d = json.loads(plan(src, dst).to_json())
  assert d["moved_bytes"] == d["lower_bound_bytes"]


def test_prefers_local_then_same_process_then_balances():
  # Replicated over 4 devices in 2 processes (2 devices each) -> sharded.
  src = ptc_from_layouts([named_layout("w", (8, 8), "float32",
                                       mesh_shape={"r": 4}, spec=())], 2)
  dst = ptc_from_layouts([named_layout(
      "w", (8, 8), "float32", mesh_shape={"x": 4}, spec=("x",),
      device_ids=[0, 1, 2, 3])], 2)
  p = plan(src, dst)
  assert p.moved_bytes == 0  # every device already holds its new shard
  # New devices 4..7 (processes 2, 3) need data from processes 0, 1.
  dst2 = ptc_from_layouts([named_layout(
      "w", (8, 8), "float32", mesh_shape={"x": 4}, spec=(None, "x"),
      device_ids=[4, 5, 6, 7])], 2)
  p2 = plan(src, dst2)
  sent = p2.traffic["sent"]
  # 4 shards of 64 B each, spread over the 4 replicas: one each.
  assert sorted(sent.values()) == [64, 64, 64, 64]
  # Same-process source preferred: a replicated tensor that gains a device
  # in process 0 is fed from process 0.
  dst3 = ptc_from_layouts([named_layout(
      "w", (8, 8), "float32", mesh_shape={"r": 2}, spec=(),
      device_ids=[1, 9])], {1: 0, 9: 0})
  src3 = ptc_from_layouts([named_layout(
      "w", (8, 8), "float32", mesh_shape={"r": 2}, spec=(),
      device_ids=[0, 5])], {0: 0, 5: 3})
  (tr,) = [t for t in plan(src3, dst3).transfers() if t.dst == 9]
  assert tr.src == 0


def test_replica_choice_rotates_across_tensors():
  layouts_a = [named_layout(f"w{i}", (4, 4), "float32", mesh_shape={"r": 4},
                            spec=()) for i in range(8)]
  layouts_b = [named_layout(f"w{i}", (4, 4), "float32", mesh_shape={"r": 1},
                            spec=(), device_ids=[7]) for i in range(8)]
  p = plan(ptc_from_layouts(layouts_a), ptc_from_layouts(layouts_b))
  assert len(p.groups) == 1  # planned once
  sent = p.traffic["sent"]
  assert sorted(sent) == [0, 1, 2, 3] and len(set(sent.values())) == 1


def test_mismatched_layouts_name_every_problem():
  a = ptc_from_layouts([
      named_layout("x", (4,), "float32", mesh_shape={"d": 2}, spec=("d",)),
      named_layout("y", (4,), "float32", mesh_shape={"d": 2}, spec=()),
      named_layout("z", (2,), "float32", mesh_shape={"d": 2}, spec=())])
  b = ptc_from_layouts([
      named_layout("x", (8,), "float32", mesh_shape={"d": 2}, spec=("d",)),
      named_layout("y", (4,), "int32", mesh_shape={"d": 2}, spec=()),
      named_layout("q", (2,), "float32", mesh_shape={"d": 2}, spec=())])
  with pytest.raises(PlanError) as e:
    plan(a, b)
  msg = str(e.value)
  assert "x: shape (4,) in the old layout, (8,) in the new" in msg
  assert "y: dtype float32 in the old layout, int32 in the new" in msg
  assert "only in the old layout: ['z']" in msg
  assert "only in the new layout: ['q']" in msg


def test_summary_reports_totals():
  a = ptc_from_layouts([named_layout("w", (8, 8), "float32",
                                     mesh_shape={"d": 2, "t": 2},
                                     spec=(None, "t"))], 2)
  b = ptc_from_layouts([named_layout("w", (8, 8), "float32",
                                     mesh_shape={"d": 1, "t": 4},
                                     spec=(None, "t"))], 2)
  s = plan(a, b).summary()
  assert "moved between devices" in s and "lower bound" in s
  assert "naive" in s and "from process" in s


def test_plan_scales_to_1024_devices():
  # Correctness at scale (timing lives in benchmarks/bench_plan.py).
  a = [named_layout(f"p{i}", (1024, 512), "float32",
                    mesh_shape={"data": 32, "fsdp": 4, "tensor": 8},
                    spec=("fsdp", "tensor")) for i in range(50)]
  b = [named_layout(f"p{i}", (1024, 512), "float32",
                    mesh_shape={"data": 16, "fsdp": 8, "tensor": 8},
                    spec=("fsdp", "tensor")) for i in range(50)]
  p = plan(ptc_from_layouts(a, 8), ptc_from_layouts(b, 8))
  assert len(p.groups) == 1
  assert p.moved_bytes == p.lower_bound_bytes > 0


def test_planning_abstract_layouts_imports_no_jax():
  # Layouts over abstract devices and their plan (float32, bfloat16, int4
  # named by string) need no jax: a process that plans (the config search, a
  # scheduler sizing a resize) does not pay jax's import, about a second.
  code = (
      "import sys\n"
      "from tenplex_jax.layout import named_layout, ptc_from_layouts\n"
      "from tenplex_jax.planner import plan\n"
      "def side(mesh):\n"
      "  return ptc_from_layouts([named_layout(f'p{i}', (64, 32), dt,\n"
      "      mesh_shape=mesh, spec=('fsdp', 'tensor'))\n"
      "      for i, dt in enumerate(('float32', 'bfloat16', 'int4'))], 4)\n"
      "p = plan(side({'data': 2, 'fsdp': 4, 'tensor': 2}),\n"
      "         side({'data': 4, 'fsdp': 2, 'tensor': 2}))\n"
      "assert p.moved_bytes == p.lower_bound_bytes > 0, p.summary()\n"
      "print(sorted(m for m in ('jax', 'jaxlib') if m in sys.modules))\n")
  out = procs.python(code, timeout=120)
  assert out.strip() == "[]", out
