"""Converting Orbax checkpoints offline: new layout, new tree, bounded memory.

The source may also be a tenplex_jax store snapshot (exported as a standard
Orbax checkpoint).

``convert(src, dst, target)`` reads the source checkpoint box by box and
writes a new checkpoint whose chunks are the target layout's shards (or
whole-chunk parts of them, so that every new shard is a set of whole
chunks), with the target shardings recorded, in the format stock Orbax
restores (zarr v3 arrays, ``_METADATA``, ``_sharding``,
``array_metadatas``, ``_CHECKPOINT_METADATA``). It needs no devices: the
target is a :class:`tenplex_jax.PTC` (or a mesh shape and rules), so one CPU
converts for any job size.

Structural conversions go through :class:`MappedSource`, a source of boxes
over another source: rename leaves, stack per-layer trees into a scanned
``layers`` axis (:func:`scan_mapping`) or split it again
(:func:`unscan_mapping`), reshape.
"""

from __future__ import annotations

import base64
import dataclasses
import collections
import concurrent.futures as cf
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from rich.progress import (BarColumn, DownloadColumn, Progress,
                           TimeRemainingColumn, TransferSpeedColumn)

from tenplex_jax._problems import Problem
from tenplex_jax._targets import (leaf_kind, match_layout, match_saved,
                                  raise_tree_problems)
from tenplex_jax.errors import (LayoutError, TreeError, UnmatchedRuleWarning,
                                UsageError)
from tenplex_jax.cloud import upload_tree
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.layout import (PTC, Box, Placement, TensorLayout,
                                named_placement, box_volume,
                                relative_index)
from tenplex_jax.orbax._read import (ARRAY_TYPES, Location, OrbaxSource,
                                     TreeEntry, read_json,
                                     sharding_from_orbax)
from tenplex_jax.planner import plan
from tenplex_jax.assembly import fill, new_boxes, read_source, source_layout
from tenplex_jax.sources import Source, SourceTensor

__all__ = ["MappedSource", "convert", "layout_from_spec", "scan_mapping",
           "unscan_mapping"]

_HANDLER = ("orbax.checkpoint._src.handlers.standard_checkpoint_handler."
            "StandardCheckpointHandler")


# -- structural mappings -----------------------------------------------------
class _Composite:

  def __init__(self, futs):
    self.futs = futs

  def result(self):
    for f in self.futs:
      f.result()


