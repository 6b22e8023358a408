"""Flax's own idioms on a model nobody here wrote: flax's lm1b TransformerLM.

The state is built exactly as lm1b builds it (tests/fixtures/lm1b_state.py):
boxed abstract state, ``nn.get_partition_spec``, ``nn.logical_to_mesh_sharding``
with lm1b's rules, a jitted init, then unboxed params (``unbox=False`` keeps
the boxes). Every move is checked three ways: values bitwise, every array's
sharding ``==`` the sharding Flax derives from the rules, and the structure
(boxes kept where the state had them).
"""

import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import tenplex_jax as tj
from fixtures.lm1b_state import LM1B_RULES, abstract_state, make_mesh, make_state
from tenplex_jax import LayoutError, ReplicationWarning

DEVS = jax.devices()
# lm1b's rules with the roles of the fsdp and tensor axes swapped.
SWAPPED = (("mlp", "fsdp"), ("vocab", "fsdp"), ("embed", "tensor"),
           ("heads", "fsdp"))
# MaxText-style rules: several mesh axes per logical name, several candidate
# rules per name (the first whose mesh axes are all still free wins), and
# mesh axes of size 1 (base.yml's logical_axis_rules, trimmed).
MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence",
                "tensor", "tensor_transpose", "tensor_sequence", "expert",
                "autoregressive")
MAXTEXT_RULES = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("vocab", ("tensor", "tensor_sequence", "autoregressive")),
    ("heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv", ()),
    ("embed", ("fsdp", "fsdp_transpose", "sequence", "tensor_transpose",
               "expert")),
    ("embed", ("fsdp", "sequence", "tensor_transpose", "expert")),
    ("norm", ("tensor", "tensor_transpose")),
    ("layers", "stage"),
)


def mesh_of(shape, devices=None, axes=("data", "fsdp", "tensor")):
  devs = list(DEVS if devices is None else devices)[:int(np.prod(shape))]
  return Mesh(np.asarray(devs).reshape(shape), axes)


def is_lp(x):
  return isinstance(x, nn.LogicallyPartitioned)


def unboxed(tree):
  return jax.tree.map(lambda x: x.value if is_lp(x) else x, tree, is_leaf=is_lp)


def bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)
          if isinstance(x, jax.Array)]


def by_path(tree):
  """``{key path: leaf}`` of a sharding tree or a state (boxes unwrapped)."""
  flat = jax.tree_util.tree_flatten_with_path(
      unboxed(tree), is_leaf=lambda x: x is None)[0]
  return {tj.key_path_name(p): x for p, x in flat}


def assert_on(new, expected):
  """Every array of ``new`` has exactly the sharding ``expected`` gives its
  path (a prefix-free tree of shardings with the unboxed state's paths)."""
  got = {k: v.sharding for k, v in by_path(new).items()
         if isinstance(v, jax.Array)}
  want = {k: v for k, v in by_path(expected).items() if k in got}
  assert got.keys() == want.keys()
  bad = [k for k in got if got[k] != want[k]]
  assert not bad, [(k, got[k].spec, want[k].spec) for k in bad[:5]]


def assert_same_shardings(a, b):
  fa, fb = by_path(a), by_path(b)
  assert fa.keys() == fb.keys()
  assert all(fa[k] == fb[k] for k in fa), [
      (k, fa[k], fb[k]) for k in fa if fa[k] != fb[k]][:3]


def rule_shardings(abstract, mesh, rules):
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                     rules)


@pytest.fixture(scope="module")
def lm1b():
  """(boxed state on (data 1, fsdp 8, tensor 1), its bits, boxed abstract)."""
  boxed, _ = make_state(make_mesh((1, 8, 1)), unbox=False)
  abstract, _ = abstract_state()
  return boxed, bits(boxed), abstract


# The tests that read the lm1b state above, on one xdist worker: it is built
# once.
_LM1B = pytest.mark.xdist_group("flax_idioms_lm1b")


# The meshes the lm1b state moves between (lm1b's data/fsdp/tensor degrees,
# subsets and a permutation of the devices).
TARGETS = [((2, 1, 4), None), ((1, 2, 2), DEVS[4:]), ((8, 1, 1), DEVS[::-1]),
           ((2, 2, 2), DEVS[1:] + DEVS[:1])]


