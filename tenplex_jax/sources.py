"""Sources of boxes: the interface every place a box can be read from
implements.

A *source* holds some boxes of some tensors (a live array's shards, a host
store, a peer's store server, a store replica, an Orbax checkpoint) and can
read any sub-box of a box it holds into a caller's buffer. This module holds
the interface only: :class:`Source`, :class:`SourceTensor` and the
preference ranks. Restoring from sources is written once, in
:mod:`tenplex_jax.assembly` (:func:`~tenplex_jax.assembly.assemble`,
:func:`~tenplex_jax.assembly.fetch_pieces`,
:func:`~tenplex_jax.assembly.place`).

The sources: :class:`tenplex_jax.store.source.StoreSource` (one round of a
store directory), :class:`tenplex_jax.store.source.StoreCopy` (one old
process's snapshot in a store, a peer's store server or a bucket) and
:class:`tenplex_jax.orbax.OrbaxSource` (an Orbax checkpoint).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tenplex_jax.layout import Box

__all__ = ["DEVICE", "HOST", "PEER", "PERSISTENT", "REPLICA", "Source",
           "SourceTensor"]

# Preference of a source kind (lower first) when several hold a piece.
DEVICE, HOST, PEER, REPLICA, PERSISTENT = range(5)


@dataclasses.dataclass(frozen=True)
class SourceTensor:
  """One tensor as a source holds it.

  Attributes:
    path: the key path name (``params/Dense_0/kernel``).
    shape: the logical shape (a PRNG key array's shape, without key data).
    dtype: the logical dtype's name (``float32``, ``bfloat16``, ``key<fry>``).
    storage: the numpy dtype of the stored elements (``uint32`` key data).
    extra: trailing stored dimensions beyond ``shape`` (key data: ``(2,)``).
    boxes: the boxes the source can read cheaply, tiling ``shape`` (for a
      checkpoint: its chunks); any sub-box of one of them can be read.
    key_impl: the PRNG implementation (``threefry2x32``) of a key array.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  storage: np.dtype
  extra: tuple[int, ...] = ()
  boxes: tuple[Box, ...] = ()
  key_impl: str | None = None

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape + self.extra) * self.storage.itemsize

  @property
  def stored_shape(self) -> tuple[int, ...]:
    return self.shape + self.extra


class Source(abc.ABC):
  """A place boxes can be read from.

  Subclasses say which tensors (and which boxes of them) they hold and read
  a sub-box of one held box into a buffer. ``preference`` ranks sources of
  the same piece (lower is tried first): ``DEVICE`` < ``HOST`` < ``PEER`` <
  ``REPLICA`` < ``PERSISTENT``. ``whole_boxes`` says that reading any part
  of a held box costs reading all of it (compressed chunks);
  ``shared_reads`` that :meth:`read_parts_async` reads the box once for
  all its parts.
  """

  name: str = "source"
  preference: int = PERSISTENT
  # Reading any part of one of its boxes costs reading the whole box (a
  # compressed or checksummed chunk): :func:`assemble` then reads the part
  # of a box that this process's pieces cover once, and copies the pieces.
  whole_boxes: bool = False
  # With ``whole_boxes``: the reads of :meth:`read_parts_async` share one
  # read of their box, so each piece is read straight into its place
  # instead of through a scratch buffer.
  shared_reads: bool = False

  @abc.abstractmethod
  def tensors(self) -> Mapping[str, SourceTensor]:
    """The tensors this source holds, by path."""

  @abc.abstractmethod
  def read_into(self, path: str, box: Box, out: np.ndarray) -> None:
    """Reads ``box`` (global coordinates, within one held box) of tensor
    ``path`` into ``out`` (shape: the box's, then ``extra``; dtype: the
    storage dtype, or another numeric dtype to convert to)."""

  def read_async(self, path: str, box: Box, out: np.ndarray):
    """Starts :meth:`read_into`; returns an object whose ``result()`` waits.
    The default reads synchronously."""
    self.read_into(path, box, out)
    return _Done()

  def read_parts_async(self, path: str, parts) -> list:
    """Starts the reads of several parts ``(box, out)`` of one held box of
    ``path`` together; returns one :meth:`read_async` result per part. A
    source with ``shared_reads`` reads the box once for all of them; the
    default reads each part on its own."""
    return [self.read_async(path, box, out) for box, out in parts]

  def saved_values(self) -> Mapping[str, Any]:
    """Plain values saved by path that are not tensors (an Orbax
    checkpoint's strings): a target leaf of the same type at such a path
    takes the saved value. The default holds none."""
    return {}

  def close(self) -> None:
    """Releases open handles; the default holds none."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def read_order(self, path: str, index: int) -> float:
    """When held box ``index`` of tensor ``path`` can be read, relative to
    the other boxes (lower: sooner; e.g. the estimated arrival of its bytes
    while the source still fetches them). :func:`assemble` reads in this
    order when a source overrides it; the default keeps the target's
    order."""
    return 0.0


class _Done:

  def result(self):
    return None


# Names this module held before the restore core moved them (0.x code that
# imports them from here keeps working, with a DeprecationWarning naming the
# new home). Looked up on first use: importing them here would make
# ``sources`` depend on the modules that implement it.
_MOVED = {"AssembleReport": "tenplex_jax.assembly",
          "assemble": "tenplex_jax.assembly",
          "fetch_pieces": "tenplex_jax.assembly",
          "match_target": "tenplex_jax.assembly",
          "place": "tenplex_jax.assembly",
          "StoreCopy": "tenplex_jax.store.source",
          "StoreSource": "tenplex_jax.store.source"}


def __getattr__(name: str):
  home = _MOVED.get(name)
  if home is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  import importlib
  import warnings
  warnings.warn(f"tenplex_jax.sources.{name} moved to {home}.{name}",
                DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module(home), name)
