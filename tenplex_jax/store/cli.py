"""``tenplex-jax store ...`` verbs: serve, ls, read, verify, gc.

Bad input (a directory that is not a store, a malformed tensor path or
index) raises :class:`~tenplex_jax.errors.UsageError` (exit 2); a failed
operation (a corrupt snapshot, an unreachable server) raises
:class:`~tenplex_jax.errors.StoreError` or returns 1. ``tenplex_jax.cli``
prints either as one ``tenplex-jax: error: <message>`` line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

from tenplex_jax.errors import StoreError, UsageError
from tenplex_jax.locations import OBJECT, PEER, parse_location
from tenplex_jax.store.format import (HostStore, check_tensor_path, gc,
                                      parse_index)
from tenplex_jax.store.objects import ObjectStore, gc_objects
from tenplex_jax.store.server import RemoteStore, serve

__all__ = ["register"]


def _serve(args) -> int:
  if args.read_only and not os.path.isdir(args.dir):
    raise UsageError(f"--dir {args.dir}: no such directory (a --read-only"
                     " server does not create it)")
  serve(args.dir, args.port, host=args.host, ready_file=args.ready_file,
        token_file=args.token_file, read_only=args.read_only,
        tls_cert=args.tls_cert, tls_key=args.tls_key)
  return 0


def _store_dir(path: str, verb: str = "this verb"):
  """The handle of ``path``, which must be an existing store: a directory
  (:class:`HostStore`) or an object-storage prefix (``ObjectStore``)."""
  loc = parse_location(path)
  if loc.kind == PEER:
    raise UsageError(f"{path}: {verb} takes a store directory or an"
                     " s3:// or gs:// store, not a store server")
  if loc.kind == OBJECT:
    st = ObjectStore(loc.target)
    if not st.is_store():
      raise UsageError(f"{path} is not a tenplex_jax store (no STORE_ID and"
                       " no procs/ objects)")
    return st
  path = loc.target
  if not os.path.isdir(path):
    raise UsageError(f"{path}: no such directory")
  st = HostStore(path)
  if not st.is_store():
    raise UsageError(f"{path} is not a tenplex_jax store (no STORE_ID and no"
                     " procs/ directory)")
  return st


def _when(t) -> str:
  try:
    return datetime.datetime.fromtimestamp(
        float(t), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
  except (TypeError, ValueError, OverflowError):
    return "?"


def _ls(args) -> int:
  loc = args.location
  if parse_location(loc).kind == PEER:
    with RemoteStore(parse_location(loc).target, timeout=10,
                     retries=1, ca_file=args.ca_file) as rs:
      rounds, problems = rs.all_rounds()
      current = dict(rs.manifests())
      sid = rs.store_id
  else:
    st = _store_dir(loc)
    rounds, problems = st.all_rounds()
    current = {}
    for k in rounds:
      try:
        current[k] = st.manifest(k)
      except StoreError:
        pass
    sid = st.identity() if not st.identity().startswith(("dir:", "url:")) \
        else None
  print(f"store {loc} (id {sid})")
  if not rounds:
    print("  no snapshots")
  for proc, ms in sorted(rounds.items()):
    print(f"process {proc}: {len(ms)} snapshot{'s' * (len(ms) != 1)}")
    for m in ms:
      cur = current.get(proc)
      mark = "*" if cur is not None and cur.get("checksum") == m.get(
          "checksum") and cur.get("created") == m.get("created") else " "
      print(f" {mark} step {m['step']:>8}  save {m.get('seq', 0):>4}  run"
            f" {m.get('run', '')!r:<24} {_when(m.get('created'))}"
            f"  {m['nbytes']:>12} bytes  {len(m['tensors'])} tensors"
            f"  mode {m['mode']}")
    cur = current.get(proc)
    if args.tensors and cur is not None:
      for path, t in cur["tensors"].items():
        boxes = " ".join(
            "[" + ", ".join(f"{a}:{b}" for a, b in e["box"]) + "]"
            for e in t["boxes"])
        print(f"     {path:40s} {t['dtype']:>14s}"
              f" {str(tuple(t['shape'])):>16s}  {boxes}")
  if rounds:
    print("(* = CURRENT; restore combines snapshots of one round: run, step"
          " and save number)")
  for p in problems:
    print(f"problem: {p}")
  return 1 if problems else 0


def _read(args) -> int:
  st = _store_dir(args.dir, "store read")
  check_tensor_path(args.path)
  entries = st.round_of(args.path, args.proc, args.step, None)
  shape = entries[0][2]["shape"]
  try:
    box = parse_index(args.index, shape) if shape else ()
  except StoreError as e:
    raise UsageError(f"index {args.index!r} of {args.path} (shape"
                     f" {shape}): {e}") from None
  arr = st.read(args.path, box, proc=args.proc, round=entries[0][1])
  np.set_printoptions(threshold=args.max)
  print(arr)
  return 0


def _verify(args) -> int:
  st = _store_dir(args.dir, "store verify")
  problems = st.verify()
  rounds, _ = st.all_rounds()
  print(json.dumps({"ok": not problems,
                    "snapshots": sum(len(v) for v in rounds.values()),
                    "problems": problems}, indent=1))
  return 1 if problems else 0


def _gc(args) -> int:
  st = _store_dir(args.dir, "store gc")
  if args.min_age < 0:
    raise UsageError(f"--min-age {args.min_age}: must be >= 0")
  if st.remote:
    out = dict(gc_objects(st.root, min_age=args.min_age), skipped=[])
  else:
    out = gc(st.root, min_age=args.min_age)
  print(json.dumps({"bytes_reclaimed": out["bytes"],
                    "removed": out["removed"],
                    "skipped_live": out["skipped"]}, indent=1))
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  p = sub.add_parser("store", help="host tensor stores")
  verbs = p.add_subparsers(dest="store_verb", required=True)
  s = verbs.add_parser(
      "serve", help="serve a store directory over HTTP",
      description="Serves a store directory to the job's other hosts. Every"
      " request must carry the job's token (--token-file, else"
      " $TENPLEX_JAX_STORE_TOKEN) when one is set; a non-loopback --host"
      " needs one. With --tls-cert and --tls-key it speaks only TLS (1.2+;"
      " clients use https:// and verify it against $TENPLEX_JAX_STORE_CA):"
      " see docs/store.md, Security.")
  s.add_argument("--dir", required=True)
  s.add_argument("--port", type=int, default=0)
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--ready-file", default=None,
                 help="write HOST:PORT here once listening")
  s.add_argument("--token-file", default=None,
                 help="file holding the job's token, readable by you only:"
                 " chmod 600, else refused (default:"
                 " $TENPLEX_JAX_STORE_TOKEN)")
  s.add_argument("--read-only", action="store_true",
                 help="refuse uploads (serve only)")
  s.add_argument("--tls-cert", default=None,
                 help="PEM certificate (chain): serve HTTPS only")
  s.add_argument("--tls-key", default=None,
                 help="PEM private key of --tls-cert")
  s.set_defaults(func=_serve)
  s = verbs.add_parser("ls", help="list a store's kept snapshots (step,"
                       " save, run, time, bytes)")
  s.add_argument("location", help="store directory, http://HOST:PORT,"
                 " s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
  s.add_argument("--ca-file", default=None,
                 help="CA file to verify an https:// server against"
                 " (default: $TENPLEX_JAX_STORE_CA; with one set, http:// is"
                 " refused)")
  s.add_argument("--tensors", action="store_true",
                 help="also list the current snapshots' tensors and boxes")
  s.set_defaults(func=_ls)
  s = verbs.add_parser("read", help="print a sub-tensor, e.g. '[:, 2:4]'"
                       " (default: all of it), assembled from the boxes"
                       " held")
  s.add_argument("dir")
  s.add_argument("path")
  s.add_argument("index", nargs="?", default=":")
  s.add_argument("--step", type=int, default=None,
                 help="read the snapshot of this step (default: newest)")
  s.add_argument("--proc", type=int, default=None,
                 help="read only this saving process's snapshot")
  s.add_argument("--max", type=int, default=1000)
  s.set_defaults(func=_read)
  s = verbs.add_parser("verify", help="check every kept snapshot's"
                       " manifest and every box's checksum")
  s.add_argument("dir")
  s.set_defaults(func=_verify)
  s = verbs.add_parser("gc", help="reclaim what interrupted saves left"
                       " (staging directories of dead writers)")
  s.add_argument("dir")
  s.add_argument("--min-age", type=float, default=600.0,
                 help="seconds after which a staging directory without a"
                 " lock counts as abandoned (default 600)")
  s.set_defaults(func=_gc)


if __name__ == "__main__":  # pragma: no cover
  from tenplex_jax.cli import main
  sys.exit(main(["store", *sys.argv[1:]]))
