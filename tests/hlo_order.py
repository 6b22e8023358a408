"""Which collectives of a compiled XLA program may run in either order.

jaxlib 0.10.2's XLA:CPU runs each computation (the entry, a loop's body, a
branch) as a graph of thunks: a thunk waits for the *completion* of the thunks
whose buffers it reads or overwrites (every data dependence of the HLO is
one), while the collectives of one computation are linked only by *scheduling*
edges on a shared communicator resource (each starts after the one before it
has started; a plain collective runs to its end inside its thunk). An
executable loaded from jax's persistent compilation cache has no such edge
between a ``while`` (or ``conditional``, ``call``) that holds collectives and
the collectives beside it, so there only data orders them: a device may run
the loop first and another device second, and over gloo they then wait for
each other for ever (docs/pipeline.md, "Ordering collectives against the
pipeline's loops").

:meth:`Module.unordered_pairs` lists the pairs of collectives of one
computation (by default the entry: the compiled step's top level) that share a
device and that no chain of data or control dependencies orders;
:meth:`Module.region_pairs` those of them, in every computation, with a loop
or conditional: the pairs a cached executable may run at the same time. A
collective here is an ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all``, ``collective-permute``, ``collective-broadcast`` or
``ragged-all-to-all`` (their ``-start`` forms too), or any instruction whose
called computations hold one, at any depth.

Example::

  m = Module(jax.jit(f).lower(x).compile().as_text())
  for computation, a, b in m.region_pairs():
    print(computation, a.name, b.name)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_STARTS = tuple(c + "-start" for c in COLLECTIVES)
_CALLS = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_CONTROL = re.compile(r"\bcontrol-predecessors=\{([^}]*)\}")
_NAME = re.compile(r"%([\w.\-]+)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Op:
  """One instruction of the analysed computation that is (or holds) a collective.

  Attributes:
    name: the instruction's name (``all-reduce.1``, ``while.521``).
    opcode: its opcode (``all-reduce``, ``while``, ...).
    devices: the device ids it communicates among: the union of its replica
      groups (every device of the program when the groups are empty), of its
      permute pairs, and of the collectives it holds.
    groups: ``replica_groups`` / ``source_target_pairs`` as written in the HLO
      (for a region: the names of the collectives it holds).
    permute: whether it is (or holds) a ``collective-permute``.
  """

  name: str
  opcode: str
  devices: frozenset
  groups: str
  permute: bool = False


@dataclasses.dataclass
class _Instr:
  name: str
  opcode: str
  operands: list
  control: list
  calls: list
  attrs: str


def _balanced(text, start):
  """Index just past the bracket group opening at ``text[start]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  raise ValueError(f"unbalanced brackets from {text[start:start + 80]!r}")


def _parse_instr(line):
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(1), re.sub(r"/\*.*?\*/", "", m.group(2))
  # The result type: a tuple in parentheses, or one token (f32[4,2]{1,0}, token[]).
  if rest.startswith("("):
    i = _balanced(rest, 0)
  else:
    i = rest.index(" ") if " " in rest else len(rest)
  rest = rest[i:].lstrip()
  om = re.match(r"([a-z][\w\-]*)\(", rest)
  if not om:
    return None
  opcode = om.group(1)
  end = _balanced(rest, om.end() - 1)
  operands = _NAME.findall(rest[om.end():end - 1])
  attrs = re.sub(r"metadata=\{.*?\}(?=,|$)", "", rest[end:])
  control = [n for c in _CONTROL.findall(attrs) for n in _NAME.findall(c)]
  calls = _CALLS.findall(attrs) + [n for b in _BRANCHES.findall(attrs)
                                   for n in re.findall(r"%?([\w.\-]+)", b)]
  return _Instr(name, opcode, operands, control, calls, attrs)


def parse(text):
  """``(computations, entry name, device count)`` of an HLO module's text:
  computations map names to their instructions in program order."""
  comps, entry, current = {}, None, None
  m = re.search(r"\bnum_partitions=(\d+)", text)
  r = re.search(r"\breplica_count=(\d+)", text)
  n_devices = (int(m.group(1)) if m else 1) * (int(r.group(1)) if r else 1)
  for line in text.splitlines():
    if current is None:
      h = _HEADER.match(line)
      if h:
        current = h.group(2)
        comps[current] = []
        if h.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    instr = _parse_instr(line)
    if instr is not None:
      comps[current].append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry, n_devices


