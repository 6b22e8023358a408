"""Elastic determinism (EasyScale D0/D1): the same bits on every mesh.

Every comparison is on raw bits (float32 viewed as uint32), never allclose.
"""

import json
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax import determinism as det
from tenplex_jax.errors import UsageError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import det_train  # noqa: E402
import procs  # noqa: E402
from fixtures import lm1b_models, lm1b_state  # noqa: E402


def bits(tree):
  """Each leaf's bits, as unsigned integers of its width (float32, bfloat16)."""
  return [np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}")
          for x in jax.tree_util.tree_leaves(tree)]


def assert_bitwise(a, b, where=""):
  la, lb = bits(a), bits(b)
  assert len(la) == len(lb), where
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y, err_msg=str(where))


def compiled_dp(v, mesh, params, batch):
  """``value_and_grad`` over ``v`` workers inside ``determinism.jit``, no
  param shardings (DP: gradients left replicated), compiled for these args."""
  f = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh)
  return det.jit(lambda p, b: f(p, b)).lower(params, batch).compile()


def all_gather_shapes(text):
  """The shapes (``"16,48"``) of the all-gathers in a compiled program."""
  return {shape for _, shape in re.findall(
      r"= \(?(\w+)\[([\d,]*)\]\S* all-gather\(", text)}


def compiled_in_jit(v, mesh, params, batch):
  """``value_and_grad`` over ``v`` workers inside ``determinism.jit``, the
  params' shardings passed (``param_shardings``), compiled for these args."""
  sh = jax.tree.map(lambda x: x.sharding, params)
  f = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh,
                         param_shardings=sh)
  return det.jit(lambda p, b: f(p, b), out_shardings=(
      NamedSharding(mesh, P()), sh)).lower(params, batch).compile()


def same_bits(a, b) -> bool:
  return all((x == y).all() for x, y in zip(bits(a), bits(b)))


def mesh1d(n, name="data"):
  return Mesh(np.array(jax.devices()[:n]), (name,))


# ---------------------------------------------------------------- an MLP


def mlp_loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def mlp_data(global_batch):
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (16, 48)), "b1": jnp.zeros(48),
            "w2": jax.random.normal(k[1], (48, 4)) / 7}
  batch = {"x": jax.random.normal(k[2], (global_batch, 16)),
           "y": jax.random.normal(k[3], (global_batch, 4))}
  return params, batch


def place(params, batch, mesh, fsdp):
  rep = NamedSharding(mesh, P())
  if fsdp:  # ZeRO-3 style: every param split over the batch axis
    specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
              for k, v in params.items()}
  else:
    params = jax.device_put(params, rep)
  return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


# V/n a power of two (or n = 1): each device sums its workers' subtree
# locally; V = 24 on 2, 4 and 8 devices (V/n = 12, 6, 3) takes the per-worker
# exchange instead: both paths must give the same bits.
@pytest.mark.parametrize("v,ns,fsdp_ns", [(8, (1, 2, 4, 8), (2, 8)),
                                           (24, (1, 2, 3, 4, 6, 8), (3, 6, 8))])