class MappedSource(Source):
  """Another source's tensors under new names and shapes.

  Args:
    base: the source.
    mapping: new path -> rule, one of
      ``"old/path"`` (rename);
      ``{"stack": [path, ...], "axis": 0}`` (a new axis at ``axis`` whose
      entry ``i`` is the ``i``-th path: per-layer trees -> scanned layers);
      ``{"unstack": path, "index": i, "axis": 0}`` (entry ``i`` of an axis,
      which is dropped: scanned -> per-layer);
      ``{"reshape": [shape], "source": path}`` (same elements, new shape;
      reads the source tensor whole, so only for leaves that fit in memory).
    keep_unmapped: pass the base's tensors no rule uses through unchanged.

  Example:
    >>> from tenplex_jax.orbax import scan_mapping
    >>> scan_mapping(["p/layers_0/w", "p/layers_1/w", "p/emb"])
    {'p/layers/w': {'stack': ['p/layers_0/w', 'p/layers_1/w'], 'axis': 0}}
  """

  def __init__(self, base: Source, mapping: Mapping[str, Any], *,
               keep_unmapped: bool = True):
    self.base = base
    self.name = f"mapped:{base.name}"
    self.preference = base.preference
    held = base.tensors()
    self.rules: dict[str, tuple] = {}
    used, problems, out = set(), [], {}

    def need(path, new):
      if path not in held:
        problems.append(f"{new}: source tensor {path!r} is not in"
                        f" {base.name}")
        return None
      used.add(path)
      return held[path]

    for new, rule in mapping.items():
      if isinstance(rule, str):
        t = need(rule, new)
        if t is not None:
          self.rules[new] = ("rename", rule)
          out[new] = _renamed(t, new)
        continue
      if not isinstance(rule, Mapping):
        problems.append(f"{new}: rule {rule!r} is not a path or a dict")
        continue
      axis = int(rule.get("axis", 0))
      if "stack" in rule:
        ts = [need(p, new) for p in rule["stack"]]
        if any(t is None for t in ts) or not ts:
          continue
        a = ts[0]
        odd = [(p, t.shape, t.dtype) for p, t in zip(rule["stack"], ts)
               if (t.shape, t.dtype, t.extra) != (a.shape, a.dtype, a.extra)]
        if odd:
          problems.append(f"{new}: cannot stack {rule['stack'][0]} {a.shape}"
                          f" {a.dtype} with {odd}")
          continue
        if not 0 <= axis <= len(a.shape):
          problems.append(f"{new}: stacking axis {axis} is out of range for"
                          f" shape {a.shape}")
          continue
        boxes = tuple(b[:axis] + ((i, i + 1),) + b[axis:]
                      for i, t in enumerate(ts) for b in t.boxes)
        shape = a.shape[:axis] + (len(ts),) + a.shape[axis:]
        out[new] = SourceTensor(new, shape, a.dtype, a.storage, a.extra,
                                boxes, a.key_impl)
        self.rules[new] = ("stack", tuple(rule["stack"]), axis)
      elif "unstack" in rule:
        t = need(rule["unstack"], new)
        if t is None:
          continue
        i = int(rule["index"])
        if not (0 <= axis < len(t.shape) and 0 <= i < t.shape[axis]):
          problems.append(f"{new}: index {i} of axis {axis} is out of range"
                          f" for {rule['unstack']} of shape {t.shape}")
          continue
        boxes = tuple(b[:axis] + b[axis + 1:] for b in t.boxes
                      if b[axis][0] <= i < b[axis][1])
        out[new] = SourceTensor(new, t.shape[:axis] + t.shape[axis + 1:],
                                t.dtype, t.storage, t.extra, boxes,
                                t.key_impl)
        self.rules[new] = ("unstack", rule["unstack"], i, axis)
      elif "reshape" in rule:
        t = need(rule.get("source", new), new)
        if t is None:
          continue
        shape = tuple(int(n) for n in rule["reshape"])
        if math.prod(shape) != math.prod(t.shape):
          problems.append(f"{new}: cannot reshape {rule.get('source', new)}"
                          f" of shape {t.shape} ({math.prod(t.shape)}"
                          f" elements) to {shape}")
          continue
        out[new] = SourceTensor(new, shape, t.dtype, t.storage, t.extra,
                                (tuple((0, n) for n in shape),), t.key_impl)
        self.rules[new] = ("reshape", rule.get("source", new))
      else:
        problems.append(f"{new}: rule {dict(rule)} has none of 'stack',"
                        " 'unstack', 'reshape'")
    if problems:
      raise TreeError("bad mapping:\n  " + "\n  ".join(problems))
    if keep_unmapped:
      for p, t in held.items():
        if p not in used and p not in out:
          out[p] = t
          self.rules[p] = ("rename", p)
    self._tensors = out

  def tensors(self) -> Mapping[str, SourceTensor]:
    return self._tensors

  def read_async(self, path: str, box: Box, out: np.ndarray):
    rule = self.rules[path]
    kind = rule[0]
    if kind == "rename":
      return self.base.read_async(rule[1], box, out)
    if kind == "stack":
      _, paths, axis = rule
      (lo, hi) = box[axis]
      futs = []
      for i in range(lo, hi):
        view = out[(slice(None),) * axis + (i - lo,)]
        futs.append(self.base.read_async(paths[i], box[:axis] + box[axis + 1:],
                                         view))
      return _Composite(futs)
    if kind == "unstack":
      _, src, i, axis = rule
      return self.base.read_async(src, box[:axis] + ((i, i + 1),) + box[axis:],
                                  np.expand_dims(out, axis))
    _, src = rule  # reshape
    t = self.base.tensors()[src]
    whole = np.empty(t.stored_shape, out.dtype)
    self.base.read_into(src, tuple((0, n) for n in t.shape), whole)
    new = self._tensors[path]
    out[...] = whole.reshape(new.stored_shape)[relative_index(
        box, tuple((0, n) for n in new.shape))]
    return _Composite([])

  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    self.read_async(path, box, out).result()

  def close(self) -> None:
    self.base.close()


def _renamed(t: SourceTensor, new: str) -> SourceTensor:
  return SourceTensor(new, t.shape, t.dtype, t.storage, t.extra, t.boxes,
                      t.key_impl)


def scan_mapping(paths: Sequence[str], *,
                 pattern: str = r"(.*)/layers_(\d+)/(.*)",
                 into: str = r"\1/layers/\3", axis: int = 0) -> dict:
  """The mapping that stacks per-layer leaves into a scanned axis.

  Args:
    paths: the source's tensor paths (``OrbaxSource(p).tensors()``).
    pattern: a regex whose group 2 is the layer number.
    into: the new path (``re`` replacement of the match).
    axis: where the layers axis goes (MaxText puts it at 1 for params).

  Returns:
    ``{new path: {"stack": [paths in layer order], "axis": axis}}``.

  Raises:
    TreeError: a group's layer numbers are not ``0 .. n-1``.

  Example:
    >>> m = scan_mapping(["params/layers_1/w", "params/layers_0/w",
    ...                   "params/emb"], axis=1)
    >>> m
    {'params/layers/w': {'stack': ['params/layers_0/w', 'params/layers_1/w'],
                         'axis': 1}}
  """
  groups: dict[str, dict[int, str]] = collections.defaultdict(dict)
  rx = re.compile(pattern)
  for p in paths:
    m = rx.fullmatch(p)
    if m:
      groups[m.expand(into)][int(m.group(2))] = p
  out = {}
  for new, by_layer in groups.items():
    if sorted(by_layer) != list(range(len(by_layer))):
      raise TreeError(f"{new}: layers {sorted(by_layer)} are not 0 ..."
                      f" {len(by_layer) - 1}")
    out[new] = {"stack": [by_layer[i] for i in range(len(by_layer))],
                "axis": axis}
  return out


