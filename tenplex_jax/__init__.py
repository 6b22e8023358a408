"""tenplex_jax: elastic re-meshing of JAX training state.

Tenplex's parallelizable tensor collections (PTC) for ``jax.sharding``:
derive a layout from any pytree of sharded arrays, plan the minimum data
movement between two layouts, and execute it in one process, across a
restart through per-host tensor stores, or on a Flax train state.
"""

from tenplex_jax.errors import DataError, LayoutError, PlanError, ReshardError, TenplexError

__version__ = "0.1.0"

__all__ = [
    "DataError",
    "LayoutError",
    "PlanError",
    "ReshardError",
    "TenplexError",
    "__version__",
]
