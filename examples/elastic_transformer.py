"""Elastic training of a small transformer with Flax linen and tenplex_jax.

The model stacks its layers on a leading 'layers' axis (so the pipeline-stage
degree is a mesh axis over that dimension), partitions attention heads and
the MLP over 'tensor', and the embedding dimension over 'fsdp'. During
training the job moves between device sets and layouts:

  step 0: 8 devices  data 2 x fsdp 2 x tensor 2
  step 6: 4 devices  fsdp 4
  step 12: 2 devices  tensor 2
  step 18: 8 devices  stage 2 x tensor 2 x data 2

Batches come from ElasticIterator, whose global batches do not depend on the
device count, so the loss follows the run that never resized.

  python examples/elastic_transformer.py [--steps 24]
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import tenplex_jax as tj  # noqa: E402
from tenplex_jax.data import ElasticIterator  # noqa: E402

AXES = ("stage", "data", "fsdp", "tensor")
RULES = (("layers", "stage"), ("batch", ("data", "fsdp")), ("embed", "fsdp"),
         ("heads", "tensor"), ("mlp", "tensor"), ("vocab", None),
         ("head_dim", None))
VOCAB, SEQ, EMBED, HEADS, LAYERS = 64, 16, 32, 4, 4


def part(init, names):
  return nn.with_logical_partitioning(init, names)


class Transformer(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    hd = EMBED // HEADS
    init = nn.initializers.normal(0.02)
    emb = self.param("embed", part(init, ("vocab", "embed")), (VOCAB, EMBED))
    qkv = self.param("qkv", part(init, ("layers", "embed", "heads",
                                        "head_dim")), (LAYERS, EMBED, 3 * HEADS,
                                                       hd))
    out = self.param("out", part(init, ("layers", "heads", "head_dim",
                                        "embed")), (LAYERS, HEADS, hd, EMBED))
    w1 = self.param("mlp_in", part(init, ("layers", "embed", "mlp")),
                    (LAYERS, EMBED, 4 * EMBED))
    w2 = self.param("mlp_out", part(init, ("layers", "mlp", "embed")),
                    (LAYERS, 4 * EMBED, EMBED))
    scale = self.param("norm", part(nn.initializers.ones, ("layers", "embed")),
                       (LAYERS, EMBED))
    x = emb[tokens]
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))

    def layer(x, p):
      qkv_l, out_l, w1_l, w2_l, s = p
      h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * s
      q, k, v = jnp.split(jnp.einsum("bse,ehd->bshd", h, qkv_l), 3, axis=2)
      att = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(hd)
      att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1)
      x = x + jnp.einsum("bhst,bthd,hde->bse", att, v, out_l)
      x = x + jax.nn.gelu(x @ w1_l) @ w2_l
      return x, None

    x, _ = jax.lax.scan(layer, x, (qkv, out, w1, w2, scale))
    return x @ emb.T


def dataset(n=512, seed=0):
  """Token sequences with a learnable rule: next = (3 * t + 1) mod VOCAB."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, n)
  seqs = [(start[i] * 3 ** np.arange(SEQ + 1) + (3 ** np.arange(SEQ + 1) - 1)
           // 2) % VOCAB for i in range(n)]
  return [{"tokens": s.astype(np.int32)} for s in seqs]


def mesh_of(devices, **sizes):
  shape = [sizes.get(a, 1) for a in AXES]
  return Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), AXES)


def create(mesh, lr=3e-3):
  model = Transformer()

  def init(key):
    params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(lr))

  abstract = jax.eval_shape(init, jax.random.key(0))
  sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
  return jax.jit(init, out_shardings=sh)(jax.random.key(0))


@jax.jit
def step(state, tokens):
  def loss_fn(p):
    logits = state.apply_fn({"params": p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  loss, g = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=g), loss


def train(schedule, steps, global_batch=16, log=print):
  devs = jax.devices()
  source = dataset()
  mesh = mesh_of(devs, **schedule[0][1])
  state = create(mesh)
  data_state, losses = None, []
  phases = dict(schedule)
  for t in range(steps):
    if t in phases and t > 0:
      mesh = mesh_of(devs, **phases[t])
      state, report = tj.remesh(state, mesh, rules=RULES)
      log(f"step {t}: {report}")
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    its = [ElasticIterator(source, global_batch_size=global_batch, seed=0,
                           shard_index=i, shard_count=n, prefetch=0)
           for i in range(n)]
    for it in its:
      if data_state is not None:
        it.set_state(data_state)
    tokens = np.concatenate([next(it)["tokens"] for it in its])
    data_state = its[0].get_state()
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
    state, loss = step(state, tokens)
    losses.append(float(loss))
    if t % 3 == 0:
      log(f"step {t:3d}  mesh {dict(mesh.shape)}  loss {losses[-1]:.4f}")
  return losses


SCHEDULE = ((0, {"data": 2, "fsdp": 2, "tensor": 2}), (6, {"fsdp": 4}),
            (12, {"tensor": 2}), (18, {"stage": 2, "tensor": 2, "data": 2}))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=24)
  args = ap.parse_args()
  elastic = train(SCHEDULE, args.steps)
  static = train(SCHEDULE[:1], args.steps, log=lambda *_: None)
  diff = max(abs(a - b) for a, b in zip(elastic, static))
  print(f"final loss {elastic[-1]:.4f} (first {elastic[0]:.4f});"
        f" max |elastic - static| = {diff:.2e}")


if __name__ == "__main__":
  main()
