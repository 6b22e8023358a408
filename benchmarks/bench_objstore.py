"""Restoring a state from an S3 server onto a new mesh: a tenplex_jax store
against Orbax, the same bytes from the same server, fresh process per method.

An S3 server (moto, its own process on 127.0.0.1) holds a state of
``--gib`` GiB twice: as a tenplex_jax store (``tj.store.save`` to
``s3://bench/store``) and as a stock Orbax ``CheckpointManager`` directory
(OCDBT, orbax 0.12) uploaded object by object (``s3://bench/orbax``, as
``aws s3 sync`` does). Each method then restores it onto a new mesh (every
shard changes: rows sharded over 8 devices -> columns over a 2 x 4 mesh)
in a fresh process; the time is the restore call alone (imports, device
set-up and the server are common to all):

* ``store_s3``: ``tj.store.restore(["s3://bench/store"], target)``.
* ``store_s3_fsspec`` (with ``--before``): ``store_s3`` with the bucket
  listed and its small objects (``STORE_ID``, ``CURRENT``, manifests) read
  one by one through s3fs, as before they went through tensorstore's
  kvstore (:class:`tenplex_jax.cloud.KvListing`): the same run's before.
* ``store_s3_base`` (with ``--base-tree DIR``): ``store_s3`` with
  ``tenplex_jax`` imported from ``DIR`` (e.g. ``git worktree add DIR
  COMMIT``): another version's store restore, in the same run.
* ``orbax_s3``: ``tenplex_jax.orbax.restore("s3://bench/orbax", target)``
  (tensorstore's ocdbt over its s3 kvstore). Orbax 0.12.8 itself cannot
  read ``s3://`` (its tensorstore spec takes only absolute file paths or
  ``gs://``; the error is recorded), so its own restore is timed on a
  local copy of the same checkpoint instead:
* ``orbax_local``: ``ocp.CheckpointManager(copy).restore(step,
  StandardRestore(target))`` from a local directory (no server).
* ``store_local``: ``tj.store.restore([dir], target)`` from a local store
  (what a store restore from S3 costs beyond the transfer).
* ``orbax_s3_unstaged`` (with ``--unstaged``): ``orbax_s3`` without
  staging, one ranged request per chunk (the read path before it).
* ``orbax_s3_serial`` (with ``--serial``): ``orbax_s3`` with every staged
  byte fetched before the first read (no overlap of the transfer and the
  decoding: the staged path before the overlap).
* ``transfer``: the transfer itself: every chunk object of the store read
  whole from the server through tensorstore's s3 kvstore, 32 in flight (a
  store restore from a bucket keeps up to 256 MiB of chunks in flight),
  the bytes dropped; the listing before the clock starts.

``--methods`` times a subset (each ratio needs its baselines in the same
run); every run records its restore CPU time and the load average.

``orbax_s3`` stages the OCDBT checkpoint's needed byte ranges locally with a
few large requests (streamed in the background, up to 4 at once) and reads
it as a local checkpoint as the bytes arrive
(:meth:`tenplex_jax.orbax.OrbaxSource.stage`); the bytes it and ``store_s3``
fetch are reported against the state's.

The values are normal float32 noise (incompressible: Orbax compresses
its chunks with zstd, and a regular pattern would let it read 1/16 of the
bytes). Every restored array is checked bitwise against the saved one
(crc32c, outside the timing). ``--repeat`` rounds, the method order rotated each round; the
summary takes the median per method.

  flock /work/.bench.lock python benchmarks/bench_objstore.py --gib 1 \\
      --repeat 3 --out benchmarks/bench_objstore_result.json
"""

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("store_s3", "orbax_s3", "orbax_local", "store_local", "transfer")
N_TENSORS = 8


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _jax():
  os.environ.setdefault("XLA_FLAGS", "")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  return jax


def _shape(gib):
  rows = 4096
  cols = int(gib * (1 << 30) / N_TENSORS / 4 / rows) // 8 * 8
  return rows, cols


def _values(i, shape):
  """Tensor i: normal float32 noise (incompressible, as trained weights
  nearly are: Orbax compresses chunks with zstd, and a regular pattern
  would shrink its reads 16-fold)."""
  import numpy as np
  return np.random.default_rng(i).standard_normal(shape, dtype=np.float32)


def _checksum(a) -> str:
  import numpy as np

  from tenplex_jax.store.format import crc32c
  return f"{crc32c(np.ascontiguousarray(a)):08x}"


def _target(jax, shape):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  s = NamedSharding(mesh, P(None, ("a", "b")))
  import jax.numpy as jnp
  return {f"t{i}": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)
          for i in range(N_TENSORS)}


