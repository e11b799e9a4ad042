"""Sentences and pairs to token ids with the run's tokenizer, and batches of them.

Layout: `[CLS] a [SEP] b [SEP]` when the tokenizer has a CLS token (WordPiece); byte-level
BPE has none, so `a <sep> b <sep>`, and a masked LM (which pools the first position)
gets a leading `<sep>` instead of [CLS] so that its first token is always the same.
Pairs longer than the limit lose tokens from the longer side first (`longest_first`).

Padding: evaluation batches hold sequences of exactly one length (no padding at all, so
predictions do not depend on batching). Training batches are bucketed: examples are
shuffled, sorted by length within windows of 50 batches, cut into batches and the batches
shuffled, then right-padded to their longest member, which the classifier keeps out of
attention with a key-padding mask and out of its pooling (see docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from tokenizers import Tokenizer

from ember.eval.glue_tasks import Split

BUCKET_WINDOW = 50  # batches per sorting window: little padding, still random batches


def truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after removing tokens one at a time from the longer side (b on ties)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    half_a, half_b = (budget + 1) // 2, budget // 2
    if len_a <= half_a:
        return len_a, budget - len_a
    if len_b <= half_b:
        return budget - len_b, len_b
    return half_a, half_b


def encode_split(split: Split, tok: Tokenizer, special_tokens: dict, objective: str,
                 max_len: int) -> list[list[int]]:
    """Token ids of every example, special tokens included, at most `max_len` long."""
    sep = special_tokens["sep"]
    first = special_tokens.get("cls", sep if objective == "mlm" else None)
    prefix = [] if first is None else [first]
    tok.no_truncation()
    tok.no_padding()
    ids_a = [e.ids for e in tok.encode_batch(split.text_a, add_special_tokens=False)]
    if split.text_b is None:
        budget = max_len - len(prefix) - 1
        return [prefix + a[:budget] + [sep] for a in ids_a]
    ids_b = [e.ids for e in tok.encode_batch(split.text_b, add_special_tokens=False)]
    budget = max_len - len(prefix) - 2
    out = []
    for a, b in zip(ids_a, ids_b):
        keep_a, keep_b = truncate_pair(len(a), len(b), budget)
        out.append(prefix + a[:keep_a] + [sep] + b[:keep_b] + [sep])
    return out


def train_batches(lengths: list[int], batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch of index batches, bucketed by length (see the module note)."""
    order = rng.permutation(len(lengths))
    window = batch_size * BUCKET_WINDOW
    lengths = np.asarray(lengths)
    batches = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def steps_per_epoch(n: int, batch_size: int) -> int:
    window = batch_size * BUCKET_WINDOW  # a multiple of batch_size: only the last window has a short batch
    return sum(-(-min(window, n - s) // batch_size) for s in range(0, n, window))


def equal_length_batches(lengths: list[int], batch_size: int) -> Iterator[np.ndarray]:
    """Index batches whose members all have the same length: no padding at all."""
    lengths = np.asarray(lengths)
    for length in np.unique(lengths):
        same = np.flatnonzero(lengths == length)
        for i in range(0, len(same), batch_size):
            yield same[i:i + batch_size]
