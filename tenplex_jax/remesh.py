"""Re-mesh a training state: the same state, on a new mesh.

``remesh(state, mesh=...)`` takes a Flax linen ``TrainState`` (params boxed
with ``nn.with_logical_partitioning``, any optax state, the step, RNG keys),
an ``nnx`` state, or any pytree of ``jax.Array``s, works out each array's
sharding on the new mesh and moves it there with the minimum data movement.
The state keeps its structure: metadata boxes (``nn.LogicallyPartitioned``,
``nnx.Variable``) stay, so ``nn.get_partition_spec`` and the user's jitted
train step keep working.

Target shardings come from, in order of precedence:

1. ``shardings``: an explicit pytree of shardings;
2. ``rules``: logical axis rules applied to each boxed leaf's logical names
   (``nn.LogicallyPartitioned.names``, an nnx variable's ``out_sharding``);
3. otherwise each array keeps its ``PartitionSpec`` on the new mesh (arrays
   with no ``NamedSharding``, e.g. a step counter on one device, are
   replicated).

A dimension that the new mesh cannot divide falls back to replication, with
one :class:`ReplicationWarning` listing every affected leaf, or raises
:class:`LayoutError` with ``strict=True``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tenplex_jax.errors import LayoutError, ReplicationWarning
from tenplex_jax.layout import key_path_name
from tenplex_jax.reshard import ReshardReport, reshard_items, resolve_targets

__all__ = ["Fallback", "RemeshReport", "remesh", "target_shardings"]


@dataclasses.dataclass(frozen=True)
class Fallback:
  """A dimension of a leaf replicated because the mesh cannot divide it."""

  path: str
  dim: int
  size: int
  axes: tuple[str, ...]
  parts: int

  def __str__(self) -> str:
    return (f"{self.path}: dim {self.dim} of size {self.size} cannot be split"
            f" {self.parts} ways over {self.axes}; replicated")


@dataclasses.dataclass(frozen=True)
class RemeshReport:
  """What a re-mesh did.

  Attributes:
    mesh_shape: the new mesh's axis sizes.
    reshard: bytes moved against the lower bound, and transfer timings.
    fallbacks: dimensions replicated because the mesh cannot divide them.
    seconds: time per phase: ``target`` (deriving shardings), ``layout``,
      ``plan``, ``transfer``, ``total``.
  """

  mesh_shape: Mapping[str, int]
  reshard: ReshardReport
  fallbacks: tuple[Fallback, ...]
  seconds: Mapping[str, float]

  @property
  def moved_bytes(self) -> int:
    return self.reshard.moved_bytes

  @property
  def lower_bound_bytes(self) -> int:
    return self.reshard.lower_bound_bytes

  def to_dict(self) -> dict:
    return {"mesh_shape": dict(self.mesh_shape),
            "reshard": self.reshard.to_dict(),
            "fallbacks": [dataclasses.asdict(f) for f in self.fallbacks],
            "seconds": dict(self.seconds)}

  def __str__(self) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    lines = [f"re-meshed onto {mesh} in {self.seconds['total'] * 1e3:.1f} ms"
             f" (targets {self.seconds['target'] * 1e3:.1f} ms)",
             "  " + str(self.reshard)]
    lines += [f"  replicated: {f}" for f in self.fallbacks]
    return "\n".join(lines)


def _is_box(x) -> bool:
  # Imported lazily: flax is only needed when a state holds its boxes.
  try:
    import flax.linen as nn
    from flax import nnx
  except ImportError:  # pragma: no cover - flax is a dependency
    return False
  return isinstance(x, (nn.Partitioned, nnx.Variable))


def _logical_names(box) -> tuple | None:
  """The logical axis names a box carries, or None."""
  import flax.linen as nn
  if isinstance(box, nn.LogicallyPartitioned):
    return tuple(box.names)
  if isinstance(box, nn.Partitioned):
    return None  # names are mesh axes, handled as a spec
  meta = box.get_metadata() if hasattr(box, "get_metadata") else {}
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = meta.get(key)
    if names is not None and not isinstance(names, jax.sharding.Sharding):
      return tuple(names)
  return None


def _spec_of_box(box, rules) -> PartitionSpec | None:
  import flax.linen as nn
  if isinstance(box, nn.Partitioned) and not isinstance(
      box, nn.LogicallyPartitioned):
    return PartitionSpec(*box.names)
  names = _logical_names(box)
  if names is None:
    return None
  if rules is None:
    return None  # keep the array's current spec
  return nn.logical_to_mesh_axes(names, rules)


def _fit(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh,
         fallbacks: list, problems: list) -> PartitionSpec:
  """Drops spec entries the mesh cannot divide; records unknown axes."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  entries = list(spec)
  if len(entries) > len(shape):
    if all(e is None for e in entries[len(shape):]):
      entries = entries[:len(shape)]
    else:
      problems.append(f"{path}: spec {spec} has {len(entries)} entries for"
                      f" an array of rank {len(shape)} (shape {tuple(shape)})")
      return spec
  out = []
  for d, entry in enumerate(entries):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(None)
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    unknown = [a for a in axes if a not in sizes]
    if unknown:
      problems.append(f"{path}: axes {unknown} of spec {spec} are not in the"
                      f" new mesh (axes {dict(sizes)})")
      out.append(None)
      continue
    parts = math.prod(sizes[a] for a in axes)
    if shape[d] % parts:
      fallbacks.append(Fallback(path, d, int(shape[d]), axes, parts))
      out.append(None)
    else:
      out.append(entry)
  return PartitionSpec(*out)


