"""store.api.allocate_ahead: the arrays a prepared Ray (or launcher) worker
allocates before its turn are the ones the restore reads into."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tenplex_jax.store import api


def _state(mesh):
  sh, rep = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P())
  w = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), sh)
  b = jax.device_put(np.arange(64, dtype=np.int32) - 7, rep)
  return {"w": w, "b": b, "key": jax.random.key(3), "note": "x"}


def _target(state):
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
      if isinstance(a, jax.Array) else a, state)


def _pointers(arr):
  return {s.device.id: s.data.unsafe_buffer_pointer()
          for s in arr.addressable_shards}


def test_restore_reads_into_the_arrays_allocated_ahead(tmp, monkeypatch):
  # The restore reads straight into XLA's arrays from this many bytes.
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1)
  save_mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  state = _state(save_mesh)
  api.save(state, tmp, step=5)
  new_mesh = Mesh(np.array(jax.devices()[2:6]), ("d",))
  target = _target(_state(new_mesh))
  n = api.allocate_ahead(target)
  # w (8 KiB) and b (256 B on each of 4 devices); the PRNG key is not
  # allocated ahead (it is restored as key data).
  assert n == 64 * 32 * 4 + 4 * 64 * 4, n
  ahead = dict(api._AHEAD)
  assert set(ahead) == {"w", "b"}
  want = {k: _pointers(v) for k, v in ahead.items()}
  got = api.restore(tmp, target)
  assert api._AHEAD == {}  # used up
  for k in ("w", "b"):
    assert got[k].sharding == target[k].sharding
    assert _pointers(got[k]) == want[k], k  # the same buffers
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))
  assert jnp.array_equal(jax.random.key_data(got["key"]),
                         jax.random.key_data(state["key"]))
  assert got["note"] == "x"


def test_arrays_allocated_ahead_for_another_layout_are_not_used(
    tmp, monkeypatch):
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1)
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  state = _state(mesh)
  api.save(state, tmp, step=5)
  other = Mesh(np.array(jax.devices()[4:8]), ("d",))
  api.allocate_ahead(_target(_state(other)))
  stale = {k: _pointers(v) for k, v in api._AHEAD.items()}
  target = _target(state)
  got = api.restore(tmp, target)
  assert api._AHEAD == {}
  for k in ("w", "b"):
    assert got[k].sharding == target[k].sharding
    assert _pointers(got[k]) != stale[k]
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))


def test_small_states_allocate_nothing_ahead(tmp):
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  assert api.allocate_ahead(_target(_state(mesh))) == 0
  assert api._AHEAD == {}
  assert api.allocate_ahead(None) == 0
