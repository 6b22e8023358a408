"""The CLI registers only the module of the verb a command line names.

``tenplex_jax.cli._VERB_MODULES`` maps each verb to the module that
registers it; these tests check that it is what registering every module of
``_VERBS`` gives (so it cannot drift from them), that a named verb registers
its module alone with the same usage line, and that every verb's module
works imported first in a fresh process (``tenplex-jax VERB --help``).
"""

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from tenplex_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": ""}


def _choices(parser):
  (action,) = [a for a in parser._actions
               if isinstance(a, argparse._SubParsersAction)]
  return list(action.choices)


def test_the_verb_map_is_what_registration_gives():
  """Each module of ``_VERBS``, registered alone, adds exactly the verbs
  the map gives it, in the map's order, and no module adds another."""
  got = {}
  for name in cli._VERBS:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="verb")
    importlib.import_module(name).register(sub)
    for verb in sub.choices:
      assert verb not in got, (verb, got[verb], name)
      got[verb] = name
  assert list(got.items()) == list(cli._VERB_MODULES.items())
  assert _choices(cli.build_parser()) == list(cli._VERB_MODULES)


@pytest.mark.parametrize("verb", list(cli._VERB_MODULES))
def test_a_named_verb_registers_its_module_alone(verb):
  module = cli._VERB_MODULES[verb]
  full, alone = cli.build_parser(), cli.build_parser(verb)
  assert _choices(alone) == [v for v, m in cli._VERB_MODULES.items()
                             if m == module]
  assert alone.format_usage() == full.format_usage()


def test_which_command_lines_name_a_verb():
  assert cli._verb_of(["store", "serve", "--dir", "d"]) == "store"
  assert cli._verb_of(["--debug", "plan"]) == "plan"
  assert cli._verb_of(["--de", "launch", "--", "x"]) == "launch"
  for argv in ([], ["--help", "store"], ["-h"], ["stor", "serve"],
               ["--", "store"], ["--debug=1", "store"], ["--debug"]):
    assert cli._verb_of(argv) is None, argv


def test_without_a_verb_every_verb_is_listed(capsys):
  for argv in (["bogus"], ["--debug", "stor", "serve"], ["--help", "store"]):
    with pytest.raises(SystemExit):
      cli.main(argv)
    out, err = capsys.readouterr()
    assert all(v in out + err for v in cli._VERB_MODULES), (argv, out, err)
  with pytest.raises(SystemExit) as e:
    cli.main(["bogus"])
  assert e.value.code == 2
  assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_each_verb_module_loads_first_in_a_fresh_process():
  """``tenplex-jax VERB --help`` in a fresh process imports that verb's
  module before any other of the package's (side by side)."""
  procs = {v: subprocess.Popen(
      [sys.executable, "-m", "tenplex_jax", v, "--help"], env=ENV,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      start_new_session=True) for v in cli._VERB_MODULES}
  bad = []
  try:
    for v, p in procs.items():
      out, err = p.communicate(timeout=180)
      if p.returncode != 0 or not out.startswith(f"usage: tenplex-jax {v}"):
        bad.append(f"{v}: exit {p.returncode}, stdout {out[:300]!r},"
                   f" stderr {err[-1500:]!r}")
  finally:
    for p in procs.values():
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  assert not bad, "\n".join(bad)
