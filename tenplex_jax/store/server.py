"""Serving a host's store to other hosts: a small HTTP server and its client.

Endpoints (all under ``http://HOST:PORT``):

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
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import math
import os
import signal
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tenplex_jax.errors import ChecksumError, StoreError, UnreachableError
from tenplex_jax.layout import Box
from tenplex_jax.store.format import (ChunkMaps, HostStore, SnapshotWriter,
                                      format_box, parse_box)

__all__ = ["RemoteStore", "make_server", "serve"]

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


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: "_StoreServer"

  def log_message(self, fmt, *args):  # quiet
    pass

  def _send(self, code: int, body: bytes, ctype: str = "application/json",
            headers: Mapping[str, str] | None = None):
    self.send_response(code)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    self.end_headers()
    self.wfile.write(body)

  def _error(self, code: int, msg: str):
    self._send(code, json.dumps({"error": msg}).encode())

  @contextlib.contextmanager
  def _answering_errors(self):
    """Turns a failed request into its HTTP error; the server keeps serving."""
    try:
      yield
    except ChecksumError as e:
      self._error(409, str(e))
    except StoreError as e:
      self._error(404, str(e))
    except (BrokenPipeError, ConnectionResetError):
      pass
    except Exception as e:  # pragma: no cover - report, keep serving
      self._error(500, f"{type(e).__name__}: {e}")

  def do_GET(self):
    url = urllib.parse.urlsplit(self.path)
    parts = url.path.strip("/").split("/", 2)
    store: HostStore = self.server.store
    with self._answering_errors():
      if parts[0] == "manifest":
        current = store.manifests()
        history = {str(k): {str(st): m for st, m in by_step.items()
                            if st != current[k]["step"]}
                   for k, by_step in store.all_manifests().items()
                   if k in current}
        body = json.dumps({"store_id": store.store_id,
                           "procs": {str(k): v for k, v in current.items()},
                           "history": history}).encode()
        self._send(200, body)
      elif parts[0] == "stats":
        with self.server.lock:
          body = json.dumps(self.server.stats).encode()
        self._send(200, body)
      elif parts[0] == "tensor" and len(parts) == 3:
        proc = int(parts[1])
        path = urllib.parse.unquote(parts[2])
        q = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        box = parse_box(q.get("box", [""])[0])
        step = int(q["step"][0]) if q.get("step", [""])[0] else None
        storage, shape, _, _ = store.storage_info(path, box, proc=proc,
                                                  step=step)
        data = np.empty(shape, storage)
        store.read_into(path, box, data, proc=proc, step=step)
        body = memoryview(data.reshape(-1)).cast("B")
        with self.server.lock:
          self.server.stats["bytes_sent"] += len(body)
          self.server.stats["requests"] += 1
          self.server.stats["pieces"] += 1
        self._send(200, body, "application/octet-stream",
                   {"X-Storage-Dtype": data.dtype.name,
                    "X-Shape": ",".join(map(str, data.shape))})
      else:
        self._error(404, f"no endpoint {url.path}")

  def _read_pieces(self):
    store: HostStore = self.server.store
    try:
      n = int(self.headers.get("Content-Length", 0))
      req = json.loads(self.rfile.read(n))
      pieces = [(int(q[0]), str(q[1]), parse_box(q[2]),
                 None if len(q) < 4 or q[3] is None else int(q[3]))
                for q in req["pieces"]]
      if any(len(q) not in (3, 4) for q in req["pieces"]):
        raise ValueError("a piece is [proc, path, box] or [proc, path, box,"
                         " step]")
    except Exception as e:
      self._error(400, f"bad /read request: {type(e).__name__}: {e}")
      return
    with self._answering_errors():
      layout = []
      total = 0
      for k, p, box, st in pieces:
        storage, shape, _, _ = store.storage_info(p, box, proc=k, step=st)
        nb = math.prod(shape) * storage.itemsize
        layout.append((total, nb, storage, shape))
        total += nb
      t0 = time.perf_counter()
      segs = []
      maps = ChunkMaps()  # a chunk several pieces share is checked once
      for (k, p, box, st), (_, nb, _, _) in zip(pieces, layout):
        got = store.read_segments(p, box, proc=k, maps=maps, step=st)
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
      self.send_response(200)
      self.send_header("Content-Type", "application/octet-stream")
      self.send_header("Content-Length", str(total))
      self.end_headers()
      for g in segs:
        _write_segment(self.wfile.write, g)
      del segs
      maps.close()
      with self.server.lock:
        self.server.stats["send_s"] += time.perf_counter() - t1

  def do_POST(self):
    url = urllib.parse.urlsplit(self.path)
    parts = url.path.strip("/").split("/")
    if parts == ["read"]:
      self._read_pieces()
      return
    if len(parts) != 2 or parts[0] != "upload":
      self._error(404, f"no endpoint {url.path}")
      return
    try:
      proc = int(parts[1])
      (hlen,) = struct.unpack("<Q", self.rfile.read(8))
      header = json.loads(self.rfile.read(hlen))
      w = SnapshotWriter(self.server.store.root, proc, step=header["step"])
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
                         run=header.get("run", ""),
                         mode=header.get("mode", "local"),
                         keep=int(header.get("keep", 1)))
      except BaseException:
        w.abort()
        raise
      self._send(200, json.dumps({"snapshot": final}).encode())
    except Exception as e:
      self._error(500, f"upload for process {parts[1]} failed:"
                  f" {type(e).__name__}: {e}")


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

  def __init__(self, addr, store: HostStore):
    super().__init__(addr, _Handler)
    self.store = store
    self.lock = threading.Lock()
    self.stats = {"bytes_sent": 0, "requests": 0, "pieces": 0,
                  "bytes_received": 0, "read_s": 0.0, "send_s": 0.0}


def make_server(root: str, port: int = 0, *, host: str = "127.0.0.1"
                ) -> _StoreServer:
  """A store server for directory ``root`` (not yet serving).

  Example:
    >>> import tempfile, threading
    >>> srv = make_server(tempfile.mkdtemp(), 0)
    >>> t = threading.Thread(target=srv.serve_forever, daemon=True); t.start()
    >>> client = RemoteStore(f"http://127.0.0.1:{srv.server_address[1]}")
    >>> client.manifests()
    {}
    >>> client.close(); srv.shutdown(); srv.server_close()
  """
  os.makedirs(root, exist_ok=True)
  return _StoreServer((host, int(port)), HostStore(root))


def serve(root: str, port: int, *, host: str = "127.0.0.1",
          ready_file: str | None = None) -> None:
  """Serves ``root`` until SIGTERM/SIGINT (``tenplex-jax store serve``).

  Writes ``host:port`` to ``ready_file`` once listening (port 0 picks a
  free port).
  """
  srv = make_server(root, port, host=host)

  def stop(*_):
    threading.Thread(target=srv.shutdown, daemon=True).start()

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  if ready_file:
    tmp = ready_file + ".tmp"
    with open(tmp, "w") as f:
      f.write(f"{srv.server_address[0]}:{srv.server_address[1]}")
    os.replace(tmp, ready_file)
  print(f"tenplex-jax store: serving {os.path.abspath(root)} on"
        f" http://{srv.server_address[0]}:{srv.server_address[1]}", flush=True)
  try:
    srv.serve_forever(poll_interval=0.2)
  finally:
    srv.server_close()


class RemoteStore:
  """Client of a store server: manifests and sub-box reads over HTTP.

  Keeps one keep-alive connection per thread; retries connection errors
  ``retries`` times with backoff, each attempt bounded by ``timeout``
  seconds, then raises :class:`StoreError` naming the URL and the tensor.
  ``bytes_received`` counts the payload bytes read.
  """

  def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2):
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
      raise StoreError(f"store URL {url!r} is not http://HOST:PORT")
    self.url = url.rstrip("/")
    self.host, self.port = u.hostname, u.port or 80
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

  def _conn(self) -> http.client.HTTPConnection:
    c = getattr(self._local, "conn", None)
    if c is None:
      c = http.client.HTTPConnection(self.host, self.port,
                                     timeout=self.timeout)
      self._local.conn = c
      with self._lock:
        self._conns.append(c)
    return c

  def _drop(self):
    c = getattr(self._local, "conn", None)
    if c is not None:
      c.close()
    self._local.conn = None

  def _get(self, target: str, what: str) -> tuple[int, dict, bytes]:
    last = None
    for attempt in range(self.retries + 1):
      try:
        c = self._conn()
        c.request("GET", target)
        r = c.getresponse()
        body = r.read()
        return r.status, dict(r.getheaders()), body
      except (OSError, http.client.HTTPException) as e:
        last = e
        self._drop()
        if attempt < self.retries:
          time.sleep(0.05 * 2 ** attempt)
    raise UnreachableError(
        f"store server {self.url} is unreachable while reading {what}"
        f" ({self.retries + 1} attempts, timeout {self.timeout}s):"
        f" {type(last).__name__}: {last}")

  @property
  def store_id(self) -> str:
    return self.fetch_manifest()["store_id"]

  def fetch_manifest(self, refresh: bool = False) -> dict:
    if self._manifest is None or refresh:
      code, _, body = self._get("/manifest", "/manifest")
      if code != 200:
        raise StoreError(f"store server {self.url}: /manifest answered"
                         f" {code}: {body[:300]!r}")
      self._manifest = json.loads(body)
    return self._manifest

  def manifests(self) -> dict[int, dict]:
    """The manifest of each process's current snapshot."""
    return {int(k): v for k, v in self.fetch_manifest()["procs"].items()}

  def all_manifests(self) -> dict[int, dict[int, dict]]:
    """Every kept snapshot's manifest: process -> step -> manifest (the
    current one included; a server without ``history`` gives the current
    ones only)."""
    man = self.fetch_manifest()
    out = {}
    for k, cur in man["procs"].items():
      by_step = {int(st): m for st, m in
                 man.get("history", {}).get(k, {}).items()}
      by_step[cur["step"]] = cur
      out[int(k)] = dict(sorted(by_step.items()))
    return out

  def stats(self) -> dict:
    code, _, body = self._get("/stats", "/stats")
    return json.loads(body)

  def read_storage(self, path: str, box: Box, *, proc: int,
                   step: int | None = None) -> np.ndarray:
    """Reads one sub-box (``GET /tensor``) of the snapshot of ``step``
    (default: the current one)."""
    target = (f"/tensor/{proc}/{urllib.parse.quote(path, safe='')}"
              f"?box={format_box(box)}"
              + ("" if step is None else f"&step={int(step)}"))
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
                step: int | None = None) -> int:
    """Reads several sub-boxes in one request (``POST /read``) straight
    into their destinations.

    Args:
      pieces: (process, tensor path, box, destination array in the storage
        dtype with the box's shape); a destination that is not
        C-contiguous is filled block by block through a small reused
        buffer.
      step: the step of the snapshots to read (default: the current ones).

    Returns:
      The payload bytes received.

    Raises:
      ChecksumError: the server found a corrupt chunk (names the piece).
      StoreError: the server is unreachable (after retries) or refused.
    """
    tail = [] if step is None else [int(step)]
    body = json.dumps({"pieces": [[k, p, format_box(b)] + tail
                                  for k, p, b, _ in pieces]}).encode()
    total = sum(d.nbytes for *_, d in pieces)
    what = (f"{len(pieces)} pieces ({pieces[0][1]} box"
            f" {list(pieces[0][2])} of process {pieces[0][0]}, ...)"
            if len(pieces) > 1 else
            f"{pieces[0][1]} box {list(pieces[0][2])} of process"
            f" {pieces[0][0]}")
    last = None
    for attempt in range(self.retries + 1):
      try:
        c = self._conn()
        c.request("POST", "/read", body=body,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
          status, err = r.status, r.read()
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
        return total
      except (OSError, http.client.HTTPException) as e:
        last = e
        self._drop()
        if attempt < self.retries:
          time.sleep(0.05 * 2 ** attempt)
    else:
      raise UnreachableError(f"store server {self.url} is unreachable while"
                       f" reading {what} ({self.retries + 1} attempts,"
                       f" timeout {self.timeout}s): {type(last).__name__}:"
                       f" {last}")
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

    try:
      c = http.client.HTTPConnection(self.host, self.port,
                                     timeout=max(self.timeout, 300))
      c.request("POST", f"/upload/{proc}", body=body(),
                headers={"Content-Length": str(total)})
      r = c.getresponse()
      out = r.read()
      c.close()
    except (OSError, http.client.HTTPException) as e:
      raise StoreError(f"store server {self.url}: uploading the snapshot of"
                       f" process {proc} failed: {e}") from e
    if r.status != 200:
      raise StoreError(f"store server {self.url}: upload of process {proc}"
                       f" answered {r.status}: {_msg(out)}")
    return json.loads(out)


def _msg(body: bytes) -> str:
  try:
    return json.loads(body)["error"]
  except Exception:
    return body[:300].decode("utf-8", "replace")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
