"""The deterministic gradient's exchange under a ``pipeline_axis``: permutes against the all_to_all.

One command (simulated CPU devices):

  PYTHONPATH=. python3 benchmarks/bench_determinism_pipeline.py
      [--mesh 2,2,2] [--layers 8] [--dim 512] [--hidden 2048] [--ratio 1]
      [--rows 2] [--seq 8] [--reps 5] [--lock /work/.bench.lock]

A pipelined residual MLP stack (``layers`` blocks of ``dim x hidden`` and
``hidden x dim``, float32; the layers split over ``stage``, the hidden dim
over ``tensor``, as tests/test_determinism_compose.py's pipeline test) on a
``(data, stage, tensor)`` mesh, ``V = data * ratio`` virtual workers of
``rows`` sequences of ``seq`` tokens, each through ``tenplex_jax.pipeline``
in 2 microbatches. It times, interleaved, ``reps`` calls of the step
``determinism.jit`` of ``value_and_grad(..., pipeline_axis="stage")``, its
grads put on the params' shardings by ``determinism.on_shards`` (as the
trainers' steps do), with

* ``det``: the top of the tree by collective permutes
  (``determinism._TOP_BY_PERMUTE``, the default);
* ``det_a2a``: by one ``all_to_all`` per leaf (``_TOP_BY_PERMUTE`` False,
  the only way under a ``pipeline_axis`` before the fourteenth session);
* ``det_ps``: ``det`` told the params' shardings (``param_shardings``):
  each stage exchanges only its layers' gradients (the others all-gather
  the whole stacked gradient over ``stage`` first and hold it whole after),

checks that their gradients have the same bits, and reports medians and
minima of the wall time and of the process's CPU time per call (user +
system), their ratios to ``det_a2a``, and XLA's per-device buffer sizes
(``memory_analysis``). Results go to stdout and ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mesh", default="2,2,2", help="data,stage,tensor")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--ratio", type=int, default=1, help="V / data")
  ap.add_argument("--rows", type=int, default=2, help="rows per worker")
  ap.add_argument("--seq", type=int, default=8)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--lock", default="")
  ap.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
      "bench_determinism_pipeline_result.json")))
  args = ap.parse_args(argv)
  shape = tuple(int(s) for s in args.mesh.split(","))
  ndev = shape[0] * shape[1] * shape[2]

  import jax
  jax.config.update("jax_num_cpu_devices", max(8, ndev))
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import tenplex_jax as tj
  from tenplex_jax import determinism as det

  from interleaved import time_interleaved

  mesh = Mesh(np.array(jax.devices()[:ndev]).reshape(shape),
              ("data", "stage", "tensor"))
  v = shape[0] * args.ratio
  ks = jax.random.split(jax.random.key(0), 3)
  L, D, H = args.layers, args.dim, args.hidden
  specs = {"a": P("stage", None, "tensor"), "b": P("stage", "tensor")}
  shardings = {n: NamedSharding(mesh, s) for n, s in specs.items()}
  params = {
      "a": jax.device_put(jax.random.normal(ks[0], (L, D, H)) / D ** 0.5,
                          shardings["a"]),
      "b": jax.device_put(jax.random.normal(ks[1], (L, H, D)) / H ** 0.5 / L,
                          shardings["b"])}
  x = jax.device_put(jax.random.normal(ks[2], (args.rows * v, args.seq, D)),
                     NamedSharding(mesh, P("data")))

  def layer(p, h):
    return h + jnp.tanh(h @ p["a"]) @ p["b"]

  def loss(p, xb):
    return jnp.mean(tj.pipeline(layer, p, xb, mesh=mesh, microbatches=2) ** 2)

  def program(top_by_permute, known):
    old = det._TOP_BY_PERMUTE
    det._TOP_BY_PERMUTE = top_by_permute
    try:
      f = det.value_and_grad(loss, virtual_workers=v, mesh=mesh,
                             pipeline_axis="stage",
                             param_shardings=shardings if known else None)

      def step(p, xb):
        loss, g = f(p, xb)
        return loss, det.on_shards(g, shardings)

      return det.jit(step).lower(params, x).compile()
    finally:
      det._TOP_BY_PERMUTE = old

  compiled = {"det": program(True, False), "det_a2a": program(False, False),
              "det_ps": program(True, True)}
  row = {"mesh": dict(zip(("data", "stage", "tensor"), shape)),
         "virtual_workers": v, "layers": L, "dim": D, "hidden": H,
         "rows_per_worker": args.rows, "seq": args.seq, "reps": args.reps,
         "params": 2 * L * D * H}
  row["memory"] = {}
  for name, c in compiled.items():
    m = c.memory_analysis()
    row["memory"][name] = {
        "temp_bytes": m.temp_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "argument_bytes": m.argument_size_in_bytes}
    text = c.as_text()
    row["memory"][name]["entry_collective_permutes"] = sum(
        "collective-permute(" in ln for ln in text[text.index("ENTRY"):].splitlines())
  lock = None
  if args.lock:
    lock = open(args.lock, "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
  try:
    outs = {n: jax.block_until_ready(c(params, x)) for n, c in compiled.items()}
    bits = [[np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(o)]
            for o in outs.values()]
    row["bitwise_equal"] = all(b == bits[0] for b in bits)
    del outs
    row["loadavg_before"] = os.getloadavg()
    times, cpu = time_interleaved(compiled, (params, x), args.reps)
    row["loadavg_after"] = os.getloadavg()
  finally:
    if lock is not None:
      fcntl.flock(lock, fcntl.LOCK_UN)
      lock.close()
  row["seconds"] = {n: statistics.median(t) for n, t in times.items()}
  row["min_seconds"] = {n: min(t) for n, t in times.items()}
  row["cpu_seconds"] = {n: statistics.median(t) for n, t in cpu.items()}
  row["min_cpu_seconds"] = {n: min(t) for n, t in cpu.items()}
  row["ratio_to_det_a2a"] = {
      "median": {n: row["seconds"][n] / row["seconds"]["det_a2a"] for n in times},
      "min": {n: row["min_seconds"][n] / row["min_seconds"]["det_a2a"] for n in times},
      "cpu_median": {n: row["cpu_seconds"][n] / row["cpu_seconds"]["det_a2a"]
                     for n in times},
      "cpu_min": {n: row["min_cpu_seconds"][n] / row["min_cpu_seconds"]["det_a2a"]
                  for n in times}}
  print(json.dumps(row, indent=1))
  pathlib.Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
  return 0 if row["bitwise_equal"] else 1


if __name__ == "__main__":
  sys.exit(main())
