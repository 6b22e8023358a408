"""The batched executors: compile counts, aliasing of rows, the transition
cache, and flax's lm1b train state moved between lm1b meshes."""

import functools
import gc
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax as tj

rmod = importlib.import_module("tenplex_jax.reshard")
DEVS = jax.devices()
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Counts XLA backend compilations (jax's monitoring events) of the calls
  inside it. The generic executor's background recompiles (see
  ``reshard._queue_recompile``) would land in any count at a moment of the
  scheduler's choosing: those queued before are waited for, and none is
  queued inside (``TENPLEX_JAX_RECOMPILE=0``)."""

  def __init__(self):
    self.n = 0
    self._env = None

  def __call__(self, event, duration, **kw):
    if event == COMPILE_EVENT:
      self.n += 1

  def __enter__(self):
    assert rmod._wait_recompiles(60.0)
    self._env = os.environ.get("TENPLEX_JAX_RECOMPILE")
    os.environ["TENPLEX_JAX_RECOMPILE"] = "0"
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)
    if self._env is None:
      del os.environ["TENPLEX_JAX_RECOMPILE"]
    else:
      os.environ["TENPLEX_JAX_RECOMPILE"] = self._env


@pytest.fixture(scope="module", autouse=True)
def _compile_cold():
  # This file tests the generic executor's device programs, which its host
  # tier (tests/test_reshard_host_tier.py) would stand in for on a cold call.
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("TENPLEX_JAX_GENERIC_COLD", "compile")
    yield


@pytest.fixture(autouse=True)
def _no_recompile_running():
  # An earlier test's background recompile (see CompileCounter) neither
  # counts nor trims the heap inside the next test.
  assert rmod._wait_recompiles(60.0)


def _ptrs(x):
  return {s.device.id: s.data.unsafe_buffer_pointer()
          for s in x.addressable_shards}


def _bits(x):
  return np.asarray(x).tobytes()


def _rows_to_cols_tree(n_leaves, rows=64, cols=64, dtype=np.float32):
  a = Mesh(np.array(DEVS), ("x",))
  b = Mesh(np.array(DEVS[::-1]), ("x",))
  hosts = {f"w{i}": (np.arange(rows * cols) * (i + 1)).astype(dtype)
           .reshape(rows, cols) for i in range(n_leaves)}
  tree = {k: jax.device_put(v, NamedSharding(a, P("x"))) for k, v in
          hosts.items()}
  target = {k: NamedSharding(b, P(None, "x")) for k in hosts}
  return hosts, tree, target


@pytest.mark.parametrize("n_leaves", [2, 8])
def test_generic_compiles_at_most_twice_per_device(n_leaves):
  # Rows over 8 devices -> columns over the 8 devices reversed: every new
  # shard is 8 pieces (64 per array), cut on 8 devices and glued on 8; the
  # compile count is bounded by 2 per device however many pieces there are,
  # and a repeated transition compiles nothing.
  hosts, tree, target = _rows_to_cols_tree(n_leaves, cols=64 + 8 * n_leaves)
  with CompileCounter() as c:
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
  assert rep.method == "generic"
  assert 0 < c.n <= 2 * len(DEVS), c.n
  for k, v in out.items():
    assert v.sharding == target[k]
    assert _bits(v) == hosts[k].tobytes()
    for s in v.addressable_shards:
      assert np.asarray(s.data).tobytes() == hosts[k][s.index].tobytes()
  _, tree2, _ = _rows_to_cols_tree(n_leaves, cols=64 + 8 * n_leaves)
  with CompileCounter() as c2:
    out2, rep2 = tj.reshard_with_report(tree2, target, method="generic")
    jax.block_until_ready(out2)
  assert c2.n == 0 and rep2.cached
  assert all(_bits(out2[k]) == hosts[k].tobytes() for k in hosts)


def test_generic_mixed_dtypes_and_replication_bitwise():
  devs = np.array(DEVS)
  a = Mesh(devs.reshape(2, 4), ("data", "tensor"))
  b = Mesh(devs[[3, 1, 7, 5]].reshape(2, 2), ("data", "tensor"))
  hosts = {
      "f": np.linspace(-3, 3, 16 * 24, dtype=np.float32).reshape(16, 24),
      "h": np.arange(16 * 8, dtype=np.float32).astype(jnp.bfloat16)
      .reshape(16, 8),
      "i": (np.arange(8 * 16) % 251 - 125).astype(np.int8).reshape(8, 16),
      "s": np.array(7, np.int32)}
  src = {"f": P("data", "tensor"), "h": P(None, ("data", "tensor")),
         "i": P("tensor"), "s": P()}
  dst = {"f": P("tensor", "data"), "h": P(("tensor", "data")),
         "i": P(None, "data"), "s": P()}
  tree = {k: jax.device_put(v, NamedSharding(a, src[k]))
          for k, v in hosts.items()}
  target = {k: NamedSharding(b, dst[k]) for k in hosts}
  for method in ("generic", "cpu"):
    out = tj.reshard(tree, target, method=method)
    for k in hosts:
      assert out[k].sharding == target[k]
      assert out[k].dtype == hosts[k].dtype
      assert _bits(out[k]) == hosts[k].tobytes(), (method, k)


def test_rows_of_an_old_shard_are_aliased_and_survive_donation():
  # Rows over 2 devices -> rows over 8: each new box is a contiguous quarter
  # of an old shard, so nothing is copied; donating the source leaves the
  # new shards (which alias it) intact while memory is churned.
  a = Mesh(np.array(DEVS[:2]), ("x",))
  b = Mesh(np.array(DEVS[::-1]), ("x",))
  host = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
  src = NamedSharding(a, P("x"))
  x = jax.jit(lambda v: v + 0, out_shardings=src)(jax.device_put(host, src))
  old = {s.data.unsafe_buffer_pointer(): s.data.nbytes
         for s in x.addressable_shards}
  y, rep = tj.reshard_with_report(x, NamedSharding(b, P("x")), method="cpu",
                                  donate=True)
  assert rep.copied_bytes == 0 and rep.aliased_shards == 8
  assert x.is_deleted()
  for p in _ptrs(y).values():  # inside an old buffer
    assert any(o <= p < o + n for o, n in old.items())
  del x
  gc.collect()
  junk = [jax.jit(lambda: jnp.full(host.shape, -1.0, jnp.float32),
                  out_shardings=jax.sharding.SingleDeviceSharding(d))()
          for d in DEVS]
  junk += [np.full(host.shape, -2.0, np.float32) for _ in range(4)]
  jax.block_until_ready(junk[:8])
  assert _bits(y) == host.tobytes()
  for s in y.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])
  # A donating step over the new array never writes the shared memory.
  step = jax.jit(lambda v: v * 0 - 5, donate_argnums=0)
  import warnings
  z_in = tj.reshard(jax.device_put(host, NamedSharding(a, P("x"))),
                    NamedSharding(b, P("x")), method="cpu")
  keep = jax.device_put(host, NamedSharding(a, P("x")))
  w = tj.reshard(keep, NamedSharding(b, P("x")), method="cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    jax.block_until_ready(step(z_in))
  assert _bits(keep) == host.tobytes() and _bits(w) == host.tobytes()


def test_unaligned_rows_are_copied_once_not_aliased():
  # 3 rows of 4 float32 = 48 bytes per device: row offsets are not 64-byte
  # aligned, so the new boxes are copied (values still bitwise).
  a = Mesh(np.array(DEVS[:1]), ("x",))
  b = Mesh(np.array(DEVS[:4]), ("x",))
  host = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
  x = jax.device_put(host, NamedSharding(a, P("x")))
  y, rep = tj.reshard_with_report(x, NamedSharding(b, P("x")), method="cpu")
  assert _bits(y) == host.tobytes()
  assert rep.copied_bytes + rep.aliased_shards * 48 >= host.nbytes - 48


def test_a_repeated_transition_reuses_its_plan():
  hosts, tree, target = _rows_to_cols_tree(3)
  _, rep1 = tj.reshard_with_report(tree, target)
  _, tree2, _ = _rows_to_cols_tree(3)
  out, rep2 = tj.reshard_with_report(tree2, target)
  assert not rep1.cached and rep2.cached and rep2.seconds["plan"] == 0
  assert rep2.moved_bytes == rep1.moved_bytes > 0
  assert all(_bits(out[k]) == hosts[k].tobytes() for k in hosts)
  # Another target is planned afresh.
  other = {k: NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)), P("x"))
           for k in target}
  out3, rep3 = tj.reshard_with_report(tree2, other)
  assert not rep3.cached
  assert all(out3[k].sharding == other[k] for k in other)


def test_donate_in_batches_frees_every_source(monkeypatch):
  monkeypatch.setattr(rmod, "_DONATE_BATCH_BYTES", 4096)
  hosts, tree, target = _rows_to_cols_tree(6)
  out = tj.reshard(tree, target, donate=True)
  assert all(v.is_deleted() for v in tree.values())
  assert all(_bits(out[k]) == hosts[k].tobytes() for k in hosts)


def test_lm1b_small_state_between_lm1b_meshes():
  """flax's lm1b train state (SMALL) through four lm1b meshes: values
  bitwise, every sharding equal to what lm1b's rules give on that mesh."""
  import flax.linen as nn
  from fixtures import lm1b_state as L
  state, _ = L.make_state(L.make_mesh((1, 8, 1)), L.SMALL)
  abstract, _ = L.abstract_state(L.SMALL)
  logical = nn.get_partition_spec(abstract)
  flat, tdef = jax.tree.flatten(state)
  ref = [np.asarray(x).tobytes() for x in flat]

  def rule_targets(mesh):
    sh = nn.logical_to_mesh_sharding(logical, mesh, L.LM1B_RULES)
    return jax.tree.unflatten(tdef, jax.tree.leaves(sh))

  devs = jax.devices()
  meshes = [((2, 4, 1), None, "cpu"), ((1, 2, 4), devs[::-1], "auto"),
            ((2, 2, 2), [devs[i] for i in (1, 0, 3, 2, 5, 4, 7, 6)], "cpu"),
            ((1, 8, 1), None, "auto")]
  cur = state
  for shape, order, method in meshes:
    target = rule_targets(L.make_mesh(shape, order))
    cur = tj.reshard(cur, target, method=method)
    got = jax.tree.leaves(cur)
    assert jax.tree.structure(cur) == tdef
    for x, s, b in zip(got, jax.tree.leaves(target), ref):
      assert x.sharding == s, (shape, x.sharding, s)
      assert np.asarray(x).tobytes() == b, shape
  # remesh on the unboxed state keeps each leaf's spec on the new mesh,
  # which for lm1b's meshes is what the rules give.
  new, _ = tj.remesh(cur, L.make_mesh((2, 1, 4)))
  target = rule_targets(L.make_mesh((2, 1, 4)))
  for x, s, b in zip(jax.tree.leaves(new), jax.tree.leaves(target), ref):
    assert x.sharding == s, (x.sharding, s)
    assert np.asarray(x).tobytes() == b


