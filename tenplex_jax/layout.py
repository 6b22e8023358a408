"""Layouts: Tenplex's parallelizable tensor collection (PTC) for jax shardings.

A PTC describes how every tensor of a state is cut and where the pieces live:

* the *slicing* (sigma): the distinct index boxes of a tensor,
* the *partitioning* and *allocation* (phi, alpha): which devices hold each
  box (its replicas), and which process each device belongs to.

Layouts are derived from ``Sharding.devices_indices_map``, so every jax
sharding works: ``NamedSharding`` (partial replication, several mesh axes on
one dimension, meshes over a subset or a permutation of devices),
``SingleDeviceSharding`` and any other ``jax.sharding.Sharding``. They can
also be built analytically from a mesh description without any devices
(:func:`named_layout`), which is how the planner is tested at thousands of
devices.

Everything here is pure: frozen values, no transfers, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from tenplex_jax.errors import LayoutError

# jax loads where a function needs it: PTC and Box (a store server) work
# without it.
if TYPE_CHECKING:
  import jax
  from jax.sharding import PartitionSpec

# A box is the half-open index range [start, stop) of each dimension.
Box = tuple[tuple[int, int], ...]

__all__ = [
    "Box",
    "PTC",
    "Placement",
    "TensorLayout",
    "box_volume",
    "intersect",
    "key_path_name",
    "named_layout",
    "relative_index",
]


def box_volume(box: Box) -> int:
  """Number of elements in ``box``.

  >>> box_volume(((0, 2), (4, 8)))
  8
  """
  return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
  """The box common to ``a`` and ``b``, or ``None`` if they do not overlap.

  Zero-size boxes (of zero-size arrays) intersect to zero-size boxes when
  their ranges coincide, so that every element-free shard is still planned.

  >>> intersect(((0, 4), (0, 4)), ((2, 6), (1, 2)))
  ((2, 4), (1, 2))
  >>> intersect(((0, 2),), ((2, 4),)) is None
  True
  """
  out = []
  for (a0, a1), (b0, b1) in zip(a, b):
    lo, hi = max(a0, b0), min(a1, b1)
    if hi < lo or (hi == lo and not (a0 == a1 == b0 == b1)):
      return None
    out.append((lo, hi))
  return tuple(out)


def relative_index(piece: Box, within: Box) -> tuple:
  """The index of ``piece`` inside an array that holds the box ``within``:
  one slice per dimension of the boxes, then ``...`` for any trailing
  dimensions (a view, also of a 0-d array).

  >>> relative_index(((2, 4), (0, 3)), ((2, 6), (0, 8)))
  (slice(0, 2, None), slice(0, 3, None), Ellipsis)
  """
  return tuple(slice(p0 - w0, p1 - w0)
               for (p0, p1), (w0, _) in zip(piece, within)) + (Ellipsis,)


def slices_to_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
  box = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise LayoutError(f"strided shard index {s} is not supported")
    box.append((start, max(start, stop)))
  # devices_indices_map may give fewer slices than dims for scalars.
  for n in shape[len(index):]:
    box.append((0, n))
  return tuple(box)


def key_path_name(path: Sequence[Any]) -> str:
  """Names a pytree key path like a file path: ``params/Dense_0/kernel``.

  >>> import jax
  >>> [key_path_name(p) for p, _ in
  ...  jax.tree_util.tree_flatten_with_path({"a": [1, {"b": 2}]})[0]]
  ['a/0', 'a/1/b']
  """
  import jax
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(str(k.name))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:  # pragma: no cover - future key types
      parts.append(str(k))
  # Flax boxes (nn.LogicallyPartitioned, nnx.Variable) hold their array in a
  # ``value`` attribute: ``params/Dense_0/kernel`` names the parameter.
  if len(parts) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) \
      and path[-1].name == "value":
    parts.pop()
  return "/".join(parts) if parts else "."


@dataclasses.dataclass(frozen=True)
class Placement:
  """The boxes of one tensor and the devices holding each (its replicas).

  Attributes:
    boxes: the distinct index boxes; together they tile the tensor.
    holders: for each box, the ids of the devices holding it, sorted.
  """

  boxes: tuple[Box, ...]
  holders: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    if len(self.boxes) != len(self.holders):
      raise LayoutError(
          f"placement has {len(self.boxes)} boxes but {len(self.holders)}"
          " holder lists")

  @functools.cached_property
  def box_of_device(self) -> dict[int, int]:
    """Device id -> index of the box it holds."""
    out: dict[int, int] = {}
    for i, devs in enumerate(self.holders):
      out.update(zip(devs, itertools.repeat(i)))
    if len(out) != sum(map(len, self.holders)):
      seen = set()
      for devs in self.holders:
        for d in devs:
          if d in seen:
            raise LayoutError(f"device {d} holds two boxes of one tensor")
          seen.add(d)
    return out

  @functools.cached_property
  def devices(self) -> tuple[int, ...]:
    return tuple(sorted(self.box_of_device))

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.boxes, self.holders))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    if self is other:
      return True
    if not isinstance(other, Placement):
      return NotImplemented
    return (self._hash == other._hash and self.boxes == other.boxes
            and self.holders == other.holders)

  def check_tiles(self, shape: Sequence[int], path: str) -> None:
    """Raises LayoutError unless the boxes tile ``shape`` exactly."""
    shape = tuple(shape)
    total = 0
    for b in self.boxes:
      if len(b) != len(shape) or any(
          not 0 <= lo <= hi <= n for (lo, hi), n in zip(b, shape)):
        raise LayoutError(f"{path}: box {b} does not fit shape {shape}")
      total += box_volume(b)
    if total != math.prod(shape):
      raise LayoutError(
          f"{path}: boxes cover {total} elements but shape {shape} has"
          f" {math.prod(shape)}; overlapping or missing shards are not"
          " supported")

  def to_json(self) -> dict:
    return {"boxes": [[list(r) for r in b] for b in self.boxes],
            "holders": [list(h) for h in self.holders]}

  @classmethod
  def from_json(cls, d: Mapping) -> Placement:
    return cls(tuple(tuple(tuple(r) for r in b) for b in d["boxes"]),
               tuple(tuple(h) for h in d["holders"]))


def _placement_from_indices_map(indices: Mapping[Any, tuple],
                                shape: tuple[int, ...]) -> Placement:
  by_box: dict[Box, list[int]] = {}
  for dev, index in indices.items():
    by_box.setdefault(slices_to_box(index, shape), []).append(dev.id)
  items = sorted(by_box.items(), key=lambda kv: kv[0])
  return Placement(tuple(b for b, _ in items),
                   tuple(tuple(sorted(h)) for _, h in items))


def _spec_to_json(spec: PartitionSpec) -> list:
  from jax.sharding import PartitionSpec
  out = []
  for entry in spec:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(None)
    elif isinstance(entry, str):
      out.append(entry)
    else:
      out.append(list(entry))
  return out


def _spec_from_json(entries: Sequence) -> PartitionSpec:
  from jax.sharding import PartitionSpec
  return PartitionSpec(*[tuple(e) if isinstance(e, list) else e
                         for e in entries])


def describe_sharding(sharding: jax.sharding.Sharding) -> dict:
  """A JSON description from which :func:`sharding_from_description` rebuilds
  the sharding. Kinds: ``named``, ``single``, or ``opaque`` (not rebuildable).
  """
  from jax.sharding import NamedSharding, SingleDeviceSharding
  if isinstance(sharding, NamedSharding):
    mesh = sharding.mesh
    return {
        "kind": "named",
        "axis_names": list(mesh.axis_names),
        "mesh_shape": [int(n) for n in mesh.devices.shape],
        "device_ids": [int(d.id) for d in mesh.devices.flat],
        "axis_types": [str(t).split(".")[-1] for t in mesh.axis_types],
        "spec": _spec_to_json(sharding.spec),
        "memory_kind": sharding.memory_kind,
    }
  if isinstance(sharding, SingleDeviceSharding):
    (dev,) = sharding.device_set
    return {"kind": "single", "device": int(dev.id),
            "memory_kind": sharding.memory_kind}
  return {"kind": "opaque", "repr": repr(sharding)}


def sharding_from_description(desc: Mapping, path: str = "?",
                              devices: Sequence[Any] | None = None
                              ) -> jax.sharding.Sharding:
  """Rebuilds a sharding from :func:`describe_sharding` output.

  Raises:
    LayoutError: the description names devices that do not exist, or is an
      ``opaque`` one.
  """
  import jax
  from jax.sharding import NamedSharding, SingleDeviceSharding
  by_id = {d.id: d for d in (devices if devices is not None else jax.devices())}

  def dev(i):
    if i not in by_id:
      raise LayoutError(
          f"{path}: layout names device {i}, which does not exist here"
          f" (devices: {sorted(by_id)[:16]}{'...' if len(by_id) > 16 else ''})")
    return by_id[i]

  kind = desc.get("kind")
  if kind == "single":
    return SingleDeviceSharding(dev(desc["device"]),
                                memory_kind=desc.get("memory_kind"))
  if kind == "named":
    grid = np.array([dev(i) for i in desc["device_ids"]], dtype=object)
    grid = grid.reshape(desc["mesh_shape"])
    types = tuple(getattr(jax.sharding.AxisType, t)
                  for t in desc.get("axis_types") or ["Auto"] * grid.ndim)
    mesh = jax.sharding.Mesh(grid, tuple(desc["axis_names"]), axis_types=types)
    return NamedSharding(mesh, _spec_from_json(desc["spec"]),
                         memory_kind=desc.get("memory_kind"))
  raise LayoutError(
      f"{path}: a layout of kind {kind!r} cannot be turned back into a"
      " sharding; pass a pytree of shardings instead")


@dataclasses.dataclass(frozen=True)
class TensorLayout:
  """The layout of one tensor of the collection.

  Attributes:
    path: the tensor's key path, e.g. ``params/Dense_0/kernel``.
    shape: the global shape.
    dtype: the dtype's name (``float32``, ``bfloat16``, ``key<fry>``, ...).
    itemsize: bytes per element (for PRNG keys, the bytes of one key).
    placement: the boxes and their holders.
    sharding: a JSON description of the sharding (see
      :func:`describe_sharding`), or ``None`` for layouts built by hand.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  itemsize: int
  placement: Placement
  sharding: Mapping | None = dataclasses.field(default=None, compare=False,
                                                hash=False)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.itemsize

  def shard_box(self, device_id: int) -> Box | None:
    i = self.placement.box_of_device.get(device_id)
    return None if i is None else self.placement.boxes[i]

  def to_json(self) -> dict:
    return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
            "itemsize": self.itemsize, "placement": self.placement.to_json(),
            "sharding": self.sharding}