def target_shardings(state: Any, mesh: Mesh, *, rules=None,
                     strict: bool = False) -> tuple[list, Any, list]:
  """Derives each array leaf's sharding on ``mesh``.

  Returns:
    ``(items, treedef, fallbacks)``: ``items`` lists ``(path, leaf,
    sharding or None)`` for every leaf of ``state`` in flatten order.

  Raises:
    LayoutError: a spec names an axis the mesh lacks; or, with ``strict``, a
      dimension the mesh cannot divide. All leaves are reported together.
  """
  box_specs: dict[str, PartitionSpec | None] = {}
  for path, node in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=_is_box)[0]:
    if _is_box(node):
      box_specs[key_path_name(path)] = _spec_of_box(node, rules)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  fallbacks: list[Fallback] = []
  problems: list[str] = []
  items = []
  cache: dict[PartitionSpec, NamedSharding] = {}
  for path, leaf in flat:
    name = key_path_name(path)
    if not isinstance(leaf, jax.Array):
      items.append((name, leaf, None))
      continue
    spec = box_specs.get(name)
    if spec is None:
      s = leaf.sharding
      spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    spec = _fit(name, leaf.shape, spec, mesh, fallbacks, problems)
    if spec not in cache:
      cache[spec] = NamedSharding(mesh, spec)
    items.append((name, leaf, cache[spec]))
  if strict and fallbacks:
    problems += [f"{f.path}: dim {f.dim} of size {f.size} cannot be split"
                 f" {f.parts} ways over mesh axes {f.axes}" for f in fallbacks]
  if problems:
    raise LayoutError("cannot place the state on mesh "
                      f"{dict(zip(mesh.axis_names, mesh.devices.shape))}:\n  "
                      + "\n  ".join(problems))
  return items, treedef, fallbacks


def _search_mesh(state, devices, *, global_batch, seq_len, hardware):
  """The configuration search's mesh and rules for ``state`` on ``devices``."""
  from tenplex_jax.search import best_mesh_for

  if global_batch is None:
    raise TypeError("remesh(devices=...) needs global_batch= for the"
                    " configuration search")
  params = getattr(state, "params", state)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
      if isinstance(x, jax.Array) else x, params)
  best = best_mesh_for(abstract, list(devices), global_batch=global_batch,
                       seq_len=seq_len, hardware=hardware)
  return best.mesh, tuple(best.rules)