@pytest.mark.parametrize("boxed_state", [True, False], ids=["boxed", "unboxed"])
@_LM1B
def test_reshard_takes_lm1b_prefix_sharding_tree(lm1b, boxed_state):
  boxed, ref, abstract = lm1b
  state = boxed if boxed_state else unboxed(boxed)
  for shape, devs in TARGETS[:2]:
    mesh = mesh_of(shape, devs)
    # lm1b's tree (from a fresh eval_shape: its TrainState carries other
    # apply_fn/tx objects, which jax.device_put would reject) ...
    target = rule_shardings(abstract, mesh, LM1B_RULES)
    new = tj.reshard(state, target)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert bits(new) == ref
    assert_on(new, target)
    # ... and the usual tree built from the live state (item 6 of issue 10).
    usual = rule_shardings(state if boxed_state else abstract, mesh,
                           LM1B_RULES)
    new2, report = tj.reshard_with_report(state, usual)
    assert jax.tree.structure(new2) == jax.tree.structure(state)
    assert bits(new2) == ref
    assert_on(new2, usual)
    assert report.moved_bytes == report.lower_bound_bytes
  if boxed_state:
    k = new.params["decoder"]["Embed_0"]["embedding"]
    assert is_lp(k) and k.names == ("vocab", "embed")


@_LM1B
def test_remesh_with_prefix_shardings_reports_what_it_used(lm1b):
  boxed, ref, abstract = lm1b
  mesh = mesh_of(*TARGETS[2])
  target = rule_shardings(abstract, mesh, LM1B_RULES)
  new, report = tj.remesh(boxed, shardings=target)
  assert jax.tree.structure(new) == jax.tree.structure(boxed)
  assert bits(new) == ref
  assert_on(new, target)
  assert report.mesh == mesh and report.rules is None
  assert_same_shardings(report.shardings, target)
  with pytest.raises(TypeError, match="not both"):
    tj.remesh(boxed, shardings=target, rules=LM1B_RULES)


@_LM1B
def test_boxed_lm1b_moves_between_meshes_by_rules(lm1b):
  boxed, ref, abstract = lm1b
  state = boxed
  for (shape, devs), rules in zip(TARGETS, [LM1B_RULES, SWAPPED] * 2):
    mesh = mesh_of(shape, devs)
    state, report = tj.remesh(state, mesh, rules=rules)
    expected = rule_shardings(abstract, mesh, rules)
    assert jax.tree.structure(state) == jax.tree.structure(boxed)
    assert bits(state) == ref
    assert_on(state, expected)
    assert report.mesh == mesh and report.rules == rules
    assert_same_shardings(report.shardings, expected)
    assert not report.fallbacks
  # The user's jit takes the reported tree as it is.
  out = jax.jit(lambda s: s, out_shardings=report.shardings)(state)
  assert_on(out, expected)


@_LM1B
def test_unboxed_state_rules_need_the_logical_names(lm1b):
  boxed, ref, abstract = lm1b
  state = unboxed(boxed)
  mesh = mesh_of((2, 2, 2))
  with pytest.raises(LayoutError, match="logical_axes="):
    tj.remesh(state, mesh, rules=SWAPPED)
  with pytest.raises(TypeError, match="needs rules="):
    tj.remesh(state, mesh, logical_axes=nn.get_partition_spec(abstract))
  expected = rule_shardings(abstract, mesh, SWAPPED)
  for names in (nn.get_partition_spec(abstract), abstract):
    new, report = tj.remesh(state, mesh, rules=SWAPPED, logical_axes=names)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert bits(new) == ref
    assert_on(new, expected)
    k = new.params["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"][
        "Dense_0"]["kernel"]
    assert k.sharding.spec == P("tensor", "fsdp")  # was P('fsdp', 'tensor')
    assert_same_shardings(report.shardings, expected)


