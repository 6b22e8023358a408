"""A decoder-only language model in Flax linen, MaxText-style.

Every parameter carries logical axis names (``nn.with_logical_partitioning``):
``vocab``, ``embed``, ``heads``, ``head_dim``, ``mlp``, and ``layers`` for the
decoder blocks, whose parameters are stacked on a leading ``layers`` axis.
Logical axis rules map the names to the mesh axes ``data``, ``fsdp``,
``tensor`` and ``stage``.

The stacked blocks run one of two ways:

* ``pipeline=True``: :func:`tenplex_jax.pipeline`, a GPipe schedule over
  ``microbatches`` with the ``layers`` axis split into stages over the mesh's
  ``stage`` axis (activations move between neighbouring stages);
* ``pipeline=False``: ``jax.lax.scan`` over the stack under ``jit``; if the
  ``layers`` axis is sharded over ``stage`` that is FSDP over layers (each
  step gathers every layer onto every device), the baseline the benchmark
  compares against.

Both compute the same function, so a run may switch between stage counts
(or between the two) and stay on the same loss curve.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import tenplex_jax as tj

# Logical names -> mesh axes; the same mapping the configuration search emits
# (with its 'pipeline' axis called 'stage' here).
RULES = (("batch", ("data", "fsdp")), ("layers", "stage"), ("embed", "fsdp"),
         ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
         ("head_dim", None), ("seq", None))
AXES = ("data", "fsdp", "stage", "tensor")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model sizes and how the layer stack runs."""

  vocab: int = 64
  seq_len: int = 16
  embed: int = 32
  heads: int = 4
  mlp: int = 64
  layers: int = 8
  remat: bool = False
  pipeline: bool = True
  microbatches: int = 4
  # The pipelined stack gathers its tensor-sharded weights once per step and
  # runs each stage's layers whole on every tensor position (pipeline's
  # gather_axes), instead of splitting them with an all-reduce per layer, tick
  # and direction: on CPU devices (gloo across processes) a collective costs
  # more than these small layers' compute. None (the default): on CPU devices
  # only; on GPUs and TPUs the tensor axis splits the layers' compute, as it
  # should there (gathering would repeat it on every tensor position).
  gather_tensor: bool | None = None


def _part(init, names):
  return nn.with_logical_partitioning(init, names)


class Block(nn.Module):
  """One pre-norm decoder block: causal self-attention and a GELU MLP."""

  cfg: Config

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    hd = c.embed // c.heads
    init = nn.initializers.normal(0.02)
    norm1 = self.param("norm1", _part(nn.initializers.ones, ("embed",)), (c.embed,))
    qkv = self.param("qkv", _part(init, ("embed", None, "heads", "head_dim")),
                     (c.embed, 3, c.heads, hd))
    out = self.param("out", _part(init, ("heads", "head_dim", "embed")), (c.heads, hd, c.embed))
    norm2 = self.param("norm2", _part(nn.initializers.ones, ("embed",)), (c.embed,))
    w1 = self.param("mlp_in", _part(init, ("embed", "mlp")), (c.embed, c.mlp))
    w2 = self.param("mlp_out", _part(init, ("mlp", "embed")), (c.mlp, c.embed))

    def rms(h, scale):
      return h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * scale

    h = rms(x, norm1)
    q, k, v = jnp.einsum("bse,ethd->tbshd", h, qkv)
    att = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(hd)
    s = x.shape[1]
    att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
    x = x + jnp.einsum("bhst,bthd,hde->bse", jax.nn.softmax(att, -1), v, out)
    return x + jax.nn.gelu(rms(x, norm2) @ w1) @ w2


def _stack_init(cfg: Config):
  """Initialiser of the stacked blocks: ``layers`` prepended to every name."""
  block = Block(cfg)

  def init(key):
    keys = jax.random.split(key, cfg.layers)
    dummy = jnp.zeros((1, cfg.seq_len, cfg.embed), jnp.float32)
    boxed = jax.vmap(lambda k: block.init(k, dummy)["params"])(keys)
    return jax.tree.map(
        lambda b: nn.LogicallyPartitioned(b.value, ("layers",) + tuple(b.names)),
        boxed, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))

  return init


class LM(nn.Module):
  """Token ids ``(batch, seq)`` -> next-token logits ``(batch, seq, vocab)``.

  Attributes:
    cfg: the sizes and the pipeline settings.
    mesh: the mesh the stack is pipelined over (needed with
      ``cfg.pipeline``; its ``stage`` axis gives the stage count).
  """

  cfg: Config
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    init = nn.initializers.normal(0.02)
    emb = self.param("embed", _part(init, ("vocab", "embed")), (c.vocab, c.embed))
    pos = self.param("pos", _part(init, ("seq", "embed")), (c.seq_len, c.embed))
    stack = self.param("layers", _stack_init(c))
    x = emb[tokens] + pos[None, :tokens.shape[1]]
    block = Block(c)

    def layer(p, h):
      return block.apply({"params": p}, h)

    if c.pipeline and self.mesh is not None and not self.is_initializing():
      # The params are replicated over ``data``: the pipeline sums their
      # gradient over it once instead of once per layer and tick, gathers them
      # over ``tensor`` once (``cfg.gather_tensor``), and skips the bubble
      # ticks' layers; not inside determinism's shard_map (manual over the
      # batch axes), whose bits must not depend on the stage count.
      ctx = jax.sharding.get_abstract_mesh()
      det = not ctx.empty and bool(ctx.manual_axes)
      batch_axes = ("data",) if self.mesh.shape["data"] > 1 and not det else ()
      on = (c.gather_tensor if c.gather_tensor is not None
            else self.mesh.devices.flat[0].platform == "cpu")
      gather = on and self.mesh.shape["tensor"] > 1 and not det
      x = tj.pipeline(layer, stack, x, mesh=self.mesh, microbatches=c.microbatches,
                      remat=c.remat, batch_axes=batch_axes, skip_bubbles=not det,
                      gather_axes=("tensor",) if gather else ())
      if not det:
        # The head's collectives (its weight's resharding, its gradient's all-reduce)
        # after the forward loop and before the backward one, by data: XLA:CPU does
        # not order them against a loop of collectives in a cached executable.
        x, emb = tj.tie(x, emb)
    else:
      step = jax.checkpoint(layer) if c.remat else layer
      x = jax.lax.scan(lambda h, p: (step(p, h), None), x, stack)[0]
    x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return x @ emb.T


def make_mesh(devices, **degrees: int) -> Mesh:
  """A mesh with axes ``AXES``; missing degrees are 1, devices taken in order."""
  unknown = set(degrees) - set(AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {AXES}")
  shape = [degrees.get(a, 1) for a in AXES]
  n = int(np.prod(shape))
  if n > len(devices):
    raise ValueError(f"degrees {degrees} need {n} devices, {len(devices)} available")
  return Mesh(np.array(list(devices)[:n]).reshape(shape), AXES)


def abstract_params(cfg: Config) -> Any:
  """Boxed abstract params (for the configuration search and shardings)."""
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  return jax.eval_shape(LM(cfg).init, jax.random.key(0), tokens)["params"]
