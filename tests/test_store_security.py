"""A store server attacked as issue 17 did: traversal in every field of every
route, requests without or with a wrong token, malformed and oversized
requests, a slow client. Every attack gets a 4xx, nothing appears outside
the store directory, no data is served without the token, and the server
keeps serving."""

import json
import os
import re
import socket
import struct
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax.errors import StoreError, UsageError
from tenplex_jax.store import (TOKEN_ENV, RemoteStore, api, make_server,
                               new_token)
from tenplex_jax.store.format import check_tensor_path

TOKEN = "test-token-" + "x" * 20


def _tree():
  m = Mesh(np.array(jax.devices()[:2]), ("d",))
  w = np.arange(64, dtype=np.float32).reshape(8, 8)
  return {"params": {"w": jax.device_put(w, NamedSharding(m, P("d")))},
          "step": 3}, w


def _files(root):
  out = set()
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      out.add(os.path.relpath(os.path.join(d, n), root))
  return out


@pytest.fixture
def box(tmp_path):
  """A store with one snapshot, served with a token; the sandbox around
  the store directory must stay as it is."""
  sandbox = tmp_path / "sandbox"
  root = sandbox / "a" / "b" / "store"
  tree, w = _tree()
  api.save(tree, str(root), step=3)
  srv = make_server(str(root), 0, token=TOKEN, head_timeout=1.0,
                    io_timeout=2.0)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  before = _files(sandbox)
  yield {"srv": srv, "port": srv.server_address[1], "root": str(root),
         "sandbox": str(sandbox), "before": before, "w": w}
  srv.shutdown()
  srv.server_close()


