"""ArrayRecord files (the ``array-record`` package): write, scan, random reads.

ArrayRecord (the format Grain and TFDS read) stores records in compressed
chunks with a footer index, so a record has no byte range of its own: the
dataset index (:func:`tenplex_jax.data.build_index`) records, per sample,
``(file_id, record_index, byte_length)`` and :class:`tenplex_jax.data.DatasetReader`
reads record ``record_index`` through an ``ArrayRecordReader`` opened for
random access (``readahead_buffer_size:0,max_parallelism:0``, as Grain's
``ArrayRecordDataSource`` does). A file is recognised by ``.array_record`` in
its name, with or without a shard suffix (``train.array_record-00001-of-00004``).

The package is an optional dependency (``pip install "tenplex_jax[data]"``);
it is imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from tenplex_jax.errors import DataError

SUFFIX = ".array_record"
READ_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def _module():
  try:
    from array_record.python import array_record_module  # noqa: PLC0415 - optional
  except ImportError as e:
    raise DataError("ArrayRecord files need the array-record package: pip install "
                    "'tenplex_jax[data]' (or array-record>=0.8.6)") from e
  return array_record_module


def is_array_record(path: str | os.PathLike) -> bool:
  """Whether a file name is an ArrayRecord file (``.array_record`` plus an optional shard suffix).

  Example:
    >>> is_array_record("d/train.array_record-00001-of-00004"), is_array_record("a.npy")
    (True, False)
  """
  return SUFFIX in os.path.basename(os.fspath(path))


def write_array_record(path: str | os.PathLike, payloads: Iterable[bytes], *,
                       group_size: int = 1) -> int:
  """Writes payloads as a new ArrayRecord file.

  Args:
    path: the file to create (its name should contain ``.array_record``).
    payloads: the records, each ``bytes``.
    group_size: keyword-only; records per compressed chunk. 1 (the default)
      makes every random read decompress one record; larger groups compress
      better and suit sequential reads.

  Returns:
    The number of records written.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.array_record")
    >>> write_array_record(p, [b"ab", b"", b"xyz"])
    3
    >>> read_array_record(p, [2, 0])
    [b'xyz', b'ab']
  """
  if not isinstance(group_size, int) or group_size < 1:
    raise DataError(f"group_size must be an int >= 1, got {group_size!r}")
  writer = _module().ArrayRecordWriter(os.fspath(path), f"group_size:{group_size}")
  if not writer.ok():
    raise DataError(f"{os.fspath(path)!r}: cannot create an ArrayRecord file here")
  count = 0
  try:
    for payload in payloads:
      writer.write(bytes(payload))
      count += 1
  finally:
    writer.close()
  return count


def open_reader(path: str | os.PathLike):
  """An ``ArrayRecordReader`` for random access; raises OSError if it cannot open the file.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.array_record")
    >>> _ = write_array_record(p, [b"x"])
    >>> r = open_reader(p); r.num_records()
    1
    >>> r.close()
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path!r}: no such ArrayRecord file")
  reader = _module().ArrayRecordReader(path, READ_OPTIONS)
  if not reader.ok():
    try:
      reader.close()  # raises the reader's error status
      detail = ""
    except RuntimeError as e:
      detail = f": {e}"
    raise OSError(f"{path!r} is not a readable ArrayRecord file{detail}")
  return reader


def read_array_record(path: str | os.PathLike, indices: Iterable[int]) -> list[bytes]:
  """Reads the records at ``indices`` of one file (random access).

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.array_record")
    >>> _ = write_array_record(p, [b"a", b"b"])
    >>> read_array_record(p, [1])
    [b'b']
  """
  reader = open_reader(path)
  try:
    return list(reader.read([int(i) for i in indices]))
  finally:
    reader.close()


def scan_array_record(path: str | os.PathLike, *, chunk: int = 4096) -> np.ndarray:
  """The byte length of every record of a file: reads the file once, ``chunk`` records at a time.

  Raises:
    DataError: the file is not a readable ArrayRecord file.

  Example:
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.array_record")
    >>> _ = write_array_record(p, [b"ab", b"", b"xyz"])
    >>> scan_array_record(p).tolist()
    [2, 0, 3]
  """
  try:
    reader = open_reader(path)
  except OSError as e:
    raise DataError(str(e)) from None
  try:
    n = reader.num_records()
    out = np.zeros(n, np.int64)
    for start in range(0, n, chunk):
      stop = min(n, start + chunk)
      out[start:stop] = [len(r) for r in reader.read(start, stop)]
    return out
  finally:
    reader.close()
