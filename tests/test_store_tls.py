"""Store traffic over TLS (issue 22): ``tenplex-jax store serve --tls-cert
--tls-key`` serves HTTPS; clients verify it against a CA file
(``ca_file=`` or ``$TENPLEX_JAX_STORE_CA``), refuse plain HTTP when one is
set, and name the location when a certificate does not verify. The token
is still required over TLS. Certificates come from ``trustme``; every
server a test starts is stopped in a ``finally`` or a fixture."""

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trustme
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax.errors import StoreError, TLSError, UsageError
from tenplex_jax.store import RemoteStore, api, make_server
from tenplex_jax.store.server import CA_ENV, TOKEN_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKEN = "tls-test-token-" + "y" * 20
ENV = {k: v for k, v in os.environ.items() if k not in (CA_ENV, TOKEN_ENV)}
ENV.update(PYTHONPATH=ROOT, XLA_FLAGS="", JAX_PLATFORMS="cpu")


@pytest.fixture(autouse=True)
def _no_tls_env(monkeypatch):
  """No CA or token from the caller's environment leaks into a test (tests
  set them with monkeypatch, so none leaks out either)."""
  monkeypatch.delenv(CA_ENV, raising=False)
  monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def pki(tmp_path):
  """A CA and a server certificate for 127.0.0.1 it signed (PEM files), and
  the certificate of another CA that signed nothing of ours."""
  d = tmp_path / "pki"
  d.mkdir(mode=0o700)
  ca = trustme.CA()
  cert = ca.issue_cert("127.0.0.1", "localhost")
  out = {k: str(d / f"{k}.pem") for k in ("ca", "cert", "key", "other_ca")}
  ca.cert_pem.write_to_path(out["ca"])
  cert.private_key_and_cert_chain_pem.write_to_path(out["cert"])
  cert.private_key_pem.write_to_path(out["key"])
  os.chmod(out["key"], 0o600)
  trustme.CA().cert_pem.write_to_path(out["other_ca"])
  return out


def _tree():
  m = Mesh(np.array(jax.devices()[:4]), ("d",))
  w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * 0.37
  b = (np.arange(32, dtype=np.int32) * 7 - 5).astype(np.int32)
  tree = {"params": {"w": jax.device_put(w, NamedSharding(m, P("d"))),
                     "b": jax.device_put(b, NamedSharding(m, P()))},
          "step": 5}
  return tree, {"w": w, "b": b}


def _target():
  m = Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("x", "y"))
  return {"params": {
      "w": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                sharding=NamedSharding(m, P("y", "x"))),
      "b": jax.ShapeDtypeStruct((32,), jnp.int32,
                                sharding=NamedSharding(m, P("x")))},
          "step": 0}


def _check(out, want):
  for k in ("w", "b"):
    got = np.asarray(out["params"][k])
    assert got.dtype == want[k].dtype
    assert got.tobytes() == want[k].tobytes(), k  # bitwise
  assert out["step"] == 5


def _read(path):
  with open(path) as f:
    return f.read()


@contextlib.contextmanager
def cli_server(tmp_path, root, pki, *, token_file=None, name="srv",
               tls=True):
  """``tenplex-jax store serve`` in its own process; killed on the way out
  whatever happened. Yields its ``https://`` (``http://``) URL."""
  ready = str(tmp_path / f"{name}.ready")
  # Append mode: the processes write through the same open file as this
  # test reads with seek(0), and a shared offset moved back by that seek
  # would let their next line overwrite the log's start (a launcher
  # test once saw 'pid 2110' and then a line cut to 'pid', for 60 s).
  log = open(tmp_path / f"{name}.log", "a+")
  cmd = [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
         str(root), "--port", "0", "--ready-file", ready]
  if tls:
    cmd += ["--tls-cert", pki["cert"], "--tls-key", pki["key"]]
  if token_file:
    cmd += ["--token-file", token_file]
  p = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                       start_new_session=True)
  try:
    t0 = time.time()
    while not (os.path.exists(ready) and _read(ready).strip()):
      if p.poll() is not None or time.time() - t0 > 60:
        log.seek(0)
        raise AssertionError(f"store serve did not start: {log.read()}")
      time.sleep(0.05)
    yield ("https://" if tls else "http://") + _read(ready).strip(), log
  finally:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    log.close()


@pytest.fixture
def token_file(tmp_path):
  path = tmp_path / "token"
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(TOKEN + "\n")
  return str(path)


