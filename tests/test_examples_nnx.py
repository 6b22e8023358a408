"""examples/nnx: the nnx LM trainer resizes mid-run, in one process and across
processes, and stays on the static curve."""

import json
import os
import pathlib
import re
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from flax.nnx.training.optimizer import OptVariable
from jax.sharding import NamedSharding

import procs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _import_example():
  """examples/nnx/train.py as a module. examples/lm has modules of the same
  names (``model``, ``train``) that other tests import, so they are set
  aside while this example's are imported, and put back."""
  names = ("model", "config", "train", "data")
  saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
  path = list(sys.path)
  sys.path.insert(0, str(ROOT / "examples" / "nnx"))
  try:
    import train as nnx_train
  finally:
    for n in names:
      sys.modules.pop(n, None)
    sys.modules.update(saved)
    sys.path[:] = path
  return nnx_train


train = _import_example()
# 8 devices (data 2, tensor 2, stage 2) -> 4 devices (stage 4, 2 microbatches):
# the layers regroup from 2 to 4 stages and every other degree changes.
SCHEDULE = "0:data=2,tensor=2,stage=2 2:stage=4,mb=2"


def test_help_documents_the_contract_flags(capsys):
  with pytest.raises(SystemExit) as e:
    train.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--schedule", "--steps", "--search", "--json", "--plot"):
    assert flag in out


# The in-process resize tests run the same schedule: the second reuses the
# steps the first compiled (the trainer's compiled-step cache) on one xdist
# worker.
@pytest.mark.xdist_group("nnx_in_process")
def test_resize_with_stage_change_follows_static_run(tmp_path, capsys):
  out_json, out_png = tmp_path / "nnx.json", tmp_path / "nnx.png"
  diff = train.main(["--steps", "4", "--schedule", SCHEDULE, "--json", str(out_json),
                     "--plot", str(out_png)])
  log = json.loads(out_json.read_text())
  el, st = log["elastic"], log["static"]
  assert [r["devices"] for r in el] == [8, 8, 4, 4]
  assert [r["mesh"] for r in el[1:3]] == [
      {"data": 2, "fsdp": 1, "tensor": 2, "stage": 2},
      {"data": 1, "fsdp": 1, "tensor": 1, "stage": 4}]
  assert [r["microbatches"] for r in el] == [4, 4, 2, 2]
  assert all(r["devices"] == 8 and r["mesh"]["stage"] == 2 for r in st)
  resized = [r for r in el if "resized_from" in r]
  assert [r["step"] for r in resized] == [2]
  assert resized[0]["reconfig_bytes"] > 0 and resized[0]["reconfig_s"] > 0
  assert all(r["step_s"] > 0 for r in el + st)
  # Same global batches, same init: equal up to the order of float sums.
  np.testing.assert_allclose([r["loss"] for r in el], [r["loss"] for r in st], rtol=1e-5)
  assert el[-1]["loss"] < el[0]["loss"]
  assert diff == log["max_abs_loss_diff"] < 1e-4
  assert "max |elastic - static|" in capsys.readouterr().out
  assert out_png.stat().st_size > 10_000
  # Each compiled step pipelines the nnx stack: activations move between
  # stages, and no all-gather produces a whole stacked block parameter.
  stacked = {tuple(v.shape) for v in jax.tree.leaves(
      train.abstract_params(train.CONFIGS["tiny"])["blocks"])}
  # Keys: (graphdef, mesh shape, device ids, rules, microbatches, deterministic).
  steps = {k[1]: f for k, f in train._COMPILED.items() if k[5] is None}
  assert {(2, 1, 2, 2), (1, 1, 4, 1)} <= set(steps)  # (data, fsdp, stage, tensor)
  for shape in [(2, 1, 2, 2), (1, 1, 4, 1)]:
    hlo = steps[shape].as_text()
    assert "collective-permute" in hlo
    gathered = [tuple(int(d) for d in m.group(1).split(",") if d) for m in re.finditer(
        r"= \(?[a-z0-9]+\[([0-9,]*)\][^\n]* all-gather(?:-start)?\(", hlo)]
    assert not stacked & set(gathered), (shape, gathered)


