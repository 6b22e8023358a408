"""An elastic decoder LM on a Ray cluster with tenplex_jax.ray: grow, shrink, a drain, a node killed.

  python examples/ray/train.py --local-nodes 3          # a local 3-node cluster
  python examples/ray/train.py --local-nodes 3 --share-nothing  # (root) nodes
                                  # in private mount namespaces
  python examples/ray/train.py --address auto --max-workers 4 --grow-at 0 --kill-at 0

The same file is the driver (run by you) and the training script (run by
every Ray worker, as ``__main__``, with ``TENPLEX_RAY_JOB`` set). The
training script uses only the launcher's script API (``initialize``,
``restore_or_init``, ``resize_due``, ``save_and_exit``, ``save_snapshot``),
so it also runs under ``tenplex-jax launch --procs 2 -- python
examples/ray/train.py --worker STEPS SNAPSHOT_EVERY LOG_DIR search 0``.

The model is the decoder-only LM of examples/lm/model.py (4 layers, the
layer stack as a scan) with AdamW. Each worker group lays its parameters and
optimizer state out on all of its devices as the configuration search
(``tenplex_jax.search.best_mesh_for``) chooses for that device count
(``--layout search``), or with the model's logical axis rules and every
device on ``data`` (``--layout rules``); a restore reshards the saved state
onto that layout. Each step's global batch comes from
``tenplex_jax.data.global_batch_ids`` (a fixed order, independent of the
worker count), and the data position travels in the saved state.

The job follows the cluster: ``num_workers=(1, max)``, one worker per CPU
of the alive nodes. On a local cluster (``--local-nodes N``, 1 CPU per
node) it starts on N - 1 nodes; at ``--grow-at`` a node joins and the job
grows onto it by itself; at ``--shrink-at`` the driver asks it to shrink by
one worker and then removes the idle node; at ``--drain-at`` Ray drains a
node running a worker (``tenplex_jax.ray.drain_node``, a preemption notice
with a deadline): the job saves and moves off it with no step lost, then
the node goes and a fresh one joins; at ``--kill-at`` a node running
a worker is killed without warning (the job restarts on the nodes left from
the newest snapshot, the lost node's shards from their store replicas, or
from the checkpoint in the Ray ``RunConfig`` storage when no store copy
survives: Orbax on a shared file system, or with ``--storage s3://...`` a
tenplex store in the bucket that every worker uploads its own shards to).
At the end the driver checks that every restored state's digest equals the
one saved at that step and that the surviving trajectory read each step's
global batch exactly once; it exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

LM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "lm")
N_SAMPLES, BATCH, SEED, LR = 96, 12, 0, 3e-3


def lm_config():
  """The decoder LM (examples/lm/model.py) at a size for 2 CPU cores; the
  layer stack runs as a scan (no pipeline across workers)."""
  sys.path.insert(0, LM_DIR)
  from model import Config
  return Config(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=4,
                pipeline=False)


def dataset(cfg):
  """Synthetic sequences ``t[i+1] = (a t[i] + b) mod vocab``, one (a, b)
  rule of four per sequence, made in code (the same in every process)."""
  import numpy as np
  rng = np.random.default_rng(SEED)
  rules = [(1, 1), (3, 1), (5, 3), (7, 2)]
  out = np.empty((N_SAMPLES, cfg.seq_len + 1), np.int32)
  for i in range(N_SAMPLES):
    a, b = rules[rng.integers(len(rules))]
    out[i, 0] = rng.integers(cfg.vocab)
    for j in range(cfg.seq_len):
      out[i, j + 1] = (a * out[i, j] + b) % cfg.vocab
  return out


def layout(cfg, how: str):
  """(mesh, rules) on all of this job's devices: the model's logical axis
  rules with every device on ``data`` (``rules``), or the configuration
  search's choice for this device count (``search``)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from model import RULES, abstract_params, make_mesh
  devices = jax.devices()
  if how == "rules":
    return make_mesh(devices, data=len(devices)), RULES
  from tenplex_jax.search import best_mesh_for
  best = best_mesh_for(abstract_params(cfg), devices, global_batch=BATCH,
                       seq_len=cfg.seq_len, restrict={"pipeline": (1,)},
                       remat=("none",), max_microbatches=1)
  names = tuple("stage" if a == "pipeline" else a
                for a in best.mesh.axis_names)
  rules = tuple((k, "stage" if v == "pipeline" else v)
                for k, v in best.rules)
  return Mesh(np.asarray(best.mesh.devices), names), rules


