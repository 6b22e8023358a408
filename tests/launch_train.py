"""A toy training script for the launcher tests.

  python tests/launch_train.py TOTAL_STEPS

Each step adds 1 to every element of a sharded array and all-reduces it (a
collective keeps the processes in lockstep, as gradients would). Resizes
come from the launcher (schedule, SIGUSR1) or, with ``TRAIN_REQUEST=A:M:S``,
from ``request_resize(M, at_step=S)`` called at step A. Optional:
``TRAIN_SNAPSHOT_EVERY=k`` (``save_snapshot``), ``TRAIN_CKPT_EVERY=k``
(Orbax checkpoint in the launcher's ``--checkpoint``), ``TRAIN_SLEEP=s``
per step (``TRAIN_SLEEP_GEN0=1``: in generation 0 only),
``TRAIN_EXPECT=S:M,...`` (``expect_resizes``: generations of M
processes from step S started ahead; each process of a job with it writes
``JOB_DIR/ahead_<generation>_<process>.json``: whether it was prepared, when
``initialize`` had returned, its turn, its nice value then and after it; ``TRAIN_AHEAD_FAIL=1``: processes
started ahead exit with status 3 before their turn), ``TRAIN_EXPECT_FAILURE=M``
(``expect_resizes``'s ``failure``: a generation of M processes prepared for a
failure; it writes the same files; ``TRAIN_WAIT_READY=S:G:M,...``: the
generation before G that reaches step S waits there until the M processes of
generation G are ready for their turn), and ``TRAIN_CRASH=S:P:KIND`` (in generation 0, process P exits
with code 3 after step S; KIND ``host`` first deletes its store, as if its
host were lost; KIND ``server`` first SIGKILLs its store server (its
store stays); KIND ``midsave`` exits before its ``save_snapshot`` of step
S, once process 0 has committed that snapshot: a crash in the middle of a
save round; ``TRAIN_CRASH_ALWAYS=1`` crashes in every generation), and
``TRAIN_KILL_SERVER_BEFORE_RESTORE=G:SLOT`` (process 0 of generation G
SIGKILLs the store server of slot SLOT before its restore).
Process 0 writes ``JOB_DIR/final.json`` at the end.
"""

import json
import os
import shutil
import signal
import sys
import time

from tenplex_jax import store


# Until its first step is done, this process is alive however long
# jax.distributed, the restore and the compiles take on a loaded host (as in
# examples/lm/train.py): the launcher's --step-timeout then bounds the imports
# before this line and the steps themselves.
beating = store.heartbeats(every=0.5)
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


def kill_store_server(store_dir):
  """SIGKILLs the launcher's store server for ``store_dir`` (a sibling of
  this process: same parent, ``store serve --dir store_dir``) and waits
  until it has exited."""
  pid = None
  for d in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{d}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
      with open(f"/proc/{d}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    if (ppid == os.getppid() and "serve" in argv and "--dir" in argv
        and argv[argv.index("--dir") + 1:][:1] == [store_dir]):
      pid = int(d)
  assert pid is not None, f"no store server for {store_dir}"
  os.kill(pid, signal.SIGKILL)
  deadline = time.time() + 60
  while time.time() < deadline:  # until it is a zombie (or reaped)
    try:
      with open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
          return
    except OSError:
      return
    time.sleep(0.05)
  raise TimeoutError(f"store server {pid} still running")


def env_int(name):
  v = os.environ.get(name)
  return int(v) if v else 0


target = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sh), "step": 0}
expect = os.environ.get("TRAIN_EXPECT")
expect_failure = os.environ.get("TRAIN_EXPECT_FAILURE")
prepared = store.prepared()
if (expect or expect_failure) and not prepared:
  store.expect_resizes(
      [(int(s), int(m), f"procs{m}") for s, m in
       (x.split(":") for x in (expect or "").split(",") if x)],
      key=f"procs{info['num_processes']}",
      failure=(int(expect_failure), f"procs{expect_failure}") if expect_failure
      else None)
expect = expect or expect_failure
initialized = time.time()
nice_prepared = os.getpriority(os.PRIO_PROCESS, 0)  # this (main) thread's
if prepared and os.environ.get("TRAIN_AHEAD_FAIL"):  # a generation ahead fails early
  print("launch_train: a process started ahead fails", flush=True)
  sys.exit(3)
kill_before = os.environ.get("TRAIN_KILL_SERVER_BEFORE_RESTORE")
if kill_before and info["process_id"] == 0:
  g, slot = map(int, kill_before.split(":"))
  if info["generation"] == g:  # after the launcher looked at its servers
    kill_store_server(os.path.join(info["job_dir"], "store", str(slot)))
    print(f"launch_train: killed the store server of slot {slot} before the"
          " restore", flush=True)
