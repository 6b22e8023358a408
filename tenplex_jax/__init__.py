"""tenplex_jax: elastic re-meshing of JAX training state.

Tenplex's parallelizable tensor collections (PTC) for ``jax.sharding``:
derive a layout from any pytree of sharded arrays, plan the minimum data
movement between two layouts, and execute it in one process, across a
restart through per-host tensor stores, or on a Flax train state.
"""

from tenplex_jax import assembly, data, determinism, jobarray, orbax, search, sources, store
from tenplex_jax._hostmem import host_pool_stats, release_host_pool
from tenplex_jax.errors import (DataError, LayoutError, PlanError, ReplicationWarning,
                                ReshardError, SearchError, StoreError, TenplexError,
                                UsageError)
from tenplex_jax.layout import PTC, Placement, TensorLayout, key_path_name, named_layout
from tenplex_jax.pipeline import bubble_fraction, pipeline
from tenplex_jax.planner import Plan, Transfer, plan
from tenplex_jax.remesh import RemeshReport, remesh
from tenplex_jax.reshard import ReshardReport, reshard, reshard_with_report

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
]
