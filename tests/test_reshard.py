"""reshard on 8 simulated CPU devices: values bitwise, shardings as targeted."""

import contextlib
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import procs
import tenplex_jax as tj
from tenplex_jax import LayoutError, PTC, ReshardError, reshard, reshard_with_report
from tenplex_jax.layout import placement_of

DEVS = jax.devices()
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn,
          jnp.float8_e5m2, jnp.int8, jnp.int32, jnp.uint8, jnp.bool_,
          jnp.complex64, jnp.int4]


@contextlib.contextmanager
def generic_cold(how):
  """``TENPLEX_JAX_GENERIC_COLD=how`` inside: how the generic executor builds
  arrays whose programs are not compiled yet (``host`` or ``compile``)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("TENPLEX_JAX_GENERIC_COLD", how)
    yield


@pytest.fixture(scope="module", autouse=True)
def _compile_cold():
  # The generic executor's device programs, not its host tier, unless a test
  # asks for it (see tests/test_reshard_host_tier.py).
  with generic_cold("compile"):
    yield


def bits(x):
  """A bitwise view of an array (or typed key array) as host bytes."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  a = np.asarray(x)
  if a.dtype == jnp.int4:
    return a.astype(np.int8).tobytes()
  return a.reshape(-1).view(np.uint8).tobytes()


