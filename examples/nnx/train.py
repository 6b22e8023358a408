"""Train an nnx LM while the job is resized, and compare with a static run.

The model (``model.py``) is a Flax nnx decoder whose parameters carry logical
names (``nnx.with_partitioning``) and whose blocks are stacked on a ``layers``
axis by ``nnx.vmap``; the stack runs as a GPipe pipeline over the mesh's
``stage`` axis (``tenplex_jax.pipeline``). The train state is what flax's
performance guide jits: ``graphdef, state = nnx.split((model, optimizer))``
with an ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)``; the step
merges, takes ``nnx.value_and_grad`` and ``optimizer.update``, and returns
``nnx.state((model, optimizer))``.

At each phase of the schedule the job moves to another device set and other
(data, fsdp, tensor, stage) degrees in this process: ``tenplex_jax.remesh``
moves the whole ``nnx.State`` (params and the optimizer's moments and step)
onto the shardings its variables' names give under the rules (the
configuration search's rules and mesh with ``--search``); the data iterator
continues from its state and the step is compiled for the new mesh. Then the
same number of steps runs on the first phase's layout without resizes, and
the losses are compared: the global batches do not depend on the device
count (``tenplex_jax.data.ElasticIterator``), so the curves agree up to the
order of float reductions. With ``--deterministic V`` they agree bit for bit
(``tenplex_jax.determinism``, V virtual workers, each worker's slice through
the pipeline over ``stage``; see :func:`make_step`) when every phase's
data x fsdp degree divides V, whatever its tensor and stage degrees.

  python examples/nnx/train.py                       # 8 -> 4 -> 2 -> 8 devices
  python examples/nnx/train.py --search --schedule "0:8 8:4 16:2 24:8"
  python examples/nnx/train.py --json nnx.json --plot nnx.png
  python examples/nnx/train.py --procs 2,2,1,2      # the same, across processes
  python examples/nnx/train.py --deterministic 8    # bitwise the static run

With ``--procs P1,P2,...`` (one process count per phase) the run goes across
processes, as ``examples/lm/train.py --procs`` does and with its driver
(``lm.worker``, ``lm.run_procs``, given this script's :data:`NNX_TRAINER`):
``tenplex-jax launch`` runs this script with ``--worker`` as P1 processes of
``devices / P1`` simulated CPU devices each; at a phase boundary every
process saves its shards of ``nnx.state((model, optimizer))`` and the data
iterator's state to its host's store (``tenplex_jax.store.save_and_exit``)
and exits, and the next phase's processes restore them onto their mesh
(``restore_or_init``, the target being the abstract ``nnx.State`` with the
shardings its variables' names give under the rules: the ``nnx.Param`` and
``OptVariable`` types and their metadata come back with it).
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # before the imports (the cross-process reconfiguration's timeline)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LM_DIR = os.path.join(os.path.dirname(HERE), "lm")


def _load_lm():
  """``examples/lm/train.py`` and ``data.py``, whose data (the synthetic
  sequences as ArrayRecord files), batches, schedule parser and plot this
  example shares. Both examples have a ``model.py``, so lm's modules are
  imported under their own names and taken out of ``sys.modules`` again (and
  this example's put back)."""
  names = ("model", "config", "train", "data")
  saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
  path = list(sys.path)
  sys.path.insert(0, LM_DIR)
  try:
    import data as lm_data
    import train as lm_train
  finally:
    for n in names:
      sys.modules.pop(n, None)
    sys.modules.update(saved)
    sys.path[:] = path
  return lm_train, lm_data


import jax  # noqa: E402

if __name__ == "__main__" and "--worker" not in sys.argv:
  # (a --worker process gets its device count from tenplex-jax launch)
  jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import tenplex_jax as tj  # noqa: E402
from tenplex_jax import determinism  # noqa: E402

lm, lm_data = _load_lm()
sys.path.insert(0, HERE)
from model import LM, RULES, Config, create_model  # noqa: E402

# Sizes: small enough for 2 CPU cores.
CONFIGS = {"tiny": Config(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=8),
           "small": Config(vocab=256, seq_len=64, embed=128, heads=8, mlp=512, layers=8)}
GLOBAL_BATCH = lm.configs.GLOBAL_BATCH
LEARNING_RATE = lm.configs.LEARNING_RATE
MICROBATCHES = 4
SEED = 0
# 8 -> 4 -> 2 -> 8 devices; every degree changes, the stage count too (2, 2, 1, 4).
DEFAULT_SCHEDULE = lm.configs.DEFAULT_SCHEDULE
parse_schedule = lm.configs.parse


def degrees_of(mesh: Mesh) -> dict:
  return {a: int(mesh.shape[a]) for a in ("data", "fsdp", "tensor", "stage")}


@functools.cache
def abstract_params(cfg: Config) -> nnx.State:
  """The model's abstract ``nnx.Param`` state, names included (for the search)."""
  with nnx.use_eager_sharding(False):
    return nnx.state(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(SEED))), nnx.Param)


