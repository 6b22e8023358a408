"""A store server process imports no jax: it only serves chunks."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tenplex_jax.runtime.launch import _stop_servers
from tenplex_jax.store.server import RemoteStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported(importtime_log: str) -> list[str]:
  """The modules a ``python -X importtime`` log names."""
  mods = []
  for line in importtime_log.splitlines():
    if line.startswith("import time:") and "|" in line:
      name = line.rsplit("|", 1)[1].strip()
      if name != "imported package":  # the header line
        mods.append(name)
  return mods


def test_store_serve_imports_no_jax(tmp_path):
  """The real ``tenplex-jax store serve`` (what the launcher starts on every
  host) reaches its ready file and answers a chunk read, a bfloat16
  sub-box that reads back bitwise, without ever importing jax."""
  import jax
  import ml_dtypes
  from tenplex_jax import store
  root = str(tmp_path / "s")
  x = (np.arange(24, dtype=np.float32).reshape(6, 4) / 7).astype(
      ml_dtypes.bfloat16)
  store.save({"w": jax.device_put(x, jax.devices()[0])}, root)
  ready, log = tmp_path / "ready", tmp_path / "importtime.log"
  env = {k: v for k, v in os.environ.items()
         if k not in ("TENPLEX_JAX_STORE_TOKEN", "TENPLEX_JAX_STORE_CA")}
  env["PYTHONPATH"] = ROOT
  with open(log, "w") as err, open(tmp_path / "stdout", "w") as out:
    p = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "tenplex_jax", "store",
         "serve", "--dir", root, "--port", "0", "--ready-file", str(ready)],
        env=env, cwd=tmp_path, stdout=out, stderr=err,
        start_new_session=True)  # cwd: ``-m`` puts it first on sys.path
  try:
    deadline = time.monotonic() + 120
    while not ready.exists():
      assert p.poll() is None, (p.returncode, log.read_text()[-3000:])
      assert time.monotonic() < deadline, "no ready file after 120 s"
      time.sleep(0.05)
    with RemoteStore(f"http://{ready.read_text()}") as rs:
      a = rs.read_storage("w", ((1, 5), (2, 4)), proc=0)
  finally:
    _stop_servers([p], grace=30)  # the launcher's stop: SIGTERM, SIGKILL, reap
  assert a.dtype.itemsize == 2 and a.shape == (4, 2)
  np.testing.assert_array_equal(a.view(np.uint16),
                                x[1:5, 2:].view(np.uint16))
  mods = _imported(log.read_text())
  assert "tenplex_jax.store.server" in mods  # the log is the server's
  assert [m for m in mods if m == "jax" or m.startswith("jax.")] == []


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