def digest(tree):
  """A layout-independent fingerprint of every array leaf's bits (a
  position-weighted sum of the 32-bit words, mod 2**32): equal digests at
  a step mean the state crossed the resize bitwise (with overwhelming
  probability)."""
  import jax
  import jax.numpy as jnp

  def one(x):
    w = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    pos = jnp.arange(w.size, dtype=jnp.uint32).reshape(w.shape)
    return jnp.sum(w * (pos * jnp.uint32(2654435761) + jnp.uint32(1)),
                   dtype=jnp.uint32)
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
  total = jax.jit(lambda xs: sum(one(x) * jnp.uint32(2 * i + 1)
                                 for i, x in enumerate(xs)))(leaves)
  return int(total)


def log_append(log_dir: str, name: str, record: dict) -> None:
  """Appends ``record`` to log ``name`` (``digests``, ``batches``,
  ``final``) in ``log_dir``: a JSON line in ``<log_dir>/<name>.jsonl``, or
  on object storage (``s3://``, ``gs://``: nodes that share no file
  system) one object ``<log_dir>/<name>/<time>-<random>.json``."""
  line = json.dumps(record)
  if "://" not in log_dir:
    with open(os.path.join(log_dir, f"{name}.jsonl"), "a") as f:
      f.write(line + "\n")
    return
  import uuid
  from tenplex_jax.cloud import filesystem, fs_path, split_url
  fs = filesystem(split_url(log_dir)[0])
  fs.pipe_file(f"{fs_path(log_dir)}/{name}/{time.time_ns():020d}-"
               f"{uuid.uuid4().hex[:8]}.json", line.encode())


def log_read(log_dir: str, name: str) -> list[dict]:
  """The records of log ``name`` in ``log_dir``, in the order written."""
  if "://" not in log_dir:
    path = os.path.join(log_dir, f"{name}.jsonl")
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [json.loads(x) for x in f if x.strip()]
  from tenplex_jax.cloud import filesystem, fs_path, split_url
  fs = filesystem(split_url(log_dir)[0])
  keys = sorted(fs.find(f"{fs_path(log_dir)}/{name}"))
  return [json.loads(fs.cat_file(k)) for k in keys]


def log_remove(log_dir: str) -> None:
  """Removes ``log_dir`` (a directory, or every object under the prefix)."""
  if "://" not in log_dir:
    shutil.rmtree(log_dir, ignore_errors=True)
    return
  from tenplex_jax.cloud import filesystem, fs_path, split_url
  fs = filesystem(split_url(log_dir)[0])
  keys = fs.find(fs_path(log_dir))
  if keys:
    fs.rm(keys)


