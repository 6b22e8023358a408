"""Test set-up: 8 simulated CPU devices, configured before jax initialises."""

import os
import shutil
import tempfile

# Every temporary file of the run (doctests' mkdtemp, pytest's own tmp_path
# base, subprocesses, Ray's session directories) goes under one directory
# that the run removes at its end, so a run leaves nothing in /tmp. The
# controller makes it; xdist workers and every subprocess inherit TMPDIR.
_SUITE_TMP = None
if "TENPLEX_SUITE_TMP" not in os.environ:
  _SUITE_TMP = tempfile.mkdtemp(prefix="tenplex-suite-")
  os.environ["TENPLEX_SUITE_TMP"] = os.environ["TMPDIR"] = _SUITE_TMP
  tempfile.tempdir = None  # gettempdir() reads TMPDIR again
  # The package's and the examples' bytecode, written once by the controller
  # (as a wheel install does) where it is missing or stale: the suite's
  # several hundred subprocesses (trainers, launchers, store servers, Ray
  # workers) then load it instead of compiling the sources each time, which
  # they do where PYTHONDONTWRITEBYTECODE is set (0.3 s of CPU a process on
  # the 2-core VM, out of its 1.4 s of imports).
  import compileall
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for _d in ("tenplex_jax", "examples"):
    compileall.compile_dir(os.path.join(_ROOT, _d), quiet=1)

# Must run before jax creates its backends; conftest is imported first.
os.environ.setdefault("XLA_FLAGS", "")
# XLA's backend optimisation level 0 (no LLVM code-generation optimisations)
# for every program the tests and their subprocesses compile: the suite is
# CPU-bound and mostly compiling (the README gives its times at both levels).
# It changes no HLO (the fusions, collectives and their order are those of
# the default level), only the machine code. The steps whose bits are the point
# (determinism.jit, jobarray.jit) compile at level 2 whatever the process
# asks (determinism.COMPILER_OPTIONS). JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs
# the suite at the default level.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


import pytest  # noqa: E402


@pytest.fixture
def tmp():
  """A fresh directory in host memory (/dev/shm where there is one), removed
  afterwards: where the multi-process tests put their stores and job dirs."""
  d = tempfile.mkdtemp(prefix="tenplex-test-",
                       dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
  yield d
  shutil.rmtree(d, ignore_errors=True)


# The longest tests (multi-process jobs, local Ray clusters, trainers), run
# first so that with `pytest -n 2` neither worker is left with one of them at
# the end while the other idles.
_LONG_FIRST = ("test_ray.py", "test_ray_share_nothing.py", "test_lm_procs.py",
               "test_examples_nnx.py", "test_jobarray_example.py",
               "test_launch_recovery.py", "test_launch_ahead.py", "test_determinism.py",
               "test_determinism_compose.py", "test_pipeline_lm.py",
               "test_store_multiprocess.py", "test_collective_order.py",
               "test_objstore.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONG_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(_LONG_FIRST)))


def pytest_unconfigure(config):
  if _SUITE_TMP is not None:
    shutil.rmtree(_SUITE_TMP, ignore_errors=True)
