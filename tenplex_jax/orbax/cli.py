"""``tenplex-jax ckpt ...`` verbs: inspect and convert Orbax checkpoints
(and export tenplex_jax store snapshots as Orbax checkpoints)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

from tenplex_jax.errors import UnmatchedRuleWarning, UsageError
from tenplex_jax.orbax import (convert, inspect, scan_mapping,
                               unscan_mapping)
from tenplex_jax.orbax._convert import open_base

__all__ = ["register"]


def _size(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n}"  # pragma: no cover


def _inspect(args) -> int:
  info = inspect(args.path, step=args.step, item=args.item)
  if args.json:
    print(json.dumps(info, indent=1))
    return 0
  fmt = info["format"]
  print(f"{info['item']}: step {info['step']},"
        f" {'OCDBT' if fmt['ocdbt'] else 'no OCDBT'}, zarr v{fmt['zarr']},"
        f" {len(info['tensors'])} arrays, {_size(info['nbytes'])}")
  w = max([len(p) for p in info["tensors"]] + [4])
  print(f"{'path':{w}s} {'dtype':>9s} {'shape':>18s} {'chunk':>18s}"
        f" {'size':>10s}  saved sharding")
  for p, t in info["tensors"].items():
    print(f"{p:{w}s} {t['dtype']:>9s} {str(tuple(t['shape'])):>18s}"
          f" {str(tuple(t['chunk_shape'])):>18s} {_size(t['nbytes']):>10s}"
          f"  {t['spec']}")
  for p, v in info["others"].items():
    print(f"{p:{w}s} {v}")
  return 0


def _convert(args) -> int:
  layout = None  # the saved layout
  if args.layout:
    try:
      layout = json.loads(pathlib.Path(args.layout).read_text())
    except (OSError, ValueError) as e:
      raise UsageError(f"--layout {args.layout}: {e}") from e
  mapping = None
  if args.map:
    try:
      mapping = json.loads(pathlib.Path(args.map).read_text())
    except (OSError, ValueError) as e:
      raise UsageError(f"--map {args.map}: {e}") from e
  if args.scan or args.unscan:
    with open_base(args.src, args.step, args.item, 0) as src:
      held = src.tensors()
      mapping = dict(mapping or {})
      if args.scan:
        mapping.update(scan_mapping(list(held), axis=args.axis))
      if args.unscan:
        mapping.update(unscan_mapping(held, axis=args.axis))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", UnmatchedRuleWarning)
    rep = convert(args.src, args.dst, layout,
                  memory_limit=args.memory_limit, mapping=mapping,
                  step=args.step, item=args.item, ocdbt=args.ocdbt,
                  allow_unmatched=args.allow_unmatched,
                  progress=not args.quiet and sys.stderr.isatty())
  for w in caught:
    if issubclass(w.category, UnmatchedRuleWarning):
      print(f"tenplex-jax: warning: {w.message}", file=sys.stderr)
    else:
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  print(json.dumps(rep))
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("ckpt", help="Orbax checkpoints: inspect, convert")
  verbs = p.add_subparsers(dest="ckpt_verb", required=True)
  s = verbs.add_parser("inspect", help="the tree, shapes, dtypes, chunks,"
                       " sizes and saved shardings of an Orbax checkpoint")
  s.add_argument("path", help="CheckpointManager, step or item directory"
                 " (local, s3://BUCKET/DIR or gs://BUCKET/DIR)")
  s.add_argument("--step", type=int, default=None)
  s.add_argument("--item", default=None)
  s.add_argument("--json", action="store_true", help="print JSON")
  s.set_defaults(func=_inspect)
  s = verbs.add_parser("convert", help="rewrite a checkpoint for another"
                       " layout (streamed, bounded memory, no devices)")
  s.add_argument("src", help="an Orbax checkpoint (CheckpointManager, step"
                 " or item directory) or a tenplex_jax store directory (its"
                 " newest complete snapshot, or --step)")
  s.add_argument("dst", help="the new checkpoint (must not exist; a"
                 " directory, s3:// or gs://)")
  s.add_argument("--layout", default=None, help="a PTC JSON file, or JSON"
                 ' {"mesh": {"data": 2, "tensor": 4}, "rules":'
                 ' [["regex", [null, "tensor"]], ...]} (default: the saved'
                 " layout); anything else, an unknown key, or a rule that"
                 " matches no tensor is an error")
  s.add_argument("--allow-unmatched", action="store_true", help="a --layout"
                 " rule whose regex matches no tensor is a warning naming it"
                 " (default: an error)")
  s.add_argument("--memory-limit", default="512MiB")
  s.add_argument("--map", default=None, help="JSON mapping new path -> rule"
                 " (rename, stack, unstack, reshape)")
  s.add_argument("--scan", action="store_true", help="stack .../layers_N/..."
                 " leaves into .../layers/... (MaxText unscanned -> scanned)")
  s.add_argument("--unscan", action="store_true", help="split .../layers/..."
                 " leaves into .../layers_N/...")
  s.add_argument("--axis", type=int, default=0, help="the layers axis")
  s.add_argument("--step", type=int, default=None)
  s.add_argument("--item", default=None)
  s.add_argument("--ocdbt", action="store_true", help="write one OCDBT"
                 " key-value store (Orbax's default format) instead of a"
                 " directory per array")
  s.add_argument("--quiet", action="store_true", help="no progress bar")
  s.set_defaults(func=_convert)
