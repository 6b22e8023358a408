"""The index-arithmetic placement of a NamedSharding agrees with jax's."""

import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import layout as layout_mod
from tenplex_jax.layout import (_placement_from_indices_map,
                                 placement_by_arithmetic)

DEVS = jax.devices()
FACTORS = [(1,), (2,), (4,), (8,), (2, 2), (2, 4), (4, 2), (1, 8), (2, 1, 4),
           (2, 2, 2)]


def jax_placement(sharding, shape):
  return _placement_from_indices_map(sharding.devices_indices_map(shape), shape)


@st.composite
def cases(draw):
  mesh_shape = draw(st.sampled_from(FACTORS))
  n = math.prod(mesh_shape)
  ids = draw(st.permutations(range(8)))[:n]  # a subset, in any order
  names = tuple(f"a{i}" for i in range(len(mesh_shape)))
  kinds = draw(st.sampled_from([AxisType.Auto, AxisType.Explicit]))
  mesh = Mesh(np.array([DEVS[i] for i in ids]).reshape(mesh_shape), names,
              axis_types=(kinds,) * len(names))
  ndim = draw(st.integers(0, 3))
  free = list(names)
  spec, shape = [], []
  for _ in range(ndim):
    k = draw(st.integers(0, min(2, len(free))))
    axes = tuple(draw(st.permutations(free))[:k])
    for a in axes:
      free.remove(a)
    parts = math.prod(mesh.shape[a] for a in axes)
    shape.append(parts * draw(st.integers(0, 3)))
    spec.append(None if not axes else axes[0] if len(axes) == 1
                and draw(st.booleans()) else axes)
  # A spec may be shorter than the rank.
  cut = draw(st.integers(0, ndim))
  if all(e is None for e in spec[cut:]):
    spec = spec[:cut]
  return NamedSharding(mesh, P(*spec)), tuple(shape)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_arithmetic_placement_equals_jax(case):
  sharding, shape = case
  fast = placement_by_arithmetic(sharding, shape)
  assert fast is not None
  assert fast == jax_placement(sharding, shape)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_small_mesh_loop_equals_the_array_path(case):
  # Meshes of up to _SMALL_MESH devices are placed by a loop over the
  # devices, larger ones by whole-array arithmetic: the same placement.
  sharding, shape = case
  mesh = sharding.mesh
  args = (shape, tuple(zip(mesh.axis_names, mesh.devices.shape)),
          tuple(sharding.spec), tuple(d.id for d in mesh.devices.flat))
  compute = layout_mod._named_placement_cached.__wrapped__
  assert mesh.size <= layout_mod._SMALL_MESH
  loop = compute(*args)
  old = layout_mod._SMALL_MESH
  layout_mod._SMALL_MESH = 0
  try:
    arrays = compute(*args)
  finally:
    layout_mod._SMALL_MESH = old
  assert loop == arrays
  assert loop.boxes == arrays.boxes and loop.holders == arrays.holders
  assert all(type(v) is int for b in loop.boxes for r in b for v in r)
  assert all(type(d) is int for h in loop.holders for d in h)


def test_small_mesh_loop_on_a_64_device_mesh_equals_the_array_path():
  # 64 devices (4 x 4 x 4, ids permuted), every spec of up to two axes
  # per dimension over a rank-3 array: the loop's largest meshes.
  rng = np.random.default_rng(0)
  ids = tuple(int(i) for i in rng.permutation(64))
  mesh_items = (("a", 4), ("b", 4), ("c", 4))
  compute = layout_mod._named_placement_cached.__wrapped__
  specs = [(None, "a", ("b", "c")), (("c", "a"), None, "b"), ("b",),
           (("a", "b", "c"),), (None, None, None), ("c", "b", "a")]
  for spec in specs:
    for shape in [(64, 16, 16), (64, 64, 64), (0, 16, 16)]:
      loop = compute(shape, mesh_items, spec, ids)
      old = layout_mod._SMALL_MESH
      layout_mod._SMALL_MESH = 0
      try:
        arrays = compute(shape, mesh_items, spec, ids)
      finally:
        layout_mod._SMALL_MESH = old
      assert loop == arrays, (spec, shape)
      assert loop.boxes == arrays.boxes, (spec, shape)
  # numpy integers in (a conversion spec's device ids): Python ints out
  got = compute(tuple(np.int64(n) for n in (8, 4)), (("a", 4),), ("a",),
                tuple(np.arange(4, dtype=np.int64)))
  assert all(type(v) is int for b in got.boxes for r in b for v in r)
  assert all(type(d) is int for h in got.holders for d in h)


@pytest.mark.parametrize("spec,shape", [
    (P(P.UNCONSTRAINED), (8,)),  # not a concrete layout: jax decides
    (P("x"), (6,)),  # 4 does not divide 6
])
def test_other_cases_take_jax_path(spec, shape):
  mesh = Mesh(np.array(DEVS[:4]), ("x",))
  assert placement_by_arithmetic(NamedSharding(mesh, spec), shape) is None


def test_single_device_sharding_takes_jax_path():
  s = jax.sharding.SingleDeviceSharding(DEVS[3])
  assert placement_by_arithmetic(s, (4, 4)) is None
