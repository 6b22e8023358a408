"""Redeployment benchmark: move a job's state (>= 1 GiB) three ways, in one
run, side by side:

* ``tenplex``: every old process saves to its own host store; the new
  processes read their pieces from their own host's store where it holds
  them and over HTTP from the other hosts' store servers (distributed state
  management).
* ``central``: every old process uploads its shards to one store server;
  the new processes read everything from it (Tenplex-Central).
* ``orbax``: Orbax ``StandardCheckpointer`` save to a shared directory and
  restore from it. On one machine that directory is local memory
  (``/dev/shm``), so this baseline moves no bytes over any network.

Scenarios (old job ``--procs`` x ``--devices`` CPU devices, one "host" =
one store directory and its server per process slot):

* ``disjoint``: the new job has as many processes as the old, on new hosts
  (no local store): every byte crosses the network.
* ``resize``: the new job has one process more; the first ``--procs`` run
  on the old hosts (their own store is local), the last on a new host (the
  paper's Fig. 10 setting: most bytes are read locally).

Every tensor is sharded over all devices along its columns, so a resize
changes every shard. Times are the slowest process's save plus the slowest
process's restore (process start-up is common to all methods and
excluded). ``--repeat`` rounds, the order of the methods rotated each
round; the summary takes the median per method. Every worker touches and
frees ``--prefault-gib`` of fresh memory before its timed call (see
docs/benchmarks.md, "Prefault"). Network bytes: tenplex,
the payload the new processes read from peers (and the servers' counted
bytes); central, the bytes uploaded plus downloaded. Prints a table;
``--out`` writes JSON.

  python benchmarks/bench_store.py --gib 1 --repeat 3 --out bench.json
"""

import argparse
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("tenplex", "central", "orbax")


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _value(i, cols, idx, shape):
  import numpy as np
  r = [len(range(*s.indices(n))) for s, n in zip(idx, shape)]
  c0 = idx[1].indices(shape[1])[0]
  row = (i * cols + c0 + np.arange(r[1], dtype=np.int64)).astype(np.float32)
  return np.broadcast_to(row, r)