def test_mlp_bitwise_across_meshes_dp_and_fsdp(v, ns, fsdp_ns):
  params, batch = mlp_data(2 * v)
  ref = None
  for n in ns:
    mesh = mesh1d(n)
    f = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh)
    for fsdp in (False, True) if n in fsdp_ns else (False,):
      p, b = place(params, batch, mesh, fsdp)
      loss, grads = f(p, b)
      for g, q in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(p)):
        assert g.sharding == q.sharding
      if ref is None:
        ref = (loss, grads)
      assert_bitwise(ref, (loss, grads))
  # The value is the global-batch mean and its gradient (up to rounding).
  loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
  np.testing.assert_allclose(ref[0], loss, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(ref[1]), jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_bitwise_across_meshes():
  # Each node of the tree rounds to bfloat16 whether it is added in a
  # device's local subtree or in the top of the tree after the exchange.
  params, batch = mlp_data(16)
  params, batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (params, batch))
  ref = None
  for n in (1, 2, 4, 8):
    mesh = mesh1d(n)
    f = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh)
    for fsdp in (False, True):
      out = f(*place(params, batch, mesh, fsdp))
      got = [np.asarray(x).view(np.uint16) for x in jax.tree_util.tree_leaves(out)]
      if ref is None:
        ref = got
      for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unrolled_counter_has_the_nested_scans_bits(monkeypatch, dtype):
  # The top levels of each device's subtree are evaluated unrolled (a
  # binary-counter stack, the default) or as nested scans: the bits must
  # not depend on it, whatever the mesh (V = 8 on 1, 2, 4 devices: V/n 8, 4,
  # 2; V = 12 on 1 device: a perfect subtree of 8 unrolled then one of 4 as
  # a scan; V = 16 on 1 device with 1 unrolled level: leaves that are
  # scans).
  params, batch = mlp_data(48)
  params, batch = jax.tree.map(lambda x: x.astype(dtype), (params, batch))
  for v, ns, levels in ((8, (1, 2, 4), (3,)), (12, (1,), (3,)),
                        (16, (1,), (1,))):
    rows = 3 * v if v != 16 else 48
    b_v = jax.tree.map(lambda x: x[:rows], batch)
    for n in ns:
      mesh = mesh1d(n)
      outs = {}
      for lv in (0,) + levels:
        monkeypatch.setattr(det, "_UNROLL_LEVELS", lv)
        f = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh)
        outs[lv] = f(*place(params, b_v, mesh, fsdp=n == 2))
      for lv in levels:
        assert_bitwise(outs[0], outs[lv], (v, n, lv))
  monkeypatch.setattr(det, "_UNROLL_LEVELS", None)
  # The default on CPU: unrolled (the workers ordered by predicate) from
  # _UNROLL_MIN_BYTES of gradient per worker, float32 and 16-bit floats
  # alike; the scans for smaller gradients (one copy of the worker to
  # compile).
  big = det._UNROLL_MIN_BYTES
  assert det._unroll_levels(mesh1d(1), params, grad_bytes=big) == 3
  assert det._unroll_levels(mesh1d(1), params, grad_bytes=big - 1) == 0
  assert det._unroll_levels(mesh1d(1), params) == 0  # this MLP is small
  assert det._unroll_levels(mesh1d(1), params, 2) == 2
  assert det._isolate_by_cond(mesh1d(1))  # barriers do not isolate on CPU


def test_bfloat16_unrolled_by_default_from_the_threshold(monkeypatch):
  # On CPU bfloat16 params take the unrolled counter by default from
  # _UNROLL_MIN_BYTES of gradient per worker, as float32 ones do (the scans
  # below): lowered here to this MLP's gradient bytes, the default steps
  # on 2 and 4 devices (V = 8: V/n = 4 and 2; DP, and FSDP inside jit with
  # param_shardings) compile without a loop and give the bits of the
  # 1-device step by the nested scans (the default below the threshold).
  params, batch = mlp_data(16)
  params, batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                               (params, batch))
  grad_bytes = sum(x.size * x.dtype.itemsize
                   for x in jax.tree_util.tree_leaves(params))
  mesh1 = mesh1d(1)
  assert det._unroll_levels(mesh1, params) == 0
  p1, b1 = place(params, batch, mesh1, False)
  scans = compiled_dp(8, mesh1, p1, b1)
  assert "while(" in scans.as_text()
  ref = scans(p1, b1)
  monkeypatch.setattr(det, "_UNROLL_MIN_BYTES", grad_bytes)
  assert det._unroll_levels(mesh1, params) == 3
  assert det._unroll_levels(mesh1, params, grad_bytes=grad_bytes - 1) == 0
  for n, fsdp in ((2, False), (4, False), (2, True)):
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, fsdp)
    compiled = (compiled_in_jit if fsdp else compiled_dp)(8, mesh, p, b)
    assert "while(" not in compiled.as_text(), (n, fsdp)
    assert_bitwise(ref, compiled(p, b), (n, fsdp))


def test_inside_jit_matches_outside():
  params, batch = mlp_data(16)
  mesh1, mesh4 = mesh1d(1), mesh1d(4)
  outside = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1)(
      *place(params, batch, mesh1, False))
  f = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh4)
  inside = det.jit(lambda p, b: f(p, b))(*place(params, batch, mesh4, True))
  assert_bitwise(outside, inside)


def test_inside_jit_with_param_shardings_matches_outside(monkeypatch):
  # FSDP params passed as shards (gathered inside each worker: V/n = 1 on 8
  # devices, once before the workers' loop for V/n = 4 on 2) and DP params:
  # the bits of the 1-device run.
  params, batch = mlp_data(16)
  mesh1 = mesh1d(1)
  ref = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1)(
      *place(params, batch, mesh1, False))
  for n, fsdp in ((8, True), (2, True), (4, False)):
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, fsdp)
    step = compiled_in_jit(8, mesh, p, b)
    assert_bitwise(ref, step(p, b), n)
    if fsdp:
      # The FSDP gradients leave in the reduce-scatter layout: the step
      # all-gathers one array per leaf fewer than with every gradient
      # gathered inside jit (the behaviour before), same bits.
      def gathers(step):
        return len(re.findall(r" all-gather(?:-start)?\(", step.as_text()))

      monkeypatch.setattr(det, "_GATHER_INSIDE_JIT", True)
      before = compiled_in_jit(8, mesh, p, b)
      monkeypatch.setattr(det, "_GATHER_INSIDE_JIT", None)
      assert_bitwise(ref, before(p, b), n)
      assert gathers(step) == gathers(before) - len(params), n


