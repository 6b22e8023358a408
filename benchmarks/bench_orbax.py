"""Orbax checkpoints: tenplex_jax.orbax vs Orbax itself, one command.

  python benchmarks/bench_orbax.py [--layers 12] [--repeat 2] [--dir /tmp/x]
  python benchmarks/bench_orbax.py --pages --repeat 3   # host page faults

Builds flax's lm1b train state (params + adamw, the real model from
tests/fixtures) with more layers than the LARGE fixture (default 12: about
2.3 GiB), plus a PRNG key array, bfloat16 and int8 leaves and a 0-d step,
and saves it with stock Orbax (``CheckpointManager`` + ``StandardSave``) on
8 simulated CPU devices. Then, each method in its own fresh process
(interleaved, repeated; medians), measured with psutil's peak RSS
(``ru_maxrss``) against the process's RSS just before the restore:

* restore onto 4 devices ``tensor=4`` and onto 2 devices ``data=2``:
  ``tenplex_jax.orbax.restore`` vs Orbax's restore with the target
  shardings; the ratio is the peak RSS rise over the bytes of the new
  shards the process holds (distinct boxes; CPU devices alias host memory);
* ``tenplex-jax ckpt convert --memory-limit 512MiB`` to the tensor=4
  layout, in one process with one CPU device: peak RSS over the
  interpreter's baseline, and GB/s against ``cp -r`` of the checkpoint.

Writes benchmarks/bench_orbax_result.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _child_env(devices: int) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["BENCH_DEVICES"] = str(devices)
  env["TENPLEX_JAX_HOST_POOL_GIB"] = "0"
  return env


def _setup_jax(devices: int):
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", devices)
  return jax


def save(args) -> None:
  jax = _setup_jax(8)
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from fixtures.lm1b_state import LARGE, make_mesh, make_state, state_bytes
  from jax.sharding import NamedSharding, PartitionSpec as P
  size = dict(LARGE, num_layers=args.layers)
  mesh = make_mesh((2, 1, 4))
  state, _ = make_state(mesh, size)
  extra = {
      "rng": jax.device_put(jax.random.split(jax.random.key(1), 8),
                            NamedSharding(mesh, P("data"))),
      "emb_bf16": jax.device_put(
          jnp.ones((4096, 1024), jnp.bfloat16), NamedSharding(mesh,
                                                             P(None, "tensor"))),
      "q_int8": jax.device_put(jnp.ones((1024, 1024), jnp.int8),
                               NamedSharding(mesh, P("tensor"))),
  }
  tree = {"state": state, "extra": extra}
  with ocp.CheckpointManager(args.dir) as m:
    m.save(1, args=ocp.args.StandardSave(tree))
    m.wait_until_finished()
  print(json.dumps({"state_bytes": state_bytes(tree)}))


def _target(jax, kind: str):
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from fixtures.lm1b_state import LARGE, LM1B_RULES, abstract_state
  from flax import linen as nn
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax.numpy as jnp
  n = 4 if kind == "tensor4" else 2
  shape = (1, 1, 4) if kind == "tensor4" else (2, 1, 1)
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape),
              ("data", "fsdp", "tensor"))
  size = dict(LARGE, num_layers=int(os.environ["BENCH_LAYERS"]))
  abstract, _ = abstract_state(size)
  unbox = lambda t: jax.tree_util.tree_map(  # noqa: E731
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      t, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  shardings = unbox(nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract), mesh, LM1B_RULES))
  state = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
      if isinstance(x, jax.ShapeDtypeStruct) else x, unbox(abstract),
      shardings)
  key = jax.eval_shape(lambda: jax.random.split(jax.random.key(1), 8))
  extra = {
      "rng": jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(
          mesh, P("data" if kind == "data2" else None))),
      "emb_bf16": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16,
                                       sharding=NamedSharding(
                                           mesh, P(None, "tensor"))),
      "q_int8": jax.ShapeDtypeStruct((1024, 1024), jnp.int8,
                                     sharding=NamedSharding(mesh,
                                                            P("tensor"))),
  }
  return {"state": state, "extra": extra}


def _rss() -> int:
  import psutil
  return psutil.Process().memory_info().rss


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _peak() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def restore(args) -> None:
  jax = _setup_jax(int(os.environ["BENCH_DEVICES"]))
  import numpy as np
  import tensorstore  # noqa: F401 - both methods use it: in the baseline
  import orbax.checkpoint as ocp
  import tenplex_jax.orbax as tor
  from tenplex_jax.layout import PTC
  target = _target(jax, args.kind)
  new_bytes = device_bytes = 0
  for t in PTC.from_tree(target):  # distinct boxes on this process's devices
    for box, holders in zip(t.placement.boxes, t.placement.holders):
      nb = int(np.prod([b - a for a, b in box])) * t.itemsize
      new_bytes += nb
      device_bytes += nb * len(holders)
  base = _rss()
  t0 = time.perf_counter()
  c0 = _cpu()
  if args.method == "tenplex":
    out = tor.restore(args.dir, target)
  else:
    with ocp.CheckpointManager(args.dir) as m:
      out = m.restore(1, args=ocp.args.StandardRestore(target))
  jax.block_until_ready(out)
  secs = time.perf_counter() - t0
  cpu = _cpu() - c0
  peak = _peak()
  print(json.dumps({"seconds": secs, "cpu_seconds": cpu, "base_rss": base, "peak_rss": peak,
                    "rise": peak - base, "new_shard_bytes": new_bytes,
                    "device_shard_bytes": device_bytes,
                    "ratio": (peak - base) / new_bytes}))


def convert(args) -> None:
  jax = _setup_jax(1)
  import tensorstore  # noqa: F401 - a library, part of the baseline
  import tenplex_jax.orbax as tor
  base = _rss()
  layout = json.loads(open(args.layout).read())
  t0 = time.perf_counter()
  rep = tor.convert(args.dir, args.out, layout, memory_limit=args.limit,
                    progress=False)
  secs = time.perf_counter() - t0
  peak = _peak()
  print(json.dumps({"seconds": secs, "base_rss": base, "peak_rss": peak,
                    "rise": peak - base, "bytes": rep["bytes"],
                    "gb_per_s": rep["bytes"] / secs / 1e9}))
  del jax


def pages(args) -> None:
  """One way of getting fresh host memory for new shards, filled once:
  200 buffers of 6 MiB (1.17 GiB), as a restore's buffers are."""
  import mmap

  import numpy as np
  n, size = 200, 6 << 20
  src = np.ones(size, np.uint8)
  r0 = resource.getrusage(resource.RUSAGE_SELF)
  t0 = time.perf_counter()
  keep = []
  for _ in range(n):
    if args.method == "numpy":  # numpy advises huge pages itself
      b = np.empty(size, np.uint8)
    else:
      flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
      if args.method == "populate":
        flags |= mmap.MAP_POPULATE
      m = mmap.mmap(-1, size, flags=flags)
      if args.method == "huge":
        m.madvise(mmap.MADV_HUGEPAGE)
      b = np.frombuffer(m, np.uint8)
    b[:] = src
    keep.append(b)
  secs = time.perf_counter() - t0
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  print(json.dumps({"method": args.method, "seconds": secs,
                    "user": r1.ru_utime - r0.ru_utime,
                    "sys": r1.ru_stime - r0.ru_stime,
                    "faults": r1.ru_minflt - r0.ru_minflt}))


