"""The example trainers run and follow the run that never resized."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_elastic_transformer_example():
  out = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "elastic_transformer.py"),
       "--steps", "8"], capture_output=True, text=True, timeout=300,
      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "re-meshed onto stage=1 x data=1 x fsdp=4 x tensor=1" in out.stdout
  diff = float(re.search(r"max \|elastic - static\| = (\S+)",
                         out.stdout).group(1))
  final, first = map(float, re.search(r"final loss (\S+) \(first (\S+)\)",
                                      out.stdout).groups())
  assert diff < 1e-4 and final < first
