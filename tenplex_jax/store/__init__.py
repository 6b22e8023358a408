"""Tensor stores and multi-process elastic restart.

* :func:`save` / :func:`restore` (and :func:`restore_with_report`): move a
  job's state through per-host stores across a change of processes.
* :class:`HostStore` (a store directory) and :class:`RemoteStore` (a store
  server) read sub-tensors by index or by the string form ``"[:, 2:4]"``.
* :func:`serve` runs a store server (``tenplex-jax store serve``); every
  request must carry the job's token when one is set: :func:`new_token`
  makes one, :data:`TOKEN_ENV` (``TENPLEX_JAX_STORE_TOKEN``) is the
  environment variable servers and clients read it from.
* :func:`gc` reclaims what interrupted saves left (``tenplex-jax store gc``).
* :func:`initialize`, :func:`resize_due`, :func:`save_and_exit`,
  :func:`restore_or_init`, :func:`request_resize`, :func:`save_snapshot` are
  the calls a training script makes under ``tenplex-jax launch``; they live
  in :mod:`tenplex_jax.runtime.launch` and are re-exported here.
"""

import importlib
import sys
import types
from typing import Any

from tenplex_jax.errors import (ChecksumError, NoCopyError, StoreError,
                                 TreeError, UnreachableError,
                                 UnsafePathError, UsageError)
from tenplex_jax.store.format import (HostStore, TensorInfo, gc,
                                      parse_index, round_id)
from tenplex_jax.store.server import (TOKEN_ENV, RemoteStore, make_server,
                                      new_token, serve)

# The names that need jax (a save, a restore, the launch runtime) load on
# first use (PEP 562): a store server (``tenplex-jax store serve``) imports
# this package without importing jax.
_LAZY = {
    **dict.fromkeys(("RestoreReport", "open_store", "replicate", "restore",
                     "restore_checkpoint", "restore_with_report", "save",
                     "save_checkpoint"), "api"),
    "latest_step": "checkpoint",
    **dict.fromkeys(("RESIZE_EXIT_CODE", "expect_resizes", "heartbeat",
                     "heartbeats", "initialize", "launch", "prepared",
                     "prepared_for_failure", "request_resize", "resize_due",
                     "restore_or_init", "save_and_exit", "save_snapshot",
                     "wait_programs", "wait_turn", "warming_up"), "launch"),
}

__all__ = [
    "ChecksumError",
    "RESIZE_EXIT_CODE",
    "HostStore",
    "NoCopyError",
    "RemoteStore",
    "RestoreReport",
    "StoreError",
    "TOKEN_ENV",
    "TensorInfo",
    "TreeError",
    "UnreachableError",
    "UnsafePathError",
    "UsageError",
    "gc",
    "heartbeat",
    "heartbeats",
    "initialize",
    "latest_step",
    "make_server",
    "new_token",
    "open_store",
    "parse_index",
    "replicate",
    "request_resize",
    "resize_due",
    "expect_resizes",
    "prepared",
    "prepared_for_failure",
    "wait_turn",
    "wait_programs",
    "warming_up",
    "restore",
    "restore_checkpoint",
    "restore_with_report",
    "restore_or_init",
    "round_id",
    "launch",
    "save",
    "save_and_exit",
    "save_checkpoint",
    "save_snapshot",
    "serve",
]


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    module = importlib.import_module(f"tenplex_jax.store.{_LAZY[name]}")
    # Bind all of that module's names at once: importing the submodule
    # ``launch`` set the attribute ``launch`` to it, the function wins.
    for n, m in _LAZY.items():
      if m == _LAZY[name]:
        globals()[n] = getattr(module, n)
    return globals()[name]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


class _StoreModule(types.ModuleType):
  """Keeps ``tenplex_jax.store.launch`` the function, as when this package
  imported the launcher eagerly: a first ``import tenplex_jax.store.launch``
  sets the package's attribute to the submodule, this binds the function."""

  def __setattr__(self, name: str, value: Any) -> None:
    if name == "launch" and isinstance(value, types.ModuleType):
      value = value.launch
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _StoreModule