def layout(phase, cfg, devices, *, search, global_batch):
  """(mesh, rules, microbatches) for a schedule phase."""
  devs = devices[:phase.devices]
  if search:
    best = tj.search.best_mesh_for(abstract_params(cfg), devs, global_batch=global_batch,
                                   seq_len=cfg.seq_len)
    names = tuple("stage" if a == "pipeline" else a for a in best.mesh.axis_names)
    rules = tuple((k, "stage" if v == "pipeline" else v) for k, v in best.rules)
    return Mesh(best.mesh.devices, names), rules, best.candidate.microbatches
  degrees = dict(phase.degrees) if phase.degrees is not None else {"data": phase.devices}
  return lm.make_mesh(devs, **degrees), RULES, phase.microbatches or MICROBATCHES


@functools.cache
def _tx(lr):
  # One instance: the optimizer's graphdef holds it, so the elastic and the
  # static run share graphdefs and compiled steps.
  return optax.adamw(lr)


def create_state(cfg, mesh, rules, lr):
  """``nnx.split((model, optimizer))``, created sharded on ``mesh``."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = create_model(cfg, seed=SEED)
    optimizer = nnx.Optimizer(model, _tx(lr), wrt=nnx.Param)
  return nnx.split((model, optimizer))


@functools.cache
def abstract_state(cfg, mesh, rules, lr):
  """``(graphdef, target)``: the graphdef of ``nnx.split((model, optimizer))``
  and its state as ``ShapeDtypeStruct``s with the shardings the variables'
  names give on ``mesh`` under ``rules`` (``nnx.get_named_sharding``); the
  ``nnx.State`` keeps the variable types and metadata. Nothing is computed."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    def build():
      model = create_model(cfg, seed=SEED)
      return model, nnx.Optimizer(model, _tx(lr), wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    shardings = nnx.get_named_sharding(state, mesh)
  return graphdef, jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def state_and_target(cfg, mesh, rules, lr):
  """``(init() -> nnx.State, its target)`` for the cross-process driver."""
  return (lambda: create_state(cfg, mesh, rules, lr)[1]), abstract_state(cfg, mesh, rules, lr)[1]


def params_of(state):
  """The model's ``nnx.Param`` arrays of ``nnx.state((model, optimizer))``, on the host."""
  return jax.tree.map(np.asarray, state[0].filter(nnx.Param))


def check_deterministic(phases, virtual_workers, layouts):
  """Raises ValueError unless every phase's data x fsdp degree divides ``V``
  (``layouts``: the phases' ``(mesh, rules, microbatches)``)."""
  for p, (mesh, _, _) in zip(phases, layouts):
    _check_batch_degree(mesh, virtual_workers, f" (the phase at step {p.step})")


def _check_batch_degree(mesh, virtual_workers, where=""):
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if virtual_workers < 1 or virtual_workers % dp:
    raise ValueError(f"--deterministic {virtual_workers}: the batch degree data x fsdp ="
                     f" {dp} of {degrees_of(mesh)}{where} does not divide it")


def make_step(graphdef, mesh, microbatches, shardings, deterministic=None,
              compiler_options=None):
  """The jitted train step on ``mesh``: the stack is pipelined over ``stage``.

  With ``deterministic=V`` the gradient is
  ``tenplex_jax.determinism.value_and_grad`` over ``V`` virtual workers with
  ``pipeline_axis="stage"``: its ``shard_map`` is manual over every other
  axis, and each worker's slice runs through the pipeline over ``stage``
  (the params stay split over the stages) in :func:`worker_microbatches`
  microbatches, the same number on every phase (another split would add the
  microbatches' gradients in another order), so ``microbatches`` does not
  apply. The update runs on the gradients laid out on the params' own shards
  (``determinism.on_shards``) and compiled apart from them
  (``determinism.unfused``), so its fusions are the same on every mesh. The
  result has the same bits on every mesh whose data x fsdp degree divides
  ``V``, whatever its stage and tensor degrees.
  """

  def seq_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(-1)

  def train_step(state, tokens, mask):
    model, optimizer = nnx.merge(graphdef, state)
    count, tokens = lm.ordered_count(mask, tokens)  # (its all-reduce before the pipeline)

    def loss_fn(model):
      per_seq = seq_loss(model(tokens[:, :-1], mesh=mesh, microbatches=microbatches), tokens)
      return (per_seq * mask).sum() / count

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  if deterministic is None:
    return jax.jit(train_step, donate_argnums=0, out_shardings=(shardings, None),
                   compiler_options=compiler_options)

  def update(state, grads):
    model, optimizer = nnx.merge(graphdef, state)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  def deterministic_step(state, tokens, mask):
    model_def, params, rest = nnx.split(nnx.merge(graphdef, state)[0], nnx.Param, ...)

    def worker_loss(params, batch, rest):
      # One virtual worker's slice; all slices have the same number of rows,
      # so the mean of the workers' means is the global batch's mean.
      worker_model = nnx.merge(model_def, params, rest)
      mb = worker_microbatches(batch["tokens"].shape[0])
      logits = worker_model(batch["tokens"][:, :-1], mesh=mesh, microbatches=mb)
      return (seq_loss(logits, batch["tokens"]) * batch["mask"]).mean()

    # With the params' shardings each stage exchanges only its layers'
    # gradients (not the whole stack over ``stage``).
    grad_fn = determinism.value_and_grad(worker_loss, virtual_workers=deterministic,
                                         mesh=mesh, batch_axis=("data", "fsdp"),
                                         pipeline_axis="stage",
                                         param_shardings=shardings[0].filter(nnx.Param))
    loss, grads = grad_fn(params, {"tokens": tokens, "mask": mask}, rest)
    # Without these XLA fuses the gradients' resharding (which differs from
    # mesh to mesh) into adamw's update: 1-ulp drifts (docs/determinism.md).
    grads = determinism.on_shards(grads, shardings[0].filter(nnx.Param))
    return determinism.unfused(update, state, grads), loss

  # Not at XLA optimisation level 0 (--fast-compile): its code is not bitwise
  # the same for a whole array and for its shards (see examples/lm/train.py).
  opts = {k: v for k, v in (compiler_options or {}).items()
          if k != "xla_backend_optimization_level"}
  return determinism.jit(deterministic_step, donate_argnums=0, out_shardings=(shardings, None),
                         compiler_options=opts)


def worker_microbatches(rows):
  """The pipeline's microbatch count for a virtual worker's ``rows`` in
  deterministic mode: ``gcd(MICROBATCHES, rows)``, fixed for the job."""
  return math.gcd(MICROBATCHES, rows)


# Compiled steps by (graphdef, mesh shape, device ids, rules, microbatches,
# deterministic, compiler options): the static run reuses the elastic run's
# first-phase executable.
_COMPILED = {}


def compiled_step(graphdef, mesh, rules, mb, state, tokens, mask, deterministic=None,
                  compiler_options=None):
  """(executable, seconds spent compiling it: 0 when cached)."""
  key = (graphdef, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat), rules, mb,
         deterministic, tuple(sorted((compiler_options or {}).items())))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  if deterministic is not None:
    _check_batch_degree(mesh, deterministic)
  t0 = time.perf_counter()
  shardings = jax.tree.map(lambda a: a.sharding, state)
  _COMPILED[key] = make_step(graphdef, mesh, mb, shardings, deterministic,
                             compiler_options).lower(state, tokens, mask).compile()
  return _COMPILED[key], time.perf_counter() - t0


