"""The runtime: what starts, resizes and restarts a training job.

* :mod:`tenplex_jax.runtime.env`: the ``TENPLEX_*`` environment a launcher
  gives each training process, read in one place (:class:`JobEnv`).

The package face imports nothing. It used to import the store first, as
the store's face imported the launcher's names (``tenplex_jax.store.launch``
is :mod:`tenplex_jax.runtime.launch`) and a launcher imported before it met
itself half-initialised; the store's face now loads those names on first
use, so either can be imported first (``tests/test_orbax_fixed.py``).
No store module loads the launchers by importing one of these modules.
"""
