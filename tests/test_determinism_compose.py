"""Elastic determinism composed with what trainers use (issue 23, item 2).

Clipping by the global norm, gradient accumulation, dropout, FSDP, tensor
axes and pipeline stages, each compared on raw bits with the static run at
every step (float32 viewed as uint32, never allclose).
"""

import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax import demo
from tenplex_jax import determinism as det

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import det_train  # noqa: E402
import procs  # noqa: E402

V = 8
ACCUM = 2          # microbatches accumulated per step
ROWS = 2 * V       # rows of one microbatch (2 per virtual worker)
STEPS = 12
MAX_NORM = 0.05    # below the gradients' norm: the clip scales every step
TX = optax.chain(det.clip_by_global_norm(MAX_NORM),
                 optax.adamw(3e-3, weight_decay=0.01))


def bits(tree):
  return [np.asarray(x).view(np.uint32) for x in jax.tree_util.tree_leaves(tree)]


def assert_bitwise(a, b, what=""):
  la, lb = bits(a), bits(b)
  assert len(la) == len(lb)
  for i, (x, y) in enumerate(zip(la, lb)):
    assert (x == y).all(), f"{what}: leaf {i} differs in {(x != y).sum()} elements"


def mesh1d(n):
  return Mesh(np.array(jax.devices()[:n]), ("data",))


_STEPS = {}


def step_for(mesh, shardings):
  """Clip + adamw step with ``ACCUM`` accumulated microbatches and dropout."""
  key = (tuple(d.id for d in mesh.devices.flat),
         tuple(str(s.spec) for s in jax.tree_util.tree_leaves(shardings)))
  if key in _STEPS:
    return _STEPS[key]
  grad = det.value_and_grad(det_train.net_loss, virtual_workers=V, mesh=mesh,
                            rng_argnums=(0,))

  def step(state, batch, t):
    k = jax.random.fold_in(jax.random.key(42), t)   # (seed, step)

    def micro(acc, xs):
      i, mb = xs
      loss, g = grad(state["params"], mb, jax.random.fold_in(k, i))
      return jax.tree.map(jnp.add, acc, (loss, g)), None

    zero = jax.tree.map(jnp.zeros_like, (jnp.float32(0), state["params"]))
    (loss, grads), _ = jax.lax.scan(micro, zero, (jnp.arange(ACCUM), batch))
    loss, grads = jax.tree.map(lambda x: x / ACCUM, (loss, grads))
    grads = det.on_shards(grads, shardings["params"])
    norm = det.global_norm(grads)

    def update(state, grads):
      updates, opt = TX.update(grads, state["opt"], state["params"])
      return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    return det.unfused(update, state, grads), (loss, norm)

  _STEPS[key] = det.jit(step, donate_argnums=0)
  return _STEPS[key]


def data():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(STEPS, ACCUM, ROWS, 12)).astype(np.float32)
  y = np.abs(x[..., :8]).argmax(-1).astype(np.int32)
  return x, y


def train(schedule, fsdp, store_dir=None):
  """Per-step (loss, norm, state bits); ``schedule`` ((first step, devices), ...)."""
  x, y = data()
  starts = dict(schedule)
  state = {"params": det_train.init_state()["params"]}
  state["opt"] = TX.init(state["params"])
  mesh, out = None, []
  for t in range(STEPS):
    if t in starts:
      new = mesh1d(starts[t])
      target = det_train.shardings(state, new, fsdp)
      if mesh is None:
        state = tj.reshard(state, target)
      elif store_dir is not None:
        tj.store.save(state, str(store_dir / str(t)), step=t)
        state = tj.store.restore(str(store_dir / str(t)), jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state, target))
      else:
        state, _ = tj.remesh(state, shardings=target)
      mesh = new
    # (ACCUM, ROWS, ...): the rows of each microbatch split over data.
    batch = jax.device_put({"x": x[t], "y": y[t]},
                           NamedSharding(mesh, P(None, "data")))
    state, (loss, norm) = step_for(mesh, target)(state, batch, t)
    out.append((float(loss), bits(norm), bits(state)))
  return out


