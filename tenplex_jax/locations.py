"""Where a store or a checkpoint lives: one parse of a location string.

Every verb that takes a location (``tenplex_jax.store.save/restore/
replicate``, ``store ls/gc/verify``, ``tenplex_jax.orbax.inspect/restore/
convert``, ``tenplex-jax ckpt``) asks :func:`parse_location` what kind it
is; nothing else looks at prefixes. A string without ``SCHEME://`` is a
local path; a scheme not in :data:`SCHEMES` is an error naming the known
ones (never a local directory called ``foo:``).
"""

from __future__ import annotations

import dataclasses
import os
import re

from tenplex_jax.errors import UsageError

__all__ = ["LOCAL", "OBJECT", "PEER", "SCHEMES", "Location",
           "parse_location"]

LOCAL, PEER, OBJECT = "local", "peer", "object"

#: scheme -> kind: a local directory, a store server (tenplex's HTTP
#: peers), an object-storage bucket.
SCHEMES = {"file": LOCAL, "http": PEER, "https": PEER, "s3": OBJECT,
           "gs": OBJECT}

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True)
class Location:
  """A parsed location.

  Attributes:
    kind: :data:`LOCAL`, :data:`PEER` or :data:`OBJECT`.
    scheme: ``""`` for a plain path, else the URL's scheme.
    target: the local path (``file://`` removed), or the URL (trailing
      ``/`` removed).
  """

  kind: str
  scheme: str
  target: str


def parse_location(location) -> Location:
  """What kind of location ``location`` is.

  Raises:
    UsageError: a URL whose scheme is not one of :data:`SCHEMES` (the
      message names them), or not a string or path.

  Example:
    >>> parse_location("s3://ckpts/run1/")
    Location(kind='object', scheme='s3', target='s3://ckpts/run1')
    >>> parse_location("/dev/shm/store").kind
    'local'
    >>> parse_location("foo://x")
    Traceback (most recent call last):
    ...
    tenplex_jax.errors.UsageError: location 'foo://x': unknown scheme 'foo'; known: file://, gs://, http://, https://, s3:// (or a local path)
  """
  if isinstance(location, os.PathLike):
    location = os.fspath(location)
  if not isinstance(location, str) or not location:
    raise UsageError(f"location {location!r}: expected a directory or a URL"
                     f" ({_known()})")
  m = _SCHEME.match(location)
  if m is None:
    return Location(LOCAL, "", location)
  scheme = m.group(1).lower()
  kind = SCHEMES.get(scheme)
  if kind is None:
    raise UsageError(f"location {location!r}: unknown scheme {scheme!r};"
                     f" known: {_known()} (or a local path)")
  if kind == LOCAL:
    path = location[m.end():]
    if not path.startswith("/"):
      raise UsageError(f"location {location!r}: a file:// URL needs an"
                       " absolute path (file:///DIR)")
    return Location(LOCAL, scheme, path)
  rest = location[m.end():].rstrip("/")
  if not rest:
    raise UsageError(f"location {location!r}: no host or bucket")
  return Location(kind, scheme, f"{scheme}://{rest}")


def _known() -> str:
  return ", ".join(s + "://" for s in sorted(SCHEMES))