def test_replicated_to_rows_aliases_one_replica():
  # Replicated on devices 2 and 4 -> rows over 3, 4, 7, 5: every new box
  # is rows of the replica on device 2 (also device 4's, which holds the
  # other replica), so nothing is copied and one old buffer stays pinned.
  a = Mesh(np.array([DEVS[2], DEVS[4]]), ("a",))
  b = Mesh(np.array([DEVS[i] for i in (3, 4, 7, 5)]), ("a",))
  host = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  x = jax.device_put(host, NamedSharding(a, P()))
  y, rep = tj.reshard_with_report(x, NamedSharding(b, P("a")), method="cpu")
  assert rep.copied_bytes == 0 and rep.aliased_shards == 4
  base = x.addressable_shards[0]
  src = {s.device.id: s.data.unsafe_buffer_pointer() for s in
         x.addressable_shards}[2]
  for p in _ptrs(y).values():
    assert src <= p < src + host.nbytes
  assert base is not None and _bits(y) == host.tobytes()
  for s in y.addressable_shards:
    assert np.array_equal(np.asarray(s.data), host[s.index])


def test_generic_compiles_once_per_array_signature():
  # Arrays between plain NamedShardings move by class: one SPMD cut and one
  # SPMD join program per (shape, dtype, shardings), shared by all 8
  # devices and by every array of that signature; an array whose shape the
  # shardings do not divide evenly takes the per-device executor.
  a = Mesh(np.array(DEVS), ("x",))
  b = Mesh(np.array(DEVS[::-1]).reshape(2, 4), ("p", "q"))
  hosts = {f"w{i:02d}": (np.arange(48 * 72, dtype=np.float32) * (i + 1))
           .reshape(48, 72) for i in range(16)}
  tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
          for k, v in hosts.items()}
  target = {k: NamedSharding(b, P("p", "q")) for k in hosts}
  with CompileCounter() as c:
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
  assert rep.method == "generic"
  assert 0 < c.n <= 2, c.n
  for k, v in out.items():
    assert v.sharding == target[k]
    for s in v.addressable_shards:
      assert np.asarray(s.data).tobytes() == hosts[k][s.index].tobytes()
  # From one device (not a NamedSharding), and a 0-d array: the per-device
  # executor, in the same call as an array of the class path.
  one = np.arange(20 * 8, dtype=np.int8).reshape(20, 8)
  tree = {"one": jax.device_put(one, DEVS[3]),
          "scalar": jax.device_put(np.float32(2.5), NamedSharding(a, P())),
          "w": tree["w00"]}
  target = {"one": NamedSharding(b, P("p", "q")),
            "scalar": NamedSharding(b, P()), "w": target["w00"]}
  out = tj.reshard(tree, target, method="generic")
  for k, host in (("one", one), ("scalar", np.float32(2.5)),
                  ("w", hosts["w00"])):
    assert out[k].sharding == target[k]
    for s in out[k].addressable_shards:
      assert np.asarray(s.data).tobytes() == np.asarray(host)[s.index].tobytes()


