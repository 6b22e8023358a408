"""Target trees as users write them, matched leaf by leaf against a state.

``jax.device_put(state, shardings)`` and ``jax.jit(out_shardings=...)`` take
a sharding tree that is a *prefix* of the state: Flax's lm1b builds it with
``nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_state), mesh,
rules)``, which puts one sharding where the state has an
``nn.LogicallyPartitioned`` box. Users also write a bare
``PartitionSpec`` with the mesh set by ``jax.set_mesh``, one sharding for a
whole tree, nnx variables holding shardings (``nnx.get_named_sharding``)
and the same array under two paths with two targets. This module turns any
of these into one target per leaf of the state, in the state's flatten
order, so the executor only ever sees ``(path, leaf, sharding)``:

* a target leaf (a ``Sharding``, ``PartitionSpec``, ``jax.Device``, a
  ``jax.ShapeDtypeStruct`` carrying a sharding, or ``None``) covering a subtree applies to every array in it (jax's prefix
  rule), boxes included;
* metadata boxes are transparent on both sides (a boxed state with an
  unboxed target, an unboxed state with a boxed target);
* node metadata that jax compares exactly (a ``TrainState``'s ``apply_fn``
  and ``tx``, which differ between two ``eval_shape`` calls) is not
  compared: structures match by their keys;
* a ``PartitionSpec`` uses the given mesh, else the mesh in context
  (``jax.set_mesh``, or the older ``with mesh:``);
* a ``NamedSharding`` on an ``AbstractMesh`` (what ``nnx.eval_shape`` gives
  under ``jax.set_mesh``) is bound to the same concrete mesh: the given
  one, else the one in context (:func:`bind_sharding`);
* every problem (no target for an array, a target that is no sharding, a
  spec that does not fit its leaf) is collected and reported grouped.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import (AbstractMesh, Mesh, NamedSharding, PartitionSpec,
                          Sharding, SingleDeviceSharding)

from tenplex_jax._problems import Problem, raise_problems
from tenplex_jax.errors import LayoutError, TreeError
from tenplex_jax.layout import key_path_name

__all__ = ["MISMATCH", "Slot", "bind_sharding", "context_mesh", "is_box",
           "bind_target", "default_memory_kind", "match_layout",
           "match_saved", "match_targets", "other_memory_kind", "per_leaf",
           "raise_tree_problems",
           "shardings_tree", "unbox", "variable_names"]


def loaded_box_types() -> tuple[type, ...]:
  """Flax's box types among the modules already imported.

  Nothing is imported here: a tree can hold a linen box only if
  ``flax.core.meta`` is loaded, and an nnx variable only if ``flax.nnx`` is.
  Importing ``flax.nnx`` for a linen user's state cost 2 s on a first
  ``remesh``.
  """
  types = []
  meta = sys.modules.get("flax.core.meta")
  if meta is not None and hasattr(meta, "Partitioned"):
    types.append(meta.Partitioned)  # nn.Partitioned, nn.LogicallyPartitioned
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and hasattr(nnx, "Variable"):
    types.append(nnx.Variable)
  return tuple(types)


def is_box(x) -> bool:
  """Whether ``x`` is a Flax metadata box (``nn.Partitioned`` and its
  ``nn.LogicallyPartitioned``, or an ``nnx.Variable``)."""
  return isinstance(x, loaded_box_types())


def variable_names(var) -> tuple | None:
  """The logical axis names an nnx variable's metadata carries, or None.

  Current flax keeps them under ``out_sharding``, older versions under
  ``sharding_names`` or ``sharding``; a value that is already a
  ``jax.sharding.Sharding`` names mesh placement, not logical axes.
  """
  meta = var.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):  # flax versions
    names = meta.get(key)
    if names is not None and not isinstance(names, jax.sharding.Sharding):
      return tuple(names)
  return None


def unbox(box) -> Any:
  """The value a box holds (its one pytree child), without side effects
  (``nn.Partitioned.unbox`` may apply a sharding constraint)."""
  children = jax.tree_util.tree_flatten(box, is_leaf=lambda y: y is not box)[0]
  if len(children) != 1:  # pragma: no cover - flax boxes hold one value
    raise LayoutError(f"a {type(box).__name__} box with {len(children)}"
                      " children")
  return children[0]


def context_mesh() -> Mesh | None:
  """The concrete mesh set by ``jax.set_mesh`` (or ``with mesh:``), if any."""
  get = getattr(jax.sharding, "get_mesh", None)
  if get is not None:
    try:
      mesh = get()
    except ValueError:  # inside a trace
      mesh = None
    if mesh is not None and not mesh.empty:
      return mesh
  try:  # the older ``with mesh:`` context manager
    from jax._src import mesh as mesh_lib
    physical = mesh_lib.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):  # pragma: no cover - jax internals
    return None
  return None if physical.empty else physical


def is_abstract(s) -> bool:
  """Whether ``s`` is a ``NamedSharding`` on an ``AbstractMesh`` (no
  devices: it cannot place an array until bound to a concrete mesh)."""
  return isinstance(s, NamedSharding) and isinstance(s.mesh, AbstractMesh)


@functools.lru_cache(maxsize=4096)
def default_memory_kind(sharding: Sharding) -> str:
  """The default memory kind of the sharding's devices (``"device"``)."""
  return next(iter(sharding.device_set)).default_memory().kind


