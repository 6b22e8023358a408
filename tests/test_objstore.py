"""Stores and Orbax checkpoints on object storage, against real servers of
those APIs started here on loopback (moto's S3 server, gcp-storage-emulator),
and the location registry (an unknown scheme is an error, never a path)."""

import contextlib
import io
import itertools
import json
import os
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
import tenplex_jax.orbax as tjo
from tenplex_jax import cli
from tenplex_jax.errors import LocationError, StoreError, UsageError
from tenplex_jax.locations import SCHEMES, parse_location
from tenplex_jax.store import HostStore, RemoteStore, make_server, open_store
from tenplex_jax.store.handle import StoreHandle
from tenplex_jax.store.objects import ObjectStore, gc_objects

from objservers import (gcs_env, gcs_server, moto_server, new_bucket,
                        new_gcs_bucket, s3_env, s3_require_auth,
                        snapshot_objects, upload_dir)

pytestmark = pytest.mark.filterwarnings(
    # botocore/aiobotocore and gcsfs internals, not ours to fix.
    "ignore::DeprecationWarning", "ignore::ResourceWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning")


def _mesh(shape, names=("a", "b")):
  return jax.make_mesh(shape, names, devices=jax.devices()[:np.prod(shape)])


def _state(seed=0):
  m = _mesh((4, 2))
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((64, 48)).astype(np.float32)
  b = rng.integers(0, 1 << 30, (48,), dtype=np.int32)
  return {"w": jax.device_put(w, NamedSharding(m, P("a", "b"))),
          "b": jax.device_put(b, NamedSharding(m, P())),
          "step": 7}, {"w": w, "b": b}


def _target():
  m = _mesh((2, 4))
  return {"w": jax.ShapeDtypeStruct((64, 48), jnp.float32,
                                    sharding=NamedSharding(m, P("b", "a"))),
          "b": jax.ShapeDtypeStruct((48,), jnp.int32,
                                    sharding=NamedSharding(m, P("b"))),
          "step": 0}


def _check(out, want, target):
  for k in ("w", "b"):
    np.testing.assert_array_equal(np.asarray(out[k]), want[k])
    assert out[k].sharding == target[k].sharding
  assert out["step"] == 7


@pytest.fixture(scope="module")
def s3_server():
  with moto_server() as srv:
    yield srv.endpoint


@pytest.fixture
def s3(s3_server, monkeypatch):
  """A fresh bucket on the module's S3 server; the AWS variables set."""
  s3_env(monkeypatch, s3_server)
  return new_bucket(s3_server)


@pytest.fixture(scope="module")
def gcs_url():
  with gcs_server() as url:
    yield url


@pytest.fixture
def gs(gcs_url, monkeypatch):
  gcs_env(monkeypatch, gcs_url)
  return new_gcs_bucket()


@pytest.mark.parametrize("tail", [b"\r", b"\r\n", b"\n", b"\r\r", b"x"])
def test_gcs_test_server_keeps_every_byte_of_an_upload(gs, tail, tmp_path):
  """The emulator's multipart parser, as patched in ``objservers``, keeps
  an object's last bytes (unpatched it dropped a final ``\r``: the Orbax
  test below failed whenever an OCDBT file ended with byte 13)."""
  import fsspec
  data = bytes(range(256)) + tail
  (tmp_path / "f").write_bytes(data)
  fs = fsspec.filesystem("gcs", skip_instance_cache=True)
  fs.put_file(str(tmp_path / "f"), f"{gs}/k")
  fs.pipe(f"{gs}/p", data)
  assert fs.cat(f"{gs}/k") == data and fs.cat(f"{gs}/p") == data


