"""Exact, faster encoding for byte-level BPE tokenizers (ember's `bpe`, GPT-2's, RoBERTa's).

`Tokenizer.encode_batch` builds a full Encoding per document (token strings, offsets,
masks) and re-runs BPE on every word it has not cached; preparation needs only the ids.
This encoder splits text with the byte-level pre-tokenizer's own pattern, looks each
word up in a dict of word -> ids, and asks the BPE model only for words it has never
seen. The ids are the same as `encode(text, add_special_tokens=False).ids`:

- it is used only for a tokenizer with no normalizer, a plain ByteLevel pre-tokenizer
  (no prefix space, the GPT-2 pattern), a BPE model without dropout, and no truncation
  or padding; anything else goes through `encode_batch`;
- a document containing an added token's text (`<|endoftext|>`, say), which the
  tokenizer would cut out first, goes through `encode_batch`;
- `verify` compares it with `encode_batch` on a batch and the caller falls back on any
  difference (e.g. a Unicode-version difference in what counts as a letter).
"""

from __future__ import annotations

import itertools
import json

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MAX_CACHE = 1 << 20  # distinct words kept; the cache is emptied when it grows past this


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (as ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def applies(tok) -> bool:
    """Whether `tok` is a byte-level BPE tokenizer this encoder reproduces exactly."""
    try:
        import regex  # noqa: F401  (the \\p{L} classes need it)
    except ImportError:
        return False
    state = json.loads(tok.to_str())
    pre = state.get("pre_tokenizer") or {}
    model = state.get("model") or {}
    return (state.get("normalizer") is None and state.get("truncation") is None and state.get("padding") is None
            and pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space") and pre.get("use_regex", True)
            and model.get("type") == "BPE" and model.get("dropout") is None)


class _WordCache(dict):
    """word -> ids; a missing word is encoded by the BPE model (so lookups stay in C)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.byte_map = _bytes_to_unicode()

    def __missing__(self, word: str) -> list[int]:
        if len(self) >= MAX_CACHE:
            self.clear()
        mapped = "".join(self.byte_map[b] for b in word.encode("utf-8"))
        ids = self[word] = [t.id for t in self.model.tokenize(mapped)]
        return ids


class CachedBPE:
    def __init__(self, tok):
        import regex

        self.tok = tok
        self.split = regex.compile(GPT2_PATTERN).findall
        self.cache = _WordCache(tok.model)
        added = sorted((t.content for t in tok.get_added_tokens_decoder().values()), key=len, reverse=True)
        self.added = regex.compile("|".join(regex.escape(a) for a in added)).search if added else None

    def encode_batch(self, docs: list[str]) -> list[list[int]]:
        out: list = [None] * len(docs)
        slow = []
        lookup, split, chain = self.cache.__getitem__, self.split, itertools.chain.from_iterable
        for i, doc in enumerate(docs):
            if self.added is not None and self.added(doc):
                slow.append(i)
                continue
            out[i] = list(chain(map(lookup, split(doc))))
        if slow:
            for i, enc in zip(slow, self.tok.encode_batch([docs[i] for i in slow], add_special_tokens=False)):
                out[i] = enc.ids
        return out

    def verify(self, docs: list[str]) -> bool:
        """True if this encoder gives `encode_batch`'s ids for every document of `docs`."""
        reference = [e.ids for e in self.tok.encode_batch(docs, add_special_tokens=False)]
        return self.encode_batch(docs) == reference
