"""Pipeline parallelism over a stack of identical layers (GPipe).

``pipeline(stage_fn, stacked_params, x, mesh=..., microbatches=M)`` computes
what applying ``stage_fn(layer_params, x) -> x`` layer after layer over the
leading ``layers`` axis of ``stacked_params`` computes, but runs the stack as a
pipeline: the ``layers`` axis is split into ``S`` contiguous groups of
``L / S`` layers, one per position of the mesh's ``stage`` axis; the batch is
split into ``M`` microbatches; at tick ``t`` stage ``s`` applies its layers to
microbatch ``t - s`` and passes the result to stage ``s + 1`` with
``jax.lax.ppermute`` inside ``jax.shard_map``. ``M + S - 1`` ticks finish every
microbatch; ``S - 1`` of them are the pipeline bubble, a fraction
``(S - 1) / (M + S - 1)`` of the step.

Each stage only ever touches its own ``L / S`` layers: the compiled program
moves activations between neighbouring stages (``collective-permute``) and
never gathers the layer stack. The function is differentiable: ``jax.grad``
through it runs the backward pass as the reverse pipeline and gives the
gradients of the sequential model, sharded over ``stage`` like the params.

The shard_map is manual over the stage axis only; every other mesh axis stays
under the compiler, so ``x``'s batch may be sharded over ``data`` (and
``fsdp``), and the params' other dimensions over ``tensor``/``fsdp``: inside a
stage the usual ``jit`` partitioning applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from tenplex_jax.errors import LayoutError, UsageError
from tenplex_jax.layout import key_path_name

__all__ = ["pipeline", "bubble_fraction", "tie"]


def bubble_fraction(stages: int, microbatches: int) -> float:
  """The idle fraction of a GPipe step: ``(S - 1) / (M + S - 1)``.

  Example:
    >>> bubble_fraction(4, 8)
    0.2727272727272727
  """
  return (stages - 1) / (microbatches + stages - 1)


def _check(stage_fn, stacked_params, x, mesh: Mesh, stage_axis: str,
           microbatches: int) -> tuple[int, int, int]:
  """Validates the inputs; returns (layers, stages, batch)."""
  if not isinstance(mesh, Mesh):
    raise UsageError(f"pipeline: mesh must be a jax.sharding.Mesh, got"
                     f" {type(mesh).__name__}")
  if stage_axis not in mesh.axis_names:
    raise UsageError(f"pipeline: the mesh has no axis {stage_axis!r} (axes"
                     f" {dict(mesh.shape)}); pass stage_axis= one of"
                     f" {tuple(mesh.axis_names)} or add a stage axis (size 1"
                     " for no pipelining)")
  stages = mesh.shape[stage_axis]
  if not isinstance(microbatches, int) or microbatches < 1:
    raise UsageError(f"pipeline: microbatches must be a positive int, got"
                     f" {microbatches!r}")
  leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
  if not leaves:
    raise UsageError("pipeline: stacked_params has no arrays")
  bad = [key_path_name(p) or "<root>" for p, v in leaves if jnp.ndim(v) < 1]
  if bad:
    raise LayoutError(f"pipeline: params {bad} have no leading layers axis"
                      " (scalars); stack every leaf on a leading layers axis")
  layers = jnp.shape(leaves[0][1])[0]
  odd = [(key_path_name(p), jnp.shape(v)[0]) for p, v in leaves
         if jnp.shape(v)[0] != layers]
  if odd:
    raise LayoutError(f"pipeline: every param leaf must have the same leading"
                      f" layers axis; {key_path_name(leaves[0][0])!r} has"
                      f" {layers}, but {odd}")
  if layers % stages:
    raise LayoutError(f"pipeline: {layers} layers (leading axis of"
                      f" {key_path_name(leaves[0][0])!r}) cannot be split"
                      f" into {stages} stages (mesh axis {stage_axis!r} has"
                      f" size {stages}); layers must be a multiple of stages")
  xs = jax.tree_util.tree_leaves_with_path(x)
  if not xs:
    raise UsageError("pipeline: x has no arrays")
  batch = jnp.shape(xs[0][1])[0] if jnp.ndim(xs[0][1]) else None
  odd = [(key_path_name(p) or "x", jnp.shape(v)) for p, v in xs
         if not jnp.ndim(v) or jnp.shape(v)[0] != batch]
  if batch is None or odd:
    raise UsageError(f"pipeline: every leaf of x needs the same leading batch"
                     f" axis; got shapes {[(key_path_name(p) or 'x', jnp.shape(v)) for p, v in xs]}")
  if batch % microbatches:
    raise UsageError(f"pipeline: the batch ({batch}, leading axis of x) is"
                     f" not divisible by microbatches={microbatches}")
  one = jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v)[1:],
                                                    jnp.result_type(v)),
                     stacked_params)
  mb = jax.tree.map(lambda v: jax.ShapeDtypeStruct(
      (batch // microbatches,) + jnp.shape(v)[1:], jnp.result_type(v)), x)
  out = jax.eval_shape(stage_fn, one, mb)
  if jax.tree.structure(out) != jax.tree.structure(mb) or any(
      (a.shape, a.dtype) != (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(mb))):
    raise UsageError(
        "pipeline: stage_fn(layer_params, x) must return x's structure,"
        " shapes and dtypes (activations flow from layer to layer); for a"
        f" microbatch {jax.tree.map(lambda a: (a.shape, str(a.dtype)), mb)}"
        f" it returned {jax.tree.map(lambda a: (a.shape, str(a.dtype)), out)}")
  return layers, stages, batch


def _shard_map_mesh(mesh: Mesh, stage_axis: str):
  """``mesh``, or the enclosing ``shard_map``'s mesh when called inside one.

  Inside a ``shard_map`` that is manual over other axes of the same mesh (as
  :func:`tenplex_jax.determinism.value_and_grad` with ``pipeline_axis``),
  the pipeline's ``shard_map`` must name the context's abstract mesh, whose
  axis types record which axes are already manual.
  """
  ctx = jax.sharding.get_abstract_mesh()
  if ctx.empty or not ctx.manual_axes:
    return mesh
  if dict(ctx.shape) != dict(mesh.shape):
    raise UsageError(f"pipeline: called inside a shard_map over a mesh"
                     f" {dict(ctx.shape)}, not the pipeline's {dict(mesh.shape)}")
  if stage_axis in ctx.manual_axes:
    raise UsageError(f"pipeline: called inside a shard_map that is already"
                     f" manual over the stage axis {stage_axis!r}; leave it"
                     " automatic there (determinism.value_and_grad:"
                     f" pipeline_axis={stage_axis!r})")
  return ctx


def pipeline(stage_fn: Callable[[Any, Any], Any], stacked_params: Any, x: Any,
             *, mesh: Mesh, stage_axis: str = "stage", microbatches: int = 1,
             remat: bool = False, batch_axes: tuple[str, ...] = (),
             gather_axes: tuple[str, ...] = (),
             skip_bubbles: bool = False) -> Any:
  """Applies a stack of layers to ``x`` as a GPipe pipeline over ``stage_axis``.

  The result equals ``for l in range(L): x = stage_fn(params[l], x)`` (up to
  float reassociation inside ``stage_fn``), for any ``stage_fn`` that treats
  the rows of the batch independently (as every microbatched schedule
  requires).

  Args:
    stage_fn: ``stage_fn(layer_params, x) -> x``: one layer. ``layer_params``
      is one slice of ``stacked_params`` along its leading axis; ``x`` is a
      microbatch (an array, or a pytree of arrays with a leading batch axis)
      and the result must have its structure, shapes and dtypes. A Flax
      module works as ``lambda p, h: block.apply({"params": p}, h)``.
    stacked_params: a pytree whose every leaf has the same leading ``layers``
      axis ``L``; ``L`` must be a multiple of the stage count. Leaves may be
      sharded over ``stage_axis`` on that axis (they are resharded to it if
      not) and over other mesh axes on other dimensions.
    x: the input: an array (or pytree of arrays) whose leading axis is the
      batch ``B``; it may be sharded over non-stage mesh axes (``data``).
    mesh: the device mesh; it must have ``stage_axis``.
    stage_axis: the mesh axis whose positions are the pipeline stages.
    microbatches: ``M``, how many microbatches ``B`` is split into (``B % M
      == 0``). Microbatch ``m`` is the rows ``m, m + M, m + 2M, ...``, so a
      batch sharded over ``data`` stays sharded within every microbatch.
    remat: recompute each layer's activations in the backward pass
      (``jax.checkpoint`` per layer) instead of keeping them.
    batch_axes: mesh axes (besides ``stage_axis``) that ``x``'s batch is
      split over and that the params are replicated over (``("data",)``).
      The pipeline is then manual over them too: each position computes its
      params' gradient from its own rows through every tick and layer, and
      the gradient is summed over ``batch_axes`` once, when the backward
      pass leaves the pipeline. Left to the compiler (the default), the sum
      runs inside the loops, once per layer and tick: a collective each
      (measured across 2 processes with gloo: 20 of the LM trainer's step's
      119 collectives). The result is the same up to float reassociation of
      that sum.
    gather_axes: mesh axes (besides ``stage_axis`` and ``batch_axes``) that
      the params' other dimensions are sharded over (``("tensor",)``) and
      that the pipeline gathers them over once, as it starts: every position
      of those axes then runs its stage's layers whole, on the whole
      microbatch, so the layers' compute is repeated on each (their product)
      instead of split, and no collective over them runs inside the loops.
      Their gradient is computed whole on every position (no sum over
      them); it leaves the pipeline replicated over them unless laid out
      again, as an optimiser update with the sharded params does or
      ``jax.lax.with_sharding_constraint`` to the params' sharding (a local
      slice). Left to the compiler (the default), each layer splits its
      matmuls over them and sums the partial results twice per layer, tick
      and direction: in the LM trainer's
      ``data=2,tensor=2,stage=2`` step 64 of its 83 collectives, against 4
      gathers. Worth it where a collective costs more than the layers'
      compute it splits (CPU devices with gloo collectives, small layers);
      the params' and the optimiser's memory stays sharded, the gathered
      layers of one stage are held for the step. ``x`` is replicated over
      them too. With one stage (no ``shard_map``) it does not apply.
    skip_bubbles: run a stage's layers only on the ticks it has a
      microbatch (``lax.cond``), not on the ``S - 1`` bubble ticks whose
      results are discarded: their compute and their collectives (those
      over ``tensor``/``fsdp``/``data`` inside ``stage_fn``) are skipped.
      The gradients gain only exact zeros from the bubble ticks either way,
      but the compiled program differs, so the bits may too (measured on the
      LM: losses equal, params within 1.5e-5 after 3 Adam steps); off by
      default, so a program stays the same for any stage count where
      bitwise results matter (``tenplex_jax.determinism``).

  Returns:
    The output, like ``x`` (same structure, shapes, dtypes).

  Raises:
    UsageError: no ``stage_axis`` in the mesh, ``B`` not divisible by ``M``,
      ``stage_fn`` changes the activation's shape, or a ``batch_axes`` entry
      that is not another mesh axis or does not divide ``B / M``, or a
      ``gather_axes`` entry that is not another mesh axis (nor a batch axis).
    LayoutError: params without a common leading axis, or ``L`` not a
      multiple of the stage count.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "data"))
    >>> layer = lambda p, h: jnp.tanh(h @ p["w"])
    >>> params = {"w": jnp.stack([jnp.eye(3) * (l + 1) for l in range(4)])}
    >>> x = jnp.ones((8, 3)) * 0.1
    >>> y = pipeline(layer, params, x, mesh=mesh, microbatches=4)
    >>> want = x
    >>> for l in range(4):
    ...   want = layer({"w": params["w"][l]}, want)
    >>> bool(jnp.allclose(y, want))
    True
  """
  _, stages, batch = _check(stage_fn, stacked_params, x, mesh, stage_axis,
                            microbatches)
  batch_axes, gather_axes = tuple(batch_axes), tuple(gather_axes)
  bad = [a for a in batch_axes if a not in mesh.axis_names or a == stage_axis]
  if bad or len(set(batch_axes)) != len(batch_axes):
    raise UsageError(f"pipeline: batch_axes {batch_axes} must be distinct mesh axes"
                     f" other than the stage axis {stage_axis!r} (mesh {dict(mesh.shape)})")
  bad = [a for a in gather_axes
         if a not in mesh.axis_names or a == stage_axis or a in batch_axes]
  if bad or len(set(gather_axes)) != len(gather_axes):
    raise UsageError(f"pipeline: gather_axes {gather_axes} must be distinct mesh axes"
                     f" other than the stage axis {stage_axis!r} and the batch_axes"
                     f" {batch_axes} (mesh {dict(mesh.shape)})")
  split_over = math.prod(mesh.shape[a] for a in batch_axes)
  if (batch // microbatches) % split_over:
    raise UsageError(f"pipeline: a microbatch's {batch // microbatches} rows (batch {batch}"
                     f" / microbatches={microbatches}) cannot be split over batch_axes"
                     f" {batch_axes} of {split_over} positions")
  m_count = microbatches
  ticks = m_count + stages - 1
  layer = jax.checkpoint(stage_fn) if remat else stage_fn

  # (B, ...) -> (M, B/M, ...), microbatch m = rows m::M: the batch's sharding
  # (contiguous blocks over data) stays on the B/M axis.
  def split(v):
    v = v.reshape((batch // m_count, m_count) + v.shape[1:])
    return jnp.moveaxis(v, 1, 0)

  def join(v):
    return jnp.moveaxis(v, 0, 1).reshape((batch,) + v.shape[2:])

  xm = jax.tree.map(split, x)
  shift = [(i, i + 1) for i in range(stages - 1)]

  def per_stage(params, xm):
    if batch_axes:
      # Varying over the batch axes from the start: the params' gradient is
      # summed over them once, where the backward pass leaves the pipeline.
      params = jax.lax.pcast(params, batch_axes, to="varying")
    stage = jax.lax.axis_index(stage_axis)
    first, last = stage == 0, stage == stages - 1
    # Varying over stages from the start: the input's cotangent is summed over
    # stages once, not once per tick.
    xm = jax.lax.pcast(xm, (stage_axis,), to="varying")

    def run_layers(h):
      return jax.lax.scan(lambda h, p: (layer(p, h), None), h, params)[0]

    def pick(tree, i):
      return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(
          v, i, 0, keepdims=False), tree)

    def tick(carry, t):
      h, out = carry
      # Stage 0 reads microbatch t (bubble ticks re-read real data, so no
      # stage ever computes on uninitialised values); the others take what
      # their predecessor sent last tick.
      inp = jax.tree.map(lambda a, b: jnp.where(first, a, b),
                         pick(xm, t % m_count), h)
      if skip_bubbles:
        # A bubble tick (no microbatch at this stage: t - stage outside
        # [0, M)) skips its layers, their compute and their collectives (all
        # over axes within the stage, so every member of a group takes the
        # same branch): what it would compute is never kept.
        busy = (t - stage >= 0) & (t - stage < m_count)
        y = jax.lax.cond(busy, run_layers, lambda h: h, inp)
      else:
        y = run_layers(inp)
      m = t - (stages - 1)
      slot = jnp.clip(m, 0, m_count - 1)
      done = last & (m >= 0)
      out = jax.tree.map(
          lambda o, v: jax.lax.dynamic_update_index_in_dim(
              o, jnp.where(done, v, jax.lax.dynamic_index_in_dim(
                  o, slot, 0, keepdims=False)), slot, 0), out, y)
      if stages > 1:
        y = jax.lax.ppermute(y, stage_axis, shift)
      return (y, out), None

    h0 = pick(xm, 0)
    out0 = jax.tree.map(jnp.zeros_like, xm)
    (_, out), _ = jax.lax.scan(tick, (h0, out0), jnp.arange(ticks))
    # Only the last stage holds the outputs; the sum over stages hands them
    # to every stage (the result is replicated over stage_axis).
    out = jax.tree.map(lambda o: jnp.where(last, o, jnp.zeros_like(o)), out)
    return jax.lax.psum(out, stage_axis)

  if stages == 1:
    # One stage: no pipeline, just the microbatch loop (a size-1 manual axis
    # has nothing to communicate).
    def one_microbatch(_, xb):
      return None, jax.lax.scan(lambda h, p: (layer(p, h), None), xb,
                                stacked_params)[0]
    return jax.tree.map(join, jax.lax.scan(one_microbatch, None, xm)[1])

  param_specs = jax.tree.map(lambda _: PartitionSpec(stage_axis),
                             stacked_params)
  # Manual over gather_axes too, with params and x replicated over them (their
  # specs do not name them): gathered once on the way in, and every position
  # computes the same, so nothing over them is summed on the way out.
  rows = PartitionSpec(None, batch_axes) if batch_axes else PartitionSpec()
  x_specs = jax.tree.map(lambda _: rows, xm)
  out = jax.shard_map(per_stage, mesh=_shard_map_mesh(mesh, stage_axis),
                      in_specs=(param_specs, x_specs),
                      out_specs=x_specs,
                      axis_names={stage_axis, *batch_axes, *gather_axes})(
                          stacked_params, xm)
  return jax.tree.map(join, out)


def _zero_of(v: Any, dtype: Any) -> jax.Array:
  """A ``0`` of ``dtype`` that XLA computes from ``v``: ``isnan(sum(v))`` is 0
  or 1 and times ``0`` always ``0`` (XLA does not fold a float ``x * 0``)."""
  total = sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree_util.tree_leaves(v))
  return jnp.isnan(total).astype(dtype) * jnp.zeros((), dtype)


@jax.custom_vjp
def tie(x: Any, w: jax.Array) -> tuple[Any, jax.Array]:
  """``(x, w)`` unchanged, ``w`` waiting for ``x`` and ``x``'s gradient for ``w``'s.

  The values are the same bits (``w - 0`` is ``w``, ``-0.0`` included, and
  so are the gradients), but in the compiled program ``w`` and what is
  computed from it come after ``x`` (a data dependence: ``w`` minus a zero
  that XLA computes from ``x``), and in the backward pass ``x``'s gradient
  comes after ``w``'s. Between :func:`pipeline`'s output ``x`` and the next
  weight ``w`` (a tied embedding's head) this orders the collectives of the
  head (``w``'s resharding, its gradient's all-reduce over ``data``) after
  the forward pipeline's loop and before the backward one, on every device.

  jaxlib 0.10.2's XLA:CPU orders the collectives of one computation among
  themselves (their start, on one shared communicator resource), but not a
  loop that holds collectives against the collectives around it once the
  executable comes from jax's persistent compilation cache; devices that
  then run them in opposite orders wait for each other for ever over gloo
  (docs/pipeline.md, "Ordering collectives").

  Args:
    x: an array or pytree (the pipeline's output).
    w: an array (a weight used after ``x``).

  Returns:
    ``(x, w)``, the same values.

  Example:
    >>> x, w = tie(jnp.ones(3), jnp.arange(2.0))
    >>> w.tolist()
    [0.0, 1.0]
  """
  return x, w - _zero_of(x, w.dtype)


def _tie_fwd(x, w):
  return tie(x, w), None


def _tie_bwd(_, grads):
  gx, gw = grads
  zero = _zero_of(gw, jnp.float32)
  return jax.tree.map(lambda g: g if g.dtype == jax.dtypes.float0
                      else g - zero.astype(g.dtype), gx), gw


tie.defvjp(_tie_fwd, _tie_bwd)
