"""ArrayRecord: the dataset index over sharded ArrayRecord files, random reads,
fallbacks, the iterators on top, and the LM example's data module."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tenplex_jax.data import (
    DataError,
    DatasetReader,
    ElasticIterator,
    PackedIterator,
    build_index,
    load_index,
    save_index,
    write_records,
)
from tenplex_jax.data.arrayrecord import scan_array_record, write_array_record

ROOT = Path(__file__).resolve().parents[1]


def _seqs(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 1000, rng.integers(0, 20)).astype(np.int32) for _ in range(n)]


def _write_shards(d, seqs, shards):
  per = -(-len(seqs) // shards)
  paths = []
  for k in range(shards):
    p = os.path.join(d, f"t.array_record-{k:05d}-of-{shards:05d}")
    write_array_record(p, (s.tobytes() for s in seqs[k * per:(k + 1) * per]),
                       group_size=1 + k)  # chunks of 1, 2, 3 records
    paths.append(p)
  return paths


def test_index_over_shard_files_reads_every_record_by_global_id(tmp_path):
  seqs = _seqs(23)
  paths = _write_shards(tmp_path, seqs, 3)
  idx = build_index(paths)
  assert idx.num_samples == 23 and [f.kind for f in idx.files] == ["array_record"] * 3
  # (file_id, record index in the file, byte length)
  assert idx.entries[9].tolist() == [1, 1, seqs[9].nbytes]
  reader = DatasetReader(save_index(idx, tmp_path / "idx"),
                         decode_record=lambda b: np.frombuffer(b, np.int32))
  order = np.random.default_rng(1).permutation(23)
  for i in order:
    assert np.array_equal(reader[int(i)], seqs[i])
    assert reader.read_bytes(int(i)) == seqs[i].tobytes()
  assert reader.stats["local"] == 23
  reader.close()
  assert load_index(tmp_path / "idx").fingerprint == idx.fingerprint
  # Records and ArrayRecord records are both bytes samples and mix in one index;
  # arrays do not.
  write_records(tmp_path / "r.tpxr", [b"x"])
  assert build_index([paths[0], tmp_path / "r.tpxr"]).num_samples == 9
  np.save(tmp_path / "a.npy", np.zeros((2, 2)))
  with pytest.raises(DataError, match="has shape"):
    build_index([paths[0], tmp_path / "a.npy"])


def test_missing_or_changed_files_go_to_the_fallbacks(tmp_path):
  seqs = _seqs(8)
  paths = _write_shards(tmp_path, seqs, 2)
  idx = build_index(paths)
  other = [s.tobytes() for s in seqs]
  os.remove(paths[1])
  reader = DatasetReader(idx, fallbacks=[other])
  assert reader[1] == other[1] and reader[6] == other[6]
  assert reader.stats == {"local": 1, "fallback": [1], "missing_local": 1}
  write_array_record(paths[1], [b"short"])  # fewer and other records
  fresh = DatasetReader(idx)
  with pytest.raises(DataError, match="sample 5 is record 1, but the file has 1 records"):
    fresh[5]
  with pytest.raises(DataError, match=r"has 5 bytes, but the index says"):
    fresh[4]
  with open(tmp_path / "bad.array_record", "wb") as f:
    f.write(b"not an array record" * 10)
  with pytest.raises(DataError, match="not a readable ArrayRecord file"):
    build_index([tmp_path / "bad.array_record"])
  assert scan_array_record(paths[0]).tolist() == [s.nbytes for s in seqs[:4]]


def test_elastic_and_packed_iterators_over_array_record(tmp_path):
  seqs = _seqs(30, seed=2)
  reader = DatasetReader(build_index(_write_shards(tmp_path, seqs, 3)),
                         decode_record=lambda b: {"tokens": np.frombuffer(b, np.int32)})
  lengths = np.asarray(reader.index.entries[:, 2]) // 4
  as_list = [{"tokens": s} for s in seqs]
  kw = dict(seq_len=8, rows_per_batch=4, seed=5, num_epochs=1)
  want = list(PackedIterator(as_list, **kw))
  parts = [list(PackedIterator(reader, shard_index=i, shard_count=3, lengths=lengths, **kw))
           for i in range(3)]
  assert len(want) == len(parts[0])
  for t, w in enumerate(want):
    got = np.concatenate([p[t]["tokens"] for p in parts])
    assert np.array_equal(got, w["tokens"])
  raw = DatasetReader(reader.index)  # variable-length bytes: an object array per batch
  it = ElasticIterator(raw, global_batch_size=4, seed=0, num_epochs=1, prefetch=2,
                       read_threads=3)  # the per-file reader lock
  assert it.fingerprint == reader.fingerprint
  got = {i: d for b in it for i, d in zip(b["ids"].tolist(), b["data"].tolist()) if i >= 0}
  assert got == {i: s.tobytes() for i, s in enumerate(seqs)}


@pytest.fixture()
def lm_data():
  sys.path.insert(0, str(ROOT / "examples" / "lm"))
  try:
    import config
    import data
    yield data, config
  finally:
    sys.path.remove(str(ROOT / "examples" / "lm"))


def test_lm_source_is_array_record_with_the_generated_sequences(tmp_path, lm_data):
  data, config = lm_data
  cfg = config.TINY
  src = data.source(cfg, tmp_path / "lm", n=40, seed=3)
  assert len(src) == 40 and {f.kind for f in src.index.files} == {"array_record"}
  assert len(src.index.files) == 4
  gen = data.generate(cfg.vocab, cfg.seq_len, 40, 3)
  for i in range(40):
    assert np.array_equal(src[i]["tokens"], gen[i])
    assert gen[i].shape == (cfg.seq_len + 1,)
  again = data.source(cfg, tmp_path / "lm", n=40, seed=3)  # reuses the written files
  assert again.fingerprint == src.fingerprint
  it = ElasticIterator(src, global_batch_size=8, seed=0, prefetch=0)
  assert next(it)["tokens"].shape == (8, cfg.seq_len + 1)
  # The packed variant: variable lengths, rows of seq_len + 1 tokens, any shard count.
  full = data.packed_iterator(cfg, tmp_path / "var", rows_per_batch=4, seed=0, n=40,
                              num_epochs=1)
  b = next(full)
  assert b["tokens"].shape == (4, cfg.seq_len + 1) and b["segment_ids"].max() >= 1
  half = data.packed_iterator(cfg, tmp_path / "var", rows_per_batch=4, seed=0, n=40,
                              shard_index=1, shard_count=2, num_epochs=1)
  assert np.array_equal(next(half)["tokens"], b["tokens"][2:])
  assert data.main(["--out", str(tmp_path / "cli"), "--samples", "9", "--shards", "2"]) == 0
  assert load_index(tmp_path / "cli" / "index").num_samples == 9


def test_lm_packed_batch_on_meshes_of_any_shard_count(tmp_path, lm_data):
  import jax
  from jax.sharding import Mesh
  data, config = lm_data
  cfg = config.TINY
  devs = np.array(jax.devices())

  def mesh(d, f):
    return Mesh(devs[:d * f].reshape(d, f, 1, 1), ("data", "fsdp", "tensor", "stage"))

  kw = dict(seed=4, workdir=tmp_path / "var", n=60)
  static, state = [], None
  for _ in range(3):
    b, state = data.packed_batch(cfg, mesh(1, 1), state, 8, **kw)
    static.append(b)
  b0, s = data.packed_batch(cfg, mesh(2, 2), None, 8, **kw)     # 4 shards
  b1, s = data.packed_batch(cfg, mesh(1, 2), s, 8, **kw)        # 2 shards
  b2, s = data.packed_batch(cfg, mesh(4, 2), s, 8, **kw)        # 8 shards
  assert s == state
  for want, got in zip(static, (b0, b1, b2)):
    for k in ("tokens", "segment_ids", "positions", "weights"):
      assert np.array_equal(np.asarray(want[k]), np.asarray(got[k])), k
  assert b2["tokens"].shape == (8, cfg.seq_len + 1)
  assert b2["tokens"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  w = np.asarray(b0["weights"])
  seg = np.asarray(b0["segment_ids"])
  assert w.shape == (8, cfg.seq_len) and w.sum() == (seg > 0).sum() - len(
      {(r, v) for r, row in enumerate(seg) for v in row if v > 0})
