"""Tensor stores and multi-process elastic restart.

* :func:`save` / :func:`restore` (and :func:`restore_with_report`): move a
  job's state through per-host stores across a change of processes.
* :class:`HostStore` (a store directory) and :class:`RemoteStore` (a store
  server) read sub-tensors by index or by the string form ``"[:, 2:4]"``.
* :func:`serve` runs a store server (``tenplex-jax store serve``).
* :func:`initialize`, :func:`resize_due`, :func:`save_and_exit`,
  :func:`restore_or_init`, :func:`request_resize`, :func:`save_snapshot` are
  the calls a training script makes under ``tenplex-jax launch``.
"""

from tenplex_jax.errors import (ChecksumError, NoCopyError, StoreError,
                                 TreeError, UnreachableError)
from tenplex_jax.store.api import (RestoreReport, open_store, replicate, restore,
                                   restore_with_report, save)
from tenplex_jax.store.checkpoint import (latest_step, restore_checkpoint,
                                          save_checkpoint)
from tenplex_jax.store.launch import (RESIZE_EXIT_CODE, initialize, launch,
                                      request_resize, resize_due, restore_or_init,
                                      save_and_exit, save_snapshot)
from tenplex_jax.store.format import HostStore, TensorInfo, parse_index
from tenplex_jax.store.server import RemoteStore, make_server, serve

__all__ = [
    "ChecksumError",
    "RESIZE_EXIT_CODE",
    "HostStore",
    "NoCopyError",
    "RemoteStore",
    "RestoreReport",
    "StoreError",
    "TensorInfo",
    "TreeError",
    "UnreachableError",
    "initialize",
    "latest_step",
    "make_server",
    "open_store",
    "parse_index",
    "replicate",
    "request_resize",
    "resize_due",
    "restore",
    "restore_checkpoint",
    "restore_with_report",
    "restore_or_init",
    "launch",
    "save",
    "save_and_exit",
    "save_checkpoint",
    "save_snapshot",
    "serve",
]
