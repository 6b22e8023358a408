"""A worker for the multi-process Orbax restore test: one process of a job.

  python tests/orbax_worker.py CONFIG.json PROC_ID

Restores the checkpoint named in the config onto a mesh over every device
of the job with ``tenplex_jax.orbax.restore`` and writes, per leaf, every
addressable shard (raw bytes, with its index) and the restore report.
"""

import json
import os
import sys

with open(sys.argv[1]) as f:
  cfg = json.load(f)
proc = int(sys.argv[2])

from procs import cpu_job  # noqa: E402  (tests/, this script's directory)

jax = cpu_job(cfg["devices"], procs=cfg["procs"], proc=proc, port=cfg["port"])

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax import orbax as tor  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(cfg["mesh"]), ("a", "b"))
target = {}
for path, (shape, dtype, spec) in cfg["leaves"].items():
  s = NamedSharding(mesh, P(*spec))
  if dtype == "key":
    k = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), shape[0]))
    target[path] = jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=s)
  else:
    target[path] = jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype),
                                        sharding=s)
tree, report = tor.restore_with_report(cfg["ckpt"], target)
shards, ok = {}, {}
for path, sds in target.items():
  x = tree[path]
  ok[path] = bool(x.sharding == sds.sharding and x.shape == sds.shape
                  and x.dtype == sds.dtype)
  if cfg["leaves"][path][1] == "key":
    x = jax.random.key_data(x)
  for sh in x.addressable_shards:
    box = ",".join(f"{s.start or 0}:{s.stop if s.stop is not None else n}"
                   for s, n in zip(sh.index, x.shape))
    shards[f"{path}|{sh.device.id}|{box}"] = np.asarray(sh.data).reshape(-1).view(
        np.uint8)
np.savez(os.path.join(cfg["out"], f"shards_{proc}.npz"), **shards)
with open(os.path.join(cfg["out"], f"result_{proc}.json"), "w") as f:
  json.dump({"report": report.to_dict(), "shardings_ok": ok}, f)
jax.distributed.shutdown()
