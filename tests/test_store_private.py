"""Stores on a shared host (issue 22): what a store writes is private (0700
directories, 0600 files, a stricter umask respected), a store root another
user could tamper with is refused before anything is written or read, and
a token file others can read is refused.

The tests run as root here: "another user" is uid 65534 (nobody), given a
directory with chown; a 0777 directory of ours is the other unsafe kind.
"""

import contextlib
import os
import stat
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax.errors import StoreError, UnsafePathError
from tenplex_jax.store import (HostStore, api, gc, make_server, new_token,
                               replicate)
from tenplex_jax.store import private

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": ""}
ENV.pop("TENPLEX_JAX_STORE_TOKEN", None)
NOBODY = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a directory to another user (chown)"
    " needs root")


def _tree():
  m = Mesh(np.array(jax.devices()[:2]), ("d",))
  w = np.arange(64, dtype=np.float32).reshape(8, 8)
  return {"params": {"w": jax.device_put(w, NamedSharding(m, P("d")))},
          "step": 3}, w


def _target():
  m = Mesh(np.array(jax.devices()[:4]), ("d",))
  return {"params": {"w": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(m, P(None, "d")))},
          "step": 0}


def _modes(root):
  """{relative path: mode} of everything under ``root`` (root included)."""
  out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      p = os.path.join(d, n)
      out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
  return out


def _listing(root):
  out = set()
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      out.add(os.path.relpath(os.path.join(d, n), root))
  return out


def _assert_private(root, skip=()):
  modes = _modes(root)
  assert len(modes) > 5, modes
  for rel, mode in modes.items():
    if rel in skip:
      continue
    p = os.path.join(root, rel)
    if os.path.isdir(p):
      assert mode == 0o700, (rel, oct(mode))
    else:
      assert mode & 0o177 == 0, (rel, oct(mode))  # 0600 or stricter
  return modes


@contextlib.contextmanager
def _umask(mask):
  old = os.umask(mask)
  try:
    yield
  finally:
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o077])
def test_everything_a_save_writes_is_private(tmp_path, mask):
  tree, w = _tree()
  root = tmp_path / "a" / "store"  # save makes both directories
  with _umask(mask):
    api.save(tree, str(root), step=3)
    api.save(tree, str(root), step=4)  # a second round: CURRENT rewritten
  modes = _assert_private(str(tmp_path / "a"))
  assert {"store/STORE_ID", "store/procs/0/CURRENT"} <= set(modes)
  assert sum(r.endswith("manifest.json") for r in modes) == 2, modes
  assert any(r.endswith("zarr.json") for r in modes)
  assert any("/c/" in r for r in modes)  # the chunk files
  out = api.restore([str(root)], _target())
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), w)


def test_a_stricter_umask_is_respected(tmp_path):
  # 0o066 on top of 0o600/0o700 changes nothing; 0o277 would make the
  # files unwritable, so a stricter umask shows in the owner bits only:
  # files written under umask 0o177 are 0600, directories under 0o077
  # 0700 -- the modes come from mkdir/open, which apply the umask.
  with _umask(0o377):
    with private.open_private(str(tmp_path / "f")) as f:
      f.write("x")
  assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o400
  with _umask(0o277):
    private.makedirs(str(tmp_path / "d" / "e"))
  assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o500
  assert stat.S_IMODE(os.stat(tmp_path / "d" / "e").st_mode) == 0o500


def test_a_file_rewritten_loses_group_and_other_bits(tmp_path):
  p = tmp_path / "heartbeat"
  p.write_text("old")
  p.chmod(0o664)
  with private.open_private(str(p)) as f:
    f.write("new")
  assert p.read_text() == "new"
  assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_replicas_and_uploads_are_private(tmp_path):
  tree, w = _tree()
  src = tmp_path / "src"
  snap = api.save(tree, str(src), step=3)
  for d, dirs, files in os.walk(src):  # an old store's modes: 0755/0644
    os.chmod(d, 0o755)
    for n in files:
      os.chmod(os.path.join(d, n), 0o644)
  dst = tmp_path / "dst"
  replicate(snap, 0, str(dst))
  _assert_private(str(dst))
  # An upload to a store server (central mode) is written private too.
  up = tmp_path / "up"
  srv = make_server(str(up), 0)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  try:
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    api.save(tree, "unused", step=3, mode="central", central=url)
  finally:
    srv.shutdown()
    srv.server_close()
  modes = _assert_private(str(up))
  assert any(r.endswith("manifest.json") for r in modes)


def _unsafe_cases(tmp_path):
  """(name, store root, the unsafe path, words the message must hold)."""
  return {
      "root of another user": ("other", "other", ["nobody (uid 65534)",
                                                  "owned by another user"]),
      "root writable by others": ("open", "open", ["mode 0777",
                                                   "writable by group or"
                                                   " others"]),
      "root sticky and writable": ("sticky", "sticky", ["mode 1777"]),
      "parent of another user": ("theirs/store", "theirs",
                                 ["nobody (uid 65534)"]),
      "procs of another user": ("mine", "mine/procs", ["nobody (uid 65534)"]),
  }


def _make_unsafe(tmp_path, case):
  rel, bad, _ = _unsafe_cases(tmp_path)[case]
  root = tmp_path / rel
  root.mkdir(parents=True, exist_ok=True)
  if case == "procs of another user":
    tree, _ = _tree()
    api.save(tree, str(root), step=3)  # a good store, then procs/ given away
  b = tmp_path / bad
  if case == "root writable by others":
    b.chmod(0o777)
  elif case == "root sticky and writable":
    b.chmod(0o1777)
  else:
    os.chown(b, NOBODY, NOBODY)
  return str(root), str(b)


