"""One error convention for every ``tenplex-jax`` verb.

Each case gives a verb bad input and checks: exit status 2 for bad input (1
for a failed operation), one ``tenplex-jax: error: ...`` line on stderr
naming the problem, nothing on stdout, and no traceback unless ``--debug``.
One case per verb runs the real console entry (``python -m tenplex_jax``)
as a subprocess (side by side, to keep the wall time down); every case also
runs in this process through ``main``.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": ""}


def _cases(d):
  np.save(os.path.join(d, "a.npy"), np.zeros((4, 2), np.float32))
  np.save(os.path.join(d, "b.npy"), np.zeros((3, 3), np.float32))
  np.save(os.path.join(d, "c.npy"), np.zeros((3, 2), np.int32))
  with open(os.path.join(d, "garbage.json"), "w") as f:
    f.write("{not json")
  with open(os.path.join(d, "other.json"), "w") as f:
    json.dump({"format": "tenplex_jax.PTC", "tensors": []}, f)
  missing = os.path.join(d, "missing")
  a, b, c = (os.path.join(d, f"{x}.npy") for x in "abc")
  out = os.path.join(d, "idx")
  # (argv, exit status, words the error line must hold)
  return [
      (["plan", "--from", missing, "--to", missing], 2, ["--from", "missing"]),
      (["plan", "--from", os.path.join(d, "garbage.json"), "--to", missing],
       2, ["garbage.json", "not a layout"]),
      (["plan", "--from", os.path.join(d, "other.json"), "--to", missing],
       2, ["other.json", "placements"]),
      (["plan", "--to", missing], 2, ["--from"]),
      (["demo", "--devices", "4"], 2, ["needs 8 devices", "--devices is 4"]),
      (["demo", "--schedule", "0:4y2"], 2, ["'0:4y2'", "STEP:DATAxTENSOR"]),
      (["demo", "--schedule", "5:2x2"], 2, ["must start at 0"]),
      (["demo", "--steps", "0"], 2, ["--steps"]),
      (["data", "index", "--out", out, missing], 2, ["missing", "not a file"]),
      (["data", "index", "--out", out, a, b], 2,
       ["b.npy", "sample 4", "(3,)", "(2,)"]),
      (["data", "index", "--out", out, a, c], 2,
       ["c.npy", "sample 4", "int32", "float32"]),
      (["data", "info", missing], 2, ["no index"]),
      (["search", "--model", "gpt3-2.7b", "--devices", "1", "--global-batch",
        "1", "--seq-len", "65536"], 2, ["no feasible layout", "memory"]),
      (["search", "--model", "gpt3-2.7b", "--devices", "0",
        "--global-batch", "8"], 2, ["--devices", "positive"]),
      (["search", "--model", "nope", "--devices", "8", "--global-batch",
        "8"], 2, ["invalid choice"]),
      (["launch", "--procs", "1"], 2, ["command after --"]),
      (["launch", "--procs", "0", "--", "true"], 2, ["procs", "positive"]),
      (["launch", "--procs", "1", "--schedule", missing, "--", "true"], 2,
       ["schedule", "missing"]),
      (["launch", "--procs", "1", "--prepare-timeout", "0", "--", "true"], 2,
       ["prepare_timeout", "positive", "0"]),
      (["bogus"], 2, ["invalid choice"]),
      (["store", "ls", missing], (1, 2), ["missing"]),
      (["store", "verify", missing], (1, 2), ["missing"]),
  ]


def _check(argv, want, words, code, out, err):
  lines = [ln for ln in err.splitlines() if ln.strip()]
  errors = [ln for ln in lines if ln.startswith("tenplex-jax: error: ")]
  ok = (code in (want if isinstance(want, tuple) else (want,))
        and len(errors) == 1 and lines[-1] == errors[0]
        and "Traceback" not in err and not out.strip()
        and all(w in errors[0] for w in words))
  return None if ok else (f"{argv}: exit {code} (want {want}), stdout"
                          f" {out[-500:]!r}, stderr {err[-1500:]!r}")


def test_every_case_in_process(tmp_path, capsys):
  from tenplex_jax.cli import main
  bad = []
  for argv, want, words in _cases(str(tmp_path)):
    try:
      code = main(argv)
    except SystemExit as e:  # argparse
      code = e.code
    out, err = capsys.readouterr()
    bad.append(_check(argv, want, words, code, out, err))
  bad = [b for b in bad if b]
  assert not bad, "\n".join(bad)
  assert not os.path.exists(tmp_path / "idx" / "index.json")


@pytest.mark.slow
def test_the_console_entry_follows_it(tmp_path):
  # A few verbs through the real entry point (each start imports jax).
  want = ("plan", "data", "search", "bogus")
  cases = []
  for case in _cases(str(tmp_path)):
    if case[0][0] in want and case[0][0] not in {c[0][0] for c in cases}:
      cases.append(case)
  cases[1] = next(c for c in _cases(str(tmp_path)) if "sample 4" in c[2])
  procs = [subprocess.Popen([sys.executable, "-m", "tenplex_jax", *argv],
                            env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
           for argv, _, _ in cases]
  bad = []
  try:
    for (argv, want, words), p in zip(cases, procs):
      out, err = p.communicate(timeout=120)
      bad.append(_check(argv, want, words, p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  bad = [b for b in bad if b]
  assert not bad, "\n".join(bad)


def test_debug_flag_prints_the_traceback(tmp_path, capsys):
  from tenplex_jax.cli import main
  assert main(["--debug", "plan", "--from", str(tmp_path / "x"), "--to",
               "y"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" in err and "FileNotFoundError" in err, err
  assert err.strip().splitlines()[-1].startswith("tenplex-jax: error:")


def test_exit_codes_of_the_convention():
  from tenplex_jax import errors
  from tenplex_jax.cli import exit_code
  assert exit_code(errors.UsageError("x")) == 2
  for e in (errors.LayoutError, errors.PlanError, errors.SearchError,
            errors.DataError, errors.TreeError):
    assert exit_code(e("x")) == 2, e
  for e in (errors.StoreError("x"), errors.ReshardError("x"),
            errors.NoCopyError("x"), OSError("x"), RuntimeError("x")):
    assert exit_code(e) == 1, e
  from tenplex_jax.runtime.launch import _Interrupted
  import signal
  assert exit_code(_Interrupted(signal.SIGTERM)) == 143
  assert exit_code(KeyboardInterrupt()) == 130