def other_memory_kind(sharding: Sharding) -> str | None:
  """The sharding's memory kind where it is not its devices' default one
  (e.g. ``"pinned_host"``: an offloaded state), else ``None``."""
  kind = sharding.memory_kind
  return None if kind is None or kind == default_memory_kind(sharding) \
      else kind


def bind_sharding(s: Sharding, path: str, mesh: Mesh | None = None,
                  ctx: list | None = None) -> tuple[Sharding | None,
                                                    Problem | None]:
  """``s`` placed on a concrete mesh when it is a ``NamedSharding`` on an
  ``AbstractMesh``; any other sharding is returned as it is.

  The concrete mesh is ``mesh``, else the one in context (``jax.set_mesh``);
  its ``abstract_mesh`` must equal the sharding's (axis names, sizes and
  types). ``ctx`` caches the context lookup across calls (a list, empty at
  first).

  Returns:
    ``(sharding, None)``, or ``(None, problem)`` naming ``path`` when there
    is no concrete mesh or it is not the one the abstract mesh describes.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    >>> s = NamedSharding(mesh.abstract_mesh, P("x"))
    >>> with jax.set_mesh(mesh):
    ...   bound, _ = bind_sharding(s, "w")
    >>> bound == NamedSharding(mesh, P("x"))
    True
    >>> print(bind_sharding(s, "w")[1])  # no mesh in context
    w: target sharding NamedSharding on AbstractMesh('x': ...) has no devices; call under `with jax.set_mesh(mesh):` with the concrete mesh (or pass mesh=)
  """
  if not is_abstract(s):
    return s, None
  m = mesh
  if m is None:
    if ctx is None:
      ctx = []
    if not ctx:
      ctx.append(context_mesh())
    m = ctx[0]
  sizes = ", ".join(f"{a!r}: {n}" for a, n in zip(s.mesh.axis_names,
                                                  s.mesh.axis_sizes))
  if m is None:
    return None, Problem(
        path, f"target sharding NamedSharding on AbstractMesh({sizes}, ...)"
        " has no devices; call under `with jax.set_mesh(mesh):` with the"
        " concrete mesh (or pass mesh=)",
        "a target sharding on an AbstractMesh has no devices and no mesh is"
        " set (call under `with jax.set_mesh(mesh):` or pass mesh=)")
  am = m.abstract_mesh
  if (am.axis_names, am.axis_sizes) != (s.mesh.axis_names,
                                        s.mesh.axis_sizes):
    have = ", ".join(f"{a!r}: {n}" for a, n in zip(am.axis_names,
                                                   am.axis_sizes))
    return None, Problem(
        path, f"target sharding's AbstractMesh({sizes}) is not the concrete"
        f" mesh's ({have})", f"a target sharding's AbstractMesh({sizes}) is"
        f" not the concrete mesh's ({have})")
  return NamedSharding(m, s.spec, memory_kind=s.memory_kind), None


def _is_target_leaf(x) -> bool:
  return x is None or isinstance(x, (Sharding, PartitionSpec, jax.Device,
                                     jax.ShapeDtypeStruct))


def _children(x) -> tuple[list, bool]:
  """``x``'s direct pytree children as ``(key, child)``, and whether ``x`` is
  a leaf."""
  flat, tdef = jax.tree_util.tree_flatten_with_path(
      x, is_leaf=lambda y: y is not x)
  if tdef.num_nodes == 1 and tdef.num_leaves == 1:
    return [], True
  return [(p[0], c) for p, c in flat], False


def _key_str(k) -> str:
  return key_path_name((k,))