def _cli(*argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = cli.main(list(argv))
  return rc, out.getvalue()


# ------------------------------------------------------------ the registry


@pytest.mark.parametrize("loc", ["foo://x", "S4://bucket/p", "hdfs://nn/p"])
def test_unknown_scheme_is_a_usage_error_never_a_path(loc, tmp_path,
                                                      monkeypatch):
  monkeypatch.chdir(tmp_path)
  state, _ = _state()
  calls = [lambda: tj.store.save(state, loc),
           lambda: tj.store.restore([loc], _target()),
           lambda: open_store(loc),
           lambda: tjo.inspect(loc),
           lambda: tjo.restore(loc, _target()),
           lambda: tjo.convert(str(tmp_path), loc)]
  for call in calls:
    with pytest.raises(UsageError) as e:
      call()
    assert "unknown scheme" in str(e.value)
    for s in SCHEMES:
      assert f"{s}://" in str(e.value)
  for argv in (["store", "ls", loc], ["store", "verify", loc],
               ["store", "gc", loc], ["ckpt", "inspect", loc]):
    rc, _ = _cli(*argv)
    assert rc == 2, argv
  assert os.listdir(tmp_path) == []  # nothing written as a local path


def test_parse_location_kinds():
  assert parse_location("s3://b-1/x/").target == "s3://b-1/x"
  assert parse_location("gs://b-1/x").kind == "object"
  assert parse_location("https://h:1").kind == "peer"
  assert parse_location("file:///tmp/x").target == "/tmp/x"
  assert parse_location("rel/dir").kind == "local"
  with pytest.raises(UsageError, match="absolute"):
    parse_location("file://rel")


# ------------------------------------------------ every handle, one contract


@pytest.fixture(params=["dir", "http", "s3", "gs"])
def any_store(request, tmp_path):
  """A store location of each kind, holding two rounds of ``_state``."""
  state, want = _state()
  kind = request.param
  if kind in ("dir", "http"):
    loc = str(tmp_path / "store")
  elif kind == "s3":
    loc = f"s3://{request.getfixturevalue('s3')}/run"
  else:
    loc = f"gs://{request.getfixturevalue('gs')}/run"
  tj.store.save(state, loc, step=6)
  tj.store.save(state, loc, step=7)
  if kind != "http":
    yield kind, loc, want
    return
  srv = make_server(loc, 0)
  th = threading.Thread(target=srv.serve_forever, daemon=True)
  th.start()
  try:
    yield kind, f"http://127.0.0.1:{srv.server_address[1]}", want
  finally:
    srv.shutdown()
    srv.server_close()


def test_every_handle_runs_the_contract(any_store):
  kind, loc, want = any_store
  h = open_store(loc)
  try:
    assert isinstance(h, {"dir": HostStore, "http": RemoteStore,
                          "s3": ObjectStore, "gs": ObjectStore}[kind])
    assert isinstance(h, StoreHandle)
    rounds, problems = h.all_rounds()
    assert problems == []
    assert [m["step"] for m in rounds[0]] == [6, 7]
    assert h.manifests()[0]["step"] == 7
    assert h.store_id
    got = h.read_storage("w", ((3, 9), (5, 20)), proc=0)
    np.testing.assert_array_equal(got.view(np.float32), want["w"][3:9, 5:20])
  finally:
    close = getattr(h, "close", None)
    if close:
      close()
  target = _target()
  _check(tj.store.restore([loc], target), want, target)


# ------------------------------------------------------------- tenplex stores


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_store_on_object_storage_restores_onto_a_new_mesh(scheme, request,
                                                          monkeypatch):
  bucket = request.getfixturevalue("s3" if scheme == "s3" else "gs")
  url = f"{scheme}://{bucket}/ckpts/run1"
  state, want = _state()
  snap = tj.store.save(state, url, step=7)
  assert snap.startswith(url + "/procs/0/snap-")
  before = snapshot_objects(scheme, bucket)
  assert any(k.endswith("/manifest.json") for k in before)
  fetched, events = [], []
  start = ObjectStore._start
  prefetch = ObjectStore.prefetch
  read_into = ObjectStore.read_into

  def counting(self, f, buf):
    fetched.append((f.fname, f.walk.chunk_bytes + 4))
    return start(self, f, buf)

  def spy(self, *a, **kw):
    events.append("prefetch")
    prefetch(self, *a, **kw)

  def reading(self, *a, **kw):
    events.append("read")
    return read_into(self, *a, **kw)

  from tenplex_jax.store import api
  rank = api._rank_copies
  ranked = []

  def ranking(*a, **kw):
    ranked.append(1)
    return rank(*a, **kw)

  monkeypatch.setattr(ObjectStore, "_start", counting)
  monkeypatch.setattr(ObjectStore, "prefetch", spy)
  monkeypatch.setattr(ObjectStore, "read_into", reading)
  monkeypatch.setattr(api, "_rank_copies", ranking)
  target = _target()
  out, rep = tj.store.restore_with_report([url], target)
  _check(out, want, target)
  assert len(ranked) == 1  # the copies ranked once, then bound to buffers
  # Every piece was announced before the first read (the transfer runs
  # ahead of the copies), each chunk object fetched once.
  first = events.index("read")
  assert "prefetch" not in events[first:] and first > 1, events
  names = [n for n, _ in fetched]
  assert len(names) == len(set(names)) > 1, names
  fetched = [n for _, n in fetched]
  # Only the boxes' chunks, each once: the plan's bytes (the whole state,
  # one process), plus the 4-byte checksum trailers.
  assert rep.state_bytes == want["w"].nbytes + want["b"].nbytes
  assert sum(fetched) <= 1.1 * rep.state_bytes, (sum(fetched), rep)
  # Reading wrote nothing: restore, ls, verify.
  rc, text = _cli("store", "ls", url, "--tensors")
  assert rc == 0 and "step        7" in text and "w" in text
  rc, text = _cli("store", "verify", url)
  assert rc == 0 and '"ok": true' in text
  assert snapshot_objects(scheme, bucket) == before
  assert not os.path.exists("s3:") and not os.path.exists("gs:")


def test_bucket_reads_run_a_bounded_window_ahead(s3, monkeypatch):
  """Announced reads fetch their chunk objects in order, at most the
  window ahead of the reads; a chunk's buffer is reused once its last
  announced read is done; an unannounced read fetches on its own."""
  from tenplex_jax.store import objects
  url = f"s3://{s3}/window"
  state, want = _state()
  tj.store.save(state, url, step=7)
  h = ObjectStore(url)
  boxes = [tuple(tuple(r) for r in b["box"])
           for b in h.manifests()[0]["tensors"]["w"]["boxes"]]
  assert len(boxes) == 8
  chunk = 16 * 24 * 4  # one chunk per box
  monkeypatch.setattr(objects, "_AHEAD_BYTES", chunk)
  allocs = []
  host_empty = objects.host_empty

  def counting(shape, dtype):
    allocs.append(shape)
    return host_empty(shape, dtype)

  fetched = []
  start = ObjectStore._start

  def fetching(self, f, buf):
    fetched.append(f.fname)
    return start(self, f, buf)

  monkeypatch.setattr(objects, "host_empty", counting)
  monkeypatch.setattr(ObjectStore, "_start", fetching)
  for box in boxes:
    h.prefetch("w", box, proc=0)
  started = lambda: sum(f.done is not None for f in h._fetches.values())
  assert started() == 1 and len(fetched) == 1
  for i, box in enumerate(boxes):
    got = h.read_storage("w", box, proc=0)
    (r0, r1), (c0, c1) = box
    np.testing.assert_array_equal(got.view(np.float32), want["w"][r0:r1,
                                                                  c0:c1])
    assert started() == (1 if i < len(boxes) - 1 else 0)
  # One buffer, reused by every chunk; every chunk fetched once.
  assert len(allocs) == 1
  assert len(fetched) == len(set(fetched)) == len(boxes)
  got = h.read_storage("w", boxes[0], proc=0)  # not announced: fetched
  assert len(fetched) == len(boxes) + 1 and len(allocs) == 1
  np.testing.assert_array_equal(got.view(np.float32), want["w"][:16, :24])
  h.drop_prefetched()


def test_s3_store_small_objects_go_through_the_kvstore_at_once(
    s3, monkeypatch):
  """A store on S3 is listed and its STORE_ID, CURRENT and manifests read
  through tensorstore's kvstore (no fsspec file system: building s3fs's
  session cost 0.3-0.8 s of a restore), every CURRENT and manifest asked
  for in one go; bytes_fetched counts each small object once."""
  import boto3

  from tenplex_jax import cloud
  from tenplex_jax.store import objects
  url = f"s3://{s3}/small"
  state, want = _state()
  for step in (5, 6, 7):
    tj.store.save(state, url, step=step, keep=2)
  c = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
  sizes = {o["Key"]: o["Size"]
           for o in c.list_objects_v2(Bucket=s3)["Contents"]}
  small = {k: n for k, n in sizes.items()
           if k.rsplit("/", 1)[-1] in ("STORE_ID", "CURRENT",
                                       "manifest.json")}
  assert len(small) == 4  # STORE_ID, CURRENT, the two kept manifests

  def no_fsspec(*a, **kw):
    raise AssertionError("fsspec used to read a store on S3")

  monkeypatch.setattr(cloud, "filesystem", no_fsspec)
  monkeypatch.setattr(objects, "filesystem", no_fsspec)
  asked = []
  prefetch = cloud.KvListing.prefetch

  def spy(self, urls):
    asked.append(sorted(u.rsplit("/", 1)[-1] for u in urls))
    prefetch(self, urls)

  monkeypatch.setattr(cloud.KvListing, "prefetch", spy)
  h = ObjectStore(url)
  rounds, problems = h.all_rounds()
  assert problems == [] and [m["step"] for m in rounds[0]] == [6, 7]
  assert h.store_id
  assert asked == [["STORE_ID"],
                   ["CURRENT", "manifest.json", "manifest.json"]]
  deadline = time.time() + 30
  while h.bytes_fetched < sum(small.values()) and time.time() < deadline:
    time.sleep(0.01)  # the reads' callbacks run on tensorstore's threads
  assert h.bytes_fetched == sum(small.values())
  got = h.read_storage("w", ((3, 9), (5, 20)), proc=0)
  np.testing.assert_array_equal(got.view(np.float32), want["w"][3:9, 5:20])
  target = _target()
  _check(tj.store.restore([url], target), want, target)


@pytest.mark.parametrize("damage", ["flip", "short", "missing"])
def test_damaged_chunk_object_is_a_clear_error(s3, damage):
  """A chunk object changed after the save (a flipped byte, cut short,
  deleted): the restore names the chunk, never returns its bytes."""
  import boto3
  url = f"s3://{s3}/damaged"
  state, want = _state()
  tj.store.save(state, url, step=7)
  c = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
  keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3)["Contents"]
          if "/data/w/" in o["Key"] and "/c/" in o["Key"]]
  key = sorted(keys)[0]
  body = bytearray(c.get_object(Bucket=s3, Key=key)["Body"].read())
  if damage == "flip":
    body[7] ^= 1
    c.put_object(Bucket=s3, Key=key, Body=bytes(body))
  elif damage == "short":
    c.put_object(Bucket=s3, Key=key, Body=bytes(body[:-9]))
  else:
    c.delete_object(Bucket=s3, Key=key)
  with pytest.raises(StoreError) as e:
    tj.store.restore([url], _target())
  msg = str(e.value)
  assert "chunk 0" in msg and "data/w/" in msg, msg
  want_kind = "missing" if damage == "missing" else "checksum mismatch"
  assert want_kind in msg, msg


