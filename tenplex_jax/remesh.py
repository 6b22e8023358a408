"""Re-mesh a training state: the same state, on a new mesh.

``remesh(state, mesh=...)`` takes a Flax linen ``TrainState`` (params boxed
with ``nn.with_logical_partitioning``, any optax state, the step, RNG keys),
an ``nnx`` state, or any pytree of ``jax.Array``s, works out each array's
sharding on the new mesh and moves it there with the minimum data movement.
The state keeps its structure: metadata boxes (``nn.LogicallyPartitioned``,
``nnx.Variable``) stay, so ``nn.get_partition_spec`` and the user's jitted
train step keep working.

Target shardings come from, in order of precedence:

1. ``shardings``: an explicit sharding tree, as ``jax.device_put`` takes it
   (a prefix tree such as lm1b's, with one sharding per box; a
   ``PartitionSpec`` uses ``mesh`` or the mesh in context);
2. ``rules``: logical axis rules applied to each leaf's logical names: those
   of ``logical_axes=`` (for an unboxed state: ``nn.get_partition_spec`` of
   the boxed abstract state, or that state itself), else those its box
   carries (``nn.LogicallyPartitioned.names``, an nnx variable's
   ``out_sharding``). Rules are never ignored: a state with no logical names
   anywhere raises :class:`LayoutError` instead of keeping its old specs;
3. otherwise each array keeps its ``PartitionSpec`` on the new mesh (arrays
   with no ``NamedSharding``, e.g. a step counter on one device, are
   replicated).

A dimension that the new mesh cannot divide falls back to replication, with
one :class:`ReplicationWarning` grouping the affected leaves, or raises
:class:`LayoutError` with ``strict=True``. The :class:`RemeshReport` carries
the mesh, the rules and the sharding tree actually used, so the user re-jits
with exactly those.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tenplex_jax._problems import Problem, format_problems, raise_problems
from tenplex_jax._targets import (MISMATCH, context_mesh, is_box, per_leaf,
                                  shardings_tree, variable_names)
from tenplex_jax.errors import LayoutError, ReplicationWarning
from tenplex_jax.layout import key_path_name
from tenplex_jax.reshard import ReshardReport, reshard_items, resolve_targets
from tenplex_jax import search

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
    mesh: the ``jax.sharding.Mesh`` the state was put on (``None`` when
      explicit ``shardings`` span several meshes or none).
    rules: the logical axis rules used (given, or picked by the
      configuration search), or ``None``.
    shardings: the target sharding of every array, in the state's structure
      with each Flax box replaced by its value's sharding and ``None`` at
      leaves that are not arrays: what ``jax.jit(out_shardings=...)`` and
      ``jax.device_put`` take. After a replication fallback it holds the
      replicated dimensions, unlike shardings derived from the rules.
  """

  mesh_shape: Mapping[str, int]
  reshard: ReshardReport
  fallbacks: tuple[Fallback, ...]
  seconds: Mapping[str, float]
  mesh: Mesh | None = None
  rules: tuple | None = None
  shardings: Any = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def moved_bytes(self) -> int:
    return self.reshard.moved_bytes

  @property
  def lower_bound_bytes(self) -> int:
    return self.reshard.lower_bound_bytes

  def to_dict(self) -> dict:
    return {"mesh_shape": dict(self.mesh_shape),
            "rules": None if self.rules is None else [
                [k, list(v) if isinstance(v, tuple) else v]
                for k, v in self.rules],
            "reshard": self.reshard.to_dict(),
            "fallbacks": [dataclasses.asdict(f) for f in self.fallbacks],
            "seconds": dict(self.seconds)}

  def __str__(self) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    lines = [f"re-meshed onto {mesh} in {self.seconds['total'] * 1e3:.1f} ms"
             f" (targets {self.seconds['target'] * 1e3:.1f} ms)",
             "  " + str(self.reshard)]
    lines += ["  replicated: " + line
              for line in format_problems(_fallback_problems(self.fallbacks))]
    return "\n".join(lines)


def _fallback_problems(fallbacks: Sequence[Fallback]) -> list[Problem]:
  return [Problem(f.path, str(f)[len(f.path) + 2:],
                  f"dimension {f.dim} of size {f.size} cannot be split {f.parts}"
                  f" ways over {f.axes}") for f in fallbacks]