@pytest.mark.xdist_group("nnx_in_process")
def test_resize_moves_params_and_optimizer_state_to_nnx_targets(tmp):
  """After the re-mesh every array of ``nnx.state((model, optimizer))`` has the
  sharding nnx itself derives from the variable's names and the rules on the
  new mesh: the stacked layers over 4 stages, the Adam moments with them.
  Through a store (what ``--procs`` does) the ``nnx.State`` comes back onto
  the trainer's abstract target bitwise, with its variable types, metadata
  and shardings."""
  from tenplex_jax import store
  seen = []

  def check(step, state, mesh, rules):
    store.save(state, tmp, step=step)
    target = train.abstract_state(train.CONFIGS["tiny"], mesh, rules, train.LEARNING_RATE)[1]
    back = store.restore([tmp], target)
    assert jax.tree.structure(back) == jax.tree.structure(state)  # types and metadata
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
      assert a.sharding == b.sharding and a.dtype == b.dtype
      assert np.array_equal(np.asarray(a), np.asarray(b))
    with nnx.logical_axis_rules(rules):
      want = nnx.get_named_sharding(state, mesh)
    got = [a.sharding for a in jax.tree.leaves(state)]
    assert got == jax.tree.leaves(want)
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in got)
    model_state, opt_state = state[0], state[1]
    kernel = model_state["blocks"]["mlp_in"]["kernel"]
    assert isinstance(kernel, nnx.Param)
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    assert kernel[...].sharding.spec[0] == "stage"
    mu = opt_state["opt_state"][0]["mu"]["blocks"]["mlp_in"]["kernel"]
    assert isinstance(mu, OptVariable) and mu[...].sharding == kernel[...].sharding
    seen.append((step, dict(mesh.shape)))

  train.train(train.parse_schedule(SCHEDULE), 3, train.CONFIGS["tiny"], log=lambda *_: None,
              on_resize=check)
  assert seen == [(2, {"data": 1, "fsdp": 1, "stage": 4, "tensor": 1})]


# --deterministic V: 8 devices (data 2, tensor 2, stage 2) -> 4 devices (stage 4)
# -> 4 devices (fsdp 2, tensor 2, one stage): the stage count goes 2 -> 4 -> 1 and
# the batch, tensor and fsdp degrees change with it; every data x fsdp degree
# divides V = 8.
DET_SCHEDULE = "0:data=2,tensor=2,stage=2 2:stage=4,mb=2 4:fsdp=2,tensor=2"
DET_STEPS = 6


def _bits(tree):
  return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


def _pipelined_without_gathering_the_stack(hlo):
  """Whether the compiled deterministic step runs each worker's slice as a
  pipeline: the stage hand-offs (``ppermute``) of the forward pass and of
  its transpose are there, and no all-gather produces a whole stacked block
  parameter: the worker's layers are not gathered over ``stage``, nor are
  their summed gradients in the exchange (``determinism.value_and_grad`` is
  told the params' shardings and exchanges each stage's layers; before, its
  all-gathers produced every stacked gradient whole on every device)."""
  stacked = {tuple(v.shape) for v in jax.tree.leaves(
      train.abstract_params(train.CONFIGS["tiny"])["blocks"])}
  hops = re.findall(r'collective-permute(?:-start)?\([^\n]*op_name="([^"]*)"', hlo)
  forward = [n for n in hops if n.endswith("ppermute") and "transpose(" not in n]
  backward = [n for n in hops if n.endswith("ppermute") and "transpose(jvp())" in n]
  gathers = re.finditer(
      r'= \(?[a-z0-9]+\[([0-9,]*)\][^\n]* all-gather(?:-start)?\([^\n]*op_name="([^"]*)"', hlo)
  whole = [(m.group(1), m.group(2)) for m in gathers
           if tuple(int(d) for d in m.group(1).split(",") if d) in stacked]
  return bool(forward) and bool(backward) and not whole


# The CLI test reuses the steps the test before compiled (the trainer's
# compiled-step cache): on one xdist worker it takes a second, not minutes.
@pytest.mark.xdist_group("nnx_deterministic")
def test_deterministic_pipelined_over_2_and_4_stages_is_bitwise_the_static_run():
  """``--deterministic 8``: each virtual worker's slice runs through the
  pipeline over ``stage`` (2, then 4 stages, then 1), and the losses at every
  step and the final params (raw float32 bits) are the static run's on data
  2 x tensor 2 x stage 2."""
  cfg = train.CONFIGS["tiny"]
  phases = train.parse_schedule(DET_SCHEDULE)
  el, (_, el_state) = train.train(phases, DET_STEPS, cfg, deterministic=8,
                                  return_state=True, log=lambda *_: None)
  st, (_, st_state) = train.train(phases[:1], DET_STEPS, cfg, deterministic=8,
                                  return_state=True, log=lambda *_: None)
  assert [r["mesh"] for r in el[::2]] == [
      {"data": 2, "fsdp": 1, "tensor": 2, "stage": 2},
      {"data": 1, "fsdp": 1, "tensor": 1, "stage": 4},
      {"data": 1, "fsdp": 2, "tensor": 2, "stage": 1}]
  assert [r["step"] for r in el if "resized_from" in r] == [2, 4]
  assert all(r["mesh"]["stage"] == 2 and r["devices"] == 8 for r in st)
  assert [r["loss"] for r in el] == [r["loss"] for r in st]
  assert el[-1]["loss"] < el[0]["loss"]
  a, b = _bits(train.params_of(el_state)), _bits(train.params_of(st_state))
  assert len(a) == len(b) > 0
  bad = [i for i, (x, y) in enumerate(zip(a, b)) if not np.array_equal(x, y)]
  assert not bad, bad
  # The deterministic steps on 2 and 4 stages are pipelines, not the layer
  # stack run whole on every device.
  steps = {k[1]: f for k, f in train._COMPILED.items() if k[5] == 8}
  assert {(2, 1, 2, 2), (1, 1, 4, 1)} <= set(steps)  # (data, fsdp, stage, tensor)
  for shape in [(2, 1, 2, 2), (1, 1, 4, 1)]:
    assert _pipelined_without_gathering_the_stack(steps[shape].as_text()), shape


