"""Every ``Source`` runs one contract (issue 25 item 5): the store's round
(``StoreSource``), one process's snapshot (``StoreCopy``) and Orbax
checkpoints (``OrbaxSource``, OCDBT on and off).

The contract: ``tensors()`` names every saved array with its shape and
dtype; each tensor's boxes lie inside its shape, are pairwise disjoint and
tile it (a ``StoreCopy`` holds one process's boxes, so they only have to be
disjoint); any sub-box of a held box reads (``read_into`` and
``read_async``) to the saved values, also into another numeric dtype; and
nothing that reads writes (the files' bytes and times are unchanged).
"""

import hashlib
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax.orbax import OrbaxSource
from tenplex_jax.sources import Source
from tenplex_jax.store import HostStore
from tenplex_jax.store.format import round_id
from tenplex_jax.store.source import StoreCopy, StoreSource


def _state():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  w = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) / 7
  e = (np.arange(6 * 4) % 11).astype(np.int8).reshape(6, 4)
  b = (np.arange(10, dtype=np.float32) - 3).astype(jnp.bfloat16)
  state = {
      "w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
      "e": jax.device_put(e, NamedSharding(mesh, P(None, "a"))),
      "b": jax.device_put(b, NamedSharding(mesh, P())),
  }
  return state, {"w": w, "e": e, "b": np.asarray(b)}


def _digest(root):
  h = hashlib.sha256()
  for d, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for f in sorted(files):
      p = os.path.join(d, f)
      st = os.stat(p)
      h.update(f"{os.path.relpath(p, root)} {st.st_mtime_ns}".encode())
      with open(p, "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def _store(tmp):
  state, want = _state()
  d = str(tmp / "store")
  tj.store.save(state, d, step=3)
  return d, want


@pytest.fixture(params=["store_round", "store_copy", "orbax_ocdbt",
                        "orbax_plain"])
def source(request, tmp_path):
  """(a fresh Source, the saved values, its root, whether its boxes tile)"""
  kind = request.param
  if kind.startswith("store"):
    d, want = _store(tmp_path)
    if kind == "store_round":
      return (lambda: StoreSource(d)), want, d, True
    h = HostStore(d)
    m = h.manifest(0)
    return (lambda: StoreCopy(d, h, 0, round_id(m), m)), want, d, False
  state, want = _state()
  d = str(tmp_path / "ck")
  c = ocp.PyTreeCheckpointer(use_ocdbt=kind == "orbax_ocdbt")
  c.save(d, state)
  c.close()
  return (lambda: OrbaxSource(d)), want, d, True


def _sub_boxes(box, rng):
  """The whole box, one cell, and a random sub-box."""
  yield box
  yield tuple((lo, lo + 1) for lo, _ in box)
  sub = []
  for lo, hi in box:
    a = int(rng.integers(lo, hi))
    b = int(rng.integers(a + 1, hi + 1))
    sub.append((a, b))
  yield tuple(sub)


def test_every_source_runs_the_contract(source):
  make, want, root, tiles = source
  before = _digest(root)
  rng = np.random.default_rng(0)
  with make() as src:
    assert isinstance(src, Source)
    held = src.tensors()
    assert set(held) <= set(want) and held, (sorted(held), sorted(want))
    if tiles:
      assert set(held) == set(want)
    for path, t in held.items():
      ref = want[path]
      assert t.shape == ref.shape, (path, t.shape, ref.shape)
      assert np.dtype(t.dtype) == ref.dtype, (path, t.dtype, ref.dtype)
      assert t.boxes, path
      for box in t.boxes:
        assert len(box) == len(t.shape)
        assert all(0 <= lo < hi <= n for (lo, hi), n in zip(box, t.shape)), \
            (path, box, t.shape)
      for x, y in itertools.combinations(t.boxes, 2):
        assert any(min(b1, b2) <= max(a1, a2)
                   for (a1, b1), (a2, b2) in zip(x, y)), (path, x, y)
      if tiles:
        assert sum(math.prod(hi - lo for lo, hi in b) for b in t.boxes) \
            == math.prod(t.shape), (path, t.boxes)
      for box in t.boxes:
        for sub in _sub_boxes(box, rng):
          idx = tuple(slice(lo, hi) for lo, hi in sub)
          shape = tuple(hi - lo for lo, hi in sub) + t.extra
          out = np.empty(shape, t.storage)
          src.read_into(path, sub, out)
          np.testing.assert_array_equal(out.view(ref.dtype), ref[idx],
                                        err_msg=f"{path} {sub}")
          out2 = np.zeros(shape, t.storage)
          src.read_async(path, sub, out2).result()
          np.testing.assert_array_equal(out2, out, err_msg=f"{path} {sub}")
          if np.issubdtype(ref.dtype, np.floating) or \
              np.issubdtype(ref.dtype, np.integer):
            as64 = np.empty(shape, np.float64)
            src.read_into(path, sub, as64)
            np.testing.assert_array_equal(
                as64, ref[idx].astype(np.float64), err_msg=f"{path} {sub}")
  assert _digest(root) == before, "reading changed the source's files"