def _check_message(e, root, bad, words):
  msg = str(e.value)
  assert isinstance(e.value, StoreError)
  assert "\n" not in msg
  assert root in msg and bad in msg, msg
  assert "mode " in msg and "Fix:" in msg, msg
  for w in words:
    assert w in msg, (w, msg)


@needs_root
@pytest.mark.parametrize("case", sorted(_unsafe_cases(None)))
def test_save_refuses_an_unsafe_root_and_writes_nothing(tmp_path, case):
  root, bad = _make_unsafe(tmp_path, case)
  words = _unsafe_cases(tmp_path)[case][2]
  before = _listing(str(tmp_path))
  tree, _ = _tree()
  with pytest.raises(UnsafePathError) as e:
    api.save(tree, root, step=4)
  _check_message(e, root, bad, words)
  with pytest.raises(UnsafePathError):
    gc(root)
  with pytest.raises(UnsafePathError):
    make_server(root, 0)
  assert _listing(str(tmp_path)) == before


@needs_root
@pytest.mark.parametrize("case", ["root of another user",
                                  "root writable by others",
                                  "procs of another user"])
def test_restore_and_replicate_refuse_an_unsafe_store(tmp_path, case):
  tree, w = _tree()
  good = tmp_path / "good"
  snap = api.save(tree, str(good), step=3)
  if case == "procs of another user":
    root, bad = _make_unsafe(tmp_path, case)
  else:  # a store with a snapshot, then given away or opened
    root, bad = str(tmp_path / "s"), str(tmp_path / "s")
    api.save(tree, root, step=3)
    if case == "root of another user":
      os.chown(root, NOBODY, NOBODY)
    else:
      os.chmod(root, 0o777)
  before = _listing(str(tmp_path))
  atimes = {p: os.stat(os.path.join(root, p)).st_atime_ns
            for p in _listing(root)}
  with pytest.raises(UnsafePathError) as e:
    api.restore([root], _target())
  _check_message(e, root, bad, ["Fix:"])
  # Refused even next to a good store: the operator must fix it.
  with pytest.raises(UnsafePathError):
    api.restore([str(good), root], _target())
  with pytest.raises(UnsafePathError):
    HostStore(root)
  with pytest.raises(UnsafePathError):
    replicate(snap, 0, root)
  assert _listing(str(tmp_path)) == before
  # Nothing was read: no file's access time moved (where atime is kept).
  assert {p: os.stat(os.path.join(root, p)).st_atime_ns
          for p in _listing(root)} == atimes
  out = api.restore([str(good)], _target())  # the good one still works
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), w)


def test_sticky_root_owned_parents_are_fine(tmp_path):
  # /dev/shm and /tmp are such; so is this one.
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o1777)
  tree, w = _tree()
  api.save(tree, str(shared / "store"), step=3)
  out = api.restore([str(shared / "store")], _target())
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), w)


@needs_root
def test_a_symlink_of_another_user_is_refused(tmp_path):
  mine = tmp_path / "mine"
  mine.mkdir(mode=0o700)
  link = tmp_path / "link"
  link.symlink_to(mine)
  os.lchown(link, NOBODY, NOBODY)
  tree, _ = _tree()
  with pytest.raises(UnsafePathError, match="symbolic link"):
    api.save(tree, str(link / "store"), step=3)
  assert not os.listdir(mine)


def _serve(d, tok, *extra):
  return subprocess.run(
      [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir", d,
       "--port", "0", "--token-file", tok, *extra],
      env=ENV, capture_output=True, text=True, timeout=60)


def test_serve_refuses_a_token_file_others_can_read(tmp_path):
  tok = tmp_path / "tok"
  tok.write_text(new_token())
  tok.chmod(0o644)
  d = tmp_path / "store"
  r = _serve(str(d), str(tok))
  assert r.returncode != 0, (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1, r.stderr
  assert str(tok) in lines[0] and "0644" in lines[0], lines
  assert f"chmod 600 {tok}" in lines[0], lines
  assert r.stdout == ""
  assert not d.exists()  # refused before the store was made


@needs_root
def test_a_token_file_of_another_user_is_refused(tmp_path):
  tok = tmp_path / "tok"
  tok.write_text(new_token())
  tok.chmod(0o600)
  os.chown(tok, NOBODY, NOBODY)
  with pytest.raises(UnsafePathError, match="nobody"):
    make_server(str(tmp_path / "s"), 0, token_file=str(tok))
  tok.chmod(0o640)
  os.chown(tok, 0, 0)
  with pytest.raises(UnsafePathError, match="0640"):
    make_server(str(tmp_path / "s"), 0, token_file=str(tok))
  tok.chmod(0o600)
  srv = make_server(str(tmp_path / "s"), 0, token_file=str(tok))
  srv.server_close()
  assert srv.token == tok.read_text()


@needs_root
def test_serve_refuses_a_store_dir_of_another_user(tmp_path):
  d = tmp_path / "store"
  d.mkdir()
  os.chown(d, NOBODY, NOBODY)
  r = subprocess.run(
      [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
       str(d), "--port", "0"], env=ENV, capture_output=True, text=True,
      timeout=60)
  assert r.returncode != 0
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and str(d) in lines[0], r.stderr
  assert "nobody (uid 65534)" in lines[0] and "mode 0755" in lines[0], lines
  assert os.listdir(d) == []


def test_orbax_checkpoints_are_unreachable_to_others(tmp_path):
  # Orbax writes the files with its own modes; the directories around them
  # (made by save_checkpoint) are 0700.
  from tenplex_jax.store import latest_step, save_checkpoint
  d = tmp_path / "ck"
  path = save_checkpoint(str(d), {"w": jnp.ones(3)}, 5)
  assert latest_step(str(d)) == 5
  assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