def dtype_of_name(name: str) -> np.dtype:
  """The numpy dtype a dtype name spells, ``ml_dtypes``' ones included.

  What ``jnp.dtype(name)`` gives (``jnp.dtype`` is numpy's; importing
  ``ml_dtypes`` registers its names, ``bfloat16`` and the like), without
  importing jax (a store server does not). A name that is not a dtype
  raises ``TypeError``, as there.

  Example:
    >>> dtype_of_name("bfloat16"), dtype_of_name("float32")
    (dtype(bfloat16), dtype('float32'))
  """
  try:
    return np.dtype(name)
  except TypeError:
    # An ml_dtypes release that does not register its names: its scalar
    # types only (``np.dtype`` of any other class is ``object``).
    t = getattr(ml_dtypes, name, None)
    if not (isinstance(t, type) and issubclass(t, np.generic)):
      raise
    return np.dtype(t)


def dtype_info(dtype) -> tuple[str, int]:
  """``(name, itemsize)`` of a numpy, ml_dtypes or jax PRNG key dtype (or its
  name).

  Imports no jax: a key dtype is an object jax made, so where jax is not
  loaded ``dtype`` is a plain one (planning over abstract devices, the store
  server), and importing jax for it cost a second.
  """
  jax = sys.modules.get("jax")
  if jax is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return str(dtype), int(dtype.itemsize)
  dt = dtype_of_name(dtype) if isinstance(dtype, str) else np.dtype(dtype)
  return dt.name, int(dt.itemsize)


