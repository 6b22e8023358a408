"""Tenplex Fig. 2a in small: a mid-epoch resize with and without the elastic dataset state.

A Flax MLP is trained on a synthetic classification dataset (Gaussian blobs,
stored sorted by class in a structured ``.npy`` read through the byte-range
index). Three runs share the seed and the model initialisation:

* static: 4 data-parallel shards for the whole run;
* elastic: 4 shards until ``--resize-step``, then the iterator state is taken
  from the shards, the job "restarts" with 2 shards and ``set_state``;
* naive: the same resize, but the new shards restart the current epoch
  (the first part of the epoch is used twice, as in the paper's Fig. 2a).

Each step's global batch is the concatenation of the shards' parts (what
data-parallel workers hold together); the train step runs on it on one
device, so the elastic loss curve must equal the static one bit for bit.

Usage: python examples/data_resize_loss_curve.py --out results/data_loss_curve.png
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# Run from a checkout without installing: put the repository root first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tenplex_jax.data import DatasetReader, ElasticIterator, build_index


class MLP(nn.Module):
  hidden: int
  classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.classes)(x)


def make_dataset(path: str, *, num_samples: int, dim: int, classes: int, seed: int) -> None:
  """Writes blobs sorted by class as a structured .npy with fields x and y."""
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(classes, dim)).astype(np.float32) * 1.5
  y = np.sort(rng.integers(0, classes, size=num_samples)).astype(np.int32)
  x = centers[y] + rng.normal(size=(num_samples, dim)).astype(np.float32) * 3.0
  data = np.zeros(num_samples, dtype=[("x", "<f4", (dim,)), ("y", "<i4")])
  data["x"], data["y"] = x, y
  np.save(path, data)


def _global_batches(source, *, shard_count, batch, seed, state):
  """Yields global batches assembled from ``shard_count`` shard iterators."""
  its = [ElasticIterator(source, global_batch_size=batch, seed=seed, shard_index=i,
                         shard_count=shard_count, prefetch=2) for i in range(shard_count)]
  if state is not None:
    for it in its:
      it.set_state(state)
  try:
    while True:
      parts = [next(it) for it in its]
      yield {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y", "mask")}, its
  finally:
    for it in its:
      it.close()


def run(*, num_samples: int = 480, batch: int = 32, epochs: int = 4, resize_step: int | None = None,
        seed: int = 0, dim: int = 16, classes: int = 8, lr: float = 0.01,
        workdir: str | None = None) -> dict:
  """Trains the three runs; returns their per-step losses and the resize step."""
  workdir = workdir or tempfile.mkdtemp(prefix="tenplex_fig2a_")
  path = os.path.join(workdir, "blobs.npy")
  make_dataset(path, num_samples=num_samples, dim=dim, classes=classes, seed=seed)
  source = DatasetReader(build_index([path]))
  steps_per_epoch = -(-num_samples // batch)
  total = epochs * steps_per_epoch
  if resize_step is None:
    resize_step = steps_per_epoch + steps_per_epoch // 2  # mid-way through epoch 1
  if not 0 < resize_step < total or resize_step % steps_per_epoch == 0:
    raise ValueError(f"resize_step must be mid-epoch inside (0, {total}), got {resize_step}")

  model = MLP(hidden=32, classes=classes)
  tx = optax.sgd(lr, momentum=0.9)

  @jax.jit
  def train_step(params, opt_state, x, y, mask):
    def loss_fn(p):
      losses = optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y)
      return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def train(mode: str) -> list[float]:
    params = model.init(jax.random.key(seed), jnp.zeros((1, dim)))
    opt_state = tx.init(params)
    losses: list[float] = []
    schedule = [(4, resize_step), (2, total - resize_step)] if mode != "static" else [
        (4, total)]
    state = None
    for shard_count, steps in schedule:
      gen = _global_batches(source, shard_count=shard_count, batch=batch, seed=seed,
                            state=state)
      for _ in range(steps):
        b, its = next(gen)
        params, opt_state, loss = train_step(params, opt_state, b["x"], b["y"],
                                             b["mask"].astype(jnp.float32))
        losses.append(float(loss))
      state = its[0].get_state()  # what a checkpoint at the resize would hold
      gen.close()
      if mode == "naive":  # restart the current epoch from its first step
        state = {**state, "step": 0}
    return losses

  curves = {mode: train(mode) for mode in ("static", "elastic", "naive")}
  source.close()
  return {"curves": curves, "resize_step": resize_step, "steps_per_epoch": steps_per_epoch,
          "elastic_max_abs_diff": float(np.max(np.abs(
              np.subtract(curves["elastic"], curves["static"])))),
          "naive_max_abs_diff": float(np.max(np.abs(
              np.subtract(curves["naive"], curves["static"]))))}


def plot(result: dict, out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  c = result["curves"]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(c["static"], "k-", lw=2, label="static (4 shards)")
  ax.plot(c["elastic"], "g--", lw=1.2, label="elastic resize 4->2 (iterator state)")
  ax.plot(c["naive"], "r:", lw=1.5, label="naive resize 4->2 (epoch restarted)")
  ax.axvline(result["resize_step"], color="orange", label="resize")
  for e in range(1, len(c["static"]) // result["steps_per_epoch"]):
    ax.axvline(e * result["steps_per_epoch"], color="0.85", lw=0.8, zorder=0)
  ax.set_xlabel("global step")
  ax.set_ylabel("training loss (global batch)")
  ax.set_title("Dataset consistency under a mid-epoch resize (cf. Tenplex Fig. 2a)")
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="results/data_loss_curve.png")
  p.add_argument("--samples", type=int, default=480)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--epochs", type=int, default=4)
  p.add_argument("--resize-step", type=int, default=None)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  result = run(num_samples=args.samples, batch=args.batch, epochs=args.epochs,
               resize_step=args.resize_step, seed=args.seed)
  plot(result, args.out)
  print(f"resize at step {result['resize_step']} "
        f"({result['steps_per_epoch']} steps per epoch), plot: {args.out}")
  print(f"elastic vs static: max abs loss difference {result['elastic_max_abs_diff']:.3g}")
  print(f"naive   vs static: max abs loss difference {result['naive_max_abs_diff']:.3g}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
