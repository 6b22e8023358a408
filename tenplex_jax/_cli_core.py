"""Core CLI verbs: ``plan`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import pathlib


def _plan(args: argparse.Namespace) -> int:
  from tenplex_jax.layout import PTC
  from tenplex_jax.planner import plan

  src = PTC.from_json(pathlib.Path(args.src).read_text())
  dst = PTC.from_json(pathlib.Path(args.dst).read_text())
  p = plan(src, dst)
  if args.json:
    print(p.to_json())
  else:
    print(p.summary())
  return 0


def _parse_schedule(text: str):
  from tenplex_jax.demo import Phase

  phases = []
  for part in text.split(","):
    step, _, dims = part.partition(":")
    data, _, tensor = dims.partition("x")
    phases.append(Phase(int(step), int(data), int(tensor)))
  return tuple(phases)


def _demo(args: argparse.Namespace) -> int:
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError:  # backends already up (e.g. called from a test)
    pass
  if len(jax.devices()) < args.devices:
    raise SystemExit(f"the demo needs {args.devices} devices,"
                     f" {len(jax.devices())} exist")
  from tenplex_jax import demo

  schedule = (_parse_schedule(args.schedule) if args.schedule
              else demo.default_schedule())
  print(f"tenplex_jax demo: {args.steps} steps on simulated CPU devices,"
        " schedule " + ", ".join(f"step {p.step}: {p.devices} devices"
                                 f" (data {p.data} x tensor {p.tensor})"
                                 for p in schedule))
  result = demo.run(schedule, steps=args.steps, log=print)
  static = demo.run(schedule[:1], steps=args.steps)
  diff = max(abs(a - b) for a, b in zip(result.losses, static.losses))
  print(f"\n{len(result.reports)} reconfigurations; final loss"
        f" {result.losses[-1]:.4f} (first {result.losses[0]:.4f})")
  print(f"max |loss - loss of a run that never resized| = {diff:.2e}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({
        "losses": result.losses, "static_losses": static.losses,
        "reports": [{"step": t, **r.to_dict()} for t, r in result.reports]},
        indent=1))
  return 0


def register(sub) -> None:
  p = sub.add_parser("plan", help="plan a reconfiguration between two"
                     " layouts (PTC JSON files) and print its summary")
  p.add_argument("--from", dest="src", required=True, help="old layout JSON")
  p.add_argument("--to", dest="dst", required=True, help="new layout JSON")
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  p.set_defaults(func=_plan)

  d = sub.add_parser("demo", help="train a small Flax model on simulated CPU"
                     " devices, re-meshed 8 -> 4 -> 2 -> 8 devices")
  d.add_argument("--steps", type=int, default=40)
  d.add_argument("--devices", type=int, default=8)
  d.add_argument("--schedule", help="phases 'STEP:DATAxTENSOR,...', e.g."
                 " '0:4x2,10:2x2,20:1x2,30:2x4'")
  d.add_argument("--json", help="write losses and reports to this file")
  d.set_defaults(func=_demo)
