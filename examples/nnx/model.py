"""A decoder-only language model in Flax nnx, sharded the way flax's guide does it.

Every parameter carries logical axis names in its ``out_sharding`` metadata
(``nnx.with_partitioning`` on the initialisers, ``kernel_metadata`` on the
attention): ``vocab``, ``embed``, ``heads``, ``head_dim``, ``mlp``. The decoder
blocks are built by ``nnx.vmap`` over a block constructor, which stacks their
parameters on a leading axis and names it ``layers`` (``transform_metadata={
nnx.PARTITION_NAME: "layers"}``). Logical axis rules (``nnx.logical_axis_rules``)
map the names to the mesh axes ``data``, ``fsdp``, ``tensor`` and ``stage``.

``LM.__call__(tokens, mesh=..., microbatches=M)`` runs the stacked blocks as a
GPipe pipeline over the mesh's ``stage`` axis (:func:`tenplex_jax.pipeline`):
the stack is split into its graph and its state with ``nnx.split`` and each
layer is ``nnx.merge(graphdef, layer_state)(x)``. Without a mesh the stack
runs layer after layer (``jax.lax.scan``); both compute the same function.

Example:
  >>> import jax, numpy as np
  >>> from flax import nnx
  >>> from jax.sharding import Mesh
  >>> cfg = Config(layers=4)
  >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 2, 2), AXES)
  >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
  ...   model = create_model(cfg, seed=0)
  >>> model.blocks.mlp_in.kernel.sharding.spec
  P('stage', 'fsdp', 'tensor')
  >>> tokens = np.zeros((4, cfg.seq_len), np.int32)
  >>> y = jax.jit(lambda m, t: m(t, mesh=mesh, microbatches=2))(model, tokens)
  >>> y.shape
  (4, 16, 64)
"""

from __future__ import annotations

import dataclasses

import flax.core.spmd as core_spmd
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import tenplex_jax as tj

# Logical names -> mesh axes (the configuration search's rules, with its
# 'pipeline' axis called 'stage').
RULES = (("batch", ("data", "fsdp")), ("layers", "stage"), ("embed", "fsdp"),
         ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
         ("head_dim", None), ("seq", None))
AXES = ("data", "fsdp", "stage", "tensor")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model sizes."""

  vocab: int = 64
  seq_len: int = 16
  embed: int = 32
  heads: int = 4
  mlp: int = 64
  layers: int = 8
  remat: bool = False


def _partitioned(names, init=nnx.initializers.normal(0.02)):
  return nnx.with_partitioning(init, names)


class Block(nnx.Module):
  """One pre-norm decoder block: causal self-attention and a GELU MLP."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.norm1 = nnx.RMSNorm(cfg.embed, scale_init=_partitioned(("embed",), nnx.initializers.ones),
                             rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        cfg.heads, cfg.embed, use_bias=False, decode=False, keep_rngs=False,
        kernel_init=nnx.initializers.normal(0.02),
        kernel_metadata={"out_sharding": ("embed", "heads", "head_dim")},
        out_kernel_metadata={"out_sharding": ("heads", "head_dim", "embed")}, rngs=rngs)
    self.norm2 = nnx.RMSNorm(cfg.embed, scale_init=_partitioned(("embed",), nnx.initializers.ones),
                             rngs=rngs)
    self.mlp_in = nnx.Linear(cfg.embed, cfg.mlp, kernel_init=_partitioned(("embed", "mlp")),
                             bias_init=_partitioned(("mlp",), nnx.initializers.zeros), rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp, cfg.embed, kernel_init=_partitioned(("mlp", "embed")),
                              bias_init=_partitioned(("embed",), nnx.initializers.zeros), rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(x[..., 0])
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class LM(nnx.Module):
  """Token ids ``(batch, seq)`` -> next-token logits ``(batch, seq, vocab)``."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.embed, embedding_init=_partitioned(("vocab", "embed")),
                           rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.seq_len, cfg.embed)),
                         out_sharding=("seq", "embed"))

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def blocks(r):
      return Block(cfg, rngs=r)

    self.blocks = blocks(rngs.split(cfg.layers))
    self.norm = nnx.RMSNorm(cfg.embed, scale_init=_partitioned(("embed",), nnx.initializers.ones),
                            rngs=rngs)

  def __call__(self, tokens, *, mesh: Mesh | None = None, microbatches: int = 1):
    """Logits; with ``mesh``, the blocks run as a pipeline over its ``stage`` axis."""
    x = self.embed(tokens) + self.pos[None, :tokens.shape[1]]
    graphdef, stack = nnx.split(self.blocks)

    def layer(state, h):
      return nnx.merge(graphdef, state)(h)

    if mesh is not None:
      x = tj.pipeline(layer, stack, x, mesh=mesh, microbatches=microbatches,
                      remat=self.cfg.remat)
      ctx = jax.sharding.get_abstract_mesh()
      if ctx.empty or not ctx.manual_axes:  # (not inside determinism's shard_map)
        # ``self.embed.attend`` with the weight tied to the pipeline's output: the
        # head's collectives (the weight's resharding, its gradient's all-reduce)
        # after the forward loop and before the backward one, by data (XLA:CPU does
        # not order them against a loop of collectives in a cached executable).
        x, emb = tj.tie(x, self.embed.embedding[...])
        query, emb = self.embed.promote_dtype((self.norm(x), emb), dtype=self.embed.dtype)
        return jnp.dot(query, emb.T)
    else:
      step = jax.checkpoint(layer) if self.cfg.remat else layer
      x = jax.lax.scan(lambda h, s: (step(s, h), None), x, stack)[0]
    return self.embed.attend(self.norm(x))


def create_model(cfg: Config, seed: int = 0) -> LM:
  """The model, initialised under ``jit`` and sharded by its partitioning
  metadata under the mesh and the rules in context (``jax.set_mesh``,
  ``nnx.logical_axis_rules``): the flax guide's sharded initialisation.
  The values depend only on ``seed``, not on the mesh."""
  rules = tuple(core_spmd.get_logical_axis_rules())
  # (Under a trace, e.g. nnx.eval_shape, the jit is nested: jax takes
  # compiler options on a top-level jit only.)
  traced = isinstance(jnp.zeros(()), jax.core.Tracer)
  if jax.default_backend() == "cpu" and not traced:
    return _init_model_cpu(cfg, seed, rules)
  return _init_model(cfg, seed, rules)


def _init_model_body(cfg, seed, rules):
  # The rules are an argument: jit's cache knows the mesh in context, not
  # flax's rules.
  with nnx.logical_axis_rules(rules):
    model = LM(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model)
    # nnx.vmap leaves the new 'layers' dimension unconstrained; constrain
    # every variable to the spec its names give under the rules.
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
  return model


_init_model = jax.jit(_init_model_body, static_argnums=(0, 1, 2))
# Initialisation runs once per job: on CPU it compiles at XLA's optimisation
# level 0 (tiny: 0.7-1.1 s of CPU against 2.1-4.6 s at the default level,
# 1 to 8 devices). Its values are the same on every mesh at either level,
# though not the same at both (tests/test_examples_nnx.py checks level 0's).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
_init_model_cpu = jax.jit(_init_model_body, static_argnums=(0, 1, 2),
                          compiler_options=INIT_COMPILER_OPTIONS)