def _groups_devices(attrs, n_devices):
  """The device ids a collective's ``replica_groups`` / ``source_target_pairs``
  name (``None`` where they are empty: every device), and their text."""
  m = re.search(r"source_target_pairs=(\{[^=]*?\}\})", attrs)
  if m:
    return frozenset(int(x) for x in re.findall(r"\d+", m.group(1))), m.group(1)
  m = re.search(r"replica_groups=", attrs)
  if not m:
    return None, ""
  rest = attrs[m.end():]
  if rest.startswith("{"):
    text = rest[:_balanced(rest, 0)]
    ids = frozenset(int(x) for x in re.findall(r"\d+", text))
    return (ids or None), text
  if rest.startswith("["):  # iota: [groups,size]<=[dims]T(perm): every id below the product
    text = re.match(r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?", rest).group(0)
    shape = [int(x) for x in re.match(r"\[([\d,]+)\]", text).group(1).split(",")]
    return frozenset(range(math.prod(shape))), text
  if rest.startswith("mesh["):  # mesh['a'=2,'b'=2] {'a'}: groups along the named axes
    text = rest[:_balanced(rest, 4)]
    sizes = [int(x) for x in re.findall(r"=(\d+)", text)]
    return frozenset(range(math.prod(sizes))), rest[:rest.index("}") + 1]
  return None, rest.split(",")[0]


def mesh_groups(text):
  """The replica groups of a ``mesh['a'=2,'b'=2] {'a'}`` spec, as sorted tuples
  of device ids (row-major ids over the mesh), e.g. ``((0, 2), (1, 3))``."""
  axes = re.findall(r"'(\w+)'=(\d+)", text)
  inside = re.findall(r"'(\w+)'", text[text.index("]"):])
  ids = np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
  names = [a for a, _ in axes]
  keep = [names.index(a) for a in inside]
  rest = [i for i in range(len(names)) if i not in keep]
  moved = np.transpose(ids, rest + keep).reshape(-1, math.prod(ids.shape[i] for i in keep))
  return tuple(sorted(tuple(int(x) for x in g) for g in moved))


class Module:
  """An HLO module's text, parsed once: ``computations`` (name -> instructions in
  program order), ``entry`` and ``n_devices``."""

  def __init__(self, text):
    self.computations, self.entry, self.n_devices = parse(text)
    self.every = frozenset(range(self.n_devices))
    self._held = {}

  def _holds(self, comp, seen):
    if comp not in self._held:
      devices, names, permute = frozenset(), [], False
      for ins in self.computations.get(comp, []):
        d, n, p = self._own(ins, seen + (comp,))
        devices, names, permute = devices | d, names + n, permute or p
      self._held[comp] = (devices, names, permute)
    return self._held[comp]

  def _own(self, ins, seen=()):
    """(devices, names of the collectives, holds a permute) of an instruction,
    at any depth."""
    if ins.opcode in COLLECTIVES or ins.opcode in _STARTS:
      ids, _ = _groups_devices(ins.attrs, self.n_devices)
      return ((self.every if ids is None else ids), [ins.name],
              ins.opcode.startswith("collective-permute"))
    devices, names, permute = frozenset(), [], False
    for c in ins.calls:
      if c not in seen:
        d, n, p = self._holds(c, seen)
        devices, names, permute = devices | d, names + n, permute or p
    return devices, names, permute

  def collective_ops(self, computation=None):
    """The collectives of one computation (the entry by default) and the
    instructions that hold collectives, in program order, as :class:`Op`."""
    out = []
    for ins in self.computations[computation or self.entry]:
      if ins.opcode in COLLECTIVES or ins.opcode in _STARTS:
        ids, groups = _groups_devices(ins.attrs, self.n_devices)
        out.append(Op(ins.name, ins.opcode, self.every if ids is None else ids, groups,
                      ins.opcode.startswith("collective-permute")))
      else:
        devices, names, permute = self._own(ins)
        if names:
          out.append(Op(ins.name, ins.opcode, devices, ",".join(names), permute))
    return out

  def unordered_pairs(self, computation=None, *, communicator_spans_program=True):
    """See :func:`unordered_pairs`."""
    name = computation or self.entry
    ops = self.collective_ops(name)
    index = {op.name: i for i, op in enumerate(ops)}
    # Which of those collectives each instruction depends on (bit i: ops[i]);
    # XLA prints a computation's instructions after their operands.
    below = {}
    for ins in self.computations[name]:
      mask = 0
      for dep in ins.operands + ins.control:
        mask |= below.get(dep, 0)
      if ins.name in index:
        mask |= 1 << index[ins.name]
      below[ins.name] = mask

    def span(op):
      return self.every if (communicator_spans_program and op.permute) else op.devices

    pairs = []
    for (i, a), (j, b) in itertools.combinations(enumerate(ops), 2):
      ordered = below[b.name] >> i & 1 or below[a.name] >> j & 1
      if not ordered and span(a) & span(b):
        pairs.append((a, b))
    return pairs

  def region_pairs(self):
    """``[(computation, a, b), ...]``: the unordered pairs, in every computation
    (each one thunk sequence of XLA:CPU), of which ``a`` or ``b`` is a ``while``,
    ``call`` or ``conditional`` holding collectives: the pairs that jaxlib
    0.10.2's XLA:CPU may run at the same time (see the module docstring)."""
    out = []
    for name in self.computations:
      for a, b in self.unordered_pairs(name):
        if a.opcode in REGIONS or b.opcode in REGIONS:
          out.append((name, a, b))
    return out


REGIONS = ("while", "call", "conditional")


def collective_ops(text, computation=None):
  """:meth:`Module.collective_ops` of an HLO module's text."""
  return Module(text).collective_ops(computation)


def unordered_pairs(text, computation=None, *, communicator_spans_program=True):
  """The pairs of collectives of one computation that no dependency orders.

  Args:
    text: an HLO module's text (``jax.jit(f).lower(...).compile().as_text()``).
    computation: the computation to look at; the entry computation (the
      compiled program's top level) by default.
    communicator_spans_program: count a ``collective-permute`` (or a region
      holding one) as sharing every device of the program, as XLA:CPU's
      permute communicator spans them all (its creation is a rendezvous of
      every device); otherwise only the devices of its pairs.

  Returns:
    ``[(a, b), ...]``, :class:`Op` pairs in program order that share a device
    and that no path of operands or control predecessors in the computation
    orders (``b`` does not depend on ``a``, nor ``a`` on ``b``).
  """
  return Module(text).unordered_pairs(
      computation, communicator_spans_program=communicator_spans_program)


def region_pairs(text):
  """:meth:`Module.region_pairs` of an HLO module's text."""
  return Module(text).region_pairs()
