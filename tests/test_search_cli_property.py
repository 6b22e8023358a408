"""CLI contract and memory-safety property of the configuration search."""

import contextlib
import io
import json

from hypothesis import given, settings, strategies as st

import tenplex_jax.search as S
from tenplex_jax import cli

KEYS = {"data", "fsdp", "tensor", "pipeline", "microbatches", "step_time_s", "memory_bytes"}


def _run(argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = cli.main(argv)
  return rc, out.getvalue()


def test_cli_json_contract():
  rc, out = _run(["search", "--model", "gpt3-2.7b", "--hardware", "a6000", "--devices", "16",
                  "--devices-per-host", "4", "--global-batch", "128", "--seq-len", "1024",
                  "--json"])
  assert rc == 0
  rows = json.loads(out)
  assert rows and all(KEYS <= set(r) for r in rows)
  times = [r["step_time_s"] for r in rows]
  assert times == sorted(times)
  limit = 0.9 * 48 * 2**30
  assert all(r["memory_bytes"] <= limit for r in rows)
  assert all(r["data"] * r["fsdp"] * r["tensor"] * r["pipeline"] == 16 for r in rows)


def test_cli_no_fsdp_json_best_is_paper_choice():
  rc, out = _run(["search", "--model", "gpt3-2.7b", "--devices", "16", "--devices-per-host",
                  "4", "--global-batch", "128", "--seq-len", "1024", "--no-fsdp", "--json"])
  best = json.loads(out)[0]
  assert (best["tensor"], best["pipeline"], best["data"], best["fsdp"]) == (2, 4, 2, 1)


def test_cli_table():
  rc, out = _run(["search", "--model", "bert-large", "--hardware", "v100", "--devices", "8",
                  "--global-batch", "64", "--top", "3"])
  assert rc == 0
  assert "rejected:" in out and "memory limit" in out and "bert-large" in out


_models = st.builds(
    lambda L, hd, a, v, s: S.transformer_spec(name="rand", layers=L, hidden=hd * a, heads=a,
                                              vocab=v, seq_len=s),
    st.sampled_from([2, 4, 6, 12, 24, 32, 48]), st.sampled_from([32, 64, 128]),
    st.sampled_from([4, 8, 12, 16, 32]), st.sampled_from([0, 1000, 32000, 50304]),
    st.sampled_from([128, 512, 2048]))
_models = st.one_of(_models, st.sampled_from(S.MODEL_PRESETS).map(S.model_preset))


@settings(max_examples=60, deadline=None)
@given(model=_models,
       hw=st.sampled_from(["a6000", "v100", "a100-40g", "a100-80g", "h100", "tpu-v4",
                           "tpu-v5e"]),
       devices=st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32, 64]),
       dph=st.sampled_from([1, 2, 4, 8]),
       batch=st.sampled_from([1, 8, 24, 64, 256]),
       opt=st.sampled_from([8, 12, 16]))
def test_never_returns_a_layout_over_memory(model, hw, devices, dph, batch, opt):
  res = S.search(model, hw, devices=devices, devices_per_host=min(dph, devices),
                 global_batch=batch, optimizer_bytes=opt)
  device_memory = S.hardware_preset(hw).memory_bytes
  for c in res.candidates:
    assert c.memory_bytes <= res.memory_limit_bytes < device_memory
    assert c.data * c.fsdp * c.tensor * c.pipeline == devices
    assert batch % (c.data * c.fsdp * c.microbatches) == 0
    # Weights alone are a lower bound the estimate must include.
    floor = S.sharded_param_count(model, data=c.data, fsdp=c.fsdp, tensor=c.tensor,
                                  pipeline=c.pipeline) * (4 + opt)
    assert c.memory_bytes >= floor