@_LM1B
def test_maxtext_style_rules(lm1b):
  boxed, ref, abstract = lm1b
  sizes = dict(data=1, stage=1, fsdp=2, fsdp_transpose=1, sequence=1,
               tensor=2, tensor_transpose=1, tensor_sequence=1, expert=2,
               autoregressive=1)
  mesh = mesh_of(tuple(sizes[a] for a in MAXTEXT_AXES), DEVS[::-1],
                 MAXTEXT_AXES)
  expected = rule_shardings(abstract, mesh, MAXTEXT_RULES)
  new, report = tj.remesh(boxed, mesh, rules=MAXTEXT_RULES)
  assert bits(new) == ref
  assert_on(new, expected)
  emb = new.params["decoder"]["Embed_0"]["embedding"].value
  assert emb.sharding.spec == P(("tensor", "tensor_sequence",
                                 "autoregressive"),
                                ("fsdp", "fsdp_transpose", "sequence",
                                 "tensor_transpose", "expert"))
  back, _ = tj.remesh(unboxed(new), make_mesh((1, 8, 1)), rules=LM1B_RULES,
                      logical_axes=abstract)
  assert bits(back) == ref
  assert_on(back, rule_shardings(abstract, make_mesh((1, 8, 1)), LM1B_RULES))


@_LM1B
def test_config_search_reads_lm1b_and_hands_back_what_to_jit(lm1b):
  boxed, ref, abstract = lm1b
  # DenseGeneral's kernels carry 2 names for 3 dimensions.
  spec = tj.search.from_abstract_params(abstract.params)
  assert 8 in spec.dims("embed")  # the out kernel's leading (heads) dim
  new, report = tj.remesh(boxed, devices=DEVS[:4], global_batch=8)
  assert bits(new) == ref
  assert report.mesh.size == 4 and report.rules
  assert not report.fallbacks
  expected = rule_shardings(boxed, report.mesh, report.rules)
  assert_on(new, expected)
  assert_same_shardings(report.shardings, expected)
  out = jax.jit(lambda s: s, out_shardings=report.shardings)(new)
  assert bits(out) == ref
  # An unboxed state searches with its logical names given separately.
  with pytest.raises(LayoutError, match="logical_axes="):
    tj.remesh(unboxed(boxed), devices=DEVS[:4], global_batch=8)
  new2, report2 = tj.remesh(unboxed(boxed), devices=DEVS[:4], global_batch=8,
                            logical_axes=abstract)
  assert bits(new2) == ref
  assert report2.rules == report.rules
  assert_on(new2, rule_shardings(abstract, report2.mesh, report2.rules))


@_LM1B
def test_replication_fallback_report_has_the_shardings_used(lm1b):
  boxed, ref, abstract = lm1b
  mesh = mesh_of((1, 2, 3), DEVS[2:])  # tensor=3 divides none of lm1b's dims
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    new, report = tj.remesh(boxed, mesh, rules=LM1B_RULES)
  (w,) = [w for w in caught if issubclass(w.category, ReplicationWarning)]
  assert len(report.fallbacks) > 20
  assert str(w.message).count("\n") <= 6  # grouped, not one line per leaf
  assert "cannot be split 3 ways over ('tensor',)" in str(w.message)
  assert bits(new) == ref
  assert_on(new, report.shardings)
  derived = by_path(rule_shardings(abstract, mesh, LM1B_RULES))
  used = by_path(report.shardings)
  changed = {f.path for f in report.fallbacks}
  assert {k for k in used if used[k] != derived[k]} == changed
  assert report.mesh == mesh and report.rules == LM1B_RULES
  out = jax.jit(lambda s: s, out_shardings=report.shardings)(new)
  assert bits(out) == ref


