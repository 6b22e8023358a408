"""A simple length-prefixed binary record format (``.tpxr``).

Layout of a record file::

    magic    8 bytes   b"TPXREC01"
    record*  repeated: length (8 bytes, unsigned little-endian) + payload

A payload is opaque bytes; its byte range in the file is
``[offset + 8, offset + 8 + length)`` where ``offset`` is the position of its
length prefix. Lengths are 64-bit, so neither records nor files have a 4 GiB
limit. :func:`tenplex_jax.data.build_index` indexes the payloads so a reader
fetches one record with one ranged read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator

from tenplex_jax.errors import DataError

RECORD_MAGIC = b"TPXREC01"
"""The first 8 bytes of every record file."""

_LEN = struct.Struct("<Q")


def write_records(path: str | os.PathLike, payloads: Iterable[bytes]) -> int:
  """Writes payloads to a new record file.

  Args:
    path: the file to create (overwritten if it exists).
    payloads: the records, each ``bytes`` (or bytes-like).

  Returns:
    The number of records written.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.tpxr")
    >>> write_records(p, [b"ab", b"", b"xyz"])
    3
    >>> list(read_records(p))
    [b'ab', b'', b'xyz']
  """
  count = 0
  with open(path, "wb") as f:
    f.write(RECORD_MAGIC)
    for payload in payloads:
      data = memoryview(payload).cast("B")
      f.write(_LEN.pack(data.nbytes))
      f.write(data)
      count += 1
  return count


def scan_records(path: str | os.PathLike) -> Iterator[tuple[int, int]]:
  """Yields ``(payload_offset, payload_length)`` of each record, reading only prefixes.

  Args:
    path: a record file written by :func:`write_records`.

  Yields:
    The byte range of each payload as ``(offset, length)`` Python ints.

  Raises:
    DataError: the file does not start with ``RECORD_MAGIC`` or is truncated.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.tpxr")
    >>> _ = write_records(p, [b"ab", b"xyz"])
    >>> list(scan_records(p))
    [(16, 2), (26, 3)]
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    magic = f.read(len(RECORD_MAGIC))
    if magic != RECORD_MAGIC:
      raise DataError(
          f"{os.fspath(path)!r} is not a record file: expected magic {RECORD_MAGIC!r}, "
          f"got {magic!r}")
    pos = len(RECORD_MAGIC)
    while pos < size:
      prefix = f.read(_LEN.size)
      if len(prefix) != _LEN.size:
        raise DataError(
            f"{os.fspath(path)!r}: truncated length prefix at byte {pos} (file size {size})")
      (length,) = _LEN.unpack(prefix)
      start = pos + _LEN.size
      if start + length > size:
        raise DataError(
            f"{os.fspath(path)!r}: record at byte {pos} claims {length} bytes but the "
            f"file ends at {size}")
      yield start, length
      pos = start + length
      f.seek(pos)


def read_records(path: str | os.PathLike) -> Iterator[bytes]:
  """Yields the payloads of a record file in order.

  Args:
    path: a record file written by :func:`write_records`.

  Yields:
    Each payload as ``bytes``.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.tpxr")
    >>> _ = write_records(p, [b"hello"])
    >>> next(read_records(p))
    b'hello'
  """
  with open(path, "rb") as f:
    for offset, length in scan_records(path):
      f.seek(offset)
      yield f.read(length)
