"""Object storage (``s3://``, ``gs://``): URLs, file systems and kvstores.

The one place that knows how to reach a bucket. Small objects (listings,
manifests, ``CURRENT``, JSON metadata) go through fsspec (``s3fs``,
``gcsfs``), except a tenplex store's on S3 (:class:`KvListing`: through
tensorstore, no SDK session to build); array bytes through tensorstore's
``s3``/``gcs`` kvstores.
Endpoint and credentials follow each ecosystem's standard environment:

* S3 and S3-compatible stores: the AWS SDK's variables
  ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``),
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` (or
  ``AWS_DEFAULT_REGION``), and the SDK's other sources of credentials.
* GCS: the Google client libraries' (application default credentials;
  ``STORAGE_EMULATOR_HOST`` for an emulator). tensorstore's ``gcs``
  driver does not read ``STORAGE_EMULATOR_HOST``; when it is set (and
  tensorstore's own ``TENSORSTORE_GCS_HTTP_URL`` is not), this module sets
  ``TENSORSTORE_GCS_HTTP_URL`` to it and, as emulators take any token,
  ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` to a placeholder unless set: the
  only environment this library writes.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

from tenplex_jax.errors import LocationError, UsageError

__all__ = ["COMMIT_MARKERS", "OBJECT_SCHEMES", "KvListing", "Listing",
           "download",
           "filesystem",
           "fs_path", "join", "kvstore_spec", "location_error", "split_url",
           "upload_tree"]

OBJECT_SCHEMES = ("s3", "gs")
_FS_PROTOCOL = {"s3": "s3", "gs": "gcs"}
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")


def split_url(url: str) -> tuple[str, str, str]:
  """``(scheme, bucket, key prefix)`` of ``s3://BUCKET/KEY`` or
  ``gs://BUCKET/KEY`` (the key without leading or trailing ``/``).

  Raises:
    UsageError: not such a URL, or the bucket name is malformed.

  Example:
    >>> split_url("s3://ckpts/run1/")
    ('s3', 'ckpts', 'run1')
  """
  scheme, sep, rest = str(url).partition("://")
  if not sep or scheme not in OBJECT_SCHEMES:
    raise UsageError(f"{url!r} is not an object-storage URL (schemes:"
                     f" {', '.join(s + '://' for s in OBJECT_SCHEMES)})")
  bucket, _, key = rest.partition("/")
  if not _BUCKET.match(bucket):
    raise UsageError(f"{url}: {bucket!r} is not a bucket name (3-63"
                     " lower-case letters, digits, '.', '-' or '_')")
  key = key.strip("/")
  if any(p in ("", ".", "..") for p in key.split("/")) and key:
    raise UsageError(f"{url}: the key {key!r} has an empty, '.' or '..'"
                     " component")
  return scheme, bucket, key


def join(url: str, *parts: str) -> str:
  """``url`` with ``parts`` appended, one ``/`` between each."""
  return "/".join([url.rstrip("/")] + [p.strip("/") for p in parts if p])


def _gcs_emulator() -> None:
  host = os.environ.get("STORAGE_EMULATOR_HOST")
  if not host or os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
    return
  if "://" not in host:
    host = "http://" + host
  os.environ["TENSORSTORE_GCS_HTTP_URL"] = host
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


# The environment a file system's endpoint and credentials come from: one
# file system per scheme and environment (making one costs ~1 s: the SDK's
# session and service models), remade when these change.
_ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_PROFILE", "STORAGE_EMULATOR_HOST",
             "GOOGLE_APPLICATION_CREDENTIALS")
_FILESYSTEMS: dict = {}
_FS_LOCK = threading.Lock()


def filesystem(scheme: str):
  """An fsspec file system for ``scheme`` in the current environment
  (listings are never cached: a store changes under its readers)."""
  key = (scheme, os.getpid()) + tuple(os.environ.get(k) for k in _ENV_KEYS)
  with _FS_LOCK:
    fs = _FILESYSTEMS.get(key)
    if fs is None:
      import fsspec  # here: a local restore never needs it (0.1-0.3 s)
      fs = _FILESYSTEMS[key] = fsspec.filesystem(
          _FS_PROTOCOL[scheme], use_listings_cache=False,
          skip_instance_cache=True)
    return fs


def fs_path(url: str) -> str:
  """The path of ``url`` in :func:`filesystem`'s terms (``BUCKET/KEY``)."""
  _, bucket, key = split_url(url)
  return f"{bucket}/{key}" if key else bucket


