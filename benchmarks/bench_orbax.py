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

  python benchmarks/bench_orbax.py --layouts [--layers 10] [--repeat 2]
      [--seeds 0,1,2,3]

Target layouts that cut the saved chunks. The checkpoint: per layer a
(1024, 4096) f32 kernel, a 4096 f32 bias and a (4096, 1024) bf16 matrix,
plus an (8192, 1024) f32 embedding and a (4096, 1024) int8 table, random
values, every leaf row-sharded over 8 ``fsdp`` devices, saved by stock
Orbax (``CheckpointManager`` + ``StandardSave``, OCDBT; 40 layers: 1 GiB,
10: 276 MiB). Restored, each method in its own fresh process, interleaved,
into: the saved layout (rows on 8 devices), columns on 4
(``P(None, "tensor")``), 2-D blocks on 2x2, and one random layout per seed
(a random subset of 1-16 devices in a random order, a 1- or 2-axis mesh,
per leaf rows, columns, 2-D blocks or replicated). Methods: ``tenplex``
(``tenplex_jax.orbax.restore``), ``per-piece`` (the same with
``assembly._GROUP_READS = False``: a tensorstore read per piece, which
decodes a chunk once per new box that takes a part of it; the code before
reads were grouped by chunk), ``scratch`` (the same with
``OrbaxSource.shared_reads = False``: a chunk that feeds several pieces is
read into a scratch buffer and its pieces copied into place on the Python
thread; the code before a chunk's pieces were read straight into place in
one tensorstore batch), ``own`` (``tenplex`` into the saved layout, in the
same round as the layout's other methods: the ratio to it, ``vs_own_adjacent``,
compares runs minutes apart on a loaded machine less than the ratio to the
``saved`` row does), ``before`` (``tenplex`` with the ``tenplex_jax`` of
``--baseline-src DIR``, in the same run) and ``orbax`` (Orbax's own
restore). Each process times its method's own import (``import_seconds``:
``orbax.checkpoint`` or ``tenplex_jax.orbax``, after jax, numpy and
tensorstore, which both use) and the restore (``seconds``; outside it,
both processes have imported both packages and read the checkpoint's
metadata once); ``first_seconds`` is their sum, what a fresh process pays.
The peak RSS is reset just before the restore (Linux ``clear_refs``), so the
rise is the restore's own. ``--div 16`` divides every dimension of the
leaves by 16 (a 0.7 MB state at 6 layers: fixed costs). Reports
wall and CPU seconds (medians), the ratio to Orbax, the ratio to our own
restore in the saved layout, and the worst and median ratio to Orbax over
the random layouts. Writes benchmarks/bench_orbax_layouts_result.json
(or ``--result``). ``--no-ocdbt`` saves the checkpoint without OCDBT (a
zarr directory per leaf); ``--chunk-bytes N`` saves it with Orbax's
sub-chunking (``SaveArgs(chunk_byte_size=N)``: chunks of at most N bytes,
several per saved shard, what Orbax advises for restores into other
layouts); ``--methods tenplex,orbax`` leaves out the per-piece path.
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


def _reset_peak() -> bool:
  """Resets the process's peak RSS (Linux ``clear_refs`` 5), so that
  :func:`_peak_since_reset` sees only what follows: a small restore's rise
  is otherwise hidden under the setup's own earlier peak."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _peak_since_reset() -> int:
  """The peak RSS since :func:`_reset_peak` (``VmHWM``), bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return _peak()


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


