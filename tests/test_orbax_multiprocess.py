"""tenplex_jax.orbax.restore in a 2-process jax.distributed job.

A checkpoint saved by stock Orbax on 8 devices (this process) is restored by
two processes of 2 devices each (tests/orbax_worker.py): every shard must
equal the saved array at its index, bitwise, and each process must read
exactly the bytes of the distinct boxes its own devices hold. The same for
seeded random trees (dtypes, ranks, saved and target layouts, OCDBT on and
off).
"""

import json
import os
import socket
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from procs import run_all

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "XLA_FLAGS": "",
       "JAX_PLATFORMS": "cpu"}

# path: (shape, dtype, spec on the new (a=2, b=2) mesh)
LEAVES = {
    "w": ([32, 24], "float32", ["a", "b"]),
    "emb": ([16, 8], "bfloat16", [None, "b"]),
    "q": ([12], "int8", []),
    "keys": ([8], "key", ["a"]),
    "step": ([], "int32", []),
}


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_each_read_their_own_boxes(tmp_path):
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
  tree = {"w": put(jnp.arange(32 * 24, dtype=jnp.float32).reshape(32, 24),
                   "x", "y"),
          "emb": put(jnp.linspace(-1, 1, 128, dtype=jnp.bfloat16)
                     .reshape(16, 8), None, "x"),
          "q": put(jnp.arange(12, dtype=jnp.int8) - 6, "y"),
          "keys": jax.random.split(jax.random.key(5), 8),
          "step": jnp.int32(77)}
  _restore_in_two_processes(tmp_path, tree, LEAVES, ocdbt=True)


_DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8", "int32", "bool"]
_SPECS = [None, "x", "y", ("x", "y")]  # the saving (x=4, y=2) mesh's
_TARGET_SPECS = [None, "a", "b", ["a", "b"]]  # the restoring (a=2, b=2) mesh's


def _random_case(seed):
  """A seeded tree saved in random layouts and random targets for it: 3-6
  leaves of rank 0-3, dims of 8, 16 or 24 (every axis combination divides
  them), the dtypes above, each split over random axes of each mesh."""
  rng = np.random.default_rng(seed)
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
  tree, leaves = {}, {}
  for i in range(int(rng.integers(3, 7))):
    shape = [int(rng.choice([8, 16, 24])) for _ in range(int(rng.integers(0, 4)))]
    dtype = str(rng.choice(_DTYPES))

    def pick(options):
      used, out = set(), []
      for _ in shape:
        o = options[int(rng.integers(len(options)))]
        names = set(o) if isinstance(o, (list, tuple)) else {o} - {None}
        out.append(None if names & used else o)
        used |= names
      return out

    n = int(np.prod(shape))
    bits = rng.integers(0, 256, size=n * 4, dtype=np.uint8)
    host = ((bits.view(np.int32) % 3 == 0) if dtype == "bool" else
            bits[:n * jnp.dtype(dtype).itemsize].view(jnp.dtype(dtype)))
    host = host.reshape(shape)
    if jnp.issubdtype(jnp.dtype(dtype), jnp.floating):  # no NaN payloads
      host = np.where(np.isfinite(host.astype(np.float32)), host, 0).astype(dtype)
    tree[f"l{i}"] = jax.device_put(host, NamedSharding(mesh, P(*pick(_SPECS))))
    leaves[f"l{i}"] = (shape, dtype, pick(_TARGET_SPECS))
  return tree, leaves


@pytest.mark.parametrize("seed,ocdbt", [(0, True), (1, False), (2, True)])
def test_random_layouts_restore_in_two_processes(tmp_path, seed, ocdbt):
  # Seeded random trees (dtypes, ranks, saved and restored layouts) through
  # the same two-process restore: every shard bitwise, each process reading
  # exactly its own devices' distinct boxes.
  tree, leaves = _random_case(seed)
  _restore_in_two_processes(tmp_path, tree, leaves, ocdbt=ocdbt)


# A tree saved by a 2-process job (tests/orbax_save_worker.py): path ->
# (dtype, spec on the saving (data=2, model=2) mesh).
SAVED_BY_TWO = {"w": ("float32", ["data", "model"]),
                "e": ("bfloat16", [None, "model"]),
                "r": ("float32", []),
                "t": ("int8", ["model"])}
_SAVED_SHAPES = {"w": (16, 12), "e": (8, 8), "r": (10,), "t": (12, 4)}


