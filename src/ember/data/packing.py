"""Pack one split's token stream into fixed-length rows and write them as .npy shards.

Every document is followed by the separator id; the stream is cut into rows of
`seq_len` tokens regardless of document boundaries (as GPT-2 and RoBERTa do), and the
final partial row is dropped. Each shard is written to a temporary name and renamed.

With `boundaries`, each shard gets a companion `<shard>.docs.npz` holding, for every
row, the positions where a document starts (CSR form: `starts`, and `indptr` with one
entry per row plus one), which training with `data.document_mask` reads to keep attention
inside each document.

With `curriculum`, the split also gets `<split>_curriculum.npy`: one float32 per row,
the mean over the row's tokens of the key of the document each token belongs to (the
separator counts with the document it ends). The loader can visit rows in ascending key
order. Only one float per row is kept in memory, never one per token.
"""

from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ember.atomic import write_atomic


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 65536 else "uint32"  # ids 0 .. 65535


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.npy"


def curriculum_name(split: str) -> str:
    return f"{split}_curriculum.npy"


def boundaries_name(shard: str) -> str:
    return shard[: -len(".npy")] + ".docs.npz"


class _HashingWriter:
    """Passes writes through to `handle`, hashing them on the way."""

    def __init__(self, handle):
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.handle.write(data)


def save_shard(path: Path, rows: np.ndarray) -> str:
    """Write `rows` as .npy atomically and return its sha256. Hashing while writing keeps
    no encoded copy of the shard in memory (numpy hands a non-file writer chunks of at
    most 16 MiB)."""
    digest = []

    def write(handle) -> None:
        sink = _HashingWriter(handle)
        np.save(sink, rows, allow_pickle=False)
        digest.append(sink.digest.hexdigest())

    write_atomic(path, write)
    return digest[0]


def save_boundaries(path: Path, starts: np.ndarray, indptr: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.savez(buffer, starts=starts, indptr=indptr)
    return _save_bytes(path, buffer.getvalue())


def document_starts(rows: np.ndarray, sep_id: int, after_sep: bool) -> tuple[np.ndarray, np.ndarray]:
    """(starts, indptr): per row, the positions that begin a document. A position begins
    one when the token before it (in stream order) is a separator; `after_sep` says
    whether the token before the first row was one (or the stream begins there)."""
    flat = rows.ravel()
    begins = np.empty(len(flat), dtype=bool)
    begins[0] = after_sep
    begins[1:] = flat[:-1] == sep_id
    row, col = np.nonzero(begins.reshape(rows.shape))
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=len(rows)), out=indptr[1:])
    return col.astype(np.uint32), indptr


def _save_bytes(path: Path, data: bytes) -> str:
    write_atomic(path, lambda handle: handle.write(data))
    return hashlib.sha256(data).hexdigest()


