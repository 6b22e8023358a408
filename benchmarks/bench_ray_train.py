"""The training script of ``bench_ray.py`` (run by every Ray worker).

A 6-layer tanh MLP (``BENCH_LAYERS`` x ``BENCH_DIM``^2 float32 weights, rows
sharded over every worker's device) trained with Adam written out
(``{"params", "mu", "nu", "count"}``): 3 x 6 x 4096^2 x 4 B = 1.13 GiB of
state. At every resize step the generation's transition mode
(``BENCH_MODES``, comma separated, cycled by generation) decides how the
state travels to the next worker group:

* ``tenplex``: ``save_snapshot`` to the node's tenplex store (``/dev/shm``),
  the next group restores with ``restore_or_init`` (own node, then peers);
* ``ray``: Ray Train's path: every worker writes its shards into one Orbax
  checkpoint (``StandardCheckpointer``, as Ray's JAX examples do) under the
  run's ``RunConfig(storage_path=..., name=...)`` directory, and the next
  group opens it as a ``ray.train.Checkpoint`` and restores it with Orbax.

Each process appends its timestamps to ``BENCH_OUT/times.jsonl``: the
signal, the save, and its milestones in the order it reached them (the
script's start, its imports, ``jax.distributed``, the setup, then for
``ray`` the restore and the compilation; for ``tenplex`` the compilation,
from the restore's target, the turn, which a group started ahead of the
resize waits for in ``restore_or_init``, and the restore), then the
first step. The driver (``bench_ray.py``)
resizes the group (``request_resize``) while it runs; group ``BENCH_RESIZES``
(the last) stops after ``BENCH_K`` steps.
"""

import importlib
import json
import os
import time

T_START = time.time()

import jax  # noqa: E402  (imports first: none starts jax's backends)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402  (both modes pay the import)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from ray.train import Checkpoint  # noqa: E402

from tenplex_jax import store  # noqa: E402
from tenplex_jax.ray import ResizeExit  # noqa: E402
from tenplex_jax.store import save_checkpoint  # noqa: E402

T_IMPORTED = time.time()
info = store.initialize()  # jax.distributed
T_INIT = time.time()

LAYERS = int(os.environ.get("BENCH_LAYERS", "6"))
D = int(os.environ.get("BENCH_DIM", "4096"))
BATCH, LR = 8, 1e-4
MODES = os.environ["BENCH_MODES"].split(",")
OUT, CKPT = os.environ["BENCH_OUT"], os.environ["BENCH_CKPT"]
RESIZES = int(os.environ["BENCH_RESIZES"])
K = int(os.environ.get("BENCH_K", "3"))  # the last group's steps
gen, proc = info["generation"], info["process_id"]

mesh = Mesh(np.array(jax.devices()), ("data",))
sh, rep = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())


def record(**kw):
  with open(os.path.join(OUT, "times.jsonl"), "a") as f:
    f.write(json.dumps({"gen": gen, "proc": proc,
                        "procs": info["num_processes"], **kw}) + "\n")


def init():
  def make():
    ps = {f"w{i}": jax.random.normal(jax.random.key(i), (D, D)) * 0.02
          for i in range(LAYERS)}
    zeros = {k: jnp.zeros_like(v) for k, v in ps.items()}
    return {"params": ps, "mu": zeros, "nu": dict(zeros),
            "count": jnp.zeros((), jnp.int32)}
  shard = {k: sh for k in (f"w{i}" for i in range(LAYERS))}
  return jax.jit(make, out_shardings={"params": shard, "mu": shard,
                                      "nu": shard, "count": rep})()


target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                   sharding=sh if a.ndim == 2 else rep),
    jax.eval_shape(init))