def _is_annotation(x) -> bool:
  """A leaf of a ``logical_axes`` tree: logical names as a PartitionSpec
  (``nn.get_partition_spec``), a box (a boxed abstract state), an abstract or
  concrete array (no names), or ``None``."""
  return (x is None or isinstance(x, (PartitionSpec, jax.ShapeDtypeStruct,
                                      jax.Array)) or is_box(x))


def _logical_names(ann) -> tuple | None:
  """The logical axis names an annotation carries, or None."""
  import flax.linen as nn
  if isinstance(ann, PartitionSpec):
    return tuple(ann)
  if isinstance(ann, nn.LogicallyPartitioned):
    return tuple(ann.names)
  if isinstance(ann, nn.Partitioned) or not is_box(ann):
    return None  # mesh axes, or no names at all
  return variable_names(ann)  # an nnx variable


def _spec_of(ann, rules) -> PartitionSpec | None:
  """The mesh spec an annotation implies under ``rules`` (as Flax computes
  it), or None to keep the array's current spec."""
  import flax.linen as nn
  if isinstance(ann, nn.Partitioned) and not isinstance(
      ann, nn.LogicallyPartitioned):
    return PartitionSpec(*ann.names)
  if rules is None or ann is None:
    return None
  if isinstance(ann, (jax.ShapeDtypeStruct, jax.Array)):
    return PartitionSpec()  # an unboxed leaf: Flax replicates it
  names = _logical_names(ann)
  if names is None:
    return None
  if isinstance(ann, (PartitionSpec, nn.LogicallyPartitioned)):
    return nn.logical_to_mesh_axes(names, rules)
  # An nnx variable: nnx's own mapping (names without a rule stay as they
  # are, i.e. are taken as mesh axes), with the variable's local rules.
  from flax.core import spmd as core_spmd
  local = ann.get_metadata().get("sharding_rules") or ()
  merged = core_spmd.composite_rules(tuple(rules), tuple(local))
  return PartitionSpec(*core_spmd.from_sharding_rules(names, merged))


def _spec_key(ann) -> tuple | None:
  """A key under which annotations imply the same spec (None: no key)."""
  import flax.linen as nn
  if ann is None:
    return ("none",)
  if isinstance(ann, PartitionSpec):
    return ("linen", tuple(ann))
  if isinstance(ann, nn.LogicallyPartitioned):
    return ("linen", tuple(ann.names))
  if isinstance(ann, (jax.ShapeDtypeStruct, jax.Array)):
    return ("leaf",)
  return None


def _annotations(state: Any, logical_axes: Any) -> list:
  """Per leaf of ``state`` (flatten order), what says its logical names:
  ``logical_axes`` where given, else the box holding the leaf, else None."""
  anns = []
  for node in jax.tree_util.tree_leaves(state, is_leaf=is_box):
    if is_box(node):
      anns += [node] * len(jax.tree_util.tree_leaves(node))
    else:
      anns.append(None)
  if logical_axes is None:
    return anns
  given, _, problems = per_leaf(state, logical_axes, is_leaf=_is_annotation)
  bad = [i for i, a in enumerate(given)
         if a is MISMATCH or not _is_annotation(a)]
  if problems or bad:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    problems += [Problem(key_path_name(flat[i][0]),
                         f"logical_axes gives {given[i]!r:.60} of type"
                         f" {type(given[i]).__name__}, not a PartitionSpec"
                         " of logical names or a box",
                         "logical_axes leaves must be PartitionSpecs of"
                         " logical names or Flax boxes")
                 for i in bad if given[i] is not MISMATCH]
    raise_problems(LayoutError, "logical_axes does not match the state",
                   problems)
  return [a if a is not None else b for a, b in zip(given, anns)]


