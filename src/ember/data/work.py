"""What a worker does to one batch of documents: clean, filter, tokenize, sign.

It runs in worker processes (or in the main process when there are none) and returns
only compact arrays, so little crosses the process boundary: one flat array of token ids
and, per document, its length (0 when dropped), why it was dropped, its characters and
bytes, its dedup keys, and (for a curriculum) its sentence count.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ember.data.clean import CleanConfig, compressed_badly, text_filter, transform
from ember.data.dedup import DedupConfig, Signer, exact_key
from ember.data.fastbpe import CachedBPE, applies

_STATE: dict = {}
# A sentence ends at a run of . ! or ? followed by whitespace or the end of the text.
# Crude next to a real sentence splitter, but it costs one regex pass and needs no
# language model; a curriculum only needs a consistent ordering, not linguistics.
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


@dataclass
class BatchResult:
    ids: np.ndarray  # uint32, the kept documents' tokens end to end
    lengths: np.ndarray  # int64 per document; 0 for a dropped one
    dropped: list  # per document: None, or the name of the filter that dropped it
    chars: np.ndarray  # int64 per document, after transforms
    n_bytes: int  # UTF-8 bytes of the batch as read
    keys: list | None = None  # exact-dedup keys
    signatures: np.ndarray | None = None  # (documents, num_perm) MinHash values
    changed: Counter = field(default_factory=Counter)  # documents each transform altered
    sentences: np.ndarray | None = None  # int64 per document, at least 1 (curriculum only)


def count_sentences(text: str) -> int:
    """Sentences in `text`: its sentence ends, and at least one."""
    return max(1, sum(1 for _ in _SENTENCE_END.finditer(text)))


def init_worker(tokenizer_json: str, clean: dict, dedup: dict, single_thread: bool,
                subprocess: bool = False, curriculum: str | None = None) -> None:
    if single_thread:
        # Several worker processes already use every core; threads inside each would contend.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if subprocess:
        # Ctrl-C is the main process's to handle (it stops the pool); workers just end. The
        # worker starts with SIGINT blocked (pipeline._sigint_blocked): a pending one is dropped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from tokenizers import Tokenizer

    _STATE["tok"] = Tokenizer.from_str(tokenizer_json)
    _STATE["clean"] = CleanConfig.from_dict(clean)
    _STATE["dedup"] = DedupConfig.from_dict(dedup)
    _STATE["signer"] = Signer(_STATE["dedup"]) if _STATE["dedup"].near else None
    _STATE["fast"] = CachedBPE(_STATE["tok"]) if applies(_STATE["tok"]) else None
    _STATE["verified"] = False
    _STATE["curriculum"] = curriculum


def _encode(docs: list[str]) -> list[list[int]]:
    """Token ids of `docs`, through the cached encoder when it reproduces the tokenizer
    (checked on the first batch: any difference and this worker stops using it)."""
    fast = _STATE["fast"]
    if fast is not None and not _STATE["verified"]:
        _STATE["verified"] = True
        if not fast.verify(docs):
            _STATE["fast"] = fast = None
    if fast is not None:
        return fast.encode_batch(docs)
    return [enc.ids for enc in _STATE["tok"].encode_batch(docs, add_special_tokens=False)]


def process(docs: list[str]) -> BatchResult:
    clean, dedup, signer = _STATE["clean"], _STATE["dedup"], _STATE["signer"]
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    changed: Counter = Counter()
    if clean.transforms_text():
        docs = [transform(d, clean, changed) for d in docs]
    dropped: list = [None] * len(docs)
    for i, doc in enumerate(docs):
        if not doc:
            dropped[i] = "empty"
        else:
            dropped[i] = text_filter(doc, clean)
    keep = [i for i, reason in enumerate(dropped) if reason is None]
    encodings = _encode([docs[i] for i in keep])
    lengths = np.zeros(len(docs), dtype=np.int64)
    chars = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    pieces = []
    for i, ids in zip(keep, encodings):
        if not ids:  # e.g. only characters the normalizer removes
            dropped[i] = "empty"
        elif compressed_badly(len(ids), chars[i], clean):
            dropped[i] = "compression"
        else:
            lengths[i] = len(ids)
            pieces.append(ids)
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.uint32, count=total)
    result = BatchResult(flat, lengths, dropped, chars, n_bytes, changed=changed)
    if dedup.exact:
        result.keys = [exact_key(d) if lengths[i] else None for i, d in enumerate(docs)]
    if _STATE.get("curriculum"):
        result.sentences = np.fromiter((count_sentences(d) if lengths[i] else 1 for i, d in enumerate(docs)),
                                       dtype=np.int64, count=len(docs))
    if signer is not None:
        result.signatures = np.zeros((len(docs), dedup.num_perm), dtype=np.uint64)
        for i, d in enumerate(docs):
            if lengths[i]:
                result.signatures[i] = signer.sign(d)
    return result