def make(shape, dtype, sharding, seed=0):
  rng = np.random.default_rng(seed)
  if dtype == jnp.bool_:
    host = rng.integers(0, 2, shape).astype(bool)
  elif dtype == jnp.int4:
    host = rng.integers(-8, 8, shape).astype(jnp.int4)
  elif jnp.issubdtype(dtype, jnp.complexfloating):
    host = (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(dtype)
  else:
    host = rng.normal(size=shape).astype(np.float32).astype(dtype) if \
        jnp.issubdtype(dtype, jnp.floating) else \
        rng.integers(0, 100, shape).astype(dtype)
  return jax.device_put(host, sharding)


@st.composite
def mesh_strategy(draw):
  n = draw(st.sampled_from([1, 2, 4, 8]))
  ids = draw(st.permutations(range(8)))[:n]
  factor = draw(st.sampled_from([f for f in (1, 2, 4, 8) if n % f == 0]))
  shape = (factor, n // factor)
  names = ("x", "y")
  return Mesh(np.array([DEVS[i] for i in ids]).reshape(shape), names)


@st.composite
def sharding_strategy(draw, ndim):
  if draw(st.integers(0, 9)) == 0:
    return SingleDeviceSharding(DEVS[draw(st.integers(0, 7))])
  mesh = draw(mesh_strategy())
  names = ["x", "y"]
  spec = []
  for _ in range(ndim):
    k = draw(st.integers(0, 3))
    if k == 0 or not names:
      spec.append(None)
    elif k == 3 and len(names) == 2:
      spec.append(tuple(draw(st.permutations(names))))
      names = []
    else:
      spec.append(names.pop(draw(st.integers(0, len(names) - 1))))
  return NamedSharding(mesh, P(*spec))


def parts(s, ndim):
  if not isinstance(s, NamedSharding):
    return [1] * ndim
  out = []
  for d in range(ndim):
    e = s.spec[d] if d < len(s.spec) else None
    axes = () if e is None else ((e,) if isinstance(e, str) else e)
    out.append(math.prod(s.mesh.shape[a] for a in axes))
  return out


@st.composite
def case(draw):
  ndim = draw(st.integers(0, 3))
  a = draw(sharding_strategy(ndim))
  b = draw(sharding_strategy(ndim))
  pa, pb = parts(a, ndim), parts(b, ndim)
  shape = tuple(math.lcm(x, y) * draw(st.sampled_from([0, 1, 2, 3]))
                for x, y in zip(pa, pb))
  if draw(st.integers(0, 3)):  # mostly non-empty
    shape = tuple(max(n, math.lcm(x, y)) for n, x, y in zip(shape, pa, pb))
  dtype = draw(st.sampled_from(DTYPES))
  method = draw(st.sampled_from(["cpu", "generic", "generic-host"]))
  return shape, dtype, a, b, method


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_random_reshard_is_bitwise_and_on_target(c):
  shape, dtype, a, b, method = c
  # "generic-host": the generic executor's host tier (arrays whose programs
  # are not compiled yet built through the host; a new transition's are not)
  cold = "host" if method == "generic-host" else "compile"
  method = method.removesuffix("-host")
  x = make(shape, dtype, a)
  before = bits(x)
  with generic_cold(cold):
    y, report = reshard_with_report({"x": x}, {"x": b}, method=method)
  y = y["x"]
  assert bits(y) == before
  assert bits(x) == before  # source untouched
  assert y.sharding == b, (y.sharding, b)  # the target itself, as
  # jax.device_put gives: not only an equivalent one
  assert y.dtype == x.dtype and y.shape == x.shape
  assert report.moved_bytes == report.lower_bound_bytes
  # Round trip is the identity.
  with generic_cold(cold):
    z = reshard(y, a, method=method)
  assert bits(z) == before and z.sharding == a, (z.sharding, a)


def test_layouts_match_jax_for_zero_size_dims():
  mesh = Mesh(np.array(DEVS[:4]).reshape(2, 2), ("x", "y"))
  s = NamedSharding(mesh, P("x", "y"))
  from tenplex_jax.layout import named_layout
  t = named_layout("t", (0, 4), "float32", mesh_shape={"x": 2, "y": 2},
                   spec=("x", "y"), device_ids=[d.id for d in DEVS[:4]])
  assert t.placement == placement_of(s, (0, 4))


def mesh24():
  return Mesh(np.array(DEVS).reshape(2, 4), ("data", "tensor"))


def test_every_dtype_and_keys_and_scalars():
  m1 = mesh24()
  m2 = Mesh(np.array(DEVS[::-1][:4]).reshape(4, 1), ("data", "tensor"))
  tree = {f"d{i}": make((8, 4), dt, NamedSharding(m1, P("data", "tensor")))
          for i, dt in enumerate(DTYPES)}
  tree["scalar"] = jax.device_put(jnp.float32(3.0), NamedSharding(m1, P()))
  tree["empty"] = jax.device_put(jnp.zeros((0, 4)),
                                 NamedSharding(m1, P(None, "tensor")))
  tree["keys"] = jax.device_put(jax.random.split(jax.random.key(1), 8),
                                NamedSharding(m1, P("data")))
  tree["key"] = jax.random.key(3)
  tree["step"] = 7
  tree["name"] = "not an array"
  target = {k: (None if not isinstance(v, jax.Array) else
                NamedSharding(m2, P("data")) if v.ndim else
                NamedSharding(m2, P())) for k, v in tree.items()}
  for method in ("cpu", "generic"):
    new = reshard(tree, target, method=method)
    for k, v in tree.items():
      if not isinstance(v, jax.Array):
        assert new[k] is v
        continue
      assert bits(new[k]) == bits(v), k
      assert new[k].dtype == v.dtype, k
      assert new[k].sharding.is_equivalent_to(target[k], v.ndim), k



@pytest.mark.parametrize("method", ["cpu", "generic"])
def test_keys_land_on_the_target_sharding_itself(method):
  """PRNG keys resharded onto a one-device mesh come back on the target
  sharding itself, as ``jax.device_put`` puts them (``wrap_key_data`` of
  the key data kept the data's spec there: ``P('a', None)`` for keys on
  ``P('a')``); keys of rank 2 on a shorter spec as ``jax.device_put`` puts
  them too (on the spec padded to their rank)."""
  keys = jax.device_put(jax.random.split(jax.random.key(1), 8),
                        NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)),
                                      P("x")))
  grid = jax.device_put(jax.random.split(jax.random.key(2), (4, 2)),
                        NamedSharding(Mesh(np.array(DEVS[:2]), ("x",)),
                                      P("x")))
  one = Mesh(np.array(DEVS[5:6]), ("a",))
  two = Mesh(np.array(DEVS[2:4]), ("a",))
  target = {"keys": NamedSharding(one, P("a")),
            "grid": NamedSharding(two, P("a"))}
  new = reshard({"keys": keys, "grid": grid}, target, method=method)
  assert new["keys"].sharding == target["keys"], new["keys"].sharding
  for k, v in (("keys", keys), ("grid", grid)):
    assert new[k].sharding == jax.device_put(v, target[k]).sharding, k
    assert new[k].sharding.is_equivalent_to(target[k], v.ndim), k
    assert bits(new[k]) == bits(v), k


