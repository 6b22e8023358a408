"""Elastic dataset state: an order independent of the device count, exactly-once samples.

* :mod:`~tenplex_jax.data.order`: the epoch order and the split of a global batch;
* :mod:`~tenplex_jax.data.index`: the byte-range dataset index and its reader;
* :mod:`~tenplex_jax.data.records`: a length-prefixed record format;
* :mod:`~tenplex_jax.data.iterator`: :class:`ElasticIterator`;
* :mod:`~tenplex_jax.data.packing`: :class:`PackedIterator` (filtering and
  sequence packing, exactly once under any shard count);
* :mod:`~tenplex_jax.data.arrayrecord`: ArrayRecord files (write, scan, read);
* :mod:`~tenplex_jax.data.checkpoint`: the iterator state in Orbax, in Grain's
  layout, restorable under any process count; a Grain iterator wrapper;
* :mod:`~tenplex_jax.data.rng`: per-sample PRNG keys.
"""

from tenplex_jax.data.index import (
    DatasetIndex,
    DatasetReader,
    FileEntry,
    build_index,
    index_fingerprint,
    load_index,
    save_index,
)
from tenplex_jax.data.iterator import ElasticIterator
from tenplex_jax.data.order import (
    PAD_ID,
    epoch_permutation,
    epoch_seed_sequence,
    global_batch_ids,
    shard_batch_ids,
    shard_bounds,
    steps_per_epoch,
)
from tenplex_jax.data.packing import PackedIterator, pack_rows
from tenplex_jax.data.records import RECORD_MAGIC, read_records, scan_records, write_records
from tenplex_jax.data.rng import sample_key, sample_key_data, sample_keys
from tenplex_jax.errors import DataError

__all__ = [
    "PAD_ID",
    "RECORD_MAGIC",
    "DataError",
    "DatasetIndex",
    "DatasetReader",
    "ElasticIterator",
    "FileEntry",
    "IteratorHandler",
    "IteratorRestore",
    "IteratorSave",
    "PackedIterator",
    "as_grain_iterator",
    "build_index",
    "epoch_permutation",
    "epoch_seed_sequence",
    "global_batch_ids",
    "index_fingerprint",
    "load_index",
    "pack_rows",
    "read_records",
    "read_state",
    "sample_key",
    "sample_key_data",
    "sample_keys",
    "save_index",
    "scan_records",
    "shard_batch_ids",
    "shard_bounds",
    "steps_per_epoch",
    "write_records",
]

# The Orbax handler imports orbax.checkpoint (seconds): loaded on first use.
_CHECKPOINT_NAMES = ("IteratorHandler", "IteratorRestore", "IteratorSave", "as_grain_iterator",
                     "read_state")


def __getattr__(name: str):
  if name in _CHECKPOINT_NAMES:
    from tenplex_jax.data import checkpoint  # noqa: PLC0415 - lazy, see above
    return getattr(checkpoint, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
