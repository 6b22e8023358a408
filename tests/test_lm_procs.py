"""examples/lm across processes: ``train.py --procs`` resizes through ``tenplex-jax launch``.

One job of 4 devices: 2 processes x 2 devices (stage 2, data 2), then at step
2 one process x 4 devices (stage 4, 2 microbatches): the train state and the
data iterator's state go through the per-host stores, the layers regroup
from 2 to 4 stages, and the losses stay on the static run's curve (float
reduction order only). The driver runs as a subprocess in its own process
group (the launcher's processes and store servers die with it), killed on
timeout.
"""

import json
import os
import sys

import numpy as np
import pytest

import procs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
ENV.pop("TENPLEX_JAX_STORE_TOKEN", None)

pytestmark = pytest.mark.slow


def test_cross_process_resize_with_stage_change_follows_static_run(tmp):
  out = os.path.join(tmp, "lm.json")
  (run,) = procs.run_all([[sys.executable, os.path.join(ROOT, "examples", "lm", "train.py"),
                           "--procs", "2,1", "--schedule", "0:stage=2,data=2 2:stage=4,mb=2",
                           "--steps", "4", "--fast-compile", "--json", out,
                           "--timeout", "400"]], timeout=450, env=ENV)
  assert run.returncode == 0, run.stdout[-5000:]
  with open(out) as f:
    log = json.load(f)
  el, st = log["elastic"], log["static"]
  assert [r["step"] for r in el] == [0, 1, 2, 3]  # ends at the right step, none repeated
  assert [(r["procs"], r["devices_per_proc"]) for r in el] == [(2, 2), (2, 2), (1, 4), (1, 4)]
  assert [r["mesh"]["stage"] for r in el] == [2, 2, 4, 4]
  assert [r["microbatches"] for r in el] == [4, 4, 2, 2]
  (resized,) = [r for r in el if "resized_from" in r]
  assert resized["step"] == 2 and resized["procs_from"] == 2
  assert resized["resized_from"] == {"data": 2, "fsdp": 1, "tensor": 1, "stage": 2}
  # The new process read the whole state (params, Adam moments) from the stores.
  assert resized["reconfig_bytes"] >= 3 * 4 * sum(
      int(np.prod(s)) for s in _param_shapes()), resized
  assert resized["reconfig_s"] >= resized["restore_s"] > 0
  np.testing.assert_allclose([r["loss"] for r in el], [r["loss"] for r in st], rtol=1e-5)
  assert log["max_abs_loss_diff"] < 1e-4 and log["max_abs_param_diff"] < 1e-5
  assert "1 resizes across processes" in run.stdout
  assert "generation 0: 2 -> 1 processes at step 2" in run.stdout


def _param_shapes():
  sys.path.insert(0, os.path.join(ROOT, "examples", "lm"))
  import config
  import jax
  from model import abstract_params
  return [x.shape for x in jax.tree.leaves(abstract_params(config.TINY))]