def test_store_keeps_rounds_and_prunes_on_s3(s3):
  url = f"s3://{s3}/p"
  state, want = _state()
  for step in (1, 2, 3):
    tj.store.save(state, url, step=step, keep=2)
  st = ObjectStore(url)
  assert [m["step"] for m in st.all_rounds()[0][0]] == [2, 3]
  assert st.manifest(0)["step"] == 3  # CURRENT


def test_interrupted_save_never_becomes_the_newest_round(s3, monkeypatch):
  url = f"s3://{s3}/p"
  state, want = _state()
  tj.store.save(state, url, step=7)
  import tenplex_jax.store.objects as objects
  real = objects.filesystem

  class Killed(BaseException):
    pass

  class Dying:  # the file system, dying at the commit (the real one is
    # shared by later calls: it is wrapped, not changed)

    def __init__(self, fs):
      self.fs = fs

    def __getattr__(self, name):
      return getattr(self.fs, name)

    def put_file(self, lpath, rpath, **kw):
      if rpath.endswith("manifest.json"):
        raise Killed("killed before the commit")
      return self.fs.put_file(lpath, rpath, **kw)

  def dying(scheme):
    return Dying(real(scheme))

  monkeypatch.setattr(objects, "filesystem", dying)
  newer = {"w": state["w"] * 2, "b": state["b"], "step": 8}
  with pytest.raises(Killed):
    tj.store.save(newer, url, step=8)
  monkeypatch.setattr(objects, "filesystem", real)
  # The half-uploaded round's chunks are there, but no manifest.
  keys = snapshot_objects("s3", s3)
  partial = {p for k in keys for p in k.split("/")
             if p.startswith("snap-0000000008")}
  assert len(partial) == 1
  assert not any(k.endswith("manifest.json") and "snap-0000000008" in k
                 for k in keys)
  target = _target()
  out = tj.store.restore([url], target)
  _check(out, want, target)  # the previous round, bitwise
  assert gc_objects(url, min_age=3600)["removed"] == []  # maybe in flight
  rc, text = _cli("store", "gc", url, "--min-age", "0")
  got = json.loads(text)
  assert rc == 0
  assert [r.rsplit("/", 1)[1] for r in got["removed"]] == sorted(partial)
  assert got["bytes_reclaimed"] > 0
  assert not any("snap-0000000008" in k for k in snapshot_objects("s3", s3))
  _check(tj.store.restore([url], target), want, target)


