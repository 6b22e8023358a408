"""The runtime: what starts, resizes and restarts a training job.

* :mod:`tenplex_jax.runtime.env`: the ``TENPLEX_*`` environment a launcher
  gives each training process, read in one place (:class:`JobEnv`).

The package face imports only the store (below the runtime), first: the
store's face re-exports the launcher's names (``tenplex_jax.store.launch``
is :mod:`tenplex_jax.runtime.launch`), so a launcher module imported before
the store would meet itself half-initialised. ``tenplex_jax`` imported the
store eagerly before its parts loaded on first use; this keeps that order.
No store module loads the launchers by importing one of these modules.
"""

import tenplex_jax.store  # noqa: F401 - first; see above
