"""The suite's ``-n 2 --dist loadgroup`` keeps each ``xdist_group`` on one worker.

Several groups exist to share state between their tests (a module's Ray
clusters, a trainer's compiled steps): scattered over the workers, each
worker pays for that state again (the nnx CLI test recompiles for 40 s
instead of 1 s). pytest-xdist 3.8.0 names a group by rewriting the test's
``_nodeid``, which pytest 9.2 no longer reads (pytest-dev/pytest-xdist#1386):
nothing fails, the groups are just ignored. This runs a small suite of its own
under the installed pytest and xdist and checks where its tests ran.
"""

import os
import re
import subprocess
import sys

_SUITE = '''
import pytest


@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
  pass


@pytest.mark.parametrize("i", range(6))
def test_free(i):
  pass
'''


def test_each_group_runs_on_one_worker(tmp_path):
  (tmp_path / "test_groups.py").write_text(_SUITE)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's addopts
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
       "-p", "no:cacheprovider", str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  ran = re.findall(r"\[(gw\d+)\][^\n]* PASSED \S*::(test_\w+)\[\d\]", run.stdout)
  assert len(ran) == 12, run.stdout[-3000:]
  grouped = {w for w, name in ran if name == "test_grouped"}
  assert len(grouped) == 1, (
      "the tests of one xdist_group ran on workers "
      f"{sorted(grouped)}: --dist loadgroup does not group with these pytest and"
      " pytest-xdist versions (pyproject's test extra pins a pair that does)\n"
      + run.stdout[-3000:])
