"""The persistent fallback: Orbax checkpoints.

Used only when no store copy of some piece survives; reads any Orbax
checkpoint through :mod:`tenplex_jax.orbax`. PRNG keys are saved as
their key data (with the implementation name) since Orbax stores plain
arrays; non-array leaves go through Orbax's own handling.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax

from tenplex_jax.cloud import upload_tree
from tenplex_jax.errors import NoCopyError, UsageError
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.orbax import locate
from tenplex_jax.orbax import restore as orbax_restore
from tenplex_jax.store import private

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

  ``directory`` (if made here) and ``step_<step>`` are made ``0700``, so
  other users cannot reach the files Orbax writes inside (with its own
  default modes).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(d, {"w": jnp.ones(3)}, 5)
    >>> latest_step(d)
    5
  """
  import orbax.checkpoint as ocp
  loc = parse_location(directory)
  name = f"step_{int(step):010d}"
  if loc.kind == OBJECT:
    # Orbax 0.12 writes no s3:// path; written here, then uploaded with its
    # commit markers last (one process: the others' shards would be on
    # their hosts).
    if jax.process_count() > 1:
      raise UsageError(f"save_checkpoint({directory!r}): an Orbax checkpoint"
                       " on object storage is written from one process; a"
                       " multi-process job saves to s3:// or gs:// with"
                       " tenplex_jax.store.save (each process its shards)")
    with tempfile.TemporaryDirectory(prefix="tenplex-jax-ckpt-") as tmp:
      save_checkpoint(tmp, tree, step)
      upload_tree(os.path.join(tmp, name), f"{loc.target}/{name}")
    return f"{loc.target}/{name}"
  if loc.kind != LOCAL:
    raise UsageError(f"save_checkpoint({directory!r}): a directory, s3:// or"
                     " gs://, not a store server")
  path = os.path.join(os.path.abspath(loc.target), name)
  # Orbax and tensorstore create the files inside with their default modes;
  # the directories made here are 0700, so other users cannot reach them.
  private.makedirs(loc.target)
  ckptr = ocp.StandardCheckpointer(file_options=ocp.options.FileOptions(
      path_permission_mode=private.DIR_MODE))
  ckptr.save(path, _unkey(tree))
  ckptr.wait_until_finished()
  ckptr.close()
  return path


def latest_step(directory: str) -> int | None:
  """The newest complete checkpoint step in ``directory``, or None.

  ``directory`` may be any Orbax checkpoint: a ``CheckpointManager``
  directory (steps ``<n>`` or ``<prefix>_<n>``, as :func:`save_checkpoint`
  writes them), a step directory, or an item directory (step 0 when no step
  is recorded).
  """
  try:
    loc = locate(directory)
  except UsageError:
    return None
  return 0 if loc.step is None else loc.step


def restore_checkpoint(directory: str, target: Any) -> tuple[Any, int]:
  """Restores the newest checkpoint in ``directory`` onto ``target``
  (ShapeDtypeStructs with shardings); returns ``(tree, step)``.

  Reads any user's Orbax checkpoint (``<dir>/<step>/default`` from
  ``ocp.CheckpointManager`` with ``StandardSave``, ``StandardCheckpointer``
  and ``PyTreeCheckpointer`` items, OCDBT or not, zarr v3 or v2) through
  :func:`tenplex_jax.orbax.restore`: each process reads only its own
  devices' boxes. Zero-size arrays and string leaves of the target (which
  Orbax does not store) are rebuilt from the target.

  Raises:
    NoCopyError: ``directory`` holds no Orbax checkpoint.
  """
  try:
    loc = locate(directory)
  except UsageError as e:
    raise NoCopyError(f"no Orbax checkpoint in {directory} to fall back to"
                      f" ({e})") from e
  tree = orbax_restore(loc.item, target)
  return tree, 0 if loc.step is None else loc.step
