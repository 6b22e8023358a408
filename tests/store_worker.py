"""A worker for the multi-process store tests: one process of a job.

  python tests/store_worker.py CONFIG.json PROC_ID

The config names the job (procs, devices per process, coordinator port, the
mesh and the action). ``save`` builds a deterministic state (values depend
only on the tensor path, never on the layout) and saves it; ``restore``
restores it onto the configured mesh and writes, per tensor, every
addressable shard (as raw storage integers) and the report for the parent.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_state import SPECS, expected_state, storage_view  # noqa: E402

from tenplex_jax import store  # noqa: E402


def target(mesh):
  out = {}
  for path, (shape, dtype, spec) in SPECS.items():
    s = NamedSharding(mesh, P(*spec))
    if dtype == "key":
      out[path] = jax.eval_shape(
          lambda: jax.random.split(jax.random.key(0), shape[0]))
      out[path] = jax.ShapeDtypeStruct(out[path].shape, out[path].dtype,
                                       sharding=s)
    else:
      out[path] = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                       sharding=s)
  out["step"] = 0
  out["note"] = ""
  return out


def build(mesh):
  host = expected_state()
  tree = {}
  for path, sds in target(mesh).items():
    if not isinstance(sds, jax.ShapeDtypeStruct):
      continue
    full = host[path]
    if SPECS[path][1] == "key":
      data = jax.make_array_from_callback(
          full.shape, NamedSharding(sds.sharding.mesh,
                                    P(*SPECS[path][2], None)),
          lambda idx: full[idx])
      tree[path] = jax.random.wrap_key_data(data, impl="threefry2x32")
    else:
      tree[path] = jax.make_array_from_callback(sds.shape, sds.sharding,
                                                lambda idx: full[idx])
  tree["step"] = cfg.get("step", 7)
  tree["note"] = "saved"
  return tree


mesh = Mesh(np.array(jax.devices()).reshape(cfg["mesh"]), ("data", "model"))
if cfg["action"] == "save":
  tree = build(mesh)
  loc = cfg["stores"][proc]
  kw = {}
  if cfg.get("replicas"):
    kw = {"replicas": cfg["replicas"], "peers": cfg["stores"]}
  if cfg.get("mode") == "central":
    kw = {"mode": "central", "central": cfg["central"]}
  if cfg.get("checkpoint") is not None:
    store.save_checkpoint(cfg["checkpoint"], tree, cfg["checkpoint_step"])
  store.save(tree, loc, step=cfg.get("step", 7), **kw)
  result = {"ok": True}
else:
  tgt = target(mesh)
  try:
    tree, report = store.restore_with_report(
        cfg["locations"][proc], tgt, checkpoint=cfg.get("checkpoint"),
        timeout=cfg.get("timeout_s", 10), retries=cfg.get("retries", 1))
  except store.StoreError as e:
    result = {"ok": False, "error": str(e), "type": type(e).__name__}
  else:
    shards = {}
    shardings_ok = {}
    for path, sds in tgt.items():
      if not isinstance(sds, jax.ShapeDtypeStruct):
        continue
      x = tree[path]
      shardings_ok[path] = bool(x.sharding == sds.sharding
                                and x.dtype == sds.dtype
                                and x.shape == sds.shape)
      if SPECS[path][1] == "key":
        x = jax.random.key_data(x)
      for sh in x.addressable_shards:
        box = ",".join(f"{s.start or 0}:{s.stop if s.stop is not None else n}"
                       for s, n in zip(sh.index, x.shape))
        shards[f"{path}|{sh.device.id}|{box}"] = storage_view(
            np.asarray(sh.data))
    np.savez(os.path.join(cfg["out"], f"shards_{proc}.npz"), **shards)
    result = {"ok": True, "report": report.to_dict(),
              "shardings_ok": shardings_ok, "step": tree["step"],
              "note": tree["note"]}
with open(os.path.join(cfg["out"], f"result_{proc}.json"), "w") as f:
  json.dump(result, f)
if cfg["procs"] > 1:
  jax.distributed.shutdown()
