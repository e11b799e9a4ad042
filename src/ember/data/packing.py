"""Pack one split's token stream into fixed-length rows and write them as .npy shards.

Every document is followed by the separator id; the stream is cut into rows of
`seq_len` tokens regardless of document boundaries (as GPT-2 and RoBERTa do), and the
final partial row is dropped. Each shard is written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ember.data.atomic import write_atomic


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.npy"


def save_shard(path: Path, rows: np.ndarray) -> str:
    """Write `rows` as .npy atomically and return its sha256."""
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    data = buffer.getvalue()
    write_atomic(path, lambda handle: handle.write(data))
    return hashlib.sha256(data).hexdigest()


class SplitWriter:
    """Accepts tokenized documents of one split and writes its shards as they fill."""

    def __init__(self, out_dir: Path, split: str, seq_len: int, dtype: str, sep_id: int,
                 shard_sequences: int, count_vocab: int = 0):
        self.out_dir, self.split, self.seq_len = out_dir, split, seq_len
        self.dtype, self.sep_id, self.shard_sequences = np.dtype(dtype), sep_id, shard_sequences
        self.tail = np.zeros(0, dtype=self.dtype)  # tokens not yet filling a row
        self.rows: list[np.ndarray] = []  # full rows waiting for a shard
        self.n_rows_waiting = 0
        self.shards: list[dict] = []
        self.documents = 0
        # Token frequencies of the written rows, for the unigram entropy (train only).
        self.counts = np.zeros(count_vocab, dtype=np.int64) if count_vocab else None

    def add(self, documents: Sequence[Sequence[int]]) -> None:
        if not documents:
            return
        self.documents += len(documents)
        sep = [self.sep_id]
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(d, sep) for d in documents),
                           dtype=self.dtype)
        stream = np.concatenate([self.tail, flat])
        n_rows = len(stream) // self.seq_len
        cut = n_rows * self.seq_len
        self.tail = stream[cut:].copy()
        if n_rows:
            self.rows.append(stream[:cut].reshape(n_rows, self.seq_len))
            self.n_rows_waiting += n_rows
        while self.n_rows_waiting >= self.shard_sequences:
            self._write(self.shard_sequences)

    def _write(self, n: int) -> None:
        waiting = np.concatenate(self.rows) if len(self.rows) > 1 else self.rows[0]
        shard, rest = waiting[:n], waiting[n:]
        self.rows = [rest] if len(rest) else []
        self.n_rows_waiting = len(rest)
        name = shard_name(self.split, len(self.shards))
        digest = save_shard(self.out_dir / name, np.ascontiguousarray(shard))
        if self.counts is not None:
            self.counts += np.bincount(shard.ravel(), minlength=len(self.counts))[: len(self.counts)]
        self.shards.append({"file": name, "sequences": int(len(shard)), "sha256": digest})

    def finish(self) -> dict:
        """Write the last shard (the partial row is dropped) and return the split's entry."""
        if self.n_rows_waiting:
            self._write(self.n_rows_waiting)
        sequences = sum(s["sequences"] for s in self.shards)
        return {"sequences": sequences, "tokens": sequences * self.seq_len,
                "documents": self.documents, "shards": self.shards}


def unigram_entropy(counts: np.ndarray) -> float:
    """Shannon entropy in nats of the token distribution: the loss of a model that
    knows token frequencies and nothing else."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