@pytest.fixture(scope="module")
def static():
  return train(((0, 8),), fsdp=False)


# The tests against the static run above, on one xdist worker: it (and its
# compiled 8-device step) is made once.
_STATIC = pytest.mark.xdist_group("compose_static")


@_STATIC
def test_static_run_clips_every_step(static):
  # The clip is active: the norm exceeds MAX_NORM at every step; and the
  # fixed-tree norm is the norm (up to rounding) of optax's.
  assert all(np.asarray(n[0]).view(np.float32) > MAX_NORM for _, n, _ in static)
  g = {"a": jax.random.normal(jax.random.key(0), (1001, 7)),
       "b": jnp.ones((3,), jnp.bfloat16)}
  np.testing.assert_allclose(det.global_norm(g), optax.tree.norm(g), rtol=1e-6)


@_STATIC
@pytest.mark.parametrize("fsdp", [False, True])
def test_clip_accumulation_dropout_bitwise_every_step_8_4_2_8(static, fsdp, tmp_path):
  """ZeRO-3 state: every resize changes the shard shapes of the params, of
  adamw's moments and of the gradients whose norm is taken; the 4 -> 2
  resize goes through the host store."""
  got = train(((0, 8), (3, 4), (6, 2), (9, 8)), fsdp=fsdp,
              store_dir=tmp_path if fsdp else None)
  for t, (a, b) in enumerate(zip(static, got)):
    assert a[0] == b[0], f"step {t}: loss {a[0]} != {b[0]}"
    assert_bitwise(a[1], b[1], f"step {t} norm")
    assert_bitwise(a[2], b[2], f"step {t} state")


@_STATIC
def test_one_device_bitwise_every_step(static):
  got = train(((0, 1),), fsdp=False)
  for t, (a, b) in enumerate(zip(static, got)):
    assert_bitwise(a[2], b[2], f"step {t} state")


# ------------------------------------------------ pipeline stages, tensor


L, D, H = 8, 32, 64


def layer(p, h):
  return h + jax.nn.gelu(h @ p["a"]) @ p["b"]


def pipeline_step(shape, v=8, param_shardings=False, fsdp_leaf=False):
  """The jitted deterministic step of a pipelined residual MLP stack on a
  (data, stage, tensor) mesh (layers split over stage, the hidden dim over
  tensor) and its arguments. With ``param_shardings`` ``value_and_grad``
  is told the params' shardings and the step puts the grads on them
  (``on_shards``), as a trainer's step does. With ``fsdp_leaf`` an input
  projection ``w`` before the stages is split over ``data`` alone, the
  batch axis (an FSDP leaf)."""
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
              ("data", "stage", "tensor"))
  k = jax.random.split(jax.random.key(0), 3)
  params = {"a": jax.random.normal(k[0], (L, D, H)) / 6,
            "b": jax.random.normal(k[1], (L, H, D)) / 8}
  specs = {"a": P("stage", None, "tensor"), "b": P("stage", "tensor")}
  if fsdp_leaf:
    params["w"] = jax.random.normal(jax.random.key(1), (D, D)) / 6
    specs["w"] = P("data", None)
  x = jax.random.normal(k[2], (4 * v, 15, D))

  def loss(p, xb):
    if fsdp_leaf:
      xb = xb @ p["w"]
    stack = {"a": p["a"], "b": p["b"]}
    return jnp.mean(tj.pipeline(layer, stack, xb, mesh=mesh, microbatches=2) ** 2)

  shardings = {n: NamedSharding(mesh, s) for n, s in specs.items()}
  f = det.value_and_grad(loss, virtual_workers=v, mesh=mesh,
                         pipeline_axis="stage",
                         param_shardings=shardings if param_shardings else None)
  if param_shardings:
    step = det.jit(lambda p, xb: (lambda loss, g: (
        loss, det.on_shards(g, shardings)))(*f(p, xb)))
  else:
    step = det.jit(f)
  ps = {n: jax.device_put(a, shardings[n]) for n, a in params.items()}
  return step, (ps, jax.device_put(x, NamedSharding(mesh, P("data"))))