def setup(args, work):
  """Writes the state to the server twice (store, Orbax) and locally."""
  jax = _jax()
  import boto3
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import tenplex_jax as tj
  shape = _shape(args.gib)
  mesh = jax.make_mesh((8,), ("x",))
  s = NamedSharding(mesh, P("x", None))
  state, sums = {}, []
  for i in range(N_TENSORS):
    full = _values(i, shape)
    sums.append(_checksum(full))
    state[f"t{i}"] = jax.make_array_from_callback(
        shape, s, lambda idx, full=full: full[idx])
    del full
  c = boto3.client("s3")
  c.create_bucket(Bucket="bench")
  t0 = time.perf_counter()
  tj.store.save(state, "s3://bench/store", step=1)
  t_store = time.perf_counter() - t0
  tj.store.save(state, os.path.join(work, "store"), step=1)
  ck = os.path.join(work, "orbax")
  with ocp.CheckpointManager(ck) as m:
    m.save(1, args=ocp.args.StandardSave(state))
  t0 = time.perf_counter()
  for d, _, names in os.walk(ck):
    for n in names:
      full = os.path.join(d, n)
      c.upload_file(full, "bench", "orbax/" + os.path.relpath(full, ck))
  t_orbax = time.perf_counter() - t0
  return {"shape": list(shape), "tensors": N_TENSORS, "crc32c": sums,
          "bytes": N_TENSORS * shape[0] * shape[1] * 4,
          "save_store_s3_s": t_store, "upload_orbax_s": t_orbax}


def worker(method, work):
  jax = _jax()
  import numpy as np

  import tenplex_jax as tj
  shape = tuple(json.loads(os.environ["BENCH_SHAPE"]))
  sums = json.loads(os.environ["BENCH_CRC"])
  target = _target(jax, shape)
  jax.block_until_ready(jax.numpy.zeros(8))
  # The libraries every method may use, imported before the clock starts
  # (the time is the restore's, not Python's imports).
  import orbax.checkpoint  # noqa: F401
  import s3fs  # noqa: F401
  import tensorstore as ts
  import tenplex_jax.orbax as tjo
  from tenplex_jax.orbax import _read
  fetched = phases = None
  t0 = time.perf_counter()
  c0 = time.process_time()
  if method == "transfer":
    # The transfer itself: every chunk object of the store read whole, as
    # many in flight as a store restore from a bucket keeps (32), the
    # bytes dropped; no checks, no copies, no placement.
    from tenplex_jax.cloud import Listing, kvstore_spec
    listing = Listing("s3://bench/store")
    keys = sorted(k for k in listing.files if "/c/" in k or
                  k.rsplit("/", 1)[-1].startswith("c"))
    kv = ts.KvStore.open(kvstore_spec("s3://bench/store")).result()
    t0 = time.perf_counter()
    c0 = time.process_time()
    fetched, pending = 0, []
    for k in keys:
      if len(pending) >= 32:
        fetched += len(pending.pop(0).result().value)
      pending.append(kv.read(k))
    for f in pending:
      fetched += len(f.result().value)
    secs = time.perf_counter() - t0
    print(json.dumps({"method": method, "seconds": secs,
                      "cpu_s": time.process_time() - c0,
                      "fetched_bytes": fetched, "objects": len(keys)}))
    return
  if method in ("store_s3", "store_s3_fsspec", "store_s3_base"):
    from tenplex_jax.store import objects
    from tenplex_jax.store.objects import ObjectStore
    if method == "store_s3_fsspec":  # the small objects through s3fs
      from tenplex_jax.cloud import Listing
      objects.KvListing = lambda url, kv, timeout: Listing(url)
    handles = []
    init = ObjectStore.__init__

    def counting(self, *a, **k):
      init(self, *a, **k)
      handles.append(self)

    ObjectStore.__init__ = counting  # bytes_fetched: every object read
    t0 = time.perf_counter()
    c0 = time.process_time()
    out, rep = tj.store.restore_with_report(["s3://bench/store"], target)
    fetched = sum(h.bytes_fetched for h in handles)
    phases = rep.seconds
  elif method == "store_local":
    out = tj.store.restore([os.path.join(work, "store")], target)
  elif method == "orbax_s3_unstaged":  # the read path before staging
    _read.OrbaxSource.stage = lambda self, needs: 0
    out = tjo.restore("s3://bench/orbax", target)
  elif method == "orbax_s3_serial":  # staged whole, then read (before)
    from tenplex_jax.sources import Source
    stage = _read.OrbaxSource.stage

    def serial(self, needs):
      n = stage(self, needs)
      run = self._run
      if run is not None and run.pool is not None:
        run.pool.shutdown(wait=True)  # every byte here before any read
        if run.error is not None:
          raise run.error
      return n

    _read.OrbaxSource.stage = serial
    _read.OrbaxSource.read_order = Source.read_order
    out = tjo.restore("s3://bench/orbax", target)
  elif method == "orbax_s3":
    stage = _read.OrbaxSource.stage
    got = []

    def counting(self, needs):
      got.append(stage(self, needs))
      return got[-1]

    _read.OrbaxSource.stage = counting
    out = tjo.restore("s3://bench/orbax", target)
    fetched = sum(got)
  else:
    import orbax.checkpoint as ocp
    with ocp.CheckpointManager(os.path.join(work, "orbax")) as m:
      out = m.restore(1, args=ocp.args.StandardRestore(target))
  jax.block_until_ready(out)
  secs = time.perf_counter() - t0
  cpu = time.process_time() - c0
  for i in range(N_TENSORS):
    a = out[f"t{i}"]
    assert a.sharding == target[f"t{i}"].sharding, (method, a.sharding)
    assert _checksum(np.asarray(a)) == sums[i], (method, i)
  print(json.dumps({"method": method, "seconds": secs, "cpu_s": cpu,
                    "fetched_bytes": fetched, "phases_s": phases,
                    "tenplex_jax": os.path.dirname(tj.__file__)}))


