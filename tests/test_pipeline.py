"""tenplex_jax.pipeline against the same layers applied one after another.

Tolerance (float32): outputs and input gradients ``rtol=1e-5`` with
``atol=1e-5 * max|reference|``; param gradients the same, scaled by the
largest reference gradient over all leaves (some leaves, e.g. an attention
key bias, have analytically zero gradients, so only an absolute bound is
meaningful for them). Measured errors are ~2e-7 of the scale.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax.errors import LayoutError, UsageError

L, D, B = 8, 16, 16


def mlp_block(p, h):
  n = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * p["scale"]
  return h + jax.nn.gelu(n @ p["w1"] + p["b1"]) @ p["w2"]


def normal(seed, shape):
  # numpy, not jax.random: no eager op compiles in the test's time budget.
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def mlp_params(layers=L, seed=0):
  return {"scale": np.full((layers, D), 1.1, np.float32),
          "w1": normal(seed, (layers, D, 2 * D)) / 4,
          "b1": np.full((layers, 2 * D), 0.01, np.float32),
          "w2": normal(seed + 1, (layers, 2 * D, D)) / 6}


class AttnBlock(nn.Module):
  """A tiny pre-norm causal self-attention block from flax.linen layers."""

  @nn.compact
  def __call__(self, h):
    y = nn.LayerNorm()(h)
    mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(y, y, mask=mask)
    return h + y


def mesh_of(**sizes):
  names = tuple(sizes)
  shape = tuple(sizes.values())
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


@functools.partial(jax.jit, static_argnums=0)
def sequential(layer, params, x, ct):
  """The reference: loss and gradients of the layers applied in order."""

  def loss(params, x):
    h = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]
    return jnp.vdot(h, ct), h

  (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return y, g


def pipelined(layer, mesh, microbatches, grad_specs=None, **kw):

  def loss(params, x, ct):
    y = tj.pipeline(layer, params, x, mesh=mesh, microbatches=microbatches, **kw)
    return jnp.vdot(y, ct), y

  grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  if grad_specs is None:
    return jax.jit(grad)

  def constrained(params, x, ct):  # the params' gradient laid out as given
    out, (gp, gx) = grad(params, x, ct)
    gp = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, s)),
                      gp, grad_specs)
    return out, (gp, gx)

  return jax.jit(constrained)


def check_against_sequential(layer, params, x, mesh, microbatches, *, param_specs=None,
                             x_spec=P("data"), **kw):
  """Runs both; asserts outputs and gradients match; returns the compiled HLO."""
  ct = normal(7, x.shape)
  want_y, (want_gp, want_gx) = sequential(layer, params, x, ct)
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: P("stage"), params)
  shard = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
  sp = jax.tree.map(shard, params, param_specs)
  sx = shard(x, x_spec)
  f = pipelined(layer, mesh, microbatches, **kw)
  compiled = f.lower(sp, sx, ct).compile()
  (_, y), (gp, gx) = compiled(sp, sx, ct)
  scale = float(jnp.abs(want_y).max())
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * scale)
  scale = float(jnp.abs(want_gx).max())
  np.testing.assert_allclose(gx, want_gx, rtol=1e-5, atol=1e-5 * scale)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_gp))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
               gp, want_gp)
  # Each stage keeps the gradients of its own layers.
  for g, s in zip(jax.tree.leaves(gp), jax.tree.leaves(param_specs)):
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim), (g.sharding, s)
  return compiled.as_text()


def all_gathers(hlo):
  return [line.strip() for line in hlo.splitlines()
          if " all-gather(" in line or " all-gather-start(" in line]


def stack_gathers(hlo, params):
  """The all-gathers whose result is a whole stacked param (all L layers)."""
  full = {tuple(v.shape) for v in jax.tree.leaves(params)}
  found = []
  for line in all_gathers(hlo):
    m = re.search(r"= \(?[a-z0-9]+\[([0-9,]*)\]", line)
    if m and tuple(int(d) for d in m.group(1).split(",") if d) in full:
      found.append(line)
  return found


# Every stage count in {1, 2, 4, 8} and every microbatch count in {1, 2, 4, 8}
# appears; the batch is sharded over 'data' on the rest of the 8 devices.
@pytest.mark.parametrize("stages,microbatches", [(1, 4), (2, 8), (4, 1), (8, 2)])
def test_mlp_block_matches_sequential(stages, microbatches):
  mesh = mesh_of(stage=stages, data=8 // stages)
  x = normal(1, (B, D))
  hlo = check_against_sequential(mlp_block, mlp_params(), x, mesh, microbatches)
  assert not stack_gathers(hlo, mlp_params()), stack_gathers(hlo, mlp_params())[:3]
  if (B // microbatches) % (8 // stages) == 0:
    # Microbatches split evenly over 'data': nothing is gathered at all.
    assert not all_gathers(hlo), all_gathers(hlo)[:3]
  if stages > 1:
    assert "collective-permute" in hlo


ATTN = AttnBlock()


def attn_layer(p, h):
  return ATTN.apply({"params": p}, h)


@functools.cache
def attn_inputs():
  x = normal(3, (B, 4, 8))
  keys = jax.random.split(jax.random.key(4), 4)
  params = jax.jit(jax.vmap(lambda k: ATTN.init(k, x[:1])["params"]))(keys)
  return params, x


def test_flax_attention_block_matches_sequential():
  stages, microbatches = 4, 2
  params, x = attn_inputs()
  mesh = mesh_of(stage=stages, data=8 // stages)
  hlo = check_against_sequential(attn_layer, params, x, mesh, microbatches)
  assert "collective-permute" in hlo
  assert not all_gathers(hlo), all_gathers(hlo)[:3]


def test_params_sharded_over_tensor_too_and_remat():
  mesh = mesh_of(stage=2, data=2, tensor=2)
  specs = {"scale": P("stage"), "w1": P("stage", None, "tensor"),
           "b1": P("stage", "tensor"), "w2": P("stage", "tensor")}
  x = normal(1, (B, D))
  hlo = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                 remat=True)
  assert "collective-permute" in hlo
  assert not all_gathers(hlo), all_gathers(hlo)[:3]


def in_loop_all_reduces(hlo):
  """The all-reduces the compiled program runs inside the pipeline's loops."""
  return [line.strip() for line in hlo.splitlines()
          if (" all-reduce(" in line or " all-reduce-start(" in line) and "while/body" in line]


