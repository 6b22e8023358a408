"""Elastic determinism: gradients whose bits do not depend on the device count.

EasyScale (ATC '23 / SC '23) calls it D1: a job that trains on 8 devices, then
4, then 3, ends with exactly the bits of a job that trained on 8 devices all
along. Data order and per-sample randomness are pinned elsewhere
(:class:`tenplex_jax.data.ElasticIterator`, :func:`tenplex_jax.data.sample_key`);
this module pins the last moving part, the order in which the gradient of a
global batch is summed.

The global batch is split into ``V`` *virtual workers* (EasyScale's
EasyScaleThreads), fixed for the life of the job. On a mesh whose batch axis
has ``n`` devices (``n`` divides ``V``), each device runs ``V / n`` virtual
workers one after the other (a ``lax.scan``), always on slices of the same
shape, so each worker's ``(loss, grad)`` is the same computation whatever
``n`` is. The ``V`` worker gradients are then summed by one fixed binary tree
over the worker indices:

* device ``d`` runs workers ``d, n + d, 2n + d, ...`` (the batch is permuted
  so that it holds their rows), so in scan step ``j`` the ``n`` devices
  together produce workers ``jn .. jn + n - 1``, consecutive;
* an ``all_to_all`` hands device ``d`` the ``d``-th chunk of each of those
  ``n`` flattened gradients;
* every device pushes its chunks, in worker order, onto a stack that evaluates
  the tree "pairwise, left subtree a power of two" (a binary counter: after
  leaf ``w`` merge as many times as ``w`` has trailing one bits);
* the chunks are gathered back and divided by ``V``.

Every node of the tree is one IEEE addition of the same two operands on every
mesh, element by element, so the result is bitwise identical for every ``n``
dividing ``V``. docs/determinism.md has the proof and the costs.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh
  >>> from tenplex_jax import determinism
  >>> def loss_fn(w, x):
  ...   return jnp.mean((x @ w) ** 2)
  >>> w, x = jnp.ones((3, 2)), jnp.arange(24.0).reshape(8, 3) / 7
  >>> out = []
  >>> for n in (1, 2):
  ...   mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
  ...   f = determinism.value_and_grad(loss_fn, virtual_workers=4, mesh=mesh)
  ...   out.append(f(w, x))
  >>> bits = [np.asarray(g).view(np.uint32) for _, g in out]
  >>> bool((bits[0] == bits[1]).all())
  True
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax.errors import UsageError

__all__ = ["COMPILER_OPTIONS", "GPU_DETERMINISM_FLAGS", "DeterminismReport",
           "SingleElementShardWarning", "check_environment",
           "clip_by_global_norm", "global_norm", "jit", "on_shards",
           "partial_gradient_bytes", "tree_sum", "value_and_grad",
           "worker_key", "worker_keys"]

# XLA flags that make GPU runs reproducible (D0). Without them XLA:GPU may
# pick atomics-based reductions (scatter, some reductions) and autotuned
# kernels that differ from run to run.
# XLA's SPMD partitioner runs a clean-up pipeline (CSE among others) on
# multi-device programs that single-device programs never see; the main
# algebraic simplifier then rewrites some divisions differently (for example
# in a softmax's gradient), so the same per-worker code gives other bits on
# 1 device than on 2+. Disabling that clean-up makes both pipelines agree.
# XLA:CPU has two code generators for fused elementwise loops (the MLIR
# "fusion emitters" and the older elemental IR emitter) and picks one per
# fusion; both let LLVM contract ``a * b + c * d`` into a fused multiply-add,
# but on different products (``fma(a, b, c * d)`` vs ``fma(c, d, a * b)``).
# An optax adamw moment update ``b1 * mu + (1 - b1) * g`` on an FSDP shard
# (its fusion slices the gathered gradient) and on a whole array went
# through different generators and differed in the last bit. With the
# fusion emitters off every fusion goes through the same generator.
# At backend optimisation level 0 (``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` sets
# it, as does ``--xla_backend_optimization_level=0``) LLVM generates the
# code without its code-generation optimisations, and XLA:CPU's programs
# for 1 and for 2+ devices no longer give the same bits for the same
# per-worker code (tests/test_determinism.py, V = 24: after 20 steps on 1
# device the first Adam moment differed from the static run's in 37 of 48
# elements; levels 1, 2 and 3 agree). The step is compiled at level 2
# whatever the process asks: every bitwise test passes there as at XLA's
# default level 3 (each level's bits are its own, the same on every mesh;
# a job keeps one level), the steps run as fast, and LLVM compiles them
# several times faster (with the fusion emitters off, level 3 spends most
# of a step's compile in LLVM: flax's lm1b TINY, V = 8, 2.2 s against
# 8.7 s on 1 CPU device; docs/determinism.md), which every resize pays
# again. Level 3 until the twenty-first session.
COMPILER_OPTIONS = (("xla_disable_hlo_passes", "spmd-cleanup"),
                    ("xla_cpu_use_fusion_emitters", False),
                    ("xla_backend_optimization_level", 2))
_OPT_LEVEL = dict(COMPILER_OPTIONS)["xla_backend_optimization_level"]


def _compiler_options(platform: str | None = None) -> dict[str, Any]:
  """:data:`COMPILER_OPTIONS` for ``platform`` (default: the default backend).

  XLA:GPU rejects the ``xla_cpu_*`` options ("No such compile option",
  jax 0.11.2 on an H100), so they are passed on CPU only.
  """
  platform = jax.default_backend() if platform is None else platform
  return {k: v for k, v in COMPILER_OPTIONS
          if platform == "cpu" or not k.startswith("xla_cpu_")}


GPU_DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops=true",
                         "--xla_gpu_exclude_nondeterministic_ops=true")


def _axes(batch_axis: str | Sequence[str]) -> tuple[str, ...]:
  if isinstance(batch_axis, str):
    return (batch_axis,)
  axes = tuple(batch_axis)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise UsageError(f"batch_axis must be a mesh axis name or a tuple of names,"
                     f" got {batch_axis!r}")
  return axes


def _is_16bit_float(dtype: Any) -> bool:
  """Whether ``dtype`` is a 16-bit float (bfloat16, float16)."""
  return (jnp.issubdtype(dtype, jnp.floating)
          and jnp.dtype(dtype).itemsize == 2)


def _bits_view(x: jax.Array) -> jax.Array:
  """A 16-bit float array as unsigned ints of its width, for a collective.

  XLA:CPU runs collectives on 16-bit floats in float32: it converts the
  operand up and the result back (exact both ways, so the same bits), but
  moves twice the bytes and adds two conversion passes over the gradient,
  fused with whatever layout change the chunks need. An integer view moves
  the same bits with none of it. Other arrays are returned as they are.
  """
  if _is_16bit_float(x.dtype):
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _from_bits_view(x: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`_bits_view` for an array of ``dtype``."""
  if x.dtype == jnp.dtype(dtype):
    return x
  return lax.bitcast_convert_type(x, dtype)