def test_missing_bucket_is_one_clear_line(s3_server, monkeypatch):
  s3_env(monkeypatch, s3_server)
  url = "s3://no-such-bucket-here/run"
  for call in (lambda: ObjectStore(url), lambda: tjo.inspect(url),
               lambda: tj.store.save(_state()[0], url)):
    with pytest.raises(LocationError) as e:
      call()
    msg = str(e.value)
    assert "no-such-bucket-here" in msg and "bucket does not exist" in msg
    assert "\n" not in msg
  with pytest.raises(StoreError, match="no-such-bucket-here.*bucket does not"
                     " exist"):
    tj.store.restore([url], _target())


def test_wrong_credentials_are_one_clear_line(s3_server, monkeypatch):
  s3_env(monkeypatch, s3_server)
  bucket = new_bucket(s3_server)
  url = f"s3://{bucket}/run"
  tj.store.save(_state()[0], url)
  s3_require_auth(s3_server, True)
  try:
    s3_env(monkeypatch, s3_server, key="wrong")
    for call in (lambda: ObjectStore(url), lambda: tjo.inspect(url),
                 lambda: tj.store.save(_state()[0], url)):
      with pytest.raises(LocationError) as e:
        call()
      msg = str(e.value)
      assert url in msg and "credentials were refused" in msg, msg
      assert "\n" not in msg
  finally:
    s3_require_auth(s3_server, False)


def test_server_killed_mid_read(monkeypatch, tmp_path, gs):
  """A restore whose S3 server dies after the first chunk: a clear error
  naming the location; with a replica of the round on GCS, GCS serves."""
  state, want = _state()
  local = str(tmp_path / "local")
  snap = tj.store.save(state, local, step=7)
  gurl = f"gs://{gs}/replica"
  tj.store.replicate(snap, 0, gurl)
  prefetch = ObjectStore.prefetch
  for with_replica in (False, True):
    with moto_server() as srv:
      s3_env(monkeypatch, srv.endpoint)
      url = f"s3://{new_bucket(srv.endpoint)}/run"
      tj.store.replicate(snap, 0, url)
      calls = []

      def dying(self, *a, **kw):
        # The restore requests its chunks up front: the server dies once
        # the first piece's chunks arrived, before the others are asked.
        prefetch(self, *a, **kw)
        if self.scheme == "s3":
          calls.append(1)
          if len(calls) == 1:
            for f in list(self._fetches.values()):
              if f.done is not None:
                f.done.result()
            srv.stop()

      monkeypatch.setattr(ObjectStore, "prefetch", dying)
      target = _target()
      if not with_replica:
        with pytest.raises(StoreError) as e:
          tj.store.restore([url], target)
        assert url in str(e.value)
        assert "server does not answer" in str(e.value)
      else:
        out, rep = tj.store.restore_with_report([url, gurl], target)
        _check(out, want, target)
        assert rep.fallbacks
      monkeypatch.setattr(ObjectStore, "prefetch", prefetch)


# ---------------------------------------------------------- Orbax checkpoints