def test_top_by_permutes_has_the_all_to_all_bits(monkeypatch):
  # The top of the tree exchanges the subtree sums by n - 1 collective
  # permutes per leaf (no all_to_all left in the step), with the bits of
  # the all_to_all it replaced and of the 1-device run: V = 8 on 2 and 4
  # devices, DP and FSDP (param_shardings: the tops in conditionals).
  params, batch = mlp_data(16)
  mesh1 = mesh1d(1)
  ref = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1)(
      *place(params, batch, mesh1, False))
  for n, fsdp in ((2, True), (4, False), (4, True)):
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, fsdp)
    counts = {}
    for permute in (True, False):
      monkeypatch.setattr(det, "_TOP_BY_PERMUTE", permute)
      compiled = compiled_in_jit(8, mesh, p, b)
      assert_bitwise(ref, compiled(p, b), (n, fsdp, permute))
      text = compiled.as_text()
      counts[permute] = (len(re.findall(r" all-to-all\(", text)),
                         len(re.findall(r" collective-permute\(", text)))
    assert counts[True][0] == 0 and counts[True][1] > 0, counts
    assert counts[False][0] >= len(params) and counts[False][1] == 0, counts
  # bfloat16 gradients left replicated (DP) take the permutes (as 16-bit
  # ints) at V/n = 1 and keep the all_to_all at V/n > 1, with the 1-device
  # bits.
  monkeypatch.setattr(det, "_TOP_BY_PERMUTE", True)
  params, batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (params, batch))
  mesh = mesh1d(2)
  p, b = place(params, batch, mesh, False)
  for v, permutes in ((2, True), (8, False)):
    ref = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh1)(
        *place(params, batch, mesh1, False))
    compiled = compiled_dp(v, mesh, p, b)
    assert_bitwise(ref, compiled(p, b), v)
    text = compiled.as_text()
    a2a = len(re.findall(r" all-to-all\(", text))
    cp = len(re.findall(r" collective-permute\(", text))
    if permutes:
      assert a2a == 0 and cp >= len(params), (v, a2a, cp)
    else:
      assert a2a >= len(params) and cp == 0, (v, a2a, cp)