@functools.lru_cache(maxsize=4096)
def _cached_placement(sharding: jax.sharding.Sharding,
                      shape: tuple[int, ...]) -> Placement:
  fast = placement_by_arithmetic(sharding, shape)
  if fast is not None:
    return fast
  return _placement_from_indices_map(sharding.devices_indices_map(shape), shape)


def placement_by_arithmetic(sharding: jax.sharding.Sharding,
                            shape: tuple[int, ...]) -> Placement | None:
  """The placement of a plain ``NamedSharding``, by index arithmetic.

  Four times faster on first use than going through ``devices_indices_map``
  (XLA's HloSharding), which is what a resize pays: 12 arrays, 0.26 ms
  against 1.1 ms. Covers a concrete mesh, spec entries that are ``None``, an
  axis name or a tuple of names, and dimensions the axes divide (the same
  arithmetic as :func:`named_layout`); anything else returns ``None`` and
  takes jax's path. ``tests/test_layout_named.py`` checks that both agree.
  """
  from jax.sharding import Mesh, NamedSharding
  if type(sharding) is not NamedSharding:
    return None
  mesh, spec = sharding.mesh, sharding.spec
  if (not isinstance(mesh, Mesh) or getattr(spec, "unreduced", None)
      or getattr(spec, "reduced", None)):
    return None
  entries = []
  for e in spec:
    if e is not None and not isinstance(e, str) and not (
        isinstance(e, tuple) and all(isinstance(a, str) for a in e)):
      return None  # UNCONSTRAINED, or an entry kind this does not know
    entries.append(e)
  devices = mesh.devices
  try:
    return _named_placement_cached(
        shape, tuple(zip(mesh.axis_names, devices.shape)), tuple(entries),
        tuple(d.id for d in devices.flat))
  except LayoutError:  # jax's path raises the error that names the leaf
    return None