@pytest.mark.parametrize("method", ["cpu", "generic"])
def test_nan_payloads_and_signalling_nans_keep_their_bits(method):
  # XLA:CPU quietened bfloat16 and float8_e5m2 NaNs (and dropped bfloat16
  # payloads) where the generic executor sliced or concatenated them.
  pats = {jnp.bfloat16: [0x7F81, 0xFFC1, 0x7FA5, 0x7FC0, 0x3F80, 0x0001],
          jnp.float16: [0x7C01, 0xFE01, 0x7D55, 0x7E00, 0x3C00, 0x0001],
          jnp.float8_e5m2: [0x7D, 0xFD, 0x7E, 0x7F, 0x3C, 0x01],
          jnp.float32: [0x7F800001, 0xFFC00001, 0x7FA00000, 0x7FC00000,
                        0x3F800000, 0x00000001]}
  m8 = Mesh(np.array(DEVS), ("data",))
  m2 = Mesh(np.array(DEVS[5:7]), ("data",))
  cases = [(NamedSharding(m8, P("data")), NamedSharding(m2, P("data"))),
           (SingleDeviceSharding(DEVS[3]), NamedSharding(m8, P("data"))),
           (NamedSharding(m8, P("data")), NamedSharding(mesh24(), P()))]
  for dt, pat in pats.items():
    width = np.dtype(dt).itemsize
    host = np.array(pat * 8, f"<u{width}")[:48].view(dt)
    for src, dst in cases:
      x = jax.device_put(host, src)
      y = reshard(x, dst, method=method)
      assert bits(y) == host.view(np.uint8).tobytes(), (dt, src, dst)
      assert y.sharding.is_equivalent_to(dst, 1)
      assert bits(x) == host.view(np.uint8).tobytes()


def test_ptc_target_round_trips_through_json():
  m1, m2 = mesh24(), Mesh(np.array(DEVS[2:6]).reshape(2, 2), ("a", "b"))
  x = make((8, 8), jnp.float32, NamedSharding(m1, P("data", "tensor")))
  target = {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                      sharding=NamedSharding(m2, P("b", "a")))}
  ptc = PTC.from_json(PTC.from_tree(target).to_json())
  y = reshard({"x": x}, ptc)["x"]
  assert bits(y) == bits(x)
  assert y.sharding.is_equivalent_to(target["x"].sharding, 2)


def test_unchanged_shards_are_reused_without_copy():
  m = mesh24()
  x = make((8, 8), jnp.float32, NamedSharding(m, P("data", "tensor")))
  # Same boxes on the same devices, different mesh object.
  m_same = Mesh(np.array(DEVS).reshape(2, 4), ("d", "t"))
  y, rep = reshard_with_report(x, NamedSharding(m_same, P("d", "t")))
  assert rep.moved_bytes == 0 and rep.reused_shards == 8
  ptr = {s.device.id: s.data.unsafe_buffer_pointer() for s in
         x.addressable_shards}
  for s in y.addressable_shards:
    assert s.data.unsafe_buffer_pointer() == ptr[s.device.id]


def test_shrink_onto_held_boxes_takes_the_kept_path():
  # data 4 -> 2 over devices 0..3: every new device already holds its box.
  m8 = Mesh(np.array(DEVS).reshape(4, 2), ("data", "tensor"))
  m4 = Mesh(np.array(DEVS[:4]).reshape(2, 2), ("data", "tensor"))
  x = make((8, 6), jnp.bfloat16, NamedSharding(m8, P(None, "tensor")))
  k = jax.device_put(jax.random.split(jax.random.key(3), 8),
                     NamedSharding(m8, P(None)))
  tree = {"x": x, "k": k, "step": 7}
  ref = {"x": bits(x), "k": bits(k)}
  ptr = {s.device.id: s.data.unsafe_buffer_pointer() for s in
         x.addressable_shards}
  target = {"x": NamedSharding(m4, P(None, "tensor")),
            "k": NamedSharding(m4, P(None)), "step": None}
  out, rep = reshard_with_report(tree, target, donate=True)
  assert rep.method == "kept" and rep.plan is None
  assert rep.moved_bytes == rep.lower_bound_bytes == 0
  assert rep.reused_shards == 8 and rep.n_tensors == 2
  # kept = bytes of the new shards: x on 4 devices (half each), 4 key copies.
  assert rep.local_bytes == 4 * (8 * 3 * 2) + 4 * (8 * 2 * 4)
  assert out["step"] == 7
  for name in ("x", "k"):
    assert out[name].sharding.is_equivalent_to(target[name], out[name].ndim)
    assert bits(out[name]) == ref[name]
  for s in out["x"].addressable_shards:
    assert s.data.unsafe_buffer_pointer() == ptr[s.device.id]
  # The sources are deleted (donate), their kept shards' memory now the
  # results' (the pointers above).
  assert x.is_deleted() and k.is_deleted()


