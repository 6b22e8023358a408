"""``tenplex_jax.store.launch``: the launcher and a training script's calls.

The code lives in :mod:`tenplex_jax.runtime.launch`; this old path is that
same module, for existing imports (``from tenplex_jax.store.launch import
launch``) and for ``tenplex_jax.store``'s own re-exports.
"""

import sys

from tenplex_jax.runtime import launch as _runtime_launch

sys.modules[__name__] = _runtime_launch
