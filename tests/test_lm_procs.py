"""examples/lm across processes: ``train.py --procs`` resizes through ``tenplex-jax launch``.

One job of 4 devices: 2 processes x 2 devices (stage 2, data 2), then at step
2 one process x 4 devices (stage 4, 2 microbatches): the train state and the
data iterator's state go through the per-host stores, the layers regroup
from 2 to 4 stages, and the losses stay on the static run's curve (float
reduction order only). The driver runs as a subprocess in its own process
group (the launcher's processes and store servers die with it), killed on
timeout.
"""

import os
import sys

import numpy as np
import pytest

import procs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

pytestmark = pytest.mark.slow


def test_cross_process_resize_with_stage_change_follows_static_run(tmp):
  procs.check_stage_change_resize(
      os.path.join(ROOT, "examples", "lm", "train.py"),
      os.path.join(tmp, "lm.json"), root=ROOT,
      n_params=sum(int(np.prod(s)) for s in _param_shapes()))


def _param_shapes():
  sys.path.insert(0, os.path.join(ROOT, "examples", "lm"))
  import config
  import jax
  from model import abstract_params
  return [x.shape for x in jax.tree.leaves(abstract_params(config.TINY))]