def test_generic_arrays_of_classes_of_their_own_share_per_device_programs():
  # 20 arrays, each the only one of its class (source sharding, target
  # sharding, rank, dtype), as in a state whose arrays were laid out one by
  # one: packing would compile a cut and a glue per class (40 programs; a
  # held-out random state of 1,406 arrays compiled 1,542 of them); arrays of
  # classes under rmod._PACK_MIN take the per-device executor, at most two
  # programs per device for all of them.
  a = Mesh(np.array(DEVS), ("x",))
  b = Mesh(np.array(DEVS[::-1]).reshape(2, 4), ("p", "q"))
  pairs = [(P("x"), P("p", "q")), (P(None, "x"), P("q", "p")),
           (P("x"), P(None, ("p", "q"))), (P(None, "x"), P("p")),
           (P("x", None), P(None, "q"))]
  dtypes = [np.float32, np.int8, jnp.bfloat16, np.int32]
  hosts, tree, target = {}, {}, {}
  for i, ((src, dst), dt) in enumerate(
      (pair, dt) for pair in pairs for dt in dtypes):
    k = f"w{i:02d}"
    hosts[k] = (np.arange(16 * 32) % 97 + i).astype(dt).reshape(16, 32)
    tree[k] = jax.device_put(hosts[k], NamedSharding(a, src))
    target[k] = NamedSharding(b, dst)
  with CompileCounter() as c:
    out = tj.reshard(tree, target, method="generic")
    jax.block_until_ready(out)
  assert 0 < c.n <= 2 * len(DEVS), c.n
  for k, v in out.items():
    assert v.sharding == target[k], k
    assert v.dtype == hosts[k].dtype and _bits(v) == hosts[k].tobytes(), k