@pytest.mark.xdist_group("nnx_deterministic")
def test_deterministic_cli_prints_the_bitwise_line(tmp_path, capsys):
  """The trainer's own check: ``--deterministic 8`` over the same schedule
  prints that losses and final params are bitwise the static run's, and its
  JSON log says so (the steps compiled above are reused)."""
  out = tmp_path / "det.json"
  diff = train.main(["--deterministic", "8", "--steps", str(DET_STEPS), "--schedule",
                     DET_SCHEDULE, "--json", str(out)])
  assert diff == 0.0
  log = json.loads(out.read_text())
  assert log["deterministic"] == 8 and log["bitwise_identical"] is True
  assert log["max_abs_param_diff"] == 0.0
  assert [r["loss"] for r in log["elastic"]] == [r["loss"] for r in log["static"]]
  assert [r["mesh"]["stage"] for r in log["elastic"]] == [2, 2, 4, 4, 1, 1]
  assert ("deterministic (8 virtual workers): losses and final params are bitwise"
          " identical to the static run") in capsys.readouterr().out


def test_deterministic_refuses_a_batch_degree_not_dividing_v(capsys):
  with pytest.raises(SystemExit) as e:
    train.main(["--deterministic", "6", "--schedule", "0:data=2,stage=2 2:data=4"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--deterministic 6" in err and "data x fsdp = 4" in err and "step 2" in err


@pytest.mark.slow
def test_deterministic_cross_process_resize_through_the_stores_is_bitwise(tmp):
  """``--procs 2,1 --deterministic 8``: 2 processes x 2 devices (data 2, stage
  2), then at step 2 one process x 4 devices (stage 4) that restores
  ``nnx.state((model, optimizer))`` from the per-host stores: the losses at
  every step and the final params (read back from the stores) are the static
  run's, bit for bit. Also what every trainer's ``--procs 2,1`` run promises
  (as ``procs.check_stage_change_resize`` checks for the LM trainer): each
  step once, on the phase's meshes and microbatches, the whole state read
  from the stores."""
  out = os.path.join(tmp, "det.json")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  env.pop("TENPLEX_JAX_STORE_TOKEN", None)
  (run,) = procs.run_all([[sys.executable, str(ROOT / "examples" / "nnx" / "train.py"),
                           "--procs", "2,1", "--schedule", "0:stage=2,data=2 2:stage=4,mb=2",
                           "--steps", "4", "--deterministic", "8", "--json", out,
                           "--timeout", "600"]], timeout=650, env=env)
  assert run.returncode == 0, run.stdout[-5000:]
  log = json.loads(pathlib.Path(out).read_text())
  el, st = log["elastic"], log["static"]
  assert [(r["procs"], r["devices_per_proc"], r["mesh"]["stage"]) for r in el] == [
      (2, 2, 2), (2, 2, 2), (1, 4, 4), (1, 4, 4)]
  (resized,) = [r for r in el if "resized_from" in r]
  n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(
      train.abstract_params(train.CONFIGS["tiny"])))
  assert resized["step"] == 2 and resized["reconfig_bytes"] >= 3 * 4 * n_params, resized
  assert resized["procs_from"] == 2 and resized["resized_from"] == {
      "data": 2, "fsdp": 1, "tensor": 1, "stage": 2}, resized
  assert resized["reconfig_s"] >= resized["restore_s"] > 0, resized
  assert [r["step"] for r in el] == [0, 1, 2, 3]  # none repeated or lost
  assert [r["microbatches"] for r in el] == [4, 4, 2, 2]
  assert "1 resizes across processes" in run.stdout
  assert "generation 0: 2 -> 1 processes at step 2" in run.stdout
  assert [r["loss"] for r in el] == [r["loss"] for r in st]
  assert log["bitwise_identical"] is True and log["max_abs_param_diff"] == 0.0
  assert ("deterministic (8 virtual workers): losses and final params are bitwise"
          " identical to the static run") in run.stdout


def test_init_has_the_same_bits_on_every_mesh():
  """The model's init compiles at XLA's optimisation level 0 on CPU
  (``INIT_COMPILER_OPTIONS``): every mesh's init gives the 1-device init's
  bits, so the elastic and the static run start from the same state."""
  cfg = train.CONFIGS["tiny"]
  assert train.create_model.__globals__["INIT_COMPILER_OPTIONS"] == {
      "xla_backend_optimization_level": 0}

  def params(schedule):
    phase = train.parse_schedule(schedule)[0]
    mesh, rules, _ = train.layout(phase, cfg, jax.devices(), search=False,
                                  global_batch=train.GLOBAL_BATCH)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      model = train.create_model(cfg, seed=train.SEED)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

  ref = params("0:1")
  for schedule in ("0:stage=2,data=2", "0:fsdp=2,tensor=2", "0:data=2,tensor=2,stage=2"):
    got = params(schedule)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(ref, got)):
      assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (schedule, i)