def _transposed_outputs(closed: Any) -> list[bool]:
  """Per output of a closed jaxpr: is it a 2-D ``transpose`` of another value?

  Followed through dtype conversions, copies, optimisation barriers,
  conditionals (every branch) and calls (``pjit``, custom derivatives).
  ``jax.grad`` of ``x @ w`` gives ``w``'s gradient as the transpose of a
  ``dot_general``, which XLA:CPU computes in place by giving it the
  transposed (column-major) layout: a gradient flagged here is likely laid
  out that way. Only a hint for the layout of the exchange: the values never
  depend on it.
  """
  producers: dict[int, dict] = {}

  def walk(jaxpr, var, depth):
    if depth > 64 or not isinstance(var, jax_core.Var):
      return False
    prod = producers.get(id(jaxpr))
    if prod is None:
      prod = producers[id(jaxpr)] = {
          v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
    if var not in prod:
      return False
    eqn, i = prod[var]
    name = eqn.primitive.name
    if name == "transpose":
      return tuple(eqn.params["permutation"]) == (1, 0)
    if name in ("convert_element_type", "copy", "copy_p"):
      return walk(jaxpr, eqn.invars[0], depth + 1)
    if name == "optimization_barrier":
      return walk(jaxpr, eqn.invars[i], depth + 1)
    if name == "cond":
      return all(walk(b.jaxpr, b.jaxpr.outvars[i], depth + 1)
                 for b in eqn.params["branches"])
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if (isinstance(inner, jax_core.Jaxpr)
          and len(inner.outvars) == len(eqn.outvars)):
        return walk(inner, inner.outvars[i], depth + 1)
    return False

  return [walk(closed.jaxpr, v, 0) for v in closed.jaxpr.outvars]


def _tree_merges(w: jax.Array) -> jax.Array:
  """Number of trailing one bits of ``w``: merges after pushing leaf ``w``."""
  # trailing ones of w == trailing zeros of w + 1 == popcount((w ^ (w + 1))) - 1
  return lax.population_count(jnp.bitwise_xor(w, w + 1)) - 1


def _final_merges(stack: jax.Array, virtual_workers: int) -> jax.Array:
  """Adds the subtrees left on the stack from right to left (static)."""
  depth = bin(virtual_workers).count("1")
  acc = stack[depth - 1]
  for i in range(depth - 2, -1, -1):
    acc = stack[i] + acc
  return acc


def tree_sum(x: jax.Array) -> jax.Array:
  """Sums ``x`` over its leading axis in the fixed tree of :func:`value_and_grad`.

  The tree is "pairwise, left subtree the largest power of two smaller than
  the node": ``[0, 24)`` is ``[0, 16) + [16, 24)``. Every node is one
  elementwise IEEE addition, so the result depends only on the values, never
  on how the array is sharded. Useful to check results and to sum per-worker
  metrics the same way.

  Args:
    x: an array of shape ``(V, ...)``.

  Returns:
    The sum over axis 0, shape ``x.shape[1:]``.

  Example:
    >>> float(tree_sum(jnp.arange(5.0)))
    10.0
  """
  x = jnp.asarray(x)
  if x.ndim == 0 or x.shape[0] == 0:
    raise UsageError(f"tree_sum needs an array with a non-empty leading axis,"
                     f" got shape {x.shape}")

  def node(lo: int, hi: int) -> jax.Array:
    if hi - lo == 1:
      return x[lo]
    mid = lo + (1 << ((hi - lo - 1).bit_length() - 1))
    return node(lo, mid) + node(mid, hi)

  return node(0, x.shape[0])


def _fold_sum(x: jax.Array) -> jax.Array:
  """Sum of a 1-D array by halving: ``x[:h] + x[h:]`` until one element.

  Every level is one elementwise IEEE addition of the same operands however
  ``x`` is sharded (an odd length gets one ``+0`` element, exact for the
  non-negative squares summed here), so the result depends on the values
  only, never on the device count.
  """
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      x = jnp.concatenate([x, jnp.zeros((1,), x.dtype)])
    h = x.shape[0] // 2
    x = x[:h] + x[h:]
  return x[0]


def global_norm(tree: Any) -> jax.Array:
  """``optax.tree.norm`` (``global_norm``) with the sum in a fixed tree: the same bits on every mesh.

  ``optax.tree.norm`` sums each leaf's squares with ``jnp.sum``; on a
  sharded leaf XLA adds per-device partial sums and then all-reduces them,
  in an order that follows the device count. Here each leaf's squares are
  summed by halving (``x[:h] + x[h:]`` down to one element: elementwise
  additions only) and the leaves' sums by :func:`tree_sum` in leaf order.
  Squares of ``bfloat16``/``float16`` leaves are summed in ``float32``.

  Args:
    tree: a pytree of floating arrays (the gradients).

  Returns:
    A scalar: the square root of the sum of all squares.

  Example:
    >>> float(global_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))
    5.0
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    raise UsageError("global_norm of a tree with no arrays")
  dt = jnp.result_type(*[jnp.promote_types(x.dtype, jnp.float32) for x in leaves])
  sums = [_fold_sum(jnp.ravel(jnp.square(x.astype(dt)))) if x.size
          else jnp.zeros((), dt) for x in leaves]
  return jnp.sqrt(tree_sum(jnp.stack(sums)))


def clip_by_global_norm(max_norm: float):
  """``optax.clip_by_global_norm`` with the norm of :func:`global_norm`.

  The same transformation (updates scaled by ``max_norm / norm`` when the
  norm exceeds ``max_norm``), whose norm has the same bits on every mesh,
  so a ``clip_by_global_norm`` + ``adamw`` chain keeps D1 over sharded
  (FSDP) gradients.

  Example:
    >>> import optax
    >>> tx = clip_by_global_norm(1.0)
    >>> u, _ = tx.update({"a": jnp.array([3.0, 4.0])}, tx.init(None))
    >>> [round(float(v), 2) for v in u["a"]]
    [0.6, 0.8]
  """
  import optax

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    trigger = norm < max_norm
    updates = jax.tree.map(
        lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
        updates)
    return updates, state

  return optax.GradientTransformation(init, update)


def worker_key(key: jax.Array, worker: int | jax.Array) -> jax.Array:
  """The PRNG key of one virtual worker: ``fold_in(key, worker)``.

  With ``key = fold_in(key(seed), step)`` this is a key from ``(seed, step,
  worker)`` only, the same on every mesh. :func:`value_and_grad` hands it to
  ``loss_fn`` for the arguments named by ``rng_argnums``.

  Args:
    key: a typed key (``jax.random.key``) or raw uint32 key data.
    worker: the virtual worker index.

  Returns:
    ``jax.random.fold_in(key, worker)``.

  Example:
    >>> k = jax.random.fold_in(jax.random.key(0), 5)   # seed 0, step 5
    >>> a, b = worker_key(k, 3), worker_key(k, 3)
    >>> bool((jax.random.key_data(a) == jax.random.key_data(b)).all())
    True
  """
  return jax.random.fold_in(key, worker)


def worker_keys(key: jax.Array, virtual_workers: int) -> jax.Array:
  """The keys of all virtual workers, ``worker_keys(k, V)[w] == worker_key(k, w)``.

  Example:
    >>> ks = worker_keys(jax.random.key(0), 4)
    >>> ks.shape
    (4,)
  """
  return jax.vmap(lambda w: jax.random.fold_in(key, w))(
      jnp.arange(virtual_workers, dtype=jnp.uint32))


def _check_batch(batch: Any, virtual_workers: int) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise UsageError("batch has no arrays")
  sizes = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    name = jax.tree_util.keystr(path) or "batch"
    if not shape:
      raise UsageError(f"batch leaf {name} is a scalar; every batch leaf needs"
                       " the global batch as its leading axis")
    sizes[name] = shape[0]
  global_batch = next(iter(sizes.values()))
  bad = {k: v for k, v in sizes.items() if v != global_batch}
  if bad:
    raise UsageError(f"batch leaves disagree on the global batch size: {sizes}")
  if global_batch == 0:
    raise UsageError(
        f"global batch 0 (leading axis of batch leaf {next(iter(sizes))}):"
        f" each of the virtual_workers={virtual_workers} needs a slice of at"
        " least one row")
  if global_batch % virtual_workers:
    raise UsageError(
        f"global batch {global_batch} (leading axis of batch leaf"
        f" {next(iter(sizes))}) is not divisible by virtual_workers="
        f"{virtual_workers}")
  return global_batch


@dataclasses.dataclass(frozen=True)
class _Groups:
  """Gradient leaves flattened into one buffer per dtype (loss appended)."""

  dtypes: tuple[Any, ...]
  # per leaf: (group index, offset, size, shape)
  slots: tuple[tuple[int, int, int, tuple[int, ...]], ...]
  loss_slot: tuple[int, int]
  lengths: tuple[int, ...]  # padded to a multiple of n
  chunks: tuple[int, ...]


def _groups(leaves: Sequence[Any], loss_dtype: Any, n: int) -> _Groups:
  dtypes: list[Any] = []
  sizes: list[int] = []
  slots = []
  for leaf in leaves:
    dt = jnp.dtype(leaf.dtype)
    if not jnp.issubdtype(dt, jnp.inexact):
      raise UsageError(f"params leaf of dtype {dt} has no gradient; only"
                       " floating params are supported")
    if dt not in dtypes:
      dtypes.append(dt)
      sizes.append(0)
    g = dtypes.index(dt)
    size = math.prod(leaf.shape)
    slots.append((g, sizes[g], size, tuple(leaf.shape)))
    sizes[g] += size
  dt = jnp.dtype(loss_dtype)
  if dt not in dtypes:
    dtypes.append(dt)
    sizes.append(0)
  g = dtypes.index(dt)
  loss_slot = (g, sizes[g])
  sizes[g] += 1
  lengths = tuple(-(-s // n) * n for s in sizes)
  return _Groups(tuple(dtypes), tuple(slots), loss_slot, lengths,
                 tuple(length // n for length in lengths))


def _flatten(groups: _Groups, leaves: Sequence[jax.Array],
             loss: jax.Array) -> list[jax.Array]:
  # Each leaf is written into a zero buffer at its offset (in-place dynamic
  # update slices: a copy each). A concatenate does the same but XLA:CPU's
  # elemental emitter (COMPILER_OPTIONS) selects the source operand per
  # element, about 4x slower on this machine.
  out = [jnp.zeros((length,), dt)
         for length, dt in zip(groups.lengths, groups.dtypes)]
  for (g, off, size, _), leaf in zip(groups.slots, leaves):
    if size:
      out[g] = lax.dynamic_update_slice(out[g], jnp.ravel(leaf), (off,))
  g, off = groups.loss_slot
  out[g] = lax.dynamic_update_slice(
      out[g], jnp.reshape(loss, (1,)).astype(groups.dtypes[g]), (off,))
  return out


def _unflatten(groups: _Groups, flats: Sequence[jax.Array], treedef) -> tuple:
  leaves = [lax.reshape(lax.dynamic_slice_in_dim(flats[g], off, size)
                        if size else flats[g][:0], shape)
            for g, off, size, shape in groups.slots]
  g, off = groups.loss_slot
  loss = flats[g][off]
  return loss, jax.tree_util.tree_unflatten(treedef, leaves)


# Forces the per-worker exchange (the only path before issue 23, now the one
# for k = V/n not a power of two); benchmarks/bench_determinism.py sets it to
# time the old path beside the new one in the same run.
_EXCHANGE_EVERY_WORKER = False

# Levels at the top of each device's subtree evaluated unrolled (a
# binary-counter stack of partial sums, no loop; up to 2**levels workers'
# programs in the step) above the nested scans. The bits are the same for
# every value (tests/test_determinism.py). None: 3 (H100, 100M params:
# 0.72-0.88x the nested scans' step time, the same memory; on CPU the
# unrolled workers wait for each other through their conditionals'
# predicates, ``_ORDER_BY_PREDICATE``, since XLA:CPU drops the optimisation
# barriers that order them on GPU: without that it ran them all before the
# first addition and held every worker's gradient at once), except on CPU
# for small gradients (``_UNROLL_MIN_BYTES``): 0 there. 16-bit floats take
# the same rule: with their additions aligned (``_ACCUMULATE_TRANSPOSED``)
# the unrolled stack took 0.68-0.90x the scans' CPU time in bfloat16 (25M
# and 100M params on 2 CPU devices, DP and FSDP, V/n = 2, 4, 8; float32
# 0.78-0.95x, 25M), the same temp memory and bits, its extra compile repaid
# within 5-14 steps (docs/determinism.md, fourteenth session). Before the
# alignment it took 1.09-1.42x, and 16-bit floats kept the scans on CPU.
# benchmarks/bench_determinism.py times both (``det_scan``, ``det_unroll``)
# and their compiles.
_UNROLL_LEVELS: int | None = None

# On CPU the top levels are unrolled only where one worker's gradient holds
# at least this many bytes. The unrolled stack compiles up to ``2**levels``
# copies of the worker's program where the nested scans compile one, and
# what it saves (the ``-0.0`` fills, the carries' copies) is proportional to
# the gradient's bytes: on small models the compile dominates (the lm1b
# SMALL bitwise test: 177 s unrolled against 59 s as scans on the 2-core
# VM, the same bits), on large ones the step. Measured on 2 CPU devices at
# V/n = 2, 4, 8 (fourteenth session, docs/determinism.md), the unrolled
# step's extra trace and compile against the CPU seconds it saves per
# step: 25M float32 (96 MiB) 0.1-2.4 s, repaid in 1-8 steps; 25M bfloat16
# (48 MiB) 0.6-4.9 s, 6-14 steps; 100M bfloat16 (192 MiB) 2-24 s, 5-10
# steps. One threshold for every dtype, in bytes (what the step saves
# grows with them). A resize compiles the new mesh's step, so compile time
# is a cost the job pays again.
_UNROLL_MIN_BYTES = 64 << 20

# How each virtual worker's ``value_and_grad`` is kept apart from what
# consumes its gradient (``_isolated_value_and_grad``): True, both branches
# of a ``lax.cond`` on a predicate XLA cannot know while compiling; False,
# optimisation barriers around it. None picks by platform: the conditional
# on CPU (XLA:CPU expands barriers before fusion, so they do not isolate
# there), barriers on GPU (a conditional reads its predicate on the host:
# one synchronisation per worker, 1.22-1.25x a 100M step on an H100).
# benchmarks/bench_determinism.py times both (``det_cond``,
# ``det_barrier``) and checks their bits (``--check-bits``).
_ISOLATE_BY_COND: bool | None = None

# Inside the caller's jit, whether every gradient is all-gathered (True) or
# the gradients of FSDP params (split over exactly the batch axes, known from
# ``param_shardings``) keep the reduce-scatter layout, the params' (False),
# each leaf's top of the tree then in a ``lax.cond`` branch of its own.
# Read when ``value_and_grad`` is called. None picks by platform: False on
# CPU (checked bitwise: tests/test_determinism.py), True on GPU, where a
# conditional reads its predicate on the host (one synchronisation per
# gradient leaf) and the sharded layout is not checked.
# benchmarks/bench_determinism.py sets True for ``det_gather``, the "before"
# of the same run.
_GATHER_INSIDE_JIT: bool | None = None


# Whether each unrolled leaf of the counter (``_UNROLL_LEVELS``) waits for
# the partial sums before it through its conditional's predicate (a data
# dependency XLA:CPU keeps, where it drops the optimisation barriers).
_ORDER_BY_PREDICATE = True


# Where the FSDP gradients keep the reduce-scatter layout inside the
# caller's jit (each leaf's top in a ``lax.cond`` branch) and the device's
# subtree is unrolled, whether the root of the subtree's addition runs in
# each leaf's top branch (True), chunk by chunk, where XLA fuses it with
# what reads the chunks (the permutes' sends and the own chunk's sum, or
# the all_to_all's slices), or before the branches (False: the sum written
# whole, then read again; the behaviour before). Same bits.
# benchmarks/bench_determinism.py times False as ``det_root_out``.
_ROOT_ADD_IN_TOP = True

# How the top of the tree exchanges the devices' subtree sums: True, by
# n - 1 collective permutes per leaf (device d sends chunk (d + s) % n at
# shift s, keeps its own chunk and adds the n chunks in device order, each
# device in a ``lax.switch`` branch of its own), False, by one all_to_all
# per leaf (the behaviour before). XLA:CPU gives an all_to_all each chunk
# as a buffer of its own, sliced out of the sum (one gradient-sized pass
# more than a reduce-scatter); the permutes slice only what they send and
# the addition reads the own chunk in place (25M on 2 CPU devices, CPU
# time over ``plain_acc``'s, V/n = 1: f32 FSDP 1.21x -> 1.11x, f32 DP
# 1.14x -> 1.00x, bf16 FSDP 0.69x -> 0.61x; bf16 DP was slower with them,
# 0.84x -> 0.96x, until its chunks were contiguous and moved as 16-bit
# ints at V/n = 1, ``_EXCHANGE_TRANSPOSED`` and ``_COLLECTIVES_AS_BITS``;
# docs/determinism.md). Same bits (the same n chunks, the same tree). Also
# with a ``pipeline_axis`` (since the fourteenth session: the own chunk is
# sliced outside the branches there, see ``top``). Not for 16-bit float
# gradients left replicated at V/n > 1 (bf16 DP keeps the all_to_all
# there). Read when ``value_and_grad`` is called;
# benchmarks/bench_determinism.py times False as ``det_a2a``.
_TOP_BY_PERMUTE = True


# Whether gathered 16-bit float gradients that the worker computes as a 2-D
# transpose (a matmul weight's) are exchanged as that transpose (split along their
# last dimension, contiguous in the column-major layout XLA:CPU gives them)
# and transposed back after the all-gather, once, as the plain step does
# (True), or split along their first dimension (False: the behaviour
# before). Same bits. Read when ``value_and_grad`` is called;
# benchmarks/bench_determinism.py times False as ``det_untransposed``.
_EXCHANGE_TRANSPOSED = True

# Whether, at V/n > 1, the 16-bit float gradients that the worker computes
# as a 2-D transpose (a matmul weight's, ``_transposed_outputs``) are
# summed on the device as that transpose (True) or as themselves (False:
# the behaviour before). XLA:CPU writes such a gradient column-major (the
# worker's bfloat16 conversion of the dot's float32 output) while the
# subtree's partial sums (scan carries, the counter's stack) are row-major,
# so every addition of a worker's gradient was a transposing pass through
# the elemental emitter (strided reads). Summed transposed, the worker's
# output is a row-major array of the transposed shape (a bitcast) and every
# addition reads both operands in order; the sum is transposed back once:
# a gathered leaf is exchanged as the transpose and transposed back after
# the all-gather (as ``_EXCHANGE_TRANSPOSED`` does at V/n = 1), an FSDP
# leaf's top branch copies it to row-major before slicing its chunks.
# Each element gets the same additions in the same order: same bits.
# float32 is left as is (its dot writes the gradient row-major). Read when
# ``value_and_grad`` is called; benchmarks/bench_determinism.py times False
# as ``det_s12``.
_ACCUMULATE_TRANSPOSED = True

# Whether 16-bit float arrays cross the collectives (the exchange, the
# gathers of gradients and of FSDP params) as unsigned 16-bit ints of the
# same bits (True) or as themselves (False: the behaviour before, which
# XLA:CPU runs in float32, converting up and back). Read when
# ``value_and_grad`` is called.
_COLLECTIVES_AS_BITS = True


def _gather_inside_jit(mesh: Mesh) -> bool:
  if _GATHER_INSIDE_JIT is not None:
    return bool(_GATHER_INSIDE_JIT)
  return _is_gpu(mesh)


def _is_gpu(mesh: Mesh) -> bool:
  return mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")


def _unroll_levels(mesh: Mesh, params: Any = (), setting: int | None = None,
                   grad_bytes: int | None = None) -> int:
  """``setting`` (``_UNROLL_LEVELS`` as read when ``value_and_grad`` was
  called), else by platform and a worker's gradient bytes (``grad_bytes``;
  default: the params' own)."""
  if setting is not None:
    return int(setting)
  leaves = jax.tree_util.tree_leaves(params)
  if grad_bytes is None:
    grad_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                     for x in leaves)
  if (mesh.devices.flat[0].platform == "cpu"
      and grad_bytes < _UNROLL_MIN_BYTES):
    return 0
  return 3