@_LM1B
def test_errors_are_grouped_with_the_full_list_on_the_exception(lm1b):
  boxed, _, _ = lm1b
  no_tensor = mesh_of((2, 4), axes=("data", "fsdp"))
  with pytest.raises(LayoutError) as e:
    tj.remesh(boxed, no_tensor, rules=LM1B_RULES)
  msg = str(e.value)
  assert msg.count("\n") <= 3, msg
  assert "mesh axes ['tensor'] are not in the new mesh" in msg
  with_tensor = [p for p in e.value.problems]
  assert len(with_tensor) > 30  # 12 kernels and biases, x3 with adamw
  assert f"{len(with_tensor)} leaves" in msg
  assert all("tensor" in str(p) for p in with_tensor)
  assert str(with_tensor[0]).startswith("params/decoder/Embed_0/embedding: ")
  # reshard groups its problems too.
  state = unboxed(boxed)
  odd = jax.tree.map(lambda x: NamedSharding(mesh_of((3,), axes=("x",)),
                                             P(*[None] * (x.ndim - 1), "x"))
                     if x.ndim else NamedSharding(no_tensor, P()), state)
  with pytest.raises(LayoutError) as e:
    tj.reshard(state, odd)
  # one line per (dimension, size) that fails, not one per leaf
  kinds = {(x.ndim - 1, x.shape[-1]) for x in jax.tree.leaves(state)
           if x.ndim and x.shape[-1] % 3}
  lines = str(e.value).splitlines()[1:]
  assert len(lines) == len(kinds) and len(e.value.problems) > 50
  assert {ln.split(" cannot")[0].strip() for ln in lines} == {
      f"dimension {d} of size {n}" for d, n in kinds}


def test_nnx_model_and_optimizer_remesh():
  class DotReluDot(nnx.Module):  # the flax sharding guide's model

    def __init__(self, depth, rngs):
      init = nnx.initializers.lecun_normal()
      self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(
                                 init, ("embed", "mlp")))
      self.w2 = nnx.Param(init(rngs.params(), (depth, depth)),
                          out_sharding=("mlp", "embed"))

    def __call__(self, x):
      return nnx.relu(self.dot1(x)) @ self.w2

  rules = (("embed", "data"), ("mlp", "model"))

  @nnx.jit
  def create():
    model = DotReluDot(64, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(
        state, nnx.get_partition_spec(state)))
    return model

  m1 = Mesh(np.array(DEVS).reshape(2, 4), ("data", "model"))
  with jax.set_mesh(m1), nnx.logical_axis_rules(rules):
    model = create()
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  state = nnx.state((model, opt))
  ref = bits(state)
  swapped = (("embed", "model"), ("mlp", "data"))
  for mesh, r in [(Mesh(np.array(DEVS[4:]).reshape(2, 2), ("data", "model")),
                   rules),
                  (Mesh(np.array(DEVS[::-1]).reshape(4, 2), ("data", "model")),
                   swapped)]:
    with nnx.logical_axis_rules(r):
      expected = nnx.get_named_sharding(state, mesh)
    new, report = tj.remesh(state, mesh, rules=r)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert bits(new) == ref
    got = [x.sharding for x in jax.tree.leaves(new)]
    assert got == jax.tree.leaves(expected)
    assert report.mesh == mesh and report.rules == r
    assert jax.tree.leaves(report.shardings) == jax.tree.leaves(expected)
    assert isinstance(new[0]["dot1"]["kernel"], nnx.Param)
    # A pure dict (nnx.to_pure_dict) with the variables as its logical axes.
    pure, _ = tj.remesh(nnx.to_pure_dict(state), mesh, rules=r,
                        logical_axes=state)
    assert isinstance(pure, dict) and bits(pure) == ref
    assert [x.sharding for x in jax.tree.leaves(pure)] == got
    # reshard takes nnx's sharding tree (Variables holding shardings) and
    # the same tree unboxed, as jax.device_put does.
    with nnx.logical_axis_rules(rules):
      back = tj.reshard(new, nnx.get_named_sharding(state, m1))
    assert bits(back) == ref and jax.tree.structure(back) == jax.tree.structure(state)
    assert [x.sharding for x in jax.tree.leaves(back)] == [
        x.sharding for x in jax.tree.leaves(state)]
    again = tj.reshard(new, report.shardings)
    assert [x.sharding for x in jax.tree.leaves(again)] == got
  # The configuration search reads nnx names too, and remesh hands back
  # what nnx's own sharding functions give under the rules it picked.
  spec = tj.search.from_abstract_params(nnx.state(model))
  assert spec.dims("mlp") == (64,) and spec.dims("embed") == (64,)
  found, report = tj.remesh(state, devices=DEVS[:4], global_batch=8)
  assert bits(found) == ref and report.mesh.size == 4
  with nnx.logical_axis_rules(report.rules):
    expected = nnx.get_named_sharding(state, report.mesh)
  assert [x.sharding for x in jax.tree.leaves(found)] == jax.tree.leaves(
      expected)
  # An abstract state with shardings (nnx.get_abstract_model's) is a target.
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  back = tj.reshard(new, abstract)
  assert bits(back) == ref
  assert [x.sharding for x in jax.tree.leaves(back)] == [
      x.sharding for x in jax.tree.leaves(state)]



