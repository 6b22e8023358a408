"""A learning-rate sweep of small LMs trained as one job array (ArrayPipe's idea).

K = 8 sibling trials of one small transformer LM, each with its own learning
rate, weight decay, dropout rate, initialisation seed and data order (one
ElasticIterator per trial), are stacked on a leading ``job`` axis and
trained by one compiled program on 8 simulated CPU devices, one trial per
device. During the run:

  step --stop-at:    the 2 trials with the highest recent loss stop
                     (tenplex_jax.jobarray.remove: the 6 others stay on
                     their devices, nothing moves), and 2 new trials
                     (learning rates next to the best one's) join on the
                     freed devices (jobarray.add);
  step --resize-at:  the array moves from 8 devices to 4, two trials per
                     device (jobarray.resize, tenplex's planner: each device
                     keeps one of its trials and receives one).

Each trial's step is the user's single-job step mapped over the job axis
(``vmap_step(..., method="map", mesh=...)``). With ``--verify`` every trial
is trained again alone on one device and the largest parameter difference is
reported (see docs/jobarray.md for why an attention LM is not bit-identical
across the two programs and how large the difference is).

Outputs: a plot of every trial's loss curve (``--plot``), a JSON log
(``--log``) with each trial's settings and losses, the membership changes
with their bytes moved, and the placement search's alternatives.

  python examples/jobarray/train.py [--steps 30] [--plot loss.png] [--log log.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax import jobarray as ja  # noqa: E402
from tenplex_jax.search import transformer_spec  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=30, help="training steps of the array")
  p.add_argument("--stop-at", type=int, default=10,
                 help="step at which the 2 worst trials stop and 2 new ones join")
  p.add_argument("--resize-at", type=int, default=20,
                 help="step at which the array moves from 8 devices to 4")
  p.add_argument("--batch", type=int, default=8, help="sequences per trial per step")
  p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
  p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
  p.add_argument("--embed", type=int, default=32, help="model width")
  p.add_argument("--layers", type=int, default=1, help="transformer blocks")
  p.add_argument("--samples", type=int, default=512, help="sequences in the dataset")
  p.add_argument("--verify", action="store_true",
                 help="train every trial alone on one device and report the difference")
  p.add_argument("--plot", default="jobarray_loss.png", help="loss curve PNG")
  p.add_argument("--log", default="jobarray_log.json", help="JSON log")
  return p.parse_args(argv)


class LM(nn.Module):
  """A pre-norm decoder: embedding, blocks of causal attention + MLP, head."""

  vocab: int
  embed: int
  layers: int
  heads: int = 4

  @nn.compact
  def __call__(self, tokens, rng, keep):
    keep_prob, scale = keep
    x = nn.Embed(self.vocab, self.embed)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02),
                       (tokens.shape[-1], self.embed))
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      h = nn.LayerNorm()(x)
      # No q/k/v biases: the key bias's true gradient is exactly zero (softmax
      # ignores a per-query constant), so its computed gradient is rounding
      # noise that Adam scales up to +-lr, differently in every program.
      h = nn.SelfAttention(num_heads=self.heads, deterministic=True,
                           use_bias=False)(h, mask=mask)
      x = x + h
      h = nn.Dense(4 * self.embed)(nn.LayerNorm()(x))
      h = nn.Dense(self.embed)(nn.gelu(h))
      drop = jax.random.bernoulli(jax.random.fold_in(rng, i), keep_prob, h.shape)
      x = x + jnp.where(drop, h * scale, 0.0)   # inverted dropout, scale = 1/keep
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


TX = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.0)


def make_dataset(n, seq, vocab, seed=0):
  """Token sequences of a random sparse Markov chain (learnable, not trivial)."""
  rs = np.random.default_rng(seed)
  nxt = rs.integers(0, vocab, (vocab, 3))
  toks = np.empty((n, seq + 1), np.int32)
  toks[:, 0] = rs.integers(0, vocab, n)
  for t in range(seq):
    toks[:, t + 1] = nxt[toks[:, t], rs.integers(0, 3, n)]
  return toks


def main(argv=None):
  args = parse_args(argv)
  t_start = time.perf_counter()
  devices = jax.devices()
  model = LM(args.vocab, args.embed, args.layers)
  data = make_dataset(args.samples, args.seq, args.vocab)

  @jax.jit
  def init_jit(key, rng, lr, wd):   # one compiled program, not one per op
    params = model.init(key, jnp.zeros((1, args.seq), jnp.int32),
                        jax.random.key(0), (1.0, 1.0))["params"]
    opt = TX.init(params)
    opt.hyperparams["learning_rate"] = lr
    opt.hyperparams["weight_decay"] = wd
    return {"params": params, "opt": opt, "rng": rng}

  def init(seed, lr, wd):
    return init_jit(jax.random.key(seed), jax.random.key(10_000 + seed),
                    jnp.float32(lr), jnp.float32(wd))

  def step(state, batch, hp):
    rng, sub = jax.random.split(state["rng"])
    tokens, mask = batch["data"], batch["mask"]

    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1], sub, (hp["keep"], hp["scale"]))
      per = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      w = mask.astype(per.dtype)[:, None]
      return (per * w).sum() / (w.sum() * per.shape[1])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
             "rng": rng}, {"loss": loss})

  # ---- trials ------------------------------------------------------------
  lrs = np.geomspace(3e-4, 3e-2, 8)
  trials = []   # every trial ever started

  def new_trial(lr, start):
    k = len(trials)
    rate = 0.1 * (k % 2)
    t = {"id": k, "lr": float(lr), "weight_decay": 1e-4 * (1 + k % 3),
         "dropout": rate, "seed": k, "start": start, "stop": None, "losses": []}
    t["hp"] = {"keep": np.float32(1 - rate), "scale": np.float32(1 / (1 - rate))}
    trials.append(t)
    return t

  active = [new_trial(lr, 0) for lr in lrs]
  its = {t["id"]: ja.job_iterators(data, seeds=[t["seed"]], global_batch_size=args.batch)[0]
         for t in active}

  spec = transformer_spec(name="example-lm", layers=args.layers, hidden=args.embed,
                          heads=4, vocab=args.vocab, seq_len=args.seq)
  placement = ja.placement_search(spec, jobs=8, devices=8, batch=args.batch, seq_len=args.seq)
  print(placement.explain())

  mesh = ja.job_mesh(devices, jobs=8)
  state = ja.stack([init(t["seed"], t["lr"], t["weight_decay"]) for t in active],
                   shardings=NamedSharding(mesh, P("job")))
  events = []

  def hps(ts):
    return ja.stack([{**t["hp"], "wd": np.float32(t["weight_decay"])} for t in ts])

  def compiled(mesh):
    # ja.jit, not jax.jit: compiled so that every trial is bitwise its solo run
    return ja.jit(ja.vmap_step(step_of_job, method="map", mesh=mesh))

  def step_of_job(s, b, h):
    s["opt"].hyperparams["weight_decay"] = h["wd"]
    return step(s, b, h)

  run = compiled(mesh)
  for i in range(args.steps):
    if i == args.stop_at:
      recent = [np.mean(t["losses"][-3:]) for t in active]
      order = np.argsort(recent)
      stop = sorted(int(j) for j in order[-2:])
      for j in stop:
        active[j]["stop"] = i
      t0 = time.perf_counter()
      state, rep = ja.repack(state, [r for r in range(len(active)) if r not in stop])
      events.append({"step": i, "event": "remove", "trials": [active[j]["id"] for j in stop],
                     "moved_bytes": rep.moved_bytes, "kept_bytes": rep.kept_bytes,
                     "mesh": dict(rep.mesh_shape), "seconds": time.perf_counter() - t0})
      active = [t for j, t in enumerate(active) if j not in stop]
      best = active[int(np.argmin([np.mean(t["losses"][-3:]) for t in active]))]
      added = [new_trial(best["lr"] * f, i) for f in (0.7, 1.4)]
      t0 = time.perf_counter()
      state, rep = ja.repack(state, list(range(len(active))) + [-1, -2],
                             new_states=[init(t["seed"], t["lr"], t["weight_decay"])
                                         for t in added], devices=devices)
      events.append({"step": i, "event": "add", "trials": [t["id"] for t in added],
                     "moved_bytes": rep.moved_bytes, "added_bytes": rep.added_bytes,
                     "kept_bytes": rep.kept_bytes, "mesh": dict(rep.mesh_shape),
                     "seconds": time.perf_counter() - t0})
      for t in added:
        its[t["id"]] = ja.job_iterators(data, seeds=[t["seed"]],
                                        global_batch_size=args.batch)[0]
      active += added
      mesh = state["params"]["Embed_0"]["embedding"].sharding.mesh
      run = compiled(mesh)
      print(f"step {i}: stopped trials {events[-2]['trials']} (moved"
            f" {events[-2]['moved_bytes']} B), added {events[-1]['trials']} with lr"
            f" {[round(t['lr'], 5) for t in added]} (moved {rep.moved_bytes} B,"
            f" wrote {rep.added_bytes} B)")
    if i == args.resize_at:
      t0 = time.perf_counter()
      mesh = ja.job_mesh(devices[:4], jobs=4)
      state, rep = ja.resize(state, mesh)
      events.append({"step": i, "event": "resize 8 -> 4 devices",
                     "moved_bytes": rep.moved_bytes, "lower_bound_bytes": rep.lower_bound_bytes,
                     "mesh": dict(mesh.shape), "seconds": time.perf_counter() - t0})
      run = compiled(mesh)
      print(f"step {i}: resized onto 4 devices, moved {rep.moved_bytes} B"
            f" (lower bound {rep.lower_bound_bytes} B)")
    batch = ja.next_batches([its[t["id"]] for t in active])
    sh = NamedSharding(mesh, P("job"))
    state, metrics = run(state, jax.device_put(batch, sh), jax.device_put(hps(active), sh))
    for t, loss in zip(active, np.asarray(metrics["loss"]).tolist()):
      t["losses"].append(loss)
  array_seconds = time.perf_counter() - t_start

  final = ja.unstack(state)
  verify = {}
  if args.verify:
    # compiled as ja.jit compiles the array's step (its passes and its XLA
    # optimisation level, whatever the process's own settings)
    solo = ja.jit(step_of_job)
    for t, s_arr in zip(active, final):
      s = jax.device_put(init(t["seed"], t["lr"], t["weight_decay"]), devices[0])
      it = ja.job_iterators(data, seeds=[t["seed"]], global_batch_size=args.batch)[0]
      h = {**t["hp"], "wd": np.float32(t["weight_decay"])}
      for _ in range(len(t["losses"])):
        s, _ = solo(s, next(it), h)
      diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(s["params"]), jax.tree.leaves(s_arr["params"])))
      verify[t["id"]] = diff
    print("max |array - solo| of each trial's parameters:",
          {k: f"{v:.2e}" for k, v in verify.items()})

  # ---- outputs -------------------------------------------------------------
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5))
  cmap = plt.get_cmap("viridis")
  for t in trials:
    xs = np.arange(t["start"], t["start"] + len(t["losses"]))
    style = "--" if t["stop"] is not None else "-"
    label = f"trial {t['id']} lr={t['lr']:.1e}" + (" (stopped)" if t["stop"] else "")
    ax.plot(xs, t["losses"], style, color=cmap(np.log(t["lr"] / 3e-4) / np.log(100)),
            label=label)
  ax.axvline(args.stop_at, color="gray", lw=0.8)
  ax.text(args.stop_at, ax.get_ylim()[1], " 2 stopped, 2 added", va="top", fontsize=8)
  ax.axvline(args.resize_at, color="gray", lw=0.8)
  ax.text(args.resize_at, ax.get_ylim()[1], " 8 -> 4 devices", va="top", fontsize=8)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(f"LR sweep as one job array ({len(trials)} trials, 8 CPU devices)")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(args.plot, dpi=120)
  log = {"args": vars(args), "seconds": array_seconds,
         "trials": [{k: v for k, v in t.items() if k != "hp"} for t in trials],
         "events": events, "verify_max_abs_diff": verify,
         "placement": placement.to_json()}
  pathlib.Path(args.log).write_text(json.dumps(log, indent=1))
  best = min((t for t in trials if t["stop"] is None), key=lambda t: t["losses"][-1])
  print(f"best trial {best['id']} lr={best['lr']:.2e} final loss {best['losses'][-1]:.4f};"
        f" {len(trials)} trials, {args.steps} steps in {array_seconds:.1f} s;"
        f" plot {args.plot}, log {args.log}")
  return log


if __name__ == "__main__":
  main()
