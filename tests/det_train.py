"""The D0/D1 training job of tests/test_determinism.py, in and across processes.

As a module: a small Flax model with dropout and LayerNorm, ``optax.adamw``,
its data, the ZeRO-3 shardings and the deterministic train step, used by the
in-process tests. As a script, under ``tenplex-jax launch``:

  python tests/det_train.py STEPS V fsdp|dp

trains the same job on however many processes the launcher gives it
(``store.initialize`` / ``restore_or_init`` / ``resize_due`` /
``save_and_exit``); process 0 writes the final state's leaves to
``JOB_DIR/final.npz`` (and the job's shape to ``final.json``).
"""

import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from tenplex_jax import determinism as det


class Net(nn.Module):
  """A small Flax model with dropout (so per-worker keys matter)."""

  @nn.compact
  def __call__(self, x, *, train):
    x = nn.gelu(nn.Dense(48)(x))
    x = nn.Dropout(0.2, deterministic=not train)(x)
    x = nn.LayerNorm()(x)
    x = nn.gelu(nn.Dense(48)(x))
    return nn.Dense(8)(x)


NET = Net()
TX = optax.adamw(3e-3, weight_decay=0.01)
STEPS = 20


def net_loss(params, batch, key):
  logits = NET.apply({"params": params}, batch["x"], train=True,
                     rngs={"dropout": key})
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]).mean()


def dataset(global_batch, steps=STEPS):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps, global_batch, 12)).astype(np.float32)
  y = (np.abs(x[..., :8]).argmax(-1)).astype(np.int32)
  return x, y


def init_state():
  params = NET.init(jax.random.key(0), jnp.ones((1, 12)), train=False)["params"]
  return {"params": params, "opt": TX.init(params)}


def shardings(state, mesh, fsdp):
  """DP: everything replicated. FSDP (ZeRO-3): each param and moment split
  over ``data`` along its largest axis that the axis size divides (other
  leaves, e.g. adamw's count or an 8-wide bias on 3 devices, replicated)."""
  n = mesh.shape["data"]

  def spec(x):
    if not fsdp or not np.ndim(x):
      return P()
    shape = np.shape(x)
    for ax in sorted(range(len(shape)), key=lambda a: -shape[a]):
      if shape[ax] % n == 0:
        return P(*[("data" if a == ax else None) for a in range(len(shape))])
    return P()

  return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, spec(x)), state)


def make_step(mesh, v, param_shardings=None):
  """The train step on ``mesh`` with ``v`` virtual workers (``param_shardings``:
  passed to ``value_and_grad``, so FSDP params enter the workers as shards)."""
  grad = det.value_and_grad(net_loss, virtual_workers=v, mesh=mesh,
                            rng_argnums=(0,), param_shardings=param_shardings)

  def step(state, batch, t):
    k = jax.random.fold_in(jax.random.key(42), t)  # (seed, step)
    loss, grads = grad(state["params"], batch, k)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates),
            "opt": opt}, loss

  return det.jit(step, donate_argnums=0)


def main(argv):
  from tenplex_jax import store
  info = store.initialize()
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh
  total, v, layout = int(argv[0]), int(argv[1]), argv[2]
  mesh = Mesh(np.array(jax.devices()), ("data",))
  abstract = jax.eval_shape(init_state)
  sh = shardings(abstract, mesh, layout == "fsdp")
  target = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, sh)
  state, step = store.restore_or_init(
      lambda: jax.jit(init_state, out_shardings=sh)(), target)
  train_step = make_step(mesh, v)
  x, y = dataset(2 * v, total)
  rows = NamedSharding(mesh, P("data"))
  while step < total:
    batch = {k: jax.make_array_from_callback(a[step].shape, rows,
                                             lambda idx, a=a: a[step][idx])
             for k, a in (("x", x), ("y", y))}
    state, _ = train_step(state, batch, step)
    step += 1
    if store.resize_due(step):
      store.save_and_exit(state, step)
  leaves = multihost_utils.process_allgather(
      jax.tree_util.tree_leaves(state), tiled=True)
  if info["process_id"] == 0:
    np.savez(os.path.join(info["job_dir"], "final.npz"),
             *[np.asarray(x) for x in leaves])
    with open(os.path.join(info["job_dir"], "final.json"), "w") as f:
      json.dump({"procs": info["num_processes"], "step": step,
                 "generation": info["generation"],
                 "devices": jax.device_count()}, f)


if __name__ == "__main__":
  main(sys.argv[1:])
