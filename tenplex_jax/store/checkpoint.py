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
import numpy as np

__all__ = ["latest_step", "restore_checkpoint", "save_checkpoint"]


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key)


def _unkey(tree):
  # Orbax stores arrays and numbers; strings are left to the caller's target.
  return jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if isinstance(x, jax.Array)
      and _is_key(x) else (None if isinstance(x, str) or _empty(x) else x),
      tree)


def _empty(x) -> bool:
  # Orbax refuses zero-size arrays; they carry no data and are rebuilt.
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and x.size == 0


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

  def phys(path, x):
    if isinstance(x, jax.ShapeDtypeStruct) and _is_key(x):
      data = jax.eval_shape(lambda k: jax.random.key_data(k), x)
      from tenplex_jax.reshard import _key_data_sharding
      s = _key_data_sharding(x.sharding, x.ndim, data.ndim - x.ndim)
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=s)
    return x

  abstract = jax.tree_util.tree_map_with_path(
      lambda p, x: None if isinstance(x, str) or _empty(x) else phys(p, x),
      target)
  ckptr = ocp.StandardCheckpointer()
  out = ckptr.restore(os.path.join(os.path.abspath(directory),
                                   f"step_{step:010d}"), abstract)
  ckptr.close()

  got = jax.tree_util.tree_leaves(out, is_leaf=lambda x: x is None)
  want, treedef = jax.tree_util.tree_flatten(target)
  leaves = []
  for x, t in zip(got, want):
    if isinstance(t, str):
      leaves.append(t)
    elif _empty(t):
      leaves.append(jax.make_array_from_callback(
          t.shape, t.sharding, lambda idx, t=t: np.zeros(
              [0] * len(t.shape), t.dtype).reshape(
                  [len(range(*s.indices(n))) for s, n in zip(idx, t.shape)])))
    elif isinstance(t, jax.ShapeDtypeStruct) and _is_key(t):
      leaves.append(jax.random.wrap_key_data(x, impl=_impl_name(t.dtype)))
    elif isinstance(t, (int, float)) and not isinstance(t, bool):
      leaves.append(type(t)(x))
    else:
      leaves.append(x)
  return jax.tree_util.tree_unflatten(treedef, leaves), step


def _impl_name(dtype) -> str:
  """``key<fry>`` -> ``threefry2x32`` (the names jax's key dtypes carry)."""
  tag = str(dtype)[4:-1]
  for name in ("threefry2x32", "rbg", "unsafe_rbg"):
    if str(jax.random.key(0, impl=name).dtype)[4:-1] == tag:
      return name
  return tag