def pipeline_grads(shape, v=8, **kwargs):
  """Loss and grads of :func:`pipeline_step`."""
  f, args = pipeline_step(shape, v, **kwargs)
  return f(*args)


_PIPELINE_REF = {}


def pipeline_ref():
  """The 1-device run's loss and grads (:func:`pipeline_grads` on (1, 1, 1)),
  computed once for the tests that compare with it: both on one xdist
  worker (``_PIPELINE``)."""
  if not _PIPELINE_REF:
    _PIPELINE_REF["ref"] = pipeline_grads((1, 1, 1))
  return _PIPELINE_REF["ref"]


_PIPELINE = pytest.mark.xdist_group("compose_pipeline")


@_PIPELINE
def test_pipeline_stages_and_tensor_bitwise():
  # (2, 2, 2): test_pipeline_top_by_permutes_is_ordered_and_bitwise.
  ref = pipeline_ref()
  for shape in [(1, 4, 2), (2, 4, 1), (4, 2, 1), (8, 1, 1), (2, 1, 2)]:
    assert_bitwise(ref, pipeline_grads(shape), f"mesh {shape}")


_COLLECTIVE = re.compile(
    r"\s*(?:ROOT\s+)?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* (?:all-gather|all-to-all"
    r"|all-reduce|reduce-scatter|collective-permute)(?:-start)?\(")


def entry_collective_sizes(text):
  """``(name, elements)`` of the collectives of an HLO module's entry
  computation (not those in loops, branches or fusions)."""
  lines = text[text.index("\nENTRY"):].splitlines()[2:]
  out = []
  for line in lines[:lines.index("}")]:
    m = _COLLECTIVE.match(line)
    if m:
      out.append((m.group(1), math.prod(int(d) for d in m.group(2).split(",") if d)))
  return out


@_PIPELINE
def test_pipeline_grads_with_param_shardings_stay_on_their_stages():
  """With ``param_shardings`` the exchange of a leaf split over ``stage``
  runs on each stage's layers: no collective of the compiled step's entry
  computation (the exchange and the gathers around it; the pipeline's own
  are in its loops) produces more than a stage's share of a stacked
  gradient (before: an all-gather over ``stage`` of the whole stack, each
  stage taking chunks of all the layers, and the whole stack on every
  device after the all-gather over ``data``). The grads have the 1-device
  run's bits."""
  ref = pipeline_ref()
  for shape in [(2, 2, 2), (1, 4, 2), (4, 2, 1)]:
    f, args = pipeline_step(shape, param_shardings=True)
    compiled = f.lower(*args).compile()
    share = L * D * H // shape[1]
    sizes = entry_collective_sizes(compiled.as_text())
    assert sizes and all(size <= share for _, size in sizes), (shape, sizes)
    assert_bitwise(ref, compiled(*args), f"mesh {shape}")


# Run in a process of its own: a deadlock of the step's collectives would
# block the devices' threads until XLA:CPU aborts the process.
_PERMUTES_UNDER_PIPELINE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, sys.argv[1])
import numpy as np
import hlo_order
import test_determinism_compose as t
res = {}
for name, kw in [("plain", {}),
                 ("fsdp", {"param_shardings": True, "fsdp_leaf": True})]:
  ref = t.pipeline_grads((1, 1, 1), **kw)
  f, args = t.pipeline_step((2, 2, 2), **kw)
  compiled = f.lower(*args).compile()
  m = hlo_order.Module(compiled.as_text())
  out = compiled(*args)
  res[name] = {
      "entry_permutes": sum(op.opcode == "collective-permute"
                            for op in m.collective_ops()),
      "region_pairs": [[c, a.name, b.name] for c, a, b in m.region_pairs()],
      "bitwise": all(np.array_equal(np.asarray(a).view(np.uint32),
                                    np.asarray(b).view(np.uint32))
                     for a, b in zip(jax.tree_util.tree_leaves(ref),
                                     jax.tree_util.tree_leaves(out)))}
