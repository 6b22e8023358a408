"""Test set-up: 8 simulated CPU devices, configured before jax initialises."""

import os

# Must run before jax creates its backends; conftest is imported first.
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
