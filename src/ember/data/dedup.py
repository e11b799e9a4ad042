"""Duplicate removal: exact (a hash of the normalised text) and near (MinHash + LSH).

The expensive halves (hashing, MinHash signatures) run in the worker processes; the
decisions (`seen`) run in the main process in input order, so the first copy of a
document is the one kept whatever the worker count. Both indexes grow with the number
of kept documents (an 8-byte key per document for exact dedup, about 70 bytes in a Python set; for near dedup one LSH entry
per band per document), the one part of preparation whose memory is not bounded.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from ember.data.errors import DataError
from ember.fields import checked_table

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w+")


@dataclass
class DedupConfig:
    exact: bool = False
    near: bool = False
    threshold: float = 0.8  # estimated Jaccard similarity of shingle sets above which a document is dropped
    num_perm: int = 64
    shingle: int = 5  # words per shingle
    seed: int = 1

    @classmethod
    def from_dict(cls, table: dict | None) -> DedupConfig:
        config = cls(**checked_table(cls, table, "[dedup]", DataError))
        if not 0 < config.threshold < 1:
            raise DataError(f"[dedup] threshold {config.threshold} must lie in (0, 1); 0.8 is typical.")
        if config.num_perm < 16 or config.shingle < 1:
            raise DataError("[dedup] needs num_perm >= 16 and shingle >= 1.")
        if not 0 <= config.seed < 2**32:  # MinHash's permutations are drawn from a numpy seed
            raise DataError(f"[dedup] seed {config.seed} must lie in 0 .. 2**32 - 1.")
        if config.near:
            _datasketch()
        return config

    def to_dict(self) -> dict:
        return asdict(self)


def _datasketch():
    try:
        import datasketch
    except ImportError:
        raise DataError("near-duplicate removal needs the datasketch package; pip install 'ember[data]'.") from None
    return datasketch


KEY_BYTES = 8


def exact_key(text: str) -> bytes:
    """8 bytes that equal for texts differing only in case and whitespace."""
    return hashlib.blake2b(_SPACE.sub(" ", text.lower()).strip().encode("utf-8"), digest_size=KEY_BYTES).digest()


class Signer:
    """MinHash signatures of word shingles (in a worker). Shingles are hashed with CRC-32:
    a C call, deterministic across processes, and as wide as the 32-bit hashes MinHash
    keeps anyway; datasketch's default (SHA-1 per shingle) was a third of the time."""

    def __init__(self, config: DedupConfig):
        self.config = config
        datasketch = _datasketch()
        self._template = datasketch.MinHash(num_perm=config.num_perm, seed=config.seed)
        self._minhash = datasketch.MinHash

    def sign(self, text: str) -> np.ndarray:
        words = _WORD.findall(text.lower())
        k = self.config.shingle
        shingles = {" ".join(words[i:i + k]).encode("utf-8") for i in range(max(1, len(words) - k + 1))}
        m = self._minhash(num_perm=self.config.num_perm, seed=self.config.seed, hashfunc=zlib.crc32,
                          permutations=self._template.permutations, scheme=self._template.scheme)
        m.update_batch(list(shingles))
        return m.hashvalues.copy()


class Deduplicator:
    """The main process's memory of what it has kept."""

    def __init__(self, config: DedupConfig):
        self.config = config
        self.keys: set[bytes] = set()
        self.lsh = None
        if config.near:
            datasketch = _datasketch()
            self.lsh = datasketch.MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
            self._lean = datasketch.LeanMinHash
            self._scheme = datasketch.MinHash(num_perm=config.num_perm, seed=config.seed).scheme
        self.kept = 0

    def duplicate(self, key: bytes | None, signature: np.ndarray | None) -> str | None:
        """'exact' or 'near' if the document repeats a kept one, else None (and remember it)."""
        if self.config.exact and key is not None:
            if key in self.keys:
                return "exact_duplicates"
        if self.lsh is not None and signature is not None:
            m = self._lean(seed=self.config.seed, hashvalues=signature, scheme=self._scheme)
            if self.lsh.query(m):
                return "near_duplicates"
            self.lsh.insert(self.kept, m, check_duplication=False)
        if self.config.exact and key is not None:
            self.keys.add(key)
        self.kept += 1
        return None

    def snapshot(self) -> dict[str, np.ndarray]:
        """Its memory as arrays: the exact keys (8 bytes each), and for every document in the
        LSH index its number and its band hashes, as the index stores them."""
        arrays = {"kept": np.array(self.kept, dtype=np.int64),
                  "keys": np.frombuffer(b"".join(self.keys), dtype=np.uint8).reshape(-1, KEY_BYTES)}
        if self.lsh is not None:
            numbers = list(self.lsh.keys.keys())
            bands = b"".join(b"".join(self.lsh.keys.get(n)) for n in numbers)
            arrays["lsh_numbers"] = np.array(numbers, dtype=np.int64)
            arrays["lsh_bands"] = np.frombuffer(bands, dtype=np.uint8).reshape(len(numbers), -1)
        return arrays

    @classmethod
    def restore(cls, config: DedupConfig, arrays: dict[str, np.ndarray]) -> Deduplicator:
        deduper = cls(config)
        deduper.kept = int(arrays["kept"])
        deduper.keys = {row.tobytes() for row in arrays["keys"]}
        if deduper.lsh is not None:
            tables = deduper.lsh.hashtables
            for number, row in zip(arrays["lsh_numbers"].tolist(), arrays["lsh_bands"]):
                # Every band hash is the same width (the index cuts equal bands): split the row back.
                hashes = [bytes(band) for band in np.split(row, len(tables))]
                deduper.lsh.keys.insert(number, *hashes)
                for band, table in zip(hashes, tables):
                    table.insert(band, number)
        return deduper
