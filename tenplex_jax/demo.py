"""The elastic training demo: a Flax model re-meshed while it trains.

``tenplex-jax demo`` is a short run of the LM trainer in ``examples/lm``
(:func:`run_lm`): a linen decoder-only LM whose stacked layers run as a
GPipe pipeline over the mesh's ``stage`` axis, re-meshed 8 -> 4 -> 2 -> 8
devices with changing (data, fsdp, tensor, stage) degrees by
:func:`tenplex_jax.remesh`, then compared with a run that never resized.

:func:`run` is the earlier, smaller demo the tests use: an MLP with
logically partitioned parameters re-meshed over (data, tensor) layouts. In
both, the global batch and the sample order never depend on the devices,
so the loss curve equals that of a run that never resized (up to float
reduction order).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import determinism
from tenplex_jax.data import ElasticIterator
from tenplex_jax.errors import UsageError
from tenplex_jax.remesh import RemeshReport, remesh

__all__ = ["DemoResult", "LM_SCHEDULE", "LMDemoResult",
           "Phase", "RULES", "MLP", "TrainState", "create_state",
           "default_schedule", "deterministic_train_step", "load_lm_trainer",
           "make_mesh", "run", "run_lm", "train_step"]

# Logical axis -> mesh axis.
RULES = (("batch", "data"), ("embed", None), ("mlp", "tensor"),
         ("classes", None))


class MLP(nn.Module):
  """Two dense layers, kernels partitioned over ('embed', 'mlp')."""

  hidden: int = 64
  classes: int = 8

  @nn.compact
  def __call__(self, x):
    part = nn.with_logical_partitioning
    x = nn.Dense(self.hidden,
                 kernel_init=part(nn.initializers.lecun_normal(),
                                  ("embed", "mlp")),
                 bias_init=part(nn.initializers.zeros, ("mlp",)))(x)
    x = nn.gelu(x)
    x = nn.Dense(self.hidden,
                 kernel_init=part(nn.initializers.lecun_normal(),
                                  ("mlp", "embed")))(x)
    x = nn.gelu(x)
    return nn.Dense(self.classes,
                    kernel_init=part(nn.initializers.lecun_normal(),
                                     ("embed", "classes")))(x)


class TrainState(train_state.TrainState):
  """A linen TrainState that also carries a PRNG key (for dropout etc.)."""

  rng: jax.Array


@dataclasses.dataclass(frozen=True)
class Phase:
  """From ``step`` on, train on ``devices`` devices as data x tensor."""

  step: int
  data: int
  tensor: int

  @property
  def devices(self) -> int:
    return self.data * self.tensor


def default_schedule() -> tuple[Phase, ...]:
  """8 -> 4 -> 2 -> 8 devices, changing the data and tensor degrees."""
  return (Phase(0, 4, 2), Phase(10, 2, 2), Phase(20, 1, 2), Phase(30, 2, 4))


def make_mesh(phase: Phase, devices: Sequence[Any] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < phase.devices:
    raise ValueError(f"phase at step {phase.step} needs {phase.devices}"
                     f" devices, {len(devices)} exist")
  grid = np.array(devices[:phase.devices]).reshape(phase.data, phase.tensor)
  return Mesh(grid, ("data", "tensor"))


def create_state(mesh: Mesh, *, features: int = 16, seed: int = 0,
                 learning_rate: float = 3e-3) -> TrainState:
  """Initialises the train state directly on ``mesh`` (no host copy)."""
  model = MLP()

  def init(key):
    params = model.init(key, jnp.ones((1, features)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params,
                             tx=optax.adamw(learning_rate),
                             rng=jax.random.key(seed + 1))

  abstract = jax.eval_shape(init, jax.random.key(seed))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract),
                                          mesh, RULES)
  return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


@jax.jit
def train_step(state: TrainState, x: jax.Array, y: jax.Array):
  """One AdamW step of softmax cross-entropy; returns (state, loss)."""
  rng, _ = jax.random.split(state.rng)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads).replace(rng=rng), loss


def deterministic_train_step(mesh: Mesh, virtual_workers: int):
  """:func:`train_step` with :func:`tenplex_jax.determinism.value_and_grad`.

  The global batch is split into ``virtual_workers`` slices whose gradients
  are summed in one fixed order, so the step gives the same bits on every
  mesh whose ``data`` axis divides ``virtual_workers``.
  """
  model = MLP()

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()

  grad = determinism.value_and_grad(loss_fn, virtual_workers=virtual_workers,
                                    mesh=mesh, batch_axis="data")

  def step(state, x, y):
    rng, _ = jax.random.split(state.rng)
    loss, grads = grad(state.params, {"x": x, "y": y})
    return state.apply_gradients(grads=grads).replace(rng=rng), loss

  return determinism.jit(step)


def make_dataset(n: int = 2048, features: int = 16, classes: int = 8,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """A synthetic classification task: labels from a fixed random teacher."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype(np.float32)
  w = rng.normal(size=(features, classes)).astype(np.float32)
  y = np.argmax(np.tanh(x @ w) + 0.1 * rng.normal(size=(n, classes)), -1)
  return x, y.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class DemoResult:
  losses: tuple[float, ...]
  reports: tuple[tuple[int, RemeshReport], ...]
  params: Any = None  # the final params, on the host (numpy)