def train(phases, steps, cfg, *, search=False, global_batch=GLOBAL_BATCH, lr=LEARNING_RATE,
          log=print, devices=None, on_resize=None, deterministic=None, return_state=False,
          compiler_options=None):
  """Runs ``steps`` steps through ``phases``; returns one record per step
  (and the final ``(graphdef, state)`` with ``return_state``).

  ``deterministic=V``: gradients by ``tenplex_jax.determinism`` over ``V``
  virtual workers (see :func:`make_step`).

  ``on_resize(step, state, mesh, rules)``, if given, sees the state right
  after each re-mesh.
  """
  devices = list(devices or jax.devices())
  source = lm_data.source(cfg)  # ArrayRecord files, read through the dataset index
  starts = {p.step: p for p in phases}
  mesh, rules, mb = layout(phases[0], cfg, devices, search=search, global_batch=global_batch)
  graphdef, state = create_state(cfg, mesh, rules, lr)
  data_state, records = None, []
  for t in range(steps):
    rec = {"step": t, "reconfig_s": 0.0, "reconfig_bytes": 0, "compile_s": 0.0}
    if t in starts and t > 0:
      old = degrees_of(mesh)
      mesh, rules, mb = layout(starts[t], cfg, devices, search=search,
                               global_batch=global_batch)
      state, report = tj.remesh(state, mesh, rules=rules, donate=True)
      jax.block_until_ready(state)
      rec["reconfig_s"] = report.seconds["total"]
      rec["reconfig_bytes"] = int(report.moved_bytes)
      rec["resized_from"] = old
      log(f"step {t}: {old} -> {degrees_of(mesh)} (microbatches {mb}): {report}")
      if on_resize is not None:
        on_resize(t, state, mesh, rules)
    tokens, mask, data_state = lm.batches(source, mesh, data_state, global_batch)
    fn, rec["compile_s"] = compiled_step(graphdef, mesh, rules, mb, state, tokens, mask,
                                         deterministic, compiler_options)
    t0 = time.perf_counter()
    state, loss = fn(state, tokens, mask)
    loss = float(loss)
    rec.update(loss=loss, step_s=time.perf_counter() - t0, devices=int(mesh.devices.size),
               mesh=degrees_of(mesh), microbatches=mb)
    records.append(rec)
    log(f"step {t:3d}  devices {mesh.devices.size}  {degrees_of(mesh)} mb {mb}"
        f"  loss {loss:.4f}  step {rec['step_s'] * 1e3:.1f} ms")
  return (records, (graphdef, state)) if return_state else records