def test_kept_path_is_not_taken_when_a_box_moves():
  m = mesh24()
  x = make((8, 8), jnp.float32, NamedSharding(m, P("data", "tensor")))
  y, rep = reshard_with_report(x, NamedSharding(m, P("tensor", "data")))
  assert rep.method in ("cpu", "generic") and rep.plan is not None
  assert rep.moved_bytes == rep.lower_bound_bytes > 0
  assert bits(y) == bits(x)


def test_donate_frees_source_and_keeps_values():
  m = mesh24()
  x = make((16, 8), jnp.float32, NamedSharding(m, P("data", "tensor")))
  ref = bits(x)
  y = reshard({"x": x}, {"x": NamedSharding(m, P("data", None))},
              donate=True)["x"]
  assert x.is_deleted()
  assert bits(y) == ref
  # Partly reused buffers survive donation.
  x2 = make((16, 8), jnp.float32, NamedSharding(m, P("data", "tensor")))
  ref2 = bits(x2)
  m_half = Mesh(np.array(DEVS[:4]).reshape(1, 4), ("data", "tensor"))
  y2 = reshard(x2, NamedSharding(m_half, P("data", "tensor")), donate=True)
  assert bits(y2) == ref2


_DONATED_AGAIN = """
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tenplex_jax as tj
d = jax.devices()
a = NamedSharding(Mesh(np.array(d), ("a",)), P("a"))
b = NamedSharding(Mesh(np.array(d).reshape(2, 4), ("c", "a")), P("c", "a"))
host = np.arange(64, dtype=np.float32).reshape(8, 8)
f = jax.jit(lambda v: v + 1)
tj.reshard(jax.device_put(host, a), b, method="generic")  # warm programs
x = jax.device_put(host, a)
f(x)  # warm jax's fast path on x
y = tj.reshard(x, b, method="generic", donate=True)
assert x.is_deleted() and (np.asarray(y) == host).all()
for call in (lambda: tj.reshard(x, b, method="generic"), lambda: f(x)):
  try:
    call()
  except RuntimeError as e:
    assert "deleted" in str(e), e
  else:
    raise AssertionError("a donated array was used")
print("ok")
"""


def _run_alone(script: str) -> None:
  """Runs ``script`` in a fresh Python (a crash there fails this test, not
  the worker) and asserts that it printed ``ok``."""
  out = procs.python(script, env={"JAX_PLATFORMS": "cpu"})
  assert out.strip() == "ok", out[-2000:]


def test_donated_array_used_again_raises_not_crashes():
  # Donation that reuses no shard deletes the array itself: deleting only
  # its shards left an array that a warm compiled program (reshard's own
  # cut, or the user's jitted step) took with deleted buffers, a segfault.
  _run_alone(_DONATED_AGAIN)