class _Mismatch:
  """Marks a part of the state the target's structure does not cover."""


MISMATCH = _Mismatch


def _match(t, s, path: tuple, out: list, problems: list,
           is_leaf: Callable = _is_target_leaf) -> None:
  """Pairs target leaves with state subtrees, ignoring box wrappers and node
  metadata. Appends ``(target leaf, state subtree)`` in flatten order."""
  if is_leaf(t):
    out.append((t, s))
    return
  t_box, s_box = is_box(t), is_box(s)
  if t_box and not (s_box and type(s) is type(t)):
    return _match(unbox(t), s, path, out, problems, is_leaf)
  if s_box and not t_box:
    return _match(t, unbox(s), path, out, problems, is_leaf)
  tc, t_leaf = _children(t)
  if t_leaf:  # a target that is no pytree node and no sharding
    out.append((t, s))
    return
  sc, s_leaf = _children(s)
  tkeys = [_key_str(k) for k, _ in tc]
  skeys = [] if s_leaf else [_key_str(k) for k, _ in sc]
  if s_leaf or tkeys != skeys:
    where = key_path_name(path) if path else "the root"
    state_desc = (f"a leaf of type {type(s).__name__}" if s_leaf
                  else f"a {type(s).__name__} with keys {skeys}")
    problems.append(
        f"the target's tree structure does not match the state's at {where}:"
        f" the state has {state_desc}, the target a {type(t).__name__} with"
        f" keys {tkeys}")
    out.append((_Mismatch, s))
    return
  for (k, tcv), (_, scv) in zip(tc, sc):
    _match(tcv, scv, path + (k,), out, problems, is_leaf)


def per_leaf(tree, target, is_leaf: Callable = _is_target_leaf,
             treedef=None) -> tuple[list, list, list]:
  """Spreads a prefix tree over ``tree``'s leaves.

  The match runs on a stand-in of ``tree`` whose leaves are their indices:
  a failed ``flatten_up_to`` formats the whole tree into its message, which
  took 0.3 s for lm1b's 51 MiB state with the arrays in it.

  Returns:
    ``(targets, direct, problems)``: per leaf of ``tree`` (flatten order), the
    target leaf covering it (``MISMATCH`` where the structures disagree),
    whether the target sits exactly at that leaf (not at a subtree above
    it), and the structure problems found.
  """
  if treedef is None:
    treedef = jax.tree_util.tree_structure(tree)
  try:
    stand_in = treedef.unflatten(range(treedef.num_leaves))
  except Exception:  # pragma: no cover - a node that checks its children
    stand_in = None
  tflat, ttree = jax.tree_util.tree_flatten(target, is_leaf=is_leaf)
  problems: list = []
  try:  # jax's own prefix match (C++), when the trees agree exactly
    pairs = list(zip(tflat, ttree.flatten_up_to(
        tree if stand_in is None else stand_in)))
  except (ValueError, TypeError):
    pairs = []
    _match(target, tree if stand_in is None else stand_in, (), pairs,
           problems, is_leaf)
  targets: list = []
  direct: list[bool] = []
  for t, sub in pairs:
    if stand_in is not None and type(sub) is int:  # a leaf of the state
      targets.append(t)
      direct.append(True)
      continue
    leaves = jax.tree_util.tree_leaves(sub)
    one = stand_in is None and len(leaves) == 1 and leaves[0] is sub
    targets += [t] * len(leaves)
    direct += [one] * len(leaves)
  return targets, direct, problems


def _fit_problem(path: str, shape: tuple, s: NamedSharding) -> Problem | None:
  """Whether a ``NamedSharding`` can shard ``shape`` (rank, divisibility)."""
  spec = tuple(s.spec)
  if len(spec) > len(shape):
    return Problem(path, f"spec {s.spec} has {len(spec)} entries for an array"
                   f" of rank {len(shape)} (shape {shape})",
                   f"spec {s.spec} is longer than the rank of its array")
  sizes = dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))
  for d, entry in enumerate(spec):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    if not all(isinstance(a, str) and a in sizes for a in axes):
      return None  # left to jax's own check, which names the leaf
    parts = math.prod(sizes[a] for a in axes)
    if shape[d] % parts:
      return Problem(
          path, f"sharding {s} does not fit shape {shape}: dimension {d} of"
          f" size {shape[d]} cannot be split {parts} ways over mesh axes"
          f" {axes}", f"dimension {d} of size {shape[d]} cannot be split"
          f" {parts} ways over mesh axes {axes}")
  return None