def collectives(text):
  """(element type, shape) of each all-gather, permute and all-to-all."""
  return re.findall(r"= \(?(\w+)\[([\d,]*)\]\S* (?:all-gather|"
                    r"collective-permute|all-to-all)\(", text)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_exchange_and_16_bit_collectives(monkeypatch, dtype):
  # bfloat16 gradients left replicated (DP) that the worker computes as a
  # transpose (the matmul weights w1 and w2; not the bias b1) are exchanged
  # as that transpose and gathered transposed (all-gathers of shape (48, 16)
  # and (4, 48); float32 ones are not), and 16-bit floats cross every
  # collective as uint16 (XLA:CPU
  # would run them in float32): the bits of the 1-device run and of the
  # exchange along the first dimension (_EXCHANGE_TRANSPOSED False), V = n
  # on 2 and 4 devices, by the permutes and by the all_to_all.
  params, batch = mlp_data(16)
  params, batch = jax.tree.map(lambda x: x.astype(dtype), (params, batch))
  mesh1 = mesh1d(1)
  for n, permute in ((2, True), (4, True), (2, False)):
    # V = n: the transposed exchange applies at V/n = 1 only.
    ref = det.value_and_grad(mlp_loss, virtual_workers=n, mesh=mesh1)(
        *place(params, batch, mesh1, False))
    monkeypatch.setattr(det, "_TOP_BY_PERMUTE", permute)
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, False)
    gathered = {}
    for transposed in (True, False):
      monkeypatch.setattr(det, "_EXCHANGE_TRANSPOSED", transposed)
      compiled = compiled_dp(n, mesh, p, b)
      assert_bitwise(ref, compiled(p, b), (n, permute, transposed))
      text = compiled.as_text()
      gathered[transposed] = all_gather_shapes(text)
      if dtype == jnp.bfloat16:
        # Only the loss (float32, one per device) is not uint16.
        assert {(t, s) for t, s in collectives(text) if t != "u16"} == {
            ("f32", str(n))}, (n, permute, collectives(text))
    assert {"16,48", "48,4"} <= gathered[False], gathered
    assert not {"48,16", "4,48"} & gathered[False], gathered
    if dtype == jnp.bfloat16:
      assert {"48,16", "4,48"} <= gathered[True], gathered
    else:  # float32 is exchanged untransposed (it was slower transposed)
      assert gathered[True] == gathered[False], gathered


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_16_bit_gradients_summed_transposed(monkeypatch, dtype):
  # At V/n > 1 the bfloat16 matmul weights' gradients left replicated (DP)
  # are summed on the device as the transpose the worker computes
  # (_ACCUMULATE_TRANSPOSED: XLA:CPU writes them column-major, the partial
  # sums are row-major), then exchanged and gathered transposed (all-gathers
  # of shape (48, 16) and (4, 48)) and transposed back once; float32 ones
  # and the bias are not. The bits of the 1-device run and of the sums as
  # themselves (False), by the nested scans (the CPU default for gradients
  # this small) and by the unrolled counter: V = 4 and 8 on 2 devices, 8 on
  # 4.
  params, batch = mlp_data(16)
  params, batch = jax.tree.map(lambda x: x.astype(dtype), (params, batch))
  mesh1 = mesh1d(1)
  # (float32 only checks that nothing changes: one case of each kind)
  bf16 = dtype == jnp.bfloat16
  refs = {}

  def one_device(v, unroll):
    """The 1-device run at ``v`` workers (each computed once)."""
    if (v, unroll) not in refs:
      refs[v, unroll] = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh1)(
          *place(params, batch, mesh1, False))
    return refs[v, unroll]

  dp_cases = ((2, 4, None), (2, 8, None), (4, 8, None), (2, 4, 3))
  for n, v, unroll in dp_cases if bf16 else dp_cases[:1]:
    monkeypatch.setattr(det, "_UNROLL_LEVELS", unroll)
    ref = one_device(v, unroll)
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, False)
    gathered = {}
    for summed_t in (True, False):
      monkeypatch.setattr(det, "_ACCUMULATE_TRANSPOSED", summed_t)
      compiled = compiled_dp(v, mesh, p, b)
      assert_bitwise(ref, compiled(p, b), (n, v, unroll, summed_t))
      gathered[summed_t] = all_gather_shapes(compiled.as_text())
    where = (n, v, unroll, gathered)
    assert {"16,48", "48,4"} <= gathered[False], where
    assert not {"48,16", "4,48"} & gathered[False], where
    if bf16:
      assert {"48,16", "4,48"} <= gathered[True], where
      assert not {"16,48", "48,4"} & gathered[True], where
    else:
      assert gathered[True] == gathered[False], where
  # FSDP inside jit with param_shardings (each leaf's top in a conditional,
  # its shard row-major): bfloat16 summed transposed too, the column-major
  # sums entering the tops' branches (both branches of w1's and w2's top
  # take a column-major operand; none with it False) and copied to
  # row-major there, once; the bits of 1 device and of the sums as
  # themselves, V = 4 and 8 on 2 devices, by the scans and the unrolled
  # counter (its root's two children added in the branches).
  fsdp_cases = ((4, None), (8, None), (4, 3))
  for v, unroll in fsdp_cases if bf16 else fsdp_cases[:1]:
    monkeypatch.setattr(det, "_UNROLL_LEVELS", unroll)
    ref = one_device(v, unroll)
    mesh = mesh1d(2)
    p, b = place(params, batch, mesh, True)
    column_major = {}
    for summed_t in (True, False):
      monkeypatch.setattr(det, "_ACCUMULATE_TRANSPOSED", summed_t)
      compiled = compiled_in_jit(v, mesh, p, b)
      assert_bitwise(ref, compiled(p, b), (v, unroll, summed_t))
      column_major[summed_t] = len(re.findall(
          r"\((?:s32\[\], )?(\w+\[\d+,\d+\]\{0,1\})(?:, \1)?\) parameter\(",
          compiled.as_text()))
    if unroll is None:  # unrolled at V/n = 2 the root's children are the
      # workers' own (column-major) outputs either way
      want = 4 if bf16 else 0
      assert column_major == {True: want, False: 0}, (v, column_major)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unrolled_root_added_in_the_top_branch(monkeypatch, dtype):
  # Inside jit with param_shardings the FSDP gradients keep the
  # reduce-scatter layout, each leaf's top in a conditional's branch; with
  # the unrolled counter the root of each device's subtree is added in that
  # branch (fused with the slices that feed the all_to_all), not before it.
  # The bits are those of the 1-device run (float32, V = 8: V/n = 4 on 2
  # devices, 2 on 4; bfloat16, V = 4 on 2 devices: its unrolled programs
  # compile slowly), and of the root added before the branches
  # (_ROOT_ADD_IN_TOP False).
  monkeypatch.setattr(det, "_UNROLL_LEVELS", 3)
  params, batch = mlp_data(16)
  params, batch = jax.tree.map(lambda x: x.astype(dtype), (params, batch))
  leaf = "bf16" if dtype == jnp.bfloat16 else "f32"
  v, ns = (4, (2,)) if dtype == jnp.bfloat16 else (8, (2, 4))
  batch = jax.tree.map(lambda x: x[:2 * v], batch)
  mesh1 = mesh1d(1)
  ref = det.value_and_grad(mlp_loss, virtual_workers=v, mesh=mesh1)(
      *place(params, batch, mesh1, False))
  for n in ns:
    mesh = mesh1d(n)
    p, b = place(params, batch, mesh, True)
    branches = {}
    for in_top in (True, False):
      monkeypatch.setattr(det, "_ROOT_ADD_IN_TOP", in_top)
      compiled = compiled_in_jit(v, mesh, p, b)
      assert_bitwise(ref, compiled(p, b), (v, n, in_top))
      # Branches that take two whole gradients of a leaf (the root's
      # children) and return its shard: both branches of each leaf's top.
      branches[in_top] = len(re.findall(
          rf"\(param[.\d]*: \((?:s32\[\], )?({leaf}\[[\d,]*\]), \1\)\)"
          rf" -> \({leaf}\[",
          compiled.as_text()))
    assert branches == {True: 2 * len(params), False: 0}, (v, n, branches)


