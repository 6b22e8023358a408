"""Typed exceptions raised by tenplex_jax.

Every exception subclasses a built-in so callers may catch either. Messages
name the leaf (its key path), the axis and the numbers involved.
"""


class TenplexError(Exception):
  """Base class of all tenplex_jax errors.

  Attributes:
    problems: for errors about many leaves, every problem found, one
      :class:`tenplex_jax._problems.Problem` per leaf (``str()`` of each is
      ``"<leaf path>: <what is wrong>"``); the message groups them, one line
      per distinct problem with a count and the first few leaves. Empty for
      errors about one thing.
  """

  problems: tuple = ()


class LayoutError(TenplexError, ValueError):
  """A layout (PTC) or sharding is malformed or does not match a tree."""


class PlanError(TenplexError, ValueError):
  """Two layouts cannot be planned against each other."""


class ReshardError(TenplexError, RuntimeError):
  """Executing a plan on devices failed; the source state is left intact."""


class ReplicationWarning(UserWarning):
  """A dimension the new mesh cannot divide falls back to replication."""


class UnmatchedRuleWarning(UserWarning):
  """Layout rules match no tensor (allowed by ``allow_unmatched=True``)."""

class DataError(TenplexError, ValueError):
  """A dataset, its index or an iterator state is malformed or does not match."""

class SearchError(TenplexError, ValueError):
  """A configuration search got inputs it cannot search (unknown preset,
  impossible topology, no feasible layout)."""


class StoreError(TenplexError, IOError):
  """A tensor store cannot be written or read; names the host and path."""


class ChecksumError(StoreError):
  """A stored chunk does not match its checksum (corrupt data)."""


class NoCopyError(StoreError):
  """No surviving store holds some piece of the state (data lost).

  Attributes:
    dead_sources: the store locations that did not answer (a dead store
      server): the missing pieces may be there. Empty when every store
      answered.
  """

  dead_sources: tuple[str, ...] = ()


class UnreachableError(StoreError):
  """A store server did not answer (dead, or every attempt timed out)."""


class TLSError(StoreError):
  """Store traffic cannot be protected as configured: a plain ``http://``
  location while a CA file is set (TLS is required), a server whose
  certificate does not verify against the CA, or one that does not speak
  TLS; names the location."""


class TreeError(TenplexError, ValueError):
  """A tree given to ``store.save``, or a restore or convert target, has
  leaves the store cannot handle or that do not match the saved state; names
  every such leaf's path with the saved and the given shape, dtype or type.

  Not a :class:`StoreError`: nothing failed to read or write, the input is
  wrong (the CLI exits 2, and no fallback to another copy is tried)."""


class UnsafePathError(StoreError):
  """A store root, a directory inside or above it, or a token file is owned
  by another user or open to group or others (who could replace the stored
  state or read the job's token); names the path, its owner and mode, and
  the fix. Raised before anything is written there or read from it."""


class LocationError(StoreError):
  """An object-storage location cannot be used: its bucket does not exist,
  the credentials are refused, or its server does not answer. The message
  names the location and the environment variables that chose the server."""


class UsageError(TenplexError, ValueError):
  """A command-line verb or a library call got input it cannot use (a bad
  flag value, a missing file, a path that is not what it should be). The CLI
  reports it as ``tenplex-jax: error: <message>`` and exits 2; other
  ``TenplexError``s and ``OSError``s exit 1."""
