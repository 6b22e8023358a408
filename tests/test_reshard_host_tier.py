"""The generic executor's host tier: a cold call compiles nothing (arrays
whose device programs are not compiled yet are built through the host), a
transition that repeats has its programs compiled in the background, and
the calls after that run them; every call bitwise and on the target."""

import importlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tenplex_jax as tj

rmod = importlib.import_module("tenplex_jax.reshard")
DEVS = jax.devices()
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
  """Counts XLA compilations of the calls inside it (jax's monitoring
  events, reported on the compiling thread); background compiles queued
  before are waited for first, and the background thread's are not counted
  (one queued inside may finish before the block ends)."""

  def __init__(self):
    self.n = 0

  def __call__(self, event, duration, **kw):
    if (event == COMPILE_EVENT
        and threading.current_thread().name != "tenplex-recompile"):
      self.n += 1

  def __enter__(self):
    assert rmod._wait_recompiles(60.0)
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)


@pytest.fixture(autouse=True)
def _cold(monkeypatch):
  """Each test starts with the executor's caches empty (another test in the
  same process may have compiled the same programs) and the host tier on,
  on CPU devices as on accelerators (whose device programs are compiled in
  the background for a transition that repeats; see ``_HOST_ONLY``)."""
  assert rmod._wait_recompiles(60.0)
  monkeypatch.setenv("TENPLEX_JAX_GENERIC_COLD", "host")
  monkeypatch.setattr(rmod, "_HOST_ONLY", frozenset())
  for cache in (rmod._GROUP_EXES, rmod._programs, rmod._compile_queued,
                rmod._TRANSITIONS, rmod._SCHEDULES):
    cache.clear()
  yield
  assert rmod._wait_recompiles(60.0)


def _bits(x):
  return np.asarray(x).reshape(-1).view(np.uint8).tobytes()


def _state(seed=0, n_packed=12, prefix="w"):
  """Arrays of several classes: ``n_packed`` f32 and a few bf16 of one class
  (moved in packed groups), two int8 of a class of their own (moved per
  device) and a replicated scalar."""
  a = Mesh(np.array(DEVS).reshape(2, 4), ("a", "b"))
  b = Mesh(np.array(DEVS[::-1][:4]).reshape(4, 1), ("a", "b"))
  rng = np.random.default_rng(seed)
  hosts, src, dst = {}, {}, {}
  for i in range(n_packed):
    hosts[f"{prefix}{i}"] = rng.standard_normal(
        (64, 32 * (1 + i % 3))).astype(np.float32)
    src[f"{prefix}{i}"] = NamedSharding(a, P(None, "b"))
    dst[f"{prefix}{i}"] = NamedSharding(b, P("a", None))
  for i in range(4):
    h = rng.standard_normal((32, 16)).astype(jnp.bfloat16)
    h.view(np.uint16)[0, :3] = [0x7F81, 0xFFC1, 0x7FA5]  # NaN payloads
    hosts[f"{prefix}h{i}"] = h
    src[f"{prefix}h{i}"] = NamedSharding(a, P("a", "b"))
    dst[f"{prefix}h{i}"] = NamedSharding(b, P(None, "a"))
  for i in range(2):
    hosts[f"{prefix}q{i}"] = rng.integers(-128, 128, (8, 24)).astype(np.int8)
    src[f"{prefix}q{i}"] = NamedSharding(a, P("a", None))
    dst[f"{prefix}q{i}"] = NamedSharding(b, P(None, "a"))
  hosts[f"{prefix}s"] = np.float32(3.5)
  src[f"{prefix}s"] = NamedSharding(a, P())
  dst[f"{prefix}s"] = NamedSharding(b, P())
  tree = {k: jax.device_put(v, src[k]) for k, v in hosts.items()}
  return hosts, tree, dst


def _check(out, hosts, target):
  for k, h in hosts.items():
    assert out[k].sharding == target[k], k
    assert _bits(out[k]) == np.asarray(h).reshape(-1).view(np.uint8).tobytes(), k


def test_cold_call_compiles_nothing_and_a_repeat_compiles_in_the_background():
  hosts, tree, target = _state()
  n = len(hosts)
  with Compiles() as c:  # cold: every array through the host
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
  assert (c.n, rep.method, rep.host_staged) == (0, "generic", n)
  assert "through the host" in str(rep)
  _check(out, hosts, target)
  assert not rmod._GROUP_EXES and not rmod._programs
  (tr,) = rmod._TRANSITIONS.values()
  assert tr.device is None  # a one-off call plans no device program
  del out
  # The second call still compiles nothing in the call, through the host
  # again; it queues the programs, compiled on the background thread.
  with Compiles() as c:
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
    assert c.n == 0 and rep.host_staged == n
  _check(out, hosts, target)
  assert tr.device is not None
  assert rmod._wait_recompiles(120.0)
  assert rmod._GROUP_EXES and rmod._programs  # both executors' programs
  # The third call runs them, timed: nothing through the host, nothing
  # compiled. The calls after it take the tier last measured faster.
  with Compiles() as c:
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
  assert (c.n, rep.host_staged) == (0, 0)
  _check(out, hosts, target)
  (times,) = tr.tiers.values()
  assert all(t > 0 for t in times), times
  for _ in range(2):
    host_faster = times[0] < times[1]
    with Compiles() as c:
      out, rep = tj.reshard_with_report(tree, target, method="generic")
      jax.block_until_ready(out)
    assert (c.n, rep.host_staged) == (0, n if host_faster else 0), times
    _check(out, hosts, target)
  # The sources are untouched throughout.
  _check(tree, hosts, {k: v.sharding for k, v in tree.items()})


