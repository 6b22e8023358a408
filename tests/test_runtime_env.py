"""The runtime's TENPLEX_* environment, read in one place (runtime/env.py)."""

import dataclasses

import pytest

from tenplex_jax.errors import UsageError
from tenplex_jax.runtime.env import JobEnv, job_env


def test_parses_every_kind():
  e = JobEnv.from_environ({
      "TENPLEX_NUM_PROCS": "3", "TENPLEX_PROC_ID": "2",
      "TENPLEX_DEVICES": "4", "TENPLEX_PEERS": '["http://a", "http://b"]',
      "TENPLEX_FAILED_STEP": "17", "TENPLEX_COMPILATION_CACHE": "1",
      "TENPLEX_STANDBY_IMPORTS": "jax,,flax"})
  assert (e.num_procs, e.proc_id, e.devices, e.procs) == (3, 2, 4, 3)
  assert e.peers == ("http://a", "http://b") and e.stores == ()
  assert e.failed_step == 17 and e.compilation_cache
  assert e.standby_imports == ("jax", "flax")
  assert e.launched


def test_defaults_without_a_launcher():
  e = JobEnv.from_environ({})
  assert not e.launched and e.procs == 1 and e.proc_id == 0
  assert e.failed_step is None and e.start_step == 0 and e.job_dir is None


@pytest.mark.parametrize("name,value,match", [
    ("TENPLEX_NUM_PROCS", "two", r"\$TENPLEX_NUM_PROCS: 'two' is not an"
     " integer"),
    ("TENPLEX_STORES", "/a,/b", r"\$TENPLEX_STORES: '/a,/b' is not a JSON"
     " list"),
    ("TENPLEX_PEERS", "[1, 2]", r"\$TENPLEX_PEERS: '\[1, 2\]' is not a JSON"
     " list of strings"),
])
def test_malformed_value_names_the_variable(name, value, match):
  with pytest.raises(UsageError, match=match):
    JobEnv.from_environ({name: value})


def test_job_env_follows_the_environment(monkeypatch):
  monkeypatch.setenv("TENPLEX_START_STEP", "5")
  first = job_env()
  assert first.start_step == 5 and job_env() is first  # parsed once
  monkeypatch.setenv("TENPLEX_START_STEP", "9")  # as restore_or_init does
  assert job_env().start_step == 9


def test_the_stores_settings_are_the_stores_to_read(monkeypatch):
  """The job's token, CA and run id are read by the store alone (the
  launchers call its readers), so one parse decides each."""
  from tenplex_jax.store.api import run_id
  from tenplex_jax.store.server import client_ca, resolve_token
  fields = {f.name for f in dataclasses.fields(JobEnv)}
  assert not fields & {"token", "ca", "run"}
  monkeypatch.setenv("TENPLEX_JAX_STORE_TOKEN", "tok")
  monkeypatch.setenv("TENPLEX_JAX_STORE_CA", "/ca.pem")
  monkeypatch.setenv("TENPLEX_RUN", "r-g1")
  assert (resolve_token(), client_ca(), run_id()) == ("tok", "/ca.pem",
                                                      "r-g1")
  monkeypatch.setenv("TENPLEX_JAX_STORE_TOKEN", "two words")
  with pytest.raises(UsageError, match="printable ASCII"):
    resolve_token()


def test_a_malformed_token_is_refused_before_anything_starts(monkeypatch,
                                                             tmp_path):
  """The launcher reads the job's token as a store server does: one the
  servers would refuse stops it before it made its job directory."""
  import sys
  from tenplex_jax.runtime import launch
  monkeypatch.setenv("TENPLEX_JAX_STORE_TOKEN", "two words")
  job = tmp_path / "job"
  with pytest.raises(UsageError, match="printable ASCII"):
    launch.launch([sys.executable, "-c", "pass"], procs=1,
                  devices_per_proc=1, timeout=30, job_dir=str(job))
  assert not job.exists()
