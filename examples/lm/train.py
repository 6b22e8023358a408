"""Train a decoder-only LM while the job is resized, and compare with a static run.

The model (``model.py``) stacks its blocks on a ``layers`` axis and runs them
as a GPipe pipeline over the mesh's ``stage`` axis (``tenplex_jax.pipeline``);
the other parameters are sharded over ``data``/``fsdp``/``tensor`` through
logical axis rules. At each step of the schedule the job moves to another
device set and other degrees in this process: ``tenplex_jax.remesh`` moves the
train state (changing the stage count regroups layers per stage, which is a
resharding of the ``layers`` axis), the data iterator continues from its
state, and the step is recompiled for the new mesh. Then the same number of
steps runs on the first phase's layout without resizes, and the losses are
compared: the global batches do not depend on the device count
(``tenplex_jax.data.ElasticIterator``), so the curves agree up to the order
of float reductions.

  python examples/lm/train.py                       # 8 -> 4 -> 2 -> 8 devices
  python examples/lm/train.py --search --schedule "0:8 8:4 16:2 24:8"
  python examples/lm/train.py --json lm.json --plot lm.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)

import dataclasses  # noqa: E402
import functools  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import config as configs  # noqa: E402
import tenplex_jax as tj  # noqa: E402
from model import LM, RULES, abstract_params, make_mesh  # noqa: E402
from tenplex_jax.data import ElasticIterator  # noqa: E402


def dataset(cfg, n=1024, seed=0):
  """The synthetic token sequences (``data.py``), written once as ArrayRecord
  files and read back through the dataset index: a random-access source of
  ``{"tokens": (seq_len + 1,) int32}`` samples for ``ElasticIterator``."""
  import data as lm_data
  return lm_data.source(cfg, n=n, seed=seed)


def layout(phase, cfg, devices, *, search, global_batch):
  """(mesh, rules, microbatches) for a phase."""
  devs = devices[:phase.devices]
  if search:
    best = tj.search.best_mesh_for(abstract_params(cfg), devs, global_batch=global_batch,
                                   seq_len=cfg.seq_len)
    names = tuple("stage" if a == "pipeline" else a for a in best.mesh.axis_names)
    mesh = Mesh(best.mesh.devices, names)
    rules = tuple((k, "stage" if v == "pipeline" else v) for k, v in best.rules)
    return mesh, rules, best.candidate.microbatches
  degrees = dict(phase.degrees) if phase.degrees is not None else {"data": phase.devices}
  mb = phase.microbatches or cfg.microbatches
  return make_mesh(devs, **degrees), RULES, mb


@functools.cache
def _model_and_tx(cfg, lr):
  # One instance each, so states of the elastic and the static run have the
  # same pytree metadata and share compiled steps.
  return LM(cfg), optax.adam(lr)


def create_state(cfg, mesh, rules, lr):
  model, tx = _model_and_tx(cfg, lr)

  def init(key):
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  abstract = jax.eval_shape(init, jax.random.key(configs.SEED))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  return jax.jit(init, out_shardings=shardings)(jax.random.key(configs.SEED))


def make_step(cfg, mesh, microbatches):
  """The jitted train step for a mesh: the pipeline runs over its stage axis."""
  model = LM(dataclasses.replace(cfg, microbatches=microbatches), mesh)

  def step(state, tokens, mask):
    def loss_fn(params):
      logits = model.apply({"params": params}, tokens[:, :-1])
      per_seq = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(-1)
      return (per_seq * mask).sum() / mask.sum()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return jax.jit(step, donate_argnums=0)


def batches(source, mesh, data_state, global_batch):
  """The global batch: each data shard's part read by its own iterator."""
  n = mesh.shape["data"] * mesh.shape["fsdp"]
  its = [ElasticIterator(source, global_batch_size=global_batch, seed=configs.SEED,
                         shard_index=i, shard_count=n, prefetch=0) for i in range(n)]
  if data_state is not None:
    for it in its:
      it.set_state(data_state)
  parts = [next(it) for it in its]
  new_state = its[0].get_state()
  tokens = np.concatenate([p["tokens"] for p in parts])
  mask = np.concatenate([p["mask"] for p in parts]).astype(np.float32)
  spec = NamedSharding(mesh, P(("data", "fsdp")))
  return jax.device_put(tokens, spec), jax.device_put(mask, spec), new_state


# Compiled train steps by (config, mesh, rules, microbatches): the static run
# reuses the elastic run's first-phase executable.
_COMPILED = {}


def degrees_of(mesh):
  return {a: int(mesh.shape[a]) for a in ("data", "fsdp", "tensor", "stage")}


