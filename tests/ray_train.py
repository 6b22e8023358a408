"""A toy training script that runs under ``tenplex-jax launch`` and ``tenplex_jax.ray``.

  python tests/ray_train.py TOTAL_STEPS LOG_DIR

A data-parallel "model" ``w`` (float32[12], sharded over every device of
the job) adds each step's global batch of sample ids (48 samples, batch 12,
shuffled per epoch by ``tenplex_jax.data.order``). The state holds the
step and the data position (epoch, step in the epoch). On every start it
checks that the restored state is bitwise what a static run has at that
step. Each process appends the sample ids its devices read in each step
the job completed (after the step's all-reduce) to
``LOG_DIR/ids_<generation>_<process>.jsonl``; process 0 writes
``LOG_DIR/final.json`` at the end. ``TRAIN_SLEEP=s`` sleeps s seconds
per step, ``TRAIN_SNAPSHOT_EVERY=k`` calls ``save_snapshot`` every k steps,
``TRAIN_CHECKPOINT_EVERY=k`` writes an Orbax checkpoint to the job's
checkpoint directory (``--checkpoint``, or the Ray ``RunConfig`` storage)
every k steps; ``TRAIN_LAYOUT=search`` lays ``w`` out as the configuration
search chooses for the job's devices (``w`` as a small transformer's
``embed`` axis) instead of over a 1-D ``data`` mesh. Process 0 writes its
layout to ``LOG_DIR/layout_<generation>.json``. ``TRAIN_HOLD=DIR`` makes
each group wait after its first step (once it has asked ``resize_due``)
until ``DIR/go_<generation>`` exists, and at each step of
``TRAIN_HOLD_STEPS`` (``7,9``) until ``DIR/go_<generation>_<step>``
exists: a test's driver acts at a known step however slowly the machine
runs. ``TRAIN_PREPARE_HANG=1``: process 1 of a group started ahead of its
turn (``TENPLEX_TURN_FILE`` set) hangs after ``jax.distributed`` came up,
before its restore (it never reaches its turn). Process ``p`` of group ``g`` writes to ``LOG_DIR/compiles_<g>_<p>.json``
how many programs XLA compiled for the group's first step, after the
restore (jax's backend compile requests less the persistent compilation
cache's hits).
"""

import json
import os
import sys
import time

from tenplex_jax import store

info = store.initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax.data.order import global_batch_ids  # noqa: E402

compiles = [0]  # XLA compilations in this process: jax's backend compile
# requests less those its persistent compilation cache answered (hits)


def on_duration(event, secs, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    compiles[0] += 1


def on_event(event, **_):
  if event == "/jax/compilation_cache/cache_hits":
    compiles[0] -= 1


jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)

N, B, SEED, n = 48, 12, 0, 12
mesh = Mesh(np.array(jax.devices()), ("data",))
sh = NamedSharding(mesh, P("data"))
if os.environ.get("TRAIN_LAYOUT") == "search":
  # w is the 'embed' axis of a small transformer: its layout on this
  # group's devices is the configuration search's choice.
  from flax import linen as nn

  from tenplex_jax.search import best_mesh_for, transformer_spec
  SPEC = transformer_spec(name="tiny", layers=2, hidden=48, heads=4,
                          vocab=96, seq_len=16)
  best = best_mesh_for(SPEC, jax.devices(), global_batch=B, seq_len=16,
                       restrict={"pipeline": (1,)}, max_microbatches=1,
                       remat=("none",))
  sh = nn.logical_to_mesh_sharding(P("embed"), best.mesh, best.rules)


def ids_at(step):
  return global_batch_ids(SEED, step * B // N, step % (N // B), N, B)


def expected_w(step):  # what a static run holds after `step` steps
  w = np.arange(n, dtype=np.float32)
  for t in range(step):
    w = w + ids_at(t).astype(np.float32)
  return w


def init():
  return {"w": jax.make_array_from_callback(
      (n,), sh, lambda idx: np.arange(n, dtype=np.float32)[idx]),
      "step": 0, "data": {"epoch": 0, "index": 0}}


target = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh),
          "step": 0, "data": {"epoch": 0, "index": 0}}
