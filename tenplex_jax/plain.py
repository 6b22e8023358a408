"""Plain (non-array) leaves of a saved state as JSON: numbers, strings,
``None``, complex numbers and numpy arrays or scalars (bytes in base64).

The store's snapshot manifests keep them this way; the store's writer and
its readers (``store.api``, ``store.source.StoreSource``) share these two
functions, so neither imports the other.
"""

from __future__ import annotations

import base64
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["decode_plain", "encode_plain"]


def encode_plain(x: Any) -> Any:
  """The JSON form of a non-array leaf; ``TypeError`` if it has none.

  >>> encode_plain(3), encode_plain(1 + 2j)
  (3, {'__complex__': [1.0, 2.0]})
  >>> decode_plain(encode_plain(np.float32(0.5))).dtype
  dtype('float32')
  """
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, complex):
    return {"__complex__": [x.real, x.imag]}
  if isinstance(x, (np.ndarray, np.generic)):
    a = np.asarray(x)
    if a.dtype.hasobject:
      raise TypeError("a numpy array of Python objects")
    # ``str`` spells numpy's own dtypes exactly ('<U3'); ml_dtypes' (bfloat16,
    # int4) need their name.
    dt = a.dtype.str if np.dtype(a.dtype.str) == a.dtype else a.dtype.name
    return {"__ndarray__": base64.b64encode(a.tobytes()).decode(),
            "dtype": dt, "shape": list(a.shape),
            "scalar": isinstance(x, np.generic)}
  raise TypeError(f"a {type(x).__module__}.{type(x).__qualname__}")


def decode_plain(v: Any) -> Any:
  """The saved non-array leaf, with its saved type (numpy scalars keep their
  dtype).

  >>> decode_plain({"__complex__": [1.0, 2.0]}), decode_plain("x")
  ((1+2j), 'x')
  """
  if isinstance(v, dict) and "__ndarray__" in v:
    a = np.frombuffer(base64.b64decode(v["__ndarray__"]),
                      dtype=jnp.dtype(v["dtype"])).reshape(v["shape"]).copy()
    return a[()] if v.get("scalar") else a
  if isinstance(v, dict) and "__complex__" in v:
    return complex(*v["__complex__"])
  return v