# ------------------------------------------------ flax's lm1b transformer

TINY = dict(vocab_size=64, emb_dim=32, num_heads=2, num_layers=1, qkv_dim=32,
            mlp_dim=64)


def lm1b_setup(shape, v):
  """lm1b's params on a (data, fsdp, tensor) mesh, with its logical rules."""
  mesh = lm1b_state.make_mesh(shape)
  abstract, init = lm1b_state.abstract_state(TINY, batch=2, seq_len=16)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                          lm1b_state.LM1B_RULES)
  state = jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(0))
  params = jax.tree_util.tree_map(
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      state.params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  model = lm1b_models.TransformerLM(
      lm1b_state.model_config(TINY, deterministic=False, max_len=16))

  def loss_fn(p, tokens, key):
    logits = model.apply({"params": p}, tokens, rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  tokens = jax.random.randint(jax.random.key(1), (2 * v, 16), 1, 64)
  tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
  return mesh, params, tokens, loss_fn


def test_lm1b_transformer_bitwise_1_device_and_fsdp_8():
  v = 8
  ref = None
  # 1 device; FSDP on 8 (params over 'fsdp' by lm1b's rules, batch over
  # data x fsdp). (A tensor axis is covered by the demo test.)
  for shape in [(1, 1, 1), (4, 2, 1)]:
    mesh, params, tokens, loss_fn = lm1b_setup(shape, v)
    f = det.value_and_grad(loss_fn, virtual_workers=v, mesh=mesh,
                           batch_axis=("data", "fsdp"), rng_argnums=(0,))
    out = f(params, tokens, jax.random.key(5))
    if ref is None:
      ref = out
    assert_bitwise(ref, out)


def test_plain_psum_step_differs_across_meshes():
  """The baseline the module fixes: XLA's all-reduce order follows the mesh."""
  params, batch = mlp_data(64)
  outs = []
  for n in (1, 8):
    p, b = place(params, batch, mesh1d(n), False)
    outs.append(jax.jit(jax.value_and_grad(mlp_loss))(p, b))
  assert not same_bits(outs[0], outs[1])


# -------------------------------------------------------- D0 and D1


_STEPS_CACHE = {}


def train_step_for(mesh, v, param_shardings=None):
  key = (tuple(d.id for d in mesh.devices.flat), v, param_shardings is None)
  if key not in _STEPS_CACHE:
    _STEPS_CACHE[key] = det_train.make_step(mesh, v, param_shardings)
  return _STEPS_CACHE[key]


def train(schedule, v, *, fsdp=False, store_dir=None, shards_in=False):
  """``schedule``: ((first step, devices), ...); resizes with remesh.

  ``fsdp``: params and adamw moments ZeRO-3 sharded over ``data`` (their
  shard shapes change with every resize), else replicated. ``shards_in``:
  the step passes the params' shardings to ``value_and_grad`` (params enter
  the workers as shards)."""
  x, y = det_train.dataset(2 * v)
  state = det_train.init_state()
  starts = dict(schedule)
  mesh = None
  for t in range(det_train.STEPS):
    if t in starts:
      new = mesh1d(starts[t])
      target = det_train.shardings(state, new, fsdp)
      if mesh is None:
        state = tj.reshard(state, target)
      elif store_dir is not None and t == schedule[1][0]:
        # This resize goes through the host store (save, restore elsewhere).
        tj.store.save(state, str(store_dir), step=t)
        state = tj.store.restore(str(store_dir), jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state, target))
      else:
        state, _ = tj.remesh(state, shardings=target)
      for a, s in zip(jax.tree_util.tree_leaves(state),
                      jax.tree_util.tree_leaves(target)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
      mesh = new
    batch = jax.device_put({"x": x[t], "y": y[t]}, NamedSharding(mesh, P("data")))
    ps = det_train.shardings(state, mesh, fsdp)["params"] if shards_in else None
    state, _ = train_step_for(mesh, v, ps)(state, batch, t)
  return state


_STATIC = {}


def static_run(v):
  """The job on 8 devices from start to end, params replicated."""
  if v not in _STATIC:
    _STATIC[v] = train(((0, 8),), v)
  return _STATIC[v]


# The two tests against static_run(8) run on one xdist worker: the second
# reuses the static run (and its compiled step) that the first made.
_STATIC_8 = pytest.mark.xdist_group("determinism_static_8")


@_STATIC_8
# Its FSDP layout splits Dense_2's (8,) bias into one-element shards on 8
# devices, which value_and_grad warns about; this step's bits hold there.
@pytest.mark.filterwarnings(
    "ignore::tenplex_jax.determinism.SingleElementShardWarning")
def test_d0_d1_training_v8_resizes_8_4_2_8(tmp_path):
  static = static_run(8)
  assert_bitwise(static, train(((0, 8),), 8))                     # D0
  assert_bitwise(static, train(((0, 1),), 8))                     # 1 device
  # D1, replicated state; the 8 -> 4 resize goes through the host store.
  assert_bitwise(static, train(((0, 8), (5, 4), (10, 2), (15, 8)), 8,
                               store_dir=tmp_path))
  # D1, ZeRO-3 state: every resize changes the shard shapes of the params
  # and of adamw's moments, which the update runs on.
  assert_bitwise(static, train(((0, 8), (5, 4), (10, 2), (15, 8)), 8,
                               fsdp=True))
  # The same with the params' shardings passed to value_and_grad: the
  # params enter the workers as shards and are gathered inside each worker
  # (inside its branch on 8 devices, before the workers' loop on 4 and 2).
  assert_bitwise(static, train(((0, 8), (5, 4), (10, 2), (15, 8)), 8,
                               fsdp=True, shards_in=True))


def test_d1_training_v24_resizes_8_3_6():
  static = static_run(24)
  assert_bitwise(static, train(((0, 1),), 24))                    # 1 device
  assert_bitwise(static, train(((0, 8), (7, 3), (14, 6)), 24))
  assert_bitwise(static, train(((0, 8), (7, 3), (14, 6)), 24, fsdp=True))


@pytest.mark.slow
@_STATIC_8
def test_d1_across_processes_through_the_store(tmp):
  """``tenplex-jax launch``: 1 process x 4 devices, then 2 x 4 from step 10,
  the state (ZeRO-3) saved to the first generation's store and restored by
  both processes of the next: the bits of the static in-process run."""
  sched = os.path.join(tmp, "schedule.txt")
  with open(sched, "w") as f:
    f.write("step 10 procs 2\n")
  job = os.path.join(tmp, "job")
  env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "",
         "JAX_PLATFORMS": "cpu"}
  env.pop("TENPLEX_JAX_STORE_TOKEN", None)
  [r] = procs.run_all(
      [[sys.executable, "-m", "tenplex_jax", "launch", "--procs", "1",
        "--devices-per-proc", "4", "--schedule", sched, "--job-dir", job,
        "--timeout", "200", "--", sys.executable,
        os.path.join(HERE, "det_train.py"), str(det_train.STEPS), "8",
        "fsdp"]], timeout=230, env=env)
  assert r.returncode == 0, r.stdout[-5000:]
  with open(os.path.join(job, "final.json")) as f:
    final = json.load(f)
  assert final == {"procs": 2, "step": det_train.STEPS, "generation": 1,
                   "devices": 8}, final
  with np.load(os.path.join(job, "final.npz")) as z:
    got = [z[f"arr_{i}"] for i in range(len(z.files))]
  assert_bitwise(static_run(8), got)


def test_d1_holds_where_the_process_disables_most_optimizations(monkeypatch):
  """``JAX_DISABLE_MOST_OPTIMIZATIONS`` (XLA's backend optimisation level 0)
  makes 1 device's program and 8 devices' differ in the last bits; the
  steps ``det.jit`` compiles stay at level 3 and keep D1."""
  monkeypatch.setattr(sys.modules[__name__], "_STEPS_CACHE", {})
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    assert_bitwise(train(((0, 8),), 24), train(((0, 1),), 24))
    assert det.check_environment().problems[0].startswith(
        "XLA's backend optimisation level is 0")
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
  with pytest.raises(ValueError, match="xla_backend_optimization_level=0"):
    det.jit(lambda x: x, compiler_options={"xla_backend_optimization_level": 0})
  assert det.check_environment(
      xla_flags="--xla_backend_optimization_level=0", platform="cpu").problems


def test_demo_deterministic_says_bitwise_identical(capsys):
  from tenplex_jax.cli import main
  assert main(["demo", "--steps", "4", "--schedule", "0:4x2,2:1x2",
               "--deterministic", "4", "--plot", ""]) == 0
  out = capsys.readouterr().out
  assert "losses and final params are bitwise identical to the static run" in out
  assert main(["demo", "--steps", "6", "--schedule", "0:4x2,2:2x2",
               "--deterministic", "6"]) == 2
  assert "data degree 4 of the phase at step 0 must divide it" in \
      capsys.readouterr().err


# ---------------------------------------------------------- helpers, errors


def test_tree_sum_is_the_tree_of_value_and_grad():
  x = jax.random.normal(jax.random.key(3), (24, 5))
  f = det.value_and_grad(lambda w, b: jnp.mean(b @ w), virtual_workers=24,
                         mesh=mesh1d(3))
  # Per-worker gradient of mean(b @ w) is the mean row of the slice (1 row).
  _, g = f(jnp.ones(5), x)
  np.testing.assert_array_equal(np.asarray(g).view(np.uint32),
                                np.asarray(det.tree_sum(x) / 24).view(np.uint32))
  left = det.tree_sum(x[:16]) + det.tree_sum(x[16:])
  np.testing.assert_array_equal(np.asarray(det.tree_sum(x)), np.asarray(left))


def test_errors_name_the_numbers():
  with pytest.raises(UsageError, match="3 devices.*virtual_workers=8"):
    det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1d(3))
  with pytest.raises(UsageError, match="not in the mesh"):
    det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1d(2),
                       batch_axis="batch")
  with pytest.raises(UsageError, match="positive int"):
    det.value_and_grad(mlp_loss, virtual_workers=0, mesh=mesh1d(1))
  f = det.value_and_grad(mlp_loss, virtual_workers=8, mesh=mesh1d(2))
  params, batch = mlp_data(12)
  with pytest.raises(UsageError, match=r"global batch 12 .*\['x'\].*virtual_workers=8"):
    f(params, batch)
  empty = jax.tree.map(lambda x: x[:0], batch)
  with pytest.raises(UsageError, match=r"global batch 0 .*\['x'\].*"
                     "virtual_workers=8 needs a slice of at least one row"):
    f(params, empty)
  params, batch = mlp_data(16)
  g = det.value_and_grad(lambda p, b, key: mlp_loss(p, b), virtual_workers=8,
                         mesh=mesh1d(2), rng_argnums=(1,))
  with pytest.raises(UsageError, match=r"rng_argnums=\(1,\) names argument"
                     r"\(s\) \[1\], but the call passed 1 argument"):
    g(params, batch, jax.random.key(0))