def test_generic_packs_arrays_of_one_class_into_shared_transfers(monkeypatch):
  # Arrays of several shapes and dtypes between the same two shardings move
  # in packed groups (one per dtype): the device-to-device transfers are
  # those of one array per group, however many arrays there are.
  a = Mesh(np.array(DEVS).reshape(2, 4), ("p", "q"))
  hosts = {f"f{i}": np.arange(16 * (8 + 8 * i), dtype=np.float32)
           .reshape(16, 8 + 8 * i) * (i + 1) for i in range(6)}
  hosts.update({f"b{i}": (np.arange(16 * 8 * (i + 1)) % 3 == 0)
                .reshape(16, 8 * (i + 1)) for i in range(3)})
  src = NamedSharding(a, P("p", "q"))
  sent = []
  real_send = rmod._send

  def counting_send(arrays, devices):
    sent.append(len(arrays))
    return real_send(arrays, devices)

  monkeypatch.setattr(rmod, "_send", counting_send)

  before = {}

  def run(keys, target, donate=False):
    tree = {k: jax.device_put(hosts[k], src) for k in keys}
    before.update({k: {s.device.id: s.data.unsafe_buffer_pointer()
                       for s in tree[k].addressable_shards} for k in keys})
    sent.clear()
    with CompileCounter() as c:
      out, rep = tj.reshard_with_report(tree, {k: target for k in keys},
                                        method="generic", donate=donate)
      jax.block_until_ready(out)
    assert rep.method == "generic"
    for k, v in out.items():
      assert v.sharding == target and v.dtype == hosts[k].dtype
      for s in v.addressable_shards:
        assert np.asarray(s.data).tobytes() == hosts[k][s.index].tobytes()
    return tree, out, rep, sum(sent), c.n

  # Blocks of 4 x 2 -> 2 x 4 on other devices: every array cut and joined.
  other = NamedSharding(Mesh(np.array(DEVS[::-1]).reshape(4, 2), ("p", "q")),
                        P("p", "q"))
  one = run(["f0"], other)[3]
  assert one > 0
  _, _, rep, n_sent, compiles = run(sorted(hosts), other)
  assert n_sent == 2 * one  # one float32 group, one bool group
  assert compiles <= 4  # a cut and a glue program per group
  # The same transition again: cached programs, nothing compiled.
  _, _, rep, _, compiles = run(sorted(hosts), other)
  assert compiles == 0 and rep.cached
  # Devices 1 and 2 swap their shards, 0 and 3-7 keep theirs (reused, not
  # copied: the same memory), and with donate the sources are deleted.
  perm = NamedSharding(Mesh(np.array(DEVS)[[0, 2, 1, 3, 4, 5, 6, 7]]
                            .reshape(2, 4), ("p", "q")), P("p", "q"))
  tree, out, rep, n_sent, _ = run(sorted(hosts), perm, donate=True)
  assert n_sent == 2 * 2 and rep.reused_shards == 6 * len(hosts)
  for k in hosts:
    assert tree[k].is_deleted(), k
    kept = {s.device.id: s.data.unsafe_buffer_pointer()
            for s in out[k].addressable_shards if s.device.id not in (1, 2)}
    assert kept == {d: p for d, p in before[k].items() if d not in (1, 2)}


def _spy_groups(monkeypatch):
  """Records ``(flight, groups)`` of every grouping the generic path makes."""
  seen = []
  real_groups = rmod._groups

  def spy(batch, flight):
    out = real_groups(batch, flight)
    seen.append((flight, out))
    return out

  monkeypatch.setattr(rmod, "_groups", spy)
  return seen


def _generic_twice(monkeypatch, hosts, flight, record):
  """Reshards ``hosts`` (rows over 8 devices -> blocks over them reversed)
  twice with ``method="generic"`` and ``flight`` bytes in flight (however
  small the state), each call on a fresh source; checks every result's
  sharding and bits; returns, per call, ``record(flight, groups)`` of its
  last grouping and its compiles."""
  monkeypatch.setattr(rmod, "_FLIGHT_MIN", flight)
  monkeypatch.setattr(rmod, "_FLIGHT_MAX", flight)
  monkeypatch.setattr(rmod, "_FLIGHT_WHOLE", 0)
  a = Mesh(np.array(DEVS), ("x",))
  b = Mesh(np.array(DEVS[::-1]).reshape(2, 4), ("p", "q"))
  src = NamedSharding(a, P("x"))
  target = {k: NamedSharding(b, P("p", "q")) for k in hosts}
  seen = _spy_groups(monkeypatch)
  calls = []
  for _ in range(2):
    tree = {k: jax.device_put(v, src) for k, v in hosts.items()}
    with CompileCounter() as c:
      out = tj.reshard(tree, target, method="generic")
      jax.block_until_ready(out)
    for k, v in out.items():
      assert v.sharding == target[k]
      assert _bits(v) == hosts[k].tobytes(), k
      for s in v.addressable_shards:
        assert np.asarray(s.data).tobytes() == hosts[k][s.index].tobytes()
    calls.append((record(*seen[-1]), c.n))
  return calls