def run(schedule: Sequence[Phase] = default_schedule(), *, steps: int = 40,
        global_batch: int = 32, seed: int = 0, log=None,
        deterministic: int | None = None) -> DemoResult:
  """Trains for ``steps`` steps, re-meshing at every phase of ``schedule``.

  Batches come from :class:`tenplex_jax.data.ElasticIterator`, one iterator
  per data-parallel shard. At a resize the dataset state is taken from the
  old iterators and given to new ones with the new shard count: the global
  batch of every step is the same whatever the device count.
  """
  x_all, y_all = make_dataset(seed=seed)
  source = [{"x": x, "y": y} for x, y in zip(x_all, y_all)]
  phases = sorted(schedule, key=lambda p: p.step)
  if not phases or phases[0].step != 0:
    raise ValueError("the schedule must start with a phase at step 0")

  def iterators(mesh, data_state):
    its = [ElasticIterator(source, global_batch_size=global_batch, seed=seed,
                           shard_index=i, shard_count=mesh.shape["data"])
           for i in range(mesh.shape["data"])]
    for it in its:
      if data_state is not None:
        it.set_state(data_state)
    return its

  if deterministic is not None:
    bad = [p for p in phases if deterministic % p.data]
    if bad:
      raise ValueError(f"deterministic={deterministic}: the data degree"
                       f" {bad[0].data} of the phase at step {bad[0].step}"
                       f" does not divide it")

  def step_for(mesh):
    if deterministic is None:
      return train_step
    return deterministic_train_step(mesh, deterministic)

  mesh = make_mesh(phases[0])
  step_fn = step_for(mesh)
  state = create_state(mesh, seed=seed)
  its = iterators(mesh, None)
  losses, reports = [], []
  next_phase = 1
  for t in range(steps):
    if next_phase < len(phases) and phases[next_phase].step == t:
      data_state = its[0].get_state()
      for it in its:
        it.close()
      mesh = make_mesh(phases[next_phase])
      state, report = remesh(state, mesh, rules=RULES)
      its = iterators(mesh, data_state)
      step_fn = step_for(mesh)
      reports.append((t, report))
      if log:
        log(f"step {t}: {report}")
      next_phase += 1
    sharding = NamedSharding(mesh, P("data"))
    parts = [next(it) for it in its]
    xs = np.concatenate([p["x"] for p in parts])
    ys = np.concatenate([p["y"] for p in parts])
    state, loss = step_fn(state, jax.device_put(xs, sharding),
                          jax.device_put(ys, sharding))
    losses.append(float(loss))
    if log and (t % 5 == 0 or t == steps - 1):
      log(f"step {t:3d}  devices {mesh.size}  data {mesh.shape['data']}"
          f"  tensor {mesh.shape['tensor']}  loss {losses[-1]:.4f}")
  for it in its:
    it.close()
  return DemoResult(tuple(losses), tuple(reports),
                    jax.tree_util.tree_map(np.asarray, state.params))


# ------------------------------------------------------ the LM trainer's run

# 8 -> 4 -> 2 -> 8 devices, every phase another (data, fsdp, tensor, stage);
# the stage count goes 2 -> 2 -> 1 -> 2. The last layout is the first one's,
# so its step is compiled once (the demo's time is mostly compilation).
LM_SCHEDULE = ("0:data=2,tensor=2,stage=2 6:fsdp=2,stage=2 12:tensor=2"
               " 18:data=2,tensor=2,stage=2")