@pytest.mark.parametrize("specs", [None, {"scale": P("stage"), "w1": P("stage", None, "tensor"),
                                          "b1": P("stage", "tensor"), "w2": P("stage", "tensor")}])
def test_batch_axes_sum_the_param_gradient_once_outside_the_loops(specs):
  """With ``batch_axes=("data",)`` the gradients still match the sequential
  layers, and the params' gradient is no longer summed over 'data' inside the
  tick and layer loops (left to the compiler, it is: once per layer and tick).
  With 'tensor' too, only the tensor-parallel all-reduces stay in the loops."""
  mesh = mesh_of(stage=2, data=2, tensor=2)
  x = normal(1, (B, D))
  data_groups = "{{0,2},{1,3},{4,6},{5,7}}"  # stage, data, tensor: data pairs differ by 2
  before = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs)
  after = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                   batch_axes=("data",))
  over_data = lambda lines: [ln for ln in lines if data_groups in ln or "[2,2,2]T(0,2,1)" in ln]
  assert over_data(in_loop_all_reduces(before)), in_loop_all_reduces(before)[:3]
  assert not over_data(in_loop_all_reduces(after)), over_data(in_loop_all_reduces(after))[:3]
  if specs is None:
    assert not in_loop_all_reduces(after), in_loop_all_reduces(after)[:3]


def test_skip_bubbles_matches_sequential_and_runs_fewer_layers():
  """``skip_bubbles=True``: the stage's layers sit in a conditional (run on the
  M of the M + S - 1 ticks it has a microbatch); outputs and gradients still
  match the sequential layers, with the tensor-parallel all-reduces inside it."""
  mesh = mesh_of(stage=2, data=2, tensor=2)
  specs = {"scale": P("stage"), "w1": P("stage", None, "tensor"),
           "b1": P("stage", "tensor"), "w2": P("stage", "tensor")}
  x = normal(1, (B, D))
  plain = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                   batch_axes=("data",))
  skip = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                  batch_axes=("data",), skip_bubbles=True)
  assert " conditional(" not in plain
  assert skip.count(" conditional(") == 2, skip.count(" conditional(")  # forward, backward
  assert in_loop_all_reduces(skip)


def in_loop_collectives(hlo):
  """Every collective the compiled program runs inside the pipeline's loops."""
  kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
  return [line.strip() for line in hlo.splitlines() if "while/body" in line
          and any(f" {k}(" in line or f" {k}-start(" in line for k in kinds)]


