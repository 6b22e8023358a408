"""examples/lm: the pipelined LM trainer resizes mid-run and stays on the static curve."""

import json

import numpy as np
import pytest

from tenplex_jax.demo import load_lm_trainer

# The module `tenplex-jax demo` runs (one copy: the demo test and this file
# share its compiled steps).
train = load_lm_trainer()
config = train.configs


def test_help_documents_the_contract_flags(capsys):
  with pytest.raises(SystemExit) as e:
    train.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--schedule", "--steps", "--search", "--json", "--plot"):
    assert flag in out


# On the xdist worker of tests/test_cli_and_docs.py's demo test, which then
# runs on the steps compiled here.
@pytest.mark.xdist_group("lm_fast_stage_change")
def test_resize_with_stage_change_follows_static_run(tmp_path, capsys):
  """8 devices (stage 2, data 2, tensor 2) -> 4 devices (stage 4): the layers
  regroup from 2 to 4 stages; losses equal the static run's up to float order."""
  out_json, out_png = tmp_path / "lm.json", tmp_path / "lm.png"
  diff = train.main(["--steps", "4", "--schedule", "0:stage=2,data=2,tensor=2 2:stage=4,mb=2",
                     "--json", str(out_json), "--plot", str(out_png), "--fast-compile"])
  log = json.loads(out_json.read_text())
  el, st = log["elastic"], log["static"]
  assert [r["devices"] for r in el] == [8, 8, 4, 4]
  assert [r["mesh"]["stage"] for r in el] == [2, 2, 4, 4]
  assert [r["microbatches"] for r in el] == [4, 4, 2, 2]
  assert all(r["devices"] == 8 for r in st)
  resized = [r for r in el if "resized_from" in r]
  assert len(resized) == 1 and resized[0]["reconfig_bytes"] > 0 and resized[0]["reconfig_s"] > 0
  np.testing.assert_allclose([r["loss"] for r in el], [r["loss"] for r in st], rtol=1e-5)
  assert diff == log["max_abs_loss_diff"] < 1e-4
  assert "max |elastic - static|" in capsys.readouterr().out
  assert out_png.stat().st_size > 10_000


def test_schedule_parse_errors():
  assert [p.devices for p in config.parse(config.DEFAULT_SCHEDULE)] == [8, 4, 2, 8]
  with pytest.raises(ValueError, match="unknown axis 'pipe'"):
    config.parse("0:pipe=2")
  with pytest.raises(ValueError, match="step 0"):
    config.parse("3:data=2")


def test_deterministic_and_procs_errors(capsys):
  # Rejected before anything compiles or starts (pipeline stages with
  # --deterministic are allowed now: tests/test_determinism_compose.py).
  for argv, words in (
      (["--deterministic", "6", "--schedule", "0:data=2,fsdp=2"],
       ["data-parallel degree 4 (data 2 x fsdp 2)", "does not divide 6"]),
      (["--procs", "3,1", "--schedule", "0:data=4 2:data=2"],
       ["step 0 has 4 devices, which 3 processes cannot share evenly"]),
      (["--procs", "2", "--schedule", "0:data=4 2:data=2"], ["1 process counts for 2 phases"])):
    with pytest.raises(SystemExit) as e:
      train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), (argv, err)
  assert train.procs_plan(config.parse(config.DEFAULT_SCHEDULE), "auto") == [2, 2, 1, 2]


def test_init_has_the_same_bits_on_every_mesh():
  """init compiles at XLA's optimisation level 0 on CPU
  (``INIT_COMPILER_OPTIONS``): every mesh's compiled init gives the
  1-device init's bits (the elastic and the static run start from the same
  state whatever their first meshes)."""
  import jax
  cfg, key = config.TINY, jax.random.key(config.SEED)
  assert train.INIT_COMPILER_OPTIONS == {"xla_backend_optimization_level": 0}

  def params(schedule):
    phase = config.parse(schedule)[0]
    mesh, rules, _ = train.layout(phase, cfg, jax.devices()[:phase.devices], search=False,
                                  global_batch=config.GLOBAL_BATCH)
    init = train.init_fn(cfg, mesh, rules, config.LEARNING_RATE)
    return [np.asarray(x) for x in jax.tree.leaves(init(key).params)]

  ref = params("0:1")
  for schedule in ("0:stage=2,data=2", "0:data=2,tensor=2,stage=2", "0:fsdp=2,stage=4",
                   "0:fsdp=4,tensor=2"):
    got = params(schedule)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(ref, got)):
      assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (schedule, i)
