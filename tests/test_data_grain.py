"""Grain interop: MapDatasets and Grain's ArrayRecordDataSource as sources, the
iterator state in Orbax in Grain's layout (restorable under another process
count), and the limits of Grain's own pieces that docs/data.md states."""

import json
import os

import grain
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tenplex_jax.data import (
    DataError,
    DatasetReader,
    ElasticIterator,
    IteratorRestore,
    IteratorSave,
    PackedIterator,
    as_grain_iterator,
    build_index,
    read_state,
)
from tenplex_jax.data.arrayrecord import write_array_record


def _global_batches(source, shards_by_step, steps, **kw):
  """Global batches (shards' parts concatenated) with the shard count changing
  at given steps; the state crosses each change."""
  out, state, its = [], None, None
  for t in range(steps):
    if t in shards_by_step:
      state = its[0].get_state() if its else None
      n = shards_by_step[t]
      its = [ElasticIterator(source, shard_index=i, shard_count=n, prefetch=0, **kw)
             for i in range(n)]
      if state is not None:
        for it in its:
          it.set_state(state)
    parts = [next(it) for it in its]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
  return out


def test_a_map_dataset_with_random_map_and_shuffle_is_an_elastic_source():
  ds = (grain.MapDataset.range(40).seed(7).shuffle()
        .random_map(lambda x, rng: {"x": np.int64(x), "noise": rng.integers(1 << 30)}))
  static = _global_batches(ds, {0: 1}, 12, global_batch_size=6, seed=2)
  elastic = _global_batches(ds, {0: 3, 4: 2, 9: 6}, 12, global_batch_size=6, seed=2)
  for s, e in zip(static, elastic):
    for k in s:
      assert np.array_equal(s[k], e[k])
  # Every sample once per epoch (7 steps of 6 slots cover the 40 samples).
  seen = np.concatenate([b["x"][b["mask"]] for b in static[:7]])
  assert sorted(seen.tolist()) == list(range(40))


def test_grain_array_record_data_source_reads_our_files(tmp_path):
  paths = []
  for k in range(2):
    p = os.path.join(tmp_path, f"d.array_record-{k:05d}-of-00002")
    write_array_record(p, [f"{k}-{i}".encode() for i in range(5 + k)])
    paths.append(p)
  ours = DatasetReader(build_index(paths))
  theirs = grain.sources.ArrayRecordDataSource(paths)
  assert len(theirs) == len(ours) == 11
  assert [theirs[i] for i in range(11)] == [ours[i] for i in range(11)]
  a = next(ElasticIterator(theirs, global_batch_size=11, seed=0, prefetch=0))
  b = next(ElasticIterator(ours, global_batch_size=11, seed=0, prefetch=0))
  assert a["data"].tolist() == b["data"].tolist()


def test_filtered_map_datasets_pack_exactly_like_keep_and_are_refused_unpacked():
  toks = [np.arange(i % 7, dtype=np.int32) + 100 * i for i in range(30)]
  ds = grain.MapDataset.source(toks).filter(lambda t: t.size % 3 != 1)
  kw = dict(seq_len=5, rows_per_batch=3, seed=1, num_epochs=1)
  want = list(PackedIterator(toks, keep=lambda t: t.size % 3 != 1, **kw))
  got = list(PackedIterator(ds, **kw))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert np.array_equal(g["tokens"], w["tokens"])
    assert np.array_equal(g["sample_ids"], w["sample_ids"])
  with pytest.raises(DataError, match="returned None for sample .* use PackedIterator"):
    list(ElasticIterator(ds, global_batch_size=30, seed=0, prefetch=0))
  with pytest.raises(DataError, match="infinite Grain MapDataset"):
    ElasticIterator(grain.MapDataset.range(3).repeat(), global_batch_size=1, seed=0)
  # Grain's own ElasticIterator refuses the filter outright.
  with pytest.raises(ValueError, match="does not support `filter`"):
    grain.experimental.ElasticIterator(
        ds, global_batch_size=3, shard_options=grain.sharding.NoSharding())