_LM_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"
_LM_MODULE = "tenplex_jax_examples_lm_train"


def load_lm_trainer():
  """``examples/lm/train.py`` as a module (with its ``model`` and ``config``).

  The LM trainer lives in the source checkout's ``examples/lm`` (as flax's
  own examples do), next to this package; an editable install
  (``pip install -e .``) finds it.

  Raises:
    UsageError: the checkout's ``examples/lm`` is not there.
  """
  if _LM_MODULE in sys.modules:
    return sys.modules[_LM_MODULE]
  if not (_LM_DIR / "train.py").is_file():
    raise UsageError(f"the demo runs the LM trainer in {_LM_DIR}, which is not there:"
                     " install tenplex_jax from its source checkout"
                     " (python3 -m pip install -e .)")
  # train.py imports `model` and `config` from its directory: load those
  # first under their names (the ones another example may have put in
  # sys.modules are set aside meanwhile and put back).
  saved = {n: sys.modules.pop(n) for n in ("model", "config") if n in sys.modules}
  try:
    for name, file in (("model", "model.py"), ("config", "config.py"),
                       (_LM_MODULE, "train.py")):
      spec = importlib.util.spec_from_file_location(name, _LM_DIR / file)
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      spec.loader.exec_module(module)
  except BaseException:
    sys.modules.pop(_LM_MODULE, None)
    raise
  finally:
    for n in ("model", "config"):
      sys.modules.pop(n, None)
    sys.modules.update(saved)
  return sys.modules[_LM_MODULE]


@dataclasses.dataclass(frozen=True)
class LMDemoResult:
  """The elastic and the static run of :func:`run_lm`.

  ``elastic``/``static``: one record per step (loss, devices, mesh degrees,
  microbatches, step and compile seconds, reconfiguration seconds and
  bytes); ``reports``: ``(step, RemeshReport)`` per resize;
  ``max_abs_loss_diff``; ``bitwise_identical``: with ``deterministic``,
  whether the losses and the final params have the static run's bits.
  """

  elastic: tuple[dict, ...]
  static: tuple[dict, ...]
  reports: tuple[tuple[int, RemeshReport], ...]
  max_abs_loss_diff: float
  bitwise_identical: bool | None


def run_lm(schedule: str = LM_SCHEDULE, *, steps: int = 24,
           deterministic: int | None = None, plot: str | None = None,
           log=None) -> LMDemoResult:
  """The LM trainer's short run: re-meshed by ``schedule``, then a static run.

  Args:
    schedule: phases ``"STEP:AXIS=N,... ..."`` (``examples/lm/config.py``).
    steps: training steps of each run.
    deterministic: ``V`` virtual workers (``tenplex_jax.determinism``):
      every phase needs a data x fsdp degree dividing ``V`` (any tensor and
      stage degrees: each worker's slice runs through the pipeline).
    plot: save the loss curves (PNG) here.
    log: called with each step's line and each reconfiguration report.

  Steps are compiled at XLA optimisation level 0 (half the compile time of
  each new mesh, slower steps: a demo is mostly compilation), except with
  ``deterministic``: level 0 code is not bitwise the same for a whole array
  and for its shards.

  Example:
    >>> r = run_lm(steps=24, plot="lm.png")  # doctest: +SKIP
    >>> r.max_abs_loss_diff < 1e-5  # doctest: +SKIP
    True
  """
  lm = load_lm_trainer()
  phases = lm.configs.parse(schedule)
  cfg = lm.configs.TINY
  opts = {"xla_backend_optimization_level": 0}
  reports, el_final, st_final = [], {}, {}
  elastic = lm.train(phases, steps, cfg, log=log or (lambda *_: None),
                     deterministic=deterministic, compiler_options=opts,
                     final=el_final, reports=reports)
  static = lm.train(phases[:1], steps, cfg, log=lambda *_: None,
                    deterministic=deterministic, compiler_options=opts,
                    final=st_final)
  diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(elastic, static))
  same = None
  if deterministic is not None:
    same = [r["loss"] for r in elastic] == [r["loss"] for r in static] and all(
        np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(
            jax.tree.leaves(el_final["params"]), jax.tree.leaves(st_final["params"])))
  if plot:
    lm.plot(elastic, static, plot)
  return LMDemoResult(tuple(elastic), tuple(static), tuple(reports), diff, same)
