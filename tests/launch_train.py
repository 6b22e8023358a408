"""A toy training script for the launcher test: counts steps in a sharded
array; resizes by the schedule; writes its final state for the parent."""

import json
import os
import sys

from tenplex_jax import store

info = store.initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("data",))
sh = NamedSharding(mesh, P("data"))
n = 12


def init():
  return {"w": jax.make_array_from_callback(
      (n,), sh, lambda idx: np.arange(n, dtype=np.float32)[idx]), "step": 0}


target = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh), "step": 0}
state, step = store.restore_or_init(init, target)
total = int(sys.argv[1])
add = jax.jit(lambda w: w + 1.0, out_shardings=sh)
while step < total:
  state = {"w": add(state["w"]), "step": step + 1}
  step += 1
  if store.resize_due(step):
    store.save_and_exit(state, step)
if info["process_id"] == 0:
  shard = {str(s.index): np.asarray(s.data).tolist()
           for s in state["w"].addressable_shards}
  with open(os.path.join(info["job_dir"], "final.json"), "w") as f:
    json.dump({"procs": info["num_processes"], "step": step,
               "generation": info["generation"], "shards": shard,
               "devices": jax.device_count()}, f)