class _Placer:
  """Makes a target sharding concrete for one leaf, as every matcher here
  does: bound to the concrete mesh when on an ``AbstractMesh``
  (:func:`bind_sharding`), then checked against the leaf's shape (rank,
  divisibility). Caches both across the leaves of one target."""

  def __init__(self, mesh: Mesh | None):
    self.mesh = mesh
    self.ctx: list = []  # the context mesh, looked up once when first needed
    self.bound: dict = {}
    self.fits: dict = {}

  def context(self) -> Mesh | None:
    if self.mesh is not None:
      return self.mesh
    if not self.ctx:
      self.ctx.append(context_mesh())
    return self.ctx[0]

  def place(self, name: str, s: Sharding, shape: tuple | None
            ) -> tuple[Sharding | None, Problem | None]:
    """``(sharding, None)`` or ``(None, problem at name)``; ``shape=None``
    skips the fit check."""
    if is_abstract(s):
      if s not in self.bound:
        self.bound[s] = bind_sharding(s, name, self.mesh, self.ctx)
      s, why = self.bound[s]
      if why is not None:
        return None, dataclasses.replace(why, path=name)
    if shape is not None and type(s) is NamedSharding and isinstance(
        s.mesh, Mesh):
      key = (s, shape)
      if key not in self.fits:
        self.fits[key] = _fit_problem(name, shape, s)
      if self.fits[key] is not None:
        return None, dataclasses.replace(self.fits[key], path=name)
    return s, None