def test_generic_groups_bounded_by_bytes_share_programs(monkeypatch):
  # Arrays of a shape that repeats go in groups of that shape of at most half
  # the bytes in flight (unless one array is larger), which share one cut
  # and one glue program; arrays of shapes seen once go in groups of at most
  # the bytes in flight. Results stay bitwise.
  hosts = {f"s{i:02d}": (np.arange(64 * 64, dtype=np.float32) * (i + 1))
           .reshape(64, 64) for i in range(6)}  # 16 KiB each
  hosts.update({f"w{i}": (np.arange(64 * 256, dtype=np.float32) - i)
                .reshape(64, 256) for i in range(2)})  # 64 KiB each
  hosts.update({f"m{i}": (np.arange(64 * 8 * (i + 1), dtype=np.float32))
                .reshape(64, 8 * (i + 1)) for i in range(4)})  # 2-8 KiB
  calls = _generic_twice(
      monkeypatch, hosts, 40 << 10,
      lambda flight, out: (flight, sorted((len(m), nb)
                                          for _, _, m, nb in out)))
  # The second call: a fresh source, nothing compiled.
  for call, ((flight, groups), n) in enumerate(calls):
    assert flight == 40 << 10
    # Six 16 KiB arrays: one per group (two exceed the 20 KiB cap); the
    # 64 KiB ones alone each; the four shapes seen once (2+4+6+8 = 20 KiB)
    # in one group.
    assert groups == sorted([(1, 16 << 10)] * 6 + [(1, 64 << 10)] * 2
                            + [(4, 20 << 10)]), groups
    if call == 0:
      assert 0 < n <= 6, n  # two shared shapes and one mixed group
    else:
      assert n == 0, n


def test_generic_uniform_groups_share_one_program_with_padding(monkeypatch):
  # Five 16 KiB arrays and two 32 KiB ones between the same shardings, 80
  # KiB in flight: two groups of one signature (three of the first shape
  # and one of the second each, the second group's third slot padded by
  # repeating an array), so one cut and one glue program for all; the
  # padding's result is dropped and every result is bitwise.
  hosts = {f"s{i}": (np.arange(64 * 64, dtype=np.float32) * (i + 1))
           .reshape(64, 64) for i in range(5)}
  hosts.update({f"w{i}": (np.arange(64 * 128, dtype=np.float32) - i)
                .reshape(64, 128) for i in range(2)})
  calls = _generic_twice(
      monkeypatch, hosts, 80 << 10,
      lambda flight, out: [(k, list(m), nb) for k, _, m, nb in out])
  for call, (groups, n) in enumerate(calls):
    assert len(groups) == 2 and groups[0][0] == groups[1][0]
    assert groups[0][0][3] == ((64, 64),) * 3 + ((64, 128),)
    assert all(nb == 80 << 10 for _, _, nb in groups)
    # Every array in exactly one group, one of them twice (the padding).
    members = sorted(m for _, ms, _ in groups for m in ms)
    assert len(members) == 8 and len(set(members)) == 7
    assert n == (2 if call == 0 else 0), n


def test_generic_groups_bounded_by_the_bytes_targets_receive(monkeypatch):
  # A target that copies every array onto 4 devices receives 4x the
  # source's bytes: groups (and the bytes in flight) count those, so no
  # group's received copies exceed the bound. Results stay bitwise.
  monkeypatch.setattr(rmod, "_FLIGHT_WHOLE", 0)
  monkeypatch.setattr(rmod, "_FLIGHT_MIN", 64 << 10)
  monkeypatch.setattr(rmod, "_FLIGHT_MAX", 64 << 10)
  seen = _spy_groups(monkeypatch)
  a = Mesh(np.array(DEVS), ("x",))
  b = Mesh(np.array(DEVS[::-1]).reshape(2, 4), ("p", "q"))
  hosts = {f"w{i}": (np.arange(64 * 64, dtype=np.float32) * (i + 1))
           .reshape(64, 64) for i in range(8)}  # 16 KiB each, 64 KiB held
  tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
          for k, v in hosts.items()}
  target = {k: NamedSharding(b, P("p")) for k in hosts}
  out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
  for k, v in out.items():
    assert v.sharding == target[k]
    for s in v.addressable_shards:
      assert np.asarray(s.data).tobytes() == hosts[k][s.index].tobytes()
  (flight, groups), = seen
  assert flight == 64 << 10
  # Each array: 16 KiB held, 64 KiB received (2 row blocks x 4 copies).
  assert sorted(nb for _, _, _, nb in groups) == [64 << 10] * 8, groups
  assert sorted(n for _, _, m, _ in groups for n in m) == list(range(8))


def test_generic_small_state_moves_in_one_group(monkeypatch):
  # A batch that receives at most _FLIGHT_WHOLE bytes runs as one group per
  # class (one cut and one glue launch), however many shapes it has: the
  # bytes in flight are all of it. Above that, the usual bound splits it.
  seen = _spy_groups(monkeypatch)
  hosts = {f"w{i:02d}": (np.arange(64 * (64 + 8 * i), dtype=np.float32)
                         - i).reshape(64, -1) for i in range(12)}
  a = Mesh(np.array(DEVS), ("x",))
  cols = NamedSharding(Mesh(np.array(DEVS[::-1]), ("x",)), P(None, "x"))
  target = {k: cols for k in hosts}
  received = sum(v.nbytes for v in hosts.values())

  def run():
    tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
            for k, v in hosts.items()}
    out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
    for k, v in out.items():
      assert v.sharding == target[k]
      assert _bits(v) == hosts[k].tobytes(), k
    return seen[-1]

  monkeypatch.setattr(rmod, "_FLIGHT_MIN", 64 << 10)
  monkeypatch.setattr(rmod, "_FLIGHT_MAX", 64 << 10)
  flight, groups = run()
  assert flight == received and len(groups) == 1, (flight, groups)
  monkeypatch.setattr(rmod, "_FLIGHT_WHOLE", received - 1)
  flight, groups = run()
  assert flight == 64 << 10 and len(groups) > 1, (flight, groups)
  assert all(nb <= flight for _, _, _, nb in groups), groups


