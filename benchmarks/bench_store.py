"""Redeployment benchmark: move a job's state (>= 1 GiB) onto a disjoint set
of processes, three ways, in one run:

* ``tenplex``: every old process saves to its own host store; the new
  processes read exactly their pieces over HTTP from all old hosts' store
  servers (distributed state management).
* ``central``: every old process uploads its shards to host 0's store
  server; the new processes read everything from it (Tenplex-Central).
* ``orbax``: Orbax ``StandardCheckpointer`` save to a shared directory and
  restore from it.

Old and new jobs are ``--procs`` processes with ``--devices`` CPU devices
each (``jax.distributed`` on 127.0.0.1, gloo). Times are the slowest
process's save plus the slowest process's restore (process start-up is
common to all methods and excluded). Prints a table; ``--out`` writes JSON.

  python benchmarks/bench_store.py --gib 1 --out bench.json
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker(cfg, proc):
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", cfg["devices"])
  if cfg["procs"] > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", cfg["procs"], proc)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from tenplex_jax import store
  mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
  sh = NamedSharding(mesh, P(None, "model"))
  rows = cfg["rows"]
  cols = 1024 * jax.device_count()
  target = {f"layer{i}/kernel": jax.ShapeDtypeStruct((rows, cols),
                                                     np.float32, sharding=sh)
            for i in range(cfg["tensors"])}
  target["step"] = 0
  out = {}
  if cfg["action"] == "save":
    tree = {k: jax.make_array_from_callback(
        v.shape, v.sharding, lambda idx, i=i, v=v: np.full(
            [len(range(*s.indices(n))) for s, n in zip(idx, v.shape)], i,
            np.float32))
        for i, (k, v) in enumerate(target.items()) if k != "step"}
    for v in tree.values():
      v.block_until_ready()
    tree["step"] = 100
    t0 = time.perf_counter()
    if cfg["method"] == "orbax":
      store.save_checkpoint(cfg["shared"], tree, 100)
    elif cfg["method"] == "central":
      store.save(tree, cfg["stores"][proc], step=100, mode="central",
                 central=cfg["central"])
    else:
      store.save(tree, cfg["stores"][proc], step=100)
    out["seconds"] = time.perf_counter() - t0
  else:
    t0 = time.perf_counter()
    if cfg["method"] == "orbax":
      tree, _ = store.restore_checkpoint(cfg["shared"], target)
    else:
      tree, rep = store.restore_with_report(cfg["locations"], target,
                                            workers=8)
      out["network_bytes"] = rep.network_bytes
      out["local_bytes"] = rep.local_bytes
      out["host_lower_bound_bytes"] = rep.host_lower_bound_bytes
    for k, v in tree.items():
      if k != "step":
        v.block_until_ready()
    out["seconds"] = time.perf_counter() - t0
    i = 3 % cfg["tensors"]
    sh0 = tree[f"layer{i}/kernel"].addressable_shards[0]
    out["ok"] = bool((np.asarray(sh0.data) == i).all()) and tree["step"] == 100
  with open(os.path.join(cfg["out"], f"{cfg['action']}_{proc}.json"), "w") as f:
    json.dump(out, f)
  if cfg["procs"] > 1:
    jax.distributed.shutdown()


def run(cfg, tmp, name):
  out = os.path.join(tmp, name)
  os.makedirs(out, exist_ok=True)
  cfg = {**cfg, "out": out, "port": _port()}
  path = os.path.join(out, "cfg.json")
  with open(path, "w") as f:
    json.dump(cfg, f)
  env = {**os.environ, "PYTHONPATH": ROOT}
  ps = [subprocess.Popen([sys.executable, __file__, "--worker", path, str(i)],
                         env=env) for i in range(cfg["procs"])]
  try:
    for p in ps:
      if p.wait(900) != 0:
        raise RuntimeError(f"{name}: a worker failed")
  finally:
    for p in ps:
      if p.poll() is None:
        p.kill()
  res = []
  for i in range(cfg["procs"]):
    with open(os.path.join(out, f"{cfg['action']}_{i}.json")) as f:
      res.append(json.load(f))
  return res


def server(d, log):
  ready = os.path.join(d, ".ready")
  os.makedirs(d, exist_ok=True)
  p = subprocess.Popen([sys.executable, "-m", "tenplex_jax", "store", "serve",
                        "--dir", d, "--port", "0", "--ready-file", ready],
                       env={**os.environ, "PYTHONPATH": ROOT},
                       stdout=log, stderr=subprocess.STDOUT)
  while not os.path.exists(ready):
    if p.poll() is not None:
      raise RuntimeError("store server failed")
    time.sleep(0.05)
  with open(ready) as f:
    return p, "http://" + f.read()


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=1.0, help="state size")
  ap.add_argument("--tensors", type=int, default=8)
  ap.add_argument("--procs", type=int, default=2)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                  else None)
  ap.add_argument("--out", default=None)
  ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.worker:
    with open(a.worker[0]) as f:
      worker(json.load(f), int(a.worker[1]))
    return
  n_dev = a.procs * a.devices
  cols = 1024 * n_dev
  rows = max(1, int(a.gib * (1 << 30) / a.tensors / (cols * 4)))
  state = rows * cols * 4 * a.tensors
  tmp = tempfile.mkdtemp(prefix="tenplex-bench-", dir=a.dir)
  base = {"procs": a.procs, "devices": a.devices, "rows": rows,
          "tensors": a.tensors}
  results = {}
  log = open(os.path.join(tmp, "servers.log"), "w")
  try:
    for method in ("tenplex", "central", "orbax"):
      stores = [os.path.join(tmp, method, f"host{i}") for i in range(a.procs)]
      cfg = {**base, "method": method, "stores": stores,
             "shared": os.path.join(tmp, method, "shared")}
      srvs = []
      try:
        if method == "central":
          srvs.append(server(stores[0], log))
          cfg["central"] = srvs[0][1]
        s = run({**cfg, "action": "save"}, tmp, f"{method}-save")
        if method == "tenplex":
          srvs = [server(d, log) for d in stores]
        urls = [u for _, u in srvs]
        # The new processes are disjoint from the old: no local store.
        r = run({**cfg, "action": "restore", "locations": urls}, tmp,
                f"{method}-restore")
      finally:
        for p, _ in srvs:
          p.terminate()
          p.wait(10)
      save_s = max(x["seconds"] for x in s)
      rest_s = max(x["seconds"] for x in r)
      results[method] = {
          "save_s": save_s, "restore_s": rest_s, "total_s": save_s + rest_s,
          "network_bytes": sum(x.get("network_bytes", 0) for x in r)
          + (state if method == "central" else 0),
          "ok": all(x["ok"] for x in r)}
      shutil.rmtree(os.path.join(tmp, method), ignore_errors=True)
  finally:
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
  t = results["tenplex"]["total_s"]
  print(f"redeployment of {state / (1 << 30):.2f} GiB ({a.tensors} tensors)"
        f" from {a.procs}x{a.devices} onto {a.procs}x{a.devices} disjoint"
        f" processes; {os.cpu_count()} CPU cores")
  print(f"{'method':>8} {'save s':>8} {'restore s':>10} {'total s':>8}"
        f" {'network GiB':>12} {'vs tenplex':>10} ok")
  for m, r in results.items():
    print(f"{m:>8} {r['save_s']:8.2f} {r['restore_s']:10.2f}"
          f" {r['total_s']:8.2f} {r['network_bytes'] / (1 << 30):12.2f}"
          f" {r['total_s'] / t:9.2f}x {r['ok']}")
  doc = {"state_bytes": state, "tensors": a.tensors, "procs": a.procs,
         "devices_per_proc": a.devices, "cpu_count": os.cpu_count(),
         "results": results,
         "speedup_vs_central": results["central"]["total_s"] / t,
         "speedup_vs_orbax": results["orbax"]["total_s"] / t}
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