def match_targets(tree: Any, target: Any, *, mesh: Mesh | None = None
                  ) -> tuple[list, Callable]:
  """Pairs every leaf of ``tree`` with its target sharding.

  Args:
    tree: the state (any pytree, Flax boxes included).
    target: one target for every array (a ``Sharding``, ``PartitionSpec``
      or ``jax.Device``), or a pytree of them that is a prefix of ``tree``
      up to boxes (``None`` for leaves that are not arrays). A
      ``jax.ShapeDtypeStruct`` with a sharding (an abstract state, as
      ``nnx.get_abstract_model`` gives) stands for its sharding.
    mesh: the mesh for ``PartitionSpec`` targets; default: the mesh in
      context.

  Returns:
    ``(items, rebuild)``: ``items`` lists ``(path, leaf, sharding or None)``
    for every leaf of ``tree`` in flatten order, ``rebuild(new_leaves)``
    puts leaves back in ``tree``'s structure (boxes kept).

  Raises:
    LayoutError: structures differ, an array has no target, a target is not
      a sharding, a ``PartitionSpec`` has no mesh, or a sharding does not fit
      its leaf; all problems together, grouped.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    >>> tree = {"a": np.zeros(4), "b": {"c": jax.numpy.zeros(4)}}
    >>> with jax.set_mesh(mesh):
    ...   items, _ = match_targets(tree, {"a": None, "b": P("x")})
    >>> [(p, None if s is None else s.spec) for p, _, s in items]
    [('a', None), ('b/c', P('x',))]
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  targets, direct, problems = per_leaf(tree, target, treedef=treedef)
  placer = _Placer(mesh)
  specs: dict = {}
  if len(targets) != len(flat):  # pragma: no cover - a matching bug
    raise LayoutError(f"matched {len(targets)} targets to {len(flat)} leaves")
  items = []
  for (path, leaf), t, is_direct in zip(flat, targets, direct):
    name = key_path_name(path)
    is_arr = isinstance(leaf, jax.Array)
    s = None
    if t is _Mismatch:
      pass  # reported once for the whole subtree
    elif t is None:
      if is_arr:
        problems.append(Problem(
            name, f"array {leaf.dtype}{list(leaf.shape)} has target None;"
            " give it a sharding", "an array has target None"))
    elif not is_arr:
      if is_direct:
        problems.append(Problem(
            name, f"a sharding is given for a non-array leaf of type"
            f" {type(leaf).__name__}",
            f"a sharding is given for a non-array leaf of type"
            f" {type(leaf).__name__}"))
    elif isinstance(t, Sharding):
      s = t
    elif isinstance(t, PartitionSpec):
      m = placer.context()
      if m is None:
        problems.append(Problem(
            name, f"target PartitionSpec{tuple(t)} needs a mesh and none is"
            " set; call it under"
            " `with jax.set_mesh(mesh):` or give a NamedSharding",
            "a PartitionSpec target needs a mesh and none is set (use"
            " `with jax.set_mesh(mesh):` or give NamedShardings)"))
      else:
        if t not in specs:
          try:
            specs[t] = NamedSharding(m, t)
          except Exception as e:  # pylint: disable=broad-except
            # an axis the mesh lacks (ValueError), or one used twice
            # (jax's DuplicateSpecError): a problem at this leaf
            used = [a for entry in t if entry is not None
                    and entry is not PartitionSpec.UNCONSTRAINED
                    for a in (entry if isinstance(entry, tuple) else (entry,))]
            missing = [a for a in used if a not in m.shape]
            why = (f"names mesh axes {missing} that the mesh"
                   f" {dict(m.shape)} lacks" if missing else f"is invalid: {e}")
            specs[t] = f"target PartitionSpec{tuple(t)} {why}"
        s = specs[t]
        if isinstance(s, str):
          problems.append(Problem(name, s, s))
          s = None
    elif isinstance(t, jax.Device):
      s = SingleDeviceSharding(t)
    elif isinstance(t, jax.ShapeDtypeStruct):  # an abstract state as target
      s = t.sharding
      if s is None:
        problems.append(Problem(
            name, "target ShapeDtypeStruct carries no sharding",
            "a target ShapeDtypeStruct carries no sharding"))
      elif tuple(t.shape) != tuple(leaf.shape) or t.dtype != leaf.dtype:
        problems.append(Problem(
            name, f"array is {leaf.dtype}{list(leaf.shape)}, the target"
            f" ShapeDtypeStruct {t.dtype}{list(t.shape)}",
            "the target ShapeDtypeStruct's shape or dtype differs"))
        s = None
    else:
      problems.append(Problem(
          name, f"target {t!r:.80} of type {type(t).__name__} is not a"
          " Sharding, PartitionSpec or Device",
          f"a target of type {type(t).__name__} is not a Sharding,"
          " PartitionSpec or Device"))
    if s is not None:
      placed, why = placer.place(name, s, tuple(leaf.shape))
      if why is not None:
        problems.append(why)
      elif is_abstract(s):
        s = placed
    items.append((name, leaf, s))
  if problems:
    raise_problems(LayoutError, "cannot reshard", problems)
  return items, treedef.unflatten


def shardings_tree(tree: Any, shardings: Sequence[Sharding | None]) -> Any:
  """``tree`` with each array replaced by its sharding and each box by the
  sharding of its value (what ``jax.jit(out_shardings=...)`` takes).

  ``shardings`` is aligned with ``jax.tree.leaves(tree)``; leaves that are not
  arrays become ``None``.

  >>> import jax, numpy as np
  >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  >>> shardings_tree({"w": np.zeros(2), "n": 3}, [None, s]) == {"n": None, "w": s}
  True
  """
  nodes, tdef = jax.tree_util.tree_flatten(tree, is_leaf=is_box)
  it = iter(shardings)
  out = []
  for node in nodes:
    if is_box(node):
      inner = [next(it) for _ in jax.tree_util.tree_leaves(node)]
      out.append(next((s for s in inner if s is not None), None))
    else:
      out.append(next(it))
  return tdef.unflatten(out)


# -- targets against saved state (restore, convert) --------------------------
def leaf_kind(x) -> str:
  """A leaf as error messages show it: ``float32[4, 2]``, ``int 0``."""
  if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
    return f"{dtype_name(x.dtype)}{list(x.shape)}"
  if isinstance(x, np.ndarray):
    return f"numpy {x.dtype}{list(x.shape)}"
  if isinstance(x, PartitionSpec):
    return f"PartitionSpec{tuple(x)}"
  return f"{type(x).__name__} {x!r}"[:80]


def dtype_name(dtype) -> str:
  """A dtype's name as layouts and sources record it (``float32``,
  ``key<fry>`` for a PRNG key array)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return str(dtype)
  return np.dtype(dtype).name


def saved_names(kp) -> list[str]:
  """Names under which a target leaf at key path ``kp`` may have been saved:
  its key path name, and the same with or without Flax boxes' trailing
  ``value``."""
  name = key_path_name(kp)
  full = "/".join(key_path_name([k]) for k in kp) if kp else "."
  out = [name, full]
  if not full.endswith("/value"):
    out.append(full + "/value")
  return list(dict.fromkeys(out))


_CLOSE_MAX = 1024  # saved paths compared with a missing one for a near name
_SIMILAR_FIRST = 3  # problems before which a missing leaf gets near names