def _orbax_manager_dir(state):
  d = tempfile.mkdtemp(prefix="tenplex-test-orbax-")
  with ocp.CheckpointManager(d) as m:
    m.save(3, args=ocp.args.StandardSave({"w": state["w"],
                                          "b": state["b"]}))
    m.save(5, args=ocp.args.StandardSave({"w": state["w"] + 1,
                                          "b": state["b"]}))
  return d


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_orbax_checkpoint_on_object_storage(scheme, request):
  bucket = request.getfixturevalue("s3" if scheme == "s3" else "gs")
  state, want = _state()
  d = _orbax_manager_dir(state)
  try:
    upload_dir(d, scheme, bucket, "ckpts/orbax")
  finally:
    import shutil
    shutil.rmtree(d)
  url = f"{scheme}://{bucket}/ckpts/orbax"
  before = snapshot_objects(scheme, bucket)
  info = tjo.inspect(url)
  assert info["step"] == 5 and info["steps"] == [3, 5]
  assert info["format"]["ocdbt"] is True
  assert info["tensors"]["w"]["shape"] == [64, 48]
  assert info["item"] == url + "/5/default"
  target = {k: v for k, v in _target().items() if k != "step"}
  out = tjo.restore(url, target)
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"] + 1)
  np.testing.assert_array_equal(np.asarray(out["b"]), want["b"])
  assert out["w"].sharding == target["w"].sharding
  out = tjo.restore(url, target, step=3)
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"])
  rc, text = _cli("ckpt", "inspect", url)
  assert rc == 0 and "w" in text
  assert snapshot_objects(scheme, bucket) == before  # reading wrote nothing
  # convert writes a new checkpoint to the bucket, markers last.
  m = _mesh((8,), ("x",))
  rep = tjo.convert(url, f"{scheme}://{bucket}/ckpts/conv",
                    {"w": NamedSharding(m, P(None, "x")),
                     "b": NamedSharding(m, P())})
  assert rep["dst"].startswith(f"{scheme}://{bucket}/ckpts/conv")
  out = tjo.restore(f"{scheme}://{bucket}/ckpts/conv", target)
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"] + 1)
  with pytest.raises(UsageError, match="exists"):
    tjo.convert(url, f"{scheme}://{bucket}/ckpts/conv")


def test_unfinished_gcs_step_is_never_read(gs):
  """Orbax writes a step on GCS in place and ``commit_success.txt`` last, so
  a step without that file is a save still running or one that failed. As
  Orbax's ``CheckpointManager`` does, the newest step is the newest finished
  one, and naming the unfinished step is a clear error, not a read of half a
  checkpoint."""
  import shutil
  state, want = _state()
  d = _orbax_manager_dir(state)  # steps 3 and 5
  try:
    # step 7: step 5's files but its commit file (a save cut short)
    shutil.copytree(os.path.join(d, "5"), os.path.join(d, "7"))
    os.remove(os.path.join(d, "7", "commit_success.txt"))
    upload_dir(d, "gs", gs, "ckpts/orbax")
  finally:
    shutil.rmtree(d)
  url = f"gs://{gs}/ckpts/orbax"
  info = tjo.inspect(url)
  assert (info["step"], info["steps"], info["unfinished_steps"]) == \
      (5, [3, 5], [7]), info
  target = {k: v for k, v in _target().items() if k != "step"}
  out = tjo.restore(url, target)
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"] + 1)
  with pytest.raises(UsageError, match=r"step 7 of gs://\S+ is not finished:"
                     r" no commit_success.txt .* finished steps: \[3, 5\]"):
    tjo.restore(url, target, step=7)


