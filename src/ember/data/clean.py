"""Cleaning: text transforms and document filters, each optional and each counted.

Transforms (in this order): Unicode normalisation (NFC or NFKC), strip accents,
lowercase, ASCII only (Cramming's normaliser options). Filters, on the transformed text:
minimum/maximum characters and words, Gopher's repetition filters (the fraction of lines
that repeat an earlier line, and for each n the fraction of characters covered by the
most frequent word n-gram), and Cramming's compression filter (drop a document whose
token count exceeds `max_tokens_per_char` times its character count, which catches
text the tokenizer cannot compress: tables, encoded data, other scripts).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field

from ember.data.errors import DataError
from ember.fields import checked_table

NORMALIZE = ("NFC", "NFKC")
TRANSFORMS = ("normalize", "strip_accents", "lowercase", "ascii_only")
FILTERS = ("min_chars", "max_chars", "min_words", "max_words", "duplicate_lines", "top_ngram", "compression")


@dataclass
class CleanConfig:
    normalize: str | None = None
    strip_accents: bool = False
    lowercase: bool = False
    ascii_only: bool = False
    min_chars: int = 0
    max_chars: int = 0  # 0: no limit
    min_words: int = 0
    max_words: int = 0
    max_duplicate_line_fraction: float = 0.0  # 0: off; Gopher uses 0.30
    max_top_ngram_fraction: dict[int, float] = field(default_factory=dict)  # Gopher: {2: .20, 3: .18, 4: .16}
    max_tokens_per_char: float = 0.0  # 0: off; Cramming uses 0.3

    @classmethod
    def from_dict(cls, table: dict | None) -> CleanConfig:
        table = checked_table(cls, table, "[clean]", DataError)
        if "max_top_ngram_fraction" in table:
            try:
                table["max_top_ngram_fraction"] = {int(n): float(f) for n, f in table["max_top_ngram_fraction"].items()}
            except (AttributeError, ValueError, TypeError):
                raise DataError("[clean] max_top_ngram_fraction must map n to a fraction, "
                                "e.g. {2 = 0.20, 3 = 0.18}.") from None
        config = cls(**table)
        config.check()
        return config

    def check(self) -> None:
        if self.normalize is not None and self.normalize not in NORMALIZE:
            raise DataError(f"[clean] normalize {self.normalize!r} is unknown; use NFC or NFKC.")
        for name in ("min_chars", "max_chars", "min_words", "max_words"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise DataError(f"[clean] {name} must be a whole number >= 0.")
        for name in ("max_duplicate_line_fraction", "max_tokens_per_char"):
            if not 0 <= float(getattr(self, name)) <= 10:
                raise DataError(f"[clean] {name} must be a fraction >= 0 (0 turns it off).")
        if any(n < 1 or not 0 < f <= 1 for n, f in self.max_top_ngram_fraction.items()):
            raise DataError("[clean] max_top_ngram_fraction needs n >= 1 and fractions in (0, 1].")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["max_top_ngram_fraction"] = {str(n): f for n, f in self.max_top_ngram_fraction.items()}
        return out

    def transforms_text(self) -> bool:
        return bool(self.normalize or self.strip_accents or self.lowercase or self.ascii_only)


def _strip_accents(text: str) -> str:
    decomposed = unicodedata.normalize("NFD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def transform(text: str, config: CleanConfig, changed: Counter | None = None) -> str:
    """`text` after the configured transforms; `changed` counts documents each one altered."""
    steps = []
    if config.normalize:
        steps.append(("normalize", lambda t: unicodedata.normalize(config.normalize, t)))
    if config.strip_accents:
        steps.append(("strip_accents", lambda t: t if t.isascii() else _strip_accents(t)))
    if config.lowercase:
        steps.append(("lowercase", str.lower))
    if config.ascii_only:
        steps.append(("ascii_only", lambda t: t if t.isascii() else t.encode("ascii", "ignore").decode("ascii")))
    for name, step in steps:
        new = step(text)
        if changed is not None and new != text:
            changed[name] += 1
        text = new
    return text.strip() if steps else text


def duplicate_line_fraction(text: str) -> float:
    """Fraction of non-empty lines that repeat an earlier line (Gopher)."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if len(lines) < 2:
        return 0.0
    return 1.0 - len(set(lines)) / len(lines)


def top_ngram_fraction(words: list[str], n: int) -> float:
    """Fraction of word characters covered by the most frequent word n-gram (Gopher)."""
    if len(words) < n + 1:
        return 0.0
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = grams.most_common(1)[0]
    if count < 2:
        return 0.0
    total = sum(map(len, words))
    return min(1.0, count * sum(map(len, gram)) / total) if total else 0.0


def text_filter(text: str, config: CleanConfig) -> str | None:
    """The name of the first filter that drops `text`, or None to keep it (before tokenizing)."""
    chars = len(text)
    if config.min_chars and chars < config.min_chars:
        return "min_chars"
    if config.max_chars and chars > config.max_chars:
        return "max_chars"
    needs_words = config.min_words or config.max_words or config.max_top_ngram_fraction
    words = text.split() if needs_words else []
    if config.min_words and len(words) < config.min_words:
        return "min_words"
    if config.max_words and len(words) > config.max_words:
        return "max_words"
    if config.max_duplicate_line_fraction and duplicate_line_fraction(text) > config.max_duplicate_line_fraction:
        return "duplicate_lines"
    for n, limit in sorted(config.max_top_ngram_fraction.items()):
        if top_ngram_fraction(words, n) > limit:
            return "top_ngram"
    return None


def compressed_badly(n_tokens: int, n_chars: int, config: CleanConfig) -> bool:
    """Cramming's filter: more than `max_tokens_per_char` tokens per character."""
    return bool(config.max_tokens_per_char) and n_tokens > config.max_tokens_per_char * n_chars