def placement_of(sharding: jax.sharding.Sharding, shape: Sequence[int],
                 path: str = "?") -> Placement:
  """The placement of an array of ``shape`` under ``sharding``.

  Raises:
    LayoutError: ``sharding`` cannot shard ``shape`` (indivisible dimension,
      spec longer than the rank, unknown mesh axis); the message names
      ``path``.
  """
  shape = tuple(int(n) for n in shape)
  try:
    return _cached_placement(sharding, shape)
  except Exception as e:  # jax raises ValueError / IndivisibleError / KeyError
    raise LayoutError(f"{path}: sharding {sharding} does not fit shape {shape}:"
                      f" {e}") from e


def _is_array_like(x) -> bool:
  import jax
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


@dataclasses.dataclass(frozen=True)
class PTC:
  """A parallelizable tensor collection: the layout of every tensor of a state.

  Attributes:
    tensors: per tensor, its :class:`TensorLayout`, in the tree's leaf order.
    processes: ``(device id, process index)`` for every device any tensor
      uses, sorted by device id.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    >>> x = jax.ShapeDtypeStruct((8, 4), np.float32,
    ...                          sharding=NamedSharding(mesh, P("model")))
    >>> ptc = PTC.from_tree({"w": x, "step": 3})
    >>> ptc["w"].placement.boxes
    (((0, 4), (0, 4)), ((4, 8), (0, 4)))
    >>> PTC.from_json(ptc.to_json()) == ptc
    True
  """

  tensors: tuple[TensorLayout, ...]
  processes: tuple[tuple[int, int], ...]

  def __post_init__(self):
    seen = set()
    for t in self.tensors:
      if t.path in seen:
        raise LayoutError(f"two tensors share the path {t.path!r}")
      seen.add(t.path)

  @functools.cached_property
  def by_path(self) -> dict[str, TensorLayout]:
    return {t.path: t for t in self.tensors}

  @functools.cached_property
  def process_of(self) -> dict[int, int]:
    return dict(self.processes)

  def __getitem__(self, path: str) -> TensorLayout:
    try:
      return self.by_path[path]
    except KeyError:
      raise KeyError(f"no tensor {path!r} in this layout; tensors:"
                     f" {list(self.by_path)[:8]}...") from None

  def __len__(self) -> int:
    return len(self.tensors)

  def __iter__(self):
    return iter(self.tensors)

  @property
  def paths(self) -> tuple[str, ...]:
    return tuple(t.path for t in self.tensors)

  @property
  def devices(self) -> tuple[int, ...]:
    return tuple(d for d, _ in self.processes)

  @property
  def nbytes(self) -> int:
    """Bytes of one copy of the state (replicas not counted)."""
    return sum(t.nbytes for t in self.tensors)

  @classmethod
  def from_tree(cls, tree: Any) -> PTC:
    """Derives the layout of every array leaf of ``tree``.

    Array leaves are ``jax.Array``s and ``jax.ShapeDtypeStruct``s carrying a
    sharding; every other leaf (Python scalars, strings, numpy arrays) is not
    part of the layout and passes through untouched.

    Raises:
      LayoutError: a ``ShapeDtypeStruct`` has no sharding, or a sharding does
        not fit its leaf's shape; the message names the leaf.
    """
    import jax
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    tensors = []
    processes: dict[int, int] = {}
    for path, leaf in leaves:
      if not _is_array_like(leaf):
        continue
      name = key_path_name(path)
      sharding = getattr(leaf, "sharding", None)
      if sharding is None:
        raise LayoutError(
            f"{name}: ShapeDtypeStruct{tuple(leaf.shape)} {leaf.dtype} carries"
            " no sharding; give it sharding=...")
      shape = tuple(int(n) for n in leaf.shape)
      placement = placement_of(sharding, shape, name)
      dtype, itemsize = dtype_info(leaf.dtype)
      tensors.append(TensorLayout(name, shape, dtype, itemsize, placement,
                                  describe_sharding(sharding)))
      for dev in sharding.device_set:
        processes[int(dev.id)] = int(dev.process_index)
    return cls(tuple(tensors), tuple(sorted(processes.items())))

  def to_json(self) -> str:
    """The universal JSON description of this parallelization config."""
    placements: dict[Placement, int] = {}
    tensors = []
    for t in self.tensors:
      idx = placements.setdefault(t.placement, len(placements))
      d = t.to_json()
      d["placement"] = idx
      tensors.append(d)
    return json.dumps({
        "format": "tenplex_jax.PTC",
        "version": 1,
        "processes": [list(p) for p in self.processes],
        "placements": [p.to_json() for p in placements],
        "tensors": tensors,
    })

  @classmethod
  def from_json(cls, text: str | Mapping) -> PTC:
    """Parses :meth:`to_json` output (a string or the parsed dict)."""
    d = json.loads(text) if isinstance(text, (str, bytes)) else text
    if d.get("format") != "tenplex_jax.PTC":
      raise LayoutError("not a tenplex_jax.PTC JSON document"
                        f" (format={d.get('format')!r})")
    placements = [Placement.from_json(p) for p in d["placements"]]
    tensors = tuple(
        TensorLayout(t["path"], tuple(t["shape"]), t["dtype"],
                     int(t["itemsize"]), placements[t["placement"]],
                     t.get("sharding"))
        for t in d["tensors"])
    return cls(tensors, tuple(tuple(p) for p in d["processes"]))

  def validate(self) -> None:
    """Checks that every tensor's boxes tile its shape exactly."""
    for t in self.tensors:
      t.placement.check_tiles(t.shape, t.path)
      missing = [d for d in t.placement.devices if d not in self.process_of]
      if missing:
        raise LayoutError(f"{t.path}: devices {missing} have no process")


