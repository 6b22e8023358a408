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
  python examples/lm/train.py --procs 2,2,1,2      # the same, across processes

With ``--procs P1,P2,...`` (one process count per phase) the run goes across
processes instead: ``tenplex-jax launch`` runs this script with ``--worker``
as P1 processes of ``devices / P1`` simulated CPU devices each; at a phase
boundary every process saves its shards and the data iterator's state to its
host's store (``tenplex_jax.store.save_and_exit``) and exits, the launcher
starts the next phase's processes (another process count, another number of
devices per process), and they restore the state onto their mesh
(``restore_or_init``). The same as one command under the launcher::

  tenplex-jax launch --procs 2 --devices-per-proc 4 -- \\
      python examples/lm/train.py --worker --procs 2,2,1,2 --records lm.jsonl

With ``--deterministic V`` the gradient of each global batch is summed over V
virtual workers in one fixed order (``tenplex_jax.determinism``): the run is
bitwise identical to the static run when every phase's data-parallel degree
(data x fsdp) divides V, whatever its tensor and stage degrees: each virtual
worker's slice runs through the pipeline over ``stage`` (see ``make_step``).
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # before the imports (the cross-process reconfiguration's timeline)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

if __name__ == "__main__" and "--worker" not in sys.argv:
  # (a --worker process gets its device count from tenplex-jax launch)
  jax.config.update("jax_num_cpu_devices", 8)

import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
import zlib  # noqa: E402
from typing import Callable  # noqa: E402

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


# init runs once per job: on CPU it compiles at XLA's optimisation level 0
# (TINY: 0.9-1.5 s of CPU against 4.6-6.9 s at the default level, 1 to 8
# devices). Its values are the same on every mesh at either level, though
# not the same at both (tests/test_pipeline_lm.py checks level 0's).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@functools.cache
def init_fn(cfg, mesh, rules, lr):
  """``init(key) -> TrainState``, jitted to create the state sharded on ``mesh``
  (one per layout: the static run reuses the elastic run's)."""
  model, tx = _model_and_tx(cfg, lr)

  def init(key):
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  abstract = jax.eval_shape(init, jax.random.key(configs.SEED))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  cpu = mesh.devices.flat[0].platform == "cpu"
  return jax.jit(init, out_shardings=shardings,
                 compiler_options=INIT_COMPILER_OPTIONS if cpu else None)


def create_state(cfg, mesh, rules, lr):
  return init_fn(cfg, mesh, rules, lr)(jax.random.key(configs.SEED))


def check_deterministic(phases, virtual_workers, layouts):
  """Raises ValueError unless ``--deterministic V`` can hold on every phase.

  ``layouts`` are the phases' ``(mesh, rules, microbatches)``. Each phase's
  data-parallel degree (data x fsdp) must divide V. Any stage count works:
  each virtual worker's loss runs the pipeline over ``stage`` inside
  ``tenplex_jax.determinism.value_and_grad`` (``pipeline_axis="stage"``).
  """
  if virtual_workers < 1:
    raise ValueError(f"--deterministic {virtual_workers}: V must be a positive number of"
                     " virtual workers")
  for p, (mesh, _, _) in zip(phases, layouts):
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if virtual_workers % dp:
      raise ValueError(f"--deterministic {virtual_workers}: the phase at step {p.step} has"
                       f" data-parallel degree {dp} (data {mesh.shape['data']} x fsdp"
                       f" {mesh.shape['fsdp']}), which does not divide {virtual_workers}")


def make_step(cfg, mesh, microbatches, *, deterministic=None, compiler_options=None,
              state_shardings=None):
  """The jitted train step for a mesh: the pipeline runs over its stage axis.

  With ``deterministic=V`` the loss and gradient come from
  ``tenplex_jax.determinism.value_and_grad`` over V virtual workers; each
  worker's slice runs through the pipeline over ``stage`` in
  ``gcd(cfg.microbatches, slice)`` microbatches, the same number on every
  phase (another split would add the microbatches' gradients in another
  order), so ``microbatches`` does not apply. The loss is then the mean over
  the batch of the masked per-sequence losses (the same as the normal
  step's when no sequence is masked out).
  """
  if deterministic is not None:
    from tenplex_jax import determinism

    def worker_loss(params, batch):
      mb = math.gcd(cfg.microbatches, batch["tokens"].shape[0])
      model = LM(dataclasses.replace(cfg, microbatches=mb), mesh)
      logits = model.apply({"params": params}, batch["tokens"][:, :-1])
      per_seq = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["tokens"][:, 1:]).mean(-1)
      return (per_seq * batch["mask"]).mean()

    # With the params' shardings each stage exchanges only its layers'
    # gradients (not the whole stack over ``stage``).
    grad = determinism.value_and_grad(
        worker_loss, virtual_workers=deterministic, mesh=mesh, batch_axis=("data", "fsdp"),
        pipeline_axis="stage",
        param_shardings=None if state_shardings is None else state_shardings.params)

    def det_step(state, tokens, mask):
      loss, grads = grad(state.params, {"tokens": tokens, "mask": mask})
      if state_shardings is not None:
        # The update runs on the gradients materialised on the params' own
        # shards (determinism.on_shards), so its fusions never read them
        # through another mesh's slices and collectives.
        grads = determinism.on_shards(grads, state_shardings.params)
      return determinism.unfused(lambda s, g: s.apply_gradients(grads=g), state, grads), loss

    # XLA:CPU at optimisation level 0 does not give the same bits for a whole
    # array and for its shards (measured: final params 1 ulp apart after a
    # data 4 -> 1 resize), so --fast-compile does not apply here.
    opts = {k: v for k, v in (compiler_options or {}).items()
            if k != "xla_backend_optimization_level"}
    # The new state keeps the old one's shardings (``state_shardings``).
    out = None if state_shardings is None else (state_shardings,
                                                NamedSharding(mesh, P()))
    return determinism.jit(det_step, donate_argnums=0, compiler_options=opts,
                           out_shardings=out)

  model = LM(dataclasses.replace(cfg, microbatches=microbatches), mesh)

  def step(state, tokens, mask):
    count, tokens = ordered_count(mask, tokens)

    def loss_fn(params):
      logits = model.apply({"params": params}, tokens[:, :-1])
      per_seq = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(-1)
      return (per_seq * mask).sum() / count

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)


def ordered_count(mask, tokens):
  """``(mask.sum(), tokens)``, the tokens waiting for the sum: the sum's all-reduce
  (over the batch axes) runs on every device before the pipeline's loop. Without that
  data dependence jaxlib 0.10.2's XLA:CPU runs it and the loop's first collective-permute
  in either order, and, with gloo across processes, devices that took opposite orders
  wait for each other for ever (docs/pipeline.md, caught with native stacks)."""
  count = mask.sum()
  # A real dependence (an optimization barrier would not do: XLA:CPU removes barriers
  # before it runs the program): the tokens plus count * 0, which XLA does not fold for
  # floats (NaN * 0 is NaN); the count of a mask is finite, so the tokens are unchanged.
  return count, tokens + (count * 0.0).astype(tokens.dtype)


