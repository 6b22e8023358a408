"""The LM example's data: token sequences generated in code, stored as ArrayRecord.

Each sequence follows ``t[i+1] = (a * t[i] + b) mod vocab`` with its own
``(a, b)`` from a small set, so the model has to read the rule off the
context. :func:`write_dataset` writes them as int32 records into sharded
ArrayRecord files (``lm.array_record-00000-of-00004``, ...) and indexes them
(``tenplex_jax.data.build_index``); :func:`source` does that once per
directory and returns the random-access source ``ElasticIterator`` reads;
:func:`packed_iterator` reads variable-length sequences packed into rows
(``tenplex_jax.data.PackedIterator``).

  python examples/lm/data.py --out /tmp/lm-data            # fixed length, 4 shard files
  python examples/lm/data.py --out /tmp/lm-var --variable  # variable lengths, for packing
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile

import numpy as np

from tenplex_jax.data import (
    DatasetReader,
    PackedIterator,
    build_index,
    load_index,
    save_index,
)
from tenplex_jax.data.arrayrecord import write_array_record

RULES = [(1, 1), (3, 1), (5, 3), (7, 2)]
INDEX_DIR = "index"
VERSION = 1  # in the cache directory's name: bump when generate() changes


def generate(vocab, seq_len, n=1024, seed=0, *, variable=False):
  """``n`` token sequences (int32) of ``seq_len + 1`` tokens, or, with
  ``variable``, of 2 to ``2 * (seq_len + 1)`` tokens each."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    a, b = RULES[rng.integers(len(RULES))]
    length = int(rng.integers(2, 2 * (seq_len + 1) + 1)) if variable else seq_len + 1
    t = np.empty(length, np.int64)
    t[0] = rng.integers(vocab)
    for i in range(length - 1):
      t[i + 1] = (a * t[i] + b) % vocab
    out.append(t.astype(np.int32))
  return out


