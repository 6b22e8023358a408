"""The global order and elastic resumes: exactly-once, identical global batches."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_jax.data import (
    DataError,
    ElasticIterator,
    epoch_permutation,
    global_batch_ids,
    shard_batch_ids,
    shard_bounds,
    steps_per_epoch,
)


def test_permutation_depends_on_seed_epoch_and_size_only():
  p = epoch_permutation(7, 2, 50)
  assert sorted(p.tolist()) == list(range(50))
  np.testing.assert_array_equal(p, epoch_permutation(7, 2, 50))
  assert not np.array_equal(p, epoch_permutation(7, 3, 50))
  assert not np.array_equal(p, epoch_permutation(8, 2, 50))
  assert p.dtype == np.int64


def test_permutation_matches_documented_recipe():
  ss = np.random.SeedSequence(11, spawn_key=(4,))
  want = np.random.Generator(np.random.PCG64(ss)).permutation(30)
  np.testing.assert_array_equal(epoch_permutation(11, 4, 30), want)


@pytest.mark.parametrize("b,n", [(10, 4), (8, 4), (3, 5), (1, 1), (7, 3)])
def test_shard_bounds_tile_the_batch_first_shards_get_one_more(b, n):
  bounds = [shard_bounds(b, i, n) for i in range(n)]
  assert bounds[0][0] == 0 and bounds[-1][1] == b
  for (s0, e0), (s1, _) in zip(bounds, bounds[1:]):
    assert e0 == s1
  sizes = [e - s for s, e in bounds]
  assert sizes == [b // n + (1 if i < b % n else 0) for i in range(n)]


def test_bad_arguments_name_what_was_given():
  with pytest.raises(DataError, match="shard_index=4 with shard_count=4"):
    shard_bounds(8, 4, 4)
  with pytest.raises(DataError, match="global_batch_size must be >= 1"):
    steps_per_epoch(10, 0)
  with pytest.raises(DataError, match="step must be < steps_per_epoch=3"):
    global_batch_ids(0, 0, 3, 10, 4)


def test_epoch_tail_is_padded_and_every_sample_used_once():
  n, b = 10, 4
  ids = np.concatenate([global_batch_ids(3, 0, t, n, b) for t in range(steps_per_epoch(n, b))])
  assert ids.shape == (12,)
  assert ids[-2:].tolist() == [-1, -1]
  assert sorted(ids[ids >= 0].tolist()) == list(range(n))


def test_pad_rule_same_for_every_shard_count():
  for n in (1, 2, 3, 4, 6):
    parts = [shard_batch_ids(0, 0, 2, 10, 4, i, n) for i in range(n)]
    np.testing.assert_array_equal(np.concatenate(parts), global_batch_ids(0, 0, 2, 10, 4))


def _static_batches(num_samples, b, seed, epochs, shuffle):
  return [global_batch_ids(seed, e, t, num_samples, b, shuffle=shuffle)
          for e in range(epochs) for t in range(steps_per_epoch(num_samples, b))]


def _run_elastic(source, b, seed, epochs, schedule, prefetch, shuffle):
  """Runs the job through (shard_count, steps) segments; returns the global batches.

  Between segments every shard's state is checked equal, JSON round-tripped,
  and given to a fresh set of iterators with the new shard count.
  """
  state = None
  out = []
  for n, steps in schedule:
    its = [ElasticIterator(source, global_batch_size=b, seed=seed, shard_index=i,
                           shard_count=n, num_epochs=epochs, prefetch=prefetch,
                           shuffle=shuffle) for i in range(n)]
    if state is not None:
      for it in its:
        it.set_state(state)
    done = False
    for _ in range(steps):
      parts = []
      for it in its:
        try:
          parts.append(next(it))
        except StopIteration:
          done = True
          break
      if done:
        assert not parts, "all shards must end at the same step"
        break
      assert [len(p["ids"]) for p in parts] == [
          shard_bounds(b, i, n)[1] - shard_bounds(b, i, n)[0] for i in range(n)]
      out.append({"ids": np.concatenate([p["ids"] for p in parts]),
                  "data": np.concatenate([p["data"] for p in parts]),
                  "mask": np.concatenate([p["mask"] for p in parts])})
    states = [it.get_state() for it in its]
    assert all(s == states[0] for s in states)
    state = json.loads(json.dumps(states[0]))
    for it in its:
      it.close()
      assert not it.prefetch_alive
    if done:
      break
  return out, state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_samples=st.integers(1, 40),
    b=st.integers(1, 9),
    seed=st.integers(0, 2**32),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    prefetch=st.sampled_from([0, 1, 3]),
    segments=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1,
                      max_size=8),
)
def test_random_resize_schedule_matches_static_run(num_samples, b, seed, epochs, shuffle,
                                                   prefetch, segments):
  source = np.arange(num_samples, dtype=np.int64) * 10 + 3
  static = _static_batches(num_samples, b, seed, epochs, shuffle)
  # Finish the job with a last segment long enough to reach the end.
  schedule = list(segments) + [(segments[-1][0] % 5 + 1, len(static) + 1)]
  elastic, final = _run_elastic(source, b, seed, epochs, schedule, prefetch, shuffle)
  assert len(elastic) == len(static)
  for t, (got, want) in enumerate(zip(elastic, static)):
    np.testing.assert_array_equal(got["ids"], want, err_msg=f"global step {t}")
    np.testing.assert_array_equal(got["mask"], want >= 0)
    np.testing.assert_array_equal(got["data"][got["mask"]], source[want[want >= 0]])
    np.testing.assert_array_equal(got["data"][~got["mask"]], 0)
  per_epoch = len(static) // epochs
  for e in range(epochs):
    ids = np.concatenate([x["ids"] for x in elastic[e * per_epoch:(e + 1) * per_epoch]])
    assert sorted(ids[ids >= 0].tolist()) == list(range(num_samples)), f"epoch {e}"
  assert (final["epoch"], final["step"]) == (epochs, 0)
  assert final["samples_seen"] == epochs * num_samples
