"""tenplex_jax: elastic re-meshing of JAX training state.

Tenplex's parallelizable tensor collections (PTC) for ``jax.sharding``:
derive a layout from any pytree of sharded arrays, plan the minimum data
movement between two layouts, and execute it in one process, across a
restart through per-host tensor stores, or on a Flax train state.
"""

import importlib
import sys
import types
from typing import Any

# Submodules and names load on first use (PEP 562), so that importing one
# part (``tenplex_jax.orbax`` for a restore) does not import every other
# (the data pipeline, the search, the store's servers): 0.3-0.5 s of a
# fresh process's fixed cost. ``from tenplex_jax import X`` works as before.
_SUBMODULES = ("assembly", "data", "determinism", "jobarray", "orbax",
               "search", "sources", "store")
_NAMES = {
    "host_pool_stats": "_hostmem", "release_host_pool": "_hostmem",
    **{n: "errors" for n in (
        "DataError", "LayoutError", "PlanError", "ReplicationWarning",
        "ReshardError", "SearchError", "StoreError", "TenplexError",
        "UsageError")},
    **{n: "layout" for n in ("PTC", "Placement", "TensorLayout",
                             "key_path_name", "named_layout")},
    "bubble_fraction": "pipeline", "pipeline": "pipeline", "tie": "pipeline",
    "Plan": "planner", "Transfer": "planner", "plan": "planner",
    "RemeshReport": "remesh", "remesh": "remesh",
    "ReshardReport": "reshard", "reshard": "reshard",
    "reshard_with_report": "reshard",
}


def __getattr__(name: str) -> Any:
  if name in _SUBMODULES:
    return importlib.import_module(f"tenplex_jax.{name}")
  mod = _NAMES.get(name)
  if mod is None:
    raise AttributeError(f"module 'tenplex_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"tenplex_jax.{mod}"), name)
  globals()[name] = value  # once: later look-ups skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
  """This package: a submodule named like the function it exports
  (``reshard``, ``remesh``, ``pipeline``) leaves the function, not the
  module, as the package's attribute once imported (as the eager imports
  did; the module stays in ``sys.modules``)."""

  def __setattr__(self, name: str, value: Any) -> None:
    if name in _SHADOWED and isinstance(value, types.ModuleType):
      value = getattr(value, name)
    super().__setattr__(name, value)


_SHADOWED = frozenset(n for n, m in _NAMES.items() if n == m)
sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "DataError",
    "LayoutError",
    "PTC",
    "Placement",
    "Plan",
    "PlanError",
    "RemeshReport",
    "ReplicationWarning",
    "ReshardError",
    "ReshardReport",
    "SearchError",
    "StoreError",
    "TensorLayout",
    "TenplexError",
    "UsageError",
    "Transfer",
    "__version__",
    "assembly",
    "bubble_fraction",
    "data",
    "determinism",
    "jobarray",
    "orbax",
    "search",
    "sources",
    "store",
    "host_pool_stats",
    "key_path_name",
    "named_layout",
    "pipeline",
    "plan",
    "release_host_pool",
    "remesh",
    "reshard",
    "reshard_with_report",
    "tie",
]