def test_packed_state_saves_beside_the_model_and_restores_under_another_process_count(
    tmp_path):
  toks = [np.arange(1 + i % 9, dtype=np.int32) for i in range(40)]
  kw = dict(seq_len=6, rows_per_batch=4, seed=3)
  it = PackedIterator(toks, **kw)
  for _ in range(3):
    next(it)
  params = {"w": jnp.arange(4.0)}
  with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(3, args=ocp.args.Composite(model=ocp.args.StandardSave(params),
                                        data=IteratorSave(it)))
    mgr.wait_until_finished()
  item = tmp_path / "ckpt" / "3" / "data"
  assert [f for f in os.listdir(item) if f.endswith(".json")] == ["process_0-of-1.json"]
  # Grain's layout: a job of 2 processes wrote one file each (equal states).
  text = (item / "process_0-of-1.json").read_text()
  os.remove(item / "process_0-of-1.json")
  for i in range(2):
    (item / f"process_{i}-of-2.json").write_text(text)
  new = PackedIterator(toks, shard_index=1, shard_count=2, **kw)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
    restored = mgr.restore(3, args=ocp.args.Composite(
        model=ocp.args.StandardRestore({"w": jnp.zeros(4)}), data=IteratorRestore(new)))
  assert restored["data"] is new and new.get_state() == it.get_state()
  assert np.array_equal(next(new)["tokens"], next(it)["tokens"][2:])
  np.testing.assert_array_equal(restored["model"]["w"], params["w"])
  # Grain's handler looks only for process_0-of-1.json here.
  with pytest.raises(ValueError, match="does not exist"):
    grain.checkpoint.CheckpointHandler().restore(
        item, args=grain.checkpoint.CheckpointRestore(as_grain_iterator(new)))
  # Per-shard states (what Grain's DataLoader writes) are not merged.
  state = json.loads(text)
  (item / "process_1-of-2.json").write_text(json.dumps(dict(state, position=0)))
  with pytest.raises(DataError, match=r"\['process_1-of-2.json'\] differ"):
    read_state(item, 0, 1)


def test_grain_handler_and_ours_read_each_others_files_at_one_process_count(tmp_path):
  src = list(range(20))
  it = as_grain_iterator(ElasticIterator(src, global_batch_size=4, seed=0, prefetch=0))
  next(it), next(it)
  grain.checkpoint.CheckpointHandler().save(tmp_path, args=grain.checkpoint.CheckpointSave(it))
  back = ElasticIterator(src, global_batch_size=4, seed=0, shard_count=2, prefetch=0)
  assert read_state(tmp_path)["step"] == 2
  from tenplex_jax.data import IteratorHandler
  IteratorHandler().restore(tmp_path, args=IteratorRestore(back))
  assert back.get_state() == it.get_state()


def test_each_process_saves_its_own_file_and_any_count_restores(tmp_path, monkeypatch):
  from tenplex_jax.data import IteratorHandler
  from tenplex_jax.data import checkpoint as ckpt
  toks = [np.arange(1 + i % 5, dtype=np.int32) for i in range(30)]
  kw = dict(seq_len=4, rows_per_batch=6, seed=9, keep=lambda t: t.size != 3)
  shards = [PackedIterator(toks, shard_index=i, shard_count=2, **kw) for i in range(2)]
  for it in shards:
    next(it), next(it)
  for i, it in enumerate(shards):  # what processes 0 and 1 of 2 do in IteratorHandler.save
    monkeypatch.setattr(ckpt, "_process_index_and_count", lambda i=i: (i, 2))
    IteratorHandler().save(tmp_path, args=IteratorSave(it))
  assert sorted(os.listdir(tmp_path)) == ["process_0-of-2.json", "process_1-of-2.json"]
  static = PackedIterator(toks, **kw)
  for _ in range(3):
    want = next(static)
  for count in (1, 3):  # restored on another process count
    parts = []
    for i in range(count):
      monkeypatch.setattr(ckpt, "_process_index_and_count", lambda i=i: (i, count))
      it = PackedIterator(toks, shard_index=i, shard_count=count, **kw)
      IteratorHandler().restore(tmp_path, args=IteratorRestore(it))
      parts.append(next(it)["tokens"])
    assert np.array_equal(np.concatenate(parts), want["tokens"])