def test_one_element_shards_over_the_batch_axes_are_warned_about():
  # XLA compiles an elementwise update of a one-element shard otherwise than
  # of the whole array (an adamw update of a (4,) leaf split over 4 devices
  # gave other bits than on 1 device): value_and_grad names such leaves.
  mesh = mesh1d(4)
  split = NamedSharding(mesh, P("data"))
  params = {"b": jax.device_put(jnp.ones(4), split),
            "w": jax.device_put(jnp.ones((8, 4)), split),
            "r": jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))}
  batch = jax.device_put(jnp.ones((8, 4)), split)

  def loss(p, x):
    return jnp.mean(x @ (p["b"] + p["r"])) + jnp.sum(p["w"])

  f = det.value_and_grad(loss, virtual_workers=4, mesh=mesh)
  with pytest.warns(det.SingleElementShardWarning) as w:
    f(params, batch)
  (msg,) = [str(x.message) for x in w]
  assert "1 params split over ('data',) (4 devices)" in msg, msg
  assert "params['b'] (4,) -> shards (1,)" in msg, msg
  assert "params['w']" not in msg and "params['r']" not in msg, msg
  specs = {"b": split, "w": split, "r": NamedSharding(mesh, P())}
  g = det.jit(lambda p, x: det.value_and_grad(
      loss, virtual_workers=4, mesh=mesh, param_shardings=specs)(p, x))
  with pytest.warns(det.SingleElementShardWarning,
                    match=r"params\['b'\] \(4,\) -> shards \(1,\)"):
    g(params, batch)
  # Two elements per shard: no warning (the suite turns warnings into errors).
  wide = {**params, "b": jax.device_put(jnp.ones(8), split)}
  batch8 = jax.device_put(jnp.ones((8, 8)), split)
  wide["r"] = jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))
  f(wide, batch8)