def test_generic_trims_the_heap_after_compiling_only(monkeypatch):
  # A cold generic call hands the C heap's free pages back (malloc_trim)
  # once its programs are compiled and before any group runs, so what the
  # compiles freed does not stay in the peak under the results; a warm call
  # (nothing compiled) does not trim. Results stay bitwise.
  hosts, _, target = _rows_to_cols_tree(3, rows=64, cols=72)
  a = Mesh(np.array(DEVS), ("x",))
  rmod._GROUP_EXES.clear()
  events = []
  real_ensure = rmod._ensure_group_programs
  real_send = rmod._send

  def ensure(keys):
    events.append("ensure")
    return real_ensure(keys)

  def send(arrays, devices):
    events.append("send")
    return real_send(arrays, devices)

  def trim(pad):
    assert pad == 0
    # The programs are compiled and cached when the heap is trimmed.
    events.append(("trim", len(rmod._GROUP_EXES)))
    return 1

  monkeypatch.setattr(rmod, "_ensure_group_programs", ensure)
  monkeypatch.setattr(rmod, "_send", send)
  monkeypatch.setattr(rmod, "_malloc_trim", trim)
  for call in range(2):
    tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
            for k, v in hosts.items()}
    events.clear()
    with CompileCounter() as c:
      out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
    trims = [e for e in events if isinstance(e, tuple)]
    if call == 0:
      assert c.n > 0
      assert trims == [("trim", 1)], events
      assert events.index(trims[0]) < events.index("send"), events
    else:
      assert c.n == 0 and trims == [], events
    for k, v in out.items():
      assert v.sharding == target[k]
      assert _bits(v) == hosts[k].tobytes(), k


