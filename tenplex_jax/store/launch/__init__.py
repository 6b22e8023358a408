"""``tenplex_jax.store.launch``: the launcher and a training script's calls.

The code lives in :mod:`tenplex_jax.runtime.launch`; this path stays for
existing imports (``from tenplex_jax.store.launch import launch``) and for
``tenplex_jax.store``'s own re-exports.
"""

from tenplex_jax.runtime.launch import *  # noqa: F403
from tenplex_jax.runtime.launch import (CA_ENV, TOKEN_ENV,  # noqa: F401
                                        __all__, check_tls_options,
                                        last_restore)