@functools.lru_cache(maxsize=4096)
def _fit_spec(shape: tuple, spec: PartitionSpec, mesh_items: tuple
              ) -> tuple[PartitionSpec, tuple, tuple]:
  """``spec`` with the entries the mesh cannot divide dropped; the dropped
  ``(dim, size, axes, parts)`` and the problems ``(message, kind)``."""
  sizes = dict(mesh_items)
  entries = list(spec)
  if len(entries) > len(shape):
    if all(e is None for e in entries[len(shape):]):
      entries = entries[:len(shape)]
    else:
      return spec, (), ((
          f"spec {spec} has {len(entries)} entries for an array of rank"
          f" {len(shape)} (shape {shape})",
          "a spec is longer than the rank of its array"),)
  out, dropped, problems = [], [], []
  used: dict[str, int] = {}  # mesh axis -> the first dimension it shards
  for d, entry in enumerate(entries):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(None)
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    again = [a for i, a in enumerate(axes) if a in used or a in axes[:i]]
    if again:  # as nnx's rules may map two names to one axis
      first = ", ".join(f"{a!r} (dimension {used.get(a, d)})" for a in again)
      problems.append((
          f"spec {spec} uses mesh axes more than once: dimension {d} uses"
          f" {first} again",
          "a spec uses a mesh axis for more than one dimension"))
      out.append(None)
      continue
    used.update((a, d) for a in axes)
    unknown = [a for a in axes if a not in sizes]
    if unknown:
      problems.append((
          f"axes {unknown} of spec {spec} are not in the new mesh (axes"
          f" {sizes})",
          f"mesh axes {unknown} are not in the new mesh (axes {sizes})"))
      out.append(None)
      continue
    parts = math.prod(sizes[a] for a in axes)
    if shape[d] % parts:
      dropped.append((d, int(shape[d]), axes, parts))
      out.append(None)
    else:
      out.append(entry)
  return PartitionSpec(*out), tuple(dropped), tuple(problems)


def _fit(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh,
         fallbacks: list, problems: list) -> PartitionSpec:
  """Drops spec entries the mesh cannot divide; records unknown axes."""
  out, dropped, found = _fit_spec(
      tuple(int(n) for n in shape), spec,
      tuple(zip(mesh.axis_names, mesh.devices.shape)))
  fallbacks += [Fallback(path, *f) for f in dropped]
  problems += [Problem(path, message, kind) for message, kind in found]
  return out


_NO_NAMES = (
    "no array of the state carries logical axis names"
    " (its params are unboxed, as lm1b and most Flax trainers keep them), so"
    " the rules cannot say where anything goes. Pass the names with"
    " logical_axes=nn.get_partition_spec(boxed_abstract_state) (or the boxed"
    " abstract state itself, from jax.eval_shape of the init), keep the boxes"
    " in the state, or give shardings=")


def target_shardings(state: Any, mesh: Mesh, *, rules=None,
                     strict: bool = False, logical_axes: Any = None
                     ) -> tuple[list, Any, list]:
  """Derives each array leaf's sharding on ``mesh``.

  Args:
    state: the state.
    mesh: the new mesh.
    rules: logical axis rules, or None to keep each array's spec.
    strict: raise instead of replicating a dimension the mesh cannot divide.
    logical_axes: a prefix tree of logical names for an unboxed state (see
      :func:`remesh`).

  Returns:
    ``(items, treedef, fallbacks)``: ``items`` lists ``(path, leaf,
    sharding or None)`` for every leaf of ``state`` in flatten order.

  Raises:
    LayoutError: a spec names an axis the mesh lacks; rules were given but
      no leaf has logical names; or, with ``strict``, a dimension the mesh
      cannot divide. All leaves are reported together, grouped.
  """
  anns = _annotations(state, logical_axes)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  if rules is not None and not any(
      _logical_names(a) for a, (_, leaf) in zip(anns, flat)
      if isinstance(leaf, jax.Array)):
    raise LayoutError("rules were given but " + _NO_NAMES)
  fallbacks: list[Fallback] = []
  problems: list = []
  items = []
  cache: dict[PartitionSpec, NamedSharding] = {}
  specs: dict = {}  # (annotation kind, names) -> spec, for this call
  for (path, leaf), ann in zip(flat, anns):
    name = key_path_name(path)
    if not isinstance(leaf, jax.Array):
      items.append((name, leaf, None))
      continue
    key = _spec_key(ann)
    if key is None:
      spec = _spec_of(ann, rules)
    else:
      if key not in specs:
        specs[key] = _spec_of(ann, rules)
      spec = specs[key]
    if spec is None:
      s = leaf.sharding
      spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    spec = _fit(name, leaf.shape, spec, mesh, fallbacks, problems)
    if spec not in cache:
      cache[spec] = NamedSharding(mesh, spec)
    items.append((name, leaf, cache[spec]))
  if strict and fallbacks:
    problems += [Problem(
        f.path, f"dim {f.dim} of size {f.size} cannot be split {f.parts} ways"
        f" over mesh axes {f.axes}", f"dimension {f.dim} of size {f.size} cannot be"
        f" split {f.parts} ways over mesh axes {f.axes}") for f in fallbacks]
  if problems:
    raise_problems(LayoutError, "cannot place the state on mesh "
                   f"{dict(zip(mesh.axis_names, mesh.devices.shape))}",
                   problems)
  return items, treedef, fallbacks