def test_generic_cut_writes_no_temporary_buffer_on_cpu():
  # XLA:CPU fuses at most 8 slices into a concatenation: a packed buffer of
  # more arrays' sub-blocks had every slice written to a temporary buffer
  # as large as the cut's outputs, then copied. The cut packs at most
  # _CONCAT_FUSE_CPU arrays a buffer, each written by one fused kernel: no
  # temporary; the results bitwise.
  hosts = {f"w{i:02d}": (np.arange(64 * (64 + 8 * i), dtype=np.float32)
                         * (i + 1)).reshape(64, -1) for i in range(20)}
  a = Mesh(np.array(DEVS), ("x",))
  cols = NamedSharding(Mesh(np.array(DEVS[::-1]), ("x",)), P(None, "x"))
  tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
          for k, v in hosts.items()}
  rmod._GROUP_EXES.clear()
  out = jax.block_until_ready(
      tj.reshard(tree, {k: cols for k in hosts}, method="generic"))
  for k, v in out.items():
    assert v.sharding == cols
    assert _bits(v) == hosts[k].tobytes(), k
  (cut, glues, sizes), = rmod._GROUP_EXES.values()
  assert cut.memory_analysis().temp_size_in_bytes == 0
  for glue in glues:
    assert glue.memory_analysis().temp_size_in_bytes == 0
  # 20 arrays in runs of 8, 8 and 4, each run's sub-blocks one buffer.
  per = [sum(64 * (64 + 8 * i) // 64 for i in range(r, min(20, r + 8)))
         for r in (0, 8, 16)]
  assert sizes == tuple(per), sizes


def test_generic_large_group_sends_and_glues_run_by_run_on_cpu(
    monkeypatch):
  # A group packed in several runs (20 arrays: runs of 8, 8 and 4) that
  # receives at least _RUNS_APART_MIN bytes sends and glues them run by
  # run: one batch of transfers and one glue launch per run, each batch
  # holding that run's packed buffers only, so each run's copies go once
  # used rather than all of the group's at once. Runs of the same member
  # shapes share one glue program. Below the bound the runs go together
  # (one batch, one glue). Results bitwise, shardings the target's.
  hosts = {f"w{i:02d}": (np.arange(64 * (64 + 8 * i), dtype=np.float32)
                         * (i + 1)).reshape(64, -1) for i in range(20)}
  hosts.update({f"s{i:02d}": (np.arange(64 * 64, dtype=np.float32) - i)
                .reshape(64, 64) for i in range(16)})
  a = Mesh(np.array(DEVS), ("x",))
  cols = NamedSharding(Mesh(np.array(DEVS[::-1]), ("x",)), P(None, "x"))
  glued = []  # per glue launch, its number of inputs and outputs
  sends = []  # per batch of transfers, its number of transfers
  real_ensure, real_send = rmod._ensure_group_programs, rmod._send

  def ensure(keys):
    out = []
    for cut, glues, sizes in real_ensure(keys):
      def spy(*ins, glue):
        outs = glue(*ins)
        glued.append((len(ins), len(outs)))
        return outs
      out.append((cut, tuple(functools.partial(spy, glue=g) for g in glues),
                  sizes))
    return out

  def send(arrays, devices):
    sends.append(len(arrays))
    return real_send(arrays, devices)

  monkeypatch.setattr(rmod, "_ensure_group_programs", ensure)
  monkeypatch.setattr(rmod, "_send", send)

  def run(bound):
    monkeypatch.setattr(rmod, "_RUNS_APART_MIN", bound)
    rmod._GROUP_EXES.clear()
    glued.clear()
    sends.clear()
    with CompileCounter() as c:
      for names in (sorted(k for k in hosts if k[0] == "w"),
                    sorted(k for k in hosts if k[0] == "s")):
        tree = {k: jax.device_put(hosts[k], NamedSharding(a, P("x")))
                for k in names}
        out = jax.block_until_ready(
            tj.reshard(tree, {k: cols for k in names}, method="generic"))
        for k, v in out.items():
          assert v.sharding == cols
          assert _bits(v) == hosts[k].tobytes(), k
    return c.n, list(rmod._GROUP_EXES.values())

  # Each group receives its source's bytes: 700 KiB and 256 KiB.
  n, ((_, g20, s20), (_, g16, s16)) = run(256 << 10)
  # 20 arrays: 3 runs; 16 of one shape: 2 runs, one group. Rows over 8 ->
  # columns over 8 reversed: 8 sub-blocks a target box, 7 from elsewhere,
  # so 56 transfers and 8 glue inputs per run.
  assert sends == [56] * 5, sends
  assert glued == [(8, 8), (8, 8), (8, 4), (8, 8), (8, 8)], glued
  # A cut and 3 glues; a cut and one glue for both runs of one shape.
  assert n == 6, n
  assert len(g20) == 3 and len(set(map(id, g20))) == 3
  assert len(g16) == 2 and g16[0] is g16[1] and s16 == (8 * 64,) * 2
  n, ((_, g20, _), (_, g16, _)) = run(512 << 10)  # the first group only
  assert sends == [56] * 3 + [112] and n == 6, (sends, n)
  assert glued == [(8, 8), (8, 8), (8, 4), (16, 16)], glued
  assert len(g20) == 3 and len(g16) == 1
  n, ((_, g20, _), (_, g16, _)) = run(64 << 20)  # neither
  assert sends == [168, 112] and n == 4, (sends, n)
  assert glued == [(24, 20), (16, 16)], glued
  assert len(g20) == 1 and len(g16) == 1


@pytest.fixture
def recompiles_on(monkeypatch):
  """Background recompiles on (none is left over from an earlier test: see
  _no_recompile_running), and none left running after."""
  monkeypatch.setenv("TENPLEX_JAX_RECOMPILE", "1")
  yield
  assert rmod._wait_recompiles(60.0)


def _recompile_case(cols: int):
  """4 arrays of one class (a packed group) and one of a class of its own
  (the per-device executor), every program cache emptied."""
  hosts, _, target = _rows_to_cols_tree(4, rows=64, cols=cols)
  hosts["z"] = np.arange(64 * 40, dtype=np.int32).reshape(64, 40)
  target["z"] = NamedSharding(Mesh(np.array(DEVS[:4]), ("y",)), P("y"))
  rmod._GROUP_EXES.clear()
  rmod._programs.clear()
  rmod._recompile_later.clear()
  return hosts, target, Mesh(np.array(DEVS), ("x",))


def test_generic_recompiles_in_the_background_and_swaps_bitwise(
    monkeypatch, recompiles_on):
  # A cold call compiles fast code and queues nothing; a call that uses the
  # programs again queues them, and after it a background thread compiles
  # them again (XLA level 1 on CPU) and swaps them into the caches. The
  # next call runs the new executables, compiles nothing, and its results
  # are bitwise the same, on the target sharding.
  hosts, target, a = _recompile_case(cols=72)
  threads, installed, queued = [], [], []

  def listen(event, duration, **kw):
    if event == COMPILE_EVENT:
      threads.append(rmod.threading.current_thread().name)

  for name in ("_install_group", "_install_program"):
    real = getattr(rmod, name)

    def wrap(key, exes, real=real, name=name):
      cache = rmod._GROUP_EXES if name == "_install_group" else rmod._programs
      installed.append((name, key, cache[key], exes))
      real(key, exes)
    monkeypatch.setattr(rmod, name, wrap)
  real_queue = rmod._queue_recompile

  def queue(*job):
    # queued inside a reshard call, compiled only after it
    queued.append(rmod._resharding)
    real_queue(*job)
  monkeypatch.setattr(rmod, "_queue_recompile", queue)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    outs = []
    for call in range(3):
      tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
              for k, v in hosts.items()}
      n0 = len(threads)
      outs.append(jax.block_until_ready(
          tj.reshard(tree, target, method="generic")))
      mine = [t for t in threads[n0:] if t != "tenplex-recompile"]
      if call == 0:  # cold: compiles, queues nothing
        assert mine and not queued, (threads, queued)
        assert rmod._recompile_later
      else:  # nothing compiled by a warm call itself
        assert mine == [], threads
      if call == 1:
        assert queued and set(queued) == {1}, queued
        assert not rmod._recompile_later
        assert rmod._wait_recompiles(60.0)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  again = [t for t in threads if t == "tenplex-recompile"]
  kinds = {name for name, *_ in installed}
  assert kinds == {"_install_group", "_install_program"}, kinds
  assert len(installed) == len(queued)
  # Each program compiled once more, on the background thread.
  assert len(again) == sum(len({id(e) for e in x[3]}) for x in installed)
  for name, key, fast, exes in installed:
    if name == "_install_group":
      assert rmod._GROUP_EXES[key] == (exes[0], tuple(exes[1:]), fast[2])
      assert rmod._GROUP_EXES[key][0] is not fast[0]
    else:
      assert rmod._programs[key] is exes[0] and exes[0] is not fast
  for out in outs:
    for k, v in out.items():
      assert v.sharding == target[k], k
      assert _bits(v) == hosts[k].tobytes(), k