def train(total: int, snapshot_every: int, log_dir: str, how: str,
          checkpoint_every: int) -> None:
  """The training script (every worker): a decoder LM, sharded params,
  AdamW, the global batches in a fixed order."""
  from tenplex_jax import store
  info = store.initialize()
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tenplex_jax.data import global_batch_ids

  cfg = lm_config()
  from model import LM, abstract_params
  mesh, rules = layout(cfg, how)
  model, tx = LM(cfg), optax.adamw(LR, weight_decay=1e-2)
  rep = NamedSharding(mesh, P())
  param_sh = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract_params(cfg)), mesh, rules)
  batch_axes = dict(rules).get("batch")
  batch_sh = NamedSharding(mesh, P(batch_axes))
  tokens_all = dataset(cfg)
  per_epoch = N_SAMPLES // BATCH

  def init_arrays():
    params = nn.unbox(model.init(jax.random.key(SEED),
                                 jnp.zeros((1, cfg.seq_len), jnp.int32))
                      ["params"])
    return {"params": params, "opt": tx.init(params)}

  shapes = jax.eval_shape(init_arrays)
  shardings = {"params": param_sh, "opt": optax.tree_map_params(
      tx, lambda _, s: s, shapes["opt"], param_sh,
      transform_non_params=lambda _: rep)}

  def init():
    arrays = jax.jit(init_arrays, out_shardings=shardings)()
    return {**arrays, "step": 0, "data": {"epoch": 0, "index": 0}}

  target = {**jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=s), shapes, shardings),
      "step": 0, "data": {"epoch": 0, "index": 0}}  # the data position
  state, step = store.restore_or_init(init, target)
  gen, me = info["generation"], info["process_id"]
  arrays = {"params": state["params"], "opt": state["opt"]}
  if step and me == 0:  # what the previous group saved at this step
    log_append(log_dir, "digests", {"gen": gen, "restored": step,
                                    "digest": digest(arrays)})
  elif step:
    digest(arrays)  # a collective: every process takes part

  @jax.jit
  def train_step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  def save(kind, fn):
    arrays = {"params": state["params"], "opt": state["opt"]}
    d = digest(arrays)
    # Every process records it: a save survives the loss of any process
    # whose shards others also hold (e.g. worker 0 killed right after the
    # digest, its replicated state saved by the others).
    log_append(log_dir, "digests", {"gen": gen, kind: step, "digest": d,
                                    "proc": me})
    fn(state, step)

  mesh_desc = {a: int(n) for a, n in mesh.shape.items() if n > 1}
  while step < total:
    d = state["data"]
    ids = global_batch_ids(SEED, d["epoch"], d["index"], N_SAMPLES, BATCH)
    x = jax.make_array_from_callback(  # each process its own devices' rows
        (BATCH, cfg.seq_len + 1), batch_sh, lambda idx: tokens_all[ids][idx])
    params, opt_state, loss = train_step(state["params"], state["opt"], x)
    loss = float(loss)
    if me == 0:
      log_append(log_dir, "batches", {"gen": gen, "step": step,
                                      "ids": ids.tolist()})
      print(f"step {step + 1} workers {info['num_processes']} mesh"
            f" {mesh_desc or {'data': 1}} loss {loss:.4f}", flush=True)
    step += 1
    nxt = d["index"] + 1
    state = {"params": params, "opt": opt_state, "step": step,
             "data": {"epoch": d["epoch"] + nxt // per_epoch,
                      "index": nxt % per_epoch}}
    time.sleep(float(os.environ.get("EXAMPLE_SLEEP", "0.2")))
    if snapshot_every and step % snapshot_every == 0:
      save("snapshot", store.save_snapshot)
    if checkpoint_every and step % checkpoint_every == 0 and info[
        "checkpoint"]:
      save("checkpoint", lambda st, s: store.save_checkpoint(
          info["checkpoint"], st, s))
    if store.resize_due(step):
      save("saved", store.save_and_exit)
  if me == 0:
    log_append(log_dir, "final", {"step": step,
                                  "workers": info["num_processes"]})