def write_dataset(out_dir, vocab, seq_len, n=1024, seed=0, *, shards=4, variable=False):
  """Writes the sequences as ``shards`` ArrayRecord files and their index; returns
  the index directory. Sample ``k`` is record ``k // shards_size`` of its file,
  files in order."""
  os.makedirs(out_dir, exist_ok=True)
  seqs = generate(vocab, seq_len, n, seed, variable=variable)
  per = -(-n // shards)
  paths = []
  for k in range(shards):
    path = os.path.join(out_dir, f"lm.array_record-{k:05d}-of-{shards:05d}")
    write_array_record(path, (s.tobytes() for s in seqs[k * per:(k + 1) * per]))
    paths.append(path)
  return save_index(build_index(paths), os.path.join(out_dir, INDEX_DIR))


def decode(record):
  """A record's bytes -> ``{"tokens": int32 array}`` (the sample the trainer reads)."""
  return {"tokens": np.frombuffer(record, np.int32)}


def _default_dir(cfg, n, seed, variable):
  name = f"tenplex-lm-data{VERSION}-v{cfg.vocab}-s{cfg.seq_len}-n{n}-seed{seed}" + \
      ("-var" if variable else "")
  return os.path.join(tempfile.gettempdir(), name)


def prepare(cfg, workdir=None, n=1024, seed=0, *, variable=False):
  """Writes the dataset into ``workdir`` unless it is there already; returns the
  index directory. Written into a temporary sibling and renamed, so processes
  starting together do not see half-written files. ``workdir=None``: a
  directory under the system temp dir named after the config."""
  workdir = workdir or _default_dir(cfg, n, seed, variable)
  index_dir = os.path.join(workdir, INDEX_DIR)
  if not os.path.exists(os.path.join(index_dir, "index.json")):
    parent = os.path.dirname(os.path.abspath(workdir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".lm-data-")
    try:
      write_dataset(tmp, cfg.vocab, cfg.seq_len, n, seed, variable=variable)
      try:
        os.rename(tmp, workdir)
      except OSError:  # another process won the race (or workdir exists but is empty)
        if not os.path.exists(os.path.join(index_dir, "index.json")):
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return index_dir


def source(cfg, workdir=None, n=1024, seed=0):
  """The trainer's source: a ``DatasetReader`` over the ArrayRecord files whose
  samples are ``{"tokens": (seq_len + 1,) int32}``; pass it to ``ElasticIterator``.
  The files hold the same sequences the in-code generator gives."""
  index_dir = prepare(cfg, workdir, n, seed)
  return DatasetReader(load_index(index_dir, data_root=os.path.dirname(index_dir)),
                       decode_record=decode)


def token_lengths(reader):
  """Each sample's token count, from the index alone (record bytes / 4)."""
  return np.asarray(reader.index.entries[:, 2]) // np.dtype(np.int32).itemsize


@functools.lru_cache(maxsize=8)
def packed_reader(cfg, workdir=None, n=1024, data_seed=0):
  """The reader over the variable-length sequences (written once), shared by calls."""
  index_dir = prepare(cfg, workdir, n, data_seed, variable=True)
  return DatasetReader(load_index(index_dir, data_root=os.path.dirname(index_dir)),
                       decode_record=decode)


def packed_iterator(cfg, workdir=None, *, rows_per_batch, seed, shard_index=0, shard_count=1,
                    n=1024, data_seed=0, keep=None, **kwargs):
  """Variable-length sequences packed into rows of ``seq_len + 1`` tokens.

  Each batch holds this shard's rows of ``rows_per_batch`` global rows:
  ``tokens``, ``segment_ids``, ``positions``, ``sample_ids``, ``source_pos``,
  ``mask`` (see ``tenplex_jax.data.PackedIterator``). The global batches do
  not depend on ``shard_count``; restore with ``set_state`` under any count.
  Without ``keep`` the plan uses the index's record lengths and a shard reads
  only its own rows' records.
  """
  reader = packed_reader(cfg, None if workdir is None else os.fspath(workdir), n, data_seed)
  return PackedIterator(reader, seq_len=cfg.seq_len + 1, rows_per_batch=rows_per_batch,
                        seed=seed, shard_index=shard_index, shard_count=shard_count,
                        keep=keep, lengths=token_lengths(reader), **kwargs)


def next_token_weights(segment_ids):
  """Loss weights of next-token prediction on packed rows: ``(rows, L - 1)`` float32,
  1 where the target ``tokens[:, 1:]`` is in the same piece as the input."""
  seg = np.asarray(segment_ids)
  return ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(np.float32)


def packed_batch(cfg, mesh, data_state, rows_per_batch, *, seed=0, workdir=None, n=1024,
                 data_seed=0):
  """One packed global batch on ``mesh``, the packed twin of ``train.batches``.

  Each data shard (``data`` x ``fsdp``) reads its rows through its own
  ``PackedIterator`` continuing from ``data_state`` (None: the start); the
  rows are concatenated and put on the mesh along ``("data", "fsdp")``.
  ``rows_per_batch`` must divide by that shard count.

  Returns:
    ``(batch, new_state)``: ``batch`` holds ``tokens``, ``segment_ids`` and
    ``positions`` (``(rows, seq_len + 1)``) and ``weights``
    (:func:`next_token_weights`), as jax arrays; ``new_state`` is the state
    after this step (the same for every shard count).
  """
  import jax  # noqa: PLC0415 - only the mesh helper needs jax
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  its = [packed_iterator(cfg, workdir, rows_per_batch=rows_per_batch, seed=seed,
                         shard_index=i, shard_count=shards, n=n, data_seed=data_seed)
         for i in range(shards)]
  if data_state is not None:
    for it in its:
      it.set_state(data_state)
  parts = [next(it) for it in its]
  new_state = its[0].get_state()
  host = {k: np.concatenate([p[k] for p in parts])
          for k in ("tokens", "segment_ids", "positions")}
  host["weights"] = next_token_weights(host["segment_ids"])
  spec = NamedSharding(mesh, P(("data", "fsdp")))
  return {k: jax.device_put(v, spec) for k, v in host.items()}, new_state


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="directory for the ArrayRecord files and index")
  p.add_argument("--vocab", type=int, default=64)
  p.add_argument("--seq-len", type=int, default=16)
  p.add_argument("--samples", type=int, default=1024)
  p.add_argument("--shards", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--variable", action="store_true",
                 help="variable-length sequences (2 .. 2*(seq_len+1) tokens), for packing")
  a = p.parse_args(argv)
  index_dir = write_dataset(a.out, a.vocab, a.seq_len, a.samples, a.seed, shards=a.shards,
                            variable=a.variable)
  index = load_index(index_dir)
  print(json.dumps({"index": index_dir, "num_samples": index.num_samples,
                    "files": [f.name for f in index.files],
                    "fingerprint": index.fingerprint}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
