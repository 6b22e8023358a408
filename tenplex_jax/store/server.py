"""Serving a host's store to other hosts: a small HTTP server and its client.

Endpoints (all under ``http://HOST:PORT``, or ``https://HOST:PORT`` when the
server has a TLS certificate, see :func:`make_server`):

* ``GET /manifest``: ``{"store_id": ..., "procs": {k: manifest},
  "history": {k: {step: manifest}}}``: each process's current snapshot,
  and its older kept snapshots (``history``, the current one left out).
* ``GET /tensor/<proc>/<path>?box=0:4,2:4[&step=S]``: the raw little-endian
  bytes of exactly that sub-box (C order, storage dtype), so a reader
  fetches only the bytes the plan needs; from the snapshot of step ``S``
  (default: the current one). Chunk checksums are verified by the server
  on read; a corrupt chunk answers ``409`` with the reason.
* ``POST /read`` with a JSON body ``{"pieces": [[proc, path, "0:4,2:4"],
  ...]}`` (a piece may name a step as a fourth entry, ``[proc, path, box,
  step]``; default: the current snapshot): the raw bytes of several
  sub-boxes, concatenated in request order, in one response (the data path
  of restores: batched pieces, sent from memory maps of the chunk files,
  see :meth:`HostStore.read_segments`). Every chunk touched is checksummed
  before the answer starts; a corrupt one answers ``409`` naming the
  piece.
* ``GET /stats``: bytes, requests and pieces served; seconds spent reading
  (mapping and checksumming) and sending (gathering column ranges
  included; summed over threads).
* ``POST /upload/<proc>``: a whole snapshot in one streamed body (central
  mode and store replicas): an 8-byte header length, a JSON header, then the
  boxes' bytes in header order. Committed atomically like a local save.

The server is a ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1
keep-alive) and runs as its own process (``tenplex-jax store serve``), so it
outlives the training process that wrote the store.

TLS (standard-library :mod:`ssl`, TLS 1.2 or newer): a server given a
certificate and key answers only TLS; a client verifies an ``https://``
server against the CA file given to it or named by
``$TENPLEX_JAX_STORE_CA`` (else the system's CAs), and with a CA file set
refuses plain ``http://`` locations (:class:`TLSError`).
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import http.server
import ipaddress
import json
import math
import os
import secrets
import signal
import random
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tenplex_jax.errors import (ChecksumError, StoreError, TLSError,
                                UnreachableError, UsageError)
from tenplex_jax.layout import PTC, Box, dtype_of_name
from tenplex_jax.store import private
from tenplex_jax.store.format import (ChunkMaps, HostStore, SnapshotWriter,
                                      check_manifest, check_step,
                                      check_tensor_path, ensure_store_id,
                                      format_box, parse_box, round_id,
                                      storage_of)

__all__ = ["CA_ENV", "RemoteStore", "TOKEN_ENV", "is_remote", "make_server",
           "new_token", "resolve_token", "serve"]

_GATHER_BYTES = 1 << 20  # strided pieces go through a buffer this big
_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
  """This thread's reusable gather buffer, at least ``nbytes`` (uint8).

  Reused, so its pages are faulted in once and it stays in the cache; a
  fresh buffer per piece would cost a page fault per 4 KiB.
  """
  buf = getattr(_SCRATCH, "buf", None)
  if buf is None or buf.nbytes < nbytes:
    buf = _SCRATCH.buf = np.empty(max(nbytes, _GATHER_BYTES), np.uint8)
  return buf[:nbytes]


def _blocks(a: np.ndarray):
  """Splits a strided array along dim 0 into blocks of about
  ``_GATHER_BYTES``: (block view, a scratch buffer of its size viewed with
  its shape and dtype)."""
  row = a[0].nbytes if a.shape[0] else 0
  per = max(1, _GATHER_BYTES // max(1, row))
  for i in range(0, a.shape[0], per):
    blk = a[i:i + per]
    raw = _scratch(blk.nbytes)
    yield blk, raw, raw.view(a.dtype).reshape(blk.shape)


def _write_segment(write, seg) -> None:
  """Writes one segment of :meth:`HostStore.read_segments`: a contiguous
  buffer as it is, a strided array gathered block by block through this
  thread's scratch buffer (one copy, into memory already in the cache)."""
  if isinstance(seg, np.ndarray) and not seg.flags.c_contiguous \
      and seg.ndim:
    for blk, raw, view in _blocks(seg):
      np.copyto(view, blk)
      write(memoryview(raw))
    return
  write(memoryview(seg).cast("B"))


TOKEN_ENV = "TENPLEX_JAX_STORE_TOKEN"
_MAX_BODY = 8 << 20  # a POST /read request body (JSON)
_MAX_PIECES = 4096  # pieces per POST /read
_MAX_HEADER = 64 << 20  # the JSON header of an upload
_MAX_BOXES = 1 << 20  # boxes per upload
_MAX_RANK = 64
_MAX_PROC = 1 << 20


CA_ENV = "TENPLEX_JAX_STORE_CA"
_SCHEMES = ("http://", "https://")


def is_remote(location: str) -> bool:
  """Whether ``location`` names a store server (``http://`` or
  ``https://``) rather than a directory.

  Example:
    >>> is_remote("https://10.0.0.2:7000"), is_remote("/dev/shm/store")
    (True, False)
  """
  return isinstance(location, str) and location.startswith(_SCHEMES)


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
  """The TLS context of a store server: TLS 1.2 or newer, the certificate
  chain ``cert`` (PEM) and its private key ``key``.

  Raises:
    UsageError: a file is missing or does not hold a matching certificate
      and key, or the key is accessible to group or others.
  """
  for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
    if not os.path.isfile(path):
      raise UsageError(f"TLS: {flag} {path}: no such file")
  mode = os.stat(key).st_mode & 0o777
  if mode & 0o077:  # as ssh refuses such a private key
    raise UsageError(f"TLS: --tls-key {key} is readable or writable by group"
                     f" or others (mode {mode:04o}): the private key must be"
                     f" private; run chmod 600 {key}")
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  try:
    ctx.load_cert_chain(cert, key)
  except (OSError, ssl.SSLError) as e:
    raise UsageError(f"TLS: cannot load the certificate {cert} with the key"
                     f" {key}: {getattr(e, 'reason', None) or e} (both must"
                     " be PEM, the key matching the certificate)") from None
  return ctx


