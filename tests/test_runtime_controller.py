"""One controller per process decides resizes and how a process leaves."""

import jax
import jax.numpy as jnp
import pytest

from tenplex_jax import store
from tenplex_jax.runtime import launch


@pytest.fixture
def fresh_controller():
  saved = list(launch._controller)
  launch._controller.clear()
  yield
  launch._controller[:] = saved


def test_the_launchers_controller_reads_the_schedule(tmp_path, monkeypatch,
                                                      fresh_controller):
  (tmp_path / "s.txt").write_text("step 3 procs 4\nstep 5 procs 2\n")
  monkeypatch.setenv("TENPLEX_SCHEDULE", str(tmp_path / "s.txt"))
  monkeypatch.setenv("TENPLEX_NUM_PROCS", "2")
  monkeypatch.setenv("TENPLEX_START_STEP", "1")
  assert [launch.resize_due(s) for s in range(1, 7)] == [
      None, None, 4, None, None, None]  # step 5 asks for the count it has
  assert type(launch.controller()) is launch.Controller
  assert launch.controller() is launch.controller()  # chosen once


class _Recorder(launch.Controller):
  def __init__(self):
    self.asked, self.left = [], []

  def resize_due(self, step):
    self.asked.append(step)
    return 3 if step == 2 else None

  def leave_for_resize(self, procs, step):
    self.left.append((procs, step))
    raise SystemExit("left")


def test_save_and_exit_leaves_through_the_controller_after_saving(
    tmp_path, monkeypatch, fresh_controller):
  monkeypatch.setenv("TENPLEX_STORE", str(tmp_path / "store"))
  c = _Recorder()
  launch.use_controller(c)
  assert launch.resize_due(1) is None and launch.resize_due(2) == 3
  state = {"w": jnp.arange(8.0), "step": 2}
  with pytest.raises(SystemExit, match="left"):
    launch.save_and_exit(state, 2)
  assert c.asked == [1, 2, 2] and c.left == [(3, 2)]
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=one),
            "step": 0}
  got = store.restore([str(tmp_path / "store")], target)
  assert got["step"] == 2 and got["w"].tolist() == list(range(8))
