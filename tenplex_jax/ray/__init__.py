"""``tenplex_jax.ray``: elastic JAX jobs on Ray (``tenplex_jax[ray]``).

The code lives in :mod:`tenplex_jax.runtime.ray`; this path stays for
existing imports (``from tenplex_jax import ray as tray``).
"""

from tenplex_jax.runtime.ray import *  # noqa: F403
from tenplex_jax.runtime.ray import __all__  # noqa: F401