def _raw(port, data: bytes, timeout=5.0) -> tuple[int, bytes]:
  """Sends raw bytes, returns (status, whole answer)."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while True:
      try:
        k = s.recv(65536)
      except (ConnectionResetError, socket.timeout):
        break
      if not k:
        break
      out += k
  if not out:
    return 0, out
  if not out.startswith(b"HTTP/"):  # an HTTP/0.9 answer: the error page
    m = re.search(rb"Error code: (\d+)", out)
    return (int(m.group(1)) if m else 0), out
  return int(out.split(b" ", 2)[1]), out


def _req(method, target, body=b"", token=TOKEN, headers=None, length=None):
  h = {"Host": "x"}
  if token is not None:
    h["Authorization"] = f"Bearer {token}"
  if method == "POST" or body:
    h["Content-Length"] = str(len(body) if length is None else length)
  h.update(headers or {})
  head = f"{method} {target} HTTP/1.1\r\n" + "".join(
      f"{k}: {v}\r\n" for k, v in h.items()) + "Connection: close\r\n\r\n"
  return head.encode() + body


def _upload_body(name="params/w", box=((0, 8), (0, 8)), shape=(8, 8),
                 **over):
  header = {"step": 1, "job": json.loads(_job_json()), "extras": {},
            "num_processes": 1, "mode": "central",
            "tensors": {name: {"dtype": "float32", "itemsize": 4,
                               "shape": list(shape), "key_impl": None}},
            "boxes": [[name, [list(r) for r in box],
                       4 * int(np.prod([b - a for a, b in box])), "uint32",
                       [b - a for a, b in box]]],
            "keep": 2, "run": "", "seq": 1}
  header.update(over)
  head = json.dumps(header).encode()
  payload = b"\0" * header["boxes"][0][2] if isinstance(
      header["boxes"], list) and header["boxes"] and isinstance(
          header["boxes"][0], list) and isinstance(
              header["boxes"][0][2], int) and 0 <= header["boxes"][0][2] \
      < 1 << 20 else b""
  return struct.pack("<Q", len(head)) + head + payload


def _job_json():
  from tenplex_jax.layout import PTC
  tree, _ = _tree()
  return PTC.from_tree({"params/w": tree["params"]["w"]}).to_json()


def _unchanged(box):
  after = _files(box["sandbox"])
  new = {p for p in after - box["before"]
         if not p.startswith(os.path.relpath(box["root"], box["sandbox"]))}
  assert not new, f"files appeared outside the store: {sorted(new)}"


def test_requests_without_or_with_a_wrong_token_get_401_and_no_data(box):
  port = box["port"]
  for tok in (None, "wrong", TOKEN + "x", TOKEN[:-1], ""):
    for data in (_req("GET", "/manifest", token=tok),
                 _req("GET", "/stats", token=tok),
                 _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8", token=tok),
                 _req("POST", "/read", json.dumps({"pieces": [
                     [0, "params/w", "0:4,0:8"]]}).encode(), token=tok),
                 _req("POST", "/upload/0", _upload_body(), token=tok)):
      code, out = _raw(port, data)
      assert code == 401, (tok, data[:40], out[:200])
      assert b"store_id" not in out and b"\x00\x00" not in out
  code, out = _raw(port, _req("GET", "/manifest",
                              headers={"Authorization": f"Basic {TOKEN}"},
                              token=None))
  assert code == 401
  code, out = _raw(port, _req("GET", "/manifest"))
  assert code == 200 and b"store_id" in out
  _unchanged(box)
  assert [n for n in os.listdir(os.path.join(box["root"], "procs", "0"))
          if n.startswith("snap-")].__len__() == 1  # no upload landed


def test_clients_send_the_token_from_the_environment(box, monkeypatch):
  url = f"http://127.0.0.1:{box['port']}"
  with pytest.raises(StoreError, match="401"), \
      RemoteStore(url, timeout=5, retries=0) as rs:
    rs.manifests()
  monkeypatch.setenv(TOKEN_ENV, TOKEN)
  with RemoteStore(url, timeout=5, retries=0) as rs:
    assert rs.manifests()[0]["step"] == 3
  m = Mesh(np.array(jax.devices()[2:4]), ("d",))
  tgt = {"params": {"w": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(m, P(None, "d")))},
         "step": 0}
  out = api.restore([url], tgt)
  assert np.asarray(out["params"]["w"]).tobytes() == box["w"].tobytes()
  monkeypatch.setenv(TOKEN_ENV, "wrong")
  with pytest.raises(api.NoCopyError, match="401"):
    api.restore([url], tgt, timeout=5, retries=0)


ATTACK_PATHS = ["../../../../tmp/x", "../x", "a/../../x", "/etc/passwd",
                "a//b", "./a", "a/.", "a\0b", "..", "", "a/" * 3000]


@pytest.mark.parametrize("name", ATTACK_PATHS)
def test_upload_traversal_is_refused_and_writes_nothing_outside(box, name):
  code, out = _raw(box["port"], _req("POST", "/upload/0",
                                     _upload_body(name=name)))
  assert 400 <= code < 500, out[:300]
  _unchanged(box)


def test_malformed_requests_on_every_route_get_4xx(box):
  port = box["port"]
  big = json.dumps({"pieces": [[0, "params/w", "0:1,0:1"]] * 5000}).encode()
  attacks = [
      _req("GET", "/tensor/0/..%2F..%2F..%2Fetc%2Fpasswd?box=0:1"),
      _req("GET", "/tensor/0/%2Fetc%2Fpasswd?box=0:1"),
      _req("GET", "/tensor/0/params%2Fw%00?box=0:1,0:1"),
      _req("GET", "/tensor/0/params%2Fw?box=-1:4,0:8"),
      _req("GET", "/tensor/0/params%2Fw?box=0:99999999999999,0:8"),
      _req("GET", "/tensor/0/params%2Fw?box=4:2,0:8"),
      _req("GET", "/tensor/0/params%2Fw?box=0:4"),  # wrong rank
      _req("GET", "/tensor/0/params%2Fw?box=a:b,0:8"),
      _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8&step=-1"),
      _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8&step=abc"),
      _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8&round=..%2F..%00"),
      _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8&path=..%2F..%2Fx"),
      _req("GET", "/tensor/-1/params%2Fw?box=0:4,0:8"),
      _req("GET", "/tensor/..%2F..%2F/params%2Fw?box=0:4,0:8"),
      _req("GET", "/tensor/99999999999/params%2Fw?box=0:4,0:8"),
      _req("GET", "/../../etc/passwd"),
      _req("GET", "/manifest/../../x"),
      _req("POST", "/read", b"{not json"),
      _req("POST", "/read", b'{"pieces": 3}'),
      _req("POST", "/read", b"[]"),
      _req("POST", "/read", json.dumps({"pieces": [
          [0, "../../../etc/passwd", "0:1"]]}).encode()),
      _req("POST", "/read", json.dumps({"pieces": [
          [0, "params/w", "0:4,0:8", -5]]}).encode()),
      _req("POST", "/read", json.dumps({"pieces": [
          [0, "params/w", "-4:4,0:8"]]}).encode()),
      _req("POST", "/read", json.dumps({"pieces": [
          ["0", "params/w", "0:4,0:8", None, "x" * 5000]]}).encode()),
      _req("POST", "/read", json.dumps({"pieces": [
          [True, "params/w", "0:4,0:8"]]}).encode()),
      _req("POST", "/read", big),
      _req("POST", "/read", b"{}", length=1 << 40),  # enormous length
      _req("POST", "/read", b"{}", length=-5),
      _req("POST", "/read", b"{}", headers={"Content-Length": "12abc"}),
      _req("POST", "/upload/0", b"\x01\x02"),
      _req("POST", "/upload/0", struct.pack("<Q", 1 << 60) + b"{}"),
      _req("POST", "/upload/0", struct.pack("<Q", 5) + b"nojso"),
      _req("POST", "/upload/-1", _upload_body()),
      _req("POST", "/upload/..%2F..%2Fx", _upload_body()),
      _req("POST", "/upload/0", _upload_body(box=((0, 9), (0, 8)))),
      _req("POST", "/upload/0", _upload_body(step=-1)),
      _req("POST", "/upload/0", _upload_body(step="../x")),
      _req("POST", "/upload/0", _upload_body(mode="../x")),
      _req("POST", "/upload/0", _upload_body(tensors={"params/w": {
          "dtype": "object", "itemsize": 8, "shape": [8, 8]}})),
      _req("POST", "/upload/0", _upload_body(boxes=[["params/w", [[0, 8],
                                                    [0, 8]], 256, "object",
                                                    [8, 8]]])),
      _req("POST", "/upload/0", _upload_body(boxes=[[
          "params/w", [[0, 8], [0, 8]], 1 << 50, "uint32", [8, 8]]])),
      _req("PUT", "/upload/0", b"x"),
      _req("DELETE", "/manifest"),
      b"GARBAGE\r\n\r\n",
      b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
      b"GET /manifest HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
  ]
  for data in attacks:
    code, out = _raw(port, data)
    assert 400 <= code < 500, (data[:120], out[:300])
    _unchanged(box)
  # The server still serves, and the store is intact.
  code, out = _raw(port, _req("GET", "/tensor/0/params%2Fw?box=0:4,0:8"))
  assert code == 200
  assert out.endswith(box["w"][:4].tobytes())


def test_read_only_server_refuses_uploads(tmp_path):
  tree, _ = _tree()
  root = str(tmp_path / "s")
  api.save(tree, root, step=3)
  srv = make_server(root, 0, read_only=True)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  try:
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    with pytest.raises(StoreError, match="403|read-only"):
      api.save(tree, url, step=4)
    assert api.HostStore(root).manifest(0)["step"] == 3
    with RemoteStore(url) as rs:  # it still serves
      assert rs.manifests()[0]["step"] == 3
  finally:
    srv.shutdown()
    srv.server_close()


def test_no_token_on_a_public_address_is_refused(tmp_path, monkeypatch):
  monkeypatch.delenv(TOKEN_ENV, raising=False)
  with pytest.raises(UsageError, match="without a token"):
    make_server(str(tmp_path), 0, host="0.0.0.0")
  tok = tmp_path / "tok"
  tok.write_text(new_token() + "\n")
  tok.chmod(0o600)  # a token file others can read is refused
  srv = make_server(str(tmp_path / "s"), 0, host="0.0.0.0",
                    token_file=str(tok))
  assert srv.token == tok.read_text().strip()
  srv.server_close()
  (tmp_path / "empty").write_text("")
  (tmp_path / "empty").chmod(0o600)
  with pytest.raises(UsageError, match="empty"):
    make_server(str(tmp_path), 0, token_file=str(tmp_path / "empty"))
  with pytest.raises(UsageError, match="token-file"):
    make_server(str(tmp_path), 0, token_file=str(tmp_path / "missing"))


def test_a_slow_client_is_cut_off_and_others_are_served(box):
  port = box["port"]
  slow = socket.create_connection(("127.0.0.1", port))
  slow.sendall(b"GET /manifest HTTP/1.1\r\nHost: x\r\n")  # never finishes
  t0 = time.monotonic()
  for _ in range(5):  # others are served meanwhile
    code, _ = _raw(port, _req("GET", "/manifest"))
    assert code == 200
  slow.settimeout(5)
  try:
    got = slow.recv(100)  # the server closes it after head_timeout (1 s)
  except ConnectionResetError:
    got = b""
  assert got == b"" and time.monotonic() - t0 < 4.5
  slow.close()


def test_tensor_paths_are_checked():
  assert check_tensor_path("params/Dense_0/kernel") == "params/Dense_0/kernel"
  assert check_tensor_path(".") == "."  # a tree that is one leaf
  for bad in ATTACK_PATHS + [None, 3]:
    with pytest.raises(UsageError):
      check_tensor_path(bad)


def test_refused_large_upload_reports_the_refusal_not_a_broken_pipe(tmp_path):
  # The server answers 403 before reading a 32 MiB body and closes; the client
  # must still see the 403 (it saw "Broken pipe" before the server lingered
  # and the client read the answer after a failed send).
  root = str(tmp_path / "s")
  api.save({"w": jnp.zeros((8,), jnp.float32)}, root, step=1)
  srv = make_server(root, 0, read_only=True)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  try:
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    big = {"w": jnp.asarray(np.ones((2048, 4096), np.float32))}
    for step in (2, 3):
      with pytest.raises(StoreError, match="403|read-only"):
        api.save(big, url, step=step)
    assert api.HostStore(root).manifest(0)["step"] == 1
  finally:
    srv.shutdown()
    srv.server_close()
