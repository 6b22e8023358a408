"""Planner scaling: a 1,000-tensor state between two layouts over 1,024
abstract devices (no devices, no I/O), side by side with a brute-force
baseline that plans every tensor separately (no template sharing).

  python benchmarks/bench_plan.py [--tensors 1000] [--out results/bench_plan.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

from tenplex_jax.layout import named_layout, ptc_from_layouts
from tenplex_jax.planner import plan

SHAPES = [((4096, 4096), ("fsdp", "tensor")), ((4096, 16384), ("fsdp", "tensor")),
          ((16384, 4096), ("tensor", "fsdp")), ((4096,), (None,)),
          ((50304, 4096), ("tensor", None))]


def layouts(n, mesh):
  out = []
  for i in range(n):
    shape, spec = SHAPES[i % len(SHAPES)]
    out.append(named_layout(f"layers/{i // len(SHAPES)}/t{i % len(SHAPES)}",
                            shape, "bfloat16" if i % 2 else "float32",
                            mesh_shape=mesh, spec=spec))
  return ptc_from_layouts(out, 8)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tensors", type=int, default=1000)
  ap.add_argument("--out", default="results/bench_plan.json")
  args = ap.parse_args()
  a_mesh = {"data": 32, "fsdp": 4, "tensor": 8}
  b_mesh = {"data": 16, "fsdp": 8, "tensor": 8}
  t0 = time.perf_counter()
  a, b = layouts(args.tensors, a_mesh), layouts(args.tensors, b_mesh)
  t1 = time.perf_counter()
  p = plan(a, b)
  t2 = time.perf_counter()
  # Baseline: one plan per tensor (what planning without templates costs).
  n_base = min(args.tensors, 50)
  t3 = time.perf_counter()
  for t, u in zip(list(a)[:n_base], list(b)[:n_base]):
    plan(ptc_from_layouts([t], 8), ptc_from_layouts([u], 8))
  t4 = time.perf_counter()
  per_tensor = (t4 - t3) / n_base
  res = {
      "machine": f"{platform.processor() or platform.machine()}, "
                 f"{platform.python_version()}",
      "tensors": args.tensors, "devices": 1024,
      "layout_s": t1 - t0, "plan_s": t2 - t1,
      "baseline_per_tensor_s": per_tensor,
      "baseline_extrapolated_s": per_tensor * args.tensors,
      "templates": len(p.groups), "moved_bytes": p.moved_bytes,
      "lower_bound_bytes": p.lower_bound_bytes,
  }
  print(f"{'':30} {'seconds':>10}")
  print(f"{'build 2 layouts':30} {res['layout_s']:>10.3f}")
  print(f"{'plan (templates shared)':30} {res['plan_s']:>10.3f}")
  print(f"{'plan per tensor, extrapolated':30} "
        f"{res['baseline_extrapolated_s']:>10.3f}")
  print(f"templates {res['templates']}, moved == lower bound:"
        f" {p.moved_bytes == p.lower_bound_bytes}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
  main()