def test_generic_recompiled_executables_are_bounded(monkeypatch,
                                                    recompiles_on):
  # Each executable takes memory mappings of its own (a process has 65,530):
  # once _RECOMPILED_MAX recompiled ones are alive, the rest keep their
  # fast code, and the results stay bitwise.
  hosts, target, a = _recompile_case(cols=56)
  kept = list(rmod._recompiled)  # none may die in between
  monkeypatch.setattr(rmod, "_RECOMPILED_MAX", len(kept) + 1)
  installs = []
  for name in ("_install_group", "_install_program"):
    real = getattr(rmod, name)
    monkeypatch.setattr(rmod, name, lambda key, exes, real=real: (
        installs.append((key, {id(e) for e in exes})), real(key, exes)))
  for call in range(3):
    tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
            for k, v in hosts.items()}
    out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
    assert rmod._wait_recompiles(60.0)
    for k, v in out.items():
      assert v.sharding == target[k], k
      assert _bits(v) == hosts[k].tobytes(), k
  # the group's and the per-device programs were queued; one job was
  # compiled (the bound is checked before each job: a group's cut and glue
  # go together)
  assert len(installs) == 1, installs
  assert len(rmod._recompiled) == len(kept) + len(installs[0][1])
  del kept


def test_generic_recompile_failure_keeps_the_fast_programs(monkeypatch,
                                                           recompiles_on):
  # A recompile that fails (here its install) leaves the fast programs in
  # place, raises nothing in the thread (pytest would report it), and
  # waiters still wake; later calls stay bitwise.
  hosts, target, a = _recompile_case(cols=40)

  def broken(key, exes):
    raise RuntimeError("install failed")
  monkeypatch.setattr(rmod, "_install_group", broken)
  monkeypatch.setattr(rmod, "_install_program", broken)
  for _ in range(3):
    tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
            for k, v in hosts.items()}
    out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
    assert rmod._wait_recompiles(60.0)
    assert rmod._recompile_thread is None and not rmod._recompile_jobs
    for k, v in out.items():
      assert _bits(v) == hosts[k].tobytes(), k


def test_generic_recompile_switch(monkeypatch, recompiles_on):
  hosts, _, target = _rows_to_cols_tree(3, rows=64, cols=88)
  a = Mesh(np.array(DEVS), ("x",))
  rmod._GROUP_EXES.clear()
  rmod._recompile_later.clear()
  queued = []
  monkeypatch.setattr(rmod, "_queue_recompile", lambda *a: queued.append(a))
  monkeypatch.setenv("TENPLEX_JAX_RECOMPILE", "0")
  for _ in range(2):
    tree = {k: jax.device_put(v, NamedSharding(a, P("x")))
            for k, v in hosts.items()}
    out = jax.block_until_ready(tj.reshard(tree, target, method="generic"))
    for k, v in out.items():
      assert _bits(v) == hosts[k].tobytes(), k
  assert not queued and not rmod._recompile_later
  rmod._GROUP_EXES.clear()
  monkeypatch.setenv("TENPLEX_JAX_RECOMPILE", "yes")
  with pytest.raises(Exception, match="TENPLEX_JAX_RECOMPILE must be 0 or 1"):
    tj.reshard(tree, target, method="generic")


_EXIT_SCRIPT = """
import time, importlib
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tenplex_jax as tj
rmod = importlib.import_module("tenplex_jax.reshard")
d = jax.devices()
a, b = Mesh(np.array(d), ("x",)), Mesh(np.array(d[::-1]), ("x",))
tree = {f"w{i}": jax.device_put(np.full((64, 64 + 8 * i), i, np.float32),
                                NamedSharding(a, P("x"))) for i in range(24)}
for _ in range(2):  # the second call queues the recompiles
  out = jax.block_until_ready(tj.reshard(
      tree, {k: NamedSharding(b, P(None, "x")) for k in tree},
      method="generic"))
assert all((np.asarray(v) == int(k[1:])).all() for k, v in out.items())
print("recompiling at exit:", rmod._recompile_thread is not None,
      len(rmod._recompile_jobs), flush=True)
"""


def test_process_exits_cleanly_while_recompiling():
  # The background thread is not a daemon (a daemon killed inside XLA at
  # interpreter exit can crash it): an exiting process waits for the
  # compile in progress and drops the queued ones.
  import sys

  import procs
  env = {**os.environ, "TENPLEX_JAX_RECOMPILE": "1"}
  r, = procs.run_all([[sys.executable, "-c", _EXIT_SCRIPT]], timeout=120,
                     env=env, merge_stderr=False)
  assert r.returncode == 0, (r.stdout, r.stderr)
  assert "recompiling at exit: True" in r.stdout, r.stdout
  assert r.stderr.strip() == "", r.stderr
