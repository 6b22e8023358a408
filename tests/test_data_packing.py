"""PackedIterator: filtered, packed global batches independent of the shard count,
every accepted sample exactly once (long samples as pieces), across random resizes."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_jax.data import DataError, PackedIterator, pack_rows

KEYS = ("tokens", "segment_ids", "positions", "sample_ids", "source_pos", "mask")


class Source:
  """Dict samples whose tokens name their sample: sample i, token k = 1000 * i + k + 1.

  ``none_for`` returns None for the rejected samples, as a Grain
  ``MapDataset.filter`` does. Counts reads."""

  def __init__(self, lengths, none_for=None):
    self.lengths = list(lengths)
    self.none_for = none_for
    self.reads = []

  def __len__(self):
    return len(self.lengths)

  def __getitem__(self, i):
    self.reads.append(i)
    if self.none_for is not None and self.none_for(i):
      return None
    return {"tokens": 1000 * i + 1 + np.arange(self.lengths[i], dtype=np.int32), "id": i}


def _make(src, n, i, cfg):
  return PackedIterator(src, shard_index=i, shard_count=n, **cfg)


def _concat(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in KEYS}


def static_run(src, cfg):
  it = _make(src, 1, 0, cfg)
  out = []
  while True:
    epoch = it.get_state()["epoch"]
    try:
      out.append((epoch, next(it)))
    except StopIteration:
      return out


def elastic_run(src, cfg, first_n, resizes):
  """Each shard's iterator reads its rows; at each resize every shard's state is
  compared, sent through JSON, and restored under the new shard count."""
  its = [_make(src, first_n, i, cfg) for i in range(first_n)]
  out, step = [], 0
  while True:
    if step in resizes:
      states = [it.get_state() for it in its]
      assert all(s == states[0] for s in states)
      state = json.loads(json.dumps(states[0]))
      n = resizes[step]
      its = [_make(src, n, i, cfg) for i in range(n)]
      for it in its:
        it.set_state(state)
    parts = []
    for it in its:
      try:
        parts.append(next(it))
      except StopIteration:
        parts.append(None)
    if all(p is None for p in parts):
      return out
    assert all(p is not None for p in parts), "shards disagree on the end of the data"
    out.append(_concat(parts))
    step += 1


def check_exactly_once(batches, accepted, lengths, num_epochs, seq_len, rows):
  per_epoch = {e: {} for e in range(num_epochs)}
  for epoch, b in batches:
    assert b["tokens"].shape == (rows, seq_len)
    for r in range(rows):
      seg, sid, sp, tok = (b[k][r] for k in ("segment_ids", "sample_ids", "source_pos",
                                             "tokens"))
      real = seg > 0
      # Pieces sit at the row's start, segments 1, 2, ... in order, padding after.
      assert not real[real.argmin():].any() if not real.all() else True
      assert (np.diff(seg[real]) >= 0).all() and (seg[real][:1] <= 1).all()
      assert (b["mask"][r] == real).all()
      assert (sid[~real] == -1).all() and (tok[~real] == 0).all()
      for s in np.unique(seg[real]):
        at = seg == s
        ids = np.unique(sid[at])
        assert ids.size == 1
        assert (b["positions"][r][at] == np.arange(at.sum())).all()
        assert sp[at][0] % seq_len == 0  # a piece starts at a multiple of L
        for p, t in zip(sp[at].tolist(), tok[at].tolist()):
          assert t == 1000 * ids[0] + p + 1
          assert (int(ids[0]), p) not in per_epoch[epoch], "a token appears twice"
          per_epoch[epoch][(int(ids[0]), p)] = t
  want = {(i, p) for i in accepted for p in range(lengths[i])}
  for e in range(num_epochs):
    assert set(per_epoch[e]) == want


@st.composite
def cases(draw):
  n = draw(st.integers(1, 30))
  seq_len = draw(st.integers(1, 8))
  lengths = draw(st.lists(st.integers(0, 3 * seq_len), min_size=n, max_size=n))
  rows = draw(st.integers(1, 6))
  mod = draw(st.integers(1, 5))
  mode = draw(st.sampled_from(["keep", "lengths", "lengths+keep", "none", "all"]))
  cfg = dict(seq_len=seq_len, rows_per_batch=rows, seed=draw(st.integers(0, 3)),
             shuffle=draw(st.booleans()), num_epochs=2,
             max_open_rows=draw(st.integers(1, 6)))
  rejected = lambda i: mod > 1 and i % mod == 0  # noqa: E731
  src = Source(lengths, none_for=rejected if mode == "none" else None)
  if "keep" in mode:
    cfg["keep"] = lambda s: not rejected(s["id"])
  if "lengths" in mode:
    cfg["lengths"] = np.array(lengths)
  filtered = mode in ("keep", "lengths+keep", "none")
  accepted = [i for i in range(n) if lengths[i] > 0 and not (filtered and rejected(i))]
  first_n = draw(st.integers(1, 8))
  steps = 2 * (sum(lengths) // (rows * seq_len) + 1)  # about the run's length
  resizes = draw(st.dictionaries(st.integers(1, steps), st.integers(1, 8), min_size=1,
                                 max_size=4))
  return src, cfg, accepted, lengths, first_n, resizes


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_resizes_give_the_static_batches_and_each_sample_once(case):
  src, cfg, accepted, lengths, first_n, resizes = case
  static = static_run(src, cfg)
  elastic = elastic_run(src, cfg, first_n, resizes)
  assert len(elastic) == len(static)
  for t, ((_, s), e) in enumerate(zip(static, elastic)):
    for k in KEYS:
      assert np.array_equal(s[k], e[k]), (t, k)
  check_exactly_once(static, accepted, lengths, 2, cfg["seq_len"], cfg["rows_per_batch"])


def test_known_lengths_without_a_filter_read_only_the_shards_rows():
  lengths = [3, 1, 4, 1, 5, 9, 2, 6]
  srcs = [Source(lengths) for _ in range(2)]
  its = [PackedIterator(srcs[i], seq_len=4, rows_per_batch=4, seed=0, shard_index=i,
                        shard_count=2, lengths=np.array(lengths), num_epochs=1)
         for i in range(2)]
  b = [next(it) for it in its]
  for src, part in zip(srcs, b):
    assert sorted(set(src.reads)) == sorted(set(part["sample_ids"][part["mask"]].tolist()))
  assert not set(srcs[0].reads) & set(srcs[1].reads)


def test_rejected_samples_never_appear_and_long_samples_split():
  src = Source([9, 2, 3])
  it = PackedIterator(src, seq_len=4, rows_per_batch=8, seed=0, shuffle=False,
                      keep=lambda s: s["id"] != 1, num_epochs=1)
  (b,) = list(it)
  real = b["sample_ids"][b["mask"]]
  assert 1 not in real and sorted(np.unique(real).tolist()) == [0, 2]
  assert sorted(b["source_pos"][b["sample_ids"] == 0].tolist()) == list(range(9))
  assert pack_rows([9, 0, 3], seq_len=4, max_open_rows=8) == [
      [(0, 0, 4)], [(0, 4, 4)], [(0, 8, 1), (2, 0, 3)]]


def test_commit_counts_only_committed_steps():
  src = Source([2] * 6)
  it = PackedIterator(src, seq_len=2, rows_per_batch=1, seed=0, auto_commit=False)
  first = [next(it)["sample_ids"].tolist() for _ in range(3)]
  it.commit(1)
  state = it.get_state()
  assert state["step"] == 1
  with pytest.raises(DataError, match="exceeds the 2 step"):
    it.commit(3)
  again = PackedIterator(src, seq_len=2, rows_per_batch=1, seed=0)
  again.set_state(state)
  assert next(again)["sample_ids"].tolist() == first[1]


def test_mismatched_or_malformed_states_are_refused():
  src = Source([3, 3])
  it = PackedIterator(src, seq_len=4, rows_per_batch=2, seed=0)
  state = it.get_state()
  other = PackedIterator(src, seq_len=5, rows_per_batch=2, seed=0)
  with pytest.raises(DataError, match="seq_len: state has 4, iterator has 5"):
    other.set_state(state)
  bad = dict(state, open=[[[0, 0, 9]]])
  with pytest.raises(DataError, match=r"piece \[0, 0, 9\] is not"):
    it.set_state(bad)
  with pytest.raises(DataError, match="lengths must be 2 ints"):
    PackedIterator(src, seq_len=4, rows_per_batch=2, seed=0, lengths=[1])
  with pytest.raises(DataError, match=r"sample 1 has 3 tokens, but lengths\[1\] says 2"):
    next(PackedIterator(src, seq_len=4, rows_per_batch=2, seed=0, shuffle=False,
                        lengths=[3, 2]))
  with pytest.raises(DataError, match="sample 0 has keys"):
    next(PackedIterator([{"x": [1]}], seq_len=4, rows_per_batch=1, seed=0))
