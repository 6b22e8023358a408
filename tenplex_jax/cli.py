"""The ``tenplex-jax`` command line: a thin layer over library calls.

Each verb lives next to the library code that does its work and registers
itself through a ``register(subparsers)`` function listed in ``_VERBS``. A
command line that names a verb registers that verb's module alone
(``_VERB_MODULES``), so that ``tenplex-jax store serve``, which the launcher
starts on every host, does not import the others (jax: a second of CPU);
without one (``tenplex-jax --help``, a misspelt verb) every module
registers, and help and errors list every verb.

Errors follow one convention for every verb: one line
``tenplex-jax: error: <message>`` on stderr, exit status 2 for bad input
(:class:`~tenplex_jax.errors.UsageError`, argparse errors, and the
``ValueError``-type errors: ``LayoutError``, ``PlanError``, ``SearchError``,
``DataError``, ``TreeError``), 1 for an operation that failed (any other
``TenplexError``, an ``OSError``, an unexpected exception), 128+N when the
command was stopped by signal N (SIGINT: 130), and no traceback unless
``tenplex-jax --debug VERB ...``.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import traceback
from collections.abc import Sequence

from tenplex_jax.errors import TenplexError, UsageError

# The verb each module registers (``register(subparsers)``), in order
# (tests/test_cli_verbs.py checks it against what the modules register).
_VERB_MODULES: dict[str, str] = {
    "plan": "tenplex_jax._cli_core",
    "demo": "tenplex_jax._cli_core",
    "data": "tenplex_jax.data.cli",
    "ckpt": "tenplex_jax.orbax.cli",
    "search": "tenplex_jax.search.cli",
    "store": "tenplex_jax.store.cli",
    "launch": "tenplex_jax.runtime.launch",
}

# The modules that register verbs, each once, in the map's order.
_VERBS: tuple[str, ...] = tuple(dict.fromkeys(_VERB_MODULES.values()))

EXIT_USAGE = 2
EXIT_FAILED = 1


class _Parser(argparse.ArgumentParser):
  """argparse with the CLI's error line (usage, then
  ``tenplex-jax: error: ...``; exit 2); subparsers inherit it."""

  def error(self, message: str):
    self.print_usage(sys.stderr)
    self.exit(EXIT_USAGE, f"tenplex-jax: error: {message}\n")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
  """The parser of every verb, or of the module that registers ``verb``.

  Args:
    verb: register only its module (its usage line still lists every
      verb); ``None``: every module of ``_VERBS``.

  Example:
    >>> args = build_parser("store").parse_args(["store", "serve", "--dir", "d"])
    >>> args.store_verb, args.port
    ('serve', 0)
  """
  parser = _Parser(
      prog="tenplex-jax",
      description="Elastic re-meshing of JAX training state.",
  )
  parser.add_argument("--debug", action="store_true",
                      help="print the traceback of an error")
  if verb is None:
    sub = parser.add_subparsers(dest="verb", required=True)
    modules = _VERBS
  else:
    # The metavar argparse would write from a full registration's choices.
    sub = parser.add_subparsers(dest="verb", required=True,
                                metavar="{" + ",".join(_VERB_MODULES) + "}")
    modules = (_VERB_MODULES[verb],)
  for name in modules:
    importlib.import_module(name).register(sub)
  return parser


def _verb_of(argv: Sequence[str]) -> str | None:
  """The verb a command line names, when it is the first argument after
  ``--debug`` (or an abbreviation of it); ``None`` otherwise (no verb, a
  misspelt one, ``--help`` or anything else before it).

  Example:
    >>> _verb_of(["--debug", "store", "serve"]), _verb_of(["--help", "store"])
    ('store', None)
  """
  for arg in argv:
    if arg in _VERB_MODULES:
      return arg
    if not (len(arg) > 2 and "--debug".startswith(arg)):
      return None
  return None


def exit_code(e: BaseException) -> int:
  """The exit status of the convention for an exception a verb raised.

  Example:
    >>> from tenplex_jax.errors import DataError, StoreError
    >>> exit_code(UsageError("x")), exit_code(DataError("x"))
    (2, 2)
    >>> exit_code(StoreError("x")), exit_code(FileNotFoundError("x"))
    (1, 1)
  """
  if isinstance(e, KeyboardInterrupt):
    return 128 + int(getattr(e, "signum", signal.SIGINT))
  if isinstance(e, UsageError):
    return EXIT_USAGE
  if isinstance(e, TenplexError):
    return EXIT_USAGE if isinstance(e, ValueError) else EXIT_FAILED
  return EXIT_FAILED


def _message(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    text = f"{e.strerror}: {e.filename!r}"
  if not isinstance(e, (TenplexError, OSError)):  # not one of ours: a bug?
    text = (f"{type(e).__name__}: {text} (unexpected; run"
            " 'tenplex-jax --debug ...' for the traceback)")
  return " ".join(text.splitlines()) if len(text) < 2000 else text


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser(_verb_of(argv)).parse_args(argv)
  try:
    return int(args.func(args) or 0)
  except KeyboardInterrupt as e:
    if args.debug:
      traceback.print_exc()
    code = exit_code(e)
    print(f"tenplex-jax: stopped ({signal.Signals(code - 128).name})",
          file=sys.stderr, flush=True)
    return code
  except SystemExit:
    raise
  except Exception as e:  # noqa: BLE001  (the convention covers them all)
    if args.debug:
      traceback.print_exc()
    sys.stdout.flush()
    print(f"tenplex-jax: error: {_message(e)}", file=sys.stderr, flush=True)
    return exit_code(e)


if __name__ == "__main__":
  sys.exit(main())
