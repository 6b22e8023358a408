"""Targets on an AbstractMesh (what ``nnx.eval_shape`` gives under
``jax.set_mesh``): bound to the concrete mesh in context or given, an error
naming the leaf without one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import tenplex_jax as tj
import tenplex_jax.orbax as tor
from tenplex_jax import store
from tenplex_jax.errors import LayoutError, TreeError


def _mesh(shape=(2, 4), names=("data", "model")):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(
      shape), devices=jax.devices()[:n])


def _tree():
  return {"w": jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8),
          "b": jnp.arange(8, dtype=jnp.int32), "step": 3}


def _abstract(mesh, specs):
  am = mesh.abstract_mesh
  return {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                    sharding=NamedSharding(am, specs["w"])),
          "b": jax.ShapeDtypeStruct((8,), jnp.int32,
                                    sharding=NamedSharding(am, specs["b"])),
          "step": 0}


SPECS = {"w": P("data", "model"), "b": P("model")}


def _check(out, tree, mesh, specs):
  for k in ("w", "b"):
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
    assert out[k].dtype == tree[k].dtype
    assert out[k].sharding == NamedSharding(mesh, specs[k]), k
    assert out[k].sharding.mesh == mesh  # the concrete devices


def test_reshard_takes_abstract_shardings_under_set_mesh():
  mesh = _mesh()
  tree = _tree()
  am = mesh.abstract_mesh
  with jax.set_mesh(mesh):
    out = tj.reshard(tree, {"w": NamedSharding(am, SPECS["w"]),
                            "b": NamedSharding(am, SPECS["b"]), "step": None})
  _check(out, tree, mesh, SPECS)
  assert out["step"] == 3
  # An abstract ShapeDtypeStruct tree as the target.
  with jax.set_mesh(mesh):
    out2 = tj.reshard(tree, {**_abstract(mesh, {"w": P("model"), "b": P()}),
                             "step": None})
  _check(out2, tree, mesh, {"w": P("model"), "b": P()})


def test_remesh_takes_abstract_shardings_in_context_or_with_mesh():
  mesh = _mesh()
  tree = _tree()
  target = {**_abstract(mesh, SPECS), "step": None}
  with jax.set_mesh(mesh):
    out, rep = tj.remesh(tree, shardings=target)
  _check(out, tree, mesh, SPECS)
  assert rep.mesh == mesh
  out, rep = tj.remesh(tree, mesh, shardings=target)
  _check(out, tree, mesh, SPECS)


def test_abstract_shardings_without_a_mesh_name_the_leaf():
  mesh = _mesh()
  tree = _tree()
  am = mesh.abstract_mesh
  with pytest.raises(LayoutError, match=r"(?s)w: target sharding"
                     r" NamedSharding on AbstractMesh\('data': 2, 'model': 4"
                     r".*jax.set_mesh"):
    tj.reshard({"w": tree["w"]}, {"w": NamedSharding(am, SPECS["w"])})
  # A concrete mesh of other axis sizes is not the one described.
  with jax.set_mesh(_mesh((4, 2))):
    with pytest.raises(LayoutError, match=r"AbstractMesh\('data': 2, 'model':"
                       r" 4\) is not the concrete mesh's \('data': 4, 'model':"
                       r" 2\)"):
      tj.reshard({"w": tree["w"]}, {"w": NamedSharding(am, SPECS["w"])})
  # A store restore checks the target before it opens a location.
  with pytest.raises(TreeError, match=r"has no devices and no mesh is set.*"
                     r" 2 leaves: b, w"):
    store.restore([str(jax.devices()[0]) + "-never-opened"],
                  _abstract(mesh, SPECS))


def test_orbax_restore_takes_abstract_targets(tmp_path):
  mesh = _mesh()
  tree = _tree()
  tor.save(tree, str(tmp_path / "ck"), step=1)
  with jax.set_mesh(mesh):
    out = tor.restore(str(tmp_path / "ck"), _abstract(mesh, SPECS))
  _check(out, tree, mesh, SPECS)
  assert out["step"] == 3
  # Outside a mesh context: an error naming the leaves, or mesh= given.
  with pytest.raises(TreeError, match=r"on an AbstractMesh has no devices"
                     r" and no mesh is set.*: 2 leaves: b, w"):
    tor.restore(str(tmp_path / "ck"), _abstract(mesh, SPECS))
  out = tor.restore(str(tmp_path / "ck"), _abstract(mesh, SPECS), mesh=mesh)
  _check(out, tree, mesh, SPECS)


def test_store_restore_takes_abstract_targets(tmp_path):
  mesh = _mesh()
  tree = _tree()
  store.save(tree, str(tmp_path / "s"), step=3)
  with jax.set_mesh(mesh):
    out = store.restore([str(tmp_path / "s")], _abstract(mesh, SPECS))
  _check(out, tree, mesh, SPECS)
  assert out["step"] == 3
  out = store.restore([str(tmp_path / "s")], _abstract(mesh, SPECS),
                      mesh=mesh)
  _check(out, tree, mesh, SPECS)


class Mlp(nnx.Module):
  def __init__(self, rngs):
    part = nnx.with_partitioning
    init = nnx.initializers.lecun_normal()
    self.l1 = nnx.Linear(8, 16, rngs=rngs, kernel_init=part(init, (None,
                                                                  "model")),
                         bias_init=part(nnx.initializers.zeros, ("model",)))
    self.l2 = nnx.Linear(16, 8, rngs=rngs, kernel_init=part(init, ("model",
                                                                  None)))
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.l1(x))), out_sharding=P())


def _objects(seed):
  model = Mlp(nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  rngs = nnx.Rngs(seed + 100)
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  return model, optimizer, rngs, metrics


def _train(objs, steps):
  model, optimizer, rngs, metrics = objs
  x = jnp.ones((4, 8), jnp.float32)

  @nnx.jit
  def step(model, optimizer, rngs, metrics):
    noise = jax.random.normal(rngs.noise(), (4, 8))

    def loss_fn(model):
      return jnp.mean((model(x + noise) - 1.0) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss

  return [float(step(model, optimizer, rngs, metrics)) for _ in range(steps)]


@pytest.mark.parametrize("via", ["orbax", "store"])
def test_nnx_objects_restored_from_eval_shape_under_set_mesh(tmp_path, via):
  """The Flax examples' style: ``nnx.eval_shape`` under ``jax.set_mesh``
  (explicit sharding) gives the target; ``nnx.update((model, optimizer,
  rngs, metrics), new)`` puts the restored state back, RNG counters and
  metrics included, and training goes on as if never interrupted."""
  old_mesh = _mesh((4, 2))
  with jax.set_mesh(old_mesh):
    objs = _objects(0)
    _train(objs, 3)
    state = nnx.state(objs)
    want = _train(_objects_copy(objs), 2)  # the uninterrupted run
    kernel = np.asarray(objs[0].l1.kernel[...])
    count = int(objs[2].noise.count[...])
    loss = float(objs[3].compute()["loss"])
  assert count == 3
  path = str(tmp_path / "ck")
  if via == "orbax":  # a stock Orbax checkpoint
    with ocp.CheckpointManager(path) as mgr:
      mgr.save(3, args=ocp.args.StandardSave(state))
      mgr.wait_until_finished()
  else:
    store.save(state, path, step=3)
  mesh = _mesh((2, 4))
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: _objects(7))
    target = nnx.state(abstract)
    new = (tor.restore(path, target) if via == "orbax"
           else store.restore([path], target))
    nnx.update(abstract, new)
    model, optimizer, rngs, metrics = abstract
    k = model.l1.kernel[...]
    assert k.sharding == NamedSharding(mesh, P(None, "model"))
    np.testing.assert_array_equal(np.asarray(k), kernel)
    assert int(rngs.noise.count[...]) == count
    assert int(optimizer.step[...]) == 3
    assert float(metrics.compute()["loss"]) == loss
    got = _train(abstract, 2)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def _objects_copy(objs):
  """A deep copy of live nnx objects (their arrays shared, immutably)."""
  graphdef, state = nnx.split(objs)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def test_a_target_that_does_not_match_is_an_input_error(tmp_path):
  """TreeError is a ValueError, not a StoreError: nothing failed to read, so
  no other copy (here the checkpoint) is tried, and the CLI exits 2."""
  from tenplex_jax.cli import exit_code
  from tenplex_jax.errors import StoreError
  assert not issubclass(TreeError, StoreError)
  assert issubclass(TreeError, ValueError)
  assert exit_code(TreeError("x")) == 2
  mesh = _mesh()
  tree = _tree()
  store.save(tree, str(tmp_path / "s"), step=3)
  tor.save(tree, str(tmp_path / "ck"), step=3)
  bad = _abstract(mesh, SPECS)
  bad["w"] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(
      mesh, SPECS["w"]))
  with pytest.raises(TreeError, match=r"w: the target is float32\[8, 4\],"
                     r" step 3 saved float32\[8, 8\]"):
    with jax.set_mesh(mesh):
      store.restore([str(tmp_path / "s")], bad,
                    checkpoint=str(tmp_path / "ck"))


def test_key_array_target_reads_raw_key_data(tmp_path):
  """A PRNG key target matches its key data saved without the key type
  (uint32[n, 2] for key<fry>[n]); another shape is a mismatch."""
  keys = jax.random.split(jax.random.key(3), 8)
  tor.save({"rng": jax.random.key_data(keys)}, str(tmp_path / "ck"), step=1)
  mesh = _mesh((8,), ("data",))
  am = mesh.abstract_mesh
  target = {"rng": jax.ShapeDtypeStruct(keys.shape, keys.dtype,
                                        sharding=NamedSharding(am, P("data")))}
  with jax.set_mesh(mesh):
    out = tor.restore(str(tmp_path / "ck"), target)
  assert out["rng"].dtype == keys.dtype
  assert out["rng"].sharding == NamedSharding(mesh, P("data"))
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(out["rng"])),
                                np.asarray(jax.random.key_data(keys)))
  other = {"rng": jax.ShapeDtypeStruct((4,), keys.dtype, sharding=NamedSharding(
      mesh, P()))}
  with pytest.raises(TreeError, match=r"rng: the target is key<fry>\[4\], the"
                     r" checkpoint saved uint32\[8, 2\]"):
    tor.restore(str(tmp_path / "ck"), other)


def test_orbax_restore_reads_with_a_cast_to_the_target_dtype(tmp_path):
  """As Orbax restores do: a target of the saved shape in another dtype reads
  the saved values cast (the store and convert require the saved dtype)."""
  tree = _tree()
  tor.save(tree, str(tmp_path / "ck"), step=1)
  mesh = _mesh()
  am = mesh.abstract_mesh
  target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16,
                                      sharding=NamedSharding(am, SPECS["w"]))}
  with jax.set_mesh(mesh):
    out = tor.restore(str(tmp_path / "ck"), target)
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"]),
                                np.asarray(tree["w"]).astype(jnp.bfloat16))