@pytest.fixture
def tls_server(tmp_path, pki):
  """An in-process TLS server of a store holding one snapshot, with a
  token; shut down afterwards."""
  root = tmp_path / "store"
  tree, want = _tree()
  api.save(tree, str(root), step=5)
  srv = make_server(str(root), 0, token=TOKEN, tls_cert=pki["cert"],
                    tls_key=pki["key"], head_timeout=1.0, io_timeout=2.0)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  try:
    yield {"srv": srv, "url": f"https://127.0.0.1:{srv.server_address[1]}",
           "port": srv.server_address[1], "want": want}
  finally:
    srv.shutdown()
    srv.server_close()


def test_restore_over_https_from_two_cli_servers_is_bitwise(tmp_path, pki,
                                                            token_file,
                                                            monkeypatch):
  # Two `store serve --tls-cert --tls-key` processes, one store each; a
  # restore through https:// only (no local directory), with the CA from
  # the environment variable, onto a different mesh.
  tree, want = _tree()
  roots = [tmp_path / "a", tmp_path / "b"]
  api.save(tree, str(roots[0]), step=5)
  api.save(tree, str(roots[1]), step=5)
  with cli_server(tmp_path, roots[0], pki, token_file=token_file,
                  name="a") as (ua, log_a), \
      cli_server(tmp_path, roots[1], pki, token_file=token_file,
                 name="b") as (ub, _):
    log_a.seek(0)
    assert f"on {ua} (token required" in log_a.read()
    monkeypatch.setenv(CA_ENV, pki["ca"])
    out, rep = api.restore_with_report([ua, ub], _target(), token=TOKEN)
    _check(out, want)
    assert rep.network_bytes > 0 and rep.local_bytes == 0
    assert set(rep.per_source_bytes) <= {ua, ub}
    # The explicit argument does the same without the variable.
    monkeypatch.delenv(CA_ENV)
    out = api.restore([ub], _target(), token=TOKEN, ca_file=pki["ca"])
    _check(out, want)


def test_wrong_ca_is_one_clear_error_naming_the_location(tls_server, pki):
  url = tls_server["url"]
  srv = tls_server["srv"]

  def failed_handshakes(want):
    """The server's count of failed connections once it reached ``want``
    (or 5 s passed) and stayed there for 0.3 s."""
    deadline = time.monotonic() + 5
    while srv.stats.get("connection_errors", 0) < want and \
        time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.3)
    return srv.stats.get("connection_errors", 0)

  # From the client directly: at once (no retries: one failed handshake on
  # the server, where each retry would add one) and without a chained ssl
  # traceback.
  with pytest.raises(TLSError, match="certificate does not verify") as e:
    RemoteStore(url, token=TOKEN, ca_file=pki["other_ca"],
                retries=5).manifests()
  assert failed_handshakes(1) == 1
  assert e.value.__cause__ is None and e.value.__suppress_context__
  # Through a restore: one line naming the location and the CA file.
  with pytest.raises(TLSError) as e:
    api.restore([url], _target(), token=TOKEN, ca_file=pki["other_ca"])
  msg = str(e.value)
  assert url in msg and "certificate does not verify" in msg
  assert pki["other_ca"] in msg and "\n" not in msg
  assert failed_handshakes(2) == 2
  # Without any CA the system's CAs are used: they do not know ours either.
  with pytest.raises(TLSError, match="the system CAs"):
    RemoteStore(url, token=TOKEN).manifests()


def test_wrong_host_name_does_not_verify(tmp_path):
  # A certificate for another name than the one connected to.
  ca = trustme.CA()
  cert = ca.issue_cert("store.example")
  paths = {k: str(tmp_path / f"{k}.pem") for k in ("ca", "cert", "key")}
  ca.cert_pem.write_to_path(paths["ca"])
  cert.private_key_and_cert_chain_pem.write_to_path(paths["cert"])
  cert.private_key_pem.write_to_path(paths["key"])
  os.chmod(paths["key"], 0o600)
  srv = make_server(str(tmp_path / "s"), 0, tls_cert=paths["cert"],
                    tls_key=paths["key"])
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  try:
    url = f"https://127.0.0.1:{srv.server_address[1]}"
    with pytest.raises(TLSError, match="127.0.0.1") as e:
      RemoteStore(url, ca_file=paths["ca"]).manifests()
    assert url in str(e.value)
  finally:
    srv.shutdown()
    srv.server_close()


