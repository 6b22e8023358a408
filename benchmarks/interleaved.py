"""Step times of several compiled programs, their calls interleaved.

Shared by the determinism benchmarks: each round calls every program once, in
turn, so that load from other jobs on a shared machine falls on all of them
alike.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence

import jax


def time_interleaved(compiled: Mapping[str, Callable], args: Sequence,
                     reps: int, kernel: dict | None = None
                     ) -> tuple[dict[str, list[float]],
                                dict[str, list[float]]]:
  """Calls each of ``compiled`` on ``args``, ``reps`` rounds, in turn.

  Args:
    kernel: if given, filled per program name with ``"system"`` (the
      process's system seconds of each call: mostly the kernel's page faults
      on buffers the runtime maps afresh) and ``"minor_faults"`` (its minor
      page faults) lists.

  Returns:
    ``(wall, cpu)``: per program name, the wall seconds and the process's CPU
    seconds (user + system, all threads) of each call, until its result is
    ready.
  """
  wall = {name: [] for name in compiled}
  cpu = {name: [] for name in compiled}
  if kernel is not None:
    kernel.update(system={name: [] for name in compiled},
                  minor_faults={name: [] for name in compiled})
  for _ in range(reps):
    for name, c in compiled.items():
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      r0 = os.times()
      t0 = time.perf_counter()
      jax.block_until_ready(c(*args))
      wall[name].append(time.perf_counter() - t0)
      r1 = os.times()
      f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      cpu[name].append(r1.user - r0.user + r1.system - r0.system)
      if kernel is not None:
        kernel["system"][name].append(r1.system - r0.system)
        kernel["minor_faults"][name].append(f1 - f0)
  return wall, cpu