def test_check_environment_reports_gpu_flags():
  bad = det.check_environment(xla_flags="", platform="gpu")
  assert not bad.ok and len(bad.problems) == 2
  good = det.check_environment(
      xla_flags=" ".join(det.GPU_DETERMINISM_FLAGS)
      + " --xla_disable_hlo_passes=spmd-cleanup", platform="gpu")
  assert good.ok and good.spmd_cleanup_disabled
  assert not good.cpu_fusion_emitters_disabled
  cpu = det.check_environment(xla_flags="", platform="cpu")
  assert cpu.ok and not cpu.spmd_cleanup_disabled
  assert det.check_environment(
      xla_flags="--xla_cpu_use_fusion_emitters=false",
      platform="cpu").cpu_fusion_emitters_disabled
  fast = det.check_environment(xla_flags="--xla_cpu_enable_fast_math=true",
                               platform="cpu")
  assert [p.split(":")[0] for p in fast.problems] == [
      "XLA_FLAGS sets --xla_cpu_enable_fast_math=true"]
  with jax.default_matmul_precision("highest"):
    r = det.check_environment(xla_flags="", platform="cpu")
  assert r.matmul_precision == "highest" and "'highest'" in r.problems[0]


def test_compiler_options_per_platform():
  # XLA:GPU rejects xla_cpu_* compile options; CPU gets all of them.
  assert det._compiler_options("cpu") == dict(det.COMPILER_OPTIONS)
  gpu = det._compiler_options("gpu")
  assert gpu == {"xla_disable_hlo_passes": "spmd-cleanup",
                 "xla_backend_optimization_level": 2}