def unscan_mapping(tensors: Mapping[str, SourceTensor], *,
                   pattern: str = r"(.*)/layers/(.*)",
                   into: str = r"\1/layers_{i}/\2", axis: int = 0) -> dict:
  """The mapping that splits a scanned ``layers`` axis into per-layer leaves.

  Args:
    tensors: the source's tensors (``OrbaxSource(p).tensors()``).
    pattern: a regex matching scanned leaves.
    into: the new path, ``{i}`` standing for the layer number.
    axis: the scanned axis.

  Returns:
    ``{new path: {"unstack": path, "index": i, "axis": axis}}``.

  Example:
    >>> t = SourceTensor("p/layers/w", (2, 3), "float32",
    ...                  np.dtype(np.float32))
    >>> unscan_mapping({"p/layers/w": t})
    {'p/layers_0/w': {'unstack': 'p/layers/w', 'index': 0, 'axis': 0},
     'p/layers_1/w': {'unstack': 'p/layers/w', 'index': 1, 'axis': 0}}
  """
  rx = re.compile(pattern)
  out = {}
  for p, t in tensors.items():
    m = rx.fullmatch(p)
    if not m:
      continue
    if axis >= len(t.shape):
      raise TreeError(f"{p}: shape {t.shape} has no axis {axis} to unscan")
    for i in range(t.shape[axis]):
      out[m.expand(into.replace("{i}", str(i)))] = {
          "unstack": p, "index": i, "axis": axis}
  return out


# -- target layouts ----------------------------------------------------------
_SPEC_KEYS = ("mesh", "rules", "devices_per_process", "device_ids")


def _spec_error(spec: Mapping) -> str | None:
  """What is wrong with a layout spec document's shape, or None."""
  unknown = [k for k in spec if k not in _SPEC_KEYS]
  if unknown:
    return (f"a layout spec has unknown keys {unknown}; it takes"
            f" {list(_SPEC_KEYS)}")
  mesh = spec.get("mesh")
  if not isinstance(mesh, Mapping) or not mesh or not all(
      isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
      and v > 0 for k, v in mesh.items()):
    return ("a layout spec needs 'mesh': {axis: size, ...} with positive"
            f" integer sizes, got {mesh!r:.80}")
  rules = spec.get("rules", [])
  if not isinstance(rules, Sequence) or isinstance(rules, str):
    return f"'rules' must be a list of [regex, spec] pairs, got {rules!r:.80}"
  for i, r in enumerate(rules):
    if not (isinstance(r, Sequence) and not isinstance(r, str) and len(r) == 2
            and isinstance(r[0], str) and isinstance(r[1], Sequence)
            and not isinstance(r[1], str)):
      return (f"rule {i} must be [regex, [axis or null or [axes], ...]],"
              f" got {r!r:.80}")
    try:
      re.compile(r[0])
    except re.error as e:
      return f"rule {i}: regex {r[0]!r} does not compile: {e}"
  return None