def _nnx_params(state: Any) -> list[bool] | None:
  """Per leaf of ``state`` (flatten order), whether it is the value of an
  ``nnx.Param``; None if the state holds no ``nnx.Param``."""
  nnx = sys.modules.get("flax.nnx")  # no nnx variables unless it is loaded
  if nnx is None:
    return None
  mask = []
  for node in jax.tree_util.tree_leaves(state, is_leaf=is_box):
    count = len(jax.tree_util.tree_leaves(node)) if is_box(node) else 1
    mask += [isinstance(node, nnx.Param)] * count
  return mask if any(mask) else None


def _search_mesh(state, logical_axes, devices, *, global_batch, seq_len,
                 hardware):
  """The configuration search's mesh and rules for ``state`` on ``devices``.

  The search reads the parameters with their logical names, from boxes or
  ``logical_axes``: the arrays of ``nnx.Param`` variables if the state has
  any (``nnx.state((model, optimizer))`` also holds the optimizer's moments,
  which are not parameters), else the leaves under ``params/`` of a linen
  TrainState (``model/`` of an older nnx optimizer state), else every leaf.
  """
  import flax.linen as nn


  if global_batch is None:
    raise TypeError("remesh(devices=...) needs global_batch= for the"
                    " configuration search")
  anns = _annotations(state, logical_axes)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  names = [key_path_name(p) for p, _ in flat]
  is_param = _nnx_params(state)
  prefix = next((p for p in ("params/", "model/")
                 if any(n.startswith(p) for n in names)), "")
  abstract = []
  for i, (n, (_, leaf), ann) in enumerate(zip(names, flat, anns)):
    wanted = is_param[i] if is_param is not None else n.startswith(prefix)
    if not wanted or not isinstance(leaf, jax.Array):
      continue
    sds = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    logical = _logical_names(ann)
    abstract.append(nn.LogicallyPartitioned(sds, logical) if logical
                    else sds)
  if not any(isinstance(a, nn.LogicallyPartitioned) for a in abstract):
    raise LayoutError("remesh(devices=...): the configuration search picks"
                      " logical axis rules, but " + _NO_NAMES)
  best = search.best_mesh_for(abstract, list(devices),
                              global_batch=global_batch, seq_len=seq_len,
                              hardware=hardware)
  return best.mesh, tuple(best.rules)


def _box_mesh(box):
  if hasattr(box, "get_metadata"):  # nnx
    return box.get_metadata().get("mesh")
  return getattr(box, "mesh", None)


def _retarget_boxes(state: Any, mesh: Mesh, rules) -> Any:
  """Boxes that name a mesh (``nn.with_logical_partitioning(..., mesh=)``,
  ``nnx.with_partitioning(..., mesh=)``) or their own rules name the new
  ones: ``unbox()`` in the user's step constrains to the box's mesh, which
  would be the old one."""
  import flax.linen as nn

  def stale(b) -> bool:
    if not is_box(b):
      return False
    if _box_mesh(b) is not None and _box_mesh(b) != mesh:
      return True
    return (rules is not None and isinstance(b, nn.LogicallyPartitioned)
            and b.rules is not None and tuple(b.rules) != rules)

  if not any(stale(b) for b in jax.tree_util.tree_leaves(state,
                                                          is_leaf=is_box)):
    return state

  def fix(b):
    if not stale(b):
      return b
    if isinstance(b, nn.Partitioned):
      kw = {"mesh": mesh} if b.mesh is not None else {}
      if isinstance(b, nn.LogicallyPartitioned) and b.rules is not None \
          and rules is not None:
        kw["rules"] = rules
      return b.replace(**kw)
    b.set_metadata(mesh=mesh)  # an nnx variable the rebuild just made
    return b

  return jax.tree_util.tree_map(fix, state, is_leaf=is_box)