_DONATED_KEPT = """
import gc
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tenplex_jax as tj
d = np.array(jax.devices())
src = NamedSharding(Mesh(d.reshape(2, 4), ("data", "tensor")), P(None, "tensor"))
# Devices 0-3 keep their shards: every one (the kept path), or 0-3 while
# 4-7 take other column blocks (the executors).
every = NamedSharding(Mesh(d[:4].reshape(1, 4), ("data", "tensor")),
                      P(None, "tensor"))
part = NamedSharding(Mesh(d[[0, 1, 2, 3, 5, 4, 7, 6]].reshape(2, 4),
                          ("data", "tensor")), P(None, "tensor"))
host = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
keys = jax.random.split(jax.random.key(3), 32).reshape(4, 8)
f = jax.jit(lambda v: v + 1)
g = jax.jit(jax.random.key_data)
for target, method in [(every, "auto"), (part, "cpu"), (part, "generic")]:
  for name, make, use in [("array", lambda: jax.device_put(host, src), f),
                          ("keys", lambda: jax.device_put(keys, src), g)]:
    x = make()
    ref = np.asarray(use(x))  # also warms jax's fast path on x
    ptrs = {s.device.id: s.data.unsafe_buffer_pointer()
            for s in x.addressable_shards}
    y, rep = tj.reshard_with_report(x, target, method=method, donate=True)
    where = (name, method, target.mesh.devices.tolist())
    assert rep.reused_shards == 4, (where, rep)
    assert x.is_deleted(), where
    # The devices that keep their shards keep their memory (no copy).
    for s in y.addressable_shards:
      if s.device.id < 4:
        assert s.data.unsafe_buffer_pointer() == ptrs[s.device.id], where
    eager = ((lambda v: np.asarray(jax.random.key_data(v)))
             if name == "keys" else np.asarray)
    for call in (lambda: use(x), lambda: eager(x),
                 lambda: tj.reshard(x, src)):
      try:
        call()
      except RuntimeError as e:
        assert "deleted" in str(e), (where, e)
      else:
        raise AssertionError(f"{where}: a donated array was used")
    del x
    gc.collect()
    assert y.sharding == target and np.array_equal(np.asarray(use(y)), ref), where
print("ok")
"""


def test_donated_array_whose_devices_keep_their_shards_is_deleted():
  # A donated array some of whose shards the result keeps was left with
  # only its other shards deleted: not reported deleted (jax looks at the
  # first shard), and a jitted call on it crashed the process (XLA:CPU,
  # jax 0.10.2: "Buffer has been deleted or donated", then a segfault).
  # Now the kept shards' memory passes to the result and the array itself
  # is deleted, as jax's own donation leaves it.
  _run_alone(_DONATED_KEPT)


@pytest.mark.parametrize("method", ["cpu", "generic"])
def test_donate_host_memory_source_under_two_paths(method):
  # A pinned_host source under two paths, or already on its (host) target:
  # moved to device memory once, deleted only after every result is built,
  # and returned itself where it is already on its target.
  m4 = Mesh(np.array(DEVS[:4]), ("a",))
  h = NamedSharding(m4, P("a"), memory_kind="pinned_host")
  t = NamedSharding(mesh24(), P("tensor"))
  for paths in (("t", "t"), ("h",), ("h", "t"), ("h", "h")):
    x = make((8, 4), jnp.float32, h)
    ref = bits(x)
    target = {f"p{i}": h if p == "h" else t for i, p in enumerate(paths)}
    out = reshard({f"p{i}": x for i in range(len(paths))}, target,
                  donate=True, method=method)
    for k, v in out.items():
      assert bits(v) == ref
      assert v.sharding.is_equivalent_to(target[k], 2)
      assert v.sharding.memory_kind == target[k].memory_kind
      if target[k] == h:
        assert v is x
    assert x.is_deleted() == ("h" not in paths)


@pytest.mark.parametrize("method", ["cpu", "generic"])
@pytest.mark.parametrize("n", [8, 0])
def test_donate_keys_whose_devices_keep_their_shards(method, n):
  # Replicated keys from 4 devices onto 8 (and zero-size keys, whose empty
  # boxes every device "keeps"): the kept shards are the new array's, so
  # donation must not delete the key array that shares them.
  k = jax.random.split(jax.random.key(0), max(n, 1))[:n]
  x = jax.device_put(k, NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P()))
  ref = bits(x)
  t = NamedSharding(Mesh(np.array(DEVS), ("a",)), P())
  y = reshard({"k": x}, {"k": t}, donate=True, method=method)["k"]
  assert not y.is_deleted()
  assert bits(y) == ref and y.sharding.is_equivalent_to(t, 1)
  assert jax.random.key_impl(y) == jax.random.key_impl(k)


