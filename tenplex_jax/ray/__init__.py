"""``tenplex_jax.ray``: elastic JAX jobs on Ray (``tenplex_jax[ray]``).

The code lives in :mod:`tenplex_jax.runtime.ray`; this old path is that
same module (every name, ``tray.NAMESPACE`` and ``tray.UsageError``
included), for existing imports (``from tenplex_jax import ray as tray``).
"""

import sys

from tenplex_jax.runtime import ray as _runtime_ray

sys.modules[__name__] = _runtime_ray
