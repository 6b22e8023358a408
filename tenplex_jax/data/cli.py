"""``tenplex-jax data``: build and inspect dataset indexes (thin layer over the library)."""

from __future__ import annotations

import argparse
import json
import os

from tenplex_jax.data.index import build_index, load_index, save_index
from tenplex_jax.errors import UsageError


def _index(args: argparse.Namespace) -> int:
  """Errors reach the CLI's convention (stderr, exit 2 for a bad file)."""
  for f in args.files:
    if not os.path.isfile(f):
      raise UsageError(f"data index: {f!r} is not a file")
  index = build_index(args.files, mixed=args.mixed)
  save_index(index, args.out)
  print(json.dumps({"out": args.out, "num_samples": index.num_samples,
                    "files": len(index.files), "fingerprint": index.fingerprint}))
  return 0


def _info(args: argparse.Namespace) -> int:
  index = load_index(args.index_dir)
  lengths = index.entries[:, 2]
  print(json.dumps({
      "num_samples": index.num_samples, "fingerprint": index.fingerprint,
      "files": [f.to_json() for f in index.files],
      "bytes": int(lengths.sum()) if index.num_samples else 0,
      "max_offset": int(index.entries[:, 1].max()) if index.num_samples else 0,
  }, indent=1))
  return 0


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds ``data index`` and ``data info`` to the ``tenplex-jax`` parser.

  Example:
    >>> p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="verb")
    >>> register(sub)
    >>> p.parse_args(["data", "index", "--out", "d", "a.npy"]).files
    ['a.npy']
  """
  data = subparsers.add_parser("data", help="dataset index for the elastic iterator")
  sub = data.add_subparsers(dest="data_verb", required=True)
  p = sub.add_parser("index", help="index .npy/.npz/.tpxr files by byte ranges and"
                     " .array_record files by record number")
  p.add_argument("--out", required=True, help="directory for index.npy and index.json")
  p.add_argument("--mixed", action="store_true",
                 help="allow samples of different shapes/dtypes (random"
                 " access only; the elastic iterator cannot batch them)")
  p.add_argument("files", nargs="+", help="data files, in sample order")
  p.set_defaults(func=_index)
  q = sub.add_parser("info", help="print an index's header and fingerprint")
  q.add_argument("index_dir")
  q.set_defaults(func=_info)
