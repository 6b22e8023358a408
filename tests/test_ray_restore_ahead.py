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


def test_restore_after_compile_restore_compiles_nothing(tmp, monkeypatch):
  old = Mesh(np.array(jax.devices()[:2]), ("x",))
  new = Mesh(np.array(jax.devices()[:4]), ("x",))
  state = _state(NamedSharding(old, P("x")))
  api.save(state, tmp, step=3)
  target = _target(_state(NamedSharding(new, P("x"))))
  monkeypatch.setattr(api, "_OWNED_MIN_BYTES", 1024)
  monkeypatch.setattr(api, "_ZEROS", {})
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
