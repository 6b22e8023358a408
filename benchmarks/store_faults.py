"""Fault campaign for the tensor stores (issue 17): what survives, never wrong
data.

  python benchmarks/store_faults.py [--kills 24] [--restore-kills 6]
      [--corruptions 40] [--readers 200] [--fuzz 600] [--out FILE.json]

Each part reports what was tried, how many times, and the outcomes; every
restore is compared bitwise with the rounds that were saved, and an outcome
is one of ``new`` (the round being saved, when the kill came after its
commit), ``previous`` (the last complete round), ``error`` (a clear
``StoreError``) or ``WRONG`` (anything else: different bytes, a mix). The
campaign fails (exit 1) on any ``WRONG`` or on a file outside a store.

1. ``kill_save``: a saving process is killed with SIGKILL at a random byte
   offset of its chunk writes (the writer sends SIGKILL to itself once that
   many bytes went through ``writev``: no cleanup runs) or at a random
   phase boundary (manifest written, renamed, CURRENT swapped, pruning),
   alternately during ``store.save`` (one process, 4 devices) and during a
   two-process round (both processes' ``SnapshotWriter``s, killed in the
   second); then restore, ``gc`` (bytes reclaimed) and the next save.
2. ``kill_restore``: a store server (``tenplex-jax store serve``, with a
   token) is SIGKILLed at a random moment while this process restores
   from it, with a replica of its data in another store (half the trials)
   or without.
3. ``corrupt``: torn, edited, traversing manifests and CURRENT files
   (random kinds, random snapshot of the newest round).
4. ``full_disk``: saves into a small tmpfs (mounted here if possible, else
   ``RLIMIT_FSIZE`` in a child) until the disk is full, at random sizes.
5. ``server_load``: ``--readers`` concurrent readers (each its own
   connection, a random piece, compared bitwise) plus slow clients (one
   header byte every 0.5 s; a reader that takes its answer at 4 KiB/s).
6. ``fuzz``: malformed HTTP requests: random mutations of valid requests
   on every route (byte flips, truncation, traversal strings spliced into
   the path, the query and the JSON body, huge and negative numbers).

Loopback only; every process started is killed (process group) on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
with contextlib.suppress(Exception):
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tenplex_jax.errors import StoreError  # noqa: E402
from tenplex_jax.store import api, format as fmt  # noqa: E402
from tenplex_jax.store.server import (TOKEN_ENV, make_server,  # noqa: E402
                                      new_token)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from store_state import save_as_two  # noqa: E402  (shared with the store tests)

SHAPES = {"a": (256, 1024), "b": (1024, 96), "c": (64,)}  # ~1.4 MiB f32


def state_np(r: int) -> dict[str, np.ndarray]:
  """The arrays of round ``r`` (different values per round)."""
  rng = np.random.default_rng(r)
  return {k: rng.standard_normal(s).astype(np.float32)
          for k, s in SHAPES.items()}


def _mesh(n, start=0):
  return Mesh(np.array(jax.devices()[start:start + n]), ("d",))


def round_tree(r: int) -> dict:
  """The state saved in round ``r``: its arrays in rows over 4 devices."""
  sharding = NamedSharding(_mesh(4), P("d"))
  return {k: jax.device_put(v, sharding)
          for k, v in state_np(r).items()} | {"round": r}


def target():
  m = _mesh(2, 4)
  return {k: jax.ShapeDtypeStruct(s, jnp.float32,
                                  sharding=NamedSharding(m, P("d")))
          for k, s in SHAPES.items()} | {"round": 0}


def classify(out, new: int, prev: int | None) -> str:
  got = {k: np.asarray(out[k]).tobytes() for k in SHAPES}
  for name, r in (("new", new), ("previous", prev)):
    if r is None:
      continue
    want = state_np(r)
    if all(got[k] == want[k].tobytes() for k in SHAPES) \
        and out["round"] == r:
      return name
  return "WRONG"


def restore_outcome(locs, new, prev) -> tuple[str, str]:
  try:
    out = api.restore(locs, target(), timeout=5, retries=1)
  except StoreError as e:
    return "error", str(e)[:200]
  return classify(out, new, prev), ""


# ------------------------------------------------------------ 1. kill_save

_CHILD = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
cfg = json.loads(sys.argv[2])
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import store_faults as sf
from tenplex_jax.store import api, format as fmt

written = [0]
def die():
  os.kill(os.getpid(), signal.SIGKILL)
kill_at = cfg["byte"]
orig_write = fmt._write_all
def write_all(fd, bufs):
  n = sum(memoryview(b).nbytes for b in bufs)
  if kill_at is not None and written[0] + n >= kill_at:
    # write part of it, then die: a torn chunk file
    part = kill_at - written[0]
    flat = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)[:part]
    os.write(fd, flat)
    die()
  written[0] += n
  orig_write(fd, bufs)
fmt._write_all = write_all
phase = cfg["phase"]
def hook(name, fn):
  def wrapped(*a, **k):
    if phase == "before_" + name:
      die()
    out = fn(*a, **k)
    if phase == "after_" + name:
      die()
    return out
  return wrapped
fmt.write_current = hook("current", fmt.write_current)
fmt.prune_snapshots = hook("prune", fmt.prune_snapshots)
fmt._trash = hook("trash", fmt._trash)
_rename = os.rename
def rename(a, b):
  if phase == "before_rename" and ".staging-" in a:
    die()
  _rename(a, b)
  if phase == "after_rename" and ".staging-" in a:
    die()
fmt.os.rename = rename

r = cfg["round"]
tree = sf.round_tree(r)
run = f"trial-{r}"
if cfg["mode"] == "save":
  api.save(tree, cfg["dirs"][0], step=r, run=run)
else:  # a two-process round: process k holds devices 2k, 2k+1
  sf.save_as_two(cfg["dirs"], tree, r, keep=2, run=run)
print("committed", flush=True)
"""