def test_orbax_ocdbt_on_s3_is_staged_in_few_requests(s3, monkeypatch):
  """An OCDBT checkpoint on a bucket: a restore fetches the chunks it needs
  into a local copy with a few large requests (not one per chunk), reads
  them from there, fetches about the bytes it needs (<= 1.1x) when it needs
  only a part, and leaves neither the bucket nor the local copy behind."""
  from tenplex_jax.orbax import _read
  from tenplex_jax.orbax._read import OrbaxSource
  rng = np.random.default_rng(3)
  w = rng.standard_normal((256, 512)).astype(np.float32)  # 16 chunks, 32 KiB
  v = rng.standard_normal((256,)).astype(np.float32)
  m = _mesh((8,), ("x",))
  d = tempfile.mkdtemp(prefix="tenplex-test-orbax-")
  try:
    with ocp.CheckpointManager(d) as mgr:
      mgr.save(1, args=ocp.args.StandardSave({
          "w": jax.device_put(w, NamedSharding(m, P("x"))),
          "v": jax.device_put(v, NamedSharding(m, P("x")))}))
    upload_dir(d, "s3", s3, "ck")
  finally:
    import shutil
    shutil.rmtree(d)
  url = f"s3://{s3}/ck"
  before = snapshot_objects("s3", s3)
  t = NamedSharding(_mesh((2, 2)), P(None, ("a", "b")))  # columns
  target = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=t),
            "v": jax.ShapeDtypeStruct(v.shape, jnp.float32,
                                      sharding=NamedSharding(t.mesh, P()))}
  reads = []
  real = _read.OrbaxSource.stage

  def spy(self, needs):
    n = real(self, needs)
    reads.append((n, self._stage_dir, {k: len(i) for k, (_, i) in
                                       self._staged.items()}))
    return n

  monkeypatch.setattr(_read.OrbaxSource, "stage", spy)
  got_whole = []
  whole = _read.download
  monkeypatch.setattr(_read, "download",
                      lambda u, p, *a: got_whole.append(u) or whole(u, p, *a))
  out = tjo.restore(url, target)
  np.testing.assert_array_equal(np.asarray(out["w"]), w)
  np.testing.assert_array_equal(np.asarray(out["v"]), v)
  assert out["w"].sharding == target["w"].sharding
  [(fetched, stage_dir, staged)] = reads
  assert staged == {"w": 8, "v": 8}  # every chunk staged
  # One request per object: the manifests, and the data files whole (all
  # of their chunks are needed), not one per chunk (16). How many data
  # files Orbax writes depends on its writes' timing (2, and 3 on a loaded
  # host), so the bound is this checkpoint's own objects.
  files = {f"s3://{k}" for k in before
           if k.endswith("/manifest.ocdbt") or "/d/" in k}
  assert len(got_whole) == len(set(got_whole)) < 16, got_whole
  assert set(got_whole) <= files, (got_whole, sorted(files))
  assert not os.path.exists(stage_dir)  # the local copy is gone
  # zstd shrinks float noise a little; the manifests and b-tree come too.
  assert 0.8 * w.nbytes <= fetched <= 1.1 * (w.nbytes + v.nbytes) \
      + (64 << 10)
  # A process holding rows [0, 64) needs 2 of w's 8 chunks: with no merging
  # of neighbouring ranges, it fetches about those (one ranged request
  # each, cut into 8 KiB parts), not the data file.
  monkeypatch.setattr(_read, "_MERGE_GAP", 0)
  monkeypatch.setattr(_read, "_PART", 8 << 10)
  with OrbaxSource(url) as src:
    n = real(src, {"w": [((0, 64), (0, 512))]})
    assert 0.8 * w.nbytes / 4 <= n <= 1.1 * w.nbytes / 4 + (64 << 10)
    staged_dir = src._stage_dir
    assert {k: len(i) for k, (_, i) in src._staged.items()} == {"w": 2}
    got = np.empty((64, 512), np.float32)
    src.read_into("w", ((0, 64), (0, 512)), got)  # from the local copy
    np.testing.assert_array_equal(got, w[:64])
    got = np.empty((64, 512), np.float32)
    src.read_into("w", ((64, 128), (0, 512)), got)  # not staged: the bucket
    np.testing.assert_array_equal(got, w[64:128])
  assert not os.path.exists(staged_dir)
  assert snapshot_objects("s3", s3) == before  # reading wrote nothing


def _slow_download(real, events, block=4 << 10, pause=0.002):
  """``download`` that streams the object into place slowly, ``block`` bytes
  at a time (as a slow link would), calling ``progress`` after each."""

  def slow(url, local, progress=None):
    tmp = local + ".whole"
    n = real(url, tmp)
    with open(tmp, "rb") as f, open(local, "wb") as out:
      while True:
        data = f.read(block)
        if not data:
          break
        out.write(data)
        out.flush()
        if progress is not None:
          progress()
          time.sleep(pause)
    os.remove(tmp)
    events.append(("end", url, time.monotonic()))
    return n

  return slow