def named_layout(
    path: str,
    shape: Sequence[int],
    dtype: Any,
    *,
    mesh_shape: Mapping[str, int],
    spec: PartitionSpec | Sequence,
    device_ids: Sequence[int] | None = None,
) -> TensorLayout:
  """The layout a ``NamedSharding`` gives, computed without devices.

  The device grid is ``device_ids`` (default ``range(n)``) reshaped to the
  mesh shape, in the axis order of ``mesh_shape``; a dimension sharded over
  several axes is split with the first axis major, as JAX does.

  >>> t = named_layout("w", (8, 4), "float32", mesh_shape={"x": 2, "y": 2},
  ...                  spec=("y",))
  >>> t.placement.boxes, t.placement.holders
  ((((0, 4), (0, 4)), ((4, 8), (0, 4))), ((0, 2), (1, 3)))
  """
  shape = tuple(int(n) for n in shape)
  spec = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
  ids = None if device_ids is None else tuple(int(i) for i in device_ids)
  placement = named_placement(path, shape, tuple(
      (str(k), int(v)) for k, v in mesh_shape.items()), spec, ids)
  name, itemsize = dtype_info(dtype)
  return TensorLayout(path, shape, name, itemsize, placement, None)


def named_placement(path, shape, mesh_items, spec, device_ids) -> Placement:
  try:
    return _named_placement_cached(shape, mesh_items, spec, device_ids)
  except LayoutError as e:
    raise LayoutError(f"{path}: {e}") from None


