"""The protocol every store handle implements.

:func:`tenplex_jax.store.open_store` maps a location to its handle by
scheme (:func:`tenplex_jax.locations.parse_location`): a directory
(:class:`~tenplex_jax.store.HostStore`), a peer's store server
(:class:`~tenplex_jax.store.RemoteStore`), an ``s3://`` or ``gs://`` bucket
(:class:`~tenplex_jax.store.objects.ObjectStore`). Each answers the calls
below alike, and all run the same contract test
(``tests/test_objstore.py::test_every_handle_runs_the_contract``). Reading
never writes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["StoreHandle"]


@runtime_checkable
class StoreHandle(Protocol):
  """What a restore asks of a store.

  Attributes:
    store_id: the store's id (two handles of one store share it).
  """

  @property
  def store_id(self) -> str: ...

  def all_rounds(self) -> tuple[dict[int, list[dict]], list[str]]:
    """Every kept snapshot's checked manifest per saving process (oldest
    first), and the problems found (snapshots left out, and why)."""
    ...

  def manifests(self) -> dict[int, dict]:
    """The manifest of each process's current snapshot."""
    ...

  def read_storage(self, path: str, box: Any, *, proc: int | None = None,
                   step: int | None = None, round: str | None = None
                   ) -> np.ndarray:
    """Sub-box ``box`` of tensor ``path`` in its storage dtype."""
    ...
