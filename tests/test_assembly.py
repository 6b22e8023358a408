"""The restore core (tenplex_jax.assembly): one assembly path that
``assemble``, the store restore and ``orbax.convert`` share."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import assembly, store
from tenplex_jax import orbax as tor
from tenplex_jax.layout import PTC, box_volume
from tenplex_jax.planner import plan
from tenplex_jax.sources import Source, SourceTensor
from tenplex_jax.store.source import StoreSource


def _mesh(shape, names, start=0):
  n = int(np.prod(shape))
  devs = jax.devices()[start:start + n]
  return Mesh(np.array(devs).reshape(shape), names)


def _tree(mesh):
  rng = np.random.default_rng(0)
  return {
      "w": jax.device_put(rng.standard_normal((12, 16), np.float32),
                          NamedSharding(mesh, P("d", "t"))),
      "b": jax.device_put(rng.standard_normal(12).astype(jnp.bfloat16),
                          NamedSharding(mesh, P("t"))),
      "r": jax.device_put(rng.integers(0, 9, (8, 6), np.int32),
                          NamedSharding(mesh, P())),
      "key": jax.device_put(jax.random.key(3), NamedSharding(mesh, P())),
  }


def _target(tree, mesh, specs):
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                  sharding=NamedSharding(mesh, specs[k]))
          for k, v in tree.items()}


def _bits(a):
  if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
    a = jax.random.key_data(a)
  return np.asarray(a).tobytes()


# A target where several devices hold each box (replicas along "r"), some
# leaves cut across the saved boxes, one replicated everywhere.
NEW = {"w": P("t", None), "b": P(), "r": P(None, "t"), "key": P()}


def test_new_boxes_are_distinct_and_tiled_by_their_pieces():
  mesh = _mesh((2, 4), ("d", "t"))
  tree = _tree(mesh)
  tmesh = _mesh((2, 3), ("r", "t"))
  target = _target(tree, tmesh, NEW)
  src = PTC.from_tree({k: v for k, v in tree.items() if k != "key"})
  dst = PTC.from_tree({k: v for k, v in target.items() if k != "key"})
  the_plan = plan(src, dst)
  mine = {0, 1, 2, 3}  # devices of the first "r" row and one of the second
  got = list(assembly.new_boxes(the_plan, dst, mine))
  for t in dst:
    boxes = [nb for nb in got if nb.path == t.path]
    want = {b for b, hs in zip(t.placement.boxes, t.placement.holders)
            if set(hs) & mine}
    assert [nb.box for nb in boxes] == list(dict.fromkeys(
        b for b in t.placement.boxes if b in want))  # each box once
    for nb in boxes:
      assert nb.holders == tuple(sorted(set(
          t.placement.holders[nb.index]) & mine))
      assert sum(box_volume(p) for p, _ in nb.pieces) == box_volume(nb.box)
  every = list(assembly.new_boxes(the_plan, dst))
  assert len(every) == sum(len(t.placement.boxes) for t in dst)


def test_fill_gives_each_piece_a_view_of_its_box_buffer():
  mesh = _mesh((2, 4), ("d", "t"))
  tree = _tree(mesh)
  tmesh = _mesh((3,), ("t",))
  w = {"w": jax.ShapeDtypeStruct((12, 16), jnp.float32,
                                 sharding=NamedSharding(tmesh, P("t", None)))}
  the_plan = plan(PTC.from_tree({"w": tree["w"]}), PTC.from_tree(w))
  dst = PTC.from_tree(w)
  bufs = {}
  for nb, buf, views in assembly.fill(
      assembly.new_boxes(the_plan, dst),
      lambda nb: bufs.setdefault(nb.box, np.zeros(nb.shape, np.float32))):
    assert buf is bufs[nb.box]
    for piece, _, view in views:
      view[...] = 1  # a view, not a copy: writes land in the buffer
      assert view.shape == tuple(b - a for a, b in piece)
    assert buf.all()  # the pieces tile the box


def test_store_assemble_and_convert_agree_bitwise(tmp_path):
  """The three users of the core give the same bytes on the same layout,
  also when several local devices hold one new box (read once)."""
  mesh = _mesh((2, 4), ("d", "t"))
  tree = _tree(mesh)
  d = str(tmp_path / "store")
  store.save(tree, d, step=5)
  tmesh = _mesh((2, 3), ("r", "t"))
  target = _target(tree, tmesh, NEW)
  via_store, rep = store.restore_with_report([d], target)
  # Each distinct new box is read once: the bytes read are the distinct
  # boxes' bytes, the device pieces count every replica.
  distinct = sum(box_volume(b) * t.itemsize
                 for t in PTC.from_tree(target)
                 for b in dict.fromkeys(t.placement.boxes))
  assert rep.local_bytes == distinct < rep.device_piece_bytes
  with StoreSource(d) as src:
    via_source, arep = assembly.assemble(src, target)
  assert arep.read_bytes == arep.new_shard_bytes == distinct
  tor.convert(d, str(tmp_path / "ck"), target, progress=False)
  via_convert = tor.restore(str(tmp_path / "ck"), target)
  for k in tree:
    for got in (via_store, via_source, via_convert):
      assert got[k].sharding == target[k].sharding, k
      assert _bits(got[k]) == _bits(tree[k]), k


def test_read_source_groups_pieces_of_one_whole_box():
  """From a source that reads boxes whole, the pieces one source box gives
  are read with one read; otherwise one read per piece."""
  full = np.arange(64, dtype=np.float32).reshape(8, 8)
  reads = []

  class Whole(Source):
    whole_boxes = True

    def tensors(self):
      return {"w": SourceTensor("w", (8, 8), "float32",
                                np.dtype(np.float32),
                                boxes=(((0, 8), (0, 4)), ((0, 8), (4, 8))))}

    def read_into(self, path, box, out):
      reads.append(box)
      out[...] = full[tuple(slice(a, b) for a, b in box)]

  src = Whole()
  tgt = PTC.from_tree({"w": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(_mesh((4,), ("t",)),
                                                  P("t")))})
  the_plan = plan(assembly.source_layout(src.tensors()), tgt)
  bufs = {}

  def alloc(nb):
    return bufs.setdefault(nb.box, np.empty(nb.shape, np.float32))

  st = assembly.read_source(src, assembly.fill(
      assembly.new_boxes(the_plan, tgt), alloc))
  assert st.pieces == 8 and st.reads == 2 and len(reads) == 2
  for box, buf in bufs.items():
    assert buf.tobytes() == full[tuple(slice(a, b) for a, b in box)].tobytes()
  reads.clear()
  Whole.whole_boxes = False
  st = assembly.read_source(src, assembly.fill(
      assembly.new_boxes(the_plan, tgt), alloc))
  assert st.reads == st.pieces == 8 == len(reads)


def test_read_source_bounds_the_reads_in_flight():
  """At most ``inflight_bytes`` of source boxes are read at once, but
  always ``min_reads``: two by default, one when the bound is strict."""
  import concurrent.futures
  full = np.arange(64, dtype=np.float32).reshape(8, 8)
  state = {"open": 0, "most": 0}

  class Done(concurrent.futures.Future):
    def result(self, timeout=None):
      state["open"] -= 1
      return super().result(timeout)

  class Rows(Source):
    def tensors(self):
      return {"w": SourceTensor("w", (8, 8), "float32",
                                np.dtype(np.float32),
                                boxes=tuple(((i, i + 1), (0, 8))
                                            for i in range(8)))}

    def read_into(self, path, box, out):
      out[...] = full[tuple(slice(a, b) for a, b in box)]

    def read_async(self, path, box, out):
      self.read_into(path, box, out)
      state["open"] += 1
      state["most"] = max(state["most"], state["open"])
      f = Done()
      f.set_result(None)
      return f

  src = Rows()
  tgt = PTC.from_tree({"w": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(_mesh((1,), ("t",)),
                                                  P()))})
  the_plan = plan(assembly.source_layout(src.tensors()), tgt)
  for kw, most in (({"inflight_bytes": 16}, 2),
                   ({"inflight_bytes": 16, "min_reads": 1}, 1),
                   ({"inflight_bytes": 64, "min_reads": 1}, 2),
                   ({"inflight_bytes": 96}, 3)):
    bufs = {}
    state.update(open=0, most=0)
    st = assembly.read_source(src, assembly.fill(
        assembly.new_boxes(the_plan, tgt),
        lambda nb: bufs.setdefault(nb.box, np.empty(nb.shape, np.float32))),
        **kw)
    assert st.reads == 8 and state["open"] == 0
    assert state["most"] == most, (kw, state["most"])  # each box 32 bytes
    (box, buf), = bufs.items()
    assert buf.tobytes() == full.tobytes()


def test_sources_module_is_the_interface_only():
  from tenplex_jax import sources
  assert set(sources.__all__) == {"DEVICE", "HOST", "PEER", "PERSISTENT",
                                  "REPLICA", "Source", "SourceTensor"}
  with pytest.raises(TypeError):
    sources.Source()  # abstract: tensors() and read_into() are required


def _assemble_store(d, target):
  with StoreSource(d) as src:
    return assembly.assemble(src, target)[0]


def test_every_restore_takes_its_buffers_from_the_one_allocator(tmp_path):
  """assemble (Orbax and store sources) and the store restore allocate their
  new shards through tenplex_jax._hostmem.host_empty, asking for populated
  pages: its counters move by one take per distinct new box of 16 KiB or
  more."""
  from tenplex_jax._hostmem import host_pool_stats
  mesh = _mesh((8,), ("d",))
  x = jax.device_put(np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024),
                     NamedSharding(mesh, P("d")))  # 32 KiB per saved shard
  d = str(tmp_path / "store")
  store.save({"x": x}, d, step=1)
  tor.save({"x": x}, str(tmp_path / "ck"), step=1)
  tmesh = _mesh((2, 2), ("r", "t"))
  target = {"x": jax.ShapeDtypeStruct(
      (64, 1024), jnp.float32, sharding=NamedSharding(tmesh, P("t")))}
  # 2 distinct new boxes of 128 KiB, each held by 2 devices.
  from tenplex_jax import _hostmem
  from tenplex_jax.store import api
  asked, populated = [], []

  def spy(shape, dtype, **kw):
    asked.append(kw.get("populate"))
    return _hostmem.host_empty(shape, dtype, **kw)

  def populating(buf):  # the store restore populates after its requests
    populated.append(buf.nbytes)
    return _hostmem.populate(buf)

  for restore in (lambda: store.restore([d], target),
                  lambda: tor.restore(str(tmp_path / "ck"), target),
                  lambda: _assemble_store(d, target)):
    before = host_pool_stats()
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(assembly, "host_empty", spy)
      mp.setattr(api, "host_empty", spy)
      mp.setattr(api, "populate", populating)
      asked.clear()
      populated.clear()
      out = restore()
    after = host_pool_stats()
    takes = (after["mapped"] + after["reused"]) - (before["mapped"]
                                                    + before["reused"])
    assert takes == 2
    # Every byte of a new shard is written next: fresh pages populated,
    # when allocated or before the reads start.
    assert len(asked) == 2 and asked.count(True) + len(populated) == 2, \
        (asked, populated)
    assert np.asarray(out["x"]).tobytes() == np.asarray(x).tobytes()


@pytest.mark.parametrize("name,home", [
    ("assemble", "tenplex_jax.assembly"), ("StoreSource", "tenplex_jax.store.source")])
def test_moved_names_still_resolve_from_sources_with_a_warning(name, home):
  import importlib
  import tenplex_jax.sources as sources
  with pytest.warns(DeprecationWarning, match=f"moved to {home}.{name}"):
    got = getattr(sources, name)
  assert got is getattr(importlib.import_module(home), name)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    sources.nope  # noqa: B018


class _Pieces(Source):
  """A direct source whose reads fill ``out`` with the box's first index and
  note the thread that read it."""
  local = True

  def __init__(self, name="pieces"):
    self.name = name
    self.threads = []

  def tensors(self):
    return {}

  def read_into(self, path, box, out):
    self.threads.append(threading.get_ident())
    out[...] = box[0][0]


def _piece_jobs(src, n, size):
  outs = [np.zeros(size, np.float32) for _ in range(n)]
  return [("w", ((i, i + 1),), outs[i], [src], None) for i in range(n)], outs


def test_fetch_pieces_groups_small_direct_pieces_and_runs_one_task_inline():
  src = _Pieces()
  jobs, outs = _piece_jobs(src, 40, 16)  # 40 pieces of 64 bytes
  # the tasks: direct pieces together up to direct_bytes, a larger piece alone
  tasks = assembly._batches(jobs, 1 << 20, 256, 256)
  assert [len(t) for t in tasks] == [4] * 10
  big = [("w", ((0, 1),), np.zeros(1000, np.float32), [src], None)]
  assert [len(t) for t in assembly._batches(jobs[:2] + big + jobs[2:4], 1 << 20,
                                            256, 256)] == [2, 1, 2]
  # a small state's pieces: one task, read in the calling thread
  served, errs = assembly.fetch_pieces(jobs, workers=8)
  assert not errs and len(served) == 40
  assert set(src.threads) == {threading.get_ident()}
  assert all((o == i).all() for i, o in enumerate(outs))
  # more bytes than one task: read by the pool's threads, every piece once
  src2 = _Pieces()
  jobs2, outs2 = _piece_jobs(src2, 40, 16)
  served, errs = assembly.fetch_pieces(jobs2, workers=8, direct_bytes=256)
  assert not errs and sorted(j[1] for _, j in served) == sorted(j[1] for j in jobs2)
  assert threading.get_ident() not in src2.threads
  assert all((o == i).all() for i, o in enumerate(outs2))