def test_nnx_search_reads_params_not_optimizer_moments(monkeypatch):
  """remesh(devices=) on nnx.state((model, optimizer)) searches with the
  model's nnx.Param arrays only: Adam's moments carry the same logical names
  but are not parameters (counting them tripled the model)."""
  class Mlp(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.up = nnx.Linear(16, 64, rngs=rngs, kernel_init=nnx.with_partitioning(
          init, ("embed", "mlp")), bias_init=nnx.with_partitioning(
              nnx.initializers.zeros, ("mlp",)))
      self.down = nnx.Param(init(rngs.params(), (64, 16)), out_sharding=("mlp", "embed"))

  rules = (("embed", "data"), ("mlp", "model"))
  m1 = Mesh(np.array(DEVS).reshape(2, 4), ("data", "model"))
  with jax.set_mesh(m1), nnx.logical_axis_rules(rules):
    model = Mlp(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  state = nnx.state((model, opt))
  seen = []
  real = tj.search.best_mesh_for

  def spy(abstract, devices, **kw):
    seen.append(tj.search.from_abstract_params(abstract))
    return real(abstract, devices, **kw)

  monkeypatch.setattr(tj.search, "best_mesh_for", spy)
  new, report = tj.remesh(state, devices=DEVS[:4], global_batch=8)
  assert [s.param_count for s in seen] == [16 * 64 + 64 + 64 * 16]
  assert seen[0].dims("mlp") == (64,) and seen[0].dims("embed") == (16,)
  assert bits(new) == bits(state) and report.mesh.size == 4
  with nnx.logical_axis_rules(report.rules):
    expected = nnx.get_named_sharding(state, report.mesh)
  assert [x.sharding for x in jax.tree.leaves(new)] == jax.tree.leaves(expected)

def test_repeated_leaf_gets_each_target():
  m = mesh_of((2, 4), axes=("data", "model"))
  x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8),
                     NamedSharding(m, P(None, "model")))
  ref = np.asarray(x).copy()
  rows, repl = NamedSharding(m, P("data")), NamedSharding(m, P())
  for donate in (False, True):
    y = jax.device_put(ref, NamedSharding(m, P(None, "model")))
    out = tj.reshard({"a": y, "b": y, "c": y}, {"a": rows, "b": repl,
                                               "c": rows}, donate=donate)
    assert out["a"].sharding == rows and out["c"].sharding == rows
    assert out["b"].sharding == repl
    for k in "abc":
      assert np.array_equal(np.asarray(out[k]), ref)
  new, report = tj.remesh({"a": x, "b": x}, shardings={"a": rows, "b": repl})
  assert new["a"].sharding == rows and new["b"].sharding == repl
  assert report.shardings == {"a": rows, "b": repl}