def client_ca(ca_file: str | None = None) -> str | None:
  """The CA file clients verify store servers against: ``ca_file``, else
  ``$TENPLEX_JAX_STORE_CA``, else None (no TLS required)."""
  return ca_file or os.environ.get(CA_ENV) or None


def client_tls_context(ca_file: str | None = None) -> ssl.SSLContext:
  """The TLS context of a store client: TLS 1.2 or newer, the server's
  certificate and host name verified against ``ca_file`` (see
  :func:`client_ca`; none: the system's CAs).

  Raises:
    TLSError: the CA file is missing or holds no certificate.
  """
  ca = client_ca(ca_file)
  try:
    ctx = ssl.create_default_context(cafile=ca)
  except (OSError, ssl.SSLError) as e:
    src = "ca_file" if ca_file else f"${CA_ENV}"
    raise TLSError(f"TLS: cannot load the CA file {ca} ({src}):"
                   f" {getattr(e, 'strerror', None) or e}") from None
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  return ctx


def new_token() -> str:
  """A fresh random job token (256 bits, URL-safe text).

  The launcher makes one per job and hands it to its processes and store
  servers in the ``TENPLEX_JAX_STORE_TOKEN`` environment variable.

  Example:
    >>> len(new_token()) >= 43
    True
  """
  return secrets.token_urlsafe(32)


def resolve_token(token: str | None = None, token_file: str | None = None
                  ) -> str | None:
  """The token to use: ``token``, else the contents of ``token_file``
  (surrounding whitespace stripped), else ``$TENPLEX_JAX_STORE_TOKEN``,
  else None (no authentication).

  Raises:
    UsageError: the token file cannot be read, or a token is empty or
      holds characters an HTTP header cannot carry.
    UnsafePathError: group or others can read or write the token file,
      or another user owns it (as ssh refuses such a key).
  """
  if token is None and token_file is not None:
    private.check_token_file(token_file)
    try:
      with open(token_file, "rb") as f:
        raw = f.read(1 << 16)
    except OSError as e:
      raise UsageError(f"--token-file {token_file}: {e.strerror or e}"
                       ) from None
    try:
      token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
      raise UsageError(f"--token-file {token_file}: the token must be"
                       " printable ASCII") from None
    if not token:
      raise UsageError(f"--token-file {token_file} is empty")
  if token is None:
    token = os.environ.get(TOKEN_ENV) or None
  if token is not None and (not token or not all(
      33 <= ord(c) < 127 for c in token)):
    raise UsageError("the store token must be non-empty printable ASCII"
                     " without spaces")
  return token