def saved_by_two_values() -> dict:
  """The values of ``SAVED_BY_TWO``, the same in every process."""
  rng = np.random.default_rng(11)
  return {k: (rng.standard_normal(_SAVED_SHAPES[k]) * 10).astype(
      jnp.dtype(dt)) for k, (dt, _) in SAVED_BY_TWO.items()}


@pytest.mark.parametrize("ocdbt", [True, False])
def test_checkpoint_saved_by_two_processes_restores_in_one(tmp_path, ocdbt):
  """A checkpoint stock Orbax saves from a 2-process job (with OCDBT each
  process writes its own ``ocdbt.process_<i>``, merged by the manifest)
  restores in one process onto columns of 4 other devices and replicated,
  bitwise, as Orbax's own restore does; ``convert`` writes it in that
  layout for Orbax."""
  ck = str(tmp_path / "ck")
  port = str(_port())
  children = run_all([[sys.executable, os.path.join(HERE, "orbax_save_worker.py"),
                        port, str(i), ck, "1" if ocdbt else "0"]
                       for i in range(2)], env=ENV, timeout=120)
  for i, c in enumerate(children):
    assert c.returncode == 0, f"process {i}:\n{c.stdout[-3000:]}"
  if ocdbt:
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(
        os.listdir(os.path.join(ck, "2", "default")))
  from tenplex_jax import orbax as tor
  full = saved_by_two_values()
  mesh = Mesh(np.array(jax.devices()[3:7]), ("y",))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, P(None, "y") if v.ndim == 2 else P())) for k, v in full.items()}
  ours = tor.restore(ck, target)
  with ocp.CheckpointManager(ck) as m:
    theirs = m.restore(2, args=ocp.args.StandardRestore(target))
  out = str(tmp_path / "conv")
  tor.convert(ck, out, target, progress=False)
  with ocp.CheckpointManager(out) as m:
    converted = m.restore(2, args=ocp.args.StandardRestore(target))
  for k, v in full.items():
    for got in (ours[k], theirs[k], converted[k]):
      assert got.sharding == target[k].sharding and got.dtype == v.dtype
      assert np.asarray(got).tobytes() == v.tobytes(), k


def _restore_in_two_processes(tmp_path, tree, leaves, ocdbt):
  """Saves ``tree`` with stock Orbax (OCDBT on or off), restores it in two
  processes of 2 devices each onto ``leaves``' (shape, dtype, spec on the
  (a=2, b=2) mesh), and checks every restored shard and read byte."""
  ck = str(tmp_path / "ck")
  opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  handler = ocp.StandardCheckpointHandler(use_ocdbt=ocdbt)
  with ocp.CheckpointManager(ck, options=opts, item_handlers=handler) as m:
    m.save(3, args=ocp.args.StandardSave(tree))
    m.wait_until_finished()
  cfg = {"procs": 2, "devices": 2, "port": _port(), "mesh": [2, 2],
         "ckpt": ck, "out": str(tmp_path), "leaves": leaves}
  path = tmp_path / "config.json"
  path.write_text(json.dumps(cfg))
  children = run_all([[sys.executable, os.path.join(HERE, "orbax_worker.py"),
                        str(path), str(i)] for i in range(2)],
                      env=ENV, timeout=120)
  for i, c in enumerate(children):
    assert c.returncode == 0, f"process {i}:\n{c.stdout[-3000:]}"
  full = {k: np.asarray(jax.random.key_data(v) if leaves[k][1] == "key" else v)
          for k, v in tree.items()}
  seen = {k: 0 for k in leaves}
  devs = [set(), set()]
  for i in range(2):
    res = json.loads((tmp_path / f"result_{i}.json").read_text())
    assert all(res["shardings_ok"].values()), res["shardings_ok"]
    shards = np.load(tmp_path / f"shards_{i}.npz")
    distinct = {}
    for key in shards.files:
      name, dev, box = key.split("|")
      devs[i].add(int(dev))
      idx = tuple(slice(*map(int, r.split(":"))) for r in box.split(",")
                  if r)
      want = full[name][idx]
      assert shards[key].tobytes() == np.ascontiguousarray(want).tobytes(), \
          key
      distinct[(name, box)] = want.nbytes
      seen[name] += want.size
    # Each process read exactly the distinct boxes of its own devices.
    assert res["report"]["read_bytes"] == sum(distinct.values())
    assert res["report"]["new_shard_bytes"] == sum(distinct.values())
  # Each process holds (and wrote out) only its own 2 devices' shards.
  assert len(devs[0]) == len(devs[1]) == 2 and not devs[0] & devs[1]
  for name, n in seen.items():  # together, every element (with replicas)
    assert n >= full[name].size