if (os.environ.get("TRAIN_PREPARE_HANG") and os.environ.get("TENPLEX_TURN_FILE")
    and info["process_id"] == 1):
  while True:  # a hang while preparing: killed by whoever started it
    time.sleep(1)
state, step = store.restore_or_init(init, target)
assert state["step"] == step, (state["step"], step)
assert state["data"] == {"epoch": step * B // N, "index": step % (N // B)}, (
    state["data"], step)
want = expected_w(step)
for s in state["w"].addressable_shards:  # bitwise what was saved
  assert np.asarray(s.data).tobytes() == want[s.index].tobytes(), (step, s.index)
total, log_dir = int(sys.argv[1]), sys.argv[2]
gen, proc = info["generation"], info["process_id"]
if proc == 0:  # this group's layout
  with open(os.path.join(log_dir, f"layout_{gen}.json"), "w") as f:
    json.dump({"mesh": dict(sh.mesh.shape), "spec": list(sh.spec)}, f)
log = open(os.path.join(log_dir, f"ids_{gen}_{proc}.jsonl"), "a")
first = step + 1  # this group's first step


def hold_at(step):
  """With ``TRAIN_HOLD``: after the group's first step, waits for the
  driver's ``go_<generation>`` file (``go_<generation>_<step>`` at the
  steps of ``TRAIN_HOLD_STEPS``)."""
  where = os.environ.get("TRAIN_HOLD")
  steps = os.environ.get("TRAIN_HOLD_STEPS", "")
  if where and step == first:
    path = os.path.join(where, f"go_{gen}")
  elif where and str(step) in steps.split(","):
    path = os.path.join(where, f"go_{gen}_{step}")
  else:
    return
  deadline = time.monotonic() + 300
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"group {gen} held at step {step}: no {path}"
                         " after 300 s")
    time.sleep(0.05)


add = jax.jit(lambda w, x: w + x, out_shardings=sh)
total_sum = jax.jit(jnp.sum)  # an all-reduce: the processes in lockstep
before_first = compiles[0]
while step < total:
  d = state["data"]
  ids = global_batch_ids(SEED, d["epoch"], d["index"], N, B)
  x = jax.make_array_from_callback(
      (B,), sh, lambda idx: ids[idx].astype(np.float32))  # local shards only
  w = add(state["w"], x)
  total_sum(w).block_until_ready()
  for s in x.addressable_shards:  # a step every process completed
    log.write(json.dumps({"step": step, "lo": s.index[0].start or 0,
                          "ids": np.asarray(s.data).astype(int).tolist()})
              + "\n")
  log.flush()
  step += 1
  if step == first:
    with open(os.path.join(log_dir, f"compiles_{gen}_{proc}.json"), "w") as f:
      json.dump({"first_step": compiles[0] - before_first}, f)
  time.sleep(float(os.environ.get("TRAIN_SLEEP", "0")))
  nxt = d["index"] + 1
  state = {"w": w, "step": step,
           "data": {"epoch": d["epoch"] + nxt // (N // B),
                    "index": nxt % (N // B)}}
  every = int(os.environ.get("TRAIN_SNAPSHOT_EVERY", "0"))
  if every and step % every == 0:
    store.save_snapshot(state, step)
  every = int(os.environ.get("TRAIN_CHECKPOINT_EVERY", "0"))
  if every and step % every == 0 and info["checkpoint"]:
    store.save_checkpoint(info["checkpoint"], state, step)
  due = store.resize_due(step)
  hold_at(step)
  if due:
    store.save_and_exit(state, step)
want = expected_w(step)
for s in state["w"].addressable_shards:
  assert np.asarray(s.data).tobytes() == want[s.index].tobytes(), (step, s.index)
if proc == 0:
  with open(os.path.join(log_dir, "final.json"), "w") as f:
    json.dump({"step": step, "procs": info["num_processes"],
               "generation": gen,
               "w": {str(s.index[0].start or 0): np.asarray(s.data).tolist()
                     for s in state["w"].addressable_shards},
               "data": state["data"]}, f)