class SplitWriter:
    """Accepts tokenized documents of one split and writes its shards as they fill."""

    def __init__(self, out_dir: Path, split: str, seq_len: int, dtype: str, sep_id: int,
                 shard_sequences: int, count_vocab: int = 0, boundaries: bool = False,
                 curriculum: bool = False):
        self.out_dir, self.split, self.seq_len = out_dir, split, seq_len
        self.dtype, self.sep_id, self.shard_sequences = np.dtype(dtype), sep_id, shard_sequences
        self.tail = np.zeros(0, dtype=self.dtype)  # tokens not yet filling a row
        self.rows: list[np.ndarray] = []  # full rows waiting for a shard
        self.n_rows_waiting = 0
        self.shards: list[dict] = []
        self.documents = 0
        self.boundaries = boundaries
        self._after_sep = True  # the stream begins with a document
        self.curriculum = curriculum
        self.key_tail = np.zeros(0, dtype=np.float32)  # per-token keys of `tail`
        self.row_keys: list[np.ndarray] = []  # float32, one per full row so far
        # Token frequencies of the written rows, for the unigram entropy (train only).
        self.counts = np.zeros(count_vocab, dtype=np.int64) if count_vocab else None

    def add(self, documents: Sequence[Sequence[int]], doc_keys: Sequence[float] | None = None) -> None:
        if not documents:
            return
        sep = [self.sep_id]
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(d, sep) for d in documents),
                           dtype=self.dtype)
        self._add_stream(flat, len(documents), self._token_keys(doc_keys, [len(d) for d in documents]))

    def add_flat(self, ids: np.ndarray, lengths: np.ndarray, doc_keys: np.ndarray | None = None) -> None:
        """Documents given as one array of ids and each document's length (all > 0)."""
        if len(lengths) == 0:
            return
        ends = np.cumsum(lengths)
        flat = np.insert(ids.astype(self.dtype, copy=False), ends, self.sep_id)
        self._add_stream(flat, len(lengths), self._token_keys(doc_keys, lengths))

    def _token_keys(self, doc_keys, lengths) -> np.ndarray | None:
        if not self.curriculum:
            return None
        if doc_keys is None or len(doc_keys) != len(lengths):
            raise ValueError("a curriculum writer needs one key per document.")
        return np.repeat(np.asarray(doc_keys, dtype=np.float32), np.asarray(lengths, dtype=np.int64) + 1)

    def _add_stream(self, flat: np.ndarray, n_documents: int, keys: np.ndarray | None = None) -> None:
        self.documents += n_documents
        stream = np.concatenate([self.tail, flat])
        n_rows = len(stream) // self.seq_len
        cut = n_rows * self.seq_len
        self.tail = stream[cut:].copy()
        if keys is not None:
            key_stream = np.concatenate([self.key_tail, keys])
            self.key_tail = key_stream[cut:].copy()
            if n_rows:
                means = key_stream[:cut].reshape(n_rows, self.seq_len).mean(axis=1, dtype=np.float64)
                self.row_keys.append(means.astype(np.float32))
        if n_rows:
            self.rows.append(stream[:cut].reshape(n_rows, self.seq_len))
            self.n_rows_waiting += n_rows
        while self.n_rows_waiting >= self.shard_sequences:
            self._write(self.shard_sequences)

    def _write(self, n: int) -> None:
        waiting = np.concatenate(self.rows) if len(self.rows) > 1 else self.rows[0]
        shard, rest = waiting[:n], waiting[n:]
        # A copy, not a view: a view would keep the whole concatenated buffer alive
        # until the next shard, doubling the packing buffer.
        self.rows = [rest.copy()] if len(rest) else []
        self.n_rows_waiting = len(rest)
        name = shard_name(self.split, len(self.shards))
        shard = np.ascontiguousarray(shard)
        entry = {"file": name, "sequences": int(len(shard))}
        if self.boundaries:
            starts, indptr = document_starts(shard, self.sep_id, self._after_sep)
            docs = boundaries_name(name)
            entry["doc_boundaries"] = {"file": docs, "sha256": save_boundaries(self.out_dir / docs, starts, indptr)}
        entry["sha256"] = save_shard(self.out_dir / name, shard)
        self._after_sep = bool(shard[-1, -1] == self.sep_id)
        if self.counts is not None:
            self.counts += np.bincount(shard.ravel(), minlength=len(self.counts))[: len(self.counts)]
        self.shards.append(entry)

    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What `restore` needs to continue this writer: plain values, and arrays (waiting
        rows and keys joined into one, as `_write` and `finish` would join them)."""
        meta = {"split": self.split, "seq_len": self.seq_len, "dtype": self.dtype.name, "sep_id": self.sep_id,
                "shard_sequences": self.shard_sequences, "shards": self.shards, "documents": self.documents,
                "boundaries": self.boundaries, "after_sep": self._after_sep, "curriculum": self.curriculum}
        empty = np.zeros((0, self.seq_len), dtype=self.dtype)
        arrays = {"tail": self.tail, "key_tail": self.key_tail,
                  "rows": np.concatenate(self.rows) if self.rows else empty,
                  "row_keys": np.concatenate(self.row_keys) if self.row_keys else np.zeros(0, dtype=np.float32)}
        if self.counts is not None:
            arrays["counts"] = self.counts
        return meta, arrays

    @classmethod
    def restore(cls, out_dir: Path, meta: dict, arrays: dict[str, np.ndarray]) -> SplitWriter:
        writer = cls(out_dir, meta["split"], meta["seq_len"], meta["dtype"], meta["sep_id"], meta["shard_sequences"],
                     boundaries=meta["boundaries"], curriculum=meta["curriculum"])
        writer.shards, writer.documents, writer._after_sep = meta["shards"], meta["documents"], meta["after_sep"]
        writer.tail, writer.key_tail = arrays["tail"], arrays["key_tail"]
        writer.rows = [arrays["rows"]] if len(arrays["rows"]) else []
        writer.n_rows_waiting = len(arrays["rows"])
        writer.row_keys = [arrays["row_keys"]] if len(arrays["row_keys"]) else []
        writer.counts = arrays.get("counts")
        return writer

    def finish(self) -> dict:
        """Write the last shard (the partial row is dropped) and return the split's entry."""
        if self.n_rows_waiting:
            self._write(self.n_rows_waiting)
        sequences = sum(s["sequences"] for s in self.shards)
        entry = {"sequences": sequences, "tokens": sequences * self.seq_len,
                 "documents": self.documents, "shards": self.shards}
        if self.curriculum:
            keys = np.concatenate(self.row_keys) if self.row_keys else np.zeros(0, dtype=np.float32)
            name = curriculum_name(self.split)
            entry["curriculum"] = {"file": name, "sha256": save_shard(self.out_dir / name, keys)}
        return entry


def unigram_entropy(counts: np.ndarray) -> float:
    """Shannon entropy in nats of the token distribution: the loss of a model that
    knows token frequencies and nothing else."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