def test_partition_spec_targets_use_the_mesh_in_context():
  m = mesh_of((2, 4), axes=("data", "model"))
  x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                     NamedSharding(m, P("data")))
  with pytest.raises(LayoutError, match=r"w: target PartitionSpec\('model',\)"
                     r" needs a mesh"):
    tj.reshard({"w": x}, P("model"))
  with pytest.raises(LayoutError, match="w: target PartitionSpec"):
    tj.remesh({"w": x}, shardings={"w": P("model")})
  with jax.set_mesh(m):
    y = tj.reshard(x, P("model"))
    z, report = tj.remesh({"w": x, "n": 3}, shardings=P(None, "model"))
  assert y.sharding == NamedSharding(m, P("model"))
  assert z["w"].sharding == NamedSharding(m, P(None, "model"))
  assert z["n"] == 3 and report.mesh == m
  with jax.set_mesh(m):  # remesh's mesh defaults to the one in context
    u, report = tj.remesh({"w": x})
  assert u["w"].sharding == NamedSharding(m, P("data")) and report.mesh == m
  with pytest.raises(TypeError, match="needs a mesh"):
    tj.remesh({"w": x})
  m2 = mesh_of((4,), DEVS[4:], axes=("model",))
  w, _ = tj.remesh({"w": x}, m2, shardings={"w": P("model")})
  assert w["w"].sharding == NamedSharding(m2, P("model"))
  with pytest.warns(DeprecationWarning):  # jax's older context manager
    with m2:
      v = tj.reshard(x, P(None, "model"))
  assert v.sharding == NamedSharding(m2, P(None, "model"))
  for out in (y, z["w"], w["w"], v):
    assert np.array_equal(np.asarray(out), np.asarray(x))
  # Devices are targets as in jax.device_put; anything else names the leaf.
  d = tj.reshard({"w": x}, DEVS[3])["w"]
  assert d.sharding == SingleDeviceSharding(DEVS[3])
  with pytest.raises(LayoutError, match="w: target 'rows' of type str"):
    tj.reshard({"w": x}, {"w": "rows"})
  with pytest.raises(LayoutError, match="structure does not match"):
    tj.reshard({"w": x}, {"v": P()})
  assert np.array_equal(np.asarray(d), np.asarray(x))


def test_boxes_that_name_a_mesh_name_the_new_one():
  m1 = mesh_of((2, 4), axes=("data", "model"))
  m2 = mesh_of((2, 2), DEVS[4:], axes=("data", "model"))
  rules = (("embed", "data"), ("mlp", "model"))
  box = nn.LogicallyPartitioned(
      jax.device_put(np.arange(32.0, dtype=np.float32).reshape(4, 8),
                     NamedSharding(m1, P("data", "model"))),
      ("embed", "mlp"), mesh=m1, rules=rules)
  new, _ = tj.remesh({"w": box}, m2, rules=(("embed", "model"),
                                            ("mlp", "data")))
  w = new["w"]
  assert w.mesh == m2 and w.rules == (("embed", "model"), ("mlp", "data"))
  assert w.value.sharding == NamedSharding(m2, P("model", "data"))
  # The user's step unboxes with the box's constraint: on the new mesh.
  out = jax.jit(lambda b: b.unbox() * 2)(w)
  assert np.array_equal(np.asarray(out), np.asarray(box.value) * 2)


def test_nnx_rules_mapping_two_names_to_one_mesh_axis_raise_layout_error():
  # nnx's rules may map two logical names of one variable to the same mesh
  # axis; remesh names every such leaf in a LayoutError (it was jax's
  # DuplicateSpecError, not a ValueError, from inside remesh).
  m = Mesh(np.array(DEVS[:4]).reshape(2, 2), ("a", "b"))
  rep = NamedSharding(m, P())

  class M(nnx.Module):
    pass

  mod = M()
  mod.w = nnx.Param(jax.device_put(np.zeros((4, 4), np.float32), rep),
                    out_sharding=("embed", "mlp"), eager_sharding=False)
  mod.v = nnx.Param(jax.device_put(np.zeros((4, 4, 2), np.float32), rep),
                    out_sharding=("embed", "heads", "mlp"),
                    eager_sharding=False)
  rules = (("embed", "a"), ("mlp", ("b", "a")), ("heads", None))
  with pytest.raises(LayoutError, match="a spec uses a mesh axis for more"
                     " than one dimension: 2 leaves: v, w") as e:
    tj.remesh(nnx.state(mod), m, rules=rules)
  text = "\n".join(map(str, e.value.problems))
  assert ("w: spec P('a', ('b', 'a')) uses mesh axes more than"
          " once: dimension 1 uses 'a' (dimension 0) again") in text
  assert ("v: spec P('a', None, ('b', 'a')) uses mesh axes more"
          " than once: dimension 2 uses 'a' (dimension 0) again") in text