def remesh(state: Any, mesh: Mesh | None = None, *, rules=None,
           shardings: Any = None, devices: Sequence[Any] | None = None,
           global_batch: int | None = None, seq_len: int = 1,
           hardware: Any = "cpu", strict: bool = False, donate: bool = False,
           method: str = "auto") -> tuple[Any, RemeshReport]:
  """Moves a training state onto a new mesh.

  Args:
    state: a Flax ``TrainState``, an ``nnx.State``, or any pytree of arrays.
    mesh: the new mesh. Required unless ``shardings`` or ``devices`` is
      given.
    rules: logical axis rules (``(("embed", "fsdp"), ("mlp", "tensor"),
      ...)``) for leaves with logical names.
    shardings: an explicit pytree of target shardings (see ``reshard``).
    devices: with no mesh, the devices to run on: the configuration search
      (:func:`tenplex_jax.search.best_mesh_for`) picks the mesh shape and the
      logical axis rules (unless ``rules`` is given) from the state's
      parameters (``state.params`` if present, else the whole state).
    global_batch: samples per step, needed with ``devices``.
    seq_len: tokens per sample, for the search's cost model.
    hardware: a hardware preset name or ``search.Hardware`` for the search.
    strict: raise instead of replicating a dimension the mesh cannot divide.
    donate: free old arrays as they are converted (see ``reshard``).
    method: the executor, as in ``reshard``.

  Returns:
    ``(new_state, report)``: the state, same structure, on the new mesh; and
    a :class:`RemeshReport`.

  Raises:
    LayoutError: an axis is not in the mesh, or (``strict``) a dimension
      cannot be divided; nothing has moved yet.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> devs = np.array(jax.devices()[:4])
    >>> old = Mesh(devs.reshape(4, 1), ("data", "tensor"))
    >>> new = Mesh(devs[:2].reshape(1, 2), ("data", "tensor"))
    >>> w = jax.device_put(np.ones((8, 4), np.float32),
    ...                    NamedSharding(old, P(None, "tensor")))
    >>> state, report = remesh({"w": w, "step": 3}, new)
    >>> dict(state["w"].sharding.mesh.shape)
    {'data': 1, 'tensor': 2}
  """
  t0 = time.perf_counter()
  fallbacks: list[Fallback] = []
  if shardings is not None:
    items, rebuild = resolve_targets(state, shardings)
    meshes = {s.mesh for _, _, s in items if isinstance(s, NamedSharding)}
    mesh_shape = dict(next(iter(meshes)).shape) if len(meshes) == 1 else {}
  else:
    if mesh is None and devices is not None:
      mesh, found = _search_mesh(state, devices, global_batch=global_batch,
                                 seq_len=seq_len, hardware=hardware)
      rules = found if rules is None else rules
    if mesh is None:
      raise TypeError("remesh needs a mesh, devices, or a pytree of"
                      " shardings")
    items, treedef, fallbacks = target_shardings(state, mesh, rules=rules,
                                                 strict=strict)
    rebuild = treedef.unflatten
    mesh_shape = dict(mesh.shape)
  if fallbacks:
    warnings.warn(
        f"{len(fallbacks)} dimension(s) cannot be divided by the new mesh"
        f" {mesh_shape} and are replicated:\n  "
        + "\n  ".join(str(f) for f in fallbacks),
        ReplicationWarning, stacklevel=2)
  t1 = time.perf_counter()
  new_state, rep = reshard_items(items, rebuild, donate=donate, method=method,
                                 t0=t1)
  seconds = {"target": t1 - t0, **{k: v for k, v in rep.seconds.items()
                                   if k != "total"},
             "total": time.perf_counter() - t0}
  return new_state, RemeshReport(mesh_shape, rep, tuple(fallbacks), seconds)