def _missing(name: str, kind: str, saved: Mapping[str, Any],
             where: str, similar: bool = True) -> Problem:
  """An array the target has where nothing is saved.

  The message names saved paths with the same leaf name (the three spelt
  most nearly the same), else those of the same parent (or else of the
  same depth) spelt nearly the same (a typo, a renamed module), else the
  first saved paths. Near spellings are looked for only where ``similar``
  (a caller with many missing leaves asks for the first few).

  >>> from types import SimpleNamespace as T
  >>> saved = {"params/dense/kernel": T(), "params/dense/bias": T()}
  >>> str(_missing("params/dense/kernal", "float32[2, 2]", saved,
  ...              "the checkpoint"))  # doctest: +NORMALIZE_WHITESPACE
  "params/dense/kernal: the target is float32[2, 2], the checkpoint saved
  nothing at this path (saved with a similar path: ['params/dense/kernel'])"
  """
  leaf = name.rsplit("/", 1)[-1]
  near = [p for p in saved if p.rsplit("/", 1)[-1] == leaf]
  if len(near) > 3:  # the three spelt most nearly the same
    near = (difflib.get_close_matches(name, near[:_CLOSE_MAX], n=3, cutoff=0)
            if similar else near[:3])
  if near:
    hint = f" (same leaf name: {near})"
  else:
    parent, depth = name.rpartition("/")[0], name.count("/")
    same = ([p for p in saved if p.rpartition("/")[0] == parent]
            or [p for p in saved if p.count("/") == depth]) if similar else []
    close = (difflib.get_close_matches(name, same, n=3, cutoff=0.8)
             if len(same) <= _CLOSE_MAX else [])
    hint = (f" (saved with a similar path: {close})" if close else
            f" (saved arrays: {list(saved)[:6]})")
  return Problem(
      name, f"the target is {kind}, {where} saved nothing at this path"
      + hint, f"the target has arrays where {where} saved nothing")


def _differs(name: str, shape: tuple, dtype: str, t: Any,
             where: str) -> Problem | None:
  """A target array's shape or dtype against the saved tensor ``t``."""
  if (dtype, tuple(shape)) == (t.dtype, tuple(t.shape)):
    return None
  msg = (f"the target is {dtype}{list(shape)}, {where} saved"
         f" {t.dtype}{list(t.shape)}")
  return Problem(name, msg, msg)  # the same shapes: one grouped line


def _is_key_data(leaf, t) -> bool:
  """Whether ``t`` holds the raw key data of the PRNG key array ``leaf``
  (saved without its key type: ``uint32[..., 2]`` for threefry keys)."""
  if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return False
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype))
  stored = tuple(t.shape) + tuple(getattr(t, "extra", ()))
  return (np.dtype(data.dtype).name, tuple(data.shape)) == (t.dtype, stored)


def match_layout(tensors: Sequence[Any], saved: Mapping[str, Any], *,
                 where: str) -> tuple[dict[str, str], list[Problem]]:
  """Matches a target layout's tensors (a PTC's ``TensorLayout``s, each with
  ``path``, ``shape`` and ``dtype``) with saved tensors by path, as
  :func:`match_saved` does for a target tree (same messages).

  Returns:
    ``(paths, problems)``: the saved path of each target path (a Flax
    box's ``.../value`` where only that was saved), and the problems.

  Example:
    >>> from types import SimpleNamespace as T
    >>> paths, problems = match_layout(
    ...     [T(path="k", shape=(2,), dtype="float32")],
    ...     {"k/value": T(shape=(3,), dtype="float32")}, where="the source")
    >>> paths, [str(p) for p in problems]
    ({'k': 'k/value'}, ['k: the target is float32[2], the source saved float32[3]'])
  """
  paths: dict[str, str] = {}
  problems: list[Problem] = []
  for t in tensors:
    hit = next((c for c in (t.path, t.path + "/value") if c in saved), None)
    if hit is None:
      problems.append(_missing(t.path, f"{t.dtype}{list(t.shape)}", saved,
                               where, similar=len(problems) < _SIMILAR_FIRST))
      continue
    paths[t.path] = hit
    differs = _differs(t.path, tuple(t.shape), t.dtype, saved[hit], where)
    if differs is not None:
      problems.append(differs)
  return paths, problems