def prefault(gib: float) -> float:
  """Touches ``gib`` GiB of fresh memory once, then frees it (as
  benchmarks/bench_reshard.py does; see docs/benchmarks.md "Prefault").

  On the VM these figures come from, memory touched for the first time
  costs 1 to 2.5 s/GiB (the host backs guest pages lazily); whichever
  method allocated the most new memory would pay it. Runs in every worker
  of every method just before its timed call. Returns the seconds taken.
  """
  import numpy as np
  t0 = time.perf_counter()
  bufs = []
  for _ in range(int(gib * (1 << 30) // (256 << 20))):
    b = np.empty(256 << 20, np.uint8)
    b.fill(1)
    bufs.append(b)
  del bufs
  return time.perf_counter() - t0


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
  rows, cols = cfg["rows"], cfg["cols"]
  target = {f"layer{i}/kernel": jax.ShapeDtypeStruct((rows, cols),
                                                     np.float32, sharding=sh)
            for i in range(cfg["tensors"])}
  target["step"] = 0
  out = {}
  if cfg["action"] == "save":
    tree = {k: jax.make_array_from_callback(
        v.shape, v.sharding,
        lambda idx, i=i, v=v: np.array(_value(i, cols, idx, v.shape)))
        for i, (k, v) in enumerate(target.items()) if k != "step"}
    for v in tree.values():
      v.block_until_ready()
    tree["step"] = 100
    out["prefault_s"] = prefault(cfg["prefault_gib"])
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
    out["prefault_s"] = prefault(cfg["prefault_gib"])
    t0 = time.perf_counter()
    if cfg["method"] == "orbax":
      tree, _ = store.restore_checkpoint(cfg["shared"], target)
    else:
      tree, rep = store.restore_with_report(cfg["locations"][proc], target,
                                            workers=8)
      for k in ("network_bytes", "local_bytes", "host_lower_bound_bytes",
                "planned_network_bytes"):
        out[k] = getattr(rep, k)
      out["phases"] = dict(rep.seconds)
    for k, v in tree.items():
      if k != "step":
        v.block_until_ready()
    out["seconds"] = time.perf_counter() - t0
    ok = tree["step"] == 100
    for i in range(cfg["tensors"]):
      a = tree[f"layer{i}/kernel"]
      for s in a.addressable_shards:
        ok = ok and bool((np.asarray(s.data)
                          == _value(i, cols, s.index, a.shape)).all())
    out["ok"] = ok
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
                         env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
        for i in range(cfg["procs"])]
  try:
    for p in ps:
      _, err = p.communicate(timeout=900)
      if p.returncode != 0:
        raise RuntimeError(f"{name}: a worker failed:\n{err[-3000:]}")
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


def _stats(url):
  with urllib.request.urlopen(url + "/stats", timeout=10) as r:
    return json.loads(r.read())


def one(method, scenario, base, tmp, log):
  """Save with the old job, restore with the new; returns the record."""
  procs, new_procs = base["procs"], base["new_procs"]
  mdir = os.path.join(tmp, method)
  stores = [os.path.join(mdir, f"host{i}") for i in range(new_procs)]
  cfg = {**base, "method": method, "stores": stores,
         "shared": os.path.join(mdir, "shared")}
  srvs = []
  try:
    if method == "central":
      srvs.append(server(os.path.join(mdir, "central"), log))
      cfg["central"] = srvs[0][1]
    s = run({**cfg, "action": "save", "procs": procs}, tmp, f"{method}-save")
    if method == "tenplex":
      srvs = [server(d, log) for d in stores[:procs]]
    urls = [u for _, u in srvs]
    if method == "central" or scenario == "disjoint":
      locations = [urls] * new_procs  # new hosts: no local store
    else:  # resize on the same hosts (+ one new host)
      locations = [([stores[i]] if i < procs else []) + urls
                   for i in range(new_procs)]
    r = run({**cfg, "action": "restore", "procs": new_procs,
             "locations": locations}, tmp, f"{method}-restore")
    wire = [_stats(u) for u in urls]
  finally:
    for p, _ in srvs:
      p.terminate()
      p.wait(10)
    shutil.rmtree(mdir, ignore_errors=True)
  save_s = max(x["seconds"] for x in s)
  rest_s = max(x["seconds"] for x in r)
  rec = {"save_s": save_s, "restore_s": rest_s, "total_s": save_s + rest_s,
         "ok": all(x["ok"] for x in r)}
  if method == "tenplex":
    rec["network_bytes"] = sum(x["network_bytes"] for x in r)
    rec["local_bytes"] = sum(x["local_bytes"] for x in r)
    rec["planned_network_bytes"] = sum(x["planned_network_bytes"] for x in r)
    rec["host_lower_bound_bytes"] = sum(x["host_lower_bound_bytes"]
                                        for x in r)
    rec["wire_bytes"] = sum(w["bytes_sent"] for w in wire)
    rec["server_read_s"] = sum(w.get("read_s", 0) for w in wire)
    rec["server_send_s"] = sum(w.get("send_s", 0) for w in wire)
  elif method == "central":
    rec["network_bytes"] = sum(w["bytes_sent"] + w["bytes_received"]
                               for w in wire)
    rec["wire_bytes"] = rec["network_bytes"]
  else:
    rec["network_bytes"] = 0
  if "phases" in r[0]:
    rec["restore_phases"] = {k: max(x["phases"][k] for x in r)
                             for k in r[0]["phases"]}
  return rec


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=1.0, help="state size")
  ap.add_argument("--tensors", type=int, default=8)
  ap.add_argument("--procs", type=int, default=2)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--scenarios", default="disjoint,resize")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--repeat", type=int, default=1)
  ap.add_argument("--prefault-gib", type=float, default=None,
                  help="fresh memory each worker touches and frees before"
                  " its timed call (default: 4x its share of the state, at"
                  " most 30%% of available memory over all workers; 0: off)")
  ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                  else None)
  ap.add_argument("--out", default=None)
  ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.worker:
    with open(a.worker[0]) as f:
      worker(json.load(f), int(a.worker[1]))
    return
  if a.prefault_gib is None:
    import psutil
    share = a.gib / a.procs
    cap = 0.3 * psutil.virtual_memory().available / (1 << 30) / (a.procs + 1)
    a.prefault_gib = round(min(4 * share, cap), 2)
  methods = [m for m in a.methods.split(",") if m]
  scenarios = [s for s in a.scenarios.split(",") if s]
  runs = {s: {m: [] for m in methods} for s in scenarios}
  setup = {}
  tmp = tempfile.mkdtemp(prefix="tenplex-bench-", dir=a.dir)
  log = open(os.path.join(tmp, "servers.log"), "w")
  try:
    for rnd in range(a.repeat):
      for sc in scenarios:
        new_procs = a.procs + (1 if sc == "resize" else 0)
        cols = 1024 * math.lcm(a.procs * a.devices, new_procs * a.devices)
        rows = max(1, int(a.gib * (1 << 30) / a.tensors / (cols * 4)))
        base = {"procs": a.procs, "new_procs": new_procs,
                "prefault_gib": a.prefault_gib,
                "devices": a.devices, "rows": rows, "cols": cols,
                "tensors": a.tensors}
        setup[sc] = {"old": f"{a.procs}x{a.devices}",
                     "new": f"{new_procs}x{a.devices}",
                     "state_bytes": rows * cols * 4 * a.tensors,
                     "tensor_shape": [rows, cols]}
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for m in order:
          rec = one(m, sc, base, tmp, log)
          runs[sc][m].append(rec)
          print(f"round {rnd} {sc:>8} {m:>8}: save {rec['save_s']:.2f} s"
                f" restore {rec['restore_s']:.2f} s ok={rec['ok']}",
                flush=True)
  finally:
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
  summary = {}
  for sc in scenarios:
    st = setup[sc]
    print(f"\n{sc}: {st['state_bytes'] / (1 << 30):.2f} GiB ({a.tensors}"
          f" tensors {st['tensor_shape']}) from {st['old']} onto"
          f" {st['new']} processes x devices; {os.cpu_count()} CPU cores;"
          f" median of {a.repeat}")
    print(f"{'method':>8} {'save s':>7} {'restore s':>9} {'total s':>8}"
          f" {'network GiB':>11} {'x tenplex':>9} ok")
    med = {}
    for m in methods:
      rs = runs[sc][m]
      med[m] = {k: statistics.median(r[k] for r in rs)
                for k in ("save_s", "restore_s", "total_s")}
      med[m]["network_bytes"] = rs[-1]["network_bytes"]
      med[m]["ok"] = all(r["ok"] for r in rs)
    t = med.get("tenplex", {}).get("total_s")
    for m in methods:
      r = med[m]
      rel = f"{r['total_s'] / t:8.2f}x" if t else "-"
      print(f"{m:>8} {r['save_s']:7.2f} {r['restore_s']:9.2f}"
            f" {r['total_s']:8.2f} {r['network_bytes'] / (1 << 30):11.2f}"
            f" {rel:>9} {r['ok']}")
      if t and m != "tenplex":
        r["speedup_of_tenplex"] = r["total_s"] / t
        r["target_2x_met"] = r["total_s"] / t >= 2.0
    summary[sc] = {**st, "median": med}
  doc = {"machine": {"cpu_count": os.cpu_count(),
                     "platform": platform.platform(),
                     "python": platform.python_version(),
                     "dir": a.dir},
         "tensors": a.tensors, "procs": a.procs, "devices_per_proc": a.devices,
         "repeat": a.repeat, "prefault_gib": a.prefault_gib,
         "summary": summary, "runs": runs}
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