def _layout_save(args) -> None:
  jax = _setup_jax(8)
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  s = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
  k = jax.random.key(0)
  tree = {}
  v = args.div  # every dimension divided by it (a small state)
  for i in range(args.layers):
    k, a, b, c = jax.random.split(k, 4)
    tree[f"layer{i}"] = {
        "kernel": jax.random.normal(a, (1024 // v, 4096 // v), jnp.float32),
        "bias": jax.random.normal(b, (4096 // v,), jnp.float32),
        "out": jax.random.normal(c, (4096 // v, 1024 // v), jnp.bfloat16)}
  k, a = jax.random.split(k)
  tree["embed"] = jax.random.normal(k, (8192 // v, 1024 // v), jnp.float32)
  tree["table"] = jax.random.randint(a, (4096 // v, 1024 // v), -128, 127,
                                     jnp.int8)
  tree = jax.device_put(tree, s)
  handlers = None if not args.no_ocdbt else \
      ocp.StandardCheckpointHandler(use_ocdbt=False)
  save_args = None
  if args.chunk_bytes:  # Orbax's sub-chunking: chunks of at most so many bytes
    save_args = jax.tree.map(
        lambda _: ocp.SaveArgs(chunk_byte_size=args.chunk_bytes), tree)
  with ocp.CheckpointManager(args.dir, item_handlers=handlers) as m:
    m.save(1, args=ocp.args.StandardSave(tree, save_args=save_args))
    m.wait_until_finished()
  print(json.dumps({"state_bytes": sum(x.nbytes
                                       for x in jax.tree.leaves(tree))}))


def _layout_devices(kind: str) -> int:
  if kind.startswith("random:"):
    import random
    return random.Random(int(kind[7:])).choice((1, 2, 3, 4, 6, 8, 12, 16))
  return {"saved": 8, "cols4": 4, "blocks2x2": 4}[kind]


def _layout_target(jax, kind: str, shapes: dict):
  """``kind``'s target for the leaves ``shapes`` (name -> (shape, dtype)):
  ``saved``, ``cols4``, ``blocks2x2`` or ``random:<seed>``."""
  import random

  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  n = _layout_devices(kind)
  devs = jax.devices()[:n]
  if kind == "saved":
    mesh, pick = Mesh(np.array(devs), ("fsdp",)), lambda nd, _: P("fsdp")
  elif kind == "cols4":
    mesh = Mesh(np.array(devs), ("tensor",))
    pick = lambda nd, _: P(*([None] * (nd - 1) + ["tensor"]))  # noqa: E731
  elif kind == "blocks2x2":
    mesh = Mesh(np.array(devs).reshape(2, 2), ("a", "b"))
    pick = lambda nd, _: P("a", "b") if nd == 2 else P(("a", "b"))  # noqa
  else:
    rng = random.Random(int(kind[7:]))
    devs = rng.sample(devs, n)
    splits = [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]
    shape = rng.choice(splits)
    names = ("a", "b")[:len(shape)]
    mesh = Mesh(np.array(devs).reshape(shape), names)

    def pick(nd, shp):
      for _ in range(8):
        c = rng.choice(("rows", "cols", "blocks", "replicated"))
        if c == "replicated":
          return P()
        if c == "blocks" and nd == 2 and len(names) == 2:
          spec = ("a", "b") if rng.random() < 0.5 else ("b", "a")
        else:
          ax = rng.choice(names + ((names,) if len(names) == 2 else ()))
          spec = [None] * nd
          spec[0 if c == "rows" or nd == 1 else nd - 1] = ax
        ok = all(e is None or shp[i] % int(np.prod(
            [mesh.shape[a] for a in (e if isinstance(e, tuple) else (e,))]))
                 == 0 for i, e in enumerate(spec))
        if ok:
          return P(*spec)
      return P()
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
      mesh, pick(len(shape), shape))) for name, (shape, dtype) in
          sorted(shapes.items())}


def _layout_restore(args) -> None:
  jax = _setup_jax(int(os.environ["BENCH_DEVICES"]))
  import jax.numpy as jnp
  import numpy as np
  import tensorstore  # noqa: F401 - both methods use it: in the baseline
  # The method's own import, timed (jax, numpy and tensorstore are the
  # baseline of both); then the other's, untimed, so that both restores
  # run with the same modules loaded.
  t0 = time.perf_counter()
  if args.method == "orbax":
    import orbax.checkpoint as ocp
  else:
    import tenplex_jax.orbax as tor
  import_secs = time.perf_counter() - t0
  import orbax.checkpoint as ocp  # noqa: F811
  import tenplex_jax.orbax as tor  # noqa: F811
  from tenplex_jax import assembly
  from tenplex_jax.layout import PTC
  info = tor.inspect(args.dir)["tensors"]
  kind = "saved" if args.method == "own" else args.kind
  flat = _layout_target(jax, kind, {
      k: (tuple(t["shape"]), jnp.dtype(t["dtype"])) for k, t in info.items()})
  target: dict = {}
  for k, v in flat.items():
    *head, last = k.split("/")
    d = target
    for h in head:
      d = d.setdefault(h, {})
    d[last] = v
  new_bytes = 0
  for t in PTC.from_tree(target):
    for box in dict.fromkeys(t.placement.boxes):
      new_bytes += int(np.prod([b - a for a, b in box])) * t.itemsize
  import gc
  gc.collect()
  reset = _reset_peak()
  base = _rss()
  t0 = time.perf_counter()
  c0 = _cpu()
  if args.method == "orbax":
    with ocp.CheckpointManager(args.dir) as m:
      out = m.restore(1, args=ocp.args.StandardRestore(target))
  else:
    assembly._GROUP_READS = args.method != "per-piece"
    if args.method == "scratch":
      from tenplex_jax.orbax._read import OrbaxSource
      OrbaxSource.shared_reads = False
    out = tor.restore(args.dir, target)
  jax.block_until_ready(out)
  secs = time.perf_counter() - t0
  cpu = _cpu() - c0
  peak = _peak_since_reset() if reset else _peak()
  print(json.dumps({"seconds": secs, "cpu_seconds": cpu, "rise": peak - base,
                    "peak_reset": reset, "import_seconds": import_secs,
                    "first_seconds": import_secs + secs,
                    "new_shard_bytes": new_bytes,
                    "ratio": (peak - base) / new_bytes,
                    "tenplex_jax": os.path.dirname(os.path.dirname(
                        tor.__file__))}))


def layouts_main(args) -> None:
  """``--layouts``: restores into layouts that cut the saved chunks."""
  work = args.dir or tempfile.mkdtemp(prefix="bench_orbax_layouts_",
                                      dir="/tmp")
  ck = os.path.join(work, "ckpt")
  me = [sys.executable, os.path.abspath(__file__), "--layers",
        str(args.layers), "--div", str(args.div)]
  methods = tuple(args.methods.split(","))
  kinds = ["saved", "cols4", "blocks2x2"] + [
      f"random:{s}" for s in args.seeds.split(",") if s]
  try:
    if not os.path.isdir(ck):
      saved = _run(me + ["--role", "lsave", "--dir", ck]
                   + (["--no-ocdbt"] if args.no_ocdbt else [])
                   + (["--chunk-bytes", str(args.chunk_bytes)]
                      if args.chunk_bytes else []), _child_env(8))
    else:  # --dir holding the checkpoint of an earlier run
      saved = {"state_bytes": None}
    print(f"state {saved['state_bytes'] or 'as saved before'} bytes,"
          f" checkpoint {_du(ck)} bytes on disk, load {os.getloadavg()}")
    results = {"state_bytes": saved["state_bytes"], "disk_bytes": _du(ck),
               "layers": args.layers, "div": args.div,
               "ocdbt": not args.no_ocdbt, "chunk_bytes": args.chunk_bytes,
               "methods": list(methods), "seeds": args.seeds,
               "repeat": args.repeat, "load_before": os.getloadavg(),
               "restore": {}}
    for kind in kinds:
      runs = {m: [] for m in methods}
      for r in range(args.repeat):
        for method in methods[::1 if r % 2 == 0 else -1]:
          env = _child_env(max(8, _layout_devices(kind)))
          if method == "before":
            env["PYTHONPATH"] = args.baseline_src + os.pathsep + env[
                "PYTHONPATH"]
          res = _run(me + ["--role", "lrestore", "--dir", ck, "--method",
                           method, "--kind", kind], env)
          if method == "before":
            assert res["tenplex_jax"].startswith(args.baseline_src), res
          runs[method].append(res)
          print(f"{kind:10s} {method:9s} {res['seconds']:.3f} s (CPU"
                f" {res['cpu_seconds']:.3f} s; import"
                f" {res['import_seconds']:.3f} s), peak RSS rise"
                f" {res['ratio']:.2f}x the new shards", flush=True)
      results["restore"][kind] = {
          m: {"seconds": statistics.median(x["seconds"] for x in v),
              "cpu_seconds": statistics.median(x["cpu_seconds"] for x in v),
              "import_seconds": statistics.median(x["import_seconds"]
                                                  for x in v),
              "first_seconds": statistics.median(x["first_seconds"]
                                                 for x in v),
              "ratio_max": max(x["ratio"] for x in v),
              "ratio": statistics.median(x["ratio"] for x in v), "runs": v}
          for m, v in runs.items()}
    res = results["restore"]
    own = res["saved"]["tenplex"]
    print(f"load {os.getloadavg()}")
    alt = next((m for m in methods if m not in ("tenplex", "orbax")),
               "per-piece")
    print(f"layout     | tenplex s (CPU) | {alt} s (CPU) | orbax s (CPU) |"
          " orbax/tenplex | tenplex/own saved | RSS rise x")
    for kind, r in res.items():
      t, o = r["tenplex"], r["orbax"]
      p = r.get(alt, {"seconds": float("nan"), "cpu_seconds": float("nan")})
      r["speedup_vs_orbax"] = o["seconds"] / t["seconds"]
      r["cpu_speedup_vs_orbax"] = o["cpu_seconds"] / t["cpu_seconds"]
      r["vs_own_saved"] = t["seconds"] / own["seconds"]
      r["cpu_vs_own_saved"] = t["cpu_seconds"] / own["cpu_seconds"]
      r["first_speedup_vs_orbax"] = o["first_seconds"] / t["first_seconds"]
      if "before" in r:
        b = r["before"]
        r["before_speedup_vs_orbax"] = o["seconds"] / b["seconds"]
        r["before_first_speedup_vs_orbax"] = (o["first_seconds"]
                                              / b["first_seconds"])
      if "own" in r:
        r["vs_own_adjacent"] = t["seconds"] / r["own"]["seconds"]
        r["cpu_vs_own_adjacent"] = t["cpu_seconds"] / r["own"]["cpu_seconds"]
      print(f"{kind:10s} | {t['seconds']:.2f} ({t['cpu_seconds']:.2f}) |"
            f" {p['seconds']:.2f} ({p['cpu_seconds']:.2f}) |"
            f" {o['seconds']:.2f} ({o['cpu_seconds']:.2f}) |"
            f" {r['speedup_vs_orbax']:.2f}x (CPU"
            f" {r['cpu_speedup_vs_orbax']:.2f}x) | {r['vs_own_saved']:.2f}x"
            f" (CPU {r['cpu_vs_own_saved']:.2f}x) | {t['ratio']:.2f}"
            f" (orbax {o['ratio']:.2f})")
    for key, pick in (("vs_own_saved", max), ("speedup_vs_orbax", min),
                      ("cpu_speedup_vs_orbax", min),
                      ("first_speedup_vs_orbax", min),
                      ("before_speedup_vs_orbax", min),
                      ("before_first_speedup_vs_orbax", min),
                      ("vs_own_adjacent", max),
                      ("cpu_vs_own_adjacent", max)):
      v = [r[key] for r in res.values() if key in r]
      if not v:
        continue
      results[f"all_{key}"] = {"worst": pick(v),
                               "median": statistics.median(v)}
    results["rss_ratio_worst"] = max(r["tenplex"]["ratio"]
                                     for r in res.values())
    results["rss_ratio_worst_run"] = {
        m: max(r[m]["ratio_max"] for r in res.values()) for m in methods}
    print(f"every layout: orbax/tenplex worst"
          f" {results['all_speedup_vs_orbax']['worst']:.2f}x median"
          f" {results['all_speedup_vs_orbax']['median']:.2f}x; tenplex/own"
          f" saved worst {results['all_vs_own_saved']['worst']:.2f}x median"
          f" {results['all_vs_own_saved']['median']:.2f}x; peak RSS rise"
          f" worst {results['rss_ratio_worst']:.2f}x the new shards")
    for key, what in (("first_speedup_vs_orbax", "import + restore"),
                      ("before_speedup_vs_orbax", "before: restore"),
                      ("before_first_speedup_vs_orbax",
                       "before: import + restore")):
      if f"all_{key}" in results:
        a = results[f"all_{key}"]
        print(f"{what}, orbax/tenplex: worst {a['worst']:.2f}x median"
              f" {a['median']:.2f}x")
    print("peak RSS rise, worst single run:", {
        m: round(v, 3) for m, v in results["rss_ratio_worst_run"].items()})
    if "all_vs_own_adjacent" in results:
      a, c = results["all_vs_own_adjacent"], results["all_cpu_vs_own_adjacent"]
      print(f"tenplex / own saved layout in the same round: wall worst"
            f" {a['worst']:.2f}x median {a['median']:.2f}x; CPU worst"
            f" {c['worst']:.2f}x median {c['median']:.2f}x")
    rand = [r for k, r in res.items() if k.startswith("random:")]
    if rand:
      v = [r["vs_own_saved"] for r in rand]
      results["random_vs_own_saved"] = {"worst": max(v),
                                        "median": statistics.median(v)}
      for key in ("speedup_vs_orbax", "cpu_speedup_vs_orbax"):
        v = [r[key] for r in rand]
        results[f"random_{key}"] = {"worst": min(v),
                                    "median": statistics.median(v)}
      print(f"random layouts, orbax/tenplex: wall worst"
            f" {results['random_speedup_vs_orbax']['worst']:.2f}x median"
            f" {results['random_speedup_vs_orbax']['median']:.2f}x; CPU"
            f" worst {results['random_cpu_speedup_vs_orbax']['worst']:.2f}x"
            f" median"
            f" {results['random_cpu_speedup_vs_orbax']['median']:.2f}x")
    results["load_after"] = os.getloadavg()
    results["machine"] = {"cpus": os.cpu_count()}
    with open(args.out_json or os.path.join(HERE,
                                       "bench_orbax_layouts_result.json"),
              "w") as f:
      json.dump(results, f, indent=1)
  finally:
    if args.dir is None:
      shutil.rmtree(work, ignore_errors=True)


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
  ap.add_argument("--div", type=int, default=1, help="--layouts: every"
                  " dimension of the checkpoint's leaves divided by this"
                  " (16: a 0.7 MB state at 6 layers)")
  ap.add_argument("--repeat", type=int, default=2)
  ap.add_argument("--dir", default=None)
  ap.add_argument("--limit", default="512MiB")
  ap.add_argument("--pages", action="store_true", help="only measure the"
                  " ways of faulting in 1.17 GiB of new host memory")
  ap.add_argument("--layouts", action="store_true", help="restore into"
                  " layouts that cut the saved chunks (see the docstring)")
  ap.add_argument("--seeds", default="0,1,2,3", help="--layouts: seeds of"
                  " the random layouts")
  ap.add_argument("--no-ocdbt", action="store_true", help="--layouts: save"
                  " the checkpoint without OCDBT (one zarr array directory"
                  " per leaf)")
  ap.add_argument("--chunk-bytes", type=int, default=0, help="--layouts:"
                  " save with Orbax's sub-chunking, SaveArgs(chunk_byte_size="
                  "N): every saved shard cut into chunks of at most N bytes,"
                  " what Orbax advises for restores into other layouts")
  ap.add_argument("--methods", default="tenplex,per-piece,orbax",
                  help="--layouts: methods to time (comma-separated)")
  ap.add_argument("--result", dest="out_json", default=None,
                  help="--layouts: where to write the result JSON")
  ap.add_argument("--baseline-src", default=None, help="--layouts: the"
                  " method 'before' is 'tenplex' with the tenplex_jax in this"
                  " directory (e.g. git archive <commit> tenplex_jax | tar -x"
                  " -C DIR), in the same run")
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
  if args.role == "lsave":
    return _layout_save(args)
  if args.role == "lrestore":
    return _layout_restore(args)
  if args.layouts:
    return layouts_main(args)
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
