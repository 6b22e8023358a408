"""The persistent fallback: Orbax checkpoints, and stores on object storage.

Used only when no store copy of some piece survives; reads any Orbax
checkpoint through :mod:`tenplex_jax.orbax`. PRNG keys are saved as
their key data (with the implementation name) since Orbax stores plain
arrays; non-array leaves go through Orbax's own handling.

On object storage (``s3://``, ``gs://``) a multi-process job's checkpoint
is a tenplex store in ``<directory>/tenplex-store`` (Orbax 0.12 writes no
``s3://`` path, and an Orbax checkpoint written locally can be uploaded
only from one process): every process uploads its own shards with
:func:`tenplex_jax.store.save`, and a round commits by its manifests,
written last. :func:`latest_step` and :func:`restore_checkpoint` read the
newer of the two.
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
from tenplex_jax.store.format import round_id
from tenplex_jax.store.objects import ObjectStore

__all__ = ["STORE_NAME", "latest_step", "restore_checkpoint",
           "save_checkpoint"]

STORE_NAME = "tenplex-store"  # the store a multi-process job's object-
# storage checkpoint is, inside the checkpoint directory


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

  On object storage (``s3://BUCKET/DIR``, ``gs://...``) a single process
  writes the Orbax checkpoint locally and uploads it (its commit markers
  last); in a multi-process job every process saves its own shards to the
  tenplex store ``DIR/tenplex-store`` instead (``tenplex_jax.store.save``,
  ``keep=2``: the round commits by its manifests, written last) and the
  path returned is its snapshot's.

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
    if jax.process_count() > 1:
      # Orbax 0.12 writes no s3:// path, and a checkpoint written locally
      # holds only this host's shards: each process uploads its own to the
      # tenplex store, the round committed by the manifests, written last.
      from tenplex_jax.store.api import save  # api uses this module
      return save(tree, f"{loc.target}/{STORE_NAME}", step=step, keep=2)
    # One process: the Orbax checkpoint is written here, then uploaded with
    # its commit markers last.
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

  On object storage, the newer of that and the newest complete round of
  the tenplex store ``directory/tenplex-store`` (see
  :func:`save_checkpoint`).
  """
  try:
    loc = locate(directory)
  except UsageError:
    step = None
  else:
    step = 0 if loc.step is None else loc.step
  in_store = _store_step(directory)
  if in_store is not None and (step is None or in_store > step):
    return in_store
  return step


def _store_step(directory: str) -> int | None:
  """The step of the newest complete round (every process of the saving
  job has its snapshot) of the tenplex store in object-storage checkpoint
  directory ``directory``; None when there is none (or ``directory`` is
  not on object storage)."""
  loc = parse_location(directory)
  if loc.kind != OBJECT:
    return None
  store = ObjectStore(f"{loc.target}/{STORE_NAME}")
  if not store.is_store():
    return None
  held: dict[str, tuple[int, int, set[int]]] = {}
  for proc, manifests in store.all_rounds()[0].items():
    for m in manifests:
      e = held.setdefault(round_id(m), (int(m["step"]),
                                        int(m["num_processes"]), set()))
      e[2].add(proc)
  done = [st for st, n, procs in held.values() if procs >= set(range(n))]
  return max(done, default=None)


def restore_checkpoint(directory: str, target: Any) -> tuple[Any, int]:
  """Restores the newest checkpoint in ``directory`` onto ``target``
  (ShapeDtypeStructs with shardings); returns ``(tree, step)``.

  Reads any user's Orbax checkpoint (``<dir>/<step>/default`` from
  ``ocp.CheckpointManager`` with ``StandardSave``, ``StandardCheckpointer``
  and ``PyTreeCheckpointer`` items, OCDBT or not, zarr v3 or v2) through
  :func:`tenplex_jax.orbax.restore`: each process reads only its own
  devices' boxes. Zero-size arrays and string leaves of the target (which
  Orbax does not store) are rebuilt from the target.

  On object storage, the tenplex store ``directory/tenplex-store`` when
  its newest complete round is newer than the Orbax checkpoints there
  (:func:`tenplex_jax.store.restore`: every plain leaf as saved, each
  process reading only the boxes its devices need).

  Raises:
    NoCopyError: ``directory`` holds no Orbax checkpoint (nor store).
  """
  in_store = _store_step(directory)
  try:
    loc = locate(directory)
  except UsageError as e:
    if in_store is None:
      raise NoCopyError(f"no Orbax checkpoint in {directory} to fall back"
                        f" to ({e})") from e
    loc = None
  if in_store is not None and (loc is None or in_store > (loc.step or 0)):
    from tenplex_jax.store.api import restore_with_report  # api uses us
    url = f"{parse_location(directory).target}/{STORE_NAME}"
    tree, report = restore_with_report([url], target)
    return tree, report.step
  tree = orbax_restore(loc.item, target)
  return tree, 0 if loc.step is None else loc.step
