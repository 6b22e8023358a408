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
written last. :func:`latest_step` and ``restore_checkpoint`` read the
newer of the two. The functions that combine the two
(:func:`tenplex_jax.store.save_checkpoint` and
:func:`tenplex_jax.store.restore_checkpoint`) live in
:mod:`tenplex_jax.store.api`, next to the store's own save and restore;
this module holds the Orbax side and reads the store's rounds only.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax

from tenplex_jax._keys import is_key
from tenplex_jax.cloud import upload_tree
from tenplex_jax.errors import NoCopyError, UsageError
from tenplex_jax.locations import LOCAL, OBJECT, parse_location
from tenplex_jax.orbax import locate
from tenplex_jax.orbax import restore as orbax_restore
from tenplex_jax.store import private
from tenplex_jax.store.format import round_id
from tenplex_jax.store.objects import ObjectStore

__all__ = ["STORE_NAME", "latest_step", "orbax_step", "restore_orbax_checkpoint",
           "save_orbax_checkpoint", "store_step", "store_url"]

STORE_NAME = "tenplex-store"  # the store a multi-process job's object-
# storage checkpoint is, inside the checkpoint directory


def _unkey(tree):
  # Orbax stores arrays and numbers; strings are left to the caller's target.
  return jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if isinstance(x, jax.Array)
      and is_key(x) else (None if isinstance(x, str) or _empty(x) else x),
      tree)


def _empty(x) -> bool:
  # Orbax refuses zero-size arrays; they carry no data and are rebuilt.
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and x.size == 0


def save_orbax_checkpoint(directory: str, tree: Any, step: int) -> str:
  """Saves ``tree`` as the Orbax checkpoint ``directory/step_<step>``;
  returns its path (:func:`tenplex_jax.store.save_checkpoint` without the
  multi-process object-storage case).

  On object storage (``s3://BUCKET/DIR``, ``gs://...``) the checkpoint is
  written locally and uploaded (its commit markers last): one process's
  shards only. ``directory`` (if made here) and ``step_<step>`` are made
  ``0700``, so other users cannot reach the files Orbax writes inside
  (with its own default modes).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> _ = save_orbax_checkpoint(d, {"w": jnp.ones(3)}, 5)
    >>> latest_step(d)
    5
  """
  import orbax.checkpoint as ocp
  loc = parse_location(directory)
  name = f"step_{int(step):010d}"
  if loc.kind == OBJECT:
    # Written here, then uploaded with its commit markers last.
    with tempfile.TemporaryDirectory(prefix="tenplex-jax-ckpt-") as tmp:
      save_orbax_checkpoint(tmp, tree, step)
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


def store_url(directory: str) -> str:
  """The tenplex store a multi-process job's object-storage checkpoint in
  ``directory`` is (``directory/tenplex-store``)."""
  return f"{parse_location(directory).target}/{STORE_NAME}"


def latest_step(directory: str) -> int | None:
  """The newest complete checkpoint step in ``directory``, or None.

  ``directory`` may be any Orbax checkpoint: a ``CheckpointManager``
  directory (steps ``<n>`` or ``<prefix>_<n>``, as :func:`tenplex_jax.store.save_checkpoint`
  writes them), a step directory, or an item directory (step 0 when no step
  is recorded).

  On object storage, the newer of that and the newest complete round of
  the tenplex store ``directory/tenplex-store`` (see
  :func:`tenplex_jax.store.save_checkpoint`).
  """
  step = orbax_step(directory)
  in_store = store_step(directory)
  if in_store is not None and (step is None or in_store > step):
    return in_store
  return step


def orbax_step(directory: str) -> int | None:
  """The newest Orbax checkpoint step in ``directory`` (0 for an item
  directory that records none), or None when it holds none."""
  try:
    loc = locate(directory)
  except UsageError:
    return None
  return 0 if loc.step is None else loc.step


def store_step(directory: str) -> int | None:
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


def restore_orbax_checkpoint(directory: str, target: Any
                             ) -> tuple[Any, int]:
  """Restores the newest Orbax checkpoint in ``directory`` onto ``target``;
  returns ``(tree, step)`` (:func:`tenplex_jax.store.restore_checkpoint`
  without the object-storage store).

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
    raise NoCopyError(f"no Orbax checkpoint in {directory} to fall back"
                      f" to ({e})") from e
  tree = orbax_restore(loc.item, target)
  return tree, 0 if loc.step is None else loc.step
