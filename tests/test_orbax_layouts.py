"""tenplex_jax.orbax.restore of a row-sharded stock Orbax checkpoint into
layouts that cut its chunks (columns, 2-D blocks, replicated, fewer and more
devices): values bitwise equal to Orbax's own restore, shardings equal to
the target, and each saved chunk read once per process however many new
boxes take a part of it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax import orbax as tor
from tenplex_jax import assembly, sources
from tenplex_jax.errors import StoreError


def _mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _tree():
  k = jax.random.split(jax.random.key(7), 4)
  return {
      "kernel": jax.random.normal(k[0], (64, 96), jnp.float32),
      "bias": jax.random.normal(k[1], (96,), jnp.float32),
      "out": jax.random.normal(k[2], (96, 64), jnp.bfloat16),
      "table": jax.random.randint(k[3], (32, 64), -128, 127, jnp.int8),
      "rng": jax.random.split(jax.random.key(5), 16),
  }


@pytest.fixture(scope="module", params=[True, False], ids=["ocdbt", "zarr"])
def rows_ckpt(request, tmp_path_factory):
  """Every leaf row-sharded over 8 ``fsdp`` devices, saved by stock Orbax
  (CheckpointManager + StandardSave), OCDBT on or off."""
  d = str(tmp_path_factory.mktemp("rows") / "ck")
  mesh = _mesh((8,), ("fsdp",))
  tree = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh,
                                                                P("fsdp"))),
                      _tree())
  opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  handler = ocp.StandardCheckpointHandler(use_ocdbt=request.param)
  with ocp.CheckpointManager(d, options=opts,
                             item_handlers=handler) as m:
    m.save(1, args=ocp.args.StandardSave(tree))
    m.wait_until_finished()
  return d, jax.tree.map(np.asarray, jax.tree.map(
      lambda x: jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree))


def _spec(kind, ndim):
  if kind == "cols":
    return P(*([None] * (ndim - 1)), "tensor")
  if kind == "blocks":
    return P("a", "b") if ndim >= 2 else P(("a", "b"))
  if kind == "replicated":
    return P()
  return P("fsdp")


LAYOUTS = {  # name: (mesh shape, axis names, spec kind)
    "cols4": ((4,), ("tensor",), "cols"),
    "cols8": ((8,), ("tensor",), "cols"),
    "blocks2x2": ((2, 2), ("a", "b"), "blocks"),
    "blocks2x4": ((2, 4), ("a", "b"), "blocks"),
    "blocks4x2": ((4, 2), ("a", "b"), "blocks"),
    "rows2": ((2,), ("fsdp",), "rows"),
    "rows8": ((8,), ("fsdp",), "rows"),
    "replicated3": ((3,), ("x",), "replicated"),
}


def _target(layout):
  shape, names, kind = LAYOUTS[layout]
  mesh = _mesh(shape, names)
  out = {}
  for k, v in _tree().items():
    out[k] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, _spec(kind, len(v.shape))))
  return out


def _data(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_restore_cuts_chunks_bitwise(rows_ckpt, layout):
  d, saved = rows_ckpt
  target = _target(layout)
  out, rep = tor.restore_with_report(d, target)
  with ocp.CheckpointManager(d) as m:
    ref = m.restore(1, args=ocp.args.StandardRestore(target))
  for k, t in target.items():
    if k == "rng":  # a replicated key array comes back as P(None,), not P()
      assert out[k].sharding.is_equivalent_to(t.sharding, 1), k
    else:
      assert out[k].sharding == t.sharding, k
    assert out[k].dtype == t.dtype, k
    got = _data(out[k])
    assert got.dtype == saved[k].dtype and got.tobytes() == \
        saved[k].tobytes(), k
    assert got.tobytes() == _data(ref[k]).tobytes(), k
    for s in out[k].addressable_shards:  # every shard holds its own box
      assert _data(s.data).tobytes() == got[s.index].tobytes(), (k, s.index)
  # Each saved chunk is read once: 8 row chunks per leaf, whatever cuts them.
  assert rep.reads == 8 * len(target)
  assert rep.read_bytes == rep.new_shard_bytes


def test_per_piece_path_reads_each_piece(rows_ckpt, monkeypatch):
  """The old path (a read per piece) gives the same values with more reads:
  the grouping is what cuts the reads."""
  d, saved = rows_ckpt
  target = _target("cols4")
  monkeypatch.setattr(assembly, "_GROUP_READS", False)
  out, rep = tor.restore_with_report(d, target)
  # 2-D leaves: 8 row chunks x 4 columns; 1-D leaves (bias, rng): 8 chunks.
  assert rep.reads == rep.pieces == 3 * 8 * 4 + 2 * 8
  for k in target:
    assert _data(out[k]).tobytes() == saved[k].tobytes(), k


def _file_reads() -> int:
  import tensorstore as ts
  metrics = ts.experimental_collect_matching_metrics(
      "/tensorstore/kvstore/file/read")
  return sum(v.get("value", 0) for m in metrics
             if m["name"].endswith("/read") for v in m["values"])


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "scratch"])
@pytest.mark.parametrize("layout", ["cols8", "blocks2x4"])
def test_each_chunk_file_read_once(rows_ckpt, layout, direct, monkeypatch):
  """Counted at the file system (tensorstore's file reads; without OCDBT a
  chunk is a file): a layout whose new boxes each take a part of several
  chunks makes exactly the reads of the saved layout, whose new boxes are
  the chunks. ``direct``: the pieces of a chunk go straight into place (one
  tensorstore batch; forced here, these pieces being under
  ``_DIRECT_PIECE``), so this is what says the chunk is read and decoded
  once for all of them (reads started one by one read a chunk again when
  one ended before the next started: 49-74 reads instead of 45); else
  through a scratch buffer."""
  d, saved = rows_ckpt
  if tor.inspect(d)["format"]["ocdbt"]:
    pytest.skip("OCDBT packs the chunks into shared data files")
  monkeypatch.setattr(assembly, "_DIRECT_PIECE", 0 if direct else 1 << 40)
  n0 = _file_reads()
  tor.restore(d, _target("rows8"))
  own = _file_reads() - n0
  n0 = _file_reads()
  out = tor.restore(d, _target(layout))
  cut = _file_reads() - n0
  assert cut == own > 8 * len(saved), (cut, own)
  for k in saved:
    assert _data(out[k]).tobytes() == saved[k].tobytes(), k


def _mapped_files() -> int:
  import tensorstore as ts
  metrics = ts.experimental_collect_matching_metrics(
      "/tensorstore/file/mmap_count")
  return sum(v.get("value", 0) for m in metrics for v in m["values"])


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "zarr"])
def test_local_checkpoint_files_mapped(tmp_path, ocdbt):
  """A local checkpoint's chunk files (or OCDBT data files) are mapped for
  zstd to decode from the page cache, not copied out with read(2) first
  (tensorstore maps only files of about 1 MiB and more: 2 MiB chunks
  here); the values stay bitwise Orbax's."""
  d = str(tmp_path / "ck")
  w = jax.device_put(
      jax.random.normal(jax.random.key(3), (2048, 512), jnp.float32),
      NamedSharding(_mesh((2,), ("fsdp",)), P("fsdp")))
  with ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False), item_handlers=
                             ocp.StandardCheckpointHandler(use_ocdbt=ocdbt)
                             ) as m:
    m.save(1, args=ocp.args.StandardSave({"w": w}))
    m.wait_until_finished()
  n0 = _mapped_files()
  out = tor.restore(d, {"w": jax.ShapeDtypeStruct(
      w.shape, w.dtype, sharding=NamedSharding(_mesh((2,), ("tensor",)),
                                               P(None, "tensor")))})
  assert _mapped_files() - n0 >= (1 if ocdbt else 2)
  assert np.asarray(out["w"]).tobytes() == np.asarray(w).tobytes()