def train(phases, steps, cfg, *, search=False, global_batch=configs.GLOBAL_BATCH,
          lr=configs.LEARNING_RATE, log=print, devices=None):
  """Runs ``steps`` steps through ``phases``; returns one record per step."""
  devices = list(devices or jax.devices())
  source = dataset(cfg)
  starts = {p.step: p for p in phases}
  mesh, rules, mb = layout(phases[0], cfg, devices, search=search, global_batch=global_batch)
  state = create_state(cfg, mesh, rules, lr)
  data_state, records = None, []
  for t in range(steps):
    rec = {"step": t, "reconfig_s": 0.0, "reconfig_bytes": 0, "compile_s": 0.0}
    if t in starts and t > 0:
      old = degrees_of(mesh)
      mesh, rules, mb = layout(starts[t], cfg, devices, search=search,
                               global_batch=global_batch)
      state, report = tj.remesh(state, mesh, rules=rules)
      jax.block_until_ready(state)
      rec["reconfig_s"] = report.seconds["total"]
      rec["reconfig_bytes"] = int(report.moved_bytes)
      rec["resized_from"] = old
      log(f"step {t}: {old} -> {degrees_of(mesh)} (microbatches {mb}): {report}")
    tokens, mask, data_state = batches(source, mesh, data_state, global_batch)
    key = (cfg, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat), rules, mb)
    if key not in _COMPILED:
      t0 = time.perf_counter()
      _COMPILED[key] = make_step(cfg, mesh, mb).lower(state, tokens, mask).compile()
      rec["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, loss = _COMPILED[key](state, tokens, mask)
    loss = float(loss)
    rec.update(loss=loss, step_s=time.perf_counter() - t0, devices=int(mesh.devices.size),
               mesh=degrees_of(mesh), microbatches=mb)
    records.append(rec)
    log(f"step {t:3d}  devices {mesh.devices.size}  {degrees_of(mesh)} mb {mb}"
        f"  loss {loss:.4f}  step {rec['step_s'] * 1e3:.1f} ms")
  return records


def plot(elastic, static, path):
  """Loss against step, elastic and static; resizes marked with their times."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  ax.plot([r["step"] for r in static], [r["loss"] for r in static], "-", color="0.6", lw=3,
          label="static (no resize)")
  ax.plot([r["step"] for r in elastic], [r["loss"] for r in elastic], "o-", ms=3, color="C0",
          label="elastic (resized)")
  top = max(r["loss"] for r in elastic)
  for r in elastic:
    if "resized_from" in r:
      ax.axvline(r["step"] - 0.5, color="C3", ls="--", lw=1)
      m = r["mesh"]
      ax.annotate(f"{r['devices']} dev  d{m['data']} f{m['fsdp']} t{m['tensor']} s{m['stage']}\n"
                  f"reconf {r['reconfig_s'] * 1e3:.0f} ms, {r['reconfig_bytes'] / 2**10:.0f} KiB",
                  (r["step"] - 0.3, top), fontsize=7, va="top", color="C3")
  diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(elastic, static))
  ax.text(0.55, 0.03, f"max |elastic - static| = {diff:.1e}", transform=ax.transAxes,
          ha="center", va="bottom", fontsize=8)
  m = elastic[0]["mesh"]
  ax.set_title(f"LM loss while resizing (start: {elastic[0]['devices']} dev d{m['data']}"
               f" f{m['fsdp']} t{m['tensor']} s{m['stage']})")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.legend(loc="lower left", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--schedule", default=configs.DEFAULT_SCHEDULE,
                  help="resize schedule: phases STEP:AXIS=N,... (axes data, fsdp, tensor, stage;"
                  " mb=N microbatches) or STEP:DEVICES, separated by spaces or ';'."
                  f" Default: {configs.DEFAULT_SCHEDULE!r}")
  ap.add_argument("--steps", type=int, default=32, help="training steps (default 32)")
  ap.add_argument("--search", action="store_true",
                  help="let tenplex_jax.search choose (data, fsdp, tensor, stage) and the"
                  " microbatch count for each phase's device count")
  ap.add_argument("--json", metavar="PATH",
                  help="write the per-step log (loss, devices, mesh degrees, step time,"
                  " reconfiguration time and bytes) of both runs as JSON")
  ap.add_argument("--plot", metavar="PATH", help="save the loss curves (PNG) here")
  ap.add_argument("--config", choices=sorted(configs.CONFIGS), default="tiny",
                  help="model size (default tiny)")
  ap.add_argument("--remat", action="store_true", help="recompute layer activations in backward")
  args = ap.parse_args(argv)
  cfg = dataclasses.replace(configs.CONFIGS[args.config], remat=args.remat)
  phases = configs.parse(args.schedule)
  need = max(p.devices for p in phases)
  if need > len(jax.devices()):
    ap.error(f"the schedule needs {need} devices, {len(jax.devices())} available")
  elastic = train(phases, args.steps, cfg, search=args.search)
  static = train(phases[:1], args.steps, cfg, search=args.search, log=lambda *_: None)
  diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(elastic, static))
  resizes = [r for r in elastic if "resized_from" in r]
  print(f"final loss {elastic[-1]['loss']:.4f} (first {elastic[0]['loss']:.4f});"
        f" {len(resizes)} resizes, reconfiguration"
        f" {sum(r['reconfig_s'] for r in resizes) * 1e3:.0f} ms in total;"
        f" max |elastic - static| = {diff:.2e}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": dataclasses.asdict(cfg), "schedule": args.schedule,
                 "search": args.search, "elastic": elastic, "static": static,
                 "max_abs_loss_diff": diff}, f, indent=1)
  if args.plot:
    plot(elastic, static, args.plot)
  return diff


if __name__ == "__main__":
  main()