def kvstore_spec(url: str) -> dict:
  """The tensorstore kvstore spec of ``url`` (a key prefix ending in ``/``
  unless the URL names the bucket only), endpoint and region from the
  environment.

  Example:
    >>> import os
    >>> os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9000"
    >>> os.environ["AWS_REGION"] = "us-east-1"
    >>> spec = kvstore_spec("s3://ckpts/run1")
    >>> spec["driver"], spec["bucket"], spec["path"], spec["endpoint"]
    ('s3', 'ckpts', 'run1/', 'http://127.0.0.1:9000')
    >>> del os.environ["AWS_ENDPOINT_URL"], os.environ["AWS_REGION"]
  """
  scheme, bucket, key = split_url(url)
  path = key + "/" if key else ""
  if scheme == "gs":
    _gcs_emulator()
    return {"driver": "gcs", "bucket": bucket, "path": path}
  spec = {"driver": "s3", "bucket": bucket, "path": path}
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or \
      os.environ.get("AWS_ENDPOINT_URL")
  if endpoint:
    spec["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get(
      "AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    # The SDK's chain would take these first too; naming them skips its
    # probing of ~/.aws files.
    spec["aws_credentials"] = {"type": "environment"}
  return spec


def _server(scheme: str) -> str:
  if scheme == "gs":
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    return f"STORAGE_EMULATOR_HOST={host}" if host else "storage.googleapis.com"
  ep = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
      "AWS_ENDPOINT_URL")
  return f"AWS_ENDPOINT_URL={ep}" if ep else "AWS's default endpoint"


def location_error(url: str, exc: BaseException, doing: str
                   ) -> LocationError:
  """One clear line for a failed object-storage call: what was done, on
  which location and server, and the kind of failure (no such bucket,
  credentials refused, unreachable), then the library's message."""
  scheme = url.partition("://")[0]
  msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
  low = msg.lower()

  def has(*words):
    return any(re.search(r"\b" + re.escape(w) + r"\b", low) for w in words)

  if has("nosuchbucket", "bucket does not exist", "the specified bucket does"
         " not exist") or ("bucket" in low and has("not found", "404")):
    why = "the bucket does not exist"
  elif has("could not connect", "failed to connect", "connection refused",
           "timed out", "timeout", "unavailable", "connection reset",
           "cannot connect", "name resolution", "unreachable",
           "connecterror", "clientconnectorerror", "endpointconnectionerror"):
    why = "the server does not answer"
  elif has("accessdenied", "access denied", "forbidden", "403", "401",
           "invalidaccesskeyid", "signaturedoesnotmatch", "access key id",
           "unauthorized", "permissionerror", "credentials"):
    why = "the credentials were refused"
  else:
    why = "the request failed"
  return LocationError(f"{url}: {doing} failed: {why} (server: "
                       f"{_server(scheme)}): {msg[:300]}")