def _isolate_by_cond(mesh: Mesh) -> bool:
  if _ISOLATE_BY_COND is not None:
    return bool(_ISOLATE_BY_COND)
  return not _is_gpu(mesh)


def _tree_list(xs: Sequence[jax.Array]) -> jax.Array:
  """:func:`tree_sum` of a list of same-shaped arrays."""

  def node(lo: int, hi: int) -> jax.Array:
    if hi - lo == 1:
      return xs[lo]
    mid = lo + (1 << ((hi - lo - 1).bit_length() - 1))
    return node(lo, mid) + node(mid, hi)

  return node(0, len(xs))


def _isolated_value_and_grad(loss_fn: Callable, params: Any, xs: Any,
                             wargs: Sequence[Any],
                             prepare: Callable[[Any], Any] | None = None,
                             pred: jax.Array | None = None,
                             by_cond: bool = True) -> tuple:
  """One virtual worker's ``value_and_grad``, compiled apart from its context.

  XLA:CPU expands optimisation barriers before fusion, so a worker's
  reductions (a bias gradient, a layer norm's) could fuse with whatever
  consumes the gradient (an all-to-all's reshape on one mesh, the tree's
  addition in a loop on another) and come out with other bits. Here the
  worker runs as both branches of a ``lax.cond`` whose predicate XLA cannot
  know while compiling (is the first element of the first float param NaN):
  a branch is its own computation, its parameters in and its root out, the
  same on every mesh and in every loop.

  ``prepare`` (the all-gather of FSDP param shards) runs inside the branch,
  so the gathered params are the branch's temporaries (their buffers are
  reused for the gradients) instead of operands live through the whole
  branch. A branch with collectives needs a predicate that is the same on
  every device: ``pred`` (else the NaN test of the local params).

  ``by_cond=False`` (GPU, ``_ISOLATE_BY_COND``): no conditional, the worker
  between optimisation barriers only (XLA:GPU keeps them through fusion; a
  conditional would read its predicate on the host).
  """
  floats = [x for x in jax.tree_util.tree_leaves(params)
            if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  vg = jax.value_and_grad(loss_fn)
  prep = prepare if prepare is not None else (lambda p: p)

  def left(ops):
    p, b, a = ops
    return vg(prep(p), b, *a)

  def right(ops):
    p, b, a = ops
    return vg(prep(p), b, *a)

  ops = lax.optimization_barrier((params, xs, tuple(wargs)))
  # The loss's own shape (``jax.value_and_grad`` would raise its TypeError
  # for a non-scalar first).
  loss_aval = jax.eval_shape(lambda o: loss_fn(prep(o[0]), o[1], *o[2]), ops)
  if loss_aval.shape != ():
    raise UsageError(f"loss_fn must return a scalar, got shape"
                     f" {loss_aval.shape}")
  if not by_cond:
    return lax.optimization_barrier(left(ops))
  if pred is None:
    if not floats:
      return lax.optimization_barrier(left(ops))
    pred = jnp.isnan(jnp.ravel(floats[0])[0])
  return lax.optimization_barrier(lax.cond(pred, left, right, ops))


def _batch_only_dim(sharding: Any, axes: tuple[str, ...]) -> int | None:
  """The dimension a ``NamedSharding`` splits over ``axes``, if it splits nothing else."""
  a = _sharded_dim(sharding, axes)
  if a is None:
    return None
  spec = tuple(sharding.spec)
  if any(entry not in (None, ()) for i, entry in enumerate(spec) if i != a):
    return None
  return a


def _sharded_dim(sharding: Any, axes: tuple[str, ...]) -> int | None:
  """The dimension a ``NamedSharding`` splits over exactly ``axes``, if any."""
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  for i, entry in enumerate(spec):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    if names == axes:
      return i
  return None


def _permute_batch(x: jax.Array, virtual_workers: int, n: int) -> jax.Array:
  # Rows of worker w = j * n + d go to device d, in the order of j.
  k = virtual_workers // n
  s = x.shape[0] // virtual_workers
  y = jnp.reshape(x, (k, n, s) + x.shape[1:])
  return jnp.reshape(jnp.swapaxes(y, 0, 1), x.shape)


class SingleElementShardWarning(UserWarning):
  """A parameter splits over the batch axes into one-element shards."""


def _warn_single_element_shards(params: Any, shardings: Sequence[Any],
                                axes: tuple[str, ...], mesh: Mesh) -> None:
  """Warns about params split over ``axes`` into one-element shards.

  Their gradients are pinned like any other's, but XLA's algebraic
  simplifier rewrites elementwise code on a one-element array (where a
  scalar's broadcast is a bitcast) otherwise than on a longer one: an optax
  adamw update of a ``(4,)`` leaf split over 4 devices gave other bits than
  on 1 device in 17 of 20 random trials (``x / (1 - b1**t) / (sqrt(v) +
  eps)`` kept as ``x / ((1 - b1**t) * (sqrt(v) + eps))`` there, as a
  multiplication by a reciprocal on the whole array).
  """
  n = math.prod(mesh.shape[a] for a in axes)
  if n < 2:
    return
  bad = []
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (kp, x), sh in zip(flat, shardings):
    shape = tuple(np.shape(x))
    if math.prod(shape) < 2 or _sharded_dim(sh, axes) is None:
      continue
    try:
      local = sh.shard_shape(shape)
    except (ValueError, TypeError):
      continue
    if math.prod(local) == 1:
      bad.append(f"params{jax.tree_util.keystr(kp)} {shape} -> shards"
                 f" {tuple(local)}")
  if bad:
    warnings.warn(
        f"{len(bad)} params split over {axes} ({n} devices) into one-element"
        " shards: " + ", ".join(bad) + ". Their gradients are pinned, but XLA"
        " compiles elementwise code on one-element arrays otherwise than on"
        " longer ones, so an optimizer update of them (optax adamw) can give"
        " other bits than on fewer devices; replicate them (P()) or keep"
        " their shards at 2+ elements", SingleElementShardWarning,
        stacklevel=4)


def value_and_grad(loss_fn: Callable[..., jax.Array], *, virtual_workers: int,
                   mesh: Mesh, batch_axis: str | Sequence[str] = "data",
                   rng_argnums: Sequence[int] = (),
                   pipeline_axis: str | None = None,
                   param_shardings: Any = None) -> Callable[..., tuple]:
  """``jax.value_and_grad`` of a global-batch mean, bitwise independent of the mesh.

  The global batch is split into ``virtual_workers`` equal slices;
  ``loss_fn(params, batch_slice, *args)`` returns the mean loss of one slice.
  The returned ``f(params, batch, *args)`` gives ``(loss, grads)``: the mean
  over the global batch and its gradient, with the same bits on every mesh
  whose ``batch_axis`` size divides ``virtual_workers``, whether ``params``
  are replicated (data parallel) or sharded over any axis (FSDP / ZeRO-3: the
  params are gathered for the workers' computation and the gradients come
  back with the params' shardings).

  Args:
    loss_fn: ``loss_fn(params, batch_slice, *args) -> scalar`` mean loss of
      one virtual worker's slice (``global_batch / virtual_workers`` rows).
    virtual_workers: ``V``, fixed for the life of the job; the batch axis
      size of every mesh used must divide it.
    mesh: the mesh ``f`` runs on.
    batch_axis: the mesh axis (or tuple of axes) the batch is split over.
      Other mesh axes replicate the workers' computation.
    rng_argnums: indices into ``args`` of PRNG keys; virtual worker ``w``
      receives ``fold_in(args[i], w)`` (:func:`worker_key`) instead of
      ``args[i]``, so dropout masks depend on ``(key, w)`` only.
    pipeline_axis: the mesh axis of a :func:`tenplex_jax.pipeline` that
      ``loss_fn`` runs (``"stage"``), or ``None``. The workers' ``shard_map``
      is manual over every other axis and leaves this one to the pipeline's
      own ``shard_map``, which then runs inside each virtual worker: the
      params stay split over stages, each stage computes its layers of the
      worker's slice. A worker's gradient has the same bits for every stage
      count (the pipeline applies the same layers to the same microbatches
      and adds their gradients in the same order), so the stage count may
      change too.
    param_shardings: the params' ``NamedSharding``s (a matching pytree),
      for ``f`` called inside the caller's ``jit``, where the params'
      shardings are not known while tracing (outside ``jit`` ``f`` reads
      them from the arrays). With them FSDP params enter the workers as
      shards and are gathered inside each worker (with one worker per
      device, inside its branch: the plain step's memory) instead of before
      the workers' ``shard_map``. On CPU the gradients of params split over
      exactly the batch axes then come out with the params' shardings (a
      reduce-scatter's layout, each leaf's top of the tree in a
      ``lax.cond`` branch of its own so that the update cannot fuse with
      it); the others, all of them on GPU and all of them with a
      ``pipeline_axis`` (whose stages' collectives nothing would order
      against those conditionals), come out gathered (see
      ``on_shards``). With a ``pipeline_axis``, the gathered gradients of
      params split over it along one dimension are exchanged on each
      stage's slice and come out split over the stages as the params are
      (without ``param_shardings`` inside ``jit``, every device's exchange
      produces every stacked gradient whole). A leaf's sharding must be the
      one it has in the step.

  Returns:
    ``f(params, batch, *args) -> (loss, grads)``, usable inside or outside
    ``jax.jit``. Every leaf of ``batch`` has the global batch as its leading
    axis, divisible by ``virtual_workers``.

  Raises:
    UsageError: ``virtual_workers`` is not a positive int, an axis is not in
      the mesh, the batch axis size does not divide ``virtual_workers``, or
      the batch is not divisible, or (outside ``jit``) an argument is placed
      on devices outside the mesh, named by its path (raised when ``f`` is
      called).

  Example:
    >>> import numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    >>> f = value_and_grad(lambda w, x: jnp.mean(x @ w), virtual_workers=4,
    ...                    mesh=mesh)
    >>> loss, g = f(jnp.ones((3,)), jnp.ones((8, 3)))
    >>> float(loss), g.tolist()
    (3.0, [1.0, 1.0, 1.0])
  """
  if (isinstance(virtual_workers, bool)
      or not isinstance(virtual_workers, (int, np.integer))
      or virtual_workers < 1):
    raise UsageError(f"virtual_workers must be a positive int, got"
                     f" {virtual_workers!r}")
  virtual_workers = int(virtual_workers)
  if virtual_workers >= 2**31:
    raise UsageError(f"virtual_workers must be < 2**31, got {virtual_workers}")
  axes = _axes(batch_axis)
  missing = [a for a in axes if a not in mesh.shape]
  if missing:
    raise UsageError(f"batch axis {missing} not in the mesh, whose axes are"
                     f" {dict(mesh.shape)}")
  if pipeline_axis is not None:
    if pipeline_axis not in mesh.shape:
      raise UsageError(f"pipeline_axis {pipeline_axis!r} not in the mesh, whose"
                       f" axes are {dict(mesh.shape)}")
    if pipeline_axis in axes:
      raise UsageError(f"pipeline_axis {pipeline_axis!r} is also a batch axis"
                       f" {axes}: the stages of a pipeline split the layers,"
                       " not the batch")
  manual = frozenset(a for a in mesh.axis_names if a != pipeline_axis)
  n = math.prod(mesh.shape[a] for a in axes)
  if virtual_workers % n:
    raise UsageError(
        f"the batch axis {axes} has {n} devices, which does not divide"
        f" virtual_workers={virtual_workers}: each device must run the same"
        f" whole number of virtual workers (use a mesh whose batch axis size"
        f" divides {virtual_workers})")
  k = virtual_workers // n
  rng_argnums = tuple(int(i) for i in rng_argnums)
  spec_axes = axes[0] if len(axes) == 1 else axes
  depth = max(1, virtual_workers.bit_length())

  def body(params, batch, *args):
    d = lax.axis_index(axes)
    local = jax.tree.map(
        lambda x: jnp.reshape(x, (k, x.shape[0] // k) + x.shape[1:]), batch)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    loss_aval = jax.eval_shape(
        lambda p, b, *a: loss_fn(p, b, *a), params,
        jax.tree.map(lambda x: x[0], local), *args)
    if loss_aval.shape != ():
      raise UsageError(f"loss_fn must return a scalar, got shape"
                       f" {loss_aval.shape}")
    groups = _groups(leaves, loss_aval.dtype, n)

    def worker(j, xs):
      w = (j * n + d).astype(jnp.uint32)
      wargs = list(args)
      for i in rng_argnums:
        wargs[i] = worker_key(args[i], w)
      loss, grads = _isolated_value_and_grad(loss_fn, params, xs, wargs,
                                             by_cond=by_cond)
      return _flatten(groups, jax.tree_util.tree_leaves(grads), loss)

    def push(stack, sp, chunk, w):
      stack = lax.dynamic_update_index_in_dim(stack, chunk, sp, 0)

      def merge(c):
        st, top = c
        s = lax.dynamic_index_in_dim(st, top - 1, 0, keepdims=False) + \
            lax.dynamic_index_in_dim(st, top, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(st, s, top - 1, 0), top - 1

      m = _tree_merges(w)
      stack, sp = lax.fori_loop(0, m, lambda _, c: merge(c), (stack, sp))
      return stack, sp + 1

    def step(carry, xs):
      j, wslice = xs
      stacks, sp = carry
      flats = worker(j, wslice)
      new_stacks = []
      sps = []
      for g, flat in enumerate(flats):
        parts = jnp.reshape(flat, (n, groups.chunks[g]))
        # Collectives run even for n == 1 so that every mesh compiles the same
        # program structure.
        parts = via_bits(lax.all_to_all, parts, axes, 0, 0, tiled=True)
        st, s = stacks[g], sp
        for i in range(n):
          st, s = push(st, s, parts[i], (j * n + i).astype(jnp.int32))
        new_stacks.append(st)
        sps.append(s)
      return (tuple(new_stacks), sps[0]), None

    stacks0 = tuple(jnp.zeros((depth, c), dt)
                    for c, dt in zip(groups.chunks, groups.dtypes))
    (stacks, _), _ = lax.scan(
        step, (stacks0, jnp.int32(0)),
        (jnp.arange(k, dtype=jnp.int32), local))
    flats = []
    for g, st in enumerate(stacks):
      total = _final_merges(st, virtual_workers) / jnp.asarray(
          virtual_workers, groups.dtypes[g])
      total = via_bits(lax.all_gather, total, axes, tiled=True)
      flats.append(total)
    return _unflatten(groups, flats, treedef)

  # A device's workers form one node of the fixed tree when they are
  # consecutive and their number k is a power of two (or the mesh has one
  # device): then each device sums its own workers locally (the subtree) and
  # one exchange per step sums the n subtrees (the top of the tree).
  aligned = (n == 1 or k & (k - 1) == 0) and not _EXCHANGE_EVERY_WORKER
  unroll_setting = _UNROLL_LEVELS
  by_cond = _isolate_by_cond(mesh)
  # Inside the caller's jit every gradient is gathered on GPU, and under a
  # pipeline_axis: nothing would order the FSDP leaves' conditionals, which
  # hold the exchange's collectives, against each other or against the
  # stages' collectives (on a (data, stage, tensor) = (2, 2, 2) mesh
  # ``hlo_order.region_pairs`` found them unordered against the
  # all-gathers: a deadlock XLA:CPU may run into, as the top's branches did
  # before the fourteenth session).
  gather_all = _gather_inside_jit(mesh) or pipeline_axis is not None
  root_add_in_top = _ROOT_ADD_IN_TOP
  exchange_transposed = _EXCHANGE_TRANSPOSED
  accumulate_transposed = _ACCUMULATE_TRANSPOSED
  as_bits = _COLLECTIVES_AS_BITS

  def via_bits(op, x, *args, **kwargs):
    # The collective ``op`` on ``x``, a 16-bit float moved as unsigned ints
    # of the same bits (``_COLLECTIVES_AS_BITS``) and viewed back after.
    if not as_bits:
      return op(x, *args, **kwargs)
    return _from_bits_view(op(_bits_view(x), *args, **kwargs), x.dtype)
  top_by_permute = _TOP_BY_PERMUTE

  def body_tree(dims, gather, shard_in, isolate, grad_bytes, staged, params,
                batch, *args):
    d = lax.axis_index(axes) if n > 1 else 0
    local = jax.tree.map(
        lambda x: jnp.reshape(x, (k, x.shape[0] // k) + x.shape[1:]), batch)
    # FSDP params arrive as their local shards (``shard_in``: the dimension
    # split over the batch axes, per leaf) and are all-gathered here: with
    # one worker per device inside its branch (the gathered params are the
    # branch's temporaries, their buffers reused for the gradients, as in a
    # plain step), with several once before the workers' loop.
    # The evaluation of the subtree (``_UNROLL_LEVELS``, read when
    # ``value_and_grad`` was called; by default from the params' dtypes and
    # a worker's gradient bytes, the whole params').
    unroll = _unroll_levels(mesh, params, unroll_setting, grad_bytes)
    prepare, pred = None, None
    if any(a is not None for a in shard_in):
      pleaves, ptree = jax.tree_util.tree_flatten(params)

      def gather_params(p):
        return jax.tree_util.tree_unflatten(ptree, [
            x if a is None else via_bits(lax.all_gather, x, axes, axis=a, tiled=True)
            for x, a in zip(jax.tree_util.tree_leaves(p), shard_in)])

      if k == 1:
        prepare = gather_params
        if by_cond:
          # The branch holds collectives: every device must take the same
          # one.
          first = next(x for x in pleaves
                       if jnp.issubdtype(x.dtype, jnp.inexact) and x.size)
          pred = lax.psum(jnp.isnan(jnp.ravel(first)[0]).astype(jnp.int32),
                          axes) > 0
      else:
        params = gather_params(params)

    def worker(j, xb, after=None):
      w = (d * k + j).astype(jnp.uint32) if n > 1 else jnp.asarray(
          j, jnp.uint32)
      xs = jax.tree.map(
          lambda x: lax.dynamic_index_in_dim(x, j, 0, keepdims=False), xb)
      wargs = list(args)
      for i in rng_argnums:
        wargs[i] = worker_key(args[i], w)
      p = pred
      if after is not None and _ORDER_BY_PREDICATE and by_cond:
        # The worker's conditional waits for ``after`` (the partial sums
        # computed so far): its predicate also tests their first elements
        # for NaN. Both branches are the same code, so the value is that of
        # the worker alone; the data dependency is what orders the
        # unrolled workers on XLA:CPU, which drops optimisation barriers.
        if p is not None:
          raise AssertionError("ordered workers with collectives inside")
        firsts = [jnp.ravel(a)[0] for a in jax.tree_util.tree_leaves(after)
                  if a.size]
        p = jnp.isnan(jnp.ravel(next(
            x for x in jax.tree_util.tree_leaves(params)
            if jnp.issubdtype(x.dtype, jnp.inexact) and x.size))[0])
        for a in firsts:
          p = p | jnp.isnan(a)
      return _isolated_value_and_grad(loss_fn, params, xs, wargs,
                                      prepare=prepare, pred=p,
                                      by_cond=by_cond)

    worker_jaxpr, avals = jax.make_jaxpr(
        lambda j: worker(j, local), return_shape=True)(jnp.int32(0))
    # The gradients the worker computes as a 2-D transpose (a matmul
    # weight's; column-major on XLA:CPU when 16-bit); with
    # ``_ACCUMULATE_TRANSPOSED`` the 16-bit ones are summed as that
    # transpose at V/n > 1 (``summed_t``): the worker hands its gradient's
    # transpose (a bitcast of the column-major buffer) to the subtree's
    # additions, and the sum is transposed back before the top (``flip``;
    # a gathered leaf whose last dimension n divides is then exchanged as
    # the transpose, ``trans`` below, the two transposes cancelling).
    transposed = _transposed_outputs(worker_jaxpr)[1:]
    grad_avals, grad_tree = jax.tree_util.tree_flatten(avals[1])
    summed_t = [accumulate_transposed and n > 1 and k > 1
                and t and x.ndim == 2 and _is_16bit_float(x.dtype)
                for x, t in zip(grad_avals, transposed)]

    def flip(g):
      # The leaves of ``summed_t`` transposed: the worker's gradient to the
      # layout it is summed in, and the sum back (its own inverse).
      return jax.tree_util.tree_unflatten(grad_tree, [
          x.T if t else x
          for x, t in zip(jax.tree_util.tree_leaves(g), summed_t)])

    if any(summed_t):
      worker_as_is = worker

      def worker(j, xb, after=None):
        loss, g = worker_as_is(j, xb, after)
        return loss, flip(g)

      avals = (avals[0], jax.tree_util.tree_unflatten(grad_tree, [
          jax.ShapeDtypeStruct(x.shape[::-1], x.dtype) if t else x
          for x, t in zip(grad_avals, summed_t)]))

    def perfect(level, j0, xb, after=None):
      # The perfect subtree over workers j0 .. j0 + 2**level - 1: a scan over
      # its two halves, each added to a carry that starts at -0.0 (x + -0.0
      # is x, bit for bit, also for x = +-0), so the carry ends as
      # left + right: one IEEE addition per node, left operand first.
      # ``after``: partial sums its first worker waits for (``counter``).
      if level == 0:
        return worker(j0, xb, after)
      half = 1 << (level - 1)

      def half_step(acc, i):
        sub = perfect(level - 1, j0 + i * half, xb, after)
        return jax.tree.map(jnp.add, acc, sub), None

      init = jax.tree.map(lambda a: jnp.full(a.shape, -0.0, a.dtype), avals)
      acc, _ = lax.scan(half_step, init, jnp.arange(2, dtype=jnp.int32))
      return acc

    def counter(leaf_levels, defer_last=False):
      # The top levels of the tree unrolled: leaves (perfect subtrees of
      # the given levels, level 0 a single worker) in worker order, each
      # pushed onto a binary-counter stack of partial sums that merges its
      # two top entries while they have the same level. A merge is the
      # node's one IEEE addition, left operand first, as in ``perfect``,
      # without its -0.0 fill and loop-carry copies. The stack enters an
      # optimisation barrier with the batch the next leaf reads, and the
      # next leaf's first worker's predicate reads the stack's top (XLA:CPU
      # drops barriers but keeps data dependencies), so the leaves run one
      # after the other (at most one partial sum per level is live), and
      # every node's sum leaves a barrier, so it is rounded to its dtype on
      # its own (never fused with the next node's addition).
      # ``defer_last``: the last merge (the root's addition) is not done;
      # the root's two children come back as ``[(left, right)]``.
      stack: list = []
      j0 = 0
      for i, level in enumerate(leaf_levels):
        xb = local
        if stack:
          xb, held = lax.optimization_barrier(
              (local, [v for _, v in stack]))
          stack = [(lv, v) for (lv, _), v in zip(stack, held)]
        after = stack[-1][1] if stack else None
        stack.append((level, perfect(level, jnp.int32(j0), xb, after)))
        j0 += 1 << level
        while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
          (lv, left), (_, right) = stack[-2], stack[-1]
          if defer_last and len(stack) == 2 and i == len(leaf_levels) - 1:
            return [(left, right)]
          stack[-2:] = [(lv + 1, lax.optimization_barrier(
              jax.tree.map(jnp.add, left, right)))]
      return [v for _, v in stack]

    def leaves_of(level):
      # A perfect subtree of ``level`` as the counter's leaves: its top
      # ``unroll`` levels unrolled, the rest nested scans.
      u = min(level, unroll)
      return [level - u] * (1 << u)

    # The root's two children, when its addition is left to the top
    # (``_ROOT_ADD_IN_TOP``, below), else None.
    root = None
    if n > 1:
      if unroll and isolate and root_add_in_top and k > 1:
        [root] = counter(leaves_of(k.bit_length() - 1), defer_last=True)
        loss = root[0][0] + root[1][0]
        grads = root[0][1]
      elif unroll:
        [(loss, grads)] = counter(leaves_of(k.bit_length() - 1))
      else:
        loss, grads = perfect(k.bit_length() - 1, jnp.int32(0), local)
    else:
      # One device: the whole tree, its left subtrees perfect (the binary
      # representation of V), added from right to left.
      bits = [b for b in range(virtual_workers.bit_length() - 1, -1, -1)
              if virtual_workers >> b & 1]
      if unroll:
        # The largest part unrolled, each smaller part one nested scan:
        # at most 2**unroll + log2(V) workers' programs in the step.
        parts = counter(leaves_of(bits[0]) + bits[1:])
      else:
        parts, off = [], 0
        for b in bits:
          parts.append(perfect(b, jnp.int32(off), local))
          off += 1 << b
      loss, grads = parts[-1]
      for part in parts[-2::-1]:
        loss, grads = jax.tree.map(jnp.add, part, (loss, grads))

    def top(xs, a, d=d):
      # The top of the tree over the n devices' subtrees, one chunk each:
      # device d receives chunk d of every device's subtree sum and adds
      # the n chunks by the tree. ``xs``: the subtree sum, or the root's
      # two children (``_ROOT_ADD_IN_TOP``), added here chunk by chunk (each
      # element's one IEEE addition, left operand first), so that XLA fuses
      # the addition with what reads the chunks and the sum is never
      # written whole.
      def prep(x, a):
        if x.ndim == 0 or a is None:
          size = x.size
          x = jnp.reshape(x, (-1,))
          if size % n:
            x = jnp.pad(x, (0, n - size % n))
          a = 0
        shape = x.shape
        return jnp.reshape(
            x, shape[:a] + (n, shape[a] // n) + shape[a + 1:]), a

      xs, a = zip(*[prep(x, a) for x in xs])
      a = a[0]
      scale = jnp.asarray(virtual_workers, xs[0].dtype)

      def chunk(ys, i, dynamic=False):
        index = lax.dynamic_index_in_dim if dynamic else lax.index_in_dim
        parts = [index(y, i, a, keepdims=False) for y in ys]
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

      # 16-bit float gradients left replicated (DP) at V/n > 1 keep the
      # all_to_all (the permutes were slower there before the transposed
      # exchange, which applies at V/n = 1 only).
      narrow = _is_16bit_float(xs[0].dtype)
      if n > 1 and top_by_permute and (isolate or not narrow or k == 1):
        # Chunk (d + s) % n of this device's sum goes to that device, by
        # n - 1 collective permutes (shift s = 1 .. n - 1); device d keeps
        # its own chunk d. Device j's chunk arrives here by the shift
        # (d - j) % n: the branch of device d adds them in device order.
        recv = [via_bits(lax.ppermute, chunk(xs, (d + s) % n, dynamic=True),
                         axes, [(i, (i + s) % n) for i in range(n)])
                for s in range(1, n)]
        if pipeline_axis is not None:
          # The own chunk sliced here, not in the branch: the leaf may be
          # split over the pipeline axis, which is left to XLA's
          # partitioner, and the branch's static slice of it was then
          # resharded inside the branch (an all-reduce over the stages).
          # A conditional that holds collectives is ordered against the
          # collectives beside it by data only, and there was none: on the
          # (data, stage, tensor) = (2, 2, 2) mesh one half of ``data``
          # entered another leaf's permute while the other half waited in
          # an all-gather over ``data``, for ever (XLA:CPU aborts after
          # its 40 s rendezvous timeout; docs/determinism.md). The branches
          # now only add; the same chunks, the same additions.
          ops = (None, [chunk(xs, d, dynamic=True)] + recv)
        else:
          ops = (xs, recv)

        def total(ops, dd):
          ys, rs = ops
          if ys is not None:  # the own chunk read in place
            rs = [chunk(ys, dd)] + list(rs)
          return _tree_list([rs[(dd - j) % n] for j in range(n)]) / scale

        return lax.switch(d, [lambda ops, dd=dd: total(ops, dd)
                              for dd in range(n)], ops)
      x = xs[0] if len(xs) == 1 else xs[0] + xs[1]
      if n > 1:
        x = via_bits(lax.all_to_all, x, axes, a, a, tiled=True)
      chunks = [lax.index_in_dim(x, i, a, keepdims=False) for i in range(n)]
      return _tree_list(chunks) / scale

    grads = flip(grads)  # (the leaves summed transposed, back)
    if root is not None:
      root = tuple((lv, flip(gv)) for lv, gv in root)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    # Gathered leaves (their chunk layout is free) that the worker computes
    # as a transpose (a matmul weight's gradient; likely column-major on
    # XLA:CPU) are exchanged as that transpose, split along their last
    # dimension: contiguous chunks of the buffer as laid out, where splitting
    # the first dimension slices every chunk out by a strided (transposing)
    # pass. The gathered sum is transposed back once, as the plain step's
    # gradients are (``_EXCHANGE_TRANSPOSED``; the same bits either way).
    # (Not where the tops run in conditionals: ``isolate``, FSDP. Only for
    # 16-bit floats, whose branch converts the dot's float32 output and
    # writes it column-major, and only at V/n = 1, where the leaf is that
    # branch's output: float32 DP V/n = 1 took 2.79x the plain step with it
    # against 0.77x without, bf16 DP V/n = 2 2.70x against 2.08x, 25M on 2
    # CPU devices, same run; at V/n > 1 the leaves summed transposed,
    # ``summed_t``, whose transpose XLA cancels with the one here.)
    trans = [not isolate and g and n > 1 and x.ndim == 2 and sd is None
             and x.shape[1] % n == 0 and (st or (
                 exchange_transposed and t and _is_16bit_float(x.dtype)
                 and k == 1))
             for x, g, t, st, sd in zip(leaves, gather, transposed, summed_t,
                                        staged)]

    def staged_top(x, sd):
      # A gathered leaf split over the pipeline axis along ``sd`` (known
      # from the params' shardings): its top and its all-gather over the
      # batch axes run manual over the pipeline axis too, on the stage's
      # slice of the leaf, chunked along a dimension of that slice; the
      # leaf comes out split over the stages as the param is. Left to the
      # partitioner, every stage all-gathered the whole leaf over the
      # stages first (the chunks along its layers) and every device held
      # it whole after. Each element gets the same additions in the same
      # order: the same bits.
      spec = P(*([None] * sd), pipeline_axis)

      def local(y):
        la = next((i for i, s in enumerate(y.shape) if s % n == 0 and s),
                  None)
        o = top((y,), la, lax.axis_index(axes) if n > 1 else 0)
        o = via_bits(lax.all_gather, o, axes, axis=0 if la is None else la,
                     tiled=True)
        return o if la is not None else jnp.reshape(o[:y.size], y.shape)

      return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                           in_specs=spec, out_specs=spec,
                           axis_names={pipeline_axis}, check_vma=False)(x)

    if not isolate:
      out = [staged_top(x, sd) if sd is not None else
             top((x.T,), 0) if t else top((x,), a)
             for x, a, t, sd in zip(leaves, dims, trans, staged)]
    else:
      # FSDP gradients leaving in the reduce-scatter layout inside the
      # caller's jit: XLA would fuse the top's last addition and the
      # division by V into the optimizer update that consumes them (on one
      # mesh; on another, where the leaf is gathered or the state
      # replicated, the update reads an all-gather's result), and XLA:CPU
      # then contracts other multiply-adds into fused multiply-adds (the
      # ZeRO-3 adamw run of tests/test_determinism.py differed from the
      # static run's). Each leaf's top runs as both branches of a
      # ``lax.cond`` whose predicate XLA cannot know while compiling, so
      # the update reads a plain buffer, the branch's output, on every
      # mesh. The branch holds the all_to_all (the predicate is the same
      # on every device): its result is the branch's temporary and the
      # leaf's subtree sum is freed after its branch, so the tops need no
      # more memory than the gathered path (one cond for all leaves held
      # every leaf's exchanged chunks at once: 1.5x the gradient).
      first = next((x for x in leaves if x.size), leaves[0])
      pred = jnp.isnan(jnp.ravel(first)[0])
      if n > 1:
        pred = lax.psum(pred.astype(jnp.int32), axes) > 0
      if root is None:
        out = [lax.cond(pred, lambda y, a=a: top((y,), a),
                        lambda y, a=a: top((y,), a), x)
               for x, a in zip(leaves, dims)]
      else:
        # The root's addition runs in the branch, chunk by chunk, where
        # XLA fuses it with what reads the chunks (the permutes' sends, the
        # own chunk's sum): the sum is never written whole (one
        # gradient-sized pass less per leaf). It is the same one IEEE
        # addition, left operand first, of each element.
        out = [lax.cond(pred, lambda lr, a=a: top(lr, a),
                        lambda lr, a=a: top(lr, a), lr)
               for lr, a in zip(zip(jax.tree_util.tree_leaves(root[0][1]),
                                    jax.tree_util.tree_leaves(root[1][1])),
                                dims)]
    # Inside the caller's jit the update consumes the gradients; handing
    # it gathered arrays (an all-gather on every mesh, 1 device included)
    # keeps XLA from fusing it with mesh-dependent indexing (see on_shards).
    out = [via_bits(lax.all_gather, o, axes, axis=0 if a is None or t else a,
                    tiled=True) if g and sd is None else o
           for o, a, g, t, sd in zip(out, dims, gather, trans, staged)]
    out = [o.T if t else o if a is not None or not g or sd is not None else
           jnp.reshape(o[:x.size], x.shape)
           for o, x, a, g, t, sd in zip(out, leaves, dims, gather, trans,
                                        staged)]
    if n > 1:
      loss = _tree_list(list(lax.all_gather(loss, axes)))
    loss = loss / jnp.asarray(virtual_workers, loss.dtype)
    return loss, out

  def run(params, batch, *args, dims=None, shard_in=None, gather=None,
          staged=None):
    isolate = gather is not None and not all(gather)
    global_batch = _check_batch(batch, virtual_workers)
    del global_batch
    wrong = [i for i in rng_argnums if not -len(args) <= i < len(args)]
    if wrong:
      raise UsageError(
          f"rng_argnums={rng_argnums} names argument(s) {wrong}, but the call"
          f" passed {len(args)} argument(s) after params and batch")
    arg_specs = tuple(P() for _ in args)
    if not aligned:
      batch = jax.tree.map(
          lambda x: _permute_batch(jnp.asarray(x), virtual_workers, n), batch)
      smap = jax.shard_map(
          body, mesh=mesh,
          in_specs=(P(), P(spec_axes), *arg_specs),
          out_specs=(P(), P()), axis_names=manual, check_vma=False)
      return smap(params, batch, *args)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for x in leaves:
      dt = jnp.dtype(jnp.result_type(x))
      if not jnp.issubdtype(dt, jnp.inexact):
        raise UsageError(f"params leaf of dtype {dt} has no gradient; only"
                         " floating params are supported")
    if dims is None:
      dims = (None,) * len(leaves)
      gather = (True,) * len(leaves)
    elif gather is None:
      gather = (False,) * len(leaves)
    # Each leaf's sum comes out split over the batch axes along one of its
    # dimensions (a reduce-scatter's layout): the dimension the param is
    # sharded along when known, else the first one n divides, else the
    # flattened leaf, padded.
    dims = tuple(
        a if a is not None and x.shape[a] % n == 0 else
        next((i for i, s in enumerate(x.shape) if s % n == 0 and s), None)
        for x, a in zip(leaves, dims))
    out_specs = [P() if g else
                 P(*([None] * a), spec_axes) if a is not None else P(spec_axes)
                 for a, g in zip(dims, gather)]
    if shard_in is None or n == 1:
      shard_in = (None,) * len(leaves)
    # The dimension each gathered leaf is split along over the pipeline
    # axis (``staged_top``); not where the tops run in conditionals, nor
    # for the leaves that leave split over the batch axes.
    if staged is None or isolate:
      staged = (None,) * len(leaves)
    staged = tuple(sd if g else None for sd, g in zip(staged, gather))
    param_specs = jax.tree_util.tree_unflatten(treedef, [
        P() if a is None else P(*([None] * a), spec_axes) for a in shard_in])
    grad_bytes = sum(
        math.prod(x.shape) * jnp.dtype(jnp.result_type(x)).itemsize
        for x in leaves)
    smap = jax.shard_map(
        lambda p, b, *a: body_tree(dims, gather, shard_in, isolate,
                                   grad_bytes, staged, p, b, *a),
        mesh=mesh, in_specs=(param_specs, P(spec_axes), *arg_specs),
        out_specs=(P(), out_specs), axis_names=manual, check_vma=False)
    loss, out = smap(params, batch, *args)
    grads = [o if g or a is not None else
             jnp.reshape(o[:x.size], x.shape)
             for o, x, a, g in zip(out, leaves, dims, gather)]
    return loss, jax.tree_util.tree_unflatten(treedef, grads)

  cache: dict[Any, Callable] = {}
  mesh_devices = set(mesh.devices.flat)

  def _dims(shardings):
    if shardings is None:
      return None, None
    return (tuple(_sharded_dim(s, axes) for s in shardings[1]),
            tuple(_batch_only_dim(s, axes) for s in shardings[1]))

  def _staged(shardings):
    if shardings is None or pipeline_axis is None:
      return None
    return tuple(_sharded_dim(s, (pipeline_axis,)) for s in shardings[1])

  def compiled(shardings, params):
    fn = cache.get(shardings)
    if fn is None:
      _warn_single_element_shards(params, shardings[1], axes, mesh)
      out = None if shardings is None else (
          NamedSharding(mesh, P()), jax.tree_util.tree_unflatten(*shardings))
      dims, shard_in = _dims(shardings)
      staged = _staged(shardings)
      fn = jax.jit(lambda *a: run(*a, dims=dims, shard_in=shard_in,
                                  staged=staged),
                   out_shardings=out, compiler_options=_compiler_options())
      cache[shardings] = fn
    return fn

  def f(params, batch, *args):
    if any(isinstance(x, jax.core.Tracer)
           for x in jax.tree_util.tree_leaves((params, batch, args))):
      # Inside the caller's jit: trace inline; the caller's compile options
      # apply (compile the step with :func:`jit`).
      if param_shardings is None:
        return run(params, batch, *args)
      leaves, treedef = jax.tree_util.tree_flatten(params)
      specs = treedef.flatten_up_to(param_shardings)
      _warn_single_element_shards(params, specs, axes, mesh)
      dims, shard_in = _dims((treedef, tuple(specs)))
      # The gradients of params split over exactly the batch axes (FSDP)
      # keep the reduce-scatter layout, the params' (their sums computed in
      # a conditional's branch, see body_tree); the others are gathered
      # (all of them where ``gather_all``).
      gather = tuple(s is None or s != a or gather_all
                     for a, s in zip(dims, shard_in))
      return run(params, batch, *args, dims=dims, shard_in=shard_in,
                 gather=gather, staged=_staged((treedef, tuple(specs))))
    # Outside jit: grads get each param's sharding when it lives on this
    # mesh's devices; otherwise (e.g. an uncommitted array on one device)
    # they come back replicated over the mesh.
    leaves, treedef = jax.tree_util.tree_flatten(params)
    replicated = NamedSharding(mesh, P())
    shardings = (treedef, tuple(
        x.sharding if isinstance(x, jax.Array)
        and x.sharding.device_set == mesh_devices else replicated
        for x in leaves))
    try:
      return compiled(shardings, params)(params, batch, *args)
    except ValueError as e:
      off = _off_mesh(mesh_devices, params=params, batch=batch, args=args)
      if not off:
        raise
      raise UsageError(
          "arrays placed on devices outside the mesh (ids"
          f" {sorted(d.id for d in mesh_devices)}): " + "; ".join(off)
          + "; put them on the mesh first (tenplex_jax.reshard or"
          " jax.device_put)") from e

  return f


def _off_mesh(mesh_devices, **trees) -> list[str]:
  """``"<name><key path> is on devices [ids]"`` for each committed array in
  ``trees`` with a device outside ``mesh_devices`` (looked up only after
  jax refused a call, so no call pays for it)."""
  out = []
  for name, tree in trees.items():
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if (isinstance(x, jax.Array) and getattr(x, "committed", True)
          and not x.sharding.device_set <= mesh_devices):
        ids = sorted(d.id for d in x.sharding.device_set)
        out.append(f"{name}{jax.tree_util.keystr(kp)} is on devices {ids}")
  return out


def on_shards(tree: Any, shardings: Any) -> Any:
  """``tree`` laid out as ``shardings`` and materialised there, inside a jitted step.

  Use it on :func:`value_and_grad`'s gradients before the optimizer update:
  XLA otherwise fuses the gradients' resharding (slices, pads, collective
  permutes, which differ from mesh to mesh) into the update's elementwise
  fusions, and XLA:CPU then contracts other multiply-adds into fused
  multiply-adds (the update's bits change with the mesh). Here each leaf
  enters a ``shard_map`` with its sharding's spec and an
  ``optimization_barrier`` there hands the update plain local shards.

  Args:
    tree: a pytree of arrays (the gradients).
    shardings: a matching pytree of ``NamedSharding``s on one mesh (the
      params').

  Returns:
    ``tree``, same values and bits.

  Raises:
    UsageError: a sharding is not a ``NamedSharding`` or the meshes differ.

  Example:
    >>> import numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = NamedSharding(mesh, P())
    >>> float(jax.jit(lambda g: on_shards(g, s))(jnp.float32(2)))
    2.0
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  specs = treedef.flatten_up_to(shardings)
  meshes = {s.mesh for s in specs if isinstance(s, NamedSharding)}
  if len(meshes) != 1 or not all(isinstance(s, NamedSharding) for s in specs):
    raise UsageError(f"on_shards needs one NamedSharding per leaf, all on one"
                     f" mesh; got {sorted({type(s).__name__ for s in specs})}"
                     f" on {len(meshes)} meshes")
  parts = tuple(s.spec for s in specs)
  out = jax.shard_map(lambda *xs: lax.optimization_barrier(xs),
                      mesh=meshes.pop(), in_specs=parts, out_specs=parts,
                      check_vma=False)(*leaves)
  return jax.tree_util.tree_unflatten(treedef, list(out))


def unfused(fn: Callable, *args: Any) -> Any:
  """``fn(*args)`` compiled apart from the ops that produced ``args``.

  XLA fuses elementwise consumers (an optimizer update) with the slicing and
  resharding that produced their operands, and XLA:CPU's code for such a
  fusion, with its fused multiply-adds, depends on that indexing, which
  differs from mesh to mesh. Here ``fn`` runs as both branches of a
  ``lax.cond`` whose predicate (is the first element of the last float
  leaf NaN) XLA cannot know while compiling, so its fusions read plain local
  arrays (the branch's parameters) on every mesh; either branch computes
  ``fn(*args)``.

  Example:
    >>> float(jax.jit(lambda x: unfused(lambda y: y * 2, x))(3.0))
    6.0
  """
  leaves = [x for x in jax.tree_util.tree_leaves(args)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and jnp.size(x)]
  if not leaves:
    return fn(*args)
  # A branch whose predicate XLA cannot know while compiling: both branches
  # are ``fn``, each compiled on its own parameters. The predicate reads the
  # last float leaf (the trainers': a gradient), so that its collective (one
  # element of a sharded leaf, broadcast) comes after whatever computed it: read
  # from a param instead, nothing ordered it against the workers' conditional
  # of collectives, which XLA:CPU may then run beside it (docs/pipeline.md).
  pred = jnp.isnan(jnp.ravel(leaves[-1])[0])
  return lax.cond(pred, lambda a: fn(*a), lambda a: fn(*a), args)


def jit(fun: Callable, **kwargs) -> Callable:
  """``jax.jit`` with the compiler options that keep :func:`value_and_grad` exact.

  Use it for the whole train step that calls :func:`value_and_grad`'s
  function, optimizer update included: a step compiled by plain ``jax.jit``
  gets XLA's default pipeline, in which a 1-device program and a
  multi-device program may simplify the same per-worker code differently,
  and XLA:CPU may compile an optax update on a sharded shard and on a whole
  array with different fused multiply-adds (see :data:`COMPILER_OPTIONS`),
  unless ``XLA_FLAGS`` holds ``--xla_disable_hlo_passes=spmd-cleanup
  --xla_cpu_use_fusion_emitters=false``.

  Args:
    fun: the function to compile.
    **kwargs: passed to ``jax.jit``; ``compiler_options`` are merged.

  Returns:
    The jitted function.

  Example:
    >>> step = jit(lambda x: x * 2)
    >>> int(step(3))
    6
  """
  options = _compiler_options()
  user = kwargs.pop("compiler_options", None) or {}
  if str(user.get("xla_backend_optimization_level")) == "0":
    raise ValueError(
        "determinism.jit: compiler_options sets xla_backend_optimization_level=0, "
        "at which XLA:CPU's programs for different device counts give different bits "
        "for the same per-worker code (D1 breaks); leave it out (the step compiles at "
        f"level {_OPT_LEVEL}, see COMPILER_OPTIONS)")
  options.update(user)
  return jax.jit(fun, compiler_options=options, **kwargs)


@dataclasses.dataclass(frozen=True)
class DeterminismReport:
  """What :func:`check_environment` found.

  Attributes:
    platform: the default backend (``cpu``, ``gpu``, ``tpu``).
    xla_flags: the ``XLA_FLAGS`` environment variable.
    matmul_precision: ``jax_default_matmul_precision`` (``None``: default).
    gpu_flags_set: each of :data:`GPU_DETERMINISM_FLAGS` and whether set.
    spmd_cleanup_disabled: whether ``XLA_FLAGS`` disables ``spmd-cleanup``
      (needed only for steps not compiled by :func:`jit`).
    cpu_fusion_emitters_disabled: whether ``XLA_FLAGS`` holds
      ``--xla_cpu_use_fusion_emitters=false`` (likewise only needed for steps
      not compiled by :func:`jit`).
    problems: human-readable findings; empty when nothing is known to break
      determinism.
  """

  platform: str
  xla_flags: str
  matmul_precision: str | None
  gpu_flags_set: dict[str, bool]
  spmd_cleanup_disabled: bool
  problems: tuple[str, ...]
  cpu_fusion_emitters_disabled: bool = False

  @property
  def ok(self) -> bool:
    return not self.problems


def _flag_value(tokens: Sequence[str], name: str) -> str | None:
  """The last value of ``--name=value`` (or ``--name``: ``"true"``)."""
  value = None
  for t in tokens:
    if t == f"--{name}":
      value = "true"
    elif t.startswith(f"--{name}="):
      value = t.split("=", 1)[1].lower()
  return value


def check_environment(xla_flags: str | None = None,
                      platform: str | None = None) -> DeterminismReport:
  """Reports the settings that D0/D1 depend on.

  On GPU, XLA picks atomics-based (run-to-run varying) kernels for scatter
  and some reductions unless ``--xla_gpu_deterministic_ops=true`` (and
  ``--xla_gpu_exclude_nondeterministic_ops=true``) are in ``XLA_FLAGS``;
  autotuning can also pick other kernels on other runs. Fast math
  (``--xla_cpu_enable_fast_math=true``) lets LLVM reassociate and
  approximate, differently for different shapes, and is reported as a
  problem; so is XLA's backend optimisation level 0
  (``--xla_backend_optimization_level=0``, or ``JAX_DISABLE_MOST_OPTIMIZATIONS``
  when ``xla_flags`` is not given), which only :func:`jit`'s steps escape; so
  is a ``jax_default_matmul_precision`` other than the
  default, which must at least be the same on every run of the job (it is
  reported so that the caller can log it).

  Args:
    xla_flags: the flags to check (default: the ``XLA_FLAGS`` variable).
    platform: the platform to check for (default: ``jax.default_backend()``).

  Returns:
    A :class:`DeterminismReport`.

  Example:
    >>> r = check_environment(xla_flags="", platform="gpu")
    >>> r.ok, r.gpu_flags_set["--xla_gpu_deterministic_ops=true"]
    (False, False)
  """
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  platform = jax.default_backend() if platform is None else platform
  tokens = flags.split()
  set_flags = {f: _flag_value(tokens, f[2:].split("=")[0]) == "true"
               for f in GPU_DETERMINISM_FLAGS}
  precision = jax.config.jax_default_matmul_precision
  problems = []
  if platform in ("gpu", "cuda", "rocm"):
    for flag, ok in set_flags.items():
      if not ok:
        problems.append(f"XLA_FLAGS lacks {flag}: GPU kernels may differ from"
                        " run to run (D0 breaks)")
  if _flag_value(tokens, "xla_cpu_enable_fast_math") == "true":
    problems.append("XLA_FLAGS sets --xla_cpu_enable_fast_math=true: LLVM may"
                    " reassociate and approximate differently for other shard"
                    " shapes (D1 breaks)")
  if _flag_value(tokens, "xla_backend_optimization_level") == "0" or (
      xla_flags is None and jax.config.values.get("jax_disable_most_optimizations")):
    problems.append("XLA's backend optimisation level is 0 (XLA_FLAGS or"
                    " JAX_DISABLE_MOST_OPTIMIZATIONS): steps not compiled by"
                    f" determinism.jit, which compiles at level {_OPT_LEVEL}, give other"
                    " bits on other device counts (D1 breaks)")
  if precision is not None:
    problems.append(f"jax_default_matmul_precision is {precision!r}: keep it"
                    " the same on every run and every resize of the job")
  disabled = [t.split("=", 1)[1].split(",") for t in tokens
              if t.startswith("--xla_disable_hlo_passes=")]
  cleanup_off = any("spmd-cleanup" in d for d in disabled)
  emitters_off = _flag_value(tokens, "xla_cpu_use_fusion_emitters") == "false"
  return DeterminismReport(platform, flags,
                           None if precision is None else str(precision),
                           set_flags, cleanup_off, tuple(problems),
                           emitters_off)


def partial_gradient_bytes(params: Any, *, virtual_workers: int, devices: int
                           ) -> dict[str, int]:
  """Per-device bytes of the buffers :func:`value_and_grad` holds (upper bounds).

  Args:
    params: a pytree of arrays or ``jax.ShapeDtypeStruct``s.
    virtual_workers: ``V``.
    devices: ``n``, the batch axis size.

  Returns:
    A dict: ``gathered_params`` (the full params each device holds while its
    workers run), ``worker_grads`` (one worker's full gradient), ``stack``
    (the partial sums: when ``V/n`` is a power of two or ``n = 1``, one
    full gradient per level of the device's subtree, ``log2(V/n)`` of them;
    otherwise, the per-worker exchange, the flat copy of a worker's gradient
    plus ``bit_length(V)`` chunks of ``1/n`` of it), ``exchange`` (the
    chunks sent and received: one full gradient, at most; the subtree path
    exchanges leaf by leaf), ``result`` (the summed gradient: ``1/n`` of it
    per device, gathered where the params are replicated) and ``total``.

  Example:
    >>> partial_gradient_bytes({"w": jax.ShapeDtypeStruct((1024,), jnp.float32)},
    ...                        virtual_workers=8, devices=2)["stack"]
    8192
  """
  leaves = jax.tree_util.tree_leaves(params)
  full = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
  k = int(virtual_workers) // int(devices)
  if devices == 1 or k & (k - 1) == 0:
    levels = (int(virtual_workers).bit_length() - 1 if devices == 1
              else k.bit_length() - 1)
    stack = levels * full
  else:
    by_dtype: dict[Any, int] = {}
    for x in leaves:
      dt = jnp.dtype(x.dtype)
      by_dtype[dt] = by_dtype.get(dt, 0) + math.prod(x.shape)
    flat = sum(-(-(size + 1) // devices) * devices * dt.itemsize
               for dt, size in by_dtype.items())
    stack = flat + max(1, int(virtual_workers).bit_length()) * flat // devices
  out = {"gathered_params": full, "worker_grads": full, "stack": stack,
         "exchange": full, "result": full}
  out["total"] = sum(out.values())
  return out
