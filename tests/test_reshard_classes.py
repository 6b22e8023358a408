"""reshard's CPU path plans arrays by class (old sharding, new sharding, rank).

One program, planned at the class's unit shape, serves every array of the
class whatever its shape; these tests check that the scaled programs give
bitwise values and the targets' shardings, that the report's figures equal
those of the full plan (which is built only when read), and that a class is
never shared across shardings that differ only in their device order.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from tenplex_jax import PTC, plan, reshard_with_report
from tenplex_jax.planner import Plan

R = importlib.import_module("tenplex_jax.reshard")
DEVS = jax.devices()


def bits(x):
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(
      np.uint8).tobytes()


def mesh(ids, shape, names):
  return Mesh(np.array([DEVS[i] for i in ids]).reshape(shape), names)


def host(shape, dtype, seed):
  n = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)
  return raw.view(dtype).reshape(shape)


def build(leaves):
  """``{name: array}``, ``{name: target}``, ``{name: host value}``."""
  tree, target, ref = {}, {}, {}
  for k, (shape, dtype, src, dst) in enumerate(leaves):
    h = host(shape, dtype, k)
    tree[f"l{k}"] = jax.device_put(h, src)
    target[f"l{k}"] = dst
    ref[f"l{k}"] = h
  return tree, target, ref


def check(out, target, ref, rep):
  for name, x in out.items():
    assert x.sharding == target[name], (name, x.sharding, target[name])
    assert bits(x) == bits(ref[name]), name
    for s in x.addressable_shards:  # each device's own shard, bitwise
      assert bits(s.data) == bits(ref[name][s.index]), name
  # The figures come from the classes; the plan (built now) must agree.
  p = rep.plan
  assert isinstance(p, Plan)
  assert (rep.moved_bytes, rep.lower_bound_bytes, rep.local_bytes,
          rep.naive_bytes) == (p.moved_bytes, p.lower_bound_bytes,
                               p.local_bytes, p.naive_bytes)
  assert rep.moved_bytes == rep.lower_bound_bytes
  assert rep.state_bytes == p.src.nbytes and rep.n_tensors == len(p.src)


def test_one_class_many_shapes_bitwise_and_figures_match_the_plan():
  a = mesh([3, 1, 0, 6, 2, 7, 5, 4], (8,), ("a",))
  b = mesh([1, 2, 5, 6], (2, 2), ("a", "b"))
  c = mesh([7, 4], (1, 2), ("a", "b"))
  leaves = []
  # Several shapes per (old sharding, new sharding): rows -> columns,
  # several axes on one dim, replication on and off, permuted devices.
  for shape in [(8, 8), (64, 16), (16, 40), (8, 1000)]:
    leaves.append((shape, np.float32, NamedSharding(a, P("a")),
                   NamedSharding(b, P(None, ("b", "a")))))
    leaves.append((shape, jnp.bfloat16, NamedSharding(a, P(None, "a")),
                   NamedSharding(b, P("a"))))
    leaves.append((shape, np.int8, NamedSharding(a, P()),
                   NamedSharding(c, P("b", None))))
  for shape in [(8, 8, 8), (16, 8, 24)]:
    leaves.append((shape, np.float32, NamedSharding(b, P("a", None, "b")),
                   NamedSharding(a, P(None, None, "a"))))
  leaves.append(((), np.float32, NamedSharding(a, P()),
                 NamedSharding(b, P())))
  tree, target, ref = build(leaves)
  out, rep = reshard_with_report(tree, target)
  assert rep.method == "cpu"
  check(out, target, ref, rep)
  # One class per (old sharding, new sharding, rank), shared by the shapes.
  c1 = R._class_of(tree["l0"], target["l0"])
  c2 = R._class_of(tree["l3"], target["l3"])
  assert c1 is not None and c1[0] is c2[0] and c1[1] != c2[1]


def test_a_class_is_not_reused_for_another_device_order():
  src = mesh(range(8), (8,), ("a",))
  d1 = mesh([0, 1, 2, 3], (2, 2), ("a", "b"))
  d2 = mesh([2, 0, 3, 1], (2, 2), ("a", "b"))  # same shape, other order
  d3 = mesh([4, 5, 6, 7], (2, 2), ("a", "b"))  # other devices
  leaves = [((16, 16), np.float32, NamedSharding(src, P("a")),
             NamedSharding(m, P("b", "a"))) for m in (d1, d2, d3)]
  leaves += [((32, 8), np.float32, NamedSharding(src, P("a")),
              NamedSharding(m, P("b", "a"))) for m in (d2, d1)]
  tree, target, ref = build(leaves)
  classes = {id(R._class_of(tree[k], target[k])[0]) for k in tree}
  assert len(classes) == 3
  out, rep = reshard_with_report(tree, target)
  check(out, target, ref, rep)
  # The same transition again (cached) and the other orders back.
  out2, rep2 = reshard_with_report(tree, target)
  assert rep2.cached
  check(out2, target, ref, rep2)
  back = {k: NamedSharding(src, P("a")) for k in tree}
  ref_back = {k: ref[k] for k in tree}
  out3, rep3 = reshard_with_report(out, back)
  check(out3, back, ref_back, rep3)


def test_classes_and_general_path_in_one_state():
  # Arrays a class cannot cover (single-device, zero-size, a dim the units
  # do not divide is impossible for valid targets) go through the planner;
  # the figures still add up to the whole plan's.
  m = mesh(range(8), (2, 4), ("x", "y"))
  n = mesh([5, 6, 7, 4], (4,), ("y",))
  leaves = [((8, 16), np.float32, NamedSharding(m, P("x", "y")),
             NamedSharding(n, P(None, "y"))),
            ((12, 4), np.int8, SingleDeviceSharding(DEVS[3]),
             NamedSharding(n, P("y"))),
            ((0, 8), np.float32, NamedSharding(m, P(None, "y")),
             NamedSharding(n, P("y"))),
            ((16,), jnp.bfloat16, NamedSharding(m, P(("x", "y"))),
             SingleDeviceSharding(DEVS[0]))]
  tree, target, ref = build(leaves)
  assert R._class_of(tree["l0"], target["l0"]) is not None
  assert R._class_of(tree["l2"], target["l2"]) is None  # zero-size
  out, rep = reshard_with_report(tree, target)
  check(out, target, ref, rep)


def test_report_plan_is_built_once_and_equals_plan_of_the_layouts():
  a = mesh(range(4), (4,), ("a",))
  b = mesh([4, 5, 6, 7], (2, 2), ("a", "b"))
  x = jax.device_put(host((16, 8), np.float32, 1), NamedSharding(a, P("a")))
  t = NamedSharding(b, P("b", "a"))
  out, rep = reshard_with_report({"x": x}, {"x": t})
  p = rep.plan
  assert rep.plan is p  # kept once built
  want = plan(PTC.from_tree({"x": x}), PTC.from_tree({"x": out["x"]}))
  assert p.moved_bytes == want.moved_bytes
  assert p.groups[0].template.moves == want.groups[0].template.moves
  assert "plan" not in rep.to_dict() and "_plan" not in rep.to_dict()


@pytest.mark.parametrize("spec", [P("a"), P(None, "b"), P(("a", "b")), P()])
def test_avals_from_a_template_equal_jax_avals(spec):
  # On the pinned jax the interned constructor is used (checked at import).
  assert R._AVAL_CREATE is not None
  m = mesh(range(8), (2, 4), ("a", "b"))
  s = NamedSharding(m, spec)
  for shape in [(8, 8), (16, 24), (64, 8)]:
    for dt in (np.dtype(np.float32), np.dtype(jnp.bfloat16)):
      got = R._aval_of(shape, dt, s)
      want = R._aval(shape, dt, s)
      assert got == want and got.sharding == want.sharding
      assert got.shape == shape and got.dtype == dt