_TWO_BIT = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tenplex_jax as tj
d = jax.devices()
a = NamedSharding(Mesh(np.array(d).reshape(2, 4), ("b", "a")), P("a"))
t = NamedSharding(Mesh(np.array(d[:4]), ("a",)), P(None, "a"))
for dt in (jnp.int2, jnp.uint2):
  host = (np.arange(32) % 2).astype(dt).reshape(4, 4, 2)
  for donate in (False, True):
    x = jax.device_put(host, a)
    y = tj.reshard(x, t, method="generic", donate=donate)
    assert (np.asarray(y).astype(np.int8) == host.astype(np.int8)).all()
    assert y.sharding.is_equivalent_to(t, 3) and x.is_deleted() == donate
# jax.device_put between these (a fallback tried) gave wrong shards and
# corrupted the C heap.
a = NamedSharding(Mesh(np.array(d)[[7, 1, 0, 6, 3, 2, 4, 5]].reshape(2, 2, 2),
                       ("c", "b", "a")), P(None, ("c", "b"), "a"))
t = NamedSharding(Mesh(np.array(d)[[5, 3, 4, 0, 1, 6, 2, 7]].reshape(1, 8),
                       ("b", "a")), P("b"))
host = np.random.default_rng(0).integers(0, 4, (4, 4, 4)).astype(jnp.uint2)
y = tj.reshard(jax.device_put(host, a), t, method="generic")
assert (np.asarray(y).astype(np.int8) == host.astype(np.int8)).all()
for s in y.addressable_shards:
  assert (np.asarray(s.data).astype(np.int8)
          == host[s.index].astype(np.int8)).all()
