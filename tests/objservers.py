"""Object-storage servers for tests, started on loopback by the tests
themselves: moto's S3 server and gcp-storage-emulator (in memory)."""

from __future__ import annotations

import contextlib
import os
import re
import uuid

import requests

from tenplex_jax.store.server import free_port


@contextlib.contextmanager
def moto_server():
  """A moto S3 server on 127.0.0.1; yields its endpoint URL; always
  stopped."""
  from moto.server import ThreadedMotoServer
  srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  srv.start()
  try:
    host, port = srv.get_host_and_port()
    srv.endpoint = f"http://{host}:{port}"
    yield srv
  finally:
    srv.stop()


def s3_env(monkeypatch, endpoint: str, key: str = "testing") -> None:
  """The AWS SDK's environment, pointing at ``endpoint``."""
  monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key)
  monkeypatch.setenv("AWS_REGION", "us-east-1")
  for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
    monkeypatch.delenv(k, raising=False)


def new_bucket(endpoint: str) -> str:
  import boto3
  name = f"b-{uuid.uuid4().hex[:12]}"
  boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
  return name


def s3_require_auth(endpoint: str, on: bool) -> None:
  """Makes the moto server check credentials (every key is then unknown),
  or stop checking."""
  requests.post(f"{endpoint}/moto-api/reset-auth",
                data=b"0" if on else b"inf", timeout=10).raise_for_status()


def _multipart_related(raw: bytes, content_type: str) -> dict:
  """An upload of ``uploadType=multipart`` split at its delimiters as sent.

  The emulator parses it with :mod:`email`, which takes ``\r\n`` before a
  delimiter as the line break even where the client breaks lines with
  ``\n`` alone (gcsfs does), so an object whose last byte is 13 was stored
  one byte short and tests whose data ended with that byte by chance
  failed. Here the line break is the one the client used after the first
  delimiter.
  """
  import json
  boundary = re.search(r'boundary="?([^";]+)"?', content_type).group(1)
  delim = b"--" + boundary.encode()
  if not raw.startswith(delim):
    raise ValueError("multipart body does not start with its boundary")
  eol = b"\r\n" if raw[len(delim):].startswith(b"\r\n") else b"\n"
  pieces = raw[len(delim) + len(eol):].split(eol + delim)
  parts = []
  for piece in pieces[:-1]:  # the last is "--" and the epilogue
    head, _, body = piece.lstrip(b"\r\n").partition(eol + eol)
    headers = {}
    for line in head.split(eol):
      k, _, v = line.decode().partition(":")
      headers[k.strip().lower()] = v.strip()
    parts.append((headers, body))
  (_, meta), (headers, content) = parts
  ctype = headers.get("content-type", "application/octet-stream")
  return {"meta": json.loads(meta), "content": content,
          "content-type": ctype.split(";")[0].strip()}


@contextlib.contextmanager
def gcs_server():
  """A gcp-storage-emulator on 127.0.0.1, in memory; yields its URL;
  always stopped. Its multipart uploads keep every byte (see
  ``_multipart_related``)."""
  from gcp_storage_emulator import server as emu
  read_data = emu._read_data

  def exact_read_data(handler, query):
    ctype = handler.headers.get("Content-Type") or ""
    if not ctype.startswith("multipart/related"):
      return read_data(handler, query)
    raw = emu._decode_raw_data(emu._read_raw_data(handler), handler)
    return _multipart_related(raw, ctype) if raw else None

  emu._read_data = exact_read_data
  port = free_port()
  srv = emu.create_server("127.0.0.1", port, in_memory=True)
  srv.start()
  try:
    yield f"http://127.0.0.1:{port}"
  finally:
    srv.stop()
    emu._read_data = read_data


def gcs_env(monkeypatch, url: str) -> None:
  """The Google client libraries' environment for the emulator at ``url``;
  tensorstore's variables, which tenplex_jax sets from it, are restored
  afterwards."""
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
  monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
  monkeypatch.delenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", raising=False)


def new_gcs_bucket() -> str:
  import fsspec
  name = f"b-{uuid.uuid4().hex[:12]}"
  fsspec.filesystem("gcs", skip_instance_cache=True).mkdir(name)
  return name


def upload_dir(local: str, scheme: str, bucket: str, prefix: str) -> None:
  """Uploads a directory object by object, as ``aws s3 sync`` or ``gsutil
  rsync`` do (boto3 for S3, gcsfs for GCS)."""
  files = []
  for d, _, names in os.walk(local):
    for n in names:
      full = os.path.join(d, n)
      files.append((full, f"{prefix}/{os.path.relpath(full, local)}"))
  if scheme == "s3":
    import boto3
    c = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for full, key in files:
      c.upload_file(full, bucket, key)
  else:
    import fsspec
    fs = fsspec.filesystem("gcs", skip_instance_cache=True)
    for full, key in files:
      fs.put_file(full, f"{bucket}/{key}")


def snapshot_objects(scheme: str, bucket: str) -> dict:
  """Every object of ``bucket``: key -> (size, etag or md5, time), to show
  that reading changed nothing."""
  import fsspec
  fs = fsspec.filesystem("s3" if scheme == "s3" else "gcs",
                         skip_instance_cache=True, use_listings_cache=False)
  out = {}
  for k, info in fs.find(bucket, detail=True).items():
    out[k] = (info.get("size"), info.get("ETag") or info.get("md5Hash"),
              str(info.get("LastModified") or info.get("updated")))
  return out