def test_orbax_staging_overlaps_the_reads(s3, monkeypatch):
  """The data files of an OCDBT checkpoint on a bucket stream into the
  local copy in the background while the restore reads: stage() returns
  before they are there, reads of a chunk wait for its bytes (the values
  come out bitwise, never zeros of a sparse file), chunks are read in the
  order they arrive, some before the last file is complete, and closing a
  source mid-stream stops the streams and removes the copy."""
  from tenplex_jax.orbax import _read
  from tenplex_jax.orbax._read import OrbaxSource
  rng = np.random.default_rng(5)
  state = {f"t{i}": rng.standard_normal((64, 256)).astype(np.float32)
           for i in range(3)}
  m = _mesh((8,), ("x",))
  d = tempfile.mkdtemp(prefix="tenplex-test-orbax-")
  try:
    with ocp.CheckpointManager(d) as mgr:
      mgr.save(1, args=ocp.args.StandardSave(
          {k: jax.device_put(v, NamedSharding(m, P("x")))
           for k, v in state.items()}))
    upload_dir(d, "s3", s3, "ck")
  finally:
    import shutil
    shutil.rmtree(d)
  url = f"s3://{s3}/ck"
  events = []
  monkeypatch.setattr(_read, "download",
                      _slow_download(_read.download, events))
  reads = []
  real_view = OrbaxSource._view

  def view(self, path, box, dtype):
    v = real_view(self, path, box, dtype)  # after the wait for its bytes
    held = self.tensors()[path].boxes  # the chunk this box (or part) is of
    index = next(i for i, h in enumerate(held)
                 if all(a0 <= a and b <= b0
                        for (a, b), (a0, b0) in zip(box, h)))
    reads.append((path, box, time.monotonic(), self.read_order(path, index)))
    return v

  monkeypatch.setattr(OrbaxSource, "_view", view)
  stage = OrbaxSource.stage
  staged_at = []
  monkeypatch.setattr(OrbaxSource, "stage", lambda self, needs: (
      stage(self, needs), staged_at.append(time.monotonic()))[0])
  t = NamedSharding(_mesh((2, 4)), P(None, ("a", "b")))  # columns
  target = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32, sharding=t)
            for k, v in state.items()}
  out = tjo.restore(url, target)
  for k, v in state.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v)
  data_ends = [e[2] for e in events if "ocdbt.process_0/d/" in e[1]]
  assert data_ends and staged_at[0] < max(data_ends)  # streamed after
  assert min(r[2] for r in reads) < max(data_ends)  # read while streaming
  # Tensor by tensor, by when the last chunk is expected; within one, the
  # chunks by when each is.
  by_tensor = [[r[3] for r in g] for _, g in itertools.groupby(
      reads, key=lambda r: r[0])]
  assert len(by_tensor) == len(state), [r[0] for r in reads]
  assert all(g == sorted(g) for g in by_tensor), by_tensor
  last = [g[-1] for g in by_tensor]
  assert last == sorted(last) and last[0] > 0, by_tensor
  # Closed mid-stream: the streams stop, the local copy goes.
  events.clear()
  with OrbaxSource(url) as src:
    src.stage({k: [((0, 64), (0, 256))] for k in state})
    stage_dir = src._stage_dir
    run = src._run
  assert run.pool is None and not os.path.exists(stage_dir)
  assert not [e for e in events if "ocdbt.process_0/d/" in e[1]]  # stopped


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_orbax_restore_of_converted_ocdbt_on_a_bucket(scheme, request,
                                                      tmp_path):
  """A checkpoint written by ``convert(..., ocdbt=True)`` keeps its
  zarr.json in a data file (tensorstore inlines only values up to 100
  bytes; Orbax's own writes inline it): staged from a bucket, that file is
  fetched before the local copy is opened (it was streamed in the
  background, and the open read zeros: tensorstore's raw "DATA_LOSS ...
  zarr.json ... Invalid JSON")."""
  bucket = request.getfixturevalue("s3" if scheme == "s3" else "gs")
  m = _mesh((2,), ("x",))
  w = np.arange(24, dtype=np.float32).reshape(8, 3)
  ocp.PyTreeCheckpointer().save(
      str(tmp_path / "src"),
      {"w": jax.device_put(w, NamedSharding(m, P("x")))})
  target = {"w": jax.ShapeDtypeStruct((8, 3), jnp.float32,
                                      sharding=NamedSharding(m, P(None)))}
  tjo.convert(str(tmp_path / "src"), str(tmp_path / "conv" / "ck"), target,
              ocdbt=True)
  upload_dir(str(tmp_path / "conv"), scheme, bucket, "c")
  before = snapshot_objects(scheme, bucket)
  out = tjo.restore(f"{scheme}://{bucket}/c/ck", target)
  np.testing.assert_array_equal(np.asarray(out["w"]), w)
  assert out["w"].sharding == target["w"].sharding
  assert snapshot_objects(scheme, bucket) == before


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_keys_restored_from_a_bucket_on_the_target_sharding(scheme, request,
                                                            tmp_path):
  """PRNG keys restored from a store and from an Orbax checkpoint on a
  bucket onto a one-device mesh come back on the target sharding itself
  (they came on ``P('a', None)`` for a target ``P('a')``: the key data's
  spec); keys of rank 2 on a shorter spec where ``jax.device_put`` puts
  them (the spec padded to their rank)."""
  bucket = request.getfixturevalue("s3" if scheme == "s3" else "gs")
  state = {"k": jax.device_put(jax.random.split(jax.random.key(4), 8),
                               NamedSharding(_mesh((4,), ("x",)), P("x"))),
           "g": jax.device_put(jax.random.split(jax.random.key(5), (4, 2)),
                               NamedSharding(_mesh((2,), ("x",)), P("x")))}
  url = f"{scheme}://{bucket}/keys"
  tj.store.save(state, url, step=3)
  ocp.PyTreeCheckpointer().save(str(tmp_path / "ck"), state)
  upload_dir(str(tmp_path / "ck"), scheme, bucket, "ck")
  one = jax.make_mesh((1,), ("a",), devices=jax.devices()[6:7])
  two = jax.make_mesh((2,), ("a",), devices=jax.devices()[2:4])
  target = {"k": jax.ShapeDtypeStruct((8,), state["k"].dtype,
                                      sharding=NamedSharding(one, P("a"))),
            "g": jax.ShapeDtypeStruct((4, 2), state["g"].dtype,
                                      sharding=NamedSharding(two, P("a")))}
  for out in (tj.store.restore(url, target),
              tjo.restore(f"{scheme}://{bucket}/ck", target)):
    assert out["k"].sharding == target["k"].sharding, out["k"].sharding
    for k, v in state.items():
      assert out[k].sharding == jax.device_put(
          v, target[k].sharding).sharding, (k, out[k].sharding)
      np.testing.assert_array_equal(jax.random.key_data(out[k]),
                                    jax.random.key_data(v))