def test_compiled_groups_run_on_the_devices_beside_new_ones_on_the_host():
  hosts, tree, target = _state()
  for _ in range(2):
    tj.reshard(tree, target, method="generic")
  assert rmod._wait_recompiles(120.0)
  # New arrays of a class of their own (float16, rank 3): the old classes'
  # groups and per-device batch are what they were, their programs compiled.
  a = Mesh(np.array(DEVS).reshape(2, 4), ("a", "b"))
  b = Mesh(np.array(DEVS[::-1][:4]).reshape(4, 1), ("a", "b"))
  rng = np.random.default_rng(1)
  more_hosts = {f"v{i}": rng.standard_normal((16, 8, 8)).astype(np.float16)
                for i in range(6)}
  more = {k: jax.device_put(v, NamedSharding(a, P(None, "b")))
          for k, v in more_hosts.items()}
  more_target = {k: NamedSharding(b, P("a")) for k in more_hosts}
  both, both_target = {**tree, **more}, {**target, **more_target}
  # The new transition's first call: everything through the host, no
  # device program planned; its second runs the compiled ones.
  for staged in (len(both), len(more)):
    with Compiles() as c:
      out, rep = tj.reshard_with_report(both, both_target, method="generic")
      jax.block_until_ready(out)
    assert (c.n, rep.host_staged) == (0, staged)
    _check(out, {**hosts, **more_hosts}, both_target)


def test_host_tier_donates_its_sources_and_keeps_every_value():
  hosts, tree, target = _state(seed=2)
  out = tj.reshard(tree, target, method="generic", donate=True)
  jax.block_until_ready(out)
  assert all(v.is_deleted() for v in tree.values())
  _check(out, hosts, target)
  # and again from the result, back and forth, donating each time
  back = {k: v.sharding for k, v in tree.items()}
  again = tj.reshard(out, back, method="generic", donate=True)
  assert all(v.is_deleted() for v in out.values())
  _check(again, hosts, back)


def test_compile_switch(monkeypatch):
  hosts, tree, target = _state(seed=3)
  monkeypatch.setenv("TENPLEX_JAX_GENERIC_COLD", "compile")
  with Compiles() as c:
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    jax.block_until_ready(out)
  assert c.n > 0 and rep.host_staged == 0
  _check(out, hosts, target)
  monkeypatch.setenv("TENPLEX_JAX_GENERIC_COLD", "later")
  with pytest.raises(ValueError, match="TENPLEX_JAX_GENERIC_COLD must be"
                     " 'host' or 'compile', not 'later'"):
    tj.reshard(tree, target, method="generic")


def test_a_failed_background_compile_leaves_the_host_tier(monkeypatch):
  hosts, tree, target = _state(seed=4)

  def fail(lowered, platform):
    raise RuntimeError("no compiler here")

  monkeypatch.setattr(rmod, "_compile", fail)
  monkeypatch.setenv("TENPLEX_JAX_RECOMPILE", "0")  # the compiles _compile
  for _ in range(3):
    out, rep = tj.reshard_with_report(tree, target, method="generic")
    assert rmod._wait_recompiles(60.0)
    assert rep.host_staged == len(hosts)
    _check(out, hosts, target)
  assert not rmod._GROUP_EXES and not rmod._programs


def test_cpu_devices_compile_nothing_for_the_host_tier(monkeypatch):
  # On CPU devices the host tier reads the shards in place: it stays the
  # path of every call, and no program is compiled for it.
  monkeypatch.setattr(rmod, "_HOST_ONLY", frozenset({"cpu"}))
  hosts, tree, target = _state(seed=5)
  for _ in range(3):
    with Compiles() as c:
      out, rep = tj.reshard_with_report(tree, target, method="generic")
      jax.block_until_ready(out)
      assert rmod._wait_recompiles(60.0)
    assert (c.n, rep.host_staged) == (0, len(hosts))
    _check(out, hosts, target)
  assert not rmod._GROUP_EXES and not rmod._programs
  assert not rmod._compile_queued
  # planned as the CPU executor plans (by class); the device programs never
  (tr,) = rmod._TRANSITIONS.values()
  assert tr.device is None
  cpu = rmod._Transition.build(
      [(k, tree[k], target[k], None) for k in sorted(tree)], "cpu", ())
  assert len(tr.progs) == len(cpu.progs) == len(tree)
  assert ([(p.boxes, p.alias, p.outs) for p in tr.progs]
          == [(p.boxes, p.alias, p.outs) for p in cpu.progs])