class Listing:
  """Every object under ``url``, listed once, as a read-only tree of
  directories and files (object stores have no directories: a key prefix
  followed by ``/`` is one).

  Raises:
    LocationError: the bucket does not exist, the credentials are refused
      or the server does not answer.
  """

  def __init__(self, url: str):
    scheme, _, _ = split_url(url)
    self.url = url.rstrip("/")
    self.fs = filesystem(scheme)
    self._base = fs_path(self.url)
    try:
      found = self.fs.find(self._base, detail=True)
      if not found:  # an empty prefix, or no bucket at all
        self.fs.ls(self._base.split("/")[0])
    except Exception as e:
      raise location_error(self.url, e, "listing") from e
    n = len(self._base) + 1
    self.files = {f[n:] for f in found if f.startswith(self._base + "/")}
    #: Bytes of each object (key relative to the listed prefix), as listed.
    self.sizes = {f[n:]: int(info.get("size") or 0)
                  for f, info in found.items()
                  if f.startswith(self._base + "/")}
    self.dirs = _dirs(self.files)
    self.bytes_read = 0

  def rel(self, url: str) -> str | None:
    """``url``'s key relative to the listed prefix; None if outside it."""
    url = url.rstrip("/")
    if url == self.url:
      return ""
    if url.startswith(self.url + "/"):
      return url[len(self.url) + 1:]
    return None

  def isfile(self, url: str) -> bool:
    return self.rel(url) in self.files

  def isdir(self, url: str) -> bool:
    return self.rel(url) in self.dirs

  def listdir(self, url: str) -> list[str]:
    """The names under directory ``url``; FileNotFoundError if none."""
    names = self.dirs.get(self.rel(url))
    if names is None:
      raise FileNotFoundError(url)
    return sorted(names)

  def read(self, url: str) -> bytes:
    """The bytes of object ``url``; FileNotFoundError if not listed."""
    rel = self.rel(url)
    if rel not in self.files:
      raise FileNotFoundError(url)
    try:
      data = self.fs.cat_file(f"{self._base}/{rel}")
    except FileNotFoundError:  # deleted since the listing
      raise
    except Exception as e:
      raise location_error(url, e, "reading") from e
    self.bytes_read += len(data)
    return data


def _dirs(files) -> dict[str, set[str]]:
  """Directory -> names in it, of the object keys ``files``."""
  dirs: dict[str, set[str]] = {}
  for k in files:
    parts = k.split("/")
    for i in range(len(parts)):
      dirs.setdefault("/".join(parts[:i]), set()).add(parts[i])
  return dirs


class KvListing(Listing):
  """:class:`Listing`'s tree, listed and read through a tensorstore kvstore
  (``kv``, opened on ``url``'s prefix) instead of fsspec: one list request
  (no SDK session to build: s3fs's first call costs 0.3-0.8 s here, most
  of it CPU), and small objects read concurrently on tensorstore's
  threads, those :meth:`prefetch` names all in flight at once.

  Used for S3 (:class:`tenplex_jax.store.objects.ObjectStore`); not for
  GCS emulators, which ignore the ``startOffset``/``endOffset`` of
  tensorstore's GCS listing. No object sizes (:attr:`sizes` is empty).

  Raises:
    LocationError: the bucket does not exist, the credentials are refused
      or the server does not answer.
  """

  def __init__(self, url: str, kv, timeout: float = 120.0):
    self.url = url.rstrip("/")
    self._kv = kv
    self._timeout = timeout
    try:
      keys = kv.list().result(timeout=timeout)
    except Exception as e:
      raise location_error(self.url, e, "listing") from e
    self.files = {k.decode() for k in keys}
    self.sizes = {}
    self.dirs = _dirs(self.files)
    self._bytes = 0
    self._lock = threading.Lock()
    self._pending: dict[str, Any] = {}  # key -> read future (prefetch)

  @property
  def bytes_read(self) -> int:
    """Bytes of every object read, prefetched ones included once their
    read is done (whether or not :meth:`read` took them)."""
    return self._bytes

  def _count(self, fut) -> None:
    try:
      r = fut.result()
    except Exception:  # noqa: BLE001 - raised to the reader, not here
      return
    if r.state == "value":
      with self._lock:
        self._bytes += len(r.value)

  def prefetch(self, urls) -> None:
    """Starts reading the listed objects ``urls`` (all at once, on
    tensorstore's threads); :meth:`read` then takes each one's answer."""
    for url in urls:
      rel = self.rel(url)
      if rel not in self.files:
        continue
      with self._lock:
        if rel in self._pending:
          continue
        fut = self._pending[rel] = self._kv.read(rel)
      fut.add_done_callback(self._count)

  def read(self, url: str) -> bytes:
    """The bytes of object ``url``; FileNotFoundError if not listed (or
    deleted since the listing)."""
    rel = self.rel(url)
    if rel not in self.files:
      raise FileNotFoundError(url)
    with self._lock:
      fut = self._pending.pop(rel, None)
    counted = fut is not None
    if fut is None:
      fut = self._kv.read(rel)
    try:
      r = fut.result(timeout=self._timeout)
    except Exception as e:
      raise location_error(url, e, "reading") from e
    if r.state != "value":
      raise FileNotFoundError(url)  # deleted since the listing
    if not counted:
      with self._lock:
        self._bytes += len(r.value)
    return r.value