def pages_main(args) -> None:
  """``--pages``: the page-fault cost behind the restore's buffers, each
  way in its own process, interleaved, ``--repeat`` rounds."""
  me = [sys.executable, os.path.abspath(__file__), "--role", "pages"]
  runs: dict[str, list] = {}
  for r in range(args.repeat):
    for m in ("huge", "plain", "populate", "numpy")[::1 if r % 2 == 0
                                                    else -1]:
      res = _run(me + ["--method", m], _child_env(1))
      runs.setdefault(m, []).append(res)
      print(f"{m:9s} wall {res['seconds']:.2f} s, user {res['user']:.2f} s,"
            f" system {res['sys']:.2f} s, {res['faults']} faults")
  print(f"load {os.getloadavg()}")
  for m, v in runs.items():
    print(f"median {m:9s} system {statistics.median(x['sys'] for x in v):.2f}"
          f" s, wall {statistics.median(x['seconds'] for x in v):.2f} s")


def _run(cmd, env, timeout=900) -> dict:
  p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                     timeout=timeout)
  if p.returncode != 0:
    raise SystemExit(f"{cmd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def _du(d) -> int:
  return sum(os.path.getsize(os.path.join(r, f))
             for r, _, fs in os.walk(d) for f in fs)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--repeat", type=int, default=2)
  ap.add_argument("--dir", default=None)
  ap.add_argument("--limit", default="512MiB")
  ap.add_argument("--pages", action="store_true", help="only measure the"
                  " ways of faulting in 1.17 GiB of new host memory")
  ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--method", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--kind", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  os.environ["BENCH_LAYERS"] = str(args.layers)
  if args.role == "save":
    return save(args)
  if args.role == "restore":
    return restore(args)
  if args.role == "convert":
    return convert(args)
  if args.role == "pages":
    return pages(args)
  if args.pages:
    return pages_main(args)
  work = args.dir or tempfile.mkdtemp(prefix="bench_orbax_", dir="/tmp")
  ck = os.path.join(work, "ckpt")
  me = [sys.executable, os.path.abspath(__file__), "--layers",
        str(args.layers)]
  try:
    saved = _run(me + ["--role", "save", "--dir", ck], _child_env(8))
    disk = _du(ck)
    print(f"state {saved['state_bytes'] / 2**30:.2f} GiB, checkpoint on disk"
          f" {disk / 2**30:.2f} GiB; load: {os.getloadavg()}")
    results = {"state_bytes": saved["state_bytes"], "disk_bytes": disk,
               "load_before": os.getloadavg(), "restore": {}, "convert": []}
    for kind, n in (("tensor4", 4), ("data2", 2)):
      runs = {"tenplex": [], "orbax": []}
      for r in range(args.repeat):
        order = ("tenplex", "orbax") if r % 2 == 0 else ("orbax", "tenplex")
        for method in order:
          res = _run(me + ["--role", "restore", "--dir", ck, "--method",
                           method, "--kind", kind], _child_env(n))
          runs[method].append(res)
          print(f"{kind} {method}: {res['seconds']:.2f} s (CPU"
                f" {res['cpu_seconds']:.2f} s), peak RSS rise"
                f" {res['rise'] / 2**30:.2f} GiB = {res['ratio']:.2f}x the"
                f" new shards ({res['new_shard_bytes'] / 2**30:.2f} GiB)")
      results["restore"][kind] = {
          m: {"seconds": statistics.median(x["seconds"] for x in v),
              "cpu_seconds": statistics.median(x["cpu_seconds"] for x in v),
              "rise": statistics.median(x["rise"] for x in v),
              "ratio": statistics.median(x["ratio"] for x in v),
              "new_shard_bytes": v[0]["new_shard_bytes"], "runs": v}
          for m, v in runs.items()}
    # Offline conversion to the tensor=4 layout, one CPU device.
    layout = os.path.join(work, "layout.json")
    code = ("import json,sys; sys.argv=['x','--layers','%d'];"
            "import os; os.environ['BENCH_LAYERS']='%d';"
            "sys.path.insert(0, %r); import bench_orbax as b;"
            "jax=b._setup_jax(4); from tenplex_jax.layout import PTC;"
            "open(%r,'w').write(PTC.from_tree(b._target(jax,'tensor4'))"
            ".to_json())" % (args.layers, args.layers, HERE, layout))
    subprocess.run([sys.executable, "-c", code], env=_child_env(4),
                   check=True)
    for r in range(args.repeat):
      out = os.path.join(work, f"conv{r}")
      cp = os.path.join(work, f"copy{r}")
      t0 = time.perf_counter()
      subprocess.run(["cp", "-r", ck, cp], check=True)
      subprocess.run(["sync"], check=True)
      cp_s = time.perf_counter() - t0
      res = _run(me + ["--role", "convert", "--dir", ck, "--layout", layout,
                       "--out", out, "--limit", args.limit], _child_env(1))
      res["copy_gb_per_s"] = disk / cp_s / 1e9
      results["convert"].append(res)
      print(f"convert (limit {args.limit}): {res['seconds']:.2f} s,"
            f" {res['gb_per_s']:.3f} GB/s of array data (cp -r of the"
            f" checkpoint: {res['copy_gb_per_s']:.3f} GB/s), peak RSS"
            f" {res['peak_rss'] / 2**20:.0f} MiB (interpreter baseline"
            f" {res['base_rss'] / 2**20:.0f} MiB, rise"
            f" {res['rise'] / 2**20:.0f} MiB)")
      shutil.rmtree(out, ignore_errors=True)
      shutil.rmtree(cp, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    results["machine"] = {"cpus": os.cpu_count(),
                          "mem_gib": os.sysconf("SC_PHYS_PAGES")
                          * os.sysconf("SC_PAGE_SIZE") / 2**30}
    with open(os.path.join(HERE, "bench_orbax_result.json"), "w") as f:
      json.dump(results, f, indent=1)
  finally:
    if args.dir is None:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
