"""Step times of several compiled programs, their calls interleaved.

Shared by the determinism benchmarks: each round calls every program once, in
turn, so that load from other jobs on a shared machine falls on all of them
alike.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

import jax


def time_interleaved(compiled: Mapping[str, Callable], args: Sequence,
                     reps: int) -> tuple[dict[str, list[float]],
                                         dict[str, list[float]]]:
  """Calls each of ``compiled`` on ``args``, ``reps`` rounds, in turn.

  Returns:
    ``(wall, cpu)``: per program name, the wall seconds and the process's CPU
    seconds (user + system, all threads) of each call, until its result is
    ready.
  """
  wall = {name: [] for name in compiled}
  cpu = {name: [] for name in compiled}
  for _ in range(reps):
    for name, c in compiled.items():
      r0 = os.times()
      t0 = time.perf_counter()
      jax.block_until_ready(c(*args))
      wall[name].append(time.perf_counter() - t0)
      r1 = os.times()
      cpu[name].append(r1.user - r0.user + r1.system - r0.system)
  return wall, cpu