def test_plain_http_is_refused_when_a_ca_is_configured(tls_server, pki,
                                                       tmp_path,
                                                       monkeypatch):
  http_url = f"http://127.0.0.1:{tls_server['port']}"
  monkeypatch.setenv(CA_ENV, pki["ca"])
  for call in (lambda: RemoteStore(http_url, token=TOKEN),
               lambda: api.open_store(http_url, token=TOKEN),
               lambda: api.restore([http_url], _target(), token=TOKEN)):
    with pytest.raises(TLSError) as e:
      call()
    msg = str(e.value)
    assert http_url in msg and "TLS is configured" in msg
    assert CA_ENV in msg and pki["ca"] in msg
  # Not silently skipped in favour of another reachable copy either.
  with pytest.raises(TLSError, match="refusing plain HTTP"):
    api.restore([tls_server["url"], http_url], _target(), token=TOKEN)
  # save (central mode) to an http:// location: refused before any upload.
  tree, _ = _tree()
  with pytest.raises(TLSError, match="refusing plain HTTP"):
    api.save(tree, str(tmp_path / "unused"), step=6, mode="central",
             central=http_url)
  with RemoteStore(tls_server["url"], token=TOKEN) as rs:
    assert rs.manifests()[0]["step"] == 5  # nothing was written
  # With the argument instead of the variable.
  monkeypatch.delenv(CA_ENV)
  with pytest.raises(TLSError, match="from ca_file"):
    RemoteStore(http_url, ca_file=pki["ca"])


def test_token_still_required_over_tls(tls_server, pki):
  url = tls_server["url"]
  before = tls_server["srv"].stats["refused"]
  with pytest.raises(StoreError, match="HTTP 401.*no token was sent"):
    with RemoteStore(url, ca_file=pki["ca"]) as rs:
      rs.manifests()
  with pytest.raises(StoreError, match="HTTP 401"):
    with RemoteStore(url, token="wrong-token", ca_file=pki["ca"]) as rs:
      rs.manifests()
  with pytest.raises(StoreError, match="HTTP 401"):
    api.restore([url], _target(), token="wrong-token", ca_file=pki["ca"])
  # Each refused once, not retried as if the server were unreachable.
  assert tls_server["srv"].stats["refused"] == before + 3
  _check(api.restore([url], _target(), token=TOKEN, ca_file=pki["ca"]),
         tls_server["want"])