def test_partial_gradient_bytes():
  params, _ = mlp_data(8)
  n_params = 16 * 48 + 48 + 48 * 4
  for n, levels in ((4, 1), (1, 3), (8, 0), (2, 2)):   # log2(V/n) subtree levels
    m = det.partial_gradient_bytes(params, virtual_workers=8, devices=n)
    assert m["stack"] == levels * n_params * 4
    assert m["gathered_params"] == m["exchange"] == n_params * 4
  # V/n = 3: the per-worker exchange's flat copy and stack of chunks.
  m = det.partial_gradient_bytes(params, virtual_workers=24, devices=8)
  flat = -(-(n_params + 1) // 8) * 8 * 4
  assert m["stack"] == flat + 5 * flat // 8


def test_non_scalar_loss_is_a_usage_error_naming_the_shape():
  """A loss_fn that returns a vector is refused with the shape it returned
  (on the subtree path jax.value_and_grad's TypeError came first)."""
  mesh = mesh1d(2)
  f = det.value_and_grad(lambda p, b: b["x"] @ p["w"], virtual_workers=4,
                         mesh=mesh)
  params = {"w": jnp.ones((3,), jnp.float32)}
  batch = {"x": jnp.ones((8, 3), jnp.float32)}
  with pytest.raises(UsageError, match=re.escape(
      "loss_fn must return a scalar, got shape (2,)")):
    f(params, batch)


def test_arrays_on_devices_outside_the_mesh_are_named():
  """Params or a batch committed to other devices than the mesh's: a
  UsageError naming the leaf's path and both device sets, not jax's
  "incompatible devices" about the step's internal arguments."""
  devs = jax.devices()
  mesh = Mesh(np.array(devs[:2]), ("data",))
  other = NamedSharding(Mesh(np.array(devs[4:6]), ("data",)), P())
  f = det.value_and_grad(lambda p, b: jnp.mean((b @ p["w"]) ** 2),
                         virtual_workers=2, mesh=mesh)
  w = np.ones((4, 3), np.float32)
  x = np.ones((8, 4), np.float32)
  on_mesh = NamedSharding(mesh, P())
  with pytest.raises(UsageError, match=re.escape(
      "arrays placed on devices outside the mesh (ids [0, 1]):"
      " params['w'] is on devices [4, 5]")):
    f({"w": jax.device_put(w, other)}, jax.device_put(x, on_mesh))
  with pytest.raises(UsageError, match=re.escape(
      "batch is on devices [4, 5]")):
    f({"w": jax.device_put(w, on_mesh)}, jax.device_put(x, other))
  # uncommitted arrays and arrays on the mesh run as before
  loss, _ = f({"w": jnp.asarray(w)}, jax.device_put(x, on_mesh))
  assert np.isfinite(float(loss))