def test_convert_of_a_store_on_a_bucket_says_what_it_is(s3):
  """``convert`` reads stores from local directories only: a tenplex store
  on a bucket is refused naming it as one (it was called "not an Orbax
  checkpoint: no _METADATA ..."), and nothing is written."""
  url = f"s3://{s3}/st"
  tj.store.save(_state()[0], url, step=7)
  before = snapshot_objects("s3", s3)
  with pytest.raises(UsageError) as e:
    tjo.convert(url, f"s3://{s3}/conv")
  assert str(e.value).startswith(f"{url} is a tenplex_jax store on object"
                                 " storage: convert reads a store from a"
                                 " local directory only"), str(e.value)
  with pytest.raises(UsageError, match=f"s3://{s3}/nothing: no such"):
    tjo.convert(f"s3://{s3}/nothing", f"s3://{s3}/conv")
  assert snapshot_objects("s3", s3) == before


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_persistent_checkpoint_on_object_storage(scheme, request):
  """save_checkpoint to s3:// or gs://, and a restore whose stores hold
  nothing falls back to it (the launcher's --checkpoint s3://...). On GCS
  each step is an item whose commit file came with it (uploaded last), so
  it counts as finished."""
  from tenplex_jax.store import (latest_step, restore_checkpoint,
                                 save_checkpoint)
  from tenplex_jax.runtime.launch import _checkpoint_location
  bucket = request.getfixturevalue("s3" if scheme == "s3" else "gs")
  url = f"{scheme}://{bucket}/persistent"
  assert _checkpoint_location(url + "/") == url
  with pytest.raises(UsageError, match="not a store server"):
    _checkpoint_location("http://127.0.0.1:1")
  state, want = _state()
  arrays = {"w": state["w"], "b": state["b"]}
  assert latest_step(url) is None
  path = save_checkpoint(url, arrays, 40)
  assert path == url + "/step_0000000040"
  save_checkpoint(url, {"w": state["w"] + 1, "b": state["b"]}, 50)
  assert latest_step(url) == 50
  target = {k: v for k, v in _target().items() if k != "step"}
  out, step = restore_checkpoint(url, target)
  assert step == 50
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"] + 1)
  assert out["w"].sharding == target["w"].sharding
  out, rep = tj.store.restore_with_report([f"{scheme}://{bucket}/none"],
                                          target, checkpoint=url)
  assert rep.from_checkpoint and rep.step == 50
  np.testing.assert_array_equal(np.asarray(out["b"]), want["b"])


@pytest.mark.slow
def test_multiprocess_jobs_save_to_and_restore_from_s3(s3, tmp_path):
  """Two jax.distributed processes save to one s3:// store (each its own
  shards) and their persistent checkpoint to S3 (save_checkpoint: a
  tenplex store inside it); three restore the store onto another mesh, each
  reading only from S3, and then, with no store holding a snapshot, the
  checkpoint."""
  import sys

  from procs import run_all
  from store_state import expected_state, storage_view
  here = os.path.dirname(os.path.abspath(__file__))
  env = {**os.environ, "PYTHONPATH": os.path.dirname(here), "XLA_FLAGS": "",
         "JAX_PLATFORMS": "cpu"}
  url = f"s3://{s3}/job"

  def job(name, procs, mesh, action, **kw):
    out = tmp_path / name
    out.mkdir()
    with socket_port() as port:
      cfg = {"procs": procs, "devices": 4, "mesh": mesh, "action": action,
             "port": port, "out": str(out), **kw}
    (out / "config.json").write_text(json.dumps(cfg))
    kids = run_all([[sys.executable, os.path.join(here, "store_worker.py"),
                     str(out / "config.json"), str(i)]
                    for i in range(procs)], env=env, timeout=180)
    res = []
    for i, c in enumerate(kids):
      assert c.returncode == 0, c.stdout[-3000:]
      res.append(json.loads((out / f"result_{i}.json").read_text()))
    return res, out

  # The job also saves its persistent checkpoint to S3 (save_checkpoint:
  # each process uploads its own shards to the tenplex store inside).
  ckpt = f"s3://{s3}/persistent"
  res, _ = job("save", 2, [4, 2], "save", stores=[url, url],
               checkpoint=ckpt, checkpoint_step=9)
  assert all(r["ok"] for r in res)
  st = ObjectStore(url)
  assert st.procs() == [0, 1]
  assert ObjectStore(ckpt + "/tenplex-store").procs() == [0, 1]
  from tenplex_jax.store import latest_step
  assert latest_step(ckpt) == 9
  exp = expected_state()

  def same_as_saved(out):
    n = 0
    for i in range(3):
      with np.load(out / f"shards_{i}.npz") as z:
        for key in z.files:
          path, _, box = key.split("|")
          idx = tuple(slice(int(a), int(b)) for a, b in
                      (r.split(":") for r in box.split(",") if r))
          np.testing.assert_array_equal(z[key],
                                        storage_view(exp[path][idx]))
          n += 1
    assert n > 0

  res, out = job("restore", 3, [2, 6], "restore",
                 locations=[[url]] * 3)
  assert all(r["ok"] and all(r["shardings_ok"].values()) for r in res), res
  same_as_saved(out)
  # No store holds a snapshot: every process falls back to the checkpoint.
  res, out = job("fallback", 3, [2, 6], "restore",
                 locations=[[f"s3://{s3}/none"]] * 3, checkpoint=ckpt)
  assert all(r["ok"] and all(r["shardings_ok"].values())
             and r["report"]["from_checkpoint"]
             and r["report"]["step"] == 9 for r in res), res
  same_as_saved(out)


@contextlib.contextmanager
def socket_port():
  from objservers import free_port
  yield free_port()