def download(url: str, local: str,
             progress: Callable[[], None] | None = None) -> int:
  """Copies object ``url`` whole into local file ``local``, streamed in one
  request and written in order from its start (memory stays at the
  library's read size, not the object's); returns the bytes written.

  ``progress``, when given, is called (with no arguments) each time more
  bytes reached the file: the bytes ``[0, os.stat(local).st_size)`` are
  then in it, so a reader may use that prefix while the rest streams.

  Raises:
    LocationError: the request failed (one line).
  """
  scheme, _, _ = split_url(url)
  fs = filesystem(scheme)
  # s3fs and gcsfs would cut a large object into concurrent ranged
  # requests, each buffered whole in memory (and written out of order);
  # one streamed request keeps memory flat and the file a growing prefix.
  kw = {"max_concurrency": 1} if scheme == "s3" else {"concurrency": 1}
  if progress is not None:
    kw["callback"] = _progress_callback(progress)
  try:
    fs.get_file(fs_path(url), local, **kw)
  except Exception as e:
    raise location_error(url, e, "reading") from e
  return os.path.getsize(local)


def _progress_callback(fn: Callable[[], None]):
  """An fsspec callback that calls ``fn()`` as bytes reach the file."""
  import fsspec.callbacks

  class _Progress(fsspec.callbacks.Callback):

    def call(self, *args, **kwargs):
      fn()

  return _Progress()


#: Files that mark a checkpoint or snapshot complete: uploaded last.
COMMIT_MARKERS = ("manifest.json", "_CHECKPOINT_METADATA",
                  "commit_success.txt")


def upload_tree(local_dir: str, url: str) -> None:
  """Uploads directory ``local_dir`` to ``url``, one object per file, the
  commit markers (:data:`COMMIT_MARKERS`) after everything else, deepest
  first, so a reader never sees a marker before the data it vouches for.

  Raises:
    UsageError: ``url`` already holds objects.
    LocationError: the bucket or server refused (one line).
  """
  scheme, _, _ = split_url(url)
  fs = filesystem(scheme)
  base = fs_path(url)
  try:
    if fs.find(base):
      raise UsageError(f"{url} exists (holds objects); this writes a new"
                       " checkpoint")
    files = []
    for d, _, names in os.walk(local_dir):
      for n in sorted(names):
        full = os.path.join(d, n)
        files.append((full, os.path.relpath(full, local_dir).replace(
            os.sep, "/")))
    data = [(f, r) for f, r in files
            if r.rsplit("/", 1)[-1] not in COMMIT_MARKERS]
    marks = sorted((x for x in files if x not in data),
                   key=lambda x: -x[1].count("/"))
    if data:
      fs.put([f for f, _ in data], [f"{base}/{r}" for _, r in data])
    for f, r in marks:
      fs.put_file(f, f"{base}/{r}")
  except UsageError:
    raise
  except Exception as e:
    raise location_error(url, e, "uploading") from e