def check(log_dir: str, total: int) -> list[str]:
  """What the run proves: every restore's state digest equals the one saved
  at that step, the job ended at ``total``, and the surviving trajectory
  read every step's global batch exactly once (each sample once per
  epoch)."""
  import numpy as np
  from tenplex_jax.data import global_batch_ids
  problems = []
  rows = log_read(log_dir, "digests")
  saved = {}
  for r in rows:
    for kind in ("saved", "snapshot", "checkpoint"):
      if kind in r:
        saved.setdefault(r[kind], set()).add(r["digest"])
  restores = [r for r in rows if "restored" in r]
  for r in restores:
    if r["restored"] not in saved:
      problems.append(f"group {r['gen']}: restored step {r['restored']},"
                      " whose save no process recorded")
    elif saved[r["restored"]] != {r["digest"]}:
      problems.append(f"group {r['gen']}: the state restored at step"
                      f" {r['restored']} differs from the one saved")
  finals = log_read(log_dir, "final")
  final = finals[-1] if finals else {"step": None}
  if final["step"] != total:
    problems.append(f"the job ended at step {final['step']}, not {total}")
  newest = {}
  for r in log_read(log_dir, "batches"):
    if r["gen"] >= newest.get(r["step"], (-1, None))[0]:
      newest[r["step"]] = (r["gen"], r["ids"])
  if sorted(newest) != list(range(total)):
    problems.append(f"steps run: {sorted(newest)}")
  per_epoch = N_SAMPLES // BATCH
  for step, (_, ids) in newest.items():
    want = global_batch_ids(SEED, step // per_epoch, step % per_epoch,
                            N_SAMPLES, BATCH)
    if not np.array_equal(ids, want):
      problems.append(f"step {step} read {ids}, the fixed order has {want}")
  for e in range(total // per_epoch):
    got = sorted(i for s in range(e * per_epoch, (e + 1) * per_epoch)
                 for i in newest[s][1])
    if got != list(range(N_SAMPLES)):
      problems.append(f"epoch {e} did not read every sample exactly once")
  print(f"check: {len(restores)} restores, each bitwise the saved state"
        f" (digests); {total} steps, each global batch exactly once"
        if not problems else "check FAILED:\n  " + "\n  ".join(problems))
  return problems


HEAD_IP = "127.0.0.2"  # loopback only; Ray turns 127.0.0.1 into the
# machine's outward address


class ProcessTreeNodes:
  """Local nodes as ``ray.cluster_utils.Cluster`` starts them: process
  trees of this host sharing its /dev/shm and /tmp, each on its own
  loopback address (the head on 127.0.0.2, then 127.0.0.3, ...)."""

  def __init__(self, n: int):
    from ray.cluster_utils import Cluster
    self.head_ip = HEAD_IP
    self.c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "node_ip_address": HEAD_IP})
    self.address, self.next_ip, self.nodes = self.c.address, 3, {}
    for _ in range(n - 1):
      self.add()

  def add(self) -> str:
    node = self.c.add_node(num_cpus=1,
                           node_ip_address=f"127.0.0.{self.next_ip}")
    self.next_ip += 1
    self.nodes[node.node_id] = node
    return node.node_id

  def workers(self) -> list[str]:
    return list(self.nodes)

  def remove(self, node_id: str, kill: bool = False) -> None:
    self.c.remove_node(self.nodes.pop(node_id), allow_graceful=not kill)

  def shutdown(self) -> None:
    self.c.shutdown()


class SharedNothingNodes:
  """Local nodes that share nothing (``share_nothing.py``): each in its own
  mount namespace with private /dev/shm, /tmp and working directory, on its
  own loopback address; removing one kills all its processes."""

  def __init__(self, n: int):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from share_nothing import ShareNothingCluster, namespaces_permitted
    why = namespaces_permitted()
    if why:
      raise SystemExit(f"--share-nothing: {why}")
    self.c = ShareNothingCluster(head_ip=HEAD_IP)
    self.head_ip, self.nodes = HEAD_IP, {}
    try:
      self.c.add_node()
      self.address = self.c.address
      for _ in range(n - 1):
        self.add()
    except BaseException:
      self.c.shutdown()
      raise

  def add(self) -> str:
    node = self.c.add_node()
    self.nodes[node["node_id"]] = node
    return node["node_id"]

  def workers(self) -> list[str]:
    return list(self.nodes)

  def remove(self, node_id: str, kill: bool = False) -> None:
    # A node that shares nothing leaves with everything it held; a planned
    # removal waits until Ray lists it dead (a kill leaves that to the job).
    self.c.kill_node(self.nodes.pop(node_id), wait_dead=not kill)

  def shutdown(self) -> None:
    self.c.shutdown()


