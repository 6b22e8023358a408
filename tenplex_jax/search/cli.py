"""``tenplex-jax search``: rank layouts for a model on a device set.

A thin layer over :func:`tenplex_jax.search.search`.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from tenplex_jax.errors import SearchError, UsageError
from tenplex_jax.search.hardware import HARDWARE_PRESETS
from tenplex_jax.search.model import MODEL_PRESETS
from tenplex_jax.search.search import SearchResult, search


def register(subparsers) -> None:
  """Adds the ``search`` verb to the ``tenplex-jax`` parser.

  Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); sub = p.add_subparsers()
    >>> register(sub)
    >>> p.parse_args(["search", "--model", "gpt3-2.7b", "--devices", "16",
    ...               "--global-batch", "128"]).hardware
    'a6000'
  """
  p = subparsers.add_parser(
      "search", help="rank mesh layouts (data, fsdp, tensor, pipeline) for a model",
      description="Analytical configuration search (docs/search.md).")
  p.add_argument("--model", required=True, choices=MODEL_PRESETS)
  p.add_argument("--hardware", default="a6000", choices=HARDWARE_PRESETS)
  p.add_argument("--devices", type=int, required=True)
  p.add_argument("--devices-per-host", type=int, default=None)
  p.add_argument("--global-batch", type=int, required=True)
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--optimizer-bytes", type=int, default=12,
                 help="optimizer state bytes per parameter (Adam fp32: 12)")
  p.add_argument("--no-fsdp", action="store_true",
                 help="only fsdp=1 layouts (the paper's (T, P, D) space)")
  p.add_argument("--allow-cross-host-tensor", action="store_true",
                 help="do not reject tensor groups that span hosts")
  p.add_argument("--top", type=int, default=10, help="rows in the table")
  p.add_argument("--json", action="store_true",
                 help="print a JSON list of feasible candidates, best first")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  """Runs the search for parsed ``args``; prints JSON or a table; returns 0.

  Raises :class:`SearchError` (exit 2) when no layout is feasible, naming
  the rejection reasons and the memory limit, and :class:`UsageError` for
  counts that are not positive.
  """
  for flag, v in (("--devices", args.devices), ("--global-batch",
                                                 args.global_batch),
                  ("--devices-per-host", args.devices_per_host),
                  ("--seq-len", args.seq_len), ("--top", args.top)):
    if v is not None and v < 1:
      raise UsageError(f"search: {flag} must be a positive integer, not {v}")
  res = search(args.model, args.hardware, devices=args.devices,
               devices_per_host=args.devices_per_host,
               global_batch=args.global_batch, seq_len=args.seq_len,
               optimizer_bytes=args.optimizer_bytes,
               tensor_within_host=not args.allow_cross_host_tensor,
               restrict={"fsdp": (1,)} if args.no_fsdp else None)
  if not res.candidates:
    counts = ", ".join(f"{k} {v}" for k, v in
                       sorted(res.rejection_counts().items())) or "none"
    raise SearchError(
        f"search: no feasible layout for {res.model.name} on"
        f" {res.topology.devices} x {res.topology.hardware.name}"
        f" ({res.topology.devices_per_host}/host), global batch"
        f" {res.workload.global_batch}, seq {res.workload.seq_len}; rejected"
        f" candidates by reason: {counts}; memory limit per device"
        f" {res.memory_limit_bytes / 2**30:.1f} GiB (more devices, a smaller"
        " batch or --allow-cross-host-tensor may help)")
  if args.json:
    json.dump([c.to_json() for c in res.candidates], sys.stdout)
    sys.stdout.write("\n")
    return 0
  _print_table(res, args.top)
  return 0


def _print_table(res: SearchResult, top: int) -> None:
  topo = res.topology
  table = Table(title=(
      f"{res.model.name} on {topo.devices} x {topo.hardware.name}"
      f" ({topo.devices_per_host}/host), batch {res.workload.global_batch},"
      f" seq {res.workload.seq_len}: {len(res.candidates)} feasible,"
      f" searched in {res.elapsed_s * 1e3:.1f} ms"))
  for col in ("#", "data", "fsdp", "tensor", "pipe", "micro", "remat",
              "step s", "samp/s", "GiB"):
    table.add_column(col, justify="right", no_wrap=True)
  for i, c in enumerate(res.candidates[:top], 1):
    table.add_row(str(i), str(c.data), str(c.fsdp), str(c.tensor),
                  str(c.pipeline), str(c.microbatches), c.remat,
                  f"{c.step_time_s:.3f}",
                  f"{res.workload.global_batch / c.step_time_s:.1f}",
                  f"{c.memory_bytes / 2**30:.1f}")
  console = Console()
  console.print(table)
  counts = res.rejection_counts()
  limit = res.memory_limit_bytes / 2**30
  console.print(f"memory limit per device: {limit:.1f} GiB")
  console.print("rejected: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                                or "none"))