@dataclasses.dataclass(frozen=True)
class Slot:
  """One leaf of a restore target, matched against the saved state.

  Attributes:
    index: the leaf's position in the flattened target.
    path: its key path name.
    leaf: the target leaf; an array leaf is a ``jax.ShapeDtypeStruct`` on a
      concrete sharding (a live array's own, an abstract mesh's bound).
    saved: the saved path it is read from, or ``None`` (nothing saved).
    array: whether the leaf is an array to restore (it has a sharding).
  """

  index: int
  path: str
  leaf: Any
  saved: str | None
  array: bool


def _is_none(x) -> bool:
  return x is None


def name_clashes(flat: Sequence[tuple[Any, Any]]) -> list[tuple[str, str]]:
  """The path names of a flattened tree (``tree_flatten_with_path``) that
  name more than one leaf: ``(name, "the key paths, listed")`` each.

  Leaves are stored and matched by their ``/``-joined path name, so a dict
  key holding ``/`` can name two leaves alike (``{"a/b": x, "a": {"b": y}}``):
  one would be saved over, or restored from, the other's data.

  >>> import jax
  >>> name_clashes(jax.tree_util.tree_flatten_with_path(
  ...     {"a/b": 1, "a": {"b": 2}})[0])
  [('a/b', "['a']['b'] and ['a/b']")]
  """
  return [(n, " and ".join(ks)) for n, ks in shared_names(
      (key_path_name(kp), jax.tree_util.keystr(kp))
      for kp, leaf in flat if leaf is not None)]


def shared_names(named: Iterable[tuple[str, str]]
                 ) -> list[tuple[str, list[str]]]:
  """Groups ``(name, description)`` pairs by name and keeps the names given
  more than once: ``(name, sorted descriptions)``, sorted by name. The one
  check behind :func:`name_clashes` (target key paths) and the Orbax
  reader's check of saved entries.

  >>> shared_names([("a/b", "x"), ("c", "z"), ("a/b", "w")])
  [('a/b', ['w', 'x'])]
  """
  by: dict[str, list[str]] = {}
  for name, what in named:
    by.setdefault(name, []).append(what)
  return [(n, sorted(ws)) for n, ws in sorted(by.items()) if len(ws) > 1]