def drive(args: argparse.Namespace) -> int:
  """The driver: a Ray cluster, the job, the elastic events, the check."""
  import tempfile
  import ray
  from ray.train import RunConfig
  from tenplex_jax import ray as tray
  cluster, events = None, {}
  if args.local_nodes and args.share_nothing:
    cluster = SharedNothingNodes(args.local_nodes - 1)  # one joins later
    ray.init(address=cluster.address, _node_ip_address=cluster.head_ip,
             log_to_driver=True)
  elif args.local_nodes:
    cluster = ProcessTreeNodes(args.local_nodes - 1)
    ray.init(address=cluster.address, _node_ip_address=cluster.head_ip,
             log_to_driver=True)
  else:
    ray.init(address=args.address)
  hi = args.max_workers or (args.local_nodes or 8)
  workers = args.workers or (1, hi)  # (min, max): follows the cluster

  # The events come in order, each once the previous one took effect (a
  # node may take many steps to start on a loaded machine): grow, shrink
  # (then the idle node goes), drain (then the drained node goes and a
  # fresh one joins; the job grows onto it), kill.
  def on_progress(job, step):
    gen, n = len(job.generations), job.current["workers"]
    events.setdefault("initial", n)
    if "grow" in events and n > events["initial"]:
      events.setdefault("grown", gen)
    if (cluster is not None and args.grow_at and step >= args.grow_at
        and "grow" not in events):
      events["grow"] = step
      print(f"driver: adding a node at step {step}", flush=True)
      cluster.add()
      if not job.auto:
        job.request_resize(n + 1)
    if (args.shrink_at and step >= args.shrink_at and "grown" in events
        and "shrink" not in events):
      events["shrink"] = job.request_resize(max(1, n - 1))
      events["shrink_gen"] = gen + 1
      print(f"driver: shrinking to {max(1, n - 1)} workers at step"
            f" {events['shrink']}", flush=True)
    if (cluster is not None and "shrink_gen" in events and gen >=
        events["shrink_gen"] and "removed" not in events):
      idle = [x for x in cluster.workers() if x not in job.current["nodes"]]
      if idle:
        tray.stop_store(job.job, idle[-1])
        cluster.remove(idle[-1])
        events["removed"] = step
        print(f"driver: removed an idle node at step {step}", flush=True)
      else:  # the node the shrink left idle is the head: it stays
        events["removed"] = None
        print(f"driver: the shrink left the head idle (kept) at step"
              f" {step}", flush=True)
    if (cluster is not None and args.drain_at and step >= args.drain_at
        and "drained" not in events
        and ("removed" in events or not args.shrink_at)):
      busy = [x for x in cluster.workers() if x in job.current["nodes"]]
      if busy:  # a preemption notice: Ray drains it, the job moves off
        events["drained"], events["drain_gen"] = busy[-1], gen
        events["t_drain"] = time.time()
        tray.drain_node(busy[-1], deadline_s=args.drain_deadline)
        print(f"driver: Ray drains a node at step {step} (deadline"
              f" {args.drain_deadline:.0f} s)", flush=True)
    if ("drained" in events and gen > events["drain_gen"]
        and step > (job.generations[events["drain_gen"]].get("step") or 0)
        and "replaced" not in events and cluster is not None):
      # The job left it (the next group restored and ran a step): the node
      # goes, a fresh one takes its place (the job grows onto it by
      # itself).
      cluster.remove(events["drained"], kill=True)
      events["replaced"] = cluster.add()
      print(f"driver: the drained node is gone, a new one joined at step"
            f" {step}", flush=True)
    if (cluster is not None and args.kill_at and step >= args.kill_at
        and "killed" not in events
        and ("replaced" in events or not args.drain_at)):
      victim = [x for x in cluster.workers() if x in job.current["nodes"]]
      if victim:
        events["killed"] = step
        events["t_kill"] = time.time()
        print(f"driver: killing a node at step {step}", flush=True)
        cluster.remove(victim[-1], kill=True)

  job = f"example-{os.getpid()}"
  # Share-nothing nodes see no /tmp of the driver: the logs for the check
  # and the checkpoints go to a host directory standing for the shared
  # file system a real cluster would mount, or with --storage s3://... to
  # the bucket (nothing shared but the network).
  tmp = tempfile.mkdtemp(prefix="tenplex-ray-example-", dir=(
      "/var/tmp" if args.share_nothing else None))
  storage = args.storage_path or os.path.join(tmp, "ray_results")
  on_objects = "://" in storage
  log_dir = args.log_dir or (f"{storage.rstrip('/')}/{job}-logs"
                             if on_objects else os.path.join(tmp, "logs"))
  if "://" not in log_dir:
    os.makedirs(log_dir, exist_ok=True)
  run_config = RunConfig(storage_path=storage, name=job)
  if on_objects:
    print(f"driver: the persistent checkpoint goes to"
          f" {tray.checkpoint_dir(run_config, job)}, the logs for the check"
          f" to {log_dir}", flush=True)
  try:
    result = tray.run(os.path.abspath(__file__),
                      ["--worker", str(args.steps), str(args.snapshot_every),
                       log_dir, args.layout, str(args.checkpoint_every)],
                      num_workers=workers, replicas=args.replicas,
                      on_progress=on_progress, job=job,
                      run_config=run_config,
                      env={"EXAMPLE_SLEEP": str(args.sleep)})
    for g in result["generations"]:
      r = g.get("restored") or {}
      if g["outcome"] == "failed":
        how = f"failed ({g['error'][:60]})"
      elif r:
        how = f"restored step {r['step']} from {r['source']}"
        if g["failed_step"] is not None:
          how += (f" (failed at step {g['failed_step']},"
                  f" {g['failed_step'] - r['step']} steps lost)")
      else:
        how = "initialised"
      first = g.get("first_step_s")
      print(f"group {g['generation']}: {g['workers']} workers, steps"
            f" {g['start_step']}..{g.get('step', g['progress'])}, {how};"
            + (f" first step {first:.1f} s after the group's start"
               if first is not None else " no step")
            + f"; {g.get('standby', 0)} of its workers were standbys")
    gens = result["generations"]
    if cluster is not None:
      asked = [k for k, at in (("grow", args.grow_at), ("shrink",
               args.shrink_at), ("drained", args.drain_at),
               ("killed", args.kill_at)) if at]
      missed = [k for k in asked if k not in events]
      print("driver: every event of the schedule happened" if not missed
            else f"driver: the job ended before {missed} (raise --steps)")
    for what in ("drain", "kill"):
      t = events.get(f"t_{what}")
      after = [g for g in gens if t is not None and g.get("t0", 0) > t
               and g.get("first_step_s") is not None]
      if after:
        g = after[0]
        lost = (g.get("restored") or {}).get("report", {}).get("steps_lost")
        print(f"{what}: {g['t0'] + g['first_step_s'] - t:.1f} s from the"
              f" signal to the next group's first step (group"
              f" {g['generation']}, restored from"
              f" {(g.get('restored') or {}).get('source')}, {lost} steps"
              " lost)")
    return 1 if check(log_dir, args.steps) else 0
  finally:
    ray.shutdown()
    if cluster is not None:
      cluster.shutdown()
      if not args.share_nothing:  # a killed node's store directory (all
        # process-tree nodes share /dev/shm; share-nothing ones took theirs)
        shutil.rmtree(f"/dev/shm/tenplex-ray-{job}", ignore_errors=True)
    if not args.log_dir and "://" in log_dir:
      try:
        log_remove(log_dir)
      except Exception as e:  # noqa: BLE001 - the check already ran
        print(f"driver: could not remove {log_dir}: {e}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    train(int(argv[1]), int(argv[2]), argv[3], argv[4], int(argv[5]))
    return 0
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              epilog=__doc__.split("\n\n", 1)[1],
                              formatter_class=argparse.RawTextHelpFormatter)
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--address", help="an existing Ray cluster's address"
                     " (e.g. 'auto' or 'ray://host:10001'); the script must"
                     " exist at the same path on every node, and"
                     " --storage and --log-dir must be s3:// or gs:// or"
                     " on a file system every node mounts")
  where.add_argument("--local-nodes", type=int, metavar="N",
                     help="start a local cluster of N nodes (1 CPU each,"
                     " N >= 3; N - 1 at first, one joins at --grow-at),"
                     " torn down at the end")
  p.add_argument("--share-nothing", action="store_true",
                 help="with --local-nodes: each node in its own mount"
                 " namespace with private /dev/shm, /tmp and working"
                 " directory (root only; examples/ray/share_nothing.py)")
  p.add_argument("--workers", type=int, default=0,
                 help="a fixed worker count (default: follow the cluster,"
                 " 1 to --max-workers workers, one per CPU)")
  p.add_argument("--max-workers", type=int, default=0,
                 help="the most workers (default: N locally, else 8)")
  p.add_argument("--layout", choices=("rules", "search"), default="search",
                 help="each worker group's mesh: the model's logical axis"
                 " rules with all devices on 'data', or the configuration"
                 " search's choice for its device count (default)")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--grow-at", type=int, default=8,
                 help="step at which a local node joins (the job grows onto"
                 " it by itself); 0: never")
  p.add_argument("--shrink-at", type=int, default=16,
                 help="step at which the job is asked to shrink by one worker"
                 " (then an idle local node is removed); 0: never")
  p.add_argument("--drain-at", type=int, default=24,
                 help="step at which Ray drains a local node running a"
                 " worker (a preemption notice): the job saves and moves off"
                 " it, then the node goes and a fresh one joins; 0: never")
  p.add_argument("--drain-deadline", type=float, default=120.0,
                 help="seconds the drained node has left")
  p.add_argument("--kill-at", type=int, default=36,
                 help="step at which a local node running a worker is"
                 " killed without warning; 0: never")
  p.add_argument("--snapshot-every", type=int, default=4,
                 help="save_snapshot every k steps (for failures)")
  p.add_argument("--replicas", type=int, default=1,
                 help="store replicas of each snapshot on other nodes")
  p.add_argument("--checkpoint-every", type=int, default=10,
                 help="a checkpoint to the Ray storage path every k"
                 " steps (the fallback when no store holds a snapshot);"
                 " 0: never")
  p.add_argument("--storage", "--storage-path", dest="storage_path",
                 help="Ray RunConfig storage_path for the checkpoints:"
                 " s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (endpoint and"
                 " credentials from the AWS_* / Google environment, passed"
                 " to the workers), or a file system every node mounts"
                 " (default: a temporary directory)")
  p.add_argument("--log-dir", help="where the workers log state digests and"
                 " batches for the final check (default: beside the"
                 " checkpoints with an s3:// or gs:// --storage, removed at"
                 " the end; else temporary)")
  p.add_argument("--sleep", type=float, default=0.2,
                 help="seconds each step sleeps (to watch the events)")
  args = p.parse_args(argv)
  if args.local_nodes is not None and args.local_nodes < 3:
    p.error("--local-nodes needs N >= 3 (one joins and one is removed)")
  if args.share_nothing and not args.local_nodes:
    p.error("--share-nothing starts local nodes: give --local-nodes N")
  return drive(args)


if __name__ == "__main__":
  sys.exit(main())