print("ok")
"""


def test_generic_two_bit_dtypes():
  # XLA's CPU code generator aborts the process compiling a slice of int2
  # or uint2 (jaxlib 0.10); the generic executor assembles them on the
  # host, without a program (nor jax.device_put, wrong for them).
  _run_alone(_TWO_BIT)


@pytest.mark.parametrize("method", ["cpu", "generic"])
def test_host_memory_scalar_key_wrapped_from_sharded_data(method):
  # wrap_key_data of data sharded P(None) gives a rank-0 key whose sharding
  # keeps P(None); jax.device_put takes it, and so must the move out of
  # pinned_host memory (it put the key onto that sharding and failed).
  m1 = Mesh(np.array(DEVS[:1]), ("a",))
  data = jax.device_put(np.array([1, 2], np.uint32),
                        NamedSharding(m1, P(None), memory_kind="pinned_host"))
  k = jax.random.wrap_key_data(data)
  t = NamedSharding(Mesh(np.array(DEVS[:2]), ("b",)), P(),
                    memory_kind="unpinned_host")
  y = reshard({"k": k}, {"k": t}, method=method)["k"]
  assert bits(y) == bits(k) == np.array([1, 2], np.uint32).tobytes()
  assert y.sharding.memory_kind == "unpinned_host"
  assert y.sharding.is_equivalent_to(t, 0)


def test_structure_mismatch_names_the_leaf():
  m = mesh24()
  x = make((8, 8), jnp.float32, NamedSharding(m, P("data")))
  with pytest.raises(LayoutError, match="structure"):
    reshard({"a": x}, {"b": NamedSharding(m, P())})
  with pytest.raises(LayoutError, match="a/w: array float32\\[8, 8\\] has"
                     " target None"):
    reshard({"a": {"w": x}}, {"a": {"w": None}})


def test_partition_spec_target_with_unknown_axis_names_leaf_and_axis():
  # Was jax's bare ValueError from NamedSharding, naming no leaf.
  m = mesh24()
  x = make((8, 4), jnp.float32, NamedSharding(m, P("data")))
  with jax.set_mesh(m):
    with pytest.raises(LayoutError) as e:
      reshard({"layer": {"w": x, "b": x}},
              {"layer": {"w": P(("data", "zz")), "b": P()}})
    assert str(e.value) == (
        "cannot reshard:\n  layer/w: target PartitionSpec(('data', 'zz'),)"
        " names mesh axes ['zz'] that the mesh {'data': 2, 'tensor': 4}"
        " lacks")
    with pytest.raises(LayoutError, match=r"layer/w: target PartitionSpec"
                       r"\('data', 'data'\) is invalid: .*duplicate"):
      reshard({"layer": {"w": x}}, {"layer": {"w": P("data", "data")}})

def test_indivisible_target_names_leaf_and_numbers():
  m = mesh24()
  x = make((6, 8), jnp.float32, NamedSharding(m, P(None, "tensor")))
  with pytest.raises(LayoutError) as e:
    reshard({"layer": {"w": x}}, {"layer": {"w": NamedSharding(m, P("tensor"))}})
  msg = str(e.value)
  assert "layer/w" in msg and "6" in msg and "4" in msg


def test_ptc_target_errors_name_leaf_and_numbers():
  m = mesh24()
  x = make((8, 8), jnp.float32, NamedSharding(m, P("data")))
  other = {"x": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16,
                                     sharding=NamedSharding(m, P()))}
  with pytest.raises(LayoutError, match=r"x: array is float32\[8, 8\], target"
                     r" layout is bfloat16\[8, 4\]"):
    reshard({"x": x}, PTC.from_tree(other))
  # A layout naming a device that does not exist.
  good = PTC.from_tree({"x": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=SingleDeviceSharding(DEVS[1]))})
  bad = PTC.from_json(good.to_json().replace('"device": 1', '"device": 99'))
  with pytest.raises(LayoutError, match="x: layout names device 99"):
    reshard({"x": x}, bad)


def test_axis_not_in_mesh_is_an_error():
  from tenplex_jax.layout import named_layout
  with pytest.raises(LayoutError, match="axis 'expert'"):
    named_layout("moe/w", (8,), "float32", mesh_shape={"data": 2},
                 spec=("expert",))


def test_failure_midway_leaves_source_intact(monkeypatch):
  m = mesh24()
  m2 = Mesh(np.array(DEVS[4:]).reshape(2, 2), ("data", "tensor"))
  tree = {f"w{i}": make((8, 8), jnp.float32,
                        NamedSharding(m, P("data", "tensor")), seed=i)
          for i in range(4)}
  ref = {k: bits(v) for k, v in tree.items()}
  rmod = importlib.import_module("tenplex_jax.reshard")
  real = rmod._make_array
  calls = {"n": 0}

  def flaky(*a, **k):
    calls["n"] += 1
    if calls["n"] == 3:
      raise RuntimeError("injected transfer failure")
    return real(*a, **k)

  monkeypatch.setattr(rmod, "_make_array", flaky)
  with pytest.raises(ReshardError, match="w2: resharding failed: injected"):
    reshard(tree, {k: NamedSharding(m2, P("tensor")) for k in tree})
  for k, v in tree.items():
    assert not v.is_deleted() and bits(v) == ref[k]


def test_public_names_resolve():
  for name in tj.__all__:
    assert getattr(tj, name) is not None


@pytest.mark.parametrize("method", ["cpu", "generic"])
def test_memory_kinds_change_with_the_layout(method):
  # Offloaded state (pinned_host) resharded onto device memory and back,
  # on a new mesh, keys included.
  m8 = Mesh(np.array(DEVS).reshape(4, 2), ("data", "tensor"))
  m2 = Mesh(np.array(DEVS[2:6]).reshape(2, 2), ("data", "tensor"))
  x = make((8, 6), jnp.bfloat16, NamedSharding(m8, P("data", "tensor")))
  k = jax.device_put(jax.random.split(jax.random.key(1), 8),
                     NamedSharding(m8, P("data")))
  ref = {"x": bits(x), "k": bits(k)}
  to_host = {"x": NamedSharding(m2, P(None, "tensor"),
                                memory_kind="pinned_host"),
             "k": NamedSharding(m2, P("tensor"), memory_kind="pinned_host")}
  h = reshard({"x": x, "k": k}, to_host, method=method)
  back = {"x": NamedSharding(m8, P("tensor", None)),
          "k": NamedSharding(m8, P(None))}
  d = reshard(h, back, method=method)
  for name in ("x", "k"):
    assert h[name].sharding.memory_kind == "pinned_host"
    assert h[name].sharding.is_equivalent_to(to_host[name], h[name].ndim)
    assert d[name].sharding.memory_kind == "device"
    assert d[name].sharding.is_equivalent_to(back[name], d[name].ndim)
    assert bits(h[name]) == ref[name] and bits(d[name]) == ref[name]