def match_saved(target: Any, saved: Mapping[str, Any], *, where: str,
                mesh: Mesh | None = None, aliases: bool = True,
                values: Mapping[str, Any] = {},  # noqa: B006 - read only
                key_data: bool = True, cast: bool = False
                ) -> tuple[list, Any, list[Slot], list[Problem]]:
  """Matches a restore (or convert) target with saved tensors, by path.

  The one matcher of targets against saved state: Orbax restores, store
  restores and conversions use it, and report its problems with
  :func:`raise_tree_problems`.

  Args:
    target: a pytree. ``jax.Array`` leaves and ``jax.ShapeDtypeStruct``
      leaves with a sharding are arrays to restore; a sharding on an
      ``AbstractMesh`` is bound to ``mesh`` or the mesh in context (see
      :func:`bind_sharding`). Any other leaf is plain.
    saved: saved tensors by path; each has ``shape`` and ``dtype`` (a
      name, as :func:`dtype_name` gives).
    where: what saved them, for messages (``"the checkpoint"``,
      ``"step 7"``).
    mesh: the concrete mesh for abstract shardings.
    aliases: also look a leaf up with or without a Flax box's trailing
      ``/value`` (Orbax saves an nnx variable's array under ``.../value``).
    values: plain values saved by path (a store's numbers); an array leaf
      with nothing in ``saved`` but a value here is not a problem.
    key_data: a PRNG key array leaf also matches its raw key data saved
      without the key type (``uint32[n, 2]`` for ``key<fry>[n]``), as
      checkpoints written without Orbax's key metadata hold it.
    cast: an array leaf of the saved shape may have another dtype (the
      source reads it with a cast, as Orbax restores do); PRNG keys never.

  Returns:
    ``(flat, treedef, slots, problems)``: the flattened target (``None``
    leaves kept), one :class:`Slot` per leaf, and the problems (a leaf's
    shape or dtype differs from the saved one; an array leaf with a size
    has nothing saved; a sharding cannot be bound or does not fit).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from types import SimpleNamespace as T
    >>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> tgt = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=s),
    ...        "step": 0}
    >>> _, _, slots, problems = match_saved(
    ...     tgt, {"w": T(shape=(5,), dtype="float32")}, where="step 3")
    >>> [(x.path, x.saved, x.array) for x in slots], [str(p) for p in problems]
    ([('step', None, False)], ['w: the target is float32[4], step 3 saved float32[5]'])
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(target,
                                                       is_leaf=_is_none)
  slots: list[Slot] = []
  problems: list[Problem] = []
  for name, clash in name_clashes(flat):
    problems.append(Problem(name, (
        f"target leaves {clash} share this path name (a dict key holds "
        "'/'); one would be restored from the other's data"),
        "target leaves share a path name (a dict key holds '/')"))
  placer = _Placer(mesh)
  for i, (kp, leaf) in enumerate(flat):
    name = key_path_name(kp)
    names = saved_names(kp) if aliases else [name]
    hit = next((c for c in names if c in saved), None)
    if isinstance(leaf, jax.Array):  # a live array: its layout is the target
      leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                  sharding=leaf.sharding)
    elif (isinstance(leaf, jax.sharding.Sharding) and hit is not None
          and not str(saved[hit].dtype).startswith("key<")):
      # A bare sharding (as jax.device_put takes): the saved shape and dtype.
      leaf = jax.ShapeDtypeStruct(tuple(saved[hit].shape),
                                  jnp.dtype(saved[hit].dtype), sharding=leaf)
    elif not (isinstance(leaf, jax.ShapeDtypeStruct)
              and leaf.sharding is not None):
      slots.append(Slot(i, name, leaf, hit, False))
      continue
    s, why = placer.place(name, leaf.sharding, None)
    if why is not None:
      problems.append(why)
      continue
    if s is not leaf.sharding:  # bound to the concrete mesh
      leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
    shape = tuple(int(n) for n in leaf.shape)
    if hit is None:
      if math.prod(shape) and name not in values:
        problems.append(_missing(name, leaf_kind(leaf), saved, where,
                                 similar=len(problems) < _SIMILAR_FIRST))
        continue
      slots.append(Slot(i, name, leaf, None, True))
      continue
    differs = _differs(name, shape, dtype_name(leaf.dtype), saved[hit], where)
    if differs is not None and key_data and _is_key_data(leaf, saved[hit]):
      differs = None  # a key array saved as its raw key data
    if differs is not None and cast and shape == tuple(saved[hit].shape) \
        and not any(d.startswith("key<") for d in (dtype_name(leaf.dtype),
                                                    saved[hit].dtype)):
      differs = None  # read with a cast to the target's dtype
    if differs is not None:
      problems.append(differs)
      continue
    _, why = placer.place(name, s, shape)  # after the shapes: they differ
    if why is not None:
      problems.append(why)
      continue
    slots.append(Slot(i, name, leaf, hit, True))
  return flat, treedef, slots, problems


def bind_target(target: Any, mesh: Mesh | None = None) -> Any:
  """``target`` with every ``jax.ShapeDtypeStruct`` whose sharding is on an
  ``AbstractMesh`` placed on ``mesh`` (default: the mesh in context); other
  leaves are kept as they are.

  Raises:
    TreeError: some shardings cannot be bound (no concrete mesh, or another
      mesh); names every such leaf.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    >>> t = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=
    ...     NamedSharding(mesh.abstract_mesh, P("x"))), "step": 0}
    >>> bind_target(t, mesh)["w"].sharding == NamedSharding(mesh, P("x"))
    True
  """
  flat, treedef = jax.tree_util.tree_flatten(target, is_leaf=_is_none)
  if not any(isinstance(x, jax.ShapeDtypeStruct) and is_abstract(x.sharding)
             for x in flat):
    return target
  paths = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_none)[0]
  placer = _Placer(mesh)
  problems: list[Problem] = []
  out = []
  for (kp, x) in paths:
    if isinstance(x, jax.ShapeDtypeStruct) and is_abstract(x.sharding):
      s, why = placer.place(key_path_name(kp), x.sharding, None)
      if why is not None:
        problems.append(why)
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    out.append(x)
  raise_tree_problems("the target's shardings cannot be placed", problems)
  return treedef.unflatten(out)


def raise_tree_problems(header: str, problems: Sequence[Problem | str]
                        ) -> None:
  """Raises :class:`TreeError` listing ``problems`` (grouped, see
  :func:`tenplex_jax._problems.raise_problems`) when there are any.

  >>> raise_tree_problems("the target does not match", [])
  >>> raise_tree_problems("the target does not match", [Problem("w", "bad")])
  Traceback (most recent call last):
  ...
  tenplex_jax.errors.TreeError: the target does not match (1 leaves):
    w: bad
  """
  if problems:
    n = len({p.path if isinstance(p, Problem) else p for p in problems})
    raise_problems(TreeError, f"{header} ({n} leaves)", problems)
