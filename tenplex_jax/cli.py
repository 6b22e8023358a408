"""The ``tenplex-jax`` command line: a thin layer over library calls.

Each verb lives next to the library code that does its work and registers
itself through a ``register(subparsers)`` function listed in ``_VERBS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define ``register(subparsers)``; each adds its verbs.
_VERBS: tuple[str, ...] = (
    "tenplex_jax._cli_core",
    "tenplex_jax.data.cli",
    "tenplex_jax.search.cli",
    "tenplex_jax.store.cli",
    "tenplex_jax.store.launch",
)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="tenplex-jax",
      description="Elastic re-meshing of JAX training state.",
  )
  sub = parser.add_subparsers(dest="verb", required=True)
  for name in _VERBS:
    importlib.import_module(name).register(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  return int(args.func(args) or 0)


if __name__ == "__main__":
  sys.exit(main())
