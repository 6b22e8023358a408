"""A store server process imports no jax: it only serves chunks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_server_serves_without_importing_jax(tmp_path):
  """A fresh process imports ``tenplex_jax.store.server``, starts a server
  (what ``tenplex-jax store serve`` runs) and answers a chunk read; jax is
  never imported, and a bfloat16 sub-box reads back bitwise."""
  import jax
  import ml_dtypes
  from tenplex_jax import store
  root = str(tmp_path / "s")
  x = (np.arange(24, dtype=np.float32).reshape(6, 4) / 7).astype(
      ml_dtypes.bfloat16)
  store.save({"w": jax.device_put(x, jax.devices()[0])}, root)
  code = (
      "import json, sys, threading\n"
      "from tenplex_jax.store.server import RemoteStore, make_server\n"
      f"srv = make_server({root!r}, 0)\n"
      "t = threading.Thread(target=srv.serve_forever, daemon=True)\n"
      "t.start()\n"
      "try:\n"
      "  a = RemoteStore('http://%s:%d' % srv.server_address).read_storage(\n"
      "      'w', ((1, 5), (2, 4)), proc=0)\n"
      "finally:\n"
      "  srv.shutdown(); srv.server_close()\n"
      "print(json.dumps({'jax': sorted(m for m in sys.modules"
      " if m == 'jax' or m.startswith('jax.')),"
      " 'bytes': a.tobytes().hex()}))\n")
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  p = subprocess.run([sys.executable, "-c", code], env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["jax"] == []
  assert out["bytes"] == np.ascontiguousarray(x[1:5, 2:]).tobytes().hex()


def test_dtype_of_name_is_jnp_dtype():
  """``dtype_of_name`` (numpy + ml_dtypes) gives what ``jnp.dtype`` gives for
  every dtype jax names, and refuses a name that is not a dtype, also one
  ``ml_dtypes`` has as another attribute (``np.dtype`` of any class is
  ``object``: an upload of dtype ``finfo`` would pass as 8 bytes)."""
  import jax.numpy as jnp
  import ml_dtypes
  from tenplex_jax.store.format import dtype_of_name
  names = ["bool", "int8", "uint32", "float16", "float32", "float64",
           "complex64", "bfloat16", "int4", "uint4", "float8_e4m3fn",
           "float8_e5m2"]
  for name in names:
    assert dtype_of_name(name) == jnp.dtype(name), name
  for name in ("finfo", "iinfo", "__version__", "nonsense"):
    assert hasattr(ml_dtypes, name) or name == "nonsense"
    with pytest.raises(TypeError):
      dtype_of_name(name)