def stock_orbax_s3_error(target_shape):
  """What Orbax 0.12.8 says when asked to restore from s3:// itself."""
  jax = _jax()
  import orbax.checkpoint as ocp
  try:
    with ocp.CheckpointManager("s3://bench/orbax") as m:
      m.restore(1, args=ocp.args.StandardRestore(_target(jax, target_shape)))
  except Exception as e:  # noqa: BLE001 - recorded, not raised
    return f"{type(e).__name__}: {str(e)[:300]}"
  return None


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--gib", type=float, default=1.0)
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--out", default=None)
  p.add_argument("--worker", default=None)
  p.add_argument("--work", default=None)
  p.add_argument("--setup", action="store_true")
  p.add_argument("--unstaged", action="store_true", help="also time"
                 " tenplex_jax.orbax.restore from S3 without staging (one"
                 " ranged request per chunk: minutes at 1 GiB on moto)")
  p.add_argument("--methods", default=None, help="comma-separated subset"
                 " of the methods (default: all); the ratios need their"
                 " baselines in the same run")
  p.add_argument("--before", action="store_true", help="also time"
                 " store_s3 with the small objects read through s3fs"
                 " (store_s3_fsspec: the path before KvListing)")
  p.add_argument("--base-tree", default=None, help="also time store_s3"
                 " with tenplex_jax imported from this directory"
                 " (store_s3_base: another version, same run)")
  p.add_argument("--serial", action="store_true", help="also time"
                 " orbax_s3 with the staging finished before the reads"
                 " start (no overlap: the path before it)")
  args = p.parse_args()
  if args.worker:
    worker(args.worker, args.work)
    return
  if args.setup:
    print(json.dumps(setup(args, args.work)))
    return
  work = tempfile.mkdtemp(prefix="tenplex-bench-objstore-")
  port = _port()
  env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
             AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
             AWS_REGION="us-east-1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  server = subprocess.Popen(
      [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
       str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    for _ in range(100):
      try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        break
      except OSError:
        time.sleep(0.1)
    me = [sys.executable, os.path.abspath(__file__), "--work", work,
          "--gib", str(args.gib)]
    info = json.loads(subprocess.run(
        me + ["--setup"], env=env, check=True, capture_output=True,
        text=True).stdout.strip().splitlines()[-1])
    env["BENCH_SHAPE"] = json.dumps(info["shape"])
    env["BENCH_CRC"] = json.dumps(info["crc32c"])
    fetched = {}
    methods = (tuple(args.methods.split(",")) if args.methods else METHODS) \
        + (("orbax_s3_unstaged",) if args.unstaged else ()) \
        + (("orbax_s3_serial",) if args.serial else ()) \
        + (("store_s3_fsspec",) if args.before else ()) \
        + (("store_s3_base",) if args.base_tree else ())
    runs = {m: [] for m in methods}
    details = {m: [] for m in methods}  # restore CPU, load after each run
    for r in range(args.repeat):
      order = methods[r % len(methods):] + methods[:r % len(methods)]
      for m in order:
        wenv = env if m != "store_s3_base" else dict(
            env, PYTHONPATH=os.path.abspath(args.base_tree) + os.pathsep
            + env["PYTHONPATH"])
        out = subprocess.run(me + ["--worker", m], env=wenv,
                             capture_output=True, text=True)
        if out.returncode:
          raise SystemExit(f"{m} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        runs[m].append(res["seconds"])
        details[m].append({"seconds": res["seconds"],
                           "cpu_s": res.get("cpu_s"),
                           "load1": os.getloadavg()[0],
                           "tenplex_jax": res.get("tenplex_jax"),
                           **({"phases_s": res["phases_s"]}
                              if res.get("phases_s") else {})})
        if res.get("fetched_bytes") is not None:
          fetched[m] = res["fetched_bytes"]
        print(f"round {r} {m:12s} {res['seconds']:7.2f} s  cpu"
              f" {res.get('cpu_s') or 0:5.2f} s  load"
              f" {os.getloadavg()[0]:5.1f}", flush=True)
    code = ("import json,sys; sys.argv=['x']; sys.path.insert(0, %r);"
            " import bench_objstore as b;"
            " print(json.dumps(b.stock_orbax_s3_error(%r)))"
            % (HERE, tuple(info["shape"])))
    err = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True)
    stock_err = json.loads(err.stdout.strip().splitlines()[-1]) \
        if err.stdout.strip() else err.stderr[-300:]
  finally:
    server.terminate()
    server.wait(30)
    shutil.rmtree(work, ignore_errors=True)
  med = {m: statistics.median(v) for m, v in runs.items()}

  def ratio(a, *b):
    return med[a] / sum(med[x] for x in b) \
        if all(x in med for x in (a, *b)) else None

  def per_round(m):
    """``m``'s rounds, each against that round's store_local + transfer."""
    return [s3 / (lo + tr) for s3, lo, tr in zip(
        runs.get(m, []), runs.get("store_local", []), runs.get("transfer", []))]

  def variant(m):
    """The summary keys of ``m``, a store_s3 variant, if it ran."""
    if m not in runs:
      return {}
    return {f"{m}_vs_local_plus_transfer":
                ratio(m, "store_local", "transfer"),
            f"store_s3_vs_{m}": ratio("store_s3", m),
            f"{m}_vs_local_plus_transfer_per_round": per_round(m)}

  summary = {
      "gib": info["bytes"] / (1 << 30), **info, "repeat": args.repeat,
      "runs_s": runs, "median_s": med, "runs": details,
      "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
      "store_s3_vs_orbax_local": ratio("store_s3", "orbax_local"),
      "orbax_s3_vs_orbax_local": ratio("orbax_s3", "orbax_local"),
      **({"orbax_s3_unstaged_vs_staged":
          med["orbax_s3_unstaged"] / med["orbax_s3"]} if args.unstaged
         else {}),
      **({"orbax_s3_serial_vs_overlapped":
          med["orbax_s3_serial"] / med["orbax_s3"]} if args.serial
         else {}),
      **variant("store_s3_fsspec"),
      **({"base_tree": args.base_tree} if "store_s3_base" in runs else {}),
      **variant("store_s3_base"),
      "store_s3_minus_store_local_s": med["store_s3"] - med["store_local"]
      if "store_s3" in med and "store_local" in med else None,
      # <= 1: a store restore from S3 costs no more than a local one plus
      # the transfer of its bytes.
      "store_s3_vs_local_plus_transfer":
          ratio("store_s3", "store_local", "transfer"),
      # Per round: each round's store_s3 against that round's baselines.
      "store_s3_vs_local_plus_transfer_per_round": per_round("store_s3"),
      "orbax_s3_vs_orbax_local_plus_transfer":
          ratio("orbax_s3", "orbax_local", "transfer"),
      "fetched_bytes": fetched,
      "fetched_over_state": {m: n / info["bytes"] for m, n in fetched.items()},
      "stock_orbax_from_s3": stock_err,
      "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                  "note": "shared machine, other jobs running"},
  }
  print(f"{'method':14s} {'median s':>9s}")
  for m in methods:
    print(f"{m:18s} {med[m]:9.2f}")
  print(f"store_s3 / orbax_local = {summary['store_s3_vs_orbax_local']},"
        f" orbax_s3 / orbax_local = {summary['orbax_s3_vs_orbax_local']},"
        f" store_s3 / (store_local + transfer) ="
        f" {summary['store_s3_vs_local_plus_transfer']} (per round"
        f" {summary['store_s3_vs_local_plus_transfer_per_round']}),"
        f" fetched / state = {summary['fetched_over_state']}")
  if "store_s3_fsspec" in runs:
    print("before (small objects through s3fs): store_s3_fsspec /"
          " (store_local + transfer) ="
          f" {summary['store_s3_fsspec_vs_local_plus_transfer']} (per round"
          f" {summary['store_s3_fsspec_vs_local_plus_transfer_per_round']})"
          f", store_s3 / store_s3_fsspec ="
          f" {summary['store_s3_vs_store_s3_fsspec']}")
  if "store_s3_base" in runs:
    print(f"base tree {args.base_tree}: store_s3_base / (store_local +"
          " transfer) ="
          f" {summary['store_s3_base_vs_local_plus_transfer']} (per round"
          f" {summary['store_s3_base_vs_local_plus_transfer_per_round']})"
          f", store_s3 / store_s3_base ="
          f" {summary['store_s3_vs_store_s3_base']}")
  print(f"stock Orbax from s3://: {stock_err}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main()
