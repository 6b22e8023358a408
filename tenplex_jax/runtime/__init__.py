"""The runtime: what starts, resizes and restarts a training job.

* :mod:`tenplex_jax.runtime.env`: the ``TENPLEX_*`` environment a launcher
  gives each training process, read in one place (:class:`JobEnv`).

The package face imports nothing, so that the store (below the runtime)
never loads the launchers by importing one of their modules.
"""
