"""Runs the docstring examples of tenplex_jax.data and checks the public surface."""

import doctest
import os
import importlib

import pytest

import tenplex_jax.data as data

MODULES = ["tenplex_jax.data.order", "tenplex_jax.data.index", "tenplex_jax.data.records",
           "tenplex_jax.data.iterator", "tenplex_jax.data.rng", "tenplex_jax.data.cli",
           "tenplex_jax.data.packing", "tenplex_jax.data.arrayrecord",
           "tenplex_jax.data.checkpoint"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f"{name} has no examples"
  assert result.failed == 0


def test_public_names_resolve_and_are_documented():
  for name in data.__all__:
    obj = getattr(data, name)
    if callable(obj) and name != "DataError":
      assert obj.__doc__ and "Example" in obj.__doc__, name


def test_the_data_doc_examples_run():
  path = os.path.join(os.path.dirname(__file__), "..", "docs", "data.md")
  result = doctest.testfile(path, module_relative=False, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
