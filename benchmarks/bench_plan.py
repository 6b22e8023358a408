"""Planner scaling: a 1,000-tensor state between two layouts over 1,024,
8,192 and 65,536 abstract devices (no devices, no I/O), layouts included.

The meshes are data x fsdp x tensor = (D/128) x 16 x 8 -> (D/256) x 32 x 8,
the tensors bench_plan's five shapes (attention and MLP kernels, a bias, an
embedding) in float32 and bfloat16, and the devices grouped either 8 per host
(D/8 processes) or as 8 hosts (D/8 devices each). Each case runs in a fresh
process and reports wall and CPU seconds of building both layouts and of
planning, and checks that the plan moves exactly its lower bound.

``--baseline-src DIR`` also runs every case with the ``tenplex_jax`` found in
DIR (e.g. ``git archive <commit> tenplex_jax | tar -x -C DIR``), side by side
in the same run, up to ``--baseline-max-devices`` (the planner before
commit "planner: linear in devices" took 590 s at 65,536 devices).

  python benchmarks/bench_plan.py [--tensors 1000] [--baseline-src DIR]
      [--out benchmarks/bench_plan_result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

SHAPES = [((4096, 4096), ("fsdp", "tensor")), ((4096, 16384), ("fsdp", "tensor")),
          ((16384, 4096), ("tensor", "fsdp")), ((4096,), (None,)),
          ((50304, 4096), ("tensor", None))]
DEVICES = (1024, 8192, 65536)
ROOT = pathlib.Path(__file__).resolve().parent.parent


def meshes(devices: int) -> tuple[dict, dict]:
  return ({"data": devices // 128, "fsdp": 16, "tensor": 8},
          {"data": devices // 256, "fsdp": 32, "tensor": 8})


def measure(tensors: int, devices: int, per_host: int) -> dict:
  """One case, in this process: seconds to build both layouts and to plan."""
  from tenplex_jax.layout import named_layout, ptc_from_layouts
  from tenplex_jax.planner import plan

  def layouts(mesh):
    out = []
    for i in range(tensors):
      shape, spec = SHAPES[i % len(SHAPES)]
      out.append(named_layout(f"layers/{i // len(SHAPES)}/t{i % len(SHAPES)}",
                              shape, "bfloat16" if i % 2 else "float32",
                              mesh_shape=mesh, spec=spec))
    return ptc_from_layouts(out, per_host)

  a_mesh, b_mesh = meshes(devices)
  w0, c0 = time.perf_counter(), time.process_time()
  a, b = layouts(a_mesh), layouts(b_mesh)
  w1, c1 = time.perf_counter(), time.process_time()
  p = plan(a, b)
  moved, lower = p.moved_bytes, p.lower_bound_bytes
  w2, c2 = time.perf_counter(), time.process_time()
  return {"layout_s": w1 - w0, "plan_s": w2 - w1, "total_s": w2 - w0,
          "layout_cpu_s": c1 - c0, "plan_cpu_s": c2 - c1,
          "total_cpu_s": c2 - c0, "templates": len(p.groups),
          "moved_bytes": moved, "moved_equals_lower_bound": moved == lower}


def run_case(src: pathlib.Path, tensors: int, devices: int, per_host: int,
             timeout: float) -> dict:
  """``measure`` in a fresh process importing tenplex_jax from ``src``."""
  code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r});"
          "import tenplex_jax; from bench_plan import measure;"
          f"r = measure({tensors}, {devices}, {per_host});"
          "r['tenplex_jax'] = tenplex_jax.__file__; print(json.dumps(r))")
  env = {**os.environ, "PYTHONPATH": str(src)}
  try:  # -P: the working directory's tenplex_jax must not shadow src's
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env,
                         check=True,
                         capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"timed_out_s": timeout}
  return json.loads(out.stdout.strip().splitlines()[-1])


def plot(results: list, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for code, style in (("new", "-o"), ("baseline", "--x")):
    for hosts, color in (("8 per host", "tab:blue"), ("8 hosts", "tab:orange")):
      pts = [(r["devices"], r[code]["total_cpu_s"]) for r in results
             if r["grouping"] == hosts and code in r
             and "total_cpu_s" in r[code]]
      if pts:
        ax.plot(*zip(*pts), style, color=color,
                label=f"{'before' if code == 'baseline' else 'now'}, {hosts}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("devices")
  ax.set_ylabel("CPU seconds (layouts + plan)")
  ax.set_title("Planning 1,000 tensors between two layouts")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tensors", type=int, default=1000)
  ap.add_argument("--devices", type=int, nargs="*", default=list(DEVICES))
  ap.add_argument("--baseline-src", default=None)
  ap.add_argument("--baseline-max-devices", type=int, default=8192)
  ap.add_argument("--timeout", type=float, default=900)
  ap.add_argument("--out", default="benchmarks/bench_plan_result.json")
  ap.add_argument("--plot-only", action="store_true",
                  help="redraw the plot from --out's JSON")
  args = ap.parse_args()
  if args.plot_only:
    out = pathlib.Path(args.out)
    plot(json.loads(out.read_text())["results"], out.with_suffix(".png"))
    return
  results = []
  print(f"{'devices':>8} {'grouping':>11} {'layouts s':>10} {'plan s':>8}"
        f" {'total s':>8} {'cpu s':>7} {'before s':>9} {'before cpu':>10}"
        f" {'speed-up':>8}")
  for devices in args.devices:
    for grouping, per_host in (("8 per host", 8), ("8 hosts", devices // 8)):
      r = {"devices": devices, "grouping": grouping, "tensors": args.tensors,
           "new": run_case(ROOT, args.tensors, devices, per_host,
                           args.timeout)}
      if args.baseline_src and devices <= args.baseline_max_devices:
        r["baseline"] = run_case(pathlib.Path(args.baseline_src),
                                 args.tensors, devices, per_host, args.timeout)
      results.append(r)
      n, b = r["new"], r.get("baseline", {})
      before = b.get("total_s")
      gain = "" if before is None else f"{before / n['total_s']:.1f}x"
      print(f"{devices:>8} {grouping:>11} {n['layout_s']:>10.3f}"
            f" {n['plan_s']:>8.3f} {n['total_s']:>8.3f}"
            f" {n['total_cpu_s']:>7.3f}"
            f" {before if before is None else round(before, 3)!s:>9}"
            f" {b.get('total_cpu_s', '-') if not b else round(b.get('total_cpu_s', 0), 3)!s:>10}"
            f" {gain:>8}",
            flush=True)
      if not n["moved_equals_lower_bound"]:
        raise SystemExit(f"{devices} devices: moved bytes != lower bound")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  with open("/proc/loadavg") as f:
    load = f.read().split()[:3]
  out.write_text(json.dumps({
      "machine": f"{platform.processor() or platform.machine()},"
                 f" {os.cpu_count()} cores, Python {platform.python_version()}",
      "load_average_at_end": load, "results": results}, indent=1))
  plot(results, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
