"""A worker for the test of checkpoints that stock Orbax saves from a
2-process job: one process of it.

  python tests/orbax_save_worker.py PORT PROC_ID DIRECTORY OCDBT(0|1)

Builds a seeded tree on a (data=2, model=2) mesh over both processes'
devices (each process makes only its own shards) and saves it with
``CheckpointManager`` + ``StandardSave`` at step 2: with OCDBT each process
writes its own ``ocdbt.process_<i>`` and Orbax merges them.
"""

import sys

port, proc, ck, ocdbt = sys.argv[1], int(sys.argv[2]), sys.argv[3], \
    sys.argv[4] == "1"

from procs import cpu_job  # noqa: E402  (tests/, this script's directory)

jax = cpu_job(2, procs=2, proc=proc, port=port)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from test_orbax_multiprocess import SAVED_BY_TWO, saved_by_two_values  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
full = saved_by_two_values()
tree = {k: jax.make_array_from_callback(
    full[k].shape, NamedSharding(mesh, P(*spec)), lambda i, k=k: full[k][i])
        for k, (_, spec) in SAVED_BY_TWO.items()}
handler = ocp.StandardCheckpointHandler(use_ocdbt=ocdbt)
with ocp.CheckpointManager(ck, item_handlers=handler) as m:
  m.save(2, args=ocp.args.StandardSave(tree))
  m.wait_until_finished()
print("saved", proc, flush=True)
