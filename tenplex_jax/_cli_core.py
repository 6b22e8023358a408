"""Core CLI verbs: ``plan`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from tenplex_jax.errors import LayoutError, UsageError
from tenplex_jax.layout import PTC
from tenplex_jax.planner import plan


def _read_ptc(path: str, flag: str):
  """The layout in the PTC JSON file ``path``; UsageError naming the flag,
  the file and what is wrong with it."""
  try:
    text = pathlib.Path(path).read_text()
  except OSError as e:
    raise UsageError(f"plan: {flag} {path!r}: {e.strerror or e}") from e
  try:
    return PTC.from_json(text)
  except LayoutError as e:
    raise UsageError(f"plan: {flag} {path!r}: {e}") from e
  except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
    what = (f"missing field {e}" if isinstance(e, KeyError)
            else f"{type(e).__name__}: {e}")
    raise UsageError(f"plan: {flag} {path!r} is not a layout (PTC JSON as"
                     f" written by PTC.to_json): {what}") from e


def _plan(args: argparse.Namespace) -> int:
  src = _read_ptc(args.src, "--from")
  dst = _read_ptc(args.dst, "--to")
  p = plan(src, dst)
  if args.json:
    print(p.to_json())
  else:
    print(p.summary())
  return 0


def _parse_schedule(text: str):
  """``'STEP:DATAxTENSOR,...'`` -> phases; UsageError naming the bad part.

  Example:
    >>> [(p.step, p.data, p.tensor) for p in _parse_schedule("0:4x2,10:2x2")]
    [(0, 4, 2), (10, 2, 2)]
  """
  from tenplex_jax.demo import Phase

  phases = []
  for part in text.split(","):
    step, _, dims = part.strip().partition(":")
    data, _, tensor = dims.partition("x")
    try:
      nums = int(step), int(data), int(tensor)
    except ValueError:
      raise UsageError(f"demo: --schedule part {part!r} is not"
                       " STEP:DATAxTENSOR (e.g. '0:4x2,10:2x2')") from None
    if nums[0] < 0 or nums[1] < 1 or nums[2] < 1:
      raise UsageError(f"demo: --schedule part {part!r}: the step must be"
                       " >= 0 and the data and tensor degrees >= 1")
    phases.append(Phase(*nums))
  steps = [p.step for p in phases]
  if steps[0] != 0 or steps != sorted(set(steps)):
    raise UsageError(f"demo: --schedule steps {steps} must start at 0 and"
                     " increase")
  return tuple(phases)


def _lm_schedule(text: str, lm) -> str:
  """The demo's ``--schedule`` as the LM trainer's phases.

  Either the LM trainer's ``'STEP:AXIS=N,... STEP:...'`` (axes data, fsdp,
  tensor, stage; ``mb=M``) or the shorthand ``'STEP:DATAxTENSOR,...'``.

  Example:
    >>> _lm_schedule("0:4x2,10:2x2", None)
    '0:data=4,tensor=2 10:data=2,tensor=2'
  """
  if "=" in text:
    try:
      lm.configs.parse(text)
    except ValueError as e:
      raise UsageError(f"demo: --schedule: {e}") from None
    return text
  return " ".join(f"{p.step}:data={p.data},tensor={p.tensor}"
                  for p in _parse_schedule(text))


def _demo(args: argparse.Namespace) -> int:
  if args.devices < 1 or args.steps < 1:
    raise UsageError(f"demo: --devices and --steps must be positive, not"
                     f" {args.devices} and {args.steps}")
  from tenplex_jax import demo

  v = args.deterministic
  lm = demo.load_lm_trainer() if args.schedule and "=" in args.schedule else None
  if args.schedule:
    text = _lm_schedule(args.schedule, lm)
  else:
    text = demo.LM_SCHEDULE
  lm = lm or demo.load_lm_trainer()
  phases = lm.configs.parse(text)
  for p in phases:  # before the backend starts
    if p.devices > args.devices:
      raise UsageError(
          f"demo: the phase at step {p.step} ({p.degrees}) needs {p.devices}"
          f" devices, --devices is {args.devices}; give --devices"
          f" {max(q.devices for q in phases)} or a --schedule whose phases fit,"
          " e.g. '0:2x1,10:1x2'")
    if p.degrees is None:
      raise UsageError(f"demo: the phase at step {p.step} gives only a device count;"
                       " give its degrees (STEP:AXIS=N,...)")
  if v is not None:
    for p in phases:
      d = dict(p.degrees)
      dp = d.get("data", 1) * d.get("fsdp", 1)
      if v < 1 or v % dp:
        raise UsageError(f"demo: --deterministic {v}: the data degree {dp} of the"
                         f" phase at step {p.step} must divide it")

  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError:  # backends already up (e.g. called from a test)
    pass
  if len(jax.devices()) < args.devices:
    raise UsageError(f"demo: --devices {args.devices}: only"
                     f" {len(jax.devices())} devices exist")
  print(f"tenplex_jax demo: the LM trainer (examples/lm), {args.steps} steps on"
        " simulated CPU devices, schedule " + ", ".join(
            f"step {p.step}: {p.devices} devices ("
            + " x ".join(f"{k} {n}" for k, n in p.degrees) + ")" for p in phases))
  result = demo.run_lm(text, steps=args.steps, deterministic=v, plot=args.plot,
                       log=print)
  el = result.elastic
  print(f"\n{len(result.reports)} reconfigurations"
        f" ({sum(r['reconfig_s'] for r in el) * 1e3:.0f} ms,"
        f" {sum(r['reconfig_bytes'] for r in el) / 2**10:.0f} KiB moved; compiling the"
        f" new meshes' steps took {sum(r['compile_s'] for r in el):.1f} s); final loss"
        f" {el[-1]['loss']:.4f} (first {el[0]['loss']:.4f})")
  print(f"max |loss - loss of a run that never resized| = {result.max_abs_loss_diff:.2e}")
  if v is not None:
    print(f"deterministic ({v} virtual workers): losses and final params are "
          + ("bitwise identical to the static run" if result.bitwise_identical else
             "NOT bitwise identical to the static run"))
  if args.plot:
    print(f"plot: {args.plot}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({
        "schedule": text, "losses": [r["loss"] for r in el],
        "static_losses": [r["loss"] for r in result.static],
        "elastic": list(el), "static": list(result.static),
        "max_abs_loss_diff": result.max_abs_loss_diff,
        "bitwise_identical": result.bitwise_identical,
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

  d = sub.add_parser("demo", help="train the pipelined LM of examples/lm on"
                     " simulated CPU devices, re-meshed 8 -> 4 -> 2 -> 8 devices"
                     " with changing (data, fsdp, tensor, stage) degrees")
  d.add_argument("--steps", type=int, default=24)
  d.add_argument("--devices", type=int, default=8)
  d.add_argument("--schedule", help="phases 'STEP:AXIS=N,... STEP:...' (axes data,"
                 " fsdp, tensor, stage; mb=M microbatches), or the shorthand"
                 " 'STEP:DATAxTENSOR,...'; default"
                 " '0:data=2,tensor=2,stage=2 6:fsdp=2,stage=2 12:tensor=2"
                 " 18:data=2,tensor=2,stage=2'")
  d.add_argument("--json", help="write the per-step logs and the reports to this file")
  d.add_argument("--plot", default="tenplex-demo.png",
                 help="save the loss curves here (default tenplex-demo.png; '' for none)")
  d.add_argument("--deterministic", type=int, metavar="V",
                 help="sum gradients over V virtual workers in a fixed order"
                 " (every phase's data x fsdp degree must divide V; any tensor and"
                 " stage degrees): the run is bitwise identical to the static run")
  d.set_defaults(func=_demo)
