"""Configuration search: choose the mesh and sharding rules for a device set.

Alpa-like, analytical and fast: enumerate (data, fsdp, tensor, pipeline)
factorizations, micro-batch counts and remat choices; prune by hard rules;
rank by a documented cost model (``docs/search.md``); optionally refine the
top few by compiling them (:func:`refine`).
"""

from tenplex_jax.search.cost import (MESH_AXES, REMAT_CHOICES, AxisLink,
                                     Calibration, Workload, axis_link,
                                     mesh_links, ring_allreduce, ring_gather,
                                     sharded_param_count)
from tenplex_jax.search.hardware import (HARDWARE_PRESETS, Hardware, Topology,
                                         hardware_preset)
from tenplex_jax.search.model import (LOGICAL_TO_MESH, MODEL_PRESETS,
                                      ModelSpec, ParamGroup,
                                      from_abstract_params, model_preset,
                                      transformer_spec)
from tenplex_jax.search.search import (BestMesh, Candidate, Rejection,
                                       SearchResult, best_mesh_for, evaluate,
                                       search)
from tenplex_jax.search.space import (REJECTION_REASONS, divisors,
                                      factorizations, mesh_rejection)

__all__ = [
    "AxisLink", "BestMesh", "Calibration", "Candidate", "HARDWARE_PRESETS",
    "Hardware", "LOGICAL_TO_MESH", "MESH_AXES", "MODEL_PRESETS", "ModelSpec",
    "ParamGroup", "REJECTION_REASONS", "REMAT_CHOICES", "Rejection",
    "SearchResult", "Topology", "Workload", "axis_link", "best_mesh_for",
    "divisors", "evaluate", "factorizations", "from_abstract_params",
    "hardware_preset", "mesh_links", "mesh_rejection", "model_preset",
    "ring_allreduce", "ring_gather", "search", "sharded_param_count",
    "transformer_spec",
]
