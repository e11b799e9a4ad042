"""One packing pass: documents -> worker processes -> split, dedup, pack, write, in input order.

Workers clean and tokenize batches in parallel; the main process takes their results
strictly in submission order, so the shards are byte-identical whatever the worker
count. At most `2 * workers` batches are in flight, which bounds memory: the input is
read only as fast as the workers consume it.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ember.data.dedup import DedupConfig, Deduplicator
from ember.data.errors import DataError
from ember.data.packing import SplitWriter, unigram_entropy
from ember.data.progress import DocumentProgress
from ember.data.work import BatchResult, init_worker, process

BATCH_DOCUMENTS = 1000
HISTOGRAM_BINS = 32  # document lengths in tokens, bin k holding [2**k, 2**(k+1))


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT held back while workers start. A spawned process inherits the blocked mask, so
    a Ctrl-C that reaches the whole group waits in a new worker until its initializer ignores
    it (no traceback from a half-started interpreter), and in the main process until the
    workers are up, when it raises KeyboardInterrupt there (which stops the pool)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Workers:
    """`work.process` on batches, in `n` spawned processes (none: in this process)."""

    def __init__(self, n: int, tokenizer_json: str, clean: dict, dedup: dict, curriculum: str | None = None):
        self.n = n
        self.pool = None
        self.broken = False
        if n == 0:
            init_worker(tokenizer_json, clean, dedup, single_thread=False, curriculum=curriculum)
        else:
            # spawn, not fork: the parent may hold tokenizer threads, and fork copies their locks.
            # An executor, not a Pool: a worker killed (out of memory, say) fails the run
            # instead of leaving it waiting forever.
            self.pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=init_worker,
                                            initargs=(tokenizer_json, clean, dedup, n > 1, True, curriculum))
            with _sigint_blocked():  # a Ctrl-C is the main process's to handle
                for started in [self.pool.submit(os.getpid) for _ in range(n)]:  # one submit spawns one
                    started.result()

    def map(self, items: Iterator[tuple[object, list[str]]]) -> Iterator[tuple[object, BatchResult]]:
        if self.pool is None:
            for meta, docs in items:
                yield meta, process(docs)
            return
        pending: deque = deque()
        try:
            for meta, docs in items:
                pending.append((meta, self.pool.submit(process, docs)))
                if len(pending) >= 2 * self.n:
                    meta_out, future = pending.popleft()
                    yield meta_out, self._result(future)
            while pending:
                meta_out, future = pending.popleft()
                yield meta_out, self._result(future)
        except BrokenProcessPool:
            self.broken = True
            raise DataError("a tokenizing worker process died (out of memory?); "
                            "run the same command again with fewer --workers.") from None

    def _result(self, future) -> BatchResult:
        # The executor notices a dead worker itself, but on some Python versions its
        # bookkeeping thread can deadlock on the dead worker's pipe (CPython gh-94777,
        # gh-105829); looking at the processes' exit codes does not depend on it.
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if any(p.exitcode is not None for p in list((self.pool._processes or {}).values())):
                    raise BrokenProcessPool from None

    def close(self) -> None:
        if self.pool is None:
            return
        if self.broken:  # waiting could hang on the dead worker: end the others and move on
            for process in list((self.pool._processes or {}).values()):
                process.kill()
                process.join()
            # The executor's bookkeeping thread may be stuck reading a result the killed
            # worker never finished writing (gh-94777), and the interpreter joins that thread
            # at exit. With the workers gone, closing our end of the result pipe leaves it no
            # writer: its read ends, it marks the pool broken, and exit does not hang.
            self.pool._result_queue._writer.close()
            self.pool.shutdown(wait=False, cancel_futures=True)
        else:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class PassResult:
    splits: dict
    entropy: float
    dropped: Counter = field(default_factory=Counter)
    changed: Counter = field(default_factory=Counter)
    per_source: list = field(default_factory=list)  # {"documents", "tokens", "characters"} kept
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(HISTOGRAM_BINS, dtype=np.int64))
    documents_seen: int = 0


def _batches(stream: Iterator[tuple[int, str, int]], size: int) -> Iterator[tuple[np.ndarray, list[str]]]:
    """Batches of documents, with an array of (source index, key) per document."""
    meta: list[tuple[int, int]] = []
    docs: list[str] = []
    for source, doc, key in stream:
        meta.append((source, key))
        docs.append(doc)
        if len(docs) == size:
            yield np.array(meta, dtype=np.int64), docs
            meta, docs = [], []
    if docs:
        yield np.array(meta, dtype=np.int64), docs


def pack_pass(stream: Iterator[tuple[int, str, int]], workers: Workers, out_dir: Path, n_sources: int, *,
              seq_len: int, dtype: str, sep: int, vocab: int, val_fraction: float, seed: int,
              shard_sequences: int, progress: bool, force_val: bool, dedup: DedupConfig,
              boundaries: bool, val_mask: Callable, curriculum: str | None = None,
              resume: dict | None = None, save: Callable[[dict], None] | None = None) -> PassResult:
    """Tokenize, split, dedup and pack `stream`; `force_val` sends the first documents to
    val until it holds `seq_len` tokens (see prepare.py). `save(state)` is called after
    every batch that completed a shard; `resume`, such a state, continues from it (the
    documents it consumed are read past, not processed: see resume.py)."""
    if resume is not None:
        writers, deduper, out = resume["writers"], resume["deduper"], resume["out"]
        kept_docs, kept_tokens, kept_chars = resume["kept"]
        next_index, val_tokens = resume["next_index"], resume["val_tokens"]
        for writer in writers.values():
            writer.out_dir = out_dir  # the folder may have been moved in between
        stream = itertools.islice(stream, next_index, None)
    else:
        writers = {split: SplitWriter(out_dir, split, seq_len, dtype, sep, shard_sequences,
                                      count_vocab=vocab if split == "train" else 0, boundaries=boundaries,
                                      curriculum=curriculum is not None)
                   for split in ("train", "val")}
        deduper = Deduplicator(dedup) if (dedup.exact or dedup.near) else None
        out = PassResult(splits={}, entropy=0.0)
        kept_docs = np.zeros(n_sources, dtype=np.int64)
        kept_tokens = np.zeros(n_sources, dtype=np.int64)
        kept_chars = np.zeros(n_sources, dtype=np.int64)
        next_index = 0
        val_tokens = 0
    with DocumentProgress(enabled=progress) as bar:
        for meta, result in workers.map(_batches(stream, BATCH_DOCUMENTS)):
            shards_before = sum(len(w.shards) for w in writers.values())
            sources, firsts = meta[:, 0], meta[:, 1]
            n = len(sources)
            # By the document's key, not its place in the stream: every copy of a document that
            # the mix reads again goes to the same split as the first.
            is_val = val_mask(seed, firsts, val_fraction)
            next_index += n
            out.changed.update(result.changed)
            out.dropped.update(reason for reason in result.dropped if reason is not None)
            kept = result.lengths > 0
            if deduper is not None:
                for i in np.flatnonzero(kept):
                    key = result.keys[i] if result.keys is not None else None
                    signature = result.signatures[i] if result.signatures is not None else None
                    duplicate = deduper.duplicate(key, signature)
                    if duplicate:
                        kept[i] = False
                        out.dropped[duplicate] += 1
            if force_val and val_tokens < seq_len:
                for i in np.flatnonzero(kept):
                    if val_tokens >= seq_len:
                        break
                    is_val[i] = True  # hashed to val, or forced there while val is short
                    val_tokens += int(result.lengths[i]) + 1
            owner = np.repeat(np.arange(n), result.lengths)
            # The curriculum key of a document: its mean sentence length in tokens.
            doc_keys = result.lengths / result.sentences if result.sentences is not None else None
            for split, chosen in (("train", kept & ~is_val), ("val", kept & is_val)):
                writers[split].add_flat(result.ids[chosen[owner]], result.lengths[chosen],
                                        None if doc_keys is None else doc_keys[chosen])
            lengths = result.lengths[kept]
            kept_docs += np.bincount(sources[kept], minlength=n_sources)
            kept_tokens += np.bincount(sources[kept], weights=lengths, minlength=n_sources).astype(np.int64)
            kept_chars += np.bincount(sources[kept], weights=result.chars[kept],
                                      minlength=n_sources).astype(np.int64)
            bins = np.minimum(np.log2(np.maximum(lengths, 1)).astype(np.int64), HISTOGRAM_BINS - 1)
            out.histogram += np.bincount(bins, minlength=HISTOGRAM_BINS)
            bar.advance(n, result.n_bytes)
            if save is not None and sum(len(w.shards) for w in writers.values()) > shards_before:
                save({"writers": writers, "deduper": deduper, "out": out, "next_index": next_index,
                      "val_tokens": val_tokens, "kept": (kept_docs, kept_tokens, kept_chars)})
    out.documents_seen = next_index
    out.splits = {split: writer.finish() for split, writer in writers.items()}
    out.entropy = unigram_entropy(writers["train"].counts)
    out.per_source = [{"documents": int(d), "tokens": int(t), "characters": int(c)}
                      for d, t, c in zip(kept_docs, kept_tokens, kept_chars)]
    return out