def train_step(state, x):
  def loss_fn(ps):
    h = x
    for i in range(LAYERS):
      h = jnp.tanh(h @ ps[f"w{i}"])
    return jnp.mean(h ** 2)
  loss, g = jax.value_and_grad(loss_fn)(state["params"])
  c = state["count"] + 1
  mu = jax.tree.map(lambda m, d: 0.9 * m + 0.1 * d, state["mu"], g)
  nu = jax.tree.map(lambda v, d: 0.999 * v + 0.001 * d * d, state["nu"], g)
  cf = c.astype(jnp.float32)
  scale = LR * jnp.sqrt(1 - 0.999 ** cf) / (1 - 0.9 ** cf)
  ps = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + 1e-8),
                    state["params"], mu, nu)
  return {"params": ps, "mu": mu, "nu": nu, "count": c}, loss


def batch(step):
  return jax.device_put(np.random.default_rng(step).normal(
      size=(BATCH, D)).astype(np.float32), rep)


mode_in = MODES[(gen - 1) % len(MODES)] if gen else None
t_setup = time.time()
step_fn = jax.jit(train_step, donate_argnums=0)
if mode_in == "ray":  # Ray Train's path: the run's checkpoint, with Orbax
  step = int(os.environ["TENPLEX_START_STEP"])
  ckpt = Checkpoint.from_directory(os.path.join(CKPT, f"step_{step:010d}"))
  with ckpt.as_directory() as path:
    ckptr = ocp.StandardCheckpointer()
    state = ckptr.restore(path, target)
    ckptr.close()
  jax.block_until_ready(state)
  t_restored = time.time()
  x = batch(step)
  compiled = step_fn.lower(state, x).compile()
  t_compiled = time.time()
  marks = [("restore", t_restored), ("compile", t_compiled)]
else:
  # tenplex: the step needs the state's shapes and shardings only, so it
  # is compiled (or loaded from the cache) from the restore's target
  # first; a group the driver started ahead of the resize does that
  # before the previous group has saved, then waits for its turn.
  compiled = step_fn.lower(
      target, jax.ShapeDtypeStruct((BATCH, D), jnp.float32,
                                   sharding=rep)).compile()
  t_compiled = time.time()
  # (started ahead: waits for its turn, then restores)
  state, step = store.restore_or_init(init, target)
  jax.block_until_ready(state)
  t_restored = time.time()
  turn = store.wait_turn()  # when it waited and saw its turn, if it did
  x = batch(step)
  marks = [("compile", t_compiled), ("turn", turn.get("seen", t_compiled)),
           ("restore", t_restored)]
state, loss = compiled(state, x)
loss = float(loss)  # a global result: every worker has finished the step
step += 1
t_first = time.time()
first = step - 1
record(kind="start", mode=mode_in, step=step - 1, marks=[
    ("relaunch", T_START), ("imports", T_IMPORTED), ("distributed", T_INIT),
    ("setup", t_setup), *marks, ("step", t_first)],
       standby="TENPLEX_STANDBY_READY" in os.environ,
       prepared=os.environ.get("TENPLEX_TURN_FILE") == "ray",
       cache=bool(jax.config.jax_compilation_cache_dir),
       t_first=t_first, restored=importlib.import_module(
           "tenplex_jax.store.launch").last_restore.get("report"))
if mode_in == "ray" and proc == 0:  # the consumed checkpoint (not timed)
  import shutil
  shutil.rmtree(os.path.join(CKPT, f"step_{step - 1:010d}"),
                ignore_errors=True)
last, step_s = t_first, None
while True:
  m = store.resize_due(step)
  if m is not None:
    t_signal = time.time()
    mode_out = MODES[gen % len(MODES)]
    if mode_out == "ray":
      save_checkpoint(CKPT, state, step)  # Orbax, every process its shards
    else:
      # this node's tenplex store, each array deleted once written (as
      # save_and_exit does)
      store.save_snapshot(state, step, delete_arrays=True)
    record(kind="save", mode=mode_out, step=step, t_signal=t_signal,
           t_saved=time.time(), step_s=step_s)
    raise ResizeExit(m, step)  # what save_and_exit raises after its save
  if gen >= RESIZES and step >= first + K:
    break
  x = batch(step)
  state, loss = compiled(state, x)
  loss = float(loss)
  step += 1
  now = time.time()
  step_s, last = now - last, now