def layout_from_spec(spec: Mapping, tensors: Mapping[str, SourceTensor],
                     saved: Mapping[str, Mapping] | None = None, *,
                     allow_unmatched: bool = False) -> PTC:
  """A target PTC from a mesh shape and rules, without devices.

  Args:
    spec: ``{"mesh": {"data": 2, "tensor": 4}, "rules": [[regex, [axis or
      null or [axes], ...]], ...], "devices_per_process": k}``. Each tensor
      takes the spec of the first rule whose regex matches its whole path;
      a tensor no rule matches keeps its saved spec when every axis in it
      is in the new mesh, else it is replicated.
    tensors: the source's tensors.
    saved: per path, the saved sharding description (``inspect``'s
      ``sharding``), for unmatched tensors.
    allow_unmatched: a rule whose regex matches no tensor (a typo such as
      ``params/.*/kernal``) is a warning naming it, not an error.

  Raises:
    LayoutError: the spec document is malformed (an unknown key, no
      ``mesh``, a rule that is not ``[regex, spec]``), a rule matches no
      tensor (unless ``allow_unmatched``), or a spec does not fit its
      tensor (names path, dimension and sizes).

  Warns:
    UnmatchedRuleWarning: with ``allow_unmatched``, rules that match no
      tensor.

  Example:
    >>> t = SourceTensor("w", (8, 4), "float32", np.dtype(np.float32))
    >>> ptc = layout_from_spec({"mesh": {"data": 2, "tensor": 2},
    ...                         "rules": [["w", [None, "tensor"]]]}, {"w": t})
    >>> ptc["w"].shard_box(1), len(ptc.processes)
    (((0, 8), (2, 4)), 4)
    >>> layout_from_spec({"mesh": {"tensor": 2}, "rules": [["v", [None]]]},
    ...                  {"w": t})
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.LayoutError: layout rules match no tensor: 'v' (rule 0); the source holds ['w'] (pass allow_unmatched=True, or --allow-unmatched, to go on with a warning)
  """
  why = _spec_error(spec)
  if why is not None:
    raise LayoutError(why)
  mesh = tuple((str(k), int(v)) for k, v in spec["mesh"].items())
  n = math.prod(v for _, v in mesh)
  ids = tuple(spec.get("device_ids") or range(n))
  rules = [(re.compile(r), tuple(tuple(e) if isinstance(e, list) else e
                                 for e in s))
           for r, s in spec.get("rules", [])]
  per = int(spec.get("devices_per_process", n))
  names = {a for a, _ in mesh}
  out = []
  for path, t in tensors.items():
    pspec = next((s for r, s in rules if r.fullmatch(path)), None)
    if pspec is None:
      d = (saved or {}).get(path)
      ps = tuple(tuple(e) if isinstance(e, list) else e
                 for e in (d or {}).get("spec", ())) if d and \
          d.get("kind") == "named" else ()
      axes = {a for e in ps if e for a in ((e,) if isinstance(e, str) else e)}
      pspec = ps if axes <= names else ()
    placement = named_placement(path, t.shape, mesh, pspec, ids)
    desc = {"kind": "named", "axis_names": [a for a, _ in mesh],
            "mesh_shape": [v for _, v in mesh], "device_ids": list(ids),
            "axis_types": ["Auto"] * len(mesh),
            "spec": [list(e) if isinstance(e, tuple) else e for e in pspec],
            "memory_kind": None}
    out.append(TensorLayout(path, t.shape, t.dtype,
                            t.storage.itemsize * math.prod(t.extra),
                            placement, desc))
  unmatched = [i for i in range(len(rules))
               if not any(rules[i][0].fullmatch(p) for p in tensors)]
  if unmatched:
    listed = ", ".join(f"{rules[i][0].pattern!r} (rule {i})"
                       for i in unmatched)
    held = list(tensors)
    msg = (f"layout rules match no tensor: {listed}; the source holds"
           f" {held[:8]}{' and more' if len(held) > 8 else ''}")
    if not allow_unmatched:
      raise LayoutError(msg + " (pass allow_unmatched=True, or"
                        " --allow-unmatched, to go on with a warning)")
    warnings.warn(msg, UnmatchedRuleWarning, stacklevel=3)
  return PTC(tuple(out), tuple((d, i // per) for i, d in enumerate(ids)))


def _target_ptc(target, tensors, saved, *, allow_unmatched: bool = False,
                mesh=None) -> PTC:
  """The target layout of a conversion, every tensor under its saved path.

  Raises :class:`LayoutError` (one line) for a target that names no layout
  (a dict that is no spec, a tree without shardings) and
  :class:`TreeError` for tensors that do not match the source.
  """
  if target is None:  # the saved layout: every tensor keeps its chunks
    return PTC((), ())
  if isinstance(target, Mapping) and target.get("format") == \
      "tenplex_jax.PTC":
    target = PTC.from_json(target)
  elif isinstance(target, Mapping) and any(k in target for k in _SPEC_KEYS):
    target = layout_from_spec(target, tensors, saved,
                              allow_unmatched=allow_unmatched)
  if isinstance(target, PTC):
    paths, problems = match_layout(target, tensors, where="the source")
    raise_tree_problems("the target does not match the source", problems)
    return PTC(tuple(dataclasses.replace(t, path=paths[t.path])
                     if paths[t.path] != t.path else t for t in target),
               target.processes)
  _, _, slots, problems = match_saved(target, tensors, where="the source",
                                      mesh=mesh)
  if not any(x.array for x in slots) and not problems:
    what = (f"a dict with keys {list(target)[:6]}"
            if isinstance(target, Mapping) else f"a {type(target).__name__}")
    raise LayoutError(
        "the target names no layout: give a tenplex_jax.PTC (or its JSON),"
        ' {"mesh": {axis: size}, "rules": [[regex, spec], ...]}, or a'
        f" pytree of jax.ShapeDtypeStructs with shardings; got {what}")
  for x in slots:  # numbers and unsharded arrays keep the saved layout
    if not x.array and not (x.leaf is None or isinstance(
        x.leaf, (bool, int, float, complex, np.ndarray, np.generic,
                 jax.ShapeDtypeStruct))):
      problems.append(Problem(
          x.path, f"the target leaf is {leaf_kind(x.leaf)}, not a"
          " jax.ShapeDtypeStruct with a sharding", "target leaves that are"
          " not jax.ShapeDtypeStructs with shardings"))
  raise_tree_problems("the target does not match the source", problems)
  return PTC.from_tree({x.saved: jax.ShapeDtypeStruct(
      x.leaf.shape, x.leaf.dtype, sharding=x.leaf.sharding)
      for x in slots if x.array and x.saved is not None})


# -- writing -----------------------------------------------------------------
def _chunk_shape(boxes: Sequence[Box], shape: tuple[int, ...],
                 extra: tuple[int, ...], itemsize: int, cap: int
                 ) -> tuple[int, ...]:
  """The largest chunk that tiles every box (gcd of their corners), then
  halved along the leading dimensions until it fits ``cap`` bytes."""
  chunk = []
  for d, n in enumerate(shape):
    g = 0
    for b in boxes:
      g = math.gcd(g, math.gcd(b[d][0], b[d][1] - b[d][0]))
    chunk.append(max(1, g or n))
  per = itemsize * math.prod(extra)
  for d in range(len(chunk)):
    while math.prod(chunk) * per > cap and chunk[d] > 1:
      f = next(p for p in range(2, chunk[d] + 1) if chunk[d] % p == 0)
      chunk[d] //= f
  return tuple(chunk)


def _grid(shape, chunk) -> list[Box]:
  return list(itertools.product(*[
      [(a, min(a + c, n)) for a in range(0, n, c)] or [(0, 0)]
      for n, c in zip(shape, chunk)]))


def _orbax_sharding(desc: Mapping | None) -> dict | None:
  if not desc or desc.get("kind") != "named":
    return None
  ids = np.array(desc["device_ids"]).reshape(desc["mesh_shape"])
  return {"sharding_type": "NamedSharding",
          "shape": [int(n) for n in desc["mesh_shape"]],
          "axis_names": list(desc["axis_names"]),
          "axis_types": [f"AxisType.{t}" for t in
                         (desc.get("axis_types")
                          or ["Auto"] * len(desc["mesh_shape"]))],
          "partition_spec": list(desc["spec"]),
          "device_mesh": {"mesh": np.vectorize(lambda i: {"id": int(i)},
                                               otypes=[object])(ids).tolist()}}


class _Budget:
  """Bytes in flight, bounded; one job larger than the bound runs alone."""

  def __init__(self, limit: int):
    self.limit, self.used = limit, 0
    self.cv = threading.Condition()

  def take(self, n: int) -> None:
    with self.cv:
      while self.used and self.used + n > self.limit:
        self.cv.wait()
      self.used += n

  def give(self, n: int) -> None:
    with self.cv:
      self.used -= n
      self.cv.notify_all()


def _parse_bytes(v) -> int:
  if isinstance(v, int):
    return v
  m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(v), re.I)
  if not m:
    raise UsageError(f"cannot read {v!r} as a size (e.g. 512MiB, 2G)")
  return int(float(m.group(1)) * 1024 ** "_KMGT".index(
      (m.group(2) or "_").upper()))


def convert(src: str, dst: str, target: Any = None, *,
            memory_limit: int | str = 512 << 20,
            mapping: Mapping[str, Any] | None = None,
            step: int | None = None, item: str | None = None,
            progress: bool | None = None, workers: int = 4,
            ocdbt: bool = False, allow_unmatched: bool = False,
            mesh: Any = None) -> dict:
  """Converts an Orbax checkpoint to another layout, offline.

  Streams chunk by chunk: at most about ``memory_limit`` bytes of chunk
  buffers and decoded source chunks are held at once (a source chunk larger
  than that is still read whole; Orbax writes one chunk per saved shard).
  Needs no devices: any machine with one CPU converts for any job. The new
  checkpoint's chunks tile every target shard exactly (so each new process
  reads whole chunks), its ``_sharding`` records the target shardings, and
  stock Orbax restores it onto the target mesh. The source is only read;
  ``dst`` appears complete or not at all (written under a temporary name,
  then renamed).

  Args:
    src: an Orbax checkpoint (manager, step or item directory, local or
      on ``s3://`` / ``gs://``), or a local tenplex_jax store directory
      (a store on object storage is refused, naming it): its newest
      complete snapshot (or
      ``step``) is exported as a standard Orbax checkpoint, box by box
      (see :class:`tenplex_jax.store.source.StoreSource`; plain numbers become
      Orbax scalars, strings Orbax strings (``_strings.json``), ``None`` an
      empty node; a complex number is refused). An Orbax source's strings
      are carried over the same way.
    dst: the new checkpoint; must not exist. When ``src`` is a step of a
      ``CheckpointManager`` or a store, ``dst`` is written as a manager
      directory (``dst/<step>/default``), else as an item directory.
    target: the target layout: a :class:`tenplex_jax.PTC` (or its JSON
      dict), a pytree of ``jax.ShapeDtypeStruct`` with shardings, or
      ``{"mesh": {...}, "rules": [...]}`` (see :func:`layout_from_spec`).
      Tensors the target does not name keep their saved chunking and
      shardings (in a tree: leaves that are ``None``, numbers or
      ``ShapeDtypeStruct``s without a sharding); ``None``: all of them do.
      A target that names no layout (a dict that is no spec or PTC, a tree
      without shardings) or a tree leaf of another type (a string, a
      ``PartitionSpec``) is an error, not the saved layout.
    memory_limit: bytes, or a string such as ``"512MiB"``.
    mapping: a structural mapping (see :class:`MappedSource`), applied
      before the target layout.
    step: the step to read from a manager directory or a store.
    item: the item to read from a step.
    progress: show a progress bar (default: when stderr is a terminal).
    workers: chunks converted concurrently (within the memory limit).
    ocdbt: write the arrays into one OCDBT key-value store (``manifest.ocdbt``
      and ``d/`` in the item, as Orbax does by default) instead of one
      directory per array; both are zarr v3.
    allow_unmatched: a layout rule that matches no tensor is a warning
      (:class:`tenplex_jax.errors.UnmatchedRuleWarning`), not an error.
    mesh: the concrete mesh for target shardings on an ``AbstractMesh``
      (default: the mesh in context).

  Returns:
    A report: ``bytes``, ``seconds``, ``gb_per_s``, ``tensors``, ``chunks``,
    ``dst`` (the item directory written).

  Raises:
    UsageError: ``dst`` exists, or ``src`` is not a checkpoint.
    LayoutError: the target names no layout, a spec is malformed or has a
      rule that matches no tensor; nothing is written.
    NoCopyError: a store source holds no complete snapshot (of ``step``).
    LayoutError: the target does not fit a tensor (names it).
    TreeError: the target's shapes or dtypes differ from the source's (or
      a store's plain leaf is not a number, numeric array or None).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from tenplex_jax.orbax import inspect, save
    >>> d = tempfile.mkdtemp()
    >>> _ = save({"w": jnp.arange(32.0).reshape(8, 4)}, d + "/src", step=3)
    >>> rep = convert(d + "/src", d + "/tp2", {"mesh": {"tensor": 2},
    ...               "rules": [["w", [None, "tensor"]]]}, progress=False)
    >>> w = inspect(d + "/tp2")["tensors"]["w"]
    >>> rep["bytes"], w["chunk_shape"], w["spec"]
    (128, [8, 2], 'P(None, tensor) on tensor=2')
  """
  dloc = parse_location(dst)
  if dloc.kind == OBJECT:  # written here, then uploaded (markers last)
    with tempfile.TemporaryDirectory(prefix="tenplex-jax-convert-") as tmp:
      rep = convert(src, os.path.join(tmp, "ck"), target,
                    memory_limit=memory_limit, mapping=mapping, step=step,
                    item=item, progress=progress, workers=workers,
                    ocdbt=ocdbt, allow_unmatched=allow_unmatched, mesh=mesh)
      upload_tree(os.path.join(tmp, "ck"), dloc.target)
    rep["dst"] = dloc.target + rep["dst"][len(os.path.join(tmp, "ck")):]
    return rep
  if dloc.kind != LOCAL:
    raise UsageError(f"convert: {dst} is a store server; the new checkpoint"
                     " goes to a directory, s3:// or gs://")
  limit = _parse_bytes(memory_limit)
  dst = os.path.abspath(dloc.target)
  if os.path.exists(dst):
    raise UsageError(f"{dst} exists; convert writes a new checkpoint")
  t0 = time.perf_counter()
  base = open_base(src, step, item, limit // 16)
  source: Source = MappedSource(base, mapping) if mapping else base
  try:
    held = source.tensors()
    saved = {}
    for e in base.entries:
      d = sharding_from_orbax(base.shardings.get(e.param),
                    len(held[e.name].shape) if e.name in held else None)
      if d:
        saved[e.name] = d
    new = _target_ptc(target, held, saved, allow_unmatched=allow_unmatched,
                      mesh=mesh)
    cap = max(1 << 20, limit // 16)
    # The destination layout, physical: every chunk is a box.
    chunks: dict[str, tuple[int, ...]] = {}
    dst_tensors = []
    for path, h in held.items():
      if math.prod(h.shape) == 0:
        continue  # Orbax stores no zero-size arrays
      boxes = new.by_path[path].placement.boxes if path in new.by_path \
          else h.boxes
      c = _chunk_shape(boxes, h.shape, h.extra, h.storage.itemsize, cap)
      chunks[path] = c
      grid = [b + tuple((0, e) for e in h.extra) for b in _grid(h.shape, c)]
      dst_tensors.append(TensorLayout(
          path, h.stored_shape, h.storage.name, h.storage.itemsize,
          Placement(tuple(grid), tuple((i,) for i in range(len(grid))))))
    used = {p: held[p] for p in chunks}
    n_dev = max((len(t.placement.boxes) for t in dst_tensors), default=0)
    dst_ptc = PTC(tuple(dst_tensors), tuple((i, 0) for i in range(n_dev)))
    the_plan = plan(source_layout(used), dst_ptc)
    # Where it goes.
    loc = base.location
    out_item = os.path.join(dst, str(loc.step), "default") \
        if loc.step is not None and loc.manager_dir else dst
    tmp = dst + f".tenplex-tmp-{os.getpid()}"
    tmp_item = out_item.replace(dst, tmp, 1)
    os.makedirs(tmp_item)
    params = {e.name: e for e in base.entries}
    names = {}
    for path in chunks:
      e = params.get(path)
      same = e is not None and (not mapping or source.rules.get(path)
                                == ("rename", path))
      names[path] = e.param if same else path.replace("/", ".")
    ctx = ts.Context({"file_io_concurrency": {"limit": 64},
                      "cache_pool": {"total_bytes_limit": 0}})
    stores = {}
    for path, c in chunks.items():
      h = held[path]
      # a parameter named "" (a dict key "") is the item's root, as Orbax
      # writes it
      sub = f"{names[path]}/" if names[path] else ""
      stores[path] = ts.open({
          "driver": "zarr3",
          "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_item}/",
                      "path": sub} if ocdbt else
                     {"driver": "file", "path": f"{tmp_item}/{sub}"},
          "metadata": {
              "shape": list(h.stored_shape),
              "chunk_grid": {"name": "regular", "configuration": {
                  "chunk_shape": list(c) + list(h.extra)}},
              "chunk_key_encoding": {"name": "default"},
              "codecs": [{"name": "bytes",
                          "configuration": {"endian": "little"}},
                         {"name": "zstd", "configuration": {
                             "level": 1, "checksum": False}}],
              "data_type": ts.dtype(h.storage).name,
              # zarr v3 takes a bool array's fill value as a JSON boolean
              "fill_value": _fill_value(h.storage)},
          "store_data_equal_to_fill_value": True,
      }, create=True, open=False, context=ctx).result()
    # Stream: every new chunk is a new box of the restore core
    # (tenplex_jax.assembly), read into a buffer and written as a chunk.
    jobs = []  # (new box, bytes in flight while it is converted)
    for nb in new_boxes(the_plan, dst_ptc):
      h = used[nb.path]
      per = h.storage.itemsize * math.prod(h.extra)
      cost = 2 * box_volume(nb.box) * h.storage.itemsize + max(
          box_volume(h.boxes[si]) * per for _, si in nb.pieces)
      jobs.append((nb, cost))
    total = sum(box_volume(nb.box) * used[nb.path].storage.itemsize
                for nb, _ in jobs)
    budget = _Budget(max(1, limit // 4))
    show = progress if progress is not None else os.isatty(2)
    done = [0]
    bar = None
    if show:
      bar = Progress("[progress.description]{task.description}", BarColumn(),
                     DownloadColumn(binary_units=True), TransferSpeedColumn(),
                     TimeRemainingColumn(), transient=False)
      task = bar.add_task("convert", total=total)
      bar.start()

    def run(job):
      nb = job[0]  # a scratch buffer (not a device buffer): np.empty
      [(_, buf, views)] = fill([nb], lambda nb: np.empty(
          nb.shape, used[nb.path].storage))
      # Every piece's read at once (the chunk's cost is budgeted above).
      read_source(source, [(nb, buf, views)], inflight_bytes=1 << 62)
      stores[nb.path][tuple(slice(a, b) for a, b in nb.box)].write(
          buf).result()
      return buf.nbytes

    pool = cf.ThreadPoolExecutor(max_workers=max(1, workers))
    futs = collections.deque()
    try:
      for job in jobs:
        budget.take(job[1])
        f = pool.submit(run, job)
        f.add_done_callback(lambda _f, c=job[1]: budget.give(c))
        futs.append(f)
        while futs and futs[0].done():
          done[0] += futs.popleft().result()
          if bar:
            bar.update(task, completed=done[0])
      while futs:
        done[0] += futs.popleft().result()
        if bar:
          bar.update(task, completed=done[0])
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    finally:
      pool.shutdown(wait=True)
      if bar:
        bar.stop()
    stores.clear()
    _write_metadata(tmp_item, held, chunks, names, new, params, base,
                    bool(mapping), ocdbt)
    if tmp_item != tmp:  # a manager step directory
      ck = (read_json(os.path.join(loc.step_dir, "_CHECKPOINT_METADATA"),
                       loc.files) if loc.step_dir else None) or {}
      now = time.time_ns()
      _dump(os.path.join(os.path.dirname(tmp_item), "_CHECKPOINT_METADATA"), {
          "item_handlers": {"default": _HANDLER}, "metrics": {},
          "performance_metrics": {}, "init_timestamp_nsecs": now,
          "commit_timestamp_nsecs": now,
          "custom_metadata": ck.get("custom_metadata") or {}})
      _dump(os.path.join(os.path.dirname(tmp_item), "commit_success.txt"),
            None)
    os.rename(tmp, dst)
  finally:
    source.close()
  secs = time.perf_counter() - t0
  return {"dst": out_item, "bytes": total, "seconds": secs,
          "gb_per_s": total / secs / 1e9, "tensors": len(chunks),
          "chunks": len(jobs), "memory_limit": limit}


def open_base(src: str, step: int | None, item: str | None,
              cache_bytes: int):
  """The source of a conversion: an Orbax checkpoint, or a tenplex_jax store
  directory (a :class:`tenplex_jax.store.source.StoreSource`, given the Orbax
  tree metadata a checkpoint would have)."""
  from tenplex_jax.store.source import StoreSource
  from tenplex_jax.store.format import HostStore
  path = os.path.abspath(os.fspath(src))
  if not (os.path.isdir(path) and HostStore(path).is_store()):
    try:
      return OrbaxSource(src, step=step, item=item, cache_bytes=cache_bytes)
    except UsageError as e:
      loc = parse_location(src)
      if loc.kind == OBJECT:
        from tenplex_jax.store.objects import ObjectStore
        if ObjectStore(loc.target).is_store():
          raise UsageError(
              f"{loc.target} is a tenplex_jax store on object storage:"
              " convert reads a store from a local directory only (copy"
              " it down first, or restore it with tenplex_jax.store."
              "restore and save that with tenplex_jax.orbax.save)") from e
      raise
  if item is not None:
    raise UsageError(f"{path} is a tenplex_jax store: it has no items")
  base = StoreSource(path, step=step)

  def keys(p):  # the store keeps key names, not types: digits = sequence
    return [{"key": k, "key_type": 1 if k.isdigit() else 2}
            for k in p.split("/")]

  entries, bad = [], []
  held = base.tensors()
  for p in held:
    v = base.plain.get(p)
    vtype = ("jax.Array" if p not in base.plain else "np.ndarray"
             if isinstance(v, np.ndarray) else "scalar")
    entries.append(TreeEntry(p, p.replace("/", "."), keys(p), vtype))
  for p, v in base.plain.items():
    if p in held:
      continue
    if v is None:
      entries.append(TreeEntry(p, p.replace("/", "."), keys(p), "None"))
    elif isinstance(v, str):  # written to _strings.json, as Orbax does
      entries.append(TreeEntry(p, p.replace("/", "."), keys(p), "string"))
    else:
      bad.append(f"{p}: {type(v).__name__} {v!r}"[:80])
  if bad:
    raise TreeError(f"{path}: step {base.step} has plain leaves a standard"
                    f" Orbax checkpoint cannot hold as arrays: {bad}")
  base.entries = entries
  base.shardings = {}
  for t in base.job:
    o = _orbax_sharding(t.sharding)
    if o:
      base.shardings[t.path.replace("/", ".")] = o
  base.location = Location(path, base.step, None, path)
  base.meta = None
  return base


def _fill_value(dtype: np.dtype):
  """zarr v3's JSON zero of ``dtype``: a boolean for bool (tensorstore
  refuses 0 there), a [real, imaginary] pair for complex numbers."""
  if dtype == np.bool_:
    return False
  if dtype.kind == "c":
    return [0, 0]
  return 0


def _dump(path: str, obj) -> None:
  with open(path, "w") as f:
    if obj is None:
      f.write("Checkpoint commit was successful to " + path)
    else:
      json.dump(obj, f)


def _write_metadata(item, held, chunks, names, new, params, base, mapped,
                    ocdbt=False):
  tree, shardings, arrays = {}, {}, []
  for path, c in chunks.items():
    h = held[path]
    e = params.get(path)
    if e is not None and names[path] == e.param:
      keys, vtype = e.keys, e.value_type
    else:
      keys = [{"key": k, "key_type": 2} for k in path.split("/")]
      vtype = "jax.Array"
    write_shape = list(c) + list(h.extra)
    tree[repr(tuple(k["key"] for k in keys))] = {
        "key_metadata": keys,
        "value_metadata": {"value_type": vtype, "skip_deserialize": False,
                           "write_shape": write_shape}}
    desc = new.by_path[path].sharding if path in new.by_path else None
    if desc is None and e is not None and not mapped:
      raw = base.shardings.get(e.param)
      if raw:
        shardings[names[path]] = raw
    elif desc is not None:
      o = _orbax_sharding(desc)
      if o:
        shardings[names[path]] = o
    arrays.append({"array_metadata": {
        "param_name": names[path], "write_shape": write_shape,
        "chunk_shape": write_shape,
        "ext_metadata": {"random_key_impl": h.key_impl} if h.key_impl
        else None}})
  raw = (base.meta or {}).get("tree_metadata") or {}
  for e in base.entries:  # empty nodes (None, empty optax states) stay
    if e.value_type not in ARRAY_TYPES:
      key = repr(tuple(k["key"] for k in e.keys))
      tree[key] = next((v for v in raw.values()
                        if v.get("key_metadata") == e.keys),
                       {"key_metadata": e.keys, "value_metadata": {
                           "value_type": e.value_type,
                           # an empty node is not read; a string is
                           "skip_deserialize": e.value_type != "string"}})
  # Strings: where Orbax's StringHandler keeps them (the tree above lists
  # them; without the file stock Orbax fails to restore the checkpoint).
  values = base.saved_values()
  strings = {e.param: values[e.name] for e in base.entries
             if e.value_type == "string" and e.name in values}
  if strings:
    _dump(os.path.join(item, "_strings.json"), strings)
  _dump(os.path.join(item, "_METADATA"), {
      "tree_metadata": tree, "use_ocdbt": bool(ocdbt), "use_zarr3": True,
      "store_array_data_equal_to_fill_value": True,
      "custom_metadata": (base.meta or {}).get("custom_metadata")})
  _dump(os.path.join(item, "_sharding"), {
      base64.urlsafe_b64encode(k.encode()).decode(): json.dumps(v)
      for k, v in shardings.items()})
  os.makedirs(os.path.join(item, "array_metadatas"))
  _dump(os.path.join(item, "array_metadatas", "process_0"),
        {"array_metadatas": arrays})
  now = time.time_ns()
  _dump(os.path.join(item, "_CHECKPOINT_METADATA"), {
      "item_handlers": _HANDLER, "metrics": {}, "performance_metrics": {},
      "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
      "custom_metadata": {}})
  _dump(os.path.join(item, "commit_success.txt"), None)
