"""``tenplex-jax store ...`` verbs: serve, ls, read, verify."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register"]


def _serve(args) -> int:
  from tenplex_jax.store.server import serve
  serve(args.dir, args.port, host=args.host, ready_file=args.ready_file)
  return 0


def _ls(args) -> int:
  from tenplex_jax.store.api import open_store
  st = open_store(args.location)
  for proc, m in sorted(st.manifests().items()):
    print(f"process {proc}: step {m['step']}, mode {m['mode']},"
          f" {m['nbytes']} bytes")
    for path, t in m["tensors"].items():
      boxes = " ".join(
          "[" + ", ".join(f"{a}:{b}" for a, b in e["box"]) + "]"
          for e in t["boxes"])
      print(f"  {path:40s} {t['dtype']:>14s} {str(tuple(t['shape'])):>16s}"
            f"  {boxes}")
  return 0


def _read(args) -> int:
  import numpy as np
  from tenplex_jax.store.format import HostStore
  arr = HostStore(args.dir).read(args.path, args.index)
  np.set_printoptions(threshold=args.max)
  print(arr)
  return 0


def _verify(args) -> int:
  from tenplex_jax.store.format import HostStore
  problems = HostStore(args.dir).verify()
  print(json.dumps({"ok": not problems, "problems": problems}, indent=1))
  return 1 if problems else 0


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("store", help="host tensor stores")
  verbs = p.add_subparsers(dest="store_verb", required=True)
  s = verbs.add_parser("serve", help="serve a store directory over HTTP")
  s.add_argument("--dir", required=True)
  s.add_argument("--port", type=int, default=0)
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--ready-file", default=None,
                 help="write HOST:PORT here once listening")
  s.set_defaults(func=_serve)
  s = verbs.add_parser("ls", help="list a store's snapshots and tensors")
  s.add_argument("location", help="store directory or http://HOST:PORT")
  s.set_defaults(func=_ls)
  s = verbs.add_parser("read", help="print a sub-tensor, e.g. '[:, 2:4]'")
  s.add_argument("dir")
  s.add_argument("path")
  s.add_argument("index", nargs="?", default=":")
  s.add_argument("--max", type=int, default=1000)
  s.set_defaults(func=_read)
  s = verbs.add_parser("verify", help="check every box's checksum")
  s.add_argument("dir")
  s.set_defaults(func=_verify)


if __name__ == "__main__":  # pragma: no cover
  from tenplex_jax.cli import main
  sys.exit(main(["store", *sys.argv[1:]]))