print(json.dumps(res))
"""


def test_pipeline_top_by_permutes_is_ordered_and_bitwise():
  """Under a ``pipeline_axis`` the top of the tree exchanges the subtree sums
  by collective permutes (in the compiled step's entry computation, not the
  pipeline's loops), no conditional or loop that holds collectives is left
  unordered against another collective (``hlo_order.region_pairs``: the
  branches of the top once resharded the own chunk over ``stage`` inside
  them, and on this (data, stage, tensor) = (2, 2, 2) mesh the two halves
  of ``data`` then waited in two different collectives until XLA:CPU
  aborted), and the step has the 1-device run's bits. The same with
  ``param_shardings`` and an FSDP leaf (split over ``data``, the batch
  axis, alone): its gradient is gathered under a ``pipeline_axis`` (its top
  in a conditional, as without one, was unordered against the all-gathers).
  In a subprocess with a timeout, so that a deadlock fails the test instead
  of hanging it."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.dirname(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
  (r,) = procs.run_all([[sys.executable, "-c", _PERMUTES_UNDER_PIPELINE, HERE]],
                       timeout=300, env=env)
  assert r.returncode == 0, r.stdout[-3000:]
  for name, res in json.loads(r.stdout.strip().splitlines()[-1]).items():
    assert res["entry_permutes"] >= 2, (name, res)  # (a's and b's, n - 1 = 1 each)
    assert res["region_pairs"] == [], (name, res)
    assert res["bitwise"], (name, res)


def test_pipeline_axis_errors():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "stage"))
  with pytest.raises(tj.errors.UsageError, match="'pipe' not in the mesh"):
    det.value_and_grad(lambda p, b: 0.0, virtual_workers=4, mesh=mesh,
                       pipeline_axis="pipe")
  with pytest.raises(tj.errors.UsageError, match="also a batch axis"):
    det.value_and_grad(lambda p, b: 0.0, virtual_workers=4, mesh=mesh,
                       batch_axis=("data", "stage"), pipeline_axis="stage")


# ------------------------------------------------ the LM trainer


# The LM trainer's deterministic steps on the demo's meshes, compiled once for
# both tests on one xdist worker (the trainer's compiled-step cache): the
# trainer test passes the demo's compiler options, which the deterministic
# step drops (optimisation level 0 would change its bits) but which are part
# of the cache's key.
_LM_DET8 = pytest.mark.xdist_group("lm_deterministic_8")


@pytest.mark.slow
@_LM_DET8
def test_lm_trainer_deterministic_8_4_2_8_stages_2_2_1_2():
  """examples/lm's --deterministic 8 over 8 -> 4 -> 2 -> 8 devices (stages
  2, 2, 1, 2; tensor 2, 1, 2, 2; fsdp at 4): the static run's losses at
  every step and its final params, bit for bit."""
  lm = demo.load_lm_trainer()
  phases = lm.configs.parse("0:data=2,tensor=2,stage=2 2:fsdp=2,stage=2"
                            " 4:tensor=2 6:data=2,tensor=2,stage=2")
  opts = {"xla_backend_optimization_level": 0}  # the demo's (see above)
  el, st = {}, {}
  a = lm.train(phases, 8, lm.configs.TINY, log=lambda *_: None,
               deterministic=8, compiler_options=opts, final=el)
  b = lm.train(phases[:1], 8, lm.configs.TINY, log=lambda *_: None,
               deterministic=8, compiler_options=opts, final=st)
  assert [r["mesh"]["stage"] for r in a[::2]] == [2, 2, 1, 2]
  assert [r["loss"] for r in a] == [r["loss"] for r in b]
  assert_bitwise(el["params"], st["params"], "final params")


@pytest.mark.slow
@_LM_DET8
def test_demo_deterministic_8_default_pipelined_schedule(capsys):
  """``tenplex-jax demo --deterministic 8`` with its default phases (stages
  2, 2, 1, 2) is no longer refused and prints the bitwise line."""
  from tenplex_jax.cli import main
  assert main(["demo", "--steps", "20", "--deterministic", "8", "--plot", ""]) == 0
  out = capsys.readouterr().out
  assert "step 0: 8 devices (data 2 x tensor 2 x stage 2)" in out, out[:2000]
  assert ("deterministic (8 virtual workers): losses and final params are bitwise"
          " identical to the static run") in out
