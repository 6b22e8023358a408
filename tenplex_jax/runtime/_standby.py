"""A standby training process of ``tenplex-jax launch``.

The launcher starts it before it knows the process's rank: Python starts and
imports the heavy modules (``TENPLEX_STANDBY_IMPORTS``, comma-separated:
jax, flax, optax, ...), then the process waits, before anything initialises
jax's backends or ``jax.distributed``, for its assignment on a pipe only it
and the launcher hold: one JSON object with the training command's ``argv``
and its whole environment (rank, process count, coordinator, stores). It
then runs the script as ``python SCRIPT ARGS`` (or ``python -m MODULE
ARGS``) would, in this process, with the modules already in
``sys.modules``. Once its imports are done it writes one byte to a second
pipe, ``READY_FD`` (the launcher kills a standby not ready within its
standby timeout). When the launcher closes the pipe without an assignment
(an unused standby at the end of the job) it exits with status 0.

  python -m tenplex_jax.runtime._standby FD READY_FD path SCRIPT
  python -m tenplex_jax.runtime._standby FD READY_FD module MODULE
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time

from tenplex_jax.runtime.env import (STANDBY_ASSIGNED_ENV, STANDBY_READY_ENV,
                                     job_env)


def _read_all(fd: int) -> bytes:
  chunks = []
  while True:
    b = os.read(fd, 1 << 16)
    if not b:
      return b"".join(chunks)
    chunks.append(b)


def main(argv: list[str]) -> None:
  fd, ready_fd, mode, target = int(argv[0]), int(argv[1]), argv[2], argv[3]
  if mode == "path":  # as `python SCRIPT`: the script's directory first
    sys.path[0] = os.path.dirname(os.path.abspath(target))
  for name in job_env().standby_imports:
    try:
      importlib.import_module(name)
    except Exception:  # noqa: BLE001  (the script's own import reports it)
      pass
  ready = time.time()
  try:
    os.write(ready_fd, b"r")
  except OSError:  # the launcher no longer asks (assigned already)
    pass
  os.close(ready_fd)
  data = _read_all(fd)
  os.close(fd)
  if not data:  # released unused
    os._exit(0)
  msg = json.loads(data)
  os.environ.clear()
  os.environ.update(msg["env"])
  os.environ[STANDBY_READY_ENV] = repr(ready)
  os.environ[STANDBY_ASSIGNED_ENV] = repr(time.time())
  sys.argv = list(msg["argv"])
  if mode == "path":
    runpy.run_path(target, run_name="__main__")
  else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv[1:])