def remesh(state: Any, mesh: Mesh | None = None, *, rules=None,
           shardings: Any = None, logical_axes: Any = None,
           devices: Sequence[Any] | None = None,
           global_batch: int | None = None, seq_len: int = 1,
           hardware: Any = "cpu", strict: bool = False, donate: bool = False,
           method: str = "auto") -> tuple[Any, RemeshReport]:
  """Moves a training state onto a new mesh.

  Args:
    state: a Flax ``TrainState`` (boxed or unboxed), an ``nnx.State``, or any
      pytree of arrays.
    mesh: the new mesh; default: the mesh set with ``jax.set_mesh``.
      Required unless ``shardings`` or ``devices`` is given.
    rules: logical axis rules (``(("embed", "fsdp"), ("mlp", "tensor"),
      ...)``) for leaves with logical names.
    shardings: an explicit sharding tree, as ``jax.device_put`` takes it
      (see ``reshard``): e.g. lm1b's prefix tree
      ``nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_state),
      mesh, rules)``. ``PartitionSpec`` leaves use ``mesh`` if given, else
      the mesh in context. Not combined with ``rules``.
    logical_axes: the logical names of an unboxed state's leaves: a prefix
      tree of ``PartitionSpec`` objects of logical names
      (``nn.get_partition_spec(boxed_abstract_state)``) or the boxed abstract
      state itself. Used with ``rules`` (or the search's rules); where given
      it takes precedence over the state's own boxes.
    devices: with no mesh, the devices to run on: the configuration search
      (:func:`tenplex_jax.search.best_mesh_for`) picks the mesh shape and the
      logical axis rules (unless ``rules`` is given) from the state's
      parameters and their logical names (boxes or ``logical_axes``).
    global_batch: samples per step, needed with ``devices``.
    seq_len: tokens per sample, for the search's cost model.
    hardware: a hardware preset name or ``search.Hardware`` for the search.
    strict: raise instead of replicating a dimension the mesh cannot divide.
    donate: free old arrays as they are converted (see ``reshard``).
    method: the executor, as in ``reshard``.

  Returns:
    ``(new_state, report)``: the state, same structure and boxes, on the new
    mesh; and a :class:`RemeshReport`, whose ``mesh``, ``rules`` and
    ``shardings`` are what to re-jit the train step with.

  Raises:
    LayoutError: an axis is not in the mesh; rules (given or searched) but
      no logical names anywhere in the state; or (``strict``) a dimension
      cannot be divided; nothing has moved yet.
    TypeError: no mesh, devices or shardings; ``shardings`` with ``rules``;
      ``logical_axes`` without rules.

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
    >>> report.shardings["w"] == NamedSharding(new, P(None, "tensor"))
    True
  """
  t0 = time.perf_counter()
  fallbacks: list[Fallback] = []
  if shardings is not None:
    if rules is not None or logical_axes is not None:
      raise TypeError("remesh takes shardings= or rules= (with"
                      " logical_axes=), not both: the rules would be ignored")
    items, rebuild = resolve_targets(state, shardings, mesh=mesh)
    meshes = {s.mesh for _, _, s in items if isinstance(s, NamedSharding)}
    used_mesh = next(iter(meshes)) if len(meshes) == 1 else None
    mesh_shape = dict(used_mesh.shape) if used_mesh is not None else {}
  else:
    if mesh is None and devices is not None:
      mesh, found = _search_mesh(state, logical_axes, devices,
                                 global_batch=global_batch, seq_len=seq_len,
                                 hardware=hardware)
      rules = found if rules is None else rules
    if mesh is None:
      mesh = context_mesh()  # as jax does: the mesh of jax.set_mesh
    if mesh is None:
      raise TypeError("remesh needs a mesh (or one set with jax.set_mesh),"
                      " devices, or a pytree of shardings")
    if logical_axes is not None and rules is None:
      raise TypeError("remesh(logical_axes=...) needs rules= to turn the"
                      " logical names into mesh axes")
    items, treedef, fallbacks = target_shardings(
        state, mesh, rules=rules, strict=strict, logical_axes=logical_axes)
    rebuild = treedef.unflatten
    used_mesh = mesh
    mesh_shape = dict(mesh.shape)
  if fallbacks:
    warnings.warn(
        f"{len(fallbacks)} dimension(s) cannot be divided by the new mesh"
        f" {mesh_shape} and are replicated (report.shardings has the"
        " shardings used):\n  "
        + "\n  ".join(format_problems(_fallback_problems(fallbacks))),
        ReplicationWarning, stacklevel=2)
  t1 = time.perf_counter()
  new_state, rep = reshard_items(items, rebuild, donate=donate, method=method,
                                 t0=t1)
  if used_mesh is not None:
    new_state = _retarget_boxes(new_state, used_mesh,
                                None if rules is None else tuple(rules))
  seconds = {"target": t1 - t0, **{k: v for k, v in rep.seconds.items()
                                   if k != "total"},
             "total": time.perf_counter() - t0}
  return new_state, RemeshReport(
      mesh_shape, rep, tuple(fallbacks), seconds, mesh=used_mesh,
      rules=None if rules is None else tuple(rules),
      shardings=shardings_tree(state, [s for _, _, s in items]))