def test_gather_axes_gather_the_params_once_and_leave_no_collective_in_the_loops():
  """With ``gather_axes=("tensor",)`` the tensor-sharded weights are gathered
  once, outside the loops; outputs and gradients still match the sequential
  layers (the gradient, whole on every tensor position, constrained to the
  params' layout: a local slice). Left to the compiler the loops hold the
  tensor-parallel all-reduces."""
  mesh = mesh_of(stage=2, data=2, tensor=2)
  specs = {"scale": P("stage"), "w1": P("stage", None, "tensor"),
           "b1": P("stage", "tensor"), "w2": P("stage", "tensor")}
  x = normal(1, (B, D))
  split = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                   batch_axes=("data",), skip_bubbles=True)
  gathered = check_against_sequential(mlp_block, mlp_params(), x, mesh, 4, param_specs=specs,
                                      batch_axes=("data",), skip_bubbles=True,
                                      gather_axes=("tensor",), grad_specs=specs)
  assert in_loop_collectives(split)
  assert not in_loop_collectives(gathered), in_loop_collectives(gathered)[:3]
  assert "collective-permute" in gathered
  # The three tensor-sharded leaves, each gathered once (none of them whole).
  assert len(all_gathers(gathered)) == 3, all_gathers(gathered)
  assert not stack_gathers(gathered, mlp_params())


def test_layer_axis_only_sharded_gathers_the_stack():
  """The control: plain jit over params sharded on 'stage' (FSDP over layers)
  all-gathers the stacked layers, which the pipeline never does."""
  mesh = mesh_of(stage=4, data=2)
  params = jax.device_put(mlp_params(), NamedSharding(mesh, P("stage")))
  x = jax.device_put(jnp.ones((B, D)), NamedSharding(mesh, P("data")))
  f = jax.jit(lambda p, x: jax.lax.scan(lambda h, q: (mlp_block(q, h), None), x, p)[0])
  hlo = f.lower(params, x).compile().as_text()
  assert stack_gathers(hlo, params)
  assert "collective-permute" not in hlo


def test_pytree_activations():
  """x may be a pytree: a hidden state and a per-row bias carried along."""

  def layer(p, xs):
    return {"h": mlp_block(p, xs["h"]) + xs["bias"], "bias": xs["bias"] * 0.5}

  mesh = mesh_of(stage=4, data=2)
  x = {"h": normal(1, (B, D)),
       "bias": normal(2, (B, 1))}
  params = mlp_params()
  want = jax.jit(lambda p, x: jax.lax.scan(lambda h, q: (layer(q, h), None), x, p)[0])(
      params, x)
  got = jax.jit(lambda p, x: tj.pipeline(layer, p, x, mesh=mesh, microbatches=4))(params, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def test_errors_name_the_numbers():
  mesh = mesh_of(stage=4, data=2)
  x = np.ones((B, D), np.float32)
  with pytest.raises(LayoutError, match=r"6 layers \(leading axis of 'b1'\).* 4 stages"):
    tj.pipeline(mlp_block, mlp_params(layers=6), x, mesh=mesh)
  with pytest.raises(UsageError, match=r"batch \(16.*microbatches=3"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, microbatches=3)
  with pytest.raises(UsageError, match=r"no axis 'pipe'"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, stage_axis="pipe")
  bad = dict(mlp_params(), w2=np.zeros((4, 2 * D, D), np.float32))
  with pytest.raises(LayoutError, match=r"'b1' has 8, but \[\('w2', 4\)\]"):
    tj.pipeline(mlp_block, bad, x, mesh=mesh)
  with pytest.raises(UsageError, match="must return x's structure"):
    tj.pipeline(lambda p, h: h[:, :3], mlp_params(), x, mesh=mesh)
  with pytest.raises(UsageError, match="positive int"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, microbatches=0)
  with pytest.raises(UsageError, match=r"batch_axes \('stage',\) must be distinct mesh axes"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, batch_axes=("stage",))
  with pytest.raises(UsageError, match=r"batch_axes \('rows',\)"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, batch_axes=("rows",))
  with pytest.raises(UsageError, match=r"gather_axes \('data',\) must be distinct.*batch_axes"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, batch_axes=("data",),
                gather_axes=("data",))
  with pytest.raises(UsageError, match=r"gather_axes \('stage',\)"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, gather_axes=("stage",))
  with pytest.raises(UsageError, match=r"microbatch's 1 rows \(batch 16 / microbatches=16\).*2 positions"):
    tj.pipeline(mlp_block, mlp_params(), x, mesh=mesh, microbatches=16, batch_axes=("data",))


def test_bubble_fraction():
  assert tj.bubble_fraction(1, 4) == 0
  assert tj.bubble_fraction(4, 4) == pytest.approx(3 / 7)