def test_grouped_read_error_names_leaf(tmp_path):
  """A source box read that fails surfaces (not a silently partial array)."""
  class Broken(sources.Source):
    whole_boxes = True

    def tensors(self):
      return {"w": sources.SourceTensor(
          "w", (4, 4), "float32", np.dtype(np.float32),
          boxes=(((0, 2), (0, 4)), ((2, 4), (0, 4))))}

    def read_into(self, path, box, out):
      raise StoreError(f"{path} box {list(box)}: disk on fire")

  s = NamedSharding(_mesh((2,), ("t",)), P(None, "t"))
  with pytest.raises(StoreError, match="w box .*disk on fire"):
    assembly.assemble(Broken(), {"w": jax.ShapeDtypeStruct(
        (4, 4), jnp.float32, sharding=s)})


def test_grouped_read_copies_sub_boxes():
  """One source box split over six new boxes (2-D blocks): it is read
  once, and each piece lands in its place."""
  full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  calls = []

  class Whole(sources.Source):
    whole_boxes = True

    def tensors(self):
      return {"w": sources.SourceTensor(
          "w", (8, 6), "float32", np.dtype(np.float32),
          boxes=(((0, 8), (0, 6)),))}

    def read_into(self, path, box, out):
      calls.append(box)
      out[...] = full[tuple(slice(a, b) for a, b in box)]

  s = NamedSharding(_mesh((2, 3), ("a", "b")), P("a", "b"))
  tree, rep = assembly.assemble(Whole(), {"w": jax.ShapeDtypeStruct(
      (8, 6), jnp.float32, sharding=s)})
  assert calls == [((0, 8), (0, 6))] and rep.reads == 1 and rep.pieces == 6
  assert np.asarray(tree["w"]).tobytes() == full.tobytes()
  assert tree["w"].sharding == s
