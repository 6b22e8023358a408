"""Iterator state beside the model state in Orbax, the way Grain's iterators are saved.

Grain's Orbax handler (``grain.checkpoint.CheckpointHandler``, used through
``ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(it))``) writes
each process's ``json.dumps(it.get_state())`` to
``process_<index>-of-<count>.json`` in the item's directory and, on restore,
reads the file of the *current* index and count: restoring under another
process count fails ("File ... does not exist"). :class:`IteratorHandler`
keeps that layout and file format (so either handler reads the other's
checkpoints at an unchanged process count), but restores under any count:
the states of :class:`~tenplex_jax.data.ElasticIterator` and
:class:`~tenplex_jax.data.PackedIterator` hold no shard index or count and
are equal on every process, so a process reads its own file if there is one,
else any, after checking that all files hold the same state.

:func:`as_grain_iterator` wraps either iterator as a ``grain.DatasetIterator``
(``get_state``/``set_state``, Orbax's v1 ``save``/``load``), for code that
expects a Grain iterator.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from tenplex_jax.errors import DataError

_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _process_index_and_count() -> tuple[int, int]:
  return jax.process_index(), jax.process_count()


def state_file_name(process_index: int, process_count: int) -> str:
  """Grain's per-process state file name.

  Example:
    >>> state_file_name(1, 4)
    'process_1-of-4.json'
  """
  return f"process_{process_index}-of-{process_count}.json"


def read_state(directory: str | epath.PathLike, process_index: int | None = None,
               process_count: int | None = None) -> dict[str, Any]:
  """The iterator state in a checkpoint item directory, for any process count.

  Reads ``process_<index>-of-<count>.json`` if it exists; otherwise every
  ``process_*-of-*.json`` there, which must hold one and the same state (true
  for this package's iterators; a Grain iterator with per-shard state is
  refused, since no shard's state stands for another's).

  Args:
    directory: the item's directory (``<step>/<item name>`` of a manager).
    process_index: this process (default ``jax.process_index()``).
    process_count: the process count (default ``jax.process_count()``).

  Returns:
    The state dict.

  Raises:
    DataError: no state file is there, or the files hold different states.

  Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for i in range(2):
    ...   _ = (d / state_file_name(i, 2)).write_text('{"step": 3}')
    >>> read_state(d, 0, 1)
    {'step': 3}
  """
  directory = epath.Path(directory)
  if process_index is None or process_count is None:
    process_index, process_count = _process_index_and_count()
  own = directory / state_file_name(process_index, process_count)
  if own.exists():
    return json.loads(own.read_text())
  files = sorted((p for p in directory.iterdir() if _FILE.fullmatch(p.name)),
                 key=lambda p: tuple(int(x) for x in _FILE.fullmatch(p.name).groups()))
  if not files:
    raise DataError(f"{directory}: no iterator state (process_*-of-*.json) to restore")
  states = [json.loads(p.read_text()) for p in files]
  differ = [p.name for p, s in zip(files, states) if s != states[0]]
  if differ:
    raise DataError(
        f"{directory}: restoring under {process_count} process(es) needs one state for all, "
        f"but {differ} differ from {files[0].name} (a per-shard iterator state; restore it "
        "under the process count that saved it)")
  return states[0]


class IteratorHandler(ocp.CheckpointHandler):
  """Orbax handler for an iterator's ``get_state``/``set_state``, in Grain's layout.

  Use through :class:`IteratorSave` and :class:`IteratorRestore` inside
  ``ocp.args.Composite``. Restoring sets the state on the given iterator and
  returns it.

  Example:
    >>> import tempfile, pathlib
    >>> from tenplex_jax.data import ElasticIterator
    >>> it = ElasticIterator(list(range(8)), global_batch_size=2, seed=0, prefetch=0)
    >>> _ = next(it)
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> IteratorHandler().save(d, args=IteratorSave(it))
    >>> sorted(p.name for p in d.iterdir())
    ['process_0-of-1.json']
    >>> new = ElasticIterator(list(range(8)), global_batch_size=2, seed=0, shard_count=2)
    >>> IteratorHandler().restore(d, args=IteratorRestore(new)).get_state()["step"]
    1
  """

  def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
    """Writes ``process_<index>-of-<count>.json`` (``item`` is Orbax's old API)."""
    item = _item(item, args)
    index, count = _process_index_and_count()
    path = epath.Path(directory) / state_file_name(index, count)
    path.write_text(json.dumps(item.get_state(), indent=1))

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> Any:
    """Sets the saved state on the iterator (:func:`read_state`) and returns it."""
    item = _item(item, args)
    item.set_state(read_state(directory))
    return item

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


def _item(item: Any, args: Any) -> Any:
  item = item if item is not None else getattr(args, "item", None)
  if item is None or not hasattr(item, "get_state") or not hasattr(item, "set_state"):
    raise DataError(f"IteratorHandler needs an iterator with get_state/set_state, got "
                    f"{type(item).__name__}")
  return item


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  """Save ``item.get_state()`` (an ElasticIterator, PackedIterator, or any iterator).

  Example:
    >>> import tempfile
    >>> from tenplex_jax.data import ElasticIterator
    >>> it = ElasticIterator(list(range(8)), global_batch_size=2, seed=0, prefetch=0)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mgr:
    ...   _ = mgr.save(0, args=ocp.args.Composite(data=IteratorSave(it)))
    ...   mgr.wait_until_finished()
  """
  item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  """Restore into ``item`` with ``item.set_state``, under any process count.

  Example:
    >>> import tempfile
    >>> from tenplex_jax.data import ElasticIterator
    >>> it = ElasticIterator(list(range(8)), global_batch_size=2, seed=0, prefetch=0)
    >>> _ = next(it)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mgr:
    ...   _ = mgr.save(1, args=ocp.args.Composite(data=IteratorSave(it)))
    ...   mgr.wait_until_finished()
    ...   new = ElasticIterator(list(range(8)), global_batch_size=2, seed=0, shard_count=2)
    ...   out = mgr.restore(1, args=ocp.args.Composite(data=IteratorRestore(new)))
    >>> out["data"].get_state()["step"]
    1
  """
  item: Any


@functools.cache
def _grain_iterator_class() -> type:
  try:
    import grain  # noqa: PLC0415 - optional dependency
  except ImportError as e:
    raise DataError("as_grain_iterator needs the grain package: pip install "
                    "'tenplex_jax[data]' (or grain>=0.2.18)") from e

  class GrainIterator(grain.DatasetIterator):
    """A ``grain.DatasetIterator`` over an ElasticIterator or PackedIterator."""

    def __init__(self, it: Any):
      super().__init__()
      self.iterator = it

    def __next__(self) -> Any:
      return next(self.iterator)

    def get_state(self) -> dict[str, Any]:
      return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
      self.iterator.set_state(state)

    def close(self) -> None:
      self.iterator.close()

  return GrainIterator


def as_grain_iterator(it: Any) -> Any:
  """Wraps an iterator of this package as a ``grain.DatasetIterator``.

  Grain's checkpoint handler and Orbax's v1 ``StatefulCheckpointable``
  protocol (``save``/``load``) then accept it; :class:`IteratorHandler`
  additionally restores it under another process count.

  Example:
    >>> from tenplex_jax.data import ElasticIterator
    >>> g = as_grain_iterator(ElasticIterator([1, 2, 3], global_batch_size=1, seed=0,
    ...                                       shuffle=False, prefetch=0))
    >>> import grain; isinstance(g, grain.DatasetIterator), next(g)["data"].tolist()
    (True, [1])
  """
  return _grain_iterator_class()(it)
