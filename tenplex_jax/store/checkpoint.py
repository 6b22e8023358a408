"""The persistent fallback: Orbax checkpoints (``StandardCheckpointer``).

Used only when no store copy of some piece survives. PRNG keys are saved as
their key data (with the implementation name) since Orbax stores plain
arrays; non-array leaves go through Orbax's own handling.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax

__all__ = ["latest_step", "restore_checkpoint", "save_checkpoint"]


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def _unkey(tree):
  return jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if isinstance(x, jax.Array)
      and _is_key(x) else x, tree)


def save_checkpoint(directory: str, tree: Any, step: int) -> str:
  """Saves ``tree`` as ``directory/step_<step>`` with Orbax; call in every
  process. Returns the checkpoint path.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(d, {"w": jnp.ones(3)}, 5)
    >>> latest_step(d)
    5
  """
  import orbax.checkpoint as ocp
  path = os.path.join(os.path.abspath(directory), f"step_{int(step):010d}")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, _unkey(tree))
  ckptr.wait_until_finished()
  ckptr.close()
  return path


def latest_step(directory: str) -> int | None:
  """The newest complete checkpoint step in ``directory``, or None."""
  if not os.path.isdir(directory):
    return None
  steps = [int(m.group(1)) for n in os.listdir(directory)
           if (m := re.fullmatch(r"step_(\d+)", n))]
  return max(steps) if steps else None


def restore_checkpoint(directory: str, target: Any) -> tuple[Any, int]:
  """Restores the newest checkpoint onto ``target`` (ShapeDtypeStructs with
  shardings); returns ``(tree, step)``."""
  import orbax.checkpoint as ocp
  from tenplex_jax.errors import NoCopyError
  step = latest_step(directory)
  if step is None:
    raise NoCopyError(f"no Orbax checkpoint in {directory} to fall back to")
  impls = {}

  def phys(path, x):
    if isinstance(x, jax.ShapeDtypeStruct) and _is_key(x):
      impls[path] = str(jax.random.key_impl(
          jax.random.key(0)))  # default impl name, refined below
      data = jax.eval_shape(lambda k: jax.random.key_data(k), x)
      from tenplex_jax.reshard import _key_data_sharding
      s = _key_data_sharding(x.sharding, x.ndim, data.ndim - x.ndim)
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=s)
    return x

  abstract = jax.tree_util.tree_map_with_path(phys, target)
  ckptr = ocp.StandardCheckpointer()
  out = ckptr.restore(os.path.join(os.path.abspath(directory),
                                   f"step_{step:010d}"), abstract)
  ckptr.close()

  def wrap(path, x, t):
    if isinstance(t, jax.ShapeDtypeStruct) and _is_key(t):
      return jax.random.wrap_key_data(x, impl=_impl_name(t.dtype))
    return x

  return jax.tree_util.tree_map_with_path(wrap, out, target), step


def _impl_name(dtype) -> str:
  # key<fry> -> threefry2x32 etc.: look the spec up through a probe key.
  return str(jax.random.key_impl(jax.random.key(0, impl=None)))\
      if "fry" in str(dtype) else str(dtype)[4:-1]
