"""remesh of Flax train states across device counts."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import LayoutError, ReplicationWarning, remesh
from tenplex_jax import demo

DEVS = jax.devices()


def leaves_bits(tree):
  out = []
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
      out.append(np.asarray(x).tobytes())
  return out


def test_train_state_remeshed_trains_on_with_same_loss():
  schedule = demo.default_schedule()  # 8 -> 4 -> 2 -> 8 devices
  elastic = demo.run(schedule, steps=36)
  static = demo.run(schedule[:1], steps=36)
  assert len(elastic.reports) == 3
  np.testing.assert_allclose(elastic.losses, static.losses, rtol=1e-5)
  assert elastic.losses[-1] < elastic.losses[0]
  for _, report in elastic.reports:
    assert report.moved_bytes == report.lower_bound_bytes


def test_structure_metadata_and_shardings_are_kept():
  m8 = demo.make_mesh(demo.Phase(0, 4, 2))
  m2 = demo.make_mesh(demo.Phase(0, 1, 2), DEVS[6:])
  state = demo.create_state(m8)
  new, report = remesh(state, m2, rules=demo.RULES)
  assert jax.tree.structure(new) == jax.tree.structure(state)
  assert leaves_bits(new) == leaves_bits(state)
  # Metadata boxes survive: partition specs still resolve, logically.
  specs = nn.get_partition_spec(new)
  assert specs.params["Dense_0"]["kernel"] == P("embed", "mlp")
  k = new.params["Dense_0"]["kernel"]
  assert isinstance(k, nn.LogicallyPartitioned)
  assert k.value.sharding.is_equivalent_to(
      NamedSharding(m2, P(None, "tensor")), 2)
  # Optimizer moments follow the parameters; scalars are replicated.
  mu = new.opt_state[0].mu["Dense_0"]["kernel"].value
  assert mu.sharding.is_equivalent_to(NamedSharding(m2, P(None, "tensor")), 2)
  assert new.step.sharding.is_equivalent_to(NamedSharding(m2, P()), 0)
  assert jax.dtypes.issubdtype(new.rng.dtype, jax.dtypes.prng_key)
  # The user's jitted step keeps working on the new mesh.
  x = jax.device_put(np.ones((4, 16), np.float32), NamedSharding(m2, P("data")))
  y = jax.device_put(np.zeros((4,), np.int32), NamedSharding(m2, P("data")))
  after, loss = demo.train_step(new, x, y)
  assert np.isfinite(float(loss)) and int(after.step) == 1
  assert report.seconds["total"] > 0 and "re-meshed" in str(report)


def test_same_specs_on_new_mesh_and_explicit_shardings():
  m1 = Mesh(np.array(DEVS).reshape(2, 4), ("data", "tensor"))
  m2 = Mesh(np.array(DEVS[:4]).reshape(4, 1), ("data", "tensor"))
  w = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8),
                     NamedSharding(m1, P("data", "tensor")))
  state = {"w": w, "step": jnp.int32(5), "note": "kept"}
  new, _ = remesh(state, m2)
  assert new["note"] == "kept"
  assert new["w"].sharding.is_equivalent_to(
      NamedSharding(m2, P("data", "tensor")), 2)
  assert new["step"].sharding.is_equivalent_to(NamedSharding(m2, P()), 0)
  target = {"w": NamedSharding(m2, P(None, "data")),
            "step": NamedSharding(m2, P()), "note": None}
  new2, report = remesh(state, shardings=target)
  assert new2["w"].sharding.is_equivalent_to(target["w"], 2)
  assert np.array_equal(np.asarray(new2["w"]), np.asarray(w))
  assert report.mesh_shape == {"data": 4, "tensor": 1}


def test_indivisible_dimension_replicates_with_one_warning_or_raises():
  m1 = Mesh(np.array(DEVS[:2]).reshape(1, 2), ("data", "tensor"))
  m3 = Mesh(np.array(DEVS[:6]).reshape(2, 3), ("data", "tensor"))
  state = {
      "a": jax.device_put(np.ones((4, 8), np.float32),
                          NamedSharding(m1, P(None, "tensor"))),
      "b": jax.device_put(np.ones((10,), np.float32),
                          NamedSharding(m1, P("tensor"))),
      "c": jax.device_put(np.ones((6,), np.float32),
                          NamedSharding(m1, P("tensor"))),
  }
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    new, report = remesh(state, m3)
  msgs = [str(w.message) for w in caught
          if issubclass(w.category, ReplicationWarning)]
  assert len(msgs) == 1
  assert "a: dim 1 of size 8 cannot be split 3 ways" in msgs[0]
  assert "b: dim 0 of size 10 cannot be split 3 ways" in msgs[0]
  assert "c:" not in msgs[0]
  assert [f.path for f in report.fallbacks] == ["a", "b"]
  assert new["a"].sharding.spec == P(None, None)
  assert new["c"].sharding.spec == P("tensor")
  with pytest.raises(LayoutError, match="a: dim 1 of size 8 cannot be split 3"):
    remesh(state, m3, strict=True)


def test_grouped_indivisible_leaves_name_the_dimension():
  # Several leaves failing alike are reported as one group; the group still
  # names which dimension cannot be split, and leaves failing at another
  # dimension are a group of their own.
  m1 = Mesh(np.array(DEVS[:2]).reshape(2), ("tensor",))
  m3 = Mesh(np.array(DEVS[:3]).reshape(3), ("tensor",))
  cols = NamedSharding(m1, P(None, "tensor"))
  rows = NamedSharding(m1, P("tensor"))
  state = {f"c{i}": jax.device_put(np.ones((3, 8), np.float32), cols)
           for i in range(3)}
  state |= {f"r{i}": jax.device_put(np.ones((8, 3), np.float32), rows)
            for i in range(2)}
  with pytest.raises(LayoutError) as e:
    remesh(state, m3, strict=True)
  msg = str(e.value)
  assert ("dimension 1 of size 8 cannot be split 3 ways over mesh axes"
          " ('tensor',): 3 leaves: c0, c1, c2") in msg
  assert ("dimension 0 of size 8 cannot be split 3 ways over mesh axes"
          " ('tensor',): 2 leaves: r0, r1") in msg
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    remesh(state, m3)
  (w,) = [w for w in caught if issubclass(w.category, ReplicationWarning)]
  assert ("dimension 1 of size 8 cannot be split 3 ways over ('tensor',):"
          " 3 leaves: c0, c1, c2") in str(w.message)


def test_axis_missing_from_new_mesh_is_an_error():
  m1 = Mesh(np.array(DEVS[:2]).reshape(2), ("expert",))
  m2 = Mesh(np.array(DEVS[:2]).reshape(2), ("data",))
  x = jax.device_put(np.ones((4,), np.float32), NamedSharding(m1, P("expert")))
  with pytest.raises(LayoutError, match=r"moe/w: axes \['expert'\]"):
    remesh({"moe": {"w": x}}, m2)


def test_nnx_state_remesh_with_rules():
  m1 = Mesh(np.array(DEVS).reshape(2, 4), ("data", "model"))
  m2 = Mesh(np.array(DEVS[4:]).reshape(2, 2), ("data", "model"))

  rules = (("embed", None), ("hidden", "model"))
  plain = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  kernel = jax.device_put(plain.kernel[...], NamedSharding(m1, P(None, "model")))
  bias = jax.device_put(plain.bias[...], NamedSharding(m1, P()))
  state = nnx.State({"l": {
      "kernel": nnx.Param(kernel, out_sharding=("embed", "hidden"),
                          eager_sharding=False),
      "bias": nnx.Param(bias, eager_sharding=False)}})
  new, report = remesh(state, m2, rules=rules)
  k = new["l"]["kernel"]
  assert isinstance(k, nnx.Variable)
  assert k[...].sharding.is_equivalent_to(NamedSharding(m2, P(None, "model")),
                                          2)
  assert np.array_equal(np.asarray(k[...]), np.asarray(kernel))
  assert report.moved_bytes == report.lower_bound_bytes


def test_devices_without_mesh_uses_the_configuration_search():
  m8 = demo.make_mesh(demo.Phase(0, 4, 2))
  state = demo.create_state(m8)
  new, report = remesh(state, devices=DEVS[:4], global_batch=32)
  assert leaves_bits(new) == leaves_bits(state)
  k = new.params["Dense_0"]["kernel"].value
  assert k.sharding.mesh.size == 4
  assert set(k.sharding.mesh.axis_names) >= {"data", "tensor"}
  assert report.moved_bytes == report.lower_bound_bytes
  with pytest.raises(TypeError, match="global_batch"):
    remesh(state, devices=DEVS[:4])