def batches(source, mesh, data_state, global_batch, crc=None):
  """The global batch: each data shard's part read by its own iterator.

  Every process reads every part (they are small) and keeps the rows of its
  own devices, so the same code runs in one process and in many. ``crc``, a
  list, receives the CRC-32 of the global batch (tokens and mask).
  """
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
  if crc is not None:  # which samples the step trains on (the same for any mesh)
    crc.append(zlib.crc32(mask.tobytes(), zlib.crc32(tokens.tobytes())))

  def put(a):
    return jax.make_array_from_callback(a.shape, spec, lambda idx: a[idx])

  return put(tokens), put(mask), new_state


# Compiled train steps by (config, mesh, rules, microbatches, mode): the
# static run reuses the elastic run's first-phase executable.
_COMPILED = {}


def degrees_of(mesh):
  return {a: int(mesh.shape[a]) for a in ("data", "fsdp", "tensor", "stage")}


def _compiled_step(cfg, mesh, rules, mb, state, tokens, mask, deterministic, compiler_options,
                   before_compile=None):
  """(executable, seconds spent compiling it: 0 when cached). ``before_compile()``, if
  given, runs between tracing and compiling (its time not counted): a generation started
  early waits there for the programs another one is compiling (``store.wait_programs``)."""
  key = (cfg, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat), rules, mb,
         deterministic, tuple(sorted((compiler_options or {}).items())))
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  t0 = time.perf_counter()
  lowered = make_step(cfg, mesh, mb, deterministic=deterministic,
                      compiler_options=compiler_options,
                      state_shardings=jax.tree.map(lambda x: x.sharding, state)
                      ).lower(state, tokens, mask)
  waited = 0.0
  if before_compile is not None:
    t1 = time.perf_counter()
    before_compile()
    waited = time.perf_counter() - t1
  fn = lowered.compile()
  _COMPILED[key] = fn
  return fn, time.perf_counter() - t0 - waited


_COMPILES = {}  # jax's compile events in this process, per thread: {ident: {kind: count}}


