"""A transformer-like state and the parallelism transitions benchmarked.

The state is scan-style (MaxText-like): every per-layer tensor is stacked
over a leading layer dimension ``L``, which the ``stage`` mesh axis shards
(pipeline stages). Per layer: attention qkv and output kernels (float32),
MLP in and out kernels (bfloat16, mixed precision), their biases and two
layernorm scales (float32); plus a float32 embedding and final layernorm.

Meshes always have the axes ``("stage", "data", "tensor")``. Two sharding
modes: ``tp`` (Megatron-style tensor parallelism, replicated over ``data``)
and ``fsdp`` (additionally shards each kernel's other dimension over
``data``, ZeRO-3 style).

Values are a cheap deterministic hash of the element index (no NaNs), so a
result can be checked shard by shard without keeping a copy of the state.
Nothing here runs at import time; jax must be configured by the caller.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

F32 = "float32"
BF16 = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Dims:
  d_model: int
  vocab: int
  layers: int


def dims_for(size_gib: float) -> Dims:
  """Model dimensions whose state is about ``size_gib`` GiB."""
  target = size_gib * (1 << 30)
  d = max(128, int(round(1024 * math.sqrt(size_gib) / 128)) * 128)
  vocab = 32 * d
  per_layer = 32 * d * d + (3 * d + d + 4 * d + d + 2 * d) * 4
  layers = max(4, int(round((target - vocab * d * 4) / per_layer / 4)) * 4)
  return Dims(d, vocab, layers)


# (path, shape fn, dtype, tp spec, fsdp spec); specs name mesh axes.
def tensor_specs(dims: Dims) -> list[tuple[str, tuple, str, tuple, tuple]]:
  d, v, n = dims.d_model, dims.vocab, dims.layers
  S, D, T = "stage", "data", "tensor"
  return [
      ("embed/embedding", (v, d), F32, (T, None), (T, D)),
      ("layers/attn/qkv/kernel", (n, d, 3 * d), F32, (S, None, T), (S, D, T)),
      ("layers/attn/qkv/bias", (n, 3 * d), F32, (S, T), (S, T)),
      ("layers/attn/out/kernel", (n, d, d), F32, (S, T, None), (S, T, D)),
      ("layers/attn/out/bias", (n, d), F32, (S, None), (S, None)),
      ("layers/mlp/wi/kernel", (n, d, 4 * d), BF16, (S, None, T), (S, D, T)),
      ("layers/mlp/wi/bias", (n, 4 * d), F32, (S, T), (S, T)),
      ("layers/mlp/wo/kernel", (n, 4 * d, d), BF16, (S, T, None), (S, T, D)),
      ("layers/mlp/wo/bias", (n, d), F32, (S, None), (S, None)),
      ("layers/ln1/scale", (n, d), F32, (S, None), (S, None)),
      ("layers/ln2/scale", (n, d), F32, (S, None), (S, None)),
      ("final_ln/scale", (d,), F32, (None,), (None,)),
  ]


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh_shape: tuple[int, int, int]  # (stage, data, tensor)
  mode: str  # "tp" or "fsdp"

  @property
  def n_devices(self) -> int:
    return math.prod(self.mesh_shape)

  def describe(self) -> str:
    s, d, t = self.mesh_shape
    return f"{self.mode} stage={s} data={d} tensor={t} ({self.n_devices} dev)"


@dataclasses.dataclass(frozen=True)
class Transition:
  name: str
  src: Layout
  dst: Layout
  what: str


TRANSITIONS = {
    t.name: t for t in [
        Transition("data4to2", Layout((1, 4, 2), "tp"), Layout((1, 2, 2), "tp"),
                   "data degree 4->2 (8 -> 4 devices, tensor 2 kept)"),
        Transition("data2to4", Layout((1, 2, 2), "tp"), Layout((1, 4, 2), "tp"),
                   "data degree 2->4 (4 -> 8 devices, tensor 2 kept)"),
        Transition("tensor2to4", Layout((1, 4, 2), "tp"),
                   Layout((1, 2, 4), "tp"), "tensor degree 2->4 (data 4->2)"),
        Transition("fsdp_to_data", Layout((1, 4, 2), "fsdp"),
                   Layout((1, 4, 2), "tp"),
                   "FSDP(data=4)+TP2 -> data 4 + TP2 (all-gather)"),
        Transition("stage2to4", Layout((2, 1, 2), "tp"),
                   Layout((4, 1, 2), "tp"),
                   "layer axis (pipeline stages) 2->4 (4 -> 8 devices)"),
        Transition("devices8to4", Layout((1, 4, 2), "fsdp"),
                   Layout((1, 2, 2), "fsdp"),
                   "8 -> 4 devices, FSDP data 4->2, tensor 2"),
    ]
}


def mesh_for(layout: Layout):
  import jax
  from jax.sharding import Mesh
  devs = np.array(jax.devices()[:layout.n_devices]).reshape(layout.mesh_shape)
  return Mesh(devs, ("stage", "data", "tensor"))


def shardings(dims: Dims, layout: Layout) -> dict:
  """A nested dict of NamedShardings for the state under ``layout``."""
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = mesh_for(layout)
  out: dict = {}
  for path, _, _, tp, fsdp in tensor_specs(dims):
    spec = tp if layout.mode == "tp" else fsdp
    _set(out, path, NamedSharding(mesh, PartitionSpec(*spec)))
  return out


def _set(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[leaf] = value


def _get(tree: dict, path: str):
  for p in path.split("/"):
    tree = tree[p]
  return tree


def leaf_paths(dims: Dims) -> list[str]:
  return [p for p, *_ in tensor_specs(dims)]


def state_bytes(dims: Dims) -> int:
  import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
  return sum(math.prod(shape) * np.dtype(_np_dtype(dt)).itemsize
             for _, shape, dt, _, _ in tensor_specs(dims))


def _np_dtype(name: str):
  if name == BF16:
    import ml_dtypes
    return ml_dtypes.bfloat16
  return np.dtype(name)


def host_values(path_index: int, shape: tuple, dtype: str) -> np.ndarray:
  """The deterministic global value of tensor ``path_index`` (no NaNs)."""
  n = math.prod(shape)
  h = np.arange(n, dtype=np.uint32)
  h += np.uint32(path_index * 7919)
  h *= np.uint32(2654435761)
  if dtype == F32:
    h >>= np.uint32(9)
    h |= np.uint32(0x3F800000)  # floats in [1, 2)
    return h.view(np.float32).reshape(shape)
  if dtype == BF16:
    h >>= np.uint32(25)
    bits = h.astype(np.uint16)
    bits |= np.uint16(0x3F80)
    return bits.view(_np_dtype(BF16)).reshape(shape)
  raise ValueError(dtype)


def _aligned_copy(x: np.ndarray) -> np.ndarray:
  """A C-contiguous copy of ``x`` whose data is 64-byte aligned (so that
  ``device_put(..., may_alias=True)`` on CPU adopts it without copying)."""
  raw = np.empty(x.nbytes + 64, np.uint8)
  off = (-raw.ctypes.data) % 64
  out = raw[off:off + x.nbytes].view(x.dtype).reshape(x.shape)
  np.copyto(out, x)
  return out


def build_state(dims: Dims, layout: Layout) -> dict:
  """The state on ``layout``: every shard its own device buffer."""
  import jax
  shs = shardings(dims, layout)
  state: dict = {}
  for i, (path, shape, dt, _, _) in enumerate(tensor_specs(dims)):
    host = host_values(i, shape, dt)
    sh = _get(shs, path)
    shards = [jax.device_put(_aligned_copy(host[idx]), dev, may_alias=True)
              for dev, idx in sh.addressable_devices_indices_map(shape).items()]
    arr = jax.make_array_from_single_device_arrays(shape, sh, shards)
    arr.block_until_ready()
    del host, shards
    _set(state, path, arr)
  return state


def check_state(dims: Dims, state: dict, target: dict) -> list[str]:
  """Problems with ``state`` (values and shardings against ``target``)."""
  problems = []
  for i, (path, shape, dt, _, _) in enumerate(tensor_specs(dims)):
    arr = _get(state, path)
    want = _get(target, path)
    if not arr.sharding.is_equivalent_to(want, len(shape)):
      problems.append(f"{path}: sharding {arr.sharding} is not {want}")
    if tuple(arr.shape) != tuple(shape):
      problems.append(f"{path}: shape {arr.shape} is not {shape}")
      continue
    host = host_values(i, shape, dt)
    devs = {s.device for s in arr.addressable_shards}
    if devs != set(want.addressable_devices):
      problems.append(f"{path}: on devices {sorted(d.id for d in devs)}")
    for s in arr.addressable_shards:
      got = np.asarray(s.data)
      if not np.array_equal(got.view(np.uint8),
                            np.ascontiguousarray(host[s.index]).view(np.uint8)):
        problems.append(f"{path}: shard on device {s.device.id} differs")
        break
  return problems
