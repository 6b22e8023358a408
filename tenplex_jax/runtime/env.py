"""The ``TENPLEX_*`` environment of the runtime, read in one place.

A launcher (``tenplex-jax launch`` or :func:`tenplex_jax.ray.run`) hands each
training process its job in environment variables; the script API
(``initialize``, ``resize_due``, ``save_snapshot``, ``restore_or_init``...)
and the standby processes read them here, as one :class:`JobEnv`, and
nowhere else. The store's own settings, which a launcher passes on too, are
the store's to read (each variable in one module:
``tests/test_import_graph.py`` checks both): the job's store token and CA
(:data:`~tenplex_jax.store.TOKEN_ENV`, ``CA_ENV``:
``store.server.resolve_token`` and ``client_ca``, which the launchers call)
and ``tenplex_jax.store.save``'s default run id ``TENPLEX_RUN``.

The environment stays the interface with the script: a script may set
``TENPLEX_DEVICES`` before ``initialize()``, a standby process receives its
whole environment after it imported the library, and ``restore_or_init``
moves ``TENPLEX_START_STEP`` to the step it restored. So :func:`job_env`
parses the variables once per distinct environment and returns the same
frozen value until one of them changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from tenplex_jax.errors import UsageError

__all__ = ["JobEnv", "STANDBY_ASSIGNED_ENV", "STANDBY_IMPORTS_ENV",
           "STANDBY_READY_ENV", "VARIABLES", "job_env"]

STANDBY_IMPORTS_ENV = "TENPLEX_STANDBY_IMPORTS"
STANDBY_READY_ENV = "TENPLEX_STANDBY_READY"
STANDBY_ASSIGNED_ENV = "TENPLEX_STANDBY_ASSIGNED"

# field -> (variable, kind); kinds: str, int, bool (set and nonempty), list
# (a JSON list of strings), csv (comma-separated).
_VARS = {
    "num_procs": ("TENPLEX_NUM_PROCS", int),
    "proc_id": ("TENPLEX_PROC_ID", int),
    "devices": ("TENPLEX_DEVICES", int),
    "coordinator": ("TENPLEX_COORDINATOR", str),
    "store": ("TENPLEX_STORE", str),
    "stores": ("TENPLEX_STORES", list),
    "peers": ("TENPLEX_PEERS", list),
    "job_dir": ("TENPLEX_JOB_DIR", str),
    "generation": ("TENPLEX_GENERATION", int),
    "start_step": ("TENPLEX_START_STEP", int),
    "replicas": ("TENPLEX_REPLICAS", int),
    "failed_step": ("TENPLEX_FAILED_STEP", int),
    "schedule": ("TENPLEX_SCHEDULE", str),
    "checkpoint": ("TENPLEX_CHECKPOINT", str),
    "compilation_cache": ("TENPLEX_COMPILATION_CACHE", bool),
    "ray_controller": ("TENPLEX_RAY_CONTROLLER", str),
    "ray_free_arrays": ("TENPLEX_RAY_FREE_ARRAYS", bool),
    "allocate_ahead": ("TENPLEX_ALLOCATE_AHEAD", bool),
    "turn_file": ("TENPLEX_TURN_FILE", str),
    "programs_file": ("TENPLEX_PROGRAMS_FILE", str),
    "for_failure": ("TENPLEX_FOR_FAILURE", bool),
    "standby_imports": (STANDBY_IMPORTS_ENV, "csv"),
}
# Every variable this module reads (and no other module does).
VARIABLES = tuple(name for name, _ in _VARS.values())


@dataclasses.dataclass(frozen=True)
class JobEnv:
  """This process's job as its launcher described it (``None`` or empty:
  not set; ``num_procs is None``: no launcher, a single-process job).

  Example:
    >>> e = JobEnv.from_environ({"TENPLEX_NUM_PROCS": "2",
    ...                          "TENPLEX_PROC_ID": "1",
    ...                          "TENPLEX_STORES": '["/s/0", "/s/1"]'})
    >>> e.num_procs, e.proc_id, e.stores, e.launched, e.generation
    (2, 1, ('/s/0', '/s/1'), True, 0)
    >>> JobEnv.from_environ({}).launched
    False
  """

  num_procs: int | None = None
  proc_id: int = 0
  devices: int | None = None
  coordinator: str | None = None
  store: str | None = None
  stores: tuple[str, ...] = ()
  peers: tuple[str, ...] = ()
  job_dir: str | None = None
  generation: int = 0
  start_step: int = 0
  replicas: int = 0
  failed_step: int | None = None
  schedule: str | None = None
  checkpoint: str | None = None
  compilation_cache: bool = False
  ray_controller: str | None = None
  ray_free_arrays: bool = False  # a Ray worker frees its arrays once saved
  allocate_ahead: bool = False  # a prepared group allocates its restore's
  # arrays before its turn (store.api.compile_restore(allocate=True))
  turn_file: str | None = None
  programs_file: str | None = None
  for_failure: bool = False  # a generation prepared for a failure
  standby_imports: tuple[str, ...] = ()

  @property
  def launched(self) -> bool:
    """Whether a launcher started this process (``TENPLEX_NUM_PROCS``)."""
    return self.num_procs is not None

  @property
  def procs(self) -> int:
    """The job's process count (1 without a launcher)."""
    return 1 if self.num_procs is None else self.num_procs

  @classmethod
  def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
    """Parses ``environ`` (default ``os.environ``); a malformed value raises
    :class:`~tenplex_jax.errors.UsageError` naming the variable."""
    environ = os.environ if environ is None else environ
    values = {}
    for field, (name, kind) in _VARS.items():
      raw = environ.get(name)
      if raw is None or (raw == "" and kind is not str):
        continue
      values[field] = _parse(name, raw, kind)
    return cls(**values)


def _parse(name: str, raw: str, kind):
  if kind is str:
    return raw or None
  if kind is bool:
    return True
  if kind == "csv":
    return tuple(x for x in raw.split(",") if x)
  if kind is int:
    try:
      return int(raw)
    except ValueError:
      raise UsageError(f"${name}: {raw!r} is not an integer") from None
  try:
    value = json.loads(raw)
  except ValueError:
    value = None
  if not isinstance(value, list) or not all(isinstance(x, str)
                                            for x in value):
    raise UsageError(f"${name}: {raw!r} is not a JSON list of strings")
  return tuple(value)


_cache: dict = {}


def job_env() -> JobEnv:
  """This process's :class:`JobEnv`, parsed once per distinct ``TENPLEX_*``
  environment (see the module's docstring for why it follows changes)."""
  key = tuple(os.environ.get(name) for name, _ in _VARS.values())
  if _cache.get("key") != key:
    _cache.update(key=key, env=JobEnv.from_environ())
  return _cache["env"]