def test_tls_server_refuses_plain_clients_and_keeps_serving(tls_server, pki,
                                                           tmp_path):
  srv = tls_server["srv"]
  assert srv.tls.minimum_version == ssl.TLSVersion.TLSv1_2
  # A plain HTTP client gets no data (the handshake fails).
  with socket.create_connection(("127.0.0.1", tls_server["port"]),
                                timeout=5) as s:
    s.sendall(b"GET /manifest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              + TOKEN.encode() + b"\r\n\r\n")
    got = b""
    with contextlib.suppress(OSError):
      while chunk := s.recv(65536):
        got += chunk
  assert b"procs" not in got and not got.startswith(b"HTTP/")
  # A client that connects and never says hello does not block the
  # accepting thread (the handshake runs in the connection's thread): with
  # head_timeout 4 s, a client that gives up after 2.5 s is served while it
  # waits; and the silent one is cut off after head_timeout.
  slow = make_server(str(tmp_path / "slow"), 0, token=TOKEN,
                     tls_cert=pki["cert"], tls_key=pki["key"],
                     head_timeout=4.0, io_timeout=6.0)
  threading.Thread(target=slow.serve_forever, daemon=True).start()
  url = f"https://127.0.0.1:{slow.server_address[1]}"
  idle = socket.create_connection(("127.0.0.1", slow.server_address[1]))
  try:
    t0 = time.monotonic()
    with RemoteStore(url, token=TOKEN, ca_file=pki["ca"], timeout=2.5,
                     retries=0) as rs:
      assert rs.manifests() == {}
    idle.settimeout(12)
    with contextlib.suppress(OSError):
      assert idle.recv(1) == b""
    assert 3.5 < time.monotonic() - t0 < 10
  finally:
    idle.close()
    slow.shutdown()
    slow.server_close()
  # ... and the server still serves.
  with RemoteStore(tls_server["url"], token=TOKEN, ca_file=pki["ca"]) as rs:
    assert rs.manifests()[0]["step"] == 5


def test_upload_and_replicate_over_https(tls_server, pki, tmp_path,
                                         monkeypatch):
  # https:// is a remote location for save (central mode) and replicate.
  url = tls_server["url"]
  monkeypatch.setenv(CA_ENV, pki["ca"])
  monkeypatch.setenv(TOKEN_ENV, TOKEN)
  tree, want = _tree()
  api.save(tree, str(tmp_path / "unused"), step=9, mode="central",
           central=url, run="central-run")
  assert not (tmp_path / "unused").exists()
  local = tmp_path / "local"
  snap = api.save(tree, str(local), step=11, run="replica-run")
  api.replicate(snap, 0, url)
  with RemoteStore(url) as rs:
    steps = {m["step"] for ms in rs.all_rounds()[0].values() for m in ms}
  assert {9, 11} <= steps
  out = api.restore([url], _target(), step=11)
  _check({**out, "step": 5}, want)


def test_cli_ls_over_https(tls_server, pki, tmp_path):
  env = {**ENV, TOKEN_ENV: TOKEN}
  r = subprocess.run([sys.executable, "-m", "tenplex_jax", "store", "ls",
                      tls_server["url"], "--ca-file", pki["ca"]],
                     env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert f"store {tls_server['url']}" in r.stdout and "step        5" in \
      r.stdout
  r = subprocess.run([sys.executable, "-m", "tenplex_jax", "store", "ls",
                      tls_server["url"], "--ca-file", pki["other_ca"]],
                     env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 1
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "certificate does not verify" in lines[0]
  assert tls_server["url"] in lines[0]


def test_serve_tls_options_are_checked(tmp_path, pki):
  def serve(*args):
    return subprocess.run(
        [sys.executable, "-m", "tenplex_jax", "store", "serve", "--dir",
         str(tmp_path / "s"), "--port", "0", *args],
        env=ENV, capture_output=True, text=True, timeout=60)
  for args, want in (
      (["--tls-cert", pki["cert"]], "both a certificate and its key"),
      (["--tls-key", pki["key"]], "both a certificate and its key"),
      (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", pki["key"]],
       "nope.pem: no such file"),
      (["--tls-cert", pki["ca"], "--tls-key", pki["key"]],
       "cannot load the certificate")):
    r = serve(*args)
    assert r.returncode == 2, (args, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], (args, r.stderr)
  os.chmod(pki["key"], 0o640)
  r = serve("--tls-cert", pki["cert"], "--tls-key", pki["key"])
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "mode 0640" in lines[0] and \
      f"chmod 600 {pki['key']}" in lines[0], r.stderr
  os.chmod(pki["key"], 0o600)
  with pytest.raises(UsageError, match="both a certificate"):
    make_server(str(tmp_path / "s"), 0, tls_cert=pki["cert"])
  with pytest.raises(TLSError, match="cannot load the CA file"):
    RemoteStore("https://127.0.0.1:1", ca_file=str(tmp_path / "no-ca"))


@pytest.mark.slow
def test_launch_with_tls_resizes_through_https_peers(tmp, pki):
  # The launcher starts its store servers with the certificate and hands
  # the processes https:// peers and the CA; a resize 1 -> 2 reads process
  # 0's snapshot over TLS in the new process 1.
  sched = os.path.join(tmp, "schedule.txt")
  with open(sched, "w") as f:
    f.write("step 3 procs 2\n")
  job = os.path.join(tmp, "job")
  r = subprocess.run(
      [sys.executable, "-m", "tenplex_jax", "launch", "--procs", "1",
       "--devices-per-proc", "2", "--schedule", sched, "--job-dir", job,
       "--timeout", "150", "--tls-cert", pki["cert"], "--tls-key",
       pki["key"], "--tls-ca", pki["ca"], "--", sys.executable,
       os.path.join(HERE, "launch_train.py"), "5"],
      env=ENV, capture_output=True, text=True, timeout=170)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  with open(os.path.join(job, "final.json")) as f:
    final = json.load(f)
  assert (final["procs"], final["step"], final["generation"]) == (2, 5, 1)
  with open(os.path.join(job, "server_0.log")) as f:
    assert "on https://127.0.0.1:" in f.read()
  with open(os.path.join(job, "restore_1_1.json")) as f:
    rep = json.load(f)
  assert rep["network_bytes"] > 0
  assert all(s.startswith(("https://", "/")) for s in rep["per_source_bytes"])
  assert any(s.startswith("https://") for s in rep["per_source_bytes"])


def test_launch_refuses_a_ca_without_a_certificate(tmp_path, pki):
  r = subprocess.run(
      [sys.executable, "-m", "tenplex_jax", "launch", "--procs", "1",
       "--job-dir", str(tmp_path / "job"), "--", sys.executable, "-c", "0"],
      env={**ENV, CA_ENV: pki["ca"]}, capture_output=True, text=True,
      timeout=60)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "have no certificate" in lines[0], r.stderr
  assert not (tmp_path / "job").exists()
