"""A small restore's fixed costs (issue 26, item 1, small states): what a
fresh process imports for ``tenplex_jax.orbax.restore``, the package's names
once loaded on first use, and the decode threads a small restore runs
(one below 8 MiB in flight), with values bitwise equal and shardings equal
to the target.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import procs
import tenplex_jax as tj
from tenplex_jax import orbax as tor
from tenplex_jax.orbax import _read


# Modules a local restore does not use, which importing every part of the
# package eagerly loaded (0.3-0.5 s in a fresh process).
_NOT_FOR_A_RESTORE = ("fsspec", "rich", "orbax.checkpoint",
                      "tenplex_jax.reshard", "tenplex_jax.store",
                      "tenplex_jax.data", "tenplex_jax.search",
                      "tenplex_jax.determinism", "tenplex_jax.jobarray",
                      "tenplex_jax.orbax._convert")


def _fresh(code: str) -> dict:
  """The JSON that ``code``, run in a fresh Python, prints last."""
  return json.loads(procs.python(code).strip().splitlines()[-1])


def test_restore_imports_only_what_it_uses(tmp_path):
  """A fresh process that imports ``tenplex_jax.orbax`` and restores a
  local checkpoint loads none of the modules a restore does not use; the
  values come back bitwise."""
  d = str(tmp_path / "ck")
  tor.save({"w": jnp.arange(32.0).reshape(8, 4)}, d, step=1)
  got = _fresh(
      "import json, sys, jax, numpy as np\n"
      "import tenplex_jax.orbax as tor\n"
      "after_import = sorted(m for m in %r if m in sys.modules)\n"
      "from jax.sharding import SingleDeviceSharding as S\n"
      "s = S(jax.devices()[0])\n"
      "out = tor.restore(%r, {'w': jax.ShapeDtypeStruct((8, 4), np.float32,"
      " sharding=s)})\n"
      "print(json.dumps({'after_import': after_import, 'after_restore':"
      " sorted(m for m in %r if m in sys.modules),"
      " 'w': np.asarray(out['w']).tolist()}))"
      % (_NOT_FOR_A_RESTORE, d, _NOT_FOR_A_RESTORE))
  assert got["after_import"] == [] and got["after_restore"] == [], got
  assert got["w"] == np.arange(32.0).reshape(8, 4).tolist()


def test_package_names_load_on_first_use():
  """Every exported name resolves in a fresh process; the functions named
  like their module (``reshard``, ``remesh``, ``pipeline``) stay the
  functions once their modules are imported, as with the eager imports."""
  got = _fresh(
      "import json, sys, types\n"
      "import tenplex_jax as tj\n"
      "import tenplex_jax.reshard, tenplex_jax.remesh, tenplex_jax.pipeline\n"
      "bad = [n for n in tj.__all__ if getattr(tj, n) is None]\n"
      "mods = [n for n in ('reshard', 'remesh', 'pipeline')"
      " if isinstance(getattr(tj, n), types.ModuleType)]\n"
      "subs = [n for n in ('assembly', 'data', 'determinism', 'jobarray',"
      " 'orbax', 'search', 'sources', 'store')"
      " if not isinstance(getattr(tj, n), types.ModuleType)]\n"
      "from tenplex_jax import reshard_with_report, PTC, UsageError\n"
      "print(json.dumps({'bad': bad, 'mods': mods, 'subs': subs,"
      " 'callable': callable(tj.reshard) and callable(tj.remesh),"
      " 'sys': type(sys.modules['tenplex_jax.reshard']).__name__}))")
  assert got == {"bad": [], "mods": [], "subs": [], "callable": True,
                 "sys": "module"}, got
  # In this process too (the suite imported everything already).
  assert callable(tj.reshard) and callable(tj.pipeline)
  assert set(tj.__all__) <= set(dir(tj))
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    tj.nope  # noqa: B018
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    tor.nope  # noqa: B018


def test_convert_names_load_on_first_use():
  assert tor.convert.__module__ == "tenplex_jax.orbax._convert"
  assert {"convert", "scan_mapping", "unscan_mapping",
          "MappedSource"} <= set(tor.__all__)
  assert callable(tor.scan_mapping) and isinstance(tor.MappedSource, type)


def test_decode_threads_by_bytes_in_flight():
  """One decode thread per whole 4 MiB in flight, 1 to COPY_THREADS: a
  small state's restore decodes on one thread (each thread keeps its freed
  chunk buffers), a 512 MiB one on 8 as before."""
  mib = 1 << 20
  assert tor._copy_threads(4 * mib) == 1
  assert tor._copy_threads(tor._inflight(84 * mib)) == 1  # 5.25 MiB
  assert tor._copy_threads(tor._inflight(189 * mib)) == 2  # 11.8 MiB
  assert tor._copy_threads(16 * mib) == 4
  assert tor._copy_threads(tor._inflight(512 * mib)) == min(
      8, _read.COPY_THREADS)
  assert tor._copy_threads(1 << 40) == _read.COPY_THREADS


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
  """A 0.5 MB state, row-sharded over 8 devices, saved by stock Orbax."""
  d = str(tmp_path_factory.mktemp("small") / "ck")
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  k = jax.random.split(jax.random.key(3), 4)
  tree = {"kernel": jax.random.normal(k[0], (256, 384), jnp.float32),
          "out": jax.random.normal(k[1], (128, 256), jnp.bfloat16),
          "table": jax.random.randint(k[2], (64, 128), -128, 127, jnp.int8),
          "bias": jax.random.normal(k[3], (384,), jnp.float32)}
  tree = jax.device_put(tree, NamedSharding(mesh, P("fsdp")))
  opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(d, options=opts) as m:
    m.save(1, args=ocp.args.StandardSave(tree))
    m.wait_until_finished()
  return d, jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("layout", ["rows8", "cols4", "blocks2x2",
                                    "replicated3"])
def test_small_restore_on_one_decode_thread(small_ckpt, layout,
                                            monkeypatch):
  """The small state's restore opens its source with one decode thread and
  gives the saved values bitwise, on the target's shardings."""
  d, saved = small_ckpt
  seen = []
  real = _read.OrbaxSource.__init__

  def spy(self, *a, **kw):
    seen.append(kw.get("copy_threads"))
    real(self, *a, **kw)

  monkeypatch.setattr(_read.OrbaxSource, "__init__", spy)
  shape, names, spec = {
      "rows8": ((8,), ("fsdp",), lambda nd: P("fsdp")),
      "cols4": ((4,), ("t",), lambda nd: P(*([None] * (nd - 1)), "t")),
      "blocks2x2": ((2, 2), ("a", "b"),
                    lambda nd: P("a", "b") if nd == 2 else P(("a", "b"))),
      "replicated3": ((3,), ("x",), lambda nd: P()),
  }[layout]
  n = int(np.prod(shape))
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, spec(v.ndim))) for k, v in saved.items()}
  out = tor.restore(d, target)
  assert seen == [1]
  for k, t in target.items():
    assert out[k].sharding == t.sharding, k
    got = np.asarray(out[k])
    assert got.dtype == saved[k].dtype, k
    assert got.tobytes() == saved[k].tobytes(), k
    for s in out[k].addressable_shards:
      assert np.asarray(s.data).tobytes() == got[s.index].tobytes(), k


@pytest.mark.parametrize("first", ["tenplex_jax.runtime.launch",
                                   "tenplex_jax.runtime.env",
                                   "tenplex_jax.cli"])
def test_a_part_imported_first_loads(first):
  """With the package's parts loaded on first use, the launcher (whose
  names the store's face re-exports) imports first in a fresh process, as
  when ``import tenplex_jax`` loaded the store before it; the CLI builds
  its parser."""
  got = _fresh(
      "import json, importlib\n"
      "m = importlib.import_module(%r)\n"
      "from tenplex_jax.cli import build_parser\n"
      "build_parser()\n"
      "from tenplex_jax.store import RESIZE_EXIT_CODE\n"
      "import tenplex_jax.runtime.launch as rl\n"
      "print(json.dumps({'same': RESIZE_EXIT_CODE == rl.RESIZE_EXIT_CODE}))"
      % first)
  assert got == {"same": True}
