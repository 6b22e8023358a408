"""store.api.compile_restore: the program a prepared Ray (or launcher)
worker's restore allocates its arrays with, compiled before its turn, so
that the restore itself compiles nothing."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

api = importlib.import_module("tenplex_jax.store.api")
from test_reshard_batched import CompileCounter as _Compiles  # noqa: E402


def _state(sh):
  return {"w": jax.device_put(
      np.arange(64 * 48, dtype=np.float32).reshape(64, 48), sh),
          "b": jax.device_put(np.arange(64, dtype=np.int32), sh)}


def _target(state):
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state)


def _saved_2_to_4(tmp, monkeypatch):
  """A state saved at step 3 from 2 devices and its target on 4, with the
  restore reading into arrays it allocates (from 1 KiB) and no zeros
  program cached."""
  old = Mesh(np.array(jax.devices()[:2]), ("x",))
  new = Mesh(np.array(jax.devices()[:4]), ("x",))
  state = _state(NamedSharding(old, P("x")))
  api.save(state, tmp, step=3)
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1024)
  monkeypatch.setattr(api, "_ZEROS", {})
  return state, _target(_state(NamedSharding(new, P("x"))))


def test_restore_after_compile_restore_compiles_nothing(tmp, monkeypatch):
  state, target = _saved_2_to_4(tmp, monkeypatch)
  # The restore's own compiles (other than the zeros program), counted on
  # a first restore: the next one, after compile_restore, has one fewer.
  with _Compiles() as first:
    api.restore_with_report([tmp], target)
  api._ZEROS.clear()
  jax.clear_caches()
  assert api.compile_restore(target)
  assert all(isinstance(f, jax.stages.Compiled) for f in api._ZEROS.values())
  with _Compiles() as c:
    out, report = api.restore_with_report([tmp], target)
  assert c.n == max(first.n - 1, 0)
  assert report.step == 3
  for k in state:
    assert out[k].sharding == target[k].sharding
    assert np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes()


def test_compile_restore_below_the_owned_size_compiles_nothing(monkeypatch):
  monkeypatch.setattr(api, "_ZEROS", {})
  sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
  with _Compiles() as c:
    assert not api.compile_restore(
        {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sh)})
  assert c.n == 0 and not api._ZEROS


def _pointers(tree):
  return {k: sorted(s.data.unsafe_buffer_pointer()
                    for s in a.addressable_shards) for k, a in tree.items()}


def test_restore_into_arrays_allocated_ahead(tmp, monkeypatch):
  # compile_restore(allocate=True): the restore reads into the arrays
  # allocated ahead (the same buffers), runs and compiles no zeros
  # program of its own, and restores the leaves bit for bit.
  state, target = _saved_2_to_4(tmp, monkeypatch)
  monkeypatch.setattr(api, "_AHEAD", {})
  with _Compiles() as first:
    api.restore_with_report([tmp], target)
  api._ZEROS.clear()
  jax.clear_caches()
  assert api.compile_restore(target, allocate=True)
  (ahead,) = api._AHEAD.values()
  want = _pointers(dict(zip(("b", "w"), ahead)))  # the leaves in path order
  # zeros (read through views: np.asarray would cache a copy on the array)
  assert all(not v.any() for a in ahead
             for v in api._writable(a, np.dtype(a.dtype)).values())
  (fn,) = api._ZEROS.values()
  runs = []
  monkeypatch.setitem(api._ZEROS, next(iter(api._ZEROS)),
                      lambda: runs.append(1) or fn())
  del ahead
  with _Compiles() as c:
    out, report = api.restore_with_report([tmp], target)
  assert c.n == max(first.n - 1, 0) and not runs and not api._AHEAD
  assert _pointers(out) == want
  assert report.step == 3
  for k in state:
    assert out[k].sharding == target[k].sharding
    assert np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes()


def _saved_on_2_held_ahead_for_4(tmp, monkeypatch):
  """A state saved at step 1 from 2 devices, and arrays allocated ahead
  (from 1 KiB) for the same leaves on 4 devices: another layout."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  state = _state(NamedSharding(mesh, P("x")))
  api.save(state, tmp, step=1)
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1024)
  monkeypatch.setattr(api, "_ZEROS", {})
  monkeypatch.setattr(api, "_AHEAD", {})
  other = _target(_state(NamedSharding(
      Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))))
  assert api.compile_restore(other, allocate=True) and api._AHEAD
  return state, other


def test_arrays_allocated_ahead_for_another_layout_are_freed(tmp,
                                                              monkeypatch):
  # Held for a layout the restore does not have: dropped before it
  # allocates its own; release_restore drops them when no restore comes.
  state, other = _saved_on_2_held_ahead_for_4(tmp, monkeypatch)
  out = api.restore([tmp], _target(state))
  assert not api._AHEAD
  for k in state:
    assert np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes()
  assert api.compile_restore(other, allocate=True) and api._AHEAD
  api.release_restore()
  assert not api._AHEAD


def test_arrays_allocated_ahead_are_freed_by_a_restore_too_small_to_use_them(
    tmp, monkeypatch):
  # A restore below the owned size reads into no allocated arrays: the
  # ones held for a larger layout are freed all the same, not kept for the
  # process's life.
  state, _ = _saved_on_2_held_ahead_for_4(tmp, monkeypatch)
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1 << 30)
  out = api.restore([tmp], _target(state))
  assert not api._AHEAD
  for k in state:
    assert np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes()