def count_compiles():
  """Counts this process's XLA compilations (``_COMPILES``, per thread) from
  jax's monitoring events: every backend compile request, and the requests
  the persistent compilation cache answered (hits; the rest compiled)."""
  if _COMPILES.get("listening"):
    return

  def add(kind):
    mine = _COMPILES.setdefault(threading.get_ident(), {"backend": 0, "cache_hits": 0})
    mine[kind] += 1

  def on_duration(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      add("backend")

  def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      add("cache_hits")

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  _COMPILES["listening"] = True


def counted_step(tr, *args, **kwargs):
  """``tr.step(*args, **kwargs)`` -> ``(step, compile seconds, XLA compilations, cache
  hits)``, the compile events counted in this thread."""
  mine = _COMPILES.setdefault(threading.get_ident(), {"backend": 0, "cache_hits": 0})
  before = dict(mine)
  fn, compile_s = tr.step(*args, **kwargs)
  hits = mine["cache_hits"] - before["cache_hits"]
  return fn, compile_s, mine["backend"] - before["backend"] - hits, hits


class _Background(threading.Thread):
  """``fn(*args)`` in a thread; :meth:`result` joins it (re-raising its error)."""

  def __init__(self, fn, *args):
    super().__init__(daemon=True)
    self._fn, self._args, self._out, self._error = fn, args, None, None
    self.start()

  def run(self):
    try:
      self._out = self._fn(*self._args)
    except BaseException as e:  # noqa: BLE001  (re-raised by result())
      self._error = e

  def result(self):
    self.join()
    if self._error is not None:
      raise self._error
    return self._out


def _host_scalar(x):
  """A replicated scalar as a Python float (also when other processes hold copies)."""
  return float(np.asarray(x.addressable_data(0)))


def train(phases, steps, cfg, *, search=False, global_batch=configs.GLOBAL_BATCH,
          lr=configs.LEARNING_RATE, log=print, devices=None, deterministic=None,
          compiler_options=None, final=None, reports=None):
  """Runs ``steps`` steps through ``phases``; returns one record per step.

  ``final``, a dict, receives the final params as host numpy arrays
  (``final["params"]``); ``reports``, a list, receives ``(step, RemeshReport)``
  per resize.
  """
  devices = list(devices or jax.devices())
  source = dataset(cfg)
  starts = {p.step: p for p in phases}
  mesh, rules, mb = layout(phases[0], cfg, devices, search=search, global_batch=global_batch)
  if deterministic is not None:
    check_deterministic(phases, deterministic,
                        [layout(p, cfg, devices, search=search, global_batch=global_batch)
                         for p in phases])
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
      if reports is not None:
        reports.append((t, report))
      log(f"step {t}: {old} -> {degrees_of(mesh)} (microbatches {mb}): {report}")
    crc = []
    tokens, mask, data_state = batches(source, mesh, data_state, global_batch, crc)
    rec["batch_crc"] = crc[0]
    fn, rec["compile_s"] = _compiled_step(cfg, mesh, rules, mb, state, tokens, mask,
                                          deterministic, compiler_options)
    t0 = time.perf_counter()
    state, loss = fn(state, tokens, mask)
    loss = _host_scalar(loss)
    rec.update(loss=loss, step_s=time.perf_counter() - t0, devices=int(mesh.devices.size),
               mesh=degrees_of(mesh), microbatches=mb)
    records.append(rec)
    log(f"step {t:3d}  devices {mesh.devices.size}  {degrees_of(mesh)} mb {mb}"
        f"  loss {loss:.4f}  step {rec['step_s'] * 1e3:.1f} ms")
  if final is not None:
    final["params"] = jax.tree.map(np.asarray, nn.unbox(state.params))
  return records


# ----------------------------------------------------- across processes


def phase_at(phases, step):
  """The phase that step ``step`` runs in."""
  return [p for p in phases if p.step <= step][-1]


def procs_plan(phases, text):
  """Processes per phase from ``--procs P1,P2,...`` (``auto``: 2 processes for
  phases of 4 or more devices, else 1).

  Example:
    >>> procs_plan(configs.parse("0:8 4:4 8:2"), "auto")
    [2, 2, 1]
  """
  if text == "auto":
    return [2 if p.devices >= 4 and p.devices % 2 == 0 else 1 for p in phases]
  try:
    plan = [int(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(f"--procs {text!r}: expected one process count per phase,"
                     " comma-separated (e.g. 2,2,1,2) or 'auto'") from None
  if len(plan) != len(phases):
    raise ValueError(f"--procs {text!r}: {len(plan)} process counts for {len(phases)}"
                     f" phases (steps {[p.step for p in phases]})")
  for p, n in zip(phases, plan):
    if n < 1 or p.devices % n:
      raise ValueError(f"--procs {text!r}: the phase at step {p.step} has {p.devices}"
                       f" devices, which {n} processes cannot share evenly")
  return plan


def _append(path, record):
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def state_and_target(cfg, mesh, rules, lr):
  """``(init() -> TrainState, its ShapeDtypeStructs)`` sharded on ``mesh``."""
  init = init_fn(cfg, mesh, rules, lr)
  key = jax.random.key(configs.SEED)
  return (lambda: init(key)), jax.eval_shape(init, key)


@dataclasses.dataclass(frozen=True)
class Trainer:
  """What :func:`worker` and :func:`run_procs` need from a trainer script.

  This script's is :data:`LM_TRAINER`; ``examples/nnx/train.py`` passes its
  own (an ``nnx.State`` of the model and the optimizer instead of a
  ``TrainState``).

  Attributes:
    script: the script ``tenplex-jax launch`` runs with ``--worker``.
    process_start: ``time.time()`` when the script started (before its imports).
    dataset: ``cfg -> source`` of ``{"tokens"}`` samples (for :func:`batches`).
    layout: ``(phase, cfg, devices, *, search, global_batch) -> (mesh, rules,
      microbatches)``.
    state: ``(cfg, mesh, rules, lr) -> (init() -> state, target)``: the
      state created on ``mesh``, and its ``ShapeDtypeStruct``s with shardings
      (the restore target).
    step: ``(cfg, mesh, rules, microbatches, state, tokens, mask,
      deterministic, compiler_options) -> (compiled step, compile seconds)``;
      the step maps ``(state, tokens, mask)`` to ``(state, loss)``.
    params: ``state -> params`` as host numpy arrays.
    check_deterministic: ``(phases, V, layouts)``, raises ``ValueError``.
    step_waits: ``step`` takes ``before_compile=`` (called between tracing and
      compiling): a generation started early traces its step before it waits for the
      programs another generation is compiling (``store.wait_programs``); otherwise it
      waits before tracing.
  """
  script: str
  process_start: float
  dataset: Callable
  layout: Callable
  state: Callable
  step: Callable
  params: Callable
  check_deterministic: Callable
  step_waits: bool = False


def _phase_key(phase, procs, search=False):
  """What a phase's generation compiles, as a string (equal for equal programs)."""
  degrees = sorted(dict(phase.degrees).items()) if phase.degrees is not None else None
  return json.dumps([procs, phase.devices, degrees, phase.microbatches]
                    + (["search"] if search else []))


def _failure_phase(phases, plan, phase, n):
  """The layout of a generation of ``n`` processes after a failure in ``phase``: the
  phase's devices per process (as ``plan`` splits them) on ``n`` processes, degrees
  and microbatches left to the configuration search (``--search``)."""
  per_proc = phase.devices // plan[phases.index(phase)]
  return dataclasses.replace(phase, devices=n * per_proc, degrees=None, microbatches=None)


def _expect_next(store, args, phases, plan, phase, n, key):
  """Tells the launcher the schedule's next phases (``store.expect_resizes``) and, with
  ``--snapshot-every``, the generation a failure would restart on (one process fewer,
  the search's layout of their devices: :func:`_failure_phase`), unless
  ``--no-prepare``. ``key``: this generation's."""
  if getattr(args, "no_prepare", False):
    return
  later = [(p.step, plan[k], _phase_key(p, plan[k])) for k, p in enumerate(phases)
           if phase.step < p.step < args.steps]
  failure = None
  if getattr(args, "snapshot_every", 0) and n > 1:
    failure = (n - 1, _phase_key(_failure_phase(phases, plan, phase, n - 1), n - 1,
                                 search=True))
  # early: a phase with a key being compiled starts at once too and waits for its
  # programs only before it compiles (store.wait_programs)
  store.expect_resizes(later, key=key, early=True, failure=failure)


def _kill_when_failure_ready(job_dir, m, kill, timeout=600.0):
  """``--kill-at`` (a test's failure): waits until the ``m`` processes of the generation
  prepared for a failure are ready (their ``lm_failure_ready_<generation>_<process>``
  files), then, if ``kill``, SIGKILLs this process."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    gens = [x.split("_")[3] for x in os.listdir(job_dir) if x.startswith("lm_failure_ready_")]
    if any(gens.count(g) >= m for g in gens):
      break
    time.sleep(0.05)
  if kill:
    print(f"--kill-at: process {os.environ.get('TENPLEX_PROC_ID')} kills itself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _hang_once(marker, flag="--hang-ahead"):
  """A test's hang, once per job. ``--hang-ahead``: the first process of a generation
  started ahead for a resize to finish its warm-up step sleeps for ever before its ready
  mark (the launcher's prepare timeout must stop it). ``--hang-at STEP``: the first
  process to reach step STEP sleeps for ever before running it, the others wait for it
  in the step's collectives (the launcher's step timeout must stop them). ``marker``,
  made exclusively, holds its pid, so the generation that replaces it goes on."""
  try:
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  except FileExistsError:
    return
  os.write(fd, str(os.getpid()).encode())
  os.close(fd)
  print(f"{flag}: process {os.environ.get('TENPLEX_PROC_ID')} of generation"
        f" {os.environ.get('TENPLEX_GENERATION')} hangs", flush=True)
  while True:
    time.sleep(3600)


def _zeros(tree, fill=0):
  """Arrays of ``fill`` shaped and sharded as a tree of ``ShapeDtypeStruct``s (no
  compilation: each process writes its own shards)."""
  def one(s):
    host = np.full(s.shape, fill, s.dtype)
    return jax.make_array_from_callback(s.shape, s.sharding, lambda idx: host[idx])
  return jax.tree.map(one, tree)


def worker(args, cfg, phases, plan, trainer=None):
  """One process of the job under ``tenplex-jax launch`` (``--worker``).

  The generation's phase is the one its start step falls in; its devices are
  split evenly over the launcher's processes. The state (train state and
  data iterator state) comes from the stores, or is initialised at step 0;
  at the next phase boundary every process saves to its store and exits for
  the launcher to start the next phase's processes. Process 0 appends a
  record per step (and one per save and restore) to ``--records``.
  ``trainer`` (default :data:`LM_TRAINER`) supplies the model's parts.
  """
  from tenplex_jax import store
  from tenplex_jax.store.launch import last_restore

  tr = trainer or LM_TRAINER

  t_start = time.time()
  count_compiles()
  n = int(os.environ.get("TENPLEX_NUM_PROCS", "1"))
  phase = phase_at(phases, int(os.environ.get("TENPLEX_START_STEP", "0")))
  # A generation after a failure (the one the launcher prepared for it, or a restart):
  # the phase's devices per process on its processes.
  recovery = store.prepared_for_failure() or "TENPLEX_FAILED_STEP" in os.environ
  # On fewer processes than the phase planned (a lost process): the search's layout.
  # On as many (a restart after a hang, --step-timeout): the phase's own.
  shrunk = recovery and n != plan[phases.index(phase)]
  lay = _failure_phase(phases, plan, phase, n) if shrunk else phase
  if lay.devices % n:
    raise ValueError(f"the phase at step {phase.step} has {lay.devices} devices, which"
                     f" {n} processes cannot share evenly")
  os.environ["TENPLEX_DEVICES"] = str(lay.devices // n)
  key = _phase_key(lay, n, search=shrunk)
  info = store.initialize()
  # Until the first step, this process is alive however long its compiles (the init's,
  # the step's) take on a loaded host: --step-timeout then bounds the steps themselves.
  beating = store.heartbeats(every=2.0)
  t_init = time.time()
  lead = info["process_id"] == 0
  # A generation the launcher started ahead (it expected this resize, or prepared it for
  # a failure): compile and warm up now, restore at the turn. Otherwise announce the
  # schedule's next phases at once, so that the launcher prepares them while this
  # generation compiles and trains.
  ahead = store.prepared()
  if not ahead:
    _expect_next(store, args, phases, plan, phase, n, key)
  devices = jax.devices()
  lr, gb = configs.LEARNING_RATE, configs.GLOBAL_BATCH
  mesh, rules, mb = tr.layout(lay, cfg, devices, search=args.search or shrunk,
                              global_batch=gb)
  if args.deterministic is not None:
    tr.check_deterministic([lay], args.deterministic, [(mesh, rules, mb)])
  init, abstract = tr.state(cfg, mesh, rules, lr)
  target = {"train": abstract, "data": ""}
  # The step compiles (or loads from the launcher's compilation cache) while the state is
  # restored: it needs the state's shapes and shardings, not its values.
  spec = NamedSharding(mesh, P(("data", "fsdp")))
  batch = (jax.ShapeDtypeStruct((gb, cfg.seq_len + 1), jnp.int32, sharding=spec),
           jax.ShapeDtypeStruct((gb,), jnp.float32, sharding=spec))
  waits = {}

  def wait_programs():  # a generation started early: the other's programs in the cache
    waits["programs_wait_s"] = store.wait_programs()

  def compile_step():
    if tr.step_waits:
      return counted_step(tr, cfg, mesh, rules, mb, abstract, *batch, args.deterministic,
                          _compiler_options(args), before_compile=wait_programs)
    wait_programs()
    return counted_step(tr, cfg, mesh, rules, mb, abstract, *batch, args.deterministic,
                        _compiler_options(args))

  compiling = _Background(compile_step)
  ahead_s = {}
  if ahead:  # before the turn: the step compiled and run once (gloo's connections)
    t0 = time.time()
    fn, ahead_s["compile_s"], _, _ = compiling.result()
    store.warming_up()  # the launcher's --warmup-timeout counts from here
    t1 = time.time()
    warm, _ = fn(_zeros(abstract), *(_zeros(x, 1) for x in batch))
    jax.block_until_ready(warm)
    del warm
    # The data path's first use too (the source's files opened, the iterators' and the
    # batch's first run), on a batch thrown away: the first batch after the turn then
    # costs what a later one does.
    source = tr.dataset(cfg)
    jax.block_until_ready(batches(source, mesh, None, gb)[:2])
    ahead_s.update(import_s=t_start - tr.process_start, distributed_s=t_init - t_start,
                   compile_wait_s=t1 - t0, warmup_s=time.time() - t1,
                   programs_wait_s=waits.get("programs_wait_s", 0.0))
    if getattr(args, "hang_ahead", None) and not recovery:  # for --hang-ahead
      _hang_once(args.hang_ahead)
    if recovery and getattr(args, "kill_at", None) is not None:  # for --kill-at
      with open(os.path.join(info["job_dir"], f"lm_failure_ready_{info['generation']}_"
                             f"{info['process_id']}"), "w"):
        pass
  tree, step = store.restore_or_init(lambda: {"train": init(), "data": ""}, target)
  jax.block_until_ready(tree)
  t_restored = time.time()
  turn = store.wait_turn()  # (restore_or_init waited for it): its times
  if ahead:
    ahead_s.update(ready_time=turn["ready"], handed_time=turn["handed"],
                   saved_time=turn.get("saved"), started_time=turn.get("started"),
                   nice=turn.get("nice", 0))
  if phase_at(phases, step) != phase:
    raise ValueError(f"restored step {step}, which is not in the phase at step {phase.step}")
  state = tree["train"]
  data_state = json.loads(tree["data"]) if tree["data"] else None
  if lead:
    _append(args.records, {
        "event": "start", "step": step, "generation": info["generation"], "procs": n,
        "devices_per_proc": lay.devices // n,
        # started ahead: imports, jax.distributed and the compile came before the turn
        # (ahead_s); the resize's path starts when the turn was seen
        "start_time": turn["seen"] if ahead else tr.process_start,
        "import_s": 0.0 if ahead else t_start - tr.process_start,
        "init_s": 0.0 if ahead else t_init - t_start,
        "restore_s": t_restored - (turn["seen"] if ahead else t_init),
        "restored_time": t_restored, "restore": last_restore.get("report"),
        # a standby process (tenplex_jax.store launch): imports done before its rank came
        "standby": "TENPLEX_STANDBY_ASSIGNED" in os.environ,
        "ahead": ahead, "ahead_s": ahead_s,
        # after a failure: the step it failed at (the launcher's), of the turn or the env
        "failed_step": last_restore.get("failed_step"),
        "layout_from_search": bool(shrunk)})
  if not ahead:
    source = tr.dataset(cfg)
  boundaries = [p.step for p in phases if p.step > phase.step]
  end = min(boundaries + [args.steps])
  every = getattr(args, "snapshot_every", 0) or 0
  for t in range(step, end):
    if getattr(args, "kill_at", None) == t and not recovery:  # every process waits
      _kill_when_failure_ready(info["job_dir"], n - 1, kill=info["process_id"] == n - 1)
    if getattr(args, "hang_at", None) == t and info["job_dir"]:  # for --hang-at
      _hang_once(os.path.join(info["job_dir"], "lm_hang_at"), "--hang-at")
    t0 = time.perf_counter()
    crc = []
    tokens, mask, data_state = batches(source, mesh, data_state, gb, crc)
    batch_s = time.perf_counter() - t0
    if compiling is not None:  # the first step: compiled while restoring
      t0 = time.perf_counter()
      fn, compile_s, compiles, hits = compiling.result()
      compile_wait_s, compiling = time.perf_counter() - t0, None
    else:
      fn, compile_s, compiles, hits = counted_step(
          tr, cfg, mesh, rules, mb, state, tokens, mask, args.deterministic,
          _compiler_options(args))
      compile_wait_s = compile_s
    beating.stop()
    c0, t0 = time.process_time(), time.perf_counter()
    state, loss = fn(state, tokens, mask)
    dispatch_s = time.perf_counter() - t0  # the call's return (the rest: running it)
    loss = _host_scalar(loss)
    rec = {"event": "step", "step": t, "loss": loss, "step_s": time.perf_counter() - t0,
           # the call's return, and the CPU seconds this process's threads spent in the step
           "dispatch_s": dispatch_s, "step_cpu_s": time.process_time() - c0,
           "time": time.time(), "compile_s": compile_s, "batch_s": batch_s,
           # of which not overlapped with the restore (the first step's compile runs with it)
           "compile_wait_s": compile_wait_s,
           # the step's XLA compilations, and those the persistent cache answered
           "xla_compiles": compiles, "cache_hits": hits,
           "devices": int(mesh.devices.size), "mesh": degrees_of(mesh),
           "microbatches": mb, "procs": n, "devices_per_proc": lay.devices // n,
           "batch_crc": crc[0], "generation": info["generation"]}
    if t == step and info["job_dir"]:  # every process's first step: its compilations
      with open(os.path.join(info["job_dir"], f"compiles_{info['generation']}_"
                             f"{info['process_id']}.json"), "w") as f:
        # (and when its state was restored and its first step done: a first step waits
        # in its collectives for the slowest process's restore)
        json.dump({"xla_compiles": compiles, "cache_hits": hits,
                   "restored_time": t_restored, "step_time": rec["time"]}, f)
    if lead:
      _append(args.records, rec)
      print(f"step {t:3d}  {n} procs x {lay.devices // n} devices  {degrees_of(mesh)}"
            f" mb {mb}  loss {loss:.4f}  step {rec['step_s'] * 1e3:.1f} ms", flush=True)
    if ahead and t == step:  # started ahead: the later phases once its first step is done
      _expect_next(store, args, phases, plan, phase, n, key)  # (not beside it)
    due = store.resize_due(t + 1)  # also a request from outside (SIGUSR1)
    if t + 1 < args.steps and (t + 1 == end or due):
      procs = due or plan[phases.index(phase_at(phases, t + 1))]
      if lead:
        _append(args.records, {"event": "save", "step": t + 1, "time": time.time(),
                               "procs": procs})
      store.save_and_exit({"train": state, "data": json.dumps(data_state)}, t + 1,
                          procs=procs)
    if every and (t + 1) % every == 0 and t + 1 < args.steps:  # for a failure's restart
      t0 = time.time()
      store.save_snapshot({"train": state, "data": json.dumps(data_state)}, t + 1)
      if lead:
        _append(args.records, {"event": "snapshot", "step": t + 1, "time": t0,
                               "seconds": time.time() - t0})
  store.save_snapshot({"train": state, "data": json.dumps(data_state)}, args.steps)
  if lead:
    _append(args.records, {"event": "end", "step": args.steps, "time": time.time()})


def _restore_bytes(job_dir, generation):
  """Bytes the processes of ``generation`` read from the stores (local, network)."""
  local = net = 0
  for name in os.listdir(job_dir):
    if name.startswith("restore_") and name.endswith(f"_{generation}.json"):
      with open(os.path.join(job_dir, name)) as f:
        r = json.load(f)
      local += r["local_bytes"]
      net += r["network_bytes"]
  return local, net


def _compiles(job_dir, generation, key=("xla_compiles", "cache_hits")):
  """Each process's first-step ``(XLA compilations, cache hits)`` in ``generation``
  (``key``: other fields of its ``compiles_<generation>_<process>.json``)."""
  out = {}
  for name in os.listdir(job_dir):
    if name.startswith(f"compiles_{generation}_") and name.endswith(".json"):
      with open(os.path.join(job_dir, name)) as f:
        r = json.load(f)
      out[int(name[:-5].split("_")[-1])] = tuple(r.get(k) for k in key)
  return [out[i] for i in sorted(out)]


def assemble(records_path, job_dir):
  """The per-step log of a run across processes, in the in-process format.

  The first step of each relaunched generation carries the reconfiguration:
  ``reconfig_s`` from the old processes' save call to the new processes'
  restored state (save, exit, relaunch, imports, ``jax.distributed`` start,
  restore; compilation apart, in ``compile_s``), split into ``relaunch_s``
  (save call to the new process's start: for a standby process of the
  launcher, to the script's start once its rank came), ``import_s`` (Python,
  jax, flax: what is left of them for a standby), ``distributed_s``
  (``tenplex_jax.store.initialize``: ``jax.distributed``; also as ``init_s``) and
  ``restore_s``; ``reconfig_bytes`` the bytes the new processes read from the
  stores (``network_bytes`` of them from other hosts' store servers). It
  also has ``resize_s`` (save call to the new step's end: compilation and
  the step included; ``first_batch_s`` and ``first_step_s``: the new step's
  ``batch_s`` and ``step_s``), ``standby`` (whether process 0 was a standby),
  ``xla_compiles`` (the step's XLA compilations in process 0; 0 when jax's
  persistent compilation cache had them all), ``xla_compiles_procs`` (each
  process's ``[compilations, cache hits]``) and ``compile_cache_hit`` (no
  process compiled, every one loaded from the cache), and ``ahead``: whether
  the generation was started ahead (``store.expect_resizes``; its imports,
  ``jax.distributed``, compile and a warm-up step came before the save, in
  ``ahead_s``; ``relaunch_s`` is then the save call to the turn seen, of which
  ``handoff_s`` to the launcher's hand-over (``save_s`` of it until every old
  process had saved) and ``ahead_wait_s`` waiting for the preparation to finish;
  ``ahead_margin_s``: how long before the save call it was ready, negative when it
  was not; ``ahead_lead_s``: how long before the save call the launcher started it;
  ``ahead_s["nice"]``: the nice increment it prepared at). Every step has ``time``
  (its end), ``batch_s`` (reading the global batch), ``step_s`` (the step, of which
  ``dispatch_s`` until the call returned; ``step_cpu_s``: process 0's CPU seconds in it),
  ``batch_crc`` (CRC-32 of the global batch) and ``generation``; the first after a resize
  also ``restore_parts_s`` (process 0's restore: manifest, plan, read, build, total) and
  ``old_exit_s`` (when the old processes had exited, from the save call).

  A restart after a failure (``--snapshot-every``) drops the records of the steps it
  runs again (``steps_redone``); its first step has ``recovered``, ``failed_step``,
  ``restored_step``, ``steps_lost``, ``failure`` (the launcher's record) and
  ``layout_from_search``, and its times count from the failed process's death instead
  of a save call: ``reconfig_s``, ``relaunch_s``, ``handoff_s``, ``ahead_margin_s``, and
  ``recovery_s`` (to the new step done; also ``resize_s``). A snapshot's time is on the
  step before it (``snapshot_s``).
  """
  with open(records_path) as f:
    events = [json.loads(x) for x in f]
  failures = _failures(job_dir)
  out, saves, prev = [], {}, None
  pending = None
  for e in events:
    if e["event"] == "save":
      saves[e["step"]] = e
    elif e["event"] == "snapshot":
      if out and out[-1]["step"] == e["step"] - 1:
        out[-1]["snapshot_s"] = e["seconds"]
    elif e["event"] == "start":
      recovered = e.get("failed_step") is not None
      pending = e if e["step"] > 0 or recovered else None
      if recovered:  # the steps from the restored one on ran again: the new ones count
        pending = dict(e, lost=[r["step"] for r in out if r["step"] >= e["step"]])
        out = [r for r in out if r["step"] < e["step"]]
    elif e["event"] == "step":
      rec = {k: e[k] for k in ("step", "loss", "step_s", "time", "batch_s", "compile_s",
                               "compile_wait_s", "xla_compiles",
                               "cache_hits", "devices", "mesh", "microbatches", "procs",
                               "devices_per_proc")}
      rec.update({k: e[k] for k in ("batch_crc", "generation", "dispatch_s", "step_cpu_s")
                  if k in e})
      rec.update(reconfig_s=0.0, reconfig_bytes=0)
      if pending is not None and pending["step"] == e["step"]:
        if pending.get("failed_step") is not None:  # a restart after a failure
          failed = pending["failed_step"]
          fail = next((f for f in failures if f["step"] == failed), {})
          if fail in failures:
            failures.remove(fail)
          base = fail.get("failed_at", pending["start_time"])
          rec.update(recovered=True, failed_step=failed, restored_step=e["step"],
                     steps_lost=failed - e["step"], steps_redone=pending["lost"],
                     recovery_s=e["time"] - base, failure=fail,
                     layout_from_search=pending.get("layout_from_search", False))
        else:
          base = saves[e["step"]]["time"]
          exits = _exit_times(job_dir, prev.get("generation"))
          if exits:  # the old processes' exit, from the save call (the launcher's)
            rec["old_exit_s"] = max(exits) - base
        local, net = _restore_bytes(job_dir, pending["generation"])
        rec.update(reconfig_s=pending["restored_time"] - base,
                   relaunch_s=pending["start_time"] - base,
                   import_s=pending["import_s"], init_s=pending["init_s"],
                   distributed_s=pending["init_s"], restore_s=pending["restore_s"],
                   resize_s=e["time"] - base, standby=pending["standby"],
                   first_step_s=e["step_s"], first_batch_s=e["batch_s"],
                   ahead=bool(pending.get("ahead")),
                   xla_compiles_procs=_compiles(job_dir, pending["generation"]),
                   reconfig_bytes=local + net, network_bytes=net,
                   # (none before a restart of the first generation)
                   resized_from=prev and prev["mesh"], procs_from=prev and prev["procs"])
        if pending.get("restore"):  # process 0's restore: manifest, plan, read, build
          rec["restore_parts_s"] = pending["restore"]["seconds"]
        restored = [t for (t,) in _compiles(job_dir, pending["generation"],
                                            ("restored_time",)) if t is not None]
        if restored:  # every process's restore: the first step waits for the slowest
          rec["restored_procs_s"] = [t - base for t in restored]
        if rec["ahead"]:  # started ahead: the turn's hand-over, and any wait for the
          a = pending["ahead_s"]  # preparation to finish
          if a.get("saved_time"):  # the old processes' save, of the hand-over
            rec["save_s"] = a["saved_time"] - base
          rec.update(ahead_s=a, handoff_s=a["handed_time"] - base,
                     ahead_wait_s=max(0.0, pending["start_time"] - a["handed_time"]),
                     ahead_margin_s=base - a["ready_time"])
          if a.get("started_time"):  # how long before the save it was started
            rec["ahead_lead_s"] = base - a["started_time"]
        rec["compile_cache_hit"] = bool(rec["xla_compiles_procs"]) and all(
            c == 0 and h > 0 for c, h in rec["xla_compiles_procs"])
        pending = None
      out.append(rec)
      prev = rec
  return out


def _exit_times(job_dir, generation):
  """When the processes of ``generation`` exited for a resize (the launcher's
  ``exited_<generation>.json``), or ``[]``."""
  try:
    with open(os.path.join(job_dir, f"exited_{generation}.json")) as f:
      return [t for t in json.load(f)["exit_times"] if t is not None]
  except (FileNotFoundError, ValueError, KeyError):
    return []


def _failures(job_dir):
  """The launcher's failure records (``failures.jsonl``: the failed step, when the
  process died, detection and restart times), in order."""
  try:
    with open(os.path.join(job_dir, "failures.jsonl")) as f:
      return [json.loads(x) for x in f if x.strip()]
  except FileNotFoundError:
    return []


# Seconds a generation started ahead may take to get ready (--prepare-timeout; its
# imports, jax.distributed, compile and warm-up step take 10-30 s on a loaded 2-core
# host for these configs).
PREPARE_TIMEOUT = 120.0

# Seconds a running generation's process may go without a step (--step-timeout; until
# its first step the worker marks itself alive, so imports and compiles are not in it)
# before the launcher takes it for hung and restarts the generation on as many
# processes from the last save (a step deadlocked by jaxlib 0.10.2's XLA:CPU gloo
# collectives, for one: docs/pipeline.md).
STEP_TIMEOUT = 300.0

# What the launcher's standby processes import before their rank comes (the
# launcher's default list, and this script's own modules that only define).
STANDBY_IMPORTS = ("jax", "jax.numpy", "numpy", "flax", "flax.linen",
                   "flax.training.train_state", "optax", "tenplex_jax",
                   "tenplex_jax.store.api", "tenplex_jax.data", "config", "model", "data")


def run_procs(args, cfg, phases, plan, log=print, trainer=None):
  """Runs the elastic job across processes with ``tenplex-jax launch``;
  returns ``(records, final params)``. ``trainer`` (default
  :data:`LM_TRAINER`) names the script the launcher runs and the model's
  parts. The job directory (``tenplex-lm-*`` in ``/dev/shm``) is removed on
  the way out, also after a timeout or an interruption, but for a job that
  failed (kept and named, for its logs)."""
  from tenplex_jax import store
  from tenplex_jax.store.launch import launch

  tr = trainer or LM_TRAINER
  parent = getattr(args, "job_parent", None)
  job = tempfile.mkdtemp(prefix="tenplex-lm-", dir=parent or (
      "/dev/shm" if os.path.isdir("/dev/shm") else None))
  records = os.path.join(job, "lm_records.jsonl")
  cmd = [sys.executable, os.path.abspath(tr.script), "--worker", "--procs",
         ",".join(map(str, plan)), "--records", records, "--schedule", args.schedule,
         "--steps", str(args.steps), "--config", args.config]
  cmd += ["--search"] * args.search + ["--remat"] * args.remat + \
      ["--fast-compile"] * args.fast_compile + \
      ["--no-prepare"] * getattr(args, "no_prepare", False)
  if args.deterministic is not None:
    cmd += ["--deterministic", str(args.deterministic)]
  every = getattr(args, "snapshot_every", 0) or 0
  if every:
    cmd += ["--snapshot-every", str(every)]
  if getattr(args, "kill_at", None) is not None:
    cmd += ["--kill-at", str(args.kill_at)]
  if getattr(args, "hang_ahead", None):
    cmd += ["--hang-ahead", os.path.abspath(args.hang_ahead)]
  if getattr(args, "hang_at", None) is not None:
    cmd += ["--hang-at", str(args.hang_at)]
  log(f"tenplex-jax launch: {plan[0]} processes x {phases[0].devices // plan[0]} devices;"
      f" processes per phase {plan}")
  keep = False  # a failed job's directory (its logs, failures.jsonl), named
  try:
    with warnings.catch_warnings():
      # The launcher's children exec at once (no jax in them before exec).
      warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
      code = launch(cmd, procs=plan[0], devices_per_proc=phases[0].devices // plan[0],
                    job_dir=job, timeout=args.timeout,
                    # without snapshots a failure would repeat steps: it ends the job
                    max_restarts=3 if every else 0, on_failure="shrink",
                    standby=not getattr(args, "no_standby", False),
                    compilation_cache=not getattr(args, "no_compilation_cache", False),
                    standby_imports=STANDBY_IMPORTS,
                    prepare_nice=getattr(args, "prepare_nice", 10),
                    # a generation started ahead that hangs in its warm-up (jaxlib
                    # 0.10.2's gloo communicators can deadlock there) is stopped and
                    # prepared again, not waited for until --timeout
                    prepare_timeout=getattr(args, "prepare_timeout", PREPARE_TIMEOUT),
                    # (from the warm-up step on, if given: however long the compile)
                    warmup_timeout=getattr(args, "warmup_timeout", None),
                    # a step that hangs: stopped after --step-timeout and run again
                    # from the last save on as many processes, in the phase's layout
                    # (repeating the steps since that save from the same state and
                    # data, also without snapshots)
                    step_timeout=getattr(args, "step_timeout", STEP_TIMEOUT) or None,
                    on_hang="same", hang_restarts=2)
    if code != 0:
      keep = True
      raise SystemExit(f"the job across processes failed (exit code {code}); its"
                       f" directory {job} is kept (logs, failures.jsonl)")
    elastic = assemble(records, job)
    # The final state, from the stores, onto this process's devices.
    mesh, rules, _ = tr.layout(phases[-1], cfg, jax.devices(), search=args.search,
                               global_batch=configs.GLOBAL_BATCH)
    _, abstract = tr.state(cfg, mesh, rules, configs.LEARNING_RATE)
    stores = sorted(os.listdir(os.path.join(job, "store")), key=int)
    tree = store.restore([os.path.join(job, "store", d) for d in stores],
                         {"train": abstract, "data": ""})
    params = tr.params(tree["train"])
  finally:
    # Also after the launcher's timeout or a signal to it (it stopped every
    # process and store server first) and any error here: the job's stores
    # and compilation cache are in host memory.
    if not keep:
      shutil.rmtree(job, ignore_errors=True)
  return elastic, params


LM_TRAINER = Trainer(
    script=__file__, process_start=_PROCESS_START, dataset=dataset, layout=layout,
    state=state_and_target, step=_compiled_step,
    params=lambda state: jax.tree.map(np.asarray, nn.unbox(state.params)),
    check_deterministic=check_deterministic, step_waits=True)


def static_run(phases, steps, cfg, *, search, deterministic, compiler_options, final,
               cache=None):
  """The static run: ``steps`` steps on the first phase's layout, no resize.

  ``cache`` (tests), a directory: the records and final params of a static run
  with the same arguments are read from there when one saved them, else this
  run saves its own. One run at a time per arguments (a file lock), so that
  two jobs that compare with the same static run compute it once.
  """
  def run():
    return train(phases[:1], steps, cfg, search=search, log=lambda *_: None,
                 deterministic=deterministic, compiler_options=compiler_options, final=final)

  if cache is None:
    return run()
  key = json.dumps([dataclasses.asdict(cfg), steps, repr(phases[0]), search, deterministic,
                    compiler_options, [str(d) for d in jax.devices()], _code_digest(),
                    os.environ.get("XLA_FLAGS", ""),
                    jax.config.values.get("jax_disable_most_optimizations")],
                   sort_keys=True)
  os.makedirs(cache, exist_ok=True)
  base = os.path.join(cache, hashlib.sha256(key.encode()).hexdigest()[:16])
  with open(base + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
    if os.path.exists(base + ".json"):  # written last: the entry is whole
      with np.load(base + ".npz") as z:
        final["params"] = [z[f"p{i}"] for i in range(len(z.files))]
      with open(base + ".json") as f:
        return json.load(f)
    records = run()
    leaves = jax.tree.leaves(final["params"])
    np.savez(base + ".npz", **{f"p{i}": x for i, x in enumerate(leaves)})
    with open(base + ".json.tmp", "w") as f:
      json.dump(records, f)
    os.replace(base + ".json.tmp", base + ".json")
    return records


@functools.cache
def _code_digest():
  """SHA-256 of the examples' and tenplex_jax's Python sources: a static run
  cached by an older version of the code (other init or step bits) is not
  read back."""
  h = hashlib.sha256()
  examples = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for top in (examples, os.path.dirname(tj.__file__)):
    for d, _, files in sorted(os.walk(top)):  # (sorted by directory)
      for name in sorted(files):
        if name.endswith(".py"):
          h.update(os.path.relpath(os.path.join(d, name), top).encode())
          with open(os.path.join(d, name), "rb") as f:
            h.update(f.read())
  return h.hexdigest()


def _compiler_options(args):
  # Optimisation level 0 halves the compile time of each new mesh's step
  # (the demo's budget) at some cost in step time.
  return {"xla_backend_optimization_level": 0} if args.fast_compile else None


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
      procs = f" ({r['procs']}x{r['devices_per_proc']})" if "procs" in r else ""
      ax.annotate(f"{r['devices']} dev{procs}  d{m['data']} f{m['fsdp']} t{m['tensor']}"
                  f" s{m['stage']}\n"
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
  ap.add_argument("--deterministic", type=int, metavar="V",
                  help="sum each batch's gradient over V virtual workers in a fixed order"
                  " (tenplex_jax.determinism): bitwise identical to the static run when every"
                  " phase's data x fsdp degree divides V (any tensor and stage degrees)")
  ap.add_argument("--procs", metavar="P1,P2,...",
                  help="run across processes with tenplex-jax launch: processes per phase"
                  " (each phase's devices split evenly over them; 'auto': 2 for phases of"
                  " 4+ devices, else 1); the state moves through the per-host stores")
  ap.add_argument("--timeout", type=float, default=900,
                  help="seconds for the whole job across processes (default 900)")
  ap.add_argument("--fast-compile", action="store_true",
                  help="compile with XLA optimisation level 0 (faster compiles, slower steps;"
                  " not with --deterministic, whose bits it would change)")
  ap.add_argument("--no-standby", action="store_true",
                  help="(with --procs) start each generation's processes afresh instead of"
                  " handing the resize to the launcher's standby processes (Python, jax,"
                  " flax, optax imported)")
  ap.add_argument("--no-compilation-cache", action="store_true",
                  help="(with --procs) no persistent compilation cache in the job"
                  " directory: every generation compiles its step")
  ap.add_argument("--no-prepare", action="store_true",
                  help="(with --procs) do not have the launcher start the next phases'"
                  " processes ahead (store.expect_resizes): each resize then imports (or takes"
                  " a standby), starts jax.distributed and compiles (or loads) after the save")
  ap.add_argument("--prepare-nice", type=int, default=10, metavar="N",
                  help="(with --procs) nice increment of the generations started ahead"
                  " while they prepare (tenplex-jax launch --prepare-nice; default 10, 0:"
                  " the running generation's priority)")
  ap.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                  help="(with --procs) save a snapshot every K steps (store.save_snapshot):"
                  " a failed process then restarts the job on one process fewer from the"
                  " newest snapshot (up to 3 times), in the generation the launcher prepared"
                  " for it (the configuration search's layout of the remaining processes'"
                  " devices, its step compiled; unless --no-prepare). Default 0: none, a"
                  " failure ends the job")
  ap.add_argument("--prepare-timeout", type=float, default=PREPARE_TIMEOUT,
                  metavar="SECONDS",
                  help="(with --procs) seconds a generation started ahead may take to get"
                  " ready (imports, jax.distributed, compile, warm-up step); past it the"
                  " launcher stops it and prepares it again, or starts the resize's"
                  " processes afresh at its turn (tenplex-jax launch --prepare-timeout;"
                  f" default {PREPARE_TIMEOUT:g})")
  ap.add_argument("--warmup-timeout", type=float, default=None, metavar="SECONDS",
                  help="(with --procs) seconds a process of a generation started ahead may"
                  " take from the end of its compile (its warm-up step, where jaxlib's gloo"
                  " communicators are made) to ready; past it the launcher handles the"
                  " generation as past --prepare-timeout (tenplex-jax launch"
                  " --warmup-timeout; default: none)")
  ap.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT, metavar="SECONDS",
                  help="(with --procs) seconds a process may go without a step (until its"
                  " first step it counts as alive: compiles and the restore are not in"
                  " it) before the launcher stops the generation as hung and runs it again on as many processes"
                  " from the last save, up to twice (tenplex-jax launch --step-timeout;"
                  f" default {STEP_TIMEOUT:g}, 0: no limit)")
  # (tests) the first process to reach step STEP hangs before it (see _hang_once)
  ap.add_argument("--hang-at", type=int, metavar="STEP", help=argparse.SUPPRESS)
  # (tests) the process of the highest rank SIGKILLs itself before step STEP, once the
  # generation prepared for the failure is ready; the job directory's parent
  ap.add_argument("--kill-at", type=int, metavar="STEP", help=argparse.SUPPRESS)
  # (tests) the first process of a generation started ahead to finish its warm-up hangs,
  # its pid in this marker file (see _hang_once)
  ap.add_argument("--hang-ahead", metavar="MARKER", help=argparse.SUPPRESS)
  ap.add_argument("--job-parent", metavar="DIR", help=argparse.SUPPRESS)
  # (tests) the static run's records and final params, shared by the runs that
  # compare with the same static run (see static_run)
  ap.add_argument("--static-cache", metavar="DIR", help=argparse.SUPPRESS)
  ap.add_argument("--worker", action="store_true",
                  help="(internal) one process of the --procs job, under tenplex-jax launch")
  ap.add_argument("--records", metavar="PATH",
                  help="(with --worker) append the per-step records here")
  args = ap.parse_args(argv)
  if args.snapshot_every < 0:
    ap.error(f"--snapshot-every {args.snapshot_every}: expected a step count >= 0")
  if args.step_timeout < 0:
    ap.error(f"--step-timeout {args.step_timeout:g}: expected seconds >= 0 (0: no limit)")
  cfg = dataclasses.replace(configs.CONFIGS[args.config], remat=args.remat)
  try:
    phases = configs.parse(args.schedule)
    plan = procs_plan(phases, args.procs) if args.procs else None
  except ValueError as e:
    ap.error(str(e))
  if args.worker:
    if plan is None or not args.records:
      ap.error("--worker needs --procs and --records (it runs under tenplex-jax launch)")
    worker(args, cfg, phases, plan)
    return None
  need = max(p.devices for p in phases)
  if need > len(jax.devices()):
    ap.error(f"the schedule needs {need} devices, {len(jax.devices())} available")
  v, opts = args.deterministic, _compiler_options(args)
  if v is not None:
    try:
      check_deterministic(phases, v, [layout(p, cfg, jax.devices(), search=args.search,
                                             global_batch=configs.GLOBAL_BATCH)
                                      for p in phases])
    except ValueError as e:
      ap.error(str(e))
  el_final, st_final = {}, {}
  if plan is not None:
    elastic, el_final["params"] = run_procs(args, cfg, phases, plan)
  else:
    elastic = train(phases, args.steps, cfg, search=args.search, deterministic=v,
                    compiler_options=opts, final=el_final)
  static = static_run(phases, args.steps, cfg, search=args.search, deterministic=v,
                      compiler_options=opts, final=st_final, cache=args.static_cache)
  diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(elastic, static))
  pdiff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(el_final["params"]), jax.tree.leaves(st_final["params"])))
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
            jax.tree.leaves(el_final["params"]), jax.tree.leaves(st_final["params"])))
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
    plot(elastic, static, args.plot)
  return diff


if __name__ == "__main__":
  main()
