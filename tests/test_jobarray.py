"""Job arrays: stacking, the mapped step against solo runs, membership changes."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax import jobarray as ja
from tenplex_jax.errors import LayoutError, UsageError

FEATURES, CLASSES, BATCH = 8, 4, 8


class Mlp(nn.Module):

  @nn.compact
  def __call__(self, x, rng, rate):
    # Inverted dropout; the scale 1/(1 - rate) comes precomputed with the
    # rate (a multiply: XLA may rewrite a division by a traced scalar
    # differently inside shard_map than in the solo program).
    keep_prob, scale = rate
    x = nn.gelu(nn.Dense(16)(x))
    keep = jax.random.bernoulli(rng, keep_prob, x.shape)
    x = jnp.where(keep, x * scale, 0.0)
    return nn.Dense(CLASSES)(x)


MODEL = Mlp()
TX = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=1e-4)


@jax.jit
def _init(key, rng, lr):
  params = MODEL.init(key, jnp.zeros((1, FEATURES)), jax.random.key(0),
                      (1.0, 1.0))["params"]
  opt = TX.init(params)
  opt.hyperparams["learning_rate"] = lr
  return {"params": params, "opt": opt, "rng": rng, "step": jnp.int32(0)}


def init_state(seed, lr):
  return _init(jax.random.key(seed), jax.random.key(1000 + seed), jnp.float32(lr))



def step_fn(state, batch, hp):
  rng, sub = jax.random.split(state["rng"])

  def loss_fn(p):
    logits = MODEL.apply({"params": p}, batch["x"], sub, (hp["keep"], hp["scale"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  opt = state["opt"]
  opt.hyperparams["weight_decay"] = hp["wd"]
  updates, opt = TX.update(grads, opt, state["params"])
  return ({"params": optax.apply_updates(state["params"], updates), "opt": opt,
           "rng": rng, "step": state["step"] + 1}, {"loss": loss})


def batch_of(job_seed, t):
  rs = np.random.default_rng([job_seed, t])
  return {"x": rs.standard_normal((BATCH, FEATURES)).astype(np.float32),
          "y": rs.integers(0, CLASSES, BATCH).astype(np.int32)}


def hp_of(seed):
  rate = 0.1 * (seed % 3)
  return {"keep": np.float32(1.0 - rate), "scale": np.float32(1.0 / (1.0 - rate)),
          "wd": np.float32(1e-4 * (1 + seed))}


def solo_run(seed, t0, t1, state=None):
  """The job trained alone on device 0, steps t0..t1-1."""
  step = jax.jit(step_fn)   # jax caches the compiled program per function
  s = jax.device_put(init_state(seed, 1e-3 * (1 + seed)) if state is None else state,
                     jax.devices()[0])
  for t in range(t0, t1):
    s, _ = step(s, batch_of(seed, t), hp_of(seed))
  return s


def leaves(state):
  return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      getattr(x, "dtype", None), jax.dtypes.prng_key) else x)
          for x in jax.tree.leaves(state)]


def max_diff(a, b):
  out = 0.0
  for x, y in zip(leaves(a), leaves(b), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    out = max(out, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)),
                                initial=0.0)))
  return out


def array_step(seeds, t, mesh=None, method="map"):
  batches = ja.stack([batch_of(s, t) for s in seeds])
  hps = ja.stack([hp_of(s) for s in seeds])
  if mesh is not None:
    batches = jax.device_put(batches, NamedSharding(mesh, P("job")))
    hps = jax.device_put(hps, NamedSharding(mesh, P("job")))
  return batches, hps


# --------------------------------------------------------------------------


def test_stack_unstack_round_trip_bitwise():
  rs = np.random.default_rng(0)
  states = [{"w": rs.standard_normal((3, 5)).astype(np.float32),
             "h": jnp.asarray(rs.standard_normal(4), dtype=jnp.bfloat16),
             "n": np.int32(k), "f8": np.arange(6, dtype=ml_dtypes.float8_e4m3fn),
             "key": jax.random.key(k), "name": "lm", "eps": 1e-8, "mask": np.bool_(k % 2)}
            for k in range(3)]
  mesh = ja.job_mesh(jax.devices()[:3], jobs=3)
  for shardings in (None, NamedSharding(mesh, P("job"))):
    s = ja.stack(states, shardings=shardings)
    assert s["w"].shape == (3, 3, 5) and s["name"] == "lm" and s["eps"] == 1e-8
    assert s["key"].shape == (3,) and jax.dtypes.issubdtype(s["key"].dtype,
                                                            jax.dtypes.prng_key)
    if shardings is not None:
      assert s["w"].sharding == shardings and s["key"].sharding.spec == P("job")
    back = ja.unstack(s)
    assert len(back) == 3
    for k in range(3):
      for x, y in zip(leaves(states[k]), leaves(back[k]), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
      assert back[k]["name"] == "lm" and back[k]["eps"] == 1e-8


def test_keys_stacked_and_repacked_on_one_device_land_on_the_target():
  # jax.random.wrap_key_data keeps the key data's spec on a one-device mesh
  # (P('job', None) for keys of rank 1 stacked: one entry too many); stack
  # and repack put the keys on the target sharding itself, as on more
  # devices, with the same key bits.
  keys = [{"k": jax.random.split(jax.random.key(j), 3)} for j in range(2)]
  for n in (1, 2):
    mesh = ja.job_mesh(jax.devices()[:n], jobs=n)
    target = NamedSharding(mesh, P("job"))
    st = ja.stack(keys, shardings={"k": target})
    want = jax.device_put(jax.random.split(jax.random.key(0), (2, 3)),
                          target).sharding
    assert st["k"].sharding == want, (n, st["k"].sharding, want)
    new, _ = ja.repack(st, [1, 0], shardings={"k": target})
    assert new["k"].sharding == want, (n, new["k"].sharding, want)
    for j, row in enumerate((1, 0)):
      np.testing.assert_array_equal(
          jax.random.key_data(new["k"])[j],
          jax.random.key_data(keys[row]["k"]))


def test_stack_mismatches_name_leaf_and_jobs():
  base = {"w": np.zeros(2, np.float32), "name": "a"}
  with pytest.raises(LayoutError, match=r"name: non-array leaf differs from job 0 in jobs \[2\]"):
    ja.stack([base, base, {**base, "name": "b"}])
  with pytest.raises(LayoutError, match=r"w: jobs \[1\] differ from job 0.*float32\[2\].*float32\[3\]"):
    ja.stack([base, {**base, "w": np.zeros(3, np.float32)}])
  with pytest.raises(LayoutError, match=r"w: jobs \[1\].*float64"):
    ja.stack([base, {**base, "w": np.zeros(2)}])
  with pytest.raises(LayoutError, match="job 1 has another tree structure"):
    ja.stack([base, {"w": base["w"]}])
  with pytest.raises(LayoutError, match="disagree on the job axis size"):
    ja.num_jobs({"a": np.zeros((2, 1)), "b": np.zeros(3)})


def test_map_step_on_one_device_is_bitwise_the_solo_run():
  seeds = [0, 1, 2]
  state = ja.stack([init_state(s, 1e-3 * (1 + s)) for s in seeds])
  step = jax.jit(ja.vmap_step(step_fn, method="map"))
  for t in range(3):
    state, metrics = step(state, *array_step(seeds, t))
  assert metrics["loss"].shape == (3,)
  for k, s in enumerate(seeds):
    assert max_diff(ja.unstack(state)[k], solo_run(s, 0, 3)) == 0.0


def test_vmap_step_sharded_matches_solo_within_tolerance():
  # vmap batches the jobs' matmuls and reductions, which XLA fuses and
  # vectorises differently: last-bit differences in the gradients (measured
  # here: at most 6e-8 after 3 Adam steps; docs/jobarray.md).
  seeds = list(range(8))
  mesh = ja.job_mesh(jax.devices()[:8], jobs=4, tensor=2)
  per_job = jax.tree.map(lambda x: P(*([None] * np.ndim(x))),
                         init_state(0, 1e-3), is_leaf=lambda x: ja._is_array(x))
  per_job["params"]["Dense_0"]["kernel"] = P(None, "tensor")
  per_job["opt"].inner_state[0].mu["Dense_0"]["kernel"] = P(None, "tensor")
  target = ja.stacked_shardings(per_job, mesh)
  state = ja.stack([init_state(s, 1e-3 * (1 + s)) for s in seeds], shardings=target)
  assert state["params"]["Dense_0"]["kernel"].sharding.spec == P("job", None, "tensor")
  step = jax.jit(ja.vmap_step(step_fn), out_shardings=(target, None))
  for t in range(3):
    state, _ = step(state, *array_step(seeds, t, mesh))
  for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
    assert x.sharding == sh
  for k, s in enumerate(seeds):
    assert max_diff(ja.unstack(state)[k], solo_run(s, 0, 3)) <= 1e-5


def test_remove_add_resize_keep_each_trajectory_bitwise():
  """4 jobs on 4 devices (one each): 2 steps, job 1 stops, 2 steps, a new job
  joins, 2 steps, the array moves onto 2 devices, 2 steps. Every job equals
  its solo run on one device bit for bit."""
  devs = jax.devices()
  mesh = ja.job_mesh(devs[:4], jobs=4)
  seeds = [0, 1, 2, 3]
  state = ja.stack([init_state(s, 1e-3 * (1 + s)) for s in seeds],
                   shardings=NamedSharding(mesh, P("job")))

  def run(state, seeds, t0, t1):
    m = state["params"]["Dense_0"]["kernel"].sharding.mesh
    step = jax.jit(ja.vmap_step(step_fn, method="map", mesh=m))
    for t in range(t0, t1):
      state, _ = step(state, *array_step(seeds, t, m))
    return state

  state = run(state, seeds, 0, 2)
  before = {x.sharding.mesh.devices.flat[k].id: x.addressable_shards[k].data.unsafe_buffer_pointer()
            for x in [state["params"]["Dense_0"]["kernel"]] for k in range(4)}
  new, rep = ja.repack(state, [0, 2, 3])
  assert rep.moved_bytes == 0 and rep.added_bytes == 0
  assert rep.kept_bytes == rep.state_bytes > 0 and rep.mesh_shape == {"job": 3}
  assert [d.id for d in new["params"]["Dense_0"]["kernel"].sharding.mesh.devices.flat] == [0, 2, 3]
  for sh in new["params"]["Dense_0"]["kernel"].addressable_shards:   # same buffers
    assert sh.data.unsafe_buffer_pointer() == before[sh.device.id]
  state = ja.remove(state, [1])
  seeds = [0, 2, 3]
  state = run(state, seeds, 2, 4)

  fresh = init_state(7, 1e-3 * 8)
  new, rep = ja.repack(state, [0, 1, 2, -1], new_states=[fresh], devices=devs[:4])
  assert rep.moved_bytes == 0 and rep.added_bytes * 4 == rep.state_bytes
  state = ja.add(state, [fresh], devices=devs[:4])
  assert [d.id for d in state["params"]["Dense_0"]["kernel"].sharding.mesh.devices.flat] == [0, 2, 3, 1]
  seeds = [0, 2, 3, 7]
  state = run(state, seeds, 4, 6)

  state, rep = ja.resize(state, ja.job_mesh(devs[:2], jobs=2))
  assert rep.moved_bytes == rep.lower_bound_bytes
  for x in jax.tree.leaves(state):
    if isinstance(x, jax.Array):
      assert x.sharding.spec[0] == "job" and x.sharding.mesh.shape == {"job": 2}
  state = run(state, seeds, 6, 8)

  jobs = ja.unstack(state)
  for k, s in enumerate(seeds):
    solo = solo_run(s, 4, 8, init_state(7, 8e-3)) if s == 7 else solo_run(s, 0, 8)
    assert max_diff(jobs[k], solo) == 0.0, s
  removed = solo_run(1, 0, 2)
  assert max_diff(removed, solo_run(1, 0, 3)) > 0   # the check can fail


def test_repack_moves_only_rows_whose_device_changes():
  mesh = ja.job_mesh(jax.devices()[:4], jobs=2, tensor=2)
  states = [{"w": np.full((4, 6), k, np.float32)} for k in range(4)]
  s = ja.stack(states, shardings={"w": NamedSharding(mesh, P("job", None, "tensor"))})
  # jobs 0,1 on group (0,1), jobs 2,3 on group (2,3); keep 1 and 2 -> 2 groups
  # of one job each: the groups stay, each keeps its row (half of it per device).
  new, rep = ja.repack(s, [1, 2])
  assert rep.moved_bytes == 0 and rep.kept_bytes == 2 * 4 * 6 * 4
  assert new["w"].sharding.spec == P("job", None, "tensor")
  np.testing.assert_array_equal(np.asarray(new["w"])[:, 0, 0], [1, 2])
  # An explicit mesh that swaps the groups moves every row.
  swapped = ja.job_mesh([jax.devices()[i] for i in (2, 3, 0, 1)], jobs=2, tensor=2)
  new, rep = ja.repack(s, [1, 2], mesh=swapped)
  assert rep.moved_bytes == 2 * 4 * 6 * 4 and rep.kept_bytes == 0
  np.testing.assert_array_equal(np.asarray(new["w"])[:, 0, 0], [1, 2])
  np.testing.assert_array_equal(np.asarray(s["w"])[:, 0, 0], [0, 1, 2, 3])  # source intact


def test_membership_errors():
  mesh = ja.job_mesh(jax.devices()[:2], jobs=2)
  s = ja.stack([{"w": np.zeros(2, np.float32)}] * 2, shardings=NamedSharding(mesh, P("job")))
  with pytest.raises(UsageError, match=r"jobs \[5\] are not in \[0, 2\)"):
    ja.remove(s, [5])
  with pytest.raises(UsageError, match="removing all 2 jobs"):
    ja.remove(s, [0, 1])
  with pytest.raises(LayoutError, match=r"w: new states \[0\] have shape \[\[3\]\], the jobs \[2\]"):
    ja.add(s, [{"w": np.zeros(3, np.float32)}])
  with pytest.raises(UsageError, match="method must be"):
    ja.vmap_step(step_fn, method="pmap")
  with pytest.raises(LayoutError, match=r"w: spec .* uses \['job'\]"):
    ja.stacked_shardings({"w": P("job")}, mesh)


def test_job_iterators_give_each_job_its_solo_stream():
  data = np.arange(40, dtype=np.float32).reshape(20, 2)
  its = ja.job_iterators(data, seeds=[3, 4], global_batch_size=4)
  solo = tj.data.ElasticIterator(data, global_batch_size=4, seed=4)
  for _ in range(3):
    b = ja.next_batches(its)
    s = next(solo)
    np.testing.assert_array_equal(b["data"][1], s["data"])
    assert not np.array_equal(b["data"][0], b["data"][1])
  h = ja.hparams(lr=[1e-3, 2e-3])
  assert h["lr"].dtype == np.float32 and h["lr"].shape == (2,)
  with pytest.raises(UsageError, match="different lengths"):
    ja.hparams(lr=[1.0], wd=[1.0, 2.0])


def test_placement_search_reports_alternatives():
  spec = tj.search.transformer_spec(name="tiny", layers=2, hidden=64, heads=4,
                                    vocab=128, seq_len=32)
  rep = ja.placement_search(spec, jobs=8, devices=8, batch=8, seq_len=32)
  assert sorted(a.job for a in rep.alternatives) == [1, 2, 4, 8]
  fits = [a for a in rep.alternatives if a.fits]
  assert rep.best.step_s == min(a.step_s for a in fits)
  for a in rep.alternatives:
    assert a.job * a.data * a.fsdp * a.tensor * a.pipeline == 8
    assert a.step_s == pytest.approx(8 // a.job * a.job_step_s)
  text = rep.explain()
  assert f"best: job={rep.best.job}" in text and text.count("\n") >= 6
  # 6 jobs on 8 devices: the job axis divides both (1, 2).
  rep = ja.placement_search(spec, jobs=6, devices=8, batch=8, seq_len=32)
  assert sorted(a.job for a in rep.alternatives) == [1, 2]


def test_public_names_resolve_and_have_examples():
  assert tj.jobarray is ja
  for name in ja.__all__:
    obj = getattr(ja, name)
    if inspect.isfunction(obj):
      assert obj.__doc__ and "Example" in obj.__doc__, name