def is_loopback(host: str) -> bool:
  """Whether every address ``host`` names is a loopback address."""
  if host in ("", "0.0.0.0", "::"):
    return False
  try:
    infos = socket.getaddrinfo(host, None)
  except OSError:
    return False
  addrs = {i[4][0] for i in infos}
  try:
    return bool(addrs) and all(
        ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
  except ValueError:
    return False


class _BadRequest(Exception):
  """A malformed request (answered 400, or ``code``)."""

  def __init__(self, msg: str, code: int = 400):
    super().__init__(msg)
    self.code = code


def _proc_of(x: Any) -> int:
  if isinstance(x, bool):
    raise _BadRequest(f"process {x!r} is not a process index")
  if isinstance(x, str):
    if not (x.isascii() and x.isdigit() and len(x) <= 7):
      raise _BadRequest(f"process {x[:20]!r} is not a process index")
    x = int(x)
  if not isinstance(x, int) or not 0 <= x < _MAX_PROC:
    raise _BadRequest(f"process {x!r} is not a process index in"
                      f" [0, {_MAX_PROC})")
  return x


def _box_of(text: Any) -> Box:
  if not isinstance(text, str) or len(text) > 4096:
    raise _BadRequest("a box is a string such as '0:4,2:4'")
  try:
    box = parse_box(text)
  except ValueError:
    raise _BadRequest(f"box {text[:80]!r} is not 'start:stop,...'") from None
  if len(box) > _MAX_RANK or any(a < 0 or b < a for a, b in box):
    raise _BadRequest(f"box {text[:80]!r}: ranges must be 0 <= start <="
                      " stop")
  return box


def _path_of(p: Any) -> str:
  try:
    return check_tensor_path(p)
  except UsageError as e:
    raise _BadRequest(str(e)) from None


def _step_of(x: Any) -> int | None:
  if x is None or x == "":
    return None
  if isinstance(x, str):
    if not (x.isascii() and x.isdigit() and len(x) <= 10):
      raise _BadRequest(f"step {x[:20]!r} is not an integer >= 0")
    x = int(x)
  try:
    return check_step(x)
  except UsageError as e:
    raise _BadRequest(str(e)) from None


def _round_of(x: Any) -> str | None:
  if x is None or x == "":
    return None
  if not isinstance(x, str) or len(x) > 1024 or "\0" in x:
    raise _BadRequest("a round is a string of at most 1024 characters")
  return x


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: "_StoreServer"

  def log_message(self, fmt, *args):  # quiet
    pass

  def setup(self):
    self.request.settimeout(self.server.io_timeout)
    if isinstance(self.request, ssl.SSLSocket):
      # The handshake runs here, in the connection's own thread (not in
      # the accepting one), bounded like a request's head.
      self.server.watch(self, self.server.head_timeout, "head")
      try:
        self.request.do_handshake()
      finally:
        self.server.unwatch(self)
    super().setup()

  def handle_one_request(self):
    # The request line and headers must arrive within head_timeout (also
    # the idle time of a kept-alive connection): a slow client is cut off.
    self.server.watch(self, self.server.head_timeout, "head")
    try:
      super().handle_one_request()
    finally:
      self.server.unwatch(self)

  def _allow(self, nbytes: int = 0) -> None:
    """This request's deadline: io_timeout plus its bytes at min_rate."""
    self.server.watch(self, self.server.io_timeout
                      + nbytes / self.server.min_rate, "io")

  def _send(self, code: int, body: bytes, ctype: str = "application/json",
            headers: Mapping[str, str] | None = None):
    self.send_response(code)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    self.wfile.write(body)

  def _error(self, code: int, msg: str, *, close: bool = False):
    if close:
      self.close_connection = True
    self._send(code, json.dumps({"error": msg}).encode(),
               headers={"WWW-Authenticate": "Bearer"} if code == 401
               else None)
    if close:
      self._linger()

  def _linger(self, max_bytes: int = 8 << 20, seconds: float = 1.0):
    """Lets a client that is still sending a body it will never have read
    (a refused upload) see the answer: closing a socket with unread input
    makes the kernel send a reset, which can discard the answer before the
    client reads it. So: send FIN, then read and drop at most ``max_bytes``
    for at most ``seconds`` (a bounded cost, also for unauthenticated
    clients)."""
    try:
      self.wfile.flush()
      self.connection.shutdown(socket.SHUT_WR)
      deadline = time.monotonic() + seconds
      left = max_bytes
      while left > 0:
        wait = deadline - time.monotonic()
        if wait <= 0:
          break
        self.connection.settimeout(wait)
        got = self.connection.recv(min(left, 1 << 16))
        if not got:
          break
        left -= len(got)
    except OSError:
      pass

  def _authorized(self) -> bool:
    """Checks the job token (constant time); answers 401 if it is wrong.
    Nothing of the request (its body) is read before this."""
    token = self.server.token
    if token is None:
      return True
    got = self.headers.get("Authorization", "")
    scheme, _, value = got.partition(" ")
    ok = hmac.compare_digest(value.strip().encode("utf-8", "replace"),
                             token.encode()) and scheme.lower() == "bearer"
    if not ok:
      with self.server.lock:
        self.server.stats["refused"] += 1
      self._error(401, "missing or wrong store token (send 'Authorization:"
                  f" Bearer <token>'; clients read ${TOKEN_ENV})", close=True)
    return ok

  @contextlib.contextmanager
  def _answering_errors(self):
    """Turns a failed request into its HTTP error; the server keeps serving."""
    try:
      yield
    except _BadRequest as e:
      self._error(e.code, str(e), close=True)
    except UsageError as e:
      self._error(400, str(e))
    except ChecksumError as e:
      self._error(409, str(e))
    except StoreError as e:
      self._error(404, str(e))
    except socket.timeout:  # a client too slow to send or take bytes
      self.close_connection = True
      with self.server.lock:
        self.server.stats["timed_out_io"] += 1
        self.server.stats["timed_out"] += 1
    except (BrokenPipeError, ConnectionResetError):
      self.close_connection = True
    except Exception as e:  # report, keep serving
      self._error(500, f"{type(e).__name__}: {e}", close=True)

  def _body_length(self, limit: int) -> int:
    raw = self.headers.get("Content-Length")
    if raw is None:
      raise _BadRequest("Content-Length is required", 411)
    if not (raw.isascii() and raw.strip().isdigit()) or len(raw) > 20:
      raise _BadRequest(f"Content-Length {raw[:30]!r} is not a length")
    n = int(raw)
    if n > limit:
      raise _BadRequest(f"request body of {n} bytes is over the limit of"
                        f" {limit}", 413)
    return n

  def _split(self) -> tuple[list[str], str]:
    if "\0" in self.path or not self.path.startswith("/"):
      raise _BadRequest("malformed request target")
    url = urllib.parse.urlsplit(self.path)
    return url.path.strip("/").split("/", 2), url.query

  def do_GET(self):
    if not self._authorized():
      return
    with self._answering_errors():
      parts, query = self._split()
      self._allow()
      if parts == ["manifest"]:
        self._send(200, json.dumps(self._manifest()).encode())
      elif parts == ["stats"]:
        with self.server.lock:
          body = json.dumps(self.server.stats).encode()
        self._send(200, body)
      elif parts[0] == "tensor" and len(parts) == 3:
        proc = _proc_of(parts[1])
        path = _path_of(urllib.parse.unquote(parts[2], errors="strict"))
        try:
          q = urllib.parse.parse_qs(query, keep_blank_values=True,
                                    strict_parsing=bool(query),
                                    max_num_fields=8)
        except ValueError as e:
          raise _BadRequest(f"bad query: {e}") from None
        if set(q) - {"box", "step", "round"} or any(
            len(v) > 1 for v in q.values()):
          raise _BadRequest("the query takes box, step and round, once"
                            " each")
        box = _box_of(q.get("box", [""])[0])
        step = _step_of(q.get("step", [""])[0])
        rnd = _round_of(q.get("round", [""])[0])
        self._answer([(proc, path, box, step, rnd)])
      else:
        raise _BadRequest(f"no endpoint GET /{'/'.join(parts)[:100]}", 404)

  def _manifest(self) -> dict:
    store: HostStore = self.server.store
    rounds, problems = store.all_rounds()
    current, history = {}, {}
    for k, ms in rounds.items():
      try:
        cur = store.manifest(k)
      except StoreError:
        cur = ms[-1]  # CURRENT is bad: the newest good snapshot
      current[str(k)] = cur
      history[str(k)] = {str(m["step"]): m for m in ms
                         if m["step"] != cur["step"]}
    try:
      sid = store.store_id
    except StoreError:
      sid = None
    return {"store_id": sid, "procs": current, "history": history,
            "rounds": {str(k): v for k, v in rounds.items()},
            "problems": problems}

  def _read_pieces(self):
    n = self._body_length(_MAX_BODY)
    self._allow(n)
    raw = _read_exact(self.rfile, n)
    try:
      req = json.loads(raw)
    except ValueError as e:
      raise _BadRequest(f"bad /read request: the body is not JSON: {e}"
                        ) from None
    if not isinstance(req, dict) or not isinstance(req.get("pieces"), list):
      raise _BadRequest('bad /read request: the body is {"pieces": [...]}')
    if len(req["pieces"]) > _MAX_PIECES:
      raise _BadRequest(f"bad /read request: {len(req['pieces'])} pieces,"
                        f" over the limit of {_MAX_PIECES}", 413)
    pieces = []
    for q in req["pieces"]:
      if not isinstance(q, list) or not 3 <= len(q) <= 5:
        raise _BadRequest("bad /read request: a piece is [proc, path, box]"
                          " or [proc, path, box, step] or [proc, path, box,"
                          " step, round]")
      pieces.append((_proc_of(q[0]), _path_of(q[1]), _box_of(q[2]),
                     _step_of(q[3] if len(q) > 3 else None),
                     _round_of(q[4] if len(q) > 4 else None)))
    self._answer(pieces)

  def _answer(self, pieces):
    """Sends the bytes of ``pieces`` (proc, path, box, step, round),
    concatenated, from memory maps of the chunk files."""
    store: HostStore = self.server.store
    # Pieces of "the current snapshot" (no round) all read the round that
    # is current now, resolved once: a commit (and its CURRENT swap) during
    # the request must not serve the first pieces from one snapshot and the
    # rest from the next.
    pinned: dict[tuple[int, int | None], str] = {}
    for k, _, _, st, rnd in pieces:
      if rnd is None and (k, st) not in pinned:
        pinned[(k, st)] = round_id(store.manifest(k, st))
    pieces = [(k, p, box, st, pinned[(k, st)] if rnd is None else rnd)
              for k, p, box, st, rnd in pieces]
    layout = []
    total = 0
    for k, p, box, st, rnd in pieces:
      storage, shape, _, _ = store.storage_info(p, box, proc=k, step=st,
                                                round=rnd)
      nb = math.prod(shape) * storage.itemsize
      layout.append((nb, storage, shape))
      total += nb
    t0 = time.perf_counter()
    segs = []
    maps = ChunkMaps()  # a chunk several pieces share is checked once
    for (k, p, box, st, rnd), (nb, _, _) in zip(pieces, layout):
      got = store.read_segments(p, box, proc=k, maps=maps, step=st,
                                round=rnd)
      if sum(memoryview(g).nbytes for g in got) != nb:  # pragma: no cover
        raise StoreError(f"{p} box {list(box)}: read the wrong size")
      segs.extend(got)
    t1 = time.perf_counter()
    with self.server.lock:
      stats = self.server.stats
      stats["bytes_sent"] += total
      stats["requests"] += 1
      stats["pieces"] += len(pieces)
      stats["read_s"] += t1 - t0
    self._allow(total)
    self.send_response(200)
    self.send_header("Content-Type", "application/octet-stream")
    self.send_header("Content-Length", str(total))
    if len(layout) == 1:
      self.send_header("X-Storage-Dtype", layout[0][1].name)
      self.send_header("X-Shape", ",".join(map(str, layout[0][2])))
    self.end_headers()
    for g in segs:
      _write_segment(self.wfile.write, g)
    del segs
    maps.close()
    with self.server.lock:
      self.server.stats["send_s"] += time.perf_counter() - t1

  def _not_allowed(self):
    if self._authorized():
      self._error(405, f"method {self.command} is not allowed (GET, POST)",
                  close=True)

  do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

  def __getattr__(self, name):
    if name.startswith("do_"):  # any other method: 405, not 501
      return self._not_allowed
    raise AttributeError(name)

  def do_POST(self):
    if not self._authorized():
      return
    with self._answering_errors():
      parts, _ = self._split()
      if parts == ["read"]:
        self._read_pieces()
        return
      if len(parts) != 2 or parts[0] != "upload":
        raise _BadRequest(f"no endpoint POST /{'/'.join(parts)[:100]}", 404)
      if self.server.read_only:
        raise _BadRequest("this store server is read-only (--read-only):"
                          " uploads are refused", 403)
      self._upload(_proc_of(parts[1]))

  def _upload(self, proc: int):
    total = self._body_length(1 << 62)
    if total < 8:
      raise _BadRequest("an upload body starts with an 8-byte header length")
    self._allow(total)
    (hlen,) = struct.unpack("<Q", _read_exact(self.rfile, 8))
    if hlen > min(_MAX_HEADER, total - 8):
      raise _BadRequest(f"upload header of {hlen} bytes is over the limit"
                        f" ({min(_MAX_HEADER, total - 8)})", 413)
    try:
      header = json.loads(_read_exact(self.rfile, hlen))
    except ValueError as e:
      raise _BadRequest(f"the upload header is not JSON: {e}") from None
    h = _check_upload(header, total - 8 - hlen)
    try:
      w = SnapshotWriter(self.server.store.root, proc, step=h["step"],
                         seq=h["seq"], run=h["run"])
    except (StoreError, OSError) as e:
      raise _BadRequest(f"upload for process {proc} failed: {e}", 500
                        ) from None
    try:
      for path, t in header["tensors"].items():
        w.declare(path, dtype=t["dtype"], itemsize=t["itemsize"],
                  shape=t["shape"], key_impl=t.get("key_impl"))
      for path, box, nbytes, storage, shape in header["boxes"]:
        raw = _read_exact(self.rfile, nbytes)
        arr = np.frombuffer(raw, dtype=storage).reshape(shape)
        w.add(path, tuple(tuple(r) for r in box), arr)
        with self.server.lock:
          self.server.stats["bytes_received"] += nbytes
      final = w.commit(ptc_json=header["job"], extras=header["extras"],
                       num_processes=header["num_processes"],
                       run=h["run"], mode=h["mode"], keep=h["keep"])
    except (StoreError, OSError) as e:
      w.abort()
      raise _BadRequest(f"upload for process {proc} failed:"
                        f" {type(e).__name__}: {e}", 500) from None
    except BaseException:
      w.abort()
      self.close_connection = True
      raise
    self._send(200, json.dumps({"snapshot": final}).encode())


def _check_upload(h: Any, payload: int) -> dict:
  """Checks an upload's JSON header against the body length: every field's
  type and range, tensor paths, each box inside its tensor, the storage
  dtype and the byte counts. Returns the checked scalars."""
  bad = _BadRequest
  if not isinstance(h, dict):
    raise bad("the upload header is not a JSON object")
  try:
    out = {"step": _step_of(h["step"]), "run": h.get("run", ""),
           "seq": h.get("seq", 0), "mode": h.get("mode", "local"),
           "keep": h.get("keep", 1)}
    if out["step"] is None:
      raise bad("the upload header has no step")
    if not isinstance(out["run"], str) or len(out["run"]) > 1024:
      raise bad("run must be a string of at most 1024 characters")
    for k, hi in (("seq", 1 << 40), ("keep", 1 << 20)):
      if isinstance(out[k], bool) or not isinstance(out[k], int) \
          or not 0 <= out[k] <= hi:
        raise bad(f"{k} must be an integer in [0, {hi}]")
    if out["mode"] not in ("local", "central", "replica"):
      raise bad("mode must be local, central or replica")
    n = h["num_processes"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= \
        _MAX_PROC:
      raise bad("num_processes must be a positive integer")
    if not isinstance(h["extras"], dict):
      raise bad("extras must be an object")
    PTC.from_json(h["job"] if isinstance(h["job"], str)
                  else json.dumps(h["job"]))
    tensors, boxes = h["tensors"], h["boxes"]
    if not isinstance(tensors, dict) or not isinstance(boxes, list):
      raise bad("tensors must be an object and boxes a list")
    if len(boxes) > _MAX_BOXES:
      raise bad(f"{len(boxes)} boxes, over the limit of {_MAX_BOXES}", 413)
    info = {}
    for path, t in tensors.items():
      _path_of(path)
      shape = t["shape"]
      if not isinstance(shape, list) or len(shape) > _MAX_RANK or any(
          isinstance(d, bool) or not isinstance(d, int) or d < 0
          for d in shape):
        raise bad(f"{path}: shape must be a list of integers >= 0")
      size = t["itemsize"]
      if isinstance(size, bool) or not isinstance(size, int) \
          or not 1 <= size <= 64 or not isinstance(t["dtype"], str):
        raise bad(f"{path}: bad dtype or itemsize")
      if not t["dtype"].startswith("key<"):
        try:
          if dtype_of_name(t["dtype"]).itemsize != size:
            raise bad(f"{path}: dtype {t['dtype']} is not {size} bytes")
        except TypeError:
          raise bad(f"{path}: unknown dtype {t['dtype'][:40]!r}") from None
      if t.get("key_impl") is not None and not isinstance(t["key_impl"],
                                                          str):
        raise bad(f"{path}: key_impl must be a string")
      try:
        info[path] = (shape, storage_of(t["dtype"], size))
      except StoreError as e:
        raise bad(str(e)) from None
    nbytes = 0
    for e in boxes:
      if not isinstance(e, list) or len(e) != 5:
        raise bad("a box entry is [path, box, nbytes, storage, shape]")
      path, box, nb, storage, bshape = e
      if path not in info:
        raise bad(f"box of undeclared tensor {str(path)[:80]!r}")
      shape, (st, extra) = info[path]
      if storage != st:
        raise bad(f"{path}: storage {str(storage)[:20]!r} is not {st}")
      if not isinstance(box, list) or len(box) != len(shape) or any(
          not isinstance(r, list) or len(r) != 2 or any(
              isinstance(x, bool) or not isinstance(x, int) for x in r)
          or not 0 <= r[0] <= r[1] <= n_ for r, n_ in zip(box, shape)):
        raise bad(f"{path}: box {str(box)[:80]} is not inside shape {shape}")
      want = [b - a for a, b in box] + list(extra)
      if bshape != want or nb != math.prod(want) * np.dtype(st).itemsize:
        raise bad(f"{path}: box {box}: shape/bytes {bshape}/{nb} do not"
                  f" match {want}")
      nbytes += nb
    if nbytes != payload:
      raise bad(f"the boxes hold {nbytes} bytes, the body carries"
                f" {payload}")
  except (KeyError, TypeError, ValueError) as e:
    raise bad(f"malformed upload header: {type(e).__name__}: {e}") from None
  return out


def _read_exact(f, n: int) -> bytearray:
  buf = bytearray(n)
  _readinto_exact(f, memoryview(buf), "upload")
  return buf


def _readinto_exact(f, view: memoryview, what: str,
                    exc: type[Exception] = StoreError) -> None:
  n = len(view)
  got = 0
  while got < n:
    k = f.readinto(view[got:])
    if not k:
      raise exc(f"{what} ended after {got} of {n} bytes")
    got += k


class _StoreServer(http.server.ThreadingHTTPServer):
  daemon_threads = True
  allow_reuse_address = True
  request_queue_size = 128

  def __init__(self, addr, store: HostStore, *, token: str | None = None,
               read_only: bool = False, max_connections: int = 512,
               head_timeout: float = 30.0, io_timeout: float = 30.0,
               min_rate: float = 1 << 20, tls: ssl.SSLContext | None = None):
    super().__init__(addr, _Handler)
    self.tls = tls
    if tls is not None:  # every accepted connection speaks TLS
      self.socket = tls.wrap_socket(self.socket, server_side=True,
                                    do_handshake_on_connect=False)
    self.store = store
    self.token = token
    self.read_only = read_only
    self.max_connections = max_connections
    self.head_timeout = head_timeout
    self.io_timeout = io_timeout
    self.min_rate = min_rate
    self.lock = threading.Lock()
    self.stats = {"bytes_sent": 0, "requests": 0, "pieces": 0,
                  "bytes_received": 0, "read_s": 0.0, "send_s": 0.0,
                  "refused": 0, "timed_out": 0, "timed_out_head": 0,
                  "timed_out_io": 0, "over_capacity": 0}
    self._deadlines: dict[Any, tuple[float, str]] = {}
    self._active = 0
    self._closing = threading.Event()
    self._reaper = threading.Thread(target=self._reap, daemon=True,
                                    name="tenplex-store-reaper")
    self._reaper.start()

  def watch(self, handler, seconds: float, what: str) -> None:
    with self.lock:
      self._deadlines[handler] = (time.monotonic() + seconds, what)

  def unwatch(self, handler) -> None:
    with self.lock:
      self._deadlines.pop(handler, None)

  def _reap(self) -> None:
    """Cuts off connections past their deadline (slow or stalled clients),
    so that none holds a thread for long."""
    while not self._closing.wait(0.25):
      now = time.monotonic()
      with self.lock:
        late = [h for h, (d, _) in self._deadlines.items() if d < now]
        for h in late:
          self.stats["timed_out_" + self._deadlines.pop(h)[1]] += 1
        self.stats["timed_out"] += len(late)
      for h in late:
        with contextlib.suppress(OSError):
          # The plain socket's shutdown, also under TLS: SSLSocket's own
          # would drop its state under the thread still using it.
          socket.socket.shutdown(h.request, socket.SHUT_RDWR)

  def process_request(self, request, client_address):
    with self.lock:
      full = self._active >= self.max_connections
      if not full:
        self._active += 1
      else:
        self.stats["over_capacity"] += 1
    if full:
      with contextlib.suppress(OSError):
        request.settimeout(1.0)
        request.sendall(b"HTTP/1.1 503 Service Unavailable\r\n"
                        b"Content-Length: 0\r\nConnection: close\r\n\r\n")
      self.shutdown_request(request)
      return
    try:
      super().process_request(request, client_address)
    except BaseException:
      with self.lock:
        self._active -= 1
      raise

  def process_request_thread(self, request, client_address):
    try:
      super().process_request_thread(request, client_address)
    finally:
      with self.lock:
        self._active -= 1

  def handle_error(self, request, client_address):
    """A connection that failed outside a route (a client gone, a cut
    slow client): counted, not printed; the server keeps serving."""
    with self.lock:
      self.stats["connection_errors"] = \
          self.stats.get("connection_errors", 0) + 1

  def server_close(self):
    self._closing.set()
    super().server_close()


def make_server(root: str, port: int = 0, *, host: str = "127.0.0.1",
                token: str | None = None, token_file: str | None = None,
                read_only: bool = False, max_connections: int = 512,
                head_timeout: float = 30.0, io_timeout: float = 30.0,
                min_rate: float = 1 << 20, tls_cert: str | None = None,
                tls_key: str | None = None) -> _StoreServer:
  """A store server for directory ``root`` (not yet serving).

  Args:
    root: the store directory (created, with its ``STORE_ID``, unless
      ``read_only``).
    port: the port (0: a free one).
    host: the address to listen on. Anything but a loopback address needs
      a token.
    token: the job's shared secret; every request must carry
      ``Authorization: Bearer <token>`` (compared in constant time), else
      it is answered 401. Default: the contents of ``token_file``, else
      ``$TENPLEX_JAX_STORE_TOKEN``, else none (loopback only).
    token_file: a file holding the token.
    read_only: refuse uploads (403).
    max_connections: connections served at once; more are answered 503.
    head_timeout: seconds a connection may take to send a request's line
      and headers (and may stay idle between requests).
    io_timeout: seconds any one socket read or write may block, and the
      base of each request's deadline, to which its bytes at ``min_rate``
      (bytes per second) are added; past it the connection is cut.
    tls_cert: a PEM certificate (chain): the server then speaks only TLS
      (1.2 or newer) and clients use ``https://HOST:PORT``.
    tls_key: the PEM private key of ``tls_cert`` (both or neither).

  Raises:
    UsageError: a non-loopback ``host`` without a token, a bad token, or
      a TLS certificate or key that cannot be loaded.
    UnsafePathError: ``root`` (or a directory above it, or its
      ``procs/``) belongs to another user or is writable by group or
      others, or the token file is open to them; uploads are written
      private (directories 0700, files 0600).

  Example:
    >>> import tempfile, threading
    >>> srv = make_server(tempfile.mkdtemp(), 0)
    >>> t = threading.Thread(target=srv.serve_forever, daemon=True); t.start()
    >>> client = RemoteStore(f"http://127.0.0.1:{srv.server_address[1]}")
    >>> client.manifests()
    {}
    >>> client.close(); srv.shutdown(); srv.server_close()
  """
  if (tls_cert is None) != (tls_key is None):
    raise UsageError("TLS needs both a certificate and its key (--tls-cert"
                     f" and --tls-key), got only the"
                     f" {'certificate' if tls_key is None else 'key'}")
  tls = None if tls_cert is None else server_tls_context(tls_cert, tls_key)
  token = resolve_token(token, token_file)
  if token is None and not is_loopback(host):
    raise UsageError(
        f"refusing to serve the store on {host!r} without a token: anyone"
        " who reaches the port could read or overwrite the model state."
        f" Give --token-file FILE or set {TOKEN_ENV} (the same in every"
        " process of the job; tenplex-jax launch does it), or listen on"
        " 127.0.0.1")
  private.check_dir(root)  # before anything is made or read there
  if not read_only:
    private.makedirs(root)
    ensure_store_id(root)
  return _StoreServer((host, int(port)), HostStore(root), token=token,
                      read_only=read_only, max_connections=max_connections,
                      head_timeout=head_timeout, io_timeout=io_timeout,
                      min_rate=min_rate, tls=tls)


def serve(root: str, port: int, *, host: str = "127.0.0.1",
          ready_file: str | None = None, token_file: str | None = None,
          read_only: bool = False, tls_cert: str | None = None,
          tls_key: str | None = None) -> None:
  """Serves ``root`` until SIGTERM/SIGINT (``tenplex-jax store serve``).

  Writes ``host:port`` to ``ready_file`` once listening (port 0 picks a
  free port). The token: ``token_file``, else ``$TENPLEX_JAX_STORE_TOKEN``
  (see :func:`make_server`). With ``tls_cert`` and ``tls_key`` it serves
  HTTPS only.
  """
  srv = make_server(root, port, host=host, token_file=token_file,
                    read_only=read_only, tls_cert=tls_cert, tls_key=tls_key)

  def stop(*_):
    threading.Thread(target=srv.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  if ready_file:
    tmp = ready_file + ".tmp"
    with private.open_private(tmp) as f:
      f.write(f"{srv.server_address[0]}:{srv.server_address[1]}")
    os.replace(tmp, ready_file)
  auth = "token required" if srv.token else "no token (loopback only)"
  scheme = "http" if srv.tls is None else "https"
  print(f"tenplex-jax store: serving {os.path.abspath(root)} on"
        f" {scheme}://{srv.server_address[0]}:{srv.server_address[1]}"
        f" ({auth}{', read-only' if read_only else ''})", flush=True)
  try:
    srv.serve_forever(poll_interval=0.2)
  finally:
    srv.server_close()


class RemoteStore:
  """Client of a store server: manifests and sub-box reads over HTTP.

  Keeps one keep-alive connection per thread; retries connection errors
  ``retries`` times with backoff, each attempt bounded by ``timeout``
  seconds, then raises :class:`StoreError` naming the URL and the tensor.
  ``bytes_received`` counts the payload bytes read. Every request carries
  ``Authorization: Bearer <token>`` when a token is given (default:
  ``$TENPLEX_JAX_STORE_TOKEN``); a server that refuses it raises
  :class:`StoreError` at once (no retries).

  An ``https://`` URL is spoken over TLS, the server's certificate verified
  against ``ca_file`` (default: ``$TENPLEX_JAX_STORE_CA``, else the
  system's CAs). With a CA file set, TLS is required: an ``http://`` URL
  raises :class:`TLSError`, as does a certificate that does not verify
  (no retries).
  """

  def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2,
               token: str | None = None, ca_file: str | None = None):
    u = urllib.parse.urlsplit(url)
    try:
      port = u.port
    except ValueError:
      port = None
      u = urllib.parse.urlsplit("")
    if u.scheme not in ("http", "https") or not u.hostname:
      raise StoreError(f"store URL {url!r} is not http(s)://HOST:PORT")
    ca = client_ca(ca_file)
    if u.scheme == "http" and ca is not None:
      raise TLSError(
          f"store location {url}: refusing plain HTTP: TLS is configured"
          f" (CA file {ca}, from {'ca_file' if ca_file else '$' + CA_ENV});"
          " serve the store with --tls-cert/--tls-key and use https://")
    self.url = url.rstrip("/")
    self.ca_file = ca
    self._tls = client_tls_context(ca) if u.scheme == "https" else None
    self.host = u.hostname
    self.port = port or (443 if self._tls is not None else 80)
    token = resolve_token(token)
    self._headers = {"Authorization": f"Bearer {token}"} if token else {}
    self.timeout = timeout
    self.retries = retries
    self._local = threading.local()
    self._lock = threading.Lock()
    self.bytes_received = 0
    self.requests = 0
    self._manifest: dict | None = None
    self._conns: list[http.client.HTTPConnection] = []

  def close(self) -> None:
    """Closes every connection this client opened (from any thread)."""
    with self._lock:
      conns, self._conns = self._conns, []
    for c in conns:
      c.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _new_conn(self, timeout: float) -> http.client.HTTPConnection:
    if self._tls is None:
      return http.client.HTTPConnection(self.host, self.port,
                                        timeout=timeout)
    return http.client.HTTPSConnection(self.host, self.port,
                                       timeout=timeout, context=self._tls)

  def _tls_failure(self, e: BaseException) -> None:
    """Raises :class:`TLSError` for a TLS failure that retrying cannot
    cure: a certificate that does not verify, a server without TLS."""
    if isinstance(e, ssl.SSLCertVerificationError):
      raise TLSError(
          f"store server {self.url}: its TLS certificate does not verify"
          f" against {'CA file ' + self.ca_file if self.ca_file else 'the system CAs'}"
          f": {e.verify_message or e.reason} (set ${CA_ENV} to the CA"
          " that signed the servers' certificates)") from None
    if isinstance(e, ssl.SSLError) and e.reason in (
        "WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST",
        "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL"):
      raise TLSError(
          f"store server {self.url}: TLS handshake failed ({e.reason}):"
          " the server does not speak TLS (start it with --tls-cert and"
          " --tls-key) or this is not a store server") from None

  def _conn(self) -> http.client.HTTPConnection:
    c = getattr(self._local, "conn", None)
    if c is None:
      c = self._new_conn(self.timeout)
      self._local.conn = c
      with self._lock:
        self._conns.append(c)
    return c

  def _drop(self):
    c = getattr(self._local, "conn", None)
    if c is not None:
      c.close()
    self._local.conn = None

  @staticmethod
  def _stale(c, e: BaseException) -> bool:
    """Whether ``e`` is a kept-alive connection ``c`` that the server closed
    while it was idle (retried at no cost)."""
    return getattr(c, "_tenplex_used", False) and isinstance(
        e, (http.client.RemoteDisconnected, BrokenPipeError,
            ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError))

  def _done(self, c, r) -> None:
    """After a response: keep the connection (marked reused) or drop it."""
    if r.will_close:
      self._drop()
    else:
      c._tenplex_used = True

  def _refused(self, status: int, body: bytes, what: str) -> None:
    if status in (401, 403):
      raise StoreError(f"store server {self.url} refused {what} (HTTP"
                       f" {status}): {_msg(body)}" + (
                           "" if self._headers else
                           f"; no token was sent (set {TOKEN_ENV})"))

  def _get(self, target: str, what: str) -> tuple[int, dict, bytes]:
    last = None
    attempt = 0
    while attempt <= self.retries:
      c = None
      try:
        c = self._conn()
        c.request("GET", target, headers=self._headers)
        r = c.getresponse()
        body = r.read()
        self._done(c, r)
        self._refused(r.status, body, what)
        return r.status, dict(r.getheaders()), body
      except StoreError:  # refused (an IOError too): not retried
        raise
      except (OSError, http.client.HTTPException) as e:
        last = e
        self._drop()
        self._tls_failure(e)
        if self._stale(c, e):
          continue
        attempt += 1
        if attempt <= self.retries:
          time.sleep(0.05 * 2 ** (attempt - 1))
    raise UnreachableError(
        f"store server {self.url} is unreachable while reading {what}"
        f" ({self.retries + 1} attempts, timeout {self.timeout}s):"
        f" {type(last).__name__}: {last}")

  @property
  def store_id(self) -> str | None:
    return self.fetch_manifest()["store_id"]

  def fetch_manifest(self, refresh: bool = False) -> dict:
    """``GET /manifest``; every manifest in it is checked (checksum,
    structure) here too, and a bad one left out (see ``problems``)."""
    if self._manifest is None or refresh:
      code, _, body = self._get("/manifest", "/manifest")
      if code != 200:
        raise StoreError(f"store server {self.url}: /manifest answered"
                         f" {code}: {body[:300]!r}")
      try:
        man = json.loads(body)
        rounds = man.get("rounds")
        if rounds is None:  # an older server: current and history
          rounds = {k: list(man.get("history", {}).get(k, {}).values())
                    + [m] for k, m in man["procs"].items()}
        problems = list(man.get("problems", []))
        good = {}
        for k, ms in rounds.items():
          for m in ms:
            try:
              good.setdefault(int(k), []).append(check_manifest(
                  m, f"store server {self.url}: manifest of process {k}",
                  proc=int(k)))
            except StoreError as e:
              problems.append(str(e))
        man["rounds"] = good
        man["problems"] = problems
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreError(f"store server {self.url}: /manifest is malformed:"
                         f" {type(e).__name__}: {e}") from None
      self._manifest = man
    return self._manifest

  def manifests(self) -> dict[int, dict]:
    """The manifest of each process's current snapshot."""
    return {int(k): v for k, v in self.fetch_manifest()["procs"].items()}

  def all_rounds(self) -> tuple[dict[int, list[dict]], list[str]]:
    """Every good kept snapshot's manifest per process, and the problems
    (as :meth:`HostStore.all_rounds`)."""
    man = self.fetch_manifest()
    return dict(man["rounds"]), list(man["problems"])

  def all_manifests(self) -> dict[int, dict[int, dict]]:
    """Every kept snapshot's manifest: process -> step -> manifest (the
    current one included; a server without ``history`` gives the current
    ones only)."""
    rounds, _ = self.all_rounds()
    return {k: dict(sorted({m["step"]: m for m in ms}.items()))
            for k, ms in rounds.items()}

  def stats(self) -> dict:
    code, _, body = self._get("/stats", "/stats")
    return json.loads(body)

  def read_storage(self, path: str, box: Box, *, proc: int,
                   step: int | None = None, round: str | None = None
                   ) -> np.ndarray:
    """Reads one sub-box (``GET /tensor``) of the snapshot of ``round`` or
    ``step`` (default: the current one)."""
    target = (f"/tensor/{proc}/{urllib.parse.quote(path, safe='')}"
              f"?box={format_box(box)}"
              + ("" if step is None else f"&step={int(step)}")
              + ("" if round is None else
                 f"&round={urllib.parse.quote(round, safe='')}"))
    what = f"{path} box {list(box)} of process {proc}" + (
        "" if step is None else f" (step {step})")
    code, headers, body = self._get(target, what)
    if code == 409:
      raise ChecksumError(f"store server {self.url}: {what}:"
                          f" {_msg(body)}")
    if code != 200:
      raise StoreError(f"store server {self.url}: {what}: HTTP {code}:"
                       f" {_msg(body)}")
    shape = tuple(int(n) for n in headers["X-Shape"].split(",") if n)
    arr = np.frombuffer(body, dtype=headers["X-Storage-Dtype"])
    with self._lock:
      self.bytes_received += len(body)
      self.requests += 1
    return arr.reshape(shape)

  def read_into(self, pieces: Sequence[tuple[int, str, Box, np.ndarray]], *,
                step: int | None = None, round: str | None = None) -> int:
    """Reads several sub-boxes in one request (``POST /read``) straight
    into their destinations.

    Args:
      pieces: (process, tensor path, box, destination array in the storage
        dtype with the box's shape); a destination that is not
        C-contiguous is filled block by block through a small reused
        buffer.
      step: the step of the snapshots to read (default: the current ones).
      round: the round of the snapshots to read (before ``step``).

    Returns:
      The payload bytes received.

    Raises:
      ChecksumError: the server found a corrupt chunk (names the piece).
      StoreError: the server is unreachable (after retries) or refused.
    """
    tail = [] if step is None and round is None else [
        None if step is None else int(step)]
    if round is not None:
      tail.append(round)
    body = json.dumps({"pieces": [[k, p, format_box(b)] + tail
                                  for k, p, b, _ in pieces]}).encode()
    total = sum(d.nbytes for *_, d in pieces)
    what = (f"{len(pieces)} pieces ({pieces[0][1]} box"
            f" {list(pieces[0][2])} of process {pieces[0][0]}, ...)"
            if len(pieces) > 1 else
            f"{pieces[0][1]} box {list(pieces[0][2])} of process"
            f" {pieces[0][0]}")
    last = None
    attempt = 0
    while attempt <= self.retries:
      c = None
      try:
        c = self._conn()
        c.request("POST", "/read", body=body,
                  headers={"Content-Type": "application/json",
                           **self._headers})
        r = c.getresponse()
        if r.status != 200:
          status, err = r.status, r.read()
          self._done(c, r)
          break
        if r.length != total:
          raise http.client.HTTPException(f"answered {r.length} bytes,"
                                          f" expected {total}")
        for *_, d in pieces:
          if d.flags.c_contiguous:
            _readinto_exact(r, memoryview(d.reshape(-1)).cast("B"), what,
                            ConnectionError)
          else:  # through this thread's scratch buffer, in blocks
            for blk, raw, view in _blocks(d):
              _readinto_exact(r, memoryview(raw), what, ConnectionError)
              blk[...] = view
        with self._lock:
          self.bytes_received += total
          self.requests += 1
        self._done(c, r)
        return total
      except (OSError, http.client.HTTPException) as e:
        last = e
        self._drop()
        self._tls_failure(e)
        if self._stale(c, e):
          continue
        attempt += 1
        if attempt <= self.retries:
          time.sleep(0.05 * 2 ** (attempt - 1))
    else:
      raise UnreachableError(f"store server {self.url} is unreachable while"
                       f" reading {what} ({self.retries + 1} attempts,"
                       f" timeout {self.timeout}s): {type(last).__name__}:"
                       f" {last}")
    self._refused(status, err, what)
    if status == 409:
      raise ChecksumError(f"store server {self.url}: {what}: {_msg(err)}")
    raise StoreError(f"store server {self.url}: {what}: HTTP {status}:"
                     f" {_msg(err)}")

  def upload(self, proc: int, header: dict, chunks: Iterator[np.ndarray],
             nbytes: int) -> dict:
    """Streams a snapshot (see the module docstring) to the server."""
    head = json.dumps(header).encode()
    total = 8 + len(head) + nbytes

    def body():
      yield struct.pack("<Q", len(head)) + head
      for c in chunks:
        yield memoryview(np.ascontiguousarray(c)).cast("B")

    c = self._new_conn(max(self.timeout, 300))
    failed = None
    try:
      try:
        c.request("POST", f"/upload/{proc}", body=body(),
                  headers={"Content-Length": str(total), **self._headers})
      except OSError as e:
        # The server may have refused the upload (401, 403, 413) and closed
        # before reading the body: its answer says why, if it arrived.
        failed = e
      r = c.getresponse()
      out = r.read()
    except (OSError, http.client.HTTPException) as e:
      self._tls_failure(failed or e)
      raise StoreError(f"store server {self.url}: uploading the snapshot of"
                       f" process {proc} failed: {failed or e}") from e
    finally:
      c.close()
    if failed is not None and r.status == 200:  # pragma: no cover - defensive
      raise StoreError(f"store server {self.url}: uploading the snapshot of"
                       f" process {proc} failed: {failed}") from failed
    self._refused(r.status, out, f"the upload of process {proc}")
    if r.status != 200:
      raise StoreError(f"store server {self.url}: upload of process {proc}"
                       f" answered {r.status}: {_msg(out)}")
    return json.loads(out)


def _msg(body: bytes) -> str:
  try:
    return json.loads(body)["error"]
  except Exception:
    return body[:300].decode("utf-8", "replace")


def _ephemeral_range() -> tuple[int, int]:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      lo, hi = (int(x) for x in f.read().split())
    return lo, hi
  except (OSError, ValueError):
    return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` that nothing listens on now, for a server
  started next (a ``jax.distributed`` coordinator, a store server).

  Drawn at random below the kernel's ephemeral range where that leaves
  room (ports 20000 up to it): a port the kernel handed out by
  ``bind(0)`` is also what it hands to the next outgoing connection, so
  on a busy host it is often taken again before the server binds it.
  """
  lo, _ = _ephemeral_range()
  if lo > 21000:
    rng = random.SystemRandom()
    for _ in range(64):
      port = rng.randrange(20000, lo)
      with socket.socket() as s:
        try:
          s.bind((host, port))
        except OSError:
          continue
        return port
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]