def _step_for_driver(cfg, mesh, rules, mb, state, tokens, mask, deterministic,
                     compiler_options):
  graphdef = abstract_state(cfg, mesh, rules, LEARNING_RATE)[0]
  return compiled_step(graphdef, mesh, rules, mb, state, tokens, mask, deterministic,
                       compiler_options)


# This script's parts for the lm trainer's cross-process driver (lm.worker, lm.run_procs).
NNX_TRAINER = lm.Trainer(
    script=__file__, process_start=_PROCESS_START, dataset=lm_data.source, layout=layout,
    state=state_and_target, step=_step_for_driver, params=params_of,
    check_deterministic=check_deterministic)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                  help="resize schedule: phases STEP:AXIS=N,... (axes data, fsdp, tensor, stage;"
                  " mb=N microbatches) or STEP:DEVICES, separated by spaces or ';'."
                  f" Default: {DEFAULT_SCHEDULE!r}")
  ap.add_argument("--steps", type=int, default=32, help="training steps (default 32)")
  ap.add_argument("--search", action="store_true",
                  help="let tenplex_jax.search choose (data, fsdp, tensor, stage) and the"
                  " microbatch count for each phase's device count")
  ap.add_argument("--json", metavar="PATH",
                  help="write the per-step log (loss, devices, mesh degrees, step time,"
                  " reconfiguration time and bytes) of both runs as JSON")
  ap.add_argument("--plot", metavar="PATH", help="save the loss curves (PNG) here")
  ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny",
                  help="model size (default tiny)")
  ap.add_argument("--remat", action="store_true", help="recompute layer activations in backward")
  ap.add_argument("--deterministic", type=int, metavar="V",
                  help="gradients bitwise independent of the mesh (tenplex_jax.determinism,"
                  " V virtual workers; every phase's data x fsdp degree must divide V):"
                  " bitwise identical to the static run, whatever the tensor and stage"
                  " degrees; each worker's slice runs through the pipeline over stage")
  ap.add_argument("--procs", metavar="P1,P2,...",
                  help="run across processes with tenplex-jax launch: processes per phase"
                  " (each phase's devices split evenly over them; 'auto': 2 for phases of"
                  " 4+ devices, else 1); nnx.state((model, optimizer)) and the data"
                  " iterator's state move through the per-host stores")
  ap.add_argument("--timeout", type=float, default=900,
                  help="seconds for the whole job across processes (default 900)")
  ap.add_argument("--prepare-timeout", type=float, default=lm.PREPARE_TIMEOUT,
                  metavar="SECONDS",
                  help="(with --procs) seconds a generation started ahead may take to get"
                  " ready; past it the launcher stops it and prepares it again, or starts"
                  " the resize's processes afresh at its turn (tenplex-jax launch"
                  f" --prepare-timeout; default {lm.PREPARE_TIMEOUT:g})")
  ap.add_argument("--step-timeout", type=float, default=lm.STEP_TIMEOUT, metavar="SECONDS",
                  help="(with --procs) seconds a process may go without a step before the"
                  " launcher stops the generation as hung and runs it again on as many"
                  " processes from the last save, up to twice (tenplex-jax launch"
                  f" --step-timeout; default {lm.STEP_TIMEOUT:g}, 0: no limit)")
  # (tests) the parent of the job directory (default /dev/shm)
  ap.add_argument("--job-parent", metavar="DIR", help=argparse.SUPPRESS)
  ap.add_argument("--fast-compile", action="store_true",
                  help="compile with XLA optimisation level 0 (faster compiles, slower steps)")
  ap.add_argument("--worker", action="store_true",
                  help="(internal) one process of the --procs job, under tenplex-jax launch")
  ap.add_argument("--records", metavar="PATH",
                  help="(with --worker) append the per-step records here")
  args = ap.parse_args(argv)
  cfg = dataclasses.replace(CONFIGS[args.config], remat=args.remat)
  try:
    phases = parse_schedule(args.schedule)
    plan = lm.procs_plan(phases, args.procs) if args.procs else None
  except ValueError as e:
    ap.error(str(e))
  if args.worker:
    if plan is None or not args.records:
      ap.error("--worker needs --procs and --records (it runs under tenplex-jax launch)")
    lm.worker(args, cfg, phases, plan, trainer=NNX_TRAINER)
    return None
  need = max(p.devices for p in phases)
  if need > len(jax.devices()):
    ap.error(f"the schedule needs {need} devices, {len(jax.devices())} available")
  v, opts = args.deterministic, lm._compiler_options(args)
  if v is not None:
    try:
      check_deterministic(phases, v, [layout(p, cfg, jax.devices(), search=args.search,
                                             global_batch=GLOBAL_BATCH) for p in phases])
    except ValueError as e:
      ap.error(str(e))
  if plan is not None:
    elastic, el_params = lm.run_procs(args, cfg, phases, plan, trainer=NNX_TRAINER)
  else:
    elastic, (_, el_state) = train(phases, args.steps, cfg, search=args.search,
                                   deterministic=v, compiler_options=opts, return_state=True)
    el_params = params_of(el_state)
  static, (_, st_state) = train(phases[:1], args.steps, cfg, search=args.search,
                                log=lambda *_: None, deterministic=v, compiler_options=opts,
                                return_state=True)
  diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(elastic, static))
  pdiff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(el_params), jax.tree.leaves(params_of(st_state))))
  resizes = [r for r in elastic if "resized_from" in r]
  where = "across processes" if plan is not None else "in one process"
  print(f"final loss {elastic[-1]['loss']:.4f} (first {elastic[0]['loss']:.4f});"
        f" {len(resizes)} resizes {where}, reconfiguration"
        f" {sum(r['reconfig_s'] for r in resizes) * 1e3:.0f} ms in total;"
        f" max |elastic - static| = {diff:.2e} (loss), {pdiff:.2e} (final params)")
  bitwise = None
  if v is not None:
    bitwise = [a["loss"] for a in elastic] == [b["loss"] for b in static] and all(
        np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(
            jax.tree.leaves(el_params), jax.tree.leaves(params_of(st_state))))
    print(f"deterministic ({v} virtual workers): losses and final params are "
          + ("bitwise identical to the static run" if bitwise
             else "NOT bitwise identical to the static run"))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": dataclasses.asdict(cfg), "schedule": args.schedule,
                 "search": args.search, "procs": plan, "deterministic": v,
                 "elastic": elastic, "static": static, "max_abs_loss_diff": diff,
                 "max_abs_param_diff": pdiff, "bitwise_identical": bitwise}, f, indent=1)
  if args.plot:
    lm.plot(elastic, static, args.plot)
  return diff


if __name__ == "__main__":
  main()