state, step = store.restore_or_init(init, target)
if expect:  # whether this process was started ahead, and its turn
  with open(os.path.join(info["job_dir"], f"ahead_{info['generation']}_"
                         f"{info['process_id']}.json"), "w") as f:
    json.dump({"prepared": prepared, "initialized": initialized,
               "turn": store.wait_turn(), "step": step, "nice_prepared": nice_prepared,
               "nice_turn": os.getpriority(os.PRIO_PROCESS, 0)}, f)
assert state["step"] == step, (state["step"], step)
for s in state["w"].addressable_shards:  # what was saved at that step
  np.testing.assert_array_equal(
      np.asarray(s.data), np.arange(n, dtype=np.float32)[s.index] + step)
total = int(sys.argv[1])
add = jax.jit(lambda w: w + 1.0, out_shardings=sh)
total_sum = jax.jit(jnp.sum)  # an all-reduce across the processes
request = os.environ.get("TRAIN_REQUEST")
crash = os.environ.get("TRAIN_CRASH")
crash_now = crash and (info["generation"] == 0
                       or os.environ.get("TRAIN_CRASH_ALWAYS"))
snapshot_every = env_int("TRAIN_SNAPSHOT_EVERY")
ckpt_every = env_int("TRAIN_CKPT_EVERY")
while step < total:
  w = add(state["w"])
  total_sum(w).block_until_ready()
  beating.stop()
  state = {"w": w, "step": step + 1}
  step += 1
  if info["generation"] == 0 or not os.environ.get("TRAIN_SLEEP_GEN0"):
    time.sleep(float(os.environ.get("TRAIN_SLEEP", "0")))
  if request and int(request.split(":")[0]) == step:
    _, m, at = request.split(":")
    store.request_resize(int(m), at_step=int(at))
  due = store.resize_due(step)
  if crash_now and crash.endswith(":midsave"):
    s, p, _ = crash.split(":")
    if int(s) == step and int(p) == info["process_id"]:
      peers = json.loads(os.environ["TENPLEX_STORES"])
      deadline = time.time() + 60
      while time.time() < deadline:  # process 0 committed step S
        h = store.open_store(peers[0])
        try:
          if h.manifests().get(0, {}).get("step") == step:
            break
        except store.StoreError:
          pass
        finally:
          getattr(h, "close", lambda: None)()
        time.sleep(0.05)
      print(f"launch_train: process {p} crashes before its snapshot of step"
            f" {step}", flush=True)
      os._exit(3)
  if snapshot_every and step % snapshot_every == 0:
    store.save_snapshot(state, step)
  if ckpt_every and step % ckpt_every == 0:
    store.save_checkpoint(info["checkpoint"], state, step)
  if crash_now:
    s, p, kind = crash.split(":")
    if int(s) == step and int(p) == info["process_id"]:
      if kind == "host":
        shutil.rmtree(info["store"])
      if kind == "server":
        kill_store_server(info["store"])
      print(f"launch_train: process {p} crashes at step {step}", flush=True)
      os._exit(3)
  for wait in filter(None, os.environ.get("TRAIN_WAIT_READY", "").split(",")):
    s, g, m = map(int, wait.split(":"))
    deadline = time.time() + 120
    while s == step and info["generation"] < g and time.time() < deadline and not all(
        os.path.exists(os.path.join(info["job_dir"], f"ready_{g}_{i}.txt"))
        for i in range(m)):
      time.sleep(0.05)
  for fault in filter(None, os.environ.get("TRAIN_FAULTS", "").split(",")):
    g, s, p, kind = fault.split(":")
    if (int(g), int(s), int(p)) == (info["generation"], step,
                                    info["process_id"]):
      print(f"launch_train: process {p} fails ({kind}) at step {step}",
            flush=True)
      if kind == "raise":
        raise RuntimeError(f"launch_train: an error in process {p}")
      if kind == "sysexit":
        sys.exit(4)
      if kind == "systemexit":  # not through sys.exit: the hooks miss it
        raise SystemExit(5)
      if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
      if kind == "hang":
        while True:
          time.sleep(1)
      raise ValueError(f"TRAIN_FAULTS: unknown kind {kind!r}")
  if due:
    store.save_and_exit(state, step)
if info["process_id"] == 0:
  shard = {str(s.index): np.asarray(s.data).tolist()
           for s in state["w"].addressable_shards}
  with open(os.path.join(info["job_dir"], "final.json"), "w") as f:
    json.dump({"procs": info["num_processes"], "step": step,
               "generation": info["generation"], "shards": shard,
               "boxes": [[s.index[0].start or 0, s.index[0].stop or n,
                          np.asarray(s.data).tolist()]
                         for s in state["w"].addressable_shards],
               "devices": jax.device_count()}, f)