@functools.lru_cache(maxsize=4096)
def _named_placement_cached(shape, mesh_items, spec, device_ids) -> Placement:
  mesh_shape = dict(mesh_items)
  names = list(mesh_shape)
  sizes = [int(mesh_shape[n]) for n in names]
  n_dev = math.prod(sizes)
  n_ids = n_dev if device_ids is None else len(device_ids)
  if n_ids != n_dev:
    raise LayoutError(f"mesh {dict(mesh_shape)} needs {n_dev} devices,"
                      f" got {n_ids}")
  if len(spec) > len(shape):
    raise LayoutError(f"spec {spec} has {len(spec)} entries but the"
                      f" tensor has rank {len(shape)} (shape {shape})")
  shape = tuple(int(n) for n in shape)  # Python ints in the boxes
  # For each tensor dim, the mesh axes it is split over (major first), the
  # number of boxes along it (1 where it is not split, or is empty) and
  # their size. A dimension's chunk index is its mesh axes' coordinates
  # read as one mixed-radix number (the first axis major); a box's key is
  # its dimensions' chunk indices read the same way, so keys sort as boxes
  # do.
  dim_axes: list[tuple[int, ...]] = []
  radix: list[int] = []
  chunk_of: list[int] = []
  for d, entry in enumerate(spec + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str)
                                     else tuple(entry))
    for a in axes:
      if a not in mesh_shape:
        raise LayoutError(f"axis {a!r} of spec {spec} is not a mesh"
                          f" axis (mesh axes: {names})")
    idx = tuple(names.index(a) for a in axes)
    parts = math.prod(sizes[i] for i in idx)
    if shape[d] % parts:
      raise LayoutError(
          f"dimension {d} of size {shape[d]} cannot be split"
          f" {parts} ways over mesh axes {axes} (shape {shape})")
    dim_axes.append(idx)
    chunk_of.append(shape[d] // parts)
    radix.append(parts if chunk_of[-1] else 1)
  if n_dev <= _SMALL_MESH:
    return _small_mesh_placement(
        sizes, dim_axes, radix, chunk_of, not shape,
        range(n_dev) if device_ids is None else [int(d) for d in device_ids])
  # Whole arrays at a time: linear in devices, no Python loop over them.
  flat_ids = (np.arange(n_dev) if device_ids is None
              else np.asarray(device_ids).reshape(-1))
  coords = np.indices(sizes).reshape(len(sizes), n_dev)
  key = np.zeros(n_dev, dtype=np.int64)
  for idx, r in zip(dim_axes, radix):
    if r == 1:  # one box along this dimension
      continue
    c = np.zeros(n_dev, dtype=np.int64)
    for i in idx:
      c = c * sizes[i] + coords[i]
    key = key * r + c
  order = np.lexsort((flat_ids, key))
  keys, counts = np.unique(key, return_counts=True)
  held = flat_ids[order].tolist()
  ends = np.cumsum(counts).tolist()
  holders = tuple(tuple(held[a:b]) for a, b in zip([0] + ends[:-1], ends))
  if not shape:
    return Placement(((),), holders)
  per_dim = np.unravel_index(keys, radix)
  ranges = [list(zip((c * chunk).tolist(), ((c + 1) * chunk).tolist()))
            for c, chunk in zip(per_dim, chunk_of)]
  boxes = tuple(zip(*ranges))
  return Placement(boxes, holders)


# Meshes of up to this many devices are placed by a Python loop over the
# devices: a dozen numpy calls on arrays this small cost more (a placement
# on 4-8 devices 37-45 us that way, 14-25 us by the loop, checks included),
# and a reshard plans two placements per class of arrays (about 90 classes
# in a random state).
_SMALL_MESH = 64


def _small_mesh_placement(sizes, dim_axes, radix, chunk_of, scalar,
                          ids) -> Placement:
  """:func:`_named_placement_cached`'s placement from its ``dim_axes``,
  ``radix`` and ``chunk_of``, device by device: the same keys, boxes and
  holders (``tests/test_layout_named.py`` checks both ways against each
  other and against jax). ``ids``: Python ints, in the mesh's order."""
  keys: dict[int, list[int]] = {}
  coord = [0] * len(sizes)
  for dev in ids:  # row-major over the mesh, as the array path flattens it
    key = 0
    for idx, r in zip(dim_axes, radix):
      if r == 1:
        continue
      c = 0
      for i in idx:
        c = c * sizes[i] + coord[i]
      key = key * r + c
    keys.setdefault(key, []).append(dev)
    for i in range(len(sizes) - 1, -1, -1):  # the next mesh coordinate
      coord[i] += 1
      if coord[i] < sizes[i]:
        break
      coord[i] = 0
  order = sorted(keys)
  holders = tuple(tuple(sorted(keys[k])) for k in order)
  if scalar:
    return Placement(((),), holders)
  boxes = []
  for k in order:
    box = [None] * len(radix)
    for d in range(len(radix) - 1, -1, -1):
      k, c = divmod(k, radix[d])
      box[d] = (c * chunk_of[d], (c + 1) * chunk_of[d])
    boxes.append(tuple(box))
  return Placement(tuple(boxes), holders)


def ptc_from_layouts(tensors: Iterable[TensorLayout],
                     process_of: Mapping[int, int] | int = 1) -> PTC:
  """Builds a PTC from hand-made layouts (see :func:`named_layout`).

  Args:
    tensors: the tensor layouts.
    process_of: device id -> process index, or an int ``k`` meaning ``k``
      devices per process (device ``d`` is in process ``d // k``).
  """
  tensors = tuple(tensors)
  placements = {id(t.placement): t.placement for t in tensors}  # shared ones once
  devs = sorted(set().union(*(p.box_of_device for p in placements.values())))
  if isinstance(process_of, int):
    procs = tuple(zip(devs, [d // process_of for d in devs]))
  else:
    procs = tuple((d, int(process_of[d])) for d in devs)
  return PTC(tensors, procs)
