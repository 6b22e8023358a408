"""A seeded generator of random resharding transitions (held-out style).

Each transition is a state (10-2,000 leaves of float32, bfloat16 and int8,
1 KiB to 256 MiB each, at least 512 MiB in all) moved from one random mesh to
another: meshes over random subsets and permutations of the 8 devices (a
quarter of the targets that fit on the devices the source leaves free lie
there: other devices), 1-3 named axes, specs with several mesh axes on one dimension, rows <->
columns, replication changes. The same seed gives the same transitions.

Example:
  >>> ts = make_transitions(seed=1, n=30)
  >>> len(ts), all(t.total_bytes() >= 512 << 20 for t in ts)
  (30, True)
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
DTYPES = ("float32", "bfloat16", "int8")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int8": 1}
_AXES = ("a", "b", "c")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """A mesh: device ids (row-major over ``shape``) and axis names."""

  devices: tuple[int, ...]
  shape: tuple[int, ...]
  names: tuple[str, ...]

  def build(self, jax_devices):
    from jax.sharding import Mesh
    devs = np.array([jax_devices[i] for i in self.devices], dtype=object)
    return Mesh(devs.reshape(self.shape), self.names)


@dataclasses.dataclass(frozen=True)
class Leaf:
  shape: tuple[int, ...]
  dtype: str
  src_spec: tuple  # PartitionSpec entries: None, a name or a tuple of names
  dst_spec: tuple

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class Transition:
  name: str
  src: MeshSpec
  dst: MeshSpec
  leaves: tuple[Leaf, ...]

  def total_bytes(self) -> int:
    return sum(l.nbytes for l in self.leaves)

  def describe(self) -> str:
    return (f"{len(self.leaves)} leaves, {self.total_bytes() / MIB:.0f} MiB,"
            f" {self.src.shape}{self.src.names}@{list(self.src.devices)} ->"
            f" {self.dst.shape}{self.dst.names}@{list(self.dst.devices)}")


def _mesh(rng: random.Random) -> MeshSpec:
  n = rng.choice((2, 4, 4, 8, 8, 8))
  devs = rng.sample(range(8), n)
  factors = []
  m = n
  while m > 1:
    f = rng.choice([d for d in (2, 4, 8) if m % d == 0])
    factors.append(f)
    m //= f
  if rng.random() < 0.3:
    factors.append(1)  # an axis of size 1
  factors = factors[:3]
  if math.prod(factors) != n:
    factors = [n]
  rng.shuffle(factors)
  return MeshSpec(tuple(devs), tuple(factors), _AXES[:len(factors)])


def _spec(rng: random.Random, mesh: MeshSpec, ndim: int, style: str) -> tuple:
  """A random spec; ``style``: rows, cols, both, replicated or multi."""
  names = list(mesh.names)
  rng.shuffle(names)
  spec = [None] * ndim
  if style == "replicated":
    return tuple(spec)
  if style == "rows":
    spec[0] = names[0]
  elif style == "cols":
    spec[-1] = names[0]
  elif style == "both" and len(names) >= 2:
    spec[0], spec[-1] = names[0], names[1]
  else:  # several mesh axes on one dimension, maybe more on another
    k = rng.randint(1, len(names))
    d = rng.randrange(ndim)
    spec[d] = tuple(names[:k]) if k > 1 else names[0]
    if k < len(names) and ndim > 1 and rng.random() < 0.5:
      spec[(d + 1) % ndim] = names[k]
  return tuple(spec)


_FLIP = {"rows": "cols", "cols": "rows", "both": "multi", "multi": "both",
         "replicated": "rows"}


def _shape(rng: random.Random, nbytes: int, itemsize: int) -> tuple:
  """A 1-3-D shape, every dimension a multiple of 8, of about ``nbytes``."""
  elems = max(64, nbytes // itemsize)
  ndim = rng.choice((1, 2, 2, 2, 3))
  if ndim == 1:
    return (max(8, elems // 8 * 8),)
  cols = 8 * 2 ** rng.randint(0, max(0, int(math.log2(max(8, elems // 64)))
                                     // 2))
  rows = max(8, elems // cols // 8 * 8)
  if ndim == 2:
    return (rows, cols)
  mid = 8 if rows >= 64 else 8
  return (max(8, rows // mid // 8 * 8), mid, cols)


def make_transition(seed: int, index: int) -> Transition:
  rng = random.Random(f"{seed}/{index}")
  src, dst = _mesh(rng), _mesh(rng)
  # A quarter of the targets whose device count allows it lie on devices
  # the source does not use ("other devices"); drawn from a separate stream
  # so that the rest of the transition is what the seed gave before.
  other = random.Random(f"{seed}/{index}/other")
  if len(src.devices) + len(dst.devices) <= 8 and other.random() < 0.25:
    free = [d for d in range(8) if d not in src.devices]
    dst = dataclasses.replace(
        dst, devices=tuple(other.sample(free, len(dst.devices))))
  n = int(round(math.exp(rng.uniform(math.log(10), math.log(2000)))))
  total = rng.randint(512, 640) * MIB
  # Leaf sizes: log-uniform weights scaled to the total, clipped to
  # [1 KiB, 256 MiB]; what clipping removed goes to leaves under the cap.
  w = [math.exp(rng.uniform(math.log(KIB), math.log(256 * MIB)))
       for _ in range(n)]
  s = sum(w)
  sizes = [min(256 * MIB, max(KIB, int(x / s * total))) for x in w]
  short = total - sum(sizes)
  order = sorted(range(n), key=lambda i: -sizes[i])
  for i in order:
    if short <= 0:
      break
    add = min(short, 256 * MIB - sizes[i])
    sizes[i] += add
    short -= add
  leaves = []
  for size in sizes:
    dtype = rng.choice(DTYPES)
    shape = _shape(rng, size, _ITEMSIZE[dtype])
    style = rng.choice(("rows", "cols", "both", "replicated", "multi"))
    move = rng.random()
    dst_style = (_FLIP[style] if move < 0.4 else
                 style if move < 0.7 else
                 rng.choice(("rows", "cols", "both", "replicated", "multi")))
    leaves.append(Leaf(shape, dtype, _spec(rng, src, len(shape), style),
                       _spec(rng, dst, len(shape), dst_style)))
  # Top up to the minimum total after rounding the shapes.
  while sum(l.nbytes for l in leaves) < 512 * MIB:
    big = max(range(len(leaves)), key=lambda i: leaves[i].nbytes)
    l = leaves[big]
    if l.nbytes * 2 > 256 * MIB:
      leaves.append(Leaf((16 * MIB // 8, 8), "float32", (None, None),
                         (None, None)))
      continue
    leaves[big] = dataclasses.replace(l, shape=(l.shape[0] * 2,) + l.shape[1:])
  return Transition(f"r{seed}.{index:02d}", src, dst, tuple(leaves))


def make_transitions(seed: int, n: int = 30) -> list[Transition]:
  return [make_transition(seed, i) for i in range(n)]


def host_value(leaf: Leaf, k: int) -> np.ndarray:
  """Leaf ``k``'s deterministic contents (any bit pattern, NaNs included)."""
  import ml_dtypes
  dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
        "int8": np.int8}[leaf.dtype]
  n = math.prod(leaf.shape) * _ITEMSIZE[leaf.dtype]
  words = (n + 3) // 4
  base = np.arange(words, dtype=np.uint32)
  base *= np.uint32(2654435761)
  base += np.uint32(k * 40503 + 1)
  return base.view(np.uint8)[:n].view(dt).reshape(leaf.shape)


def pspec(entries: tuple):
  from jax.sharding import PartitionSpec
  return PartitionSpec(*entries)