PHASES = ["before_rename", "after_rename", "before_current", "after_current",
          "before_prune", "after_trash"]


def _run_child(cfg: dict, timeout: float = 180.0) -> int:
  p = subprocess.Popen([sys.executable, "-c", _CHILD, ROOT, json.dumps(cfg)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       start_new_session=True)
  try:
    p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
    raise
  finally:
    if p.returncode is None:  # not reaped: its group id is still its own
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
  return p.returncode


def _save_round(mode: str, dirs, r: int) -> None:
  """Saves round ``r`` completely, in this process (as the child would)."""
  if mode == "save":
    api.save(round_tree(r), dirs[0], step=r, run=f"trial-{r}")
  else:
    _save_sim(dirs, r, run=f"trial-{r}")


def kill_save(trials: int, base: str, rng: random.Random) -> dict:
  res = {"trials": 0, "outcomes": {}, "by_point": [], "bytes_reclaimed": 0,
         "staging_left": 0}
  for mode in ("save", "round2"):
    d = os.path.join(base, f"kill-{mode}")
    dirs = [os.path.join(d, "p0"), os.path.join(d, "p1")]
    locs = dirs if mode == "round2" else dirs[:1]
    nbytes = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    r = 1
    _save_round(mode, dirs, r)
    prev = r
    for i in range(trials // 2):
      r += 1
      byte = phase = None
      if i % 3 == 2:
        phase = rng.choice(PHASES)
      else:
        byte = rng.randrange(0, nbytes)
        if mode == "round2" and i % 2:  # in the second process's save
          byte = nbytes // 2 + rng.randrange(0, nbytes // 2)
      rc = _run_child({"mode": mode, "dirs": dirs, "round": r, "byte": byte,
                       "phase": phase})
      outcome, msg = restore_outcome(locs, r, prev)
      res["trials"] += 1
      res["outcomes"][outcome] = res["outcomes"].get(outcome, 0) + 1
      res["by_point"].append({"mode": mode, "byte": byte, "phase": phase,
                              "exit": rc, "outcome": outcome, "error": msg})
      for x in dirs:
        if os.path.isdir(x):
          res["bytes_reclaimed"] += fmt.gc(x, min_age=0)["bytes"]
      if outcome == "new":
        prev = r
      if outcome == "error":  # nothing complete: save a round again
        r += 1
        _save_round(mode, dirs, r)
        prev = r
    for x in dirs:
      for dd, sub, _ in os.walk(x):
        res["staging_left"] += sum(n.startswith(".staging-") for n in sub)
  return res


# --------------------------------------------------------- 2. kill_restore


def kill_restore(trials: int, base: str, rng: random.Random) -> dict:
  res = {"trials": 0, "outcomes": {}, "with_replica": 0,
         "killed_mid_restore": 0}
  token = new_token()
  env = dict(os.environ, **{TOKEN_ENV: token, "PYTHONPATH": ROOT})
  for i in range(trials):
    d = os.path.join(base, f"restore-{i}")
    dirs = [os.path.join(d, "p0"), os.path.join(d, "p1")]
    replica = os.path.join(d, "replica1")
    r = 100 + i
    _save_round("round2", dirs, r)
    with_replica = i % 2 == 0
    if with_replica:  # a copy of process 1's store, served by a survivor
      shutil.copytree(dirs[1], replica)
      os.unlink(os.path.join(replica, "STORE_ID"))  # a store of its own
      fmt.ensure_store_id(replica)
    procs = []
    stalled = os.path.join(d, "stalled")
    limit = 0  # the victim holds the first read (one request here)

    def start(sdir, tag):
      ready = os.path.join(d, f"ready-{tag}")
      cmd = ([sys.executable, os.path.join(ROOT, "tests",
                                           "stalling_store_server.py"),
              sdir, ready, stalled, str(limit)] if tag == "victim" else
             [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
              sdir, "--ready-file", ready])
      p = subprocess.Popen(cmd, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
      procs.append(p)
      deadline = time.time() + 120
      while not os.path.exists(ready):
        if time.time() > deadline or p.poll() is not None:
          raise RuntimeError("store server did not start")
        time.sleep(0.05)
      with open(ready) as f:
        return p, "http://" + f.read()

    try:
      srv, url = start(dirs[1], "victim")
      rurl = start(replica, "replica")[1] if with_replica else None
      done = threading.Event()

      def kill_when_stalled():
        # The victim answered `limit` reads and holds the next one: the
        # restore is provably in flight against it. Kill it then (or when
        # the restore ended without stalling it).
        while not done.is_set() and not os.path.exists(stalled):
          time.sleep(0.01)
        os.killpg(srv.pid, signal.SIGKILL)

      killer = threading.Thread(target=kill_when_stalled)
      old = os.environ.get(TOKEN_ENV)
      os.environ[TOKEN_ENV] = token
      killer.start()
      try:
        locs = [dirs[0], url] + ([rurl] if with_replica else [])
        outcome, msg = restore_outcome(locs, r, None)
      finally:
        done.set()
        killer.join()
        if old is None:
          os.environ.pop(TOKEN_ENV, None)
        else:
          os.environ[TOKEN_ENV] = old
    finally:
      for p in procs:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if outcome == "error" and with_replica:
      outcome = "WRONG"  # a surviving replica must be used
    res["trials"] += 1
    res["with_replica"] += with_replica
    mid = os.path.exists(stalled)
    res["killed_mid_restore"] = res.get("killed_mid_restore", 0) + mid
    key = (f"{outcome} ({'replica' if with_replica else 'no replica'},"
           f" {'killed mid-restore' if mid else 'killed after'})")
    res["outcomes"][key] = res["outcomes"].get(key, 0) + 1
  return res


# -------------------------------------------------------------- 3. corrupt

KINDS = ["truncate", "flip", "edit_extras", "traverse_dir", "traverse_rehash",
         "absolute_dir", "delete", "current_garbage", "current_traverse",
         "current_truncate", "current_missing_snap"]


def _save_sim(dirs, r, procs=(0, 1), keep=2, run=None):
  return save_as_two(dirs, round_tree(r), r, procs=procs, keep=keep,
                     run=f"c{r}" if run is None else run)


def corrupt(trials: int, base: str, rng: random.Random) -> dict:
  res = {"trials": 0, "outcomes": {}, "kinds": {}}
  for i in range(trials):
    d = os.path.join(base, f"corrupt-{i}")
    dirs = [os.path.join(d, "p0"), os.path.join(d, "p1")]
    _save_sim(dirs, 2 * i + 1)
    snaps = _save_sim(dirs, 2 * i + 2)
    kind = KINDS[i % len(KINDS)]
    k = rng.randrange(2)
    snap = snaps[k]
    mp = os.path.join(snap, "manifest.json")
    cur = os.path.join(os.path.dirname(snap), "CURRENT")
    if kind == "truncate":
      with open(mp, "r+b") as f:
        f.truncate(rng.randrange(0, os.path.getsize(mp)))
    elif kind == "flip":
      with open(mp, "r+b") as f:
        pos = rng.randrange(os.path.getsize(mp))
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    elif kind in ("edit_extras", "traverse_dir", "traverse_rehash",
                  "absolute_dir"):
      with open(mp) as f:
        m = json.load(f)
      if kind == "edit_extras":
        m["extras"]["round"] = 999
      elif kind == "absolute_dir":
        m["tensors"]["a"]["boxes"][0]["dir"] = "/etc"
      else:
        m["tensors"]["a"]["boxes"][0]["dir"] = "../../../../outside-box"
      if kind in ("traverse_rehash", "absolute_dir"):
        m["checksum"] = fmt.manifest_checksum(m)
      with open(mp, "w") as f:
        json.dump(m, f)
    elif kind == "delete":
      os.unlink(mp)
    elif kind == "current_garbage":
      with open(cur, "wb") as f:
        f.write(os.urandom(rng.randrange(1, 64)))
    elif kind == "current_traverse":
      with open(cur, "w") as f:
        f.write("../../../../etc\n")
    elif kind == "current_truncate":
      with open(cur, "r+b") as f:
        f.truncate(rng.randrange(0, os.path.getsize(cur)))
    elif kind == "current_missing_snap":
      name = "snap-0000000099-r000001-deadbeef"
      with open(cur, "w") as f:
        f.write(fmt._current_text(name))
    outcome, msg = restore_outcome(dirs, 2 * i + 2, 2 * i + 1)
    if kind.startswith("current") and outcome != "new":
      outcome = "WRONG" if outcome != "error" else outcome
    res["trials"] += 1
    res["outcomes"][outcome] = res["outcomes"].get(outcome, 0) + 1
    res["kinds"].setdefault(kind, {})
    res["kinds"][kind][outcome] = res["kinds"][kind].get(outcome, 0) + 1
  return res


# ------------------------------------------------------------ 4. full_disk


def _mount_tmpfs(path: str, mib: int) -> bool:
  os.makedirs(path, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs",
                      path], capture_output=True)
  return r.returncode == 0


def full_disk(trials: int, base: str, rng: random.Random) -> dict:
  res = {"trials": 0, "outcomes": {}, "failed_saves": 0, "how": None,
         "staging_left": 0}
  mnt = os.path.join(base, "tmpfs")
  if not _mount_tmpfs(mnt, 16):
    res["how"] = "not run: cannot mount a tmpfs (not root?)"
    return res
  res["how"] = "a 16 MiB tmpfs mounted for the campaign"
  try:
    m = _mesh(4)
    for i in range(trials):
      d = os.path.join(mnt, f"s{i}")
      # State sizes so that 1-3 rounds fit (keep=2 holds two).
      n = rng.choice([5, 7, 9, 11, 13, 15, 17]) << 20
      last = None
      for r in range(1, 6):
        x = np.full((n // 4,), float(r), np.float32)
        tree = {"x": jax.device_put(x, NamedSharding(m, P("d")))}
        try:
          api.save(tree, d, step=r, run=f"disk{i}")
          last = r
        except (StoreError, OSError) as e:
          res["failed_saves"] += 1
          tgt = {"x": jax.ShapeDtypeStruct(x.shape, jnp.float32,
                                           sharding=NamedSharding(
                                               _mesh(2, 4), P("d")))}
          try:
            out = api.restore([d], tgt)
            ok = last is not None and np.array_equal(
                np.asarray(out["x"]), np.full_like(x, float(last)))
            outcome = "previous" if ok else "WRONG"
          except StoreError:
            outcome = "error" if last is None else "WRONG"
          res["outcomes"][outcome] = res["outcomes"].get(outcome, 0) + 1
          res["trials"] += 1
          res.setdefault("errors", []).append(str(e)[:120])
          for dd, sub, _ in os.walk(d):
            res["staging_left"] += sum(s.startswith(".staging-")
                                       for s in sub)
          break
      shutil.rmtree(d, ignore_errors=True)
  finally:
    subprocess.run(["umount", "-l", mnt], capture_output=True)
  return res


# ---------------------------------------------------------- 5. server_load


def server_load(readers: int, base: str, rng: random.Random,
                slow: int = 10, slow_s: float = 10.0) -> dict:
  d = os.path.join(base, "load")
  dirs = [os.path.join(d, "p0"), os.path.join(d, "p1")]
  _save_sim(dirs, 7)
  want = state_np(7)
  token = new_token()
  srv = make_server(dirs[0], 0, token=token, head_timeout=2.0,
                    io_timeout=3.0, min_rate=8 << 20)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  port = srv.server_address[1]
  url = f"http://127.0.0.1:{port}"
  from tenplex_jax.store.server import RemoteStore
  res = {"readers": readers, "ok": 0, "wrong": 0, "errors": [],
         "slow_clients": slow, "slow_cut": 0, "slow_reader_cut": False}
  stop = threading.Event()

  def slowloris(i):
    s = None
    try:
      s = socket.create_connection(("127.0.0.1", port), timeout=10)
      s.sendall(b"GET /manifest HTTP/1.1\r\n")
      t0 = time.monotonic()
      while not stop.is_set() and time.monotonic() - t0 < slow_s:
        s.sendall(b"X")
        time.sleep(0.5)
    except OSError:
      with lock:
        res["slow_cut"] += 1
      return
    finally:
      if s is not None:
        s.close()

  def slow_reader():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"pieces": [[0, "a", "0:64,0:1024"]] * 64}).encode()
    s.sendall(b"POST /read HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + token.encode() + b"\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    got, t0 = 0, time.monotonic()
    try:
      s.settimeout(10)
      while time.monotonic() - t0 < slow_s:
        k = s.recv(4096)
        if not k:
          res["slow_reader_cut"] = True
          break
        got += len(k)
        time.sleep(1.0)
    except OSError:
      res["slow_reader_cut"] = True
    finally:
      s.close()
    res["slow_reader_bytes"] = got
    res["slow_reader_s"] = round(time.monotonic() - t0, 1)

  lock = threading.Lock()

  def reader(i):
    r = random.Random(i)
    name = r.choice(list(SHAPES))
    shape = SHAPES[name]
    q = shape[0] // 4  # process 0 holds the boxes of devices 0 and 1
    j = r.randrange(2)
    lo = j * q + r.randrange(0, q)
    hi = r.randrange(lo + 1, (j + 1) * q + 1)
    box = ((lo, hi),) + tuple((0, n) for n in shape[1:])
    dest = np.empty((hi - lo,) + shape[1:], np.uint32)
    try:
      with RemoteStore(url, timeout=30, retries=2, token=token) as rs:
        rs.read_into([(0, name, box, dest)])
      ok = dest.view(np.float32).tobytes() == want[name][lo:hi].tobytes()
      with lock:
        res["ok" if ok else "wrong"] += 1
    except Exception as e:
      with lock:
        res["errors"].append(f"{type(e).__name__}: {e}"[:160])

  t0 = time.monotonic()
  th = [threading.Thread(target=slowloris, args=(i,)) for i in range(slow)]
  th.append(threading.Thread(target=slow_reader))
  for x in th:
    x.start()
  time.sleep(0.2)
  rt = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
  for x in rt:
    x.start()
  for x in rt:
    x.join(120)
  res["readers_s"] = round(time.monotonic() - t0, 2)
  for x in th:
    x.join(60)
  stop.set()
  res["server_stats"] = {k: srv.stats.get(k) for k in
                         ("requests", "timed_out_head", "timed_out_io",
                          "over_capacity", "refused")}
  # The slow reader's answer was cut on the server's side (its deadline:
  # io_timeout + bytes / min_rate), the slow header senders at head_timeout.
  res["slow_reader_cut"] = srv.stats["timed_out_io"] >= 1
  res["slow_cut"] = min(srv.stats["timed_out_head"], slow)
  srv.shutdown()
  srv.server_close()
  return res


# ----------------------------------------------------------------- 6. fuzz

TRAVERSALS = ["../../../../tmp/tenplex-fuzz", "..%2F..%2F..%2Ftmp%2Fx",
              "/etc/passwd", "a/../../x", "%00", "\x00", "..", ".", "//",
              "-1", "99999999999999999999", "-99999999", "1e308", "NaN",
              "{}", "[]", "\"", "\\", "%", "\xff"]


def fuzz(n: int, base: str, rng: random.Random) -> dict:
  d = os.path.join(base, "fuzz", "box", "store")
  _save_sim([d, d + "1"], 9)
  sandbox = os.path.join(base, "fuzz")
  before = {os.path.join(a, x) for a, ds, fs in os.walk(sandbox)
            for x in ds + fs if not os.path.join(a, x).startswith(d)}
  token = new_token()
  srv = make_server(d, 0, token=token, head_timeout=1.0, io_timeout=1.0)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  port = srv.server_address[1]
  auth = f"Authorization: Bearer {token}\r\n"
  good = [
      "GET /manifest HTTP/1.1\r\n{auth}\r\n",
      "GET /stats HTTP/1.1\r\n{auth}\r\n",
      "GET /tensor/0/a?box=0:4,0:1024 HTTP/1.1\r\n{auth}\r\n",
      "POST /read HTTP/1.1\r\n{auth}Content-Length: {n}\r\n\r\n{body}",
      "POST /upload/0 HTTP/1.1\r\n{auth}Content-Length: {n}\r\n\r\n{body}",
  ]
  res = {"requests": n, "codes": {}, "files_outside": 0, "server_alive":
         False}
  tmp_before = {x for x in ("/tmp/tenplex-fuzz", "/tmp/x", "/etc/x")
                if os.path.exists(x)}
  for i in range(n):
    tpl = rng.choice(good)
    body = json.dumps({"pieces": [[0, "a", "0:4,0:1024"]]})
    if "upload" in tpl:
      head = json.dumps({"step": 1, "tensors": {"a": {
          "dtype": "float32", "itemsize": 4, "shape": [4]}}, "boxes": [[
              "a", [[0, 4]], 16, "uint32", [4]]]})
      body = (len(head).to_bytes(8, "little").decode("latin-1") + head
              + "\x00" * 16)
    trav = rng.choice(TRAVERSALS).replace("{", "{{").replace("}", "}}")
    how = rng.randrange(6)
    if how == 0:
      body = body.replace('"a"', json.dumps(trav), 1)
    elif how == 1:
      tpl = tpl.replace("/tensor/0/a", "/tensor/0/" + trav).replace(
          "/upload/0", "/upload/" + trav)
    elif how == 2:
      tpl = tpl.replace("box=0:4,0:1024", "box=" + trav).replace(
          " HTTP/1.1", f"&step={trav}&round={trav} HTTP/1.1", 1)
    elif how == 3:
      body = body.replace("0:4,0:1024", trav).replace("16", trav, 1)
    text = tpl.format(auth=auth if rng.random() > 0.1 else "",
                      n=len(body.encode("latin-1")) if rng.random() > 0.2
                      else rng.choice([-1, 1 << 62, 0, 10 ** 30]),
                      body=body)
    raw = text.encode("latin-1")
    if how == 4 and raw:  # random byte flips
      b = bytearray(raw)
      for _ in range(rng.randrange(1, 6)):
        b[rng.randrange(len(b))] = rng.randrange(256)
      raw = bytes(b)
    elif how == 5:
      raw = raw[:rng.randrange(len(raw) + 1)]
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
          k = s.recv(65536)
          if not k:
            break
          out += k
      code = out.split(b" ", 2)[1].decode() if out.startswith(b"HTTP/") \
          else ("closed" if not out else "http/0.9 error page")
    except OSError as e:
      code = type(e).__name__
    res["codes"][code] = res["codes"].get(code, 0) + 1
  after = {os.path.join(a, x) for a, ds, fs in os.walk(sandbox)
           for x in ds + fs if not os.path.join(a, x).startswith(d)}
  res["files_outside"] = len(after - before)
  res["files_outside_tmp"] = bool(
      {x for x in ("/tmp/tenplex-fuzz", "/tmp/x", "/etc/x")
       if os.path.exists(x)} - tmp_before)
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    s.sendall(f"GET /manifest HTTP/1.1\r\n{auth}Connection: close\r\n\r\n"
              .encode())
    res["server_alive"] = s.recv(20).startswith(b"HTTP/1.1 200")
  srv.shutdown()
  srv.server_close()
  return res


def run(kills=24, restore_kills=6, corruptions=44, readers=200, fuzz_n=600,
        disk=8, seed=0, base=None) -> dict:
  rng = random.Random(seed)
  own = base is None
  base = base or tempfile.mkdtemp(prefix="tenplex-faults-", dir="/dev/shm")
  out = {"load_avg_start": os.getloadavg()[0]}
  t = time.perf_counter()
  try:
    for name, fn, n in (("kill_save", kill_save, kills),
                        ("kill_restore", kill_restore, restore_kills),
                        ("corrupt", corrupt, corruptions),
                        ("full_disk", full_disk, disk),
                        ("server_load", server_load, readers),
                        ("fuzz", fuzz, fuzz_n)):
      if n:
        t0 = time.perf_counter()
        out[name] = fn(n, base, rng)
        out[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(_brief(out[name]))}", flush=True)
  finally:
    if own:
      shutil.rmtree(base, ignore_errors=True)
  out["seconds"] = round(time.perf_counter() - t, 1)
  out["load_avg_end"] = os.getloadavg()[0]
  return out


def _brief(r: dict) -> dict:
  return {k: v for k, v in r.items() if k not in ("by_point", "errors")}


def bad(out: dict) -> list[str]:
  """Every finding that means data was wrong or escaped."""
  probs = []
  for name in ("kill_save", "kill_restore", "corrupt", "full_disk"):
    for k, v in out.get(name, {}).get("outcomes", {}).items():
      if "WRONG" in k:
        probs.append(f"{name}: {v} x {k}")
    if out.get(name, {}).get("staging_left"):
      probs.append(f"{name}: staging directories left after gc")
  s = out.get("server_load")
  if s and (s["ok"] != s["readers"] or s["wrong"]):
    probs.append(f"server_load: {s['ok']}/{s['readers']} readers ok,"
                 f" {s['wrong']} wrong, errors {s['errors'][:3]}")
  f = out.get("fuzz")
  if f and (f["files_outside"] or f["files_outside_tmp"]
            or not f["server_alive"]
            or any(c.startswith("5") and c not in ("503",)
                   for c in f["codes"])):
    probs.append(f"fuzz: {f}")
  return probs


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kills", type=int, default=24)
  ap.add_argument("--restore-kills", type=int, default=6)
  ap.add_argument("--corruptions", type=int, default=44)
  ap.add_argument("--disk", type=int, default=8)
  ap.add_argument("--readers", type=int, default=200)
  ap.add_argument("--fuzz", type=int, default=600)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  out = run(a.kills, a.restore_kills, a.corruptions, a.readers, a.fuzz,
            a.disk, a.seed)
  out["problems"] = bad(out)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  print(json.dumps(out["problems"]) if out["problems"] else "no problems")
  return 1 if out["problems"] else 0


if __name__ == "__main__":
  sys.exit(main())
