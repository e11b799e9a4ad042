"""`ember data prepare`: text in, token shards + tokenizer.json + manifest.json out.

The manifest is written last and atomically, so a folder with a manifest is a finished
preparation (never overwritten) and a folder without one is an interrupted one, whose
leftovers are removed and redone.

Which split a document goes to depends only on (seed, document index), through a hash,
so the split is reproducible and needs no shuffling pass. One extra rule keeps the
held-out split from ending up empty on a small corpus: if the hashed split gives the
validation split no full sequence, the packing pass is redone with the first documents
of the corpus sent to validation until it holds `seq_len` tokens. Only small corpora
(or a tiny val_fraction) ever take the second pass, so it costs little, and a normal
corpus's held-out set is not biased towards its first documents.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ember.data.atomic import TMP_SUFFIX, write_text_atomic
from ember.data.errors import DataError
from ember.data.packing import SplitWriter, token_dtype, unigram_entropy
from ember.data.progress import DocumentProgress
from ember.data.sources import input_files, iter_documents, new_counts
from ember.data.tokenizer import (KINDS, load_tokenizer, min_vocab_size, special_token_ids,
                                  train_tokenizer)

FORMAT = "ember-shards/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
BATCH_DOCUMENTS = 1000
_LEFTOVER = re.compile(r"^((train|val)_\d{5,}\.npy|tokenizer\.json|manifest\.json)"
                       + "(" + re.escape(TMP_SUFFIX) + ")?$")


def validate_args(inputs: list[Path], out_dir: Path, tokenizer: str, vocab_size: int, seq_len: int,
                  val_fraction: float, shard_sequences: int) -> None:
    """Refuse bad arguments before any compute is spent."""
    if seq_len < 8:
        raise DataError(f"seq_len {seq_len} is too short; use at least 8.")
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"val_fraction {val_fraction} must lie in [0, 0.5); 0.01 is typical.")
    if shard_sequences < 1:
        raise DataError("shard_sequences must be at least 1.")
    if tokenizer in KINDS and vocab_size < min_vocab_size(tokenizer):
        raise DataError(f"vocab_size {vocab_size} is too small for {tokenizer}; "
                        f"use at least {min_vocab_size(tokenizer)}.")
    if tokenizer in KINDS and vocab_size > 2**32 - 1:
        raise DataError(f"vocab_size {vocab_size} is too large; use at most {2**32 - 1}.")
    input_files(inputs)  # raises DataError for missing inputs or folders without text
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file; choose a folder.")
    if (out_dir / MANIFEST).exists():
        raise DataError(f"{out_dir} already holds prepared data; choose another --out or delete it.")


def remove_leftovers(out_dir: Path, keep: str = "") -> None:
    """Delete what an interrupted preparation left behind (only files this module writes)."""
    for path in out_dir.iterdir():
        if path.is_file() and path.name != keep and _LEFTOVER.match(path.name):
            path.unlink()


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 that scrambles every bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def val_mask(seed: int, indices: np.ndarray, val_fraction: float) -> np.ndarray:
    """True where document `indices` belong to the validation split (splitmix64 hash)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) + _GOLDEN)
        x = _mix(key + (indices.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (x >> np.uint64(11)).astype(np.float64) / float(2**53) < val_fraction


def _batches(documents, size: int):
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare(inputs: list[Path], out_dir: Path, tokenizer: str = "bpe", vocab_size: int = 8192,
            seq_len: int = 128, val_fraction: float = 0.01, seed: int = 0,
            shard_sequences: int = 65536, progress: bool = True) -> dict:
    """Tokenize `inputs` into packed shards in `out_dir`; return the manifest."""
    inputs, out_dir = [Path(p) for p in inputs], Path(out_dir)
    tokenizer = str(tokenizer)
    validate_args(inputs, out_dir, tokenizer, vocab_size, seq_len, val_fraction, shard_sequences)

    if tokenizer in KINDS:
        tok = train_tokenizer(tokenizer, iter_documents(inputs), vocab_size, show_progress=progress)
        kind = tokenizer
    else:
        tok, kind = load_tokenizer(Path(tokenizer)), "file"
    specials = special_token_ids(tok)
    vocab = max(tok.get_vocab_size(), max(tok.get_vocab().values(), default=-1) + 1)
    dtype = token_dtype(vocab)

    out_dir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir)
    tokenizer_text = tok.to_str(pretty=True)
    write_text_atomic(out_dir / TOKENIZER_FILE, tokenizer_text)

    counts, splits, entropy = _pack(tok, inputs, out_dir, seq_len, dtype, specials["sep"], vocab,
                                    val_fraction, seed, shard_sequences, progress, force_val=False)
    if val_fraction > 0 and splits["val"]["sequences"] == 0:
        remove_leftovers(out_dir, keep=TOKENIZER_FILE)
        counts, splits, entropy = _pack(tok, inputs, out_dir, seq_len, dtype, specials["sep"], vocab,
                                        val_fraction, seed, shard_sequences, progress, force_val=True)
    if counts["documents"] == 0:
        raise DataError(f"the inputs hold no documents ({counts['not_json']} rows were not JSON, "
                        f"{counts['no_text_field']} had no text field); check the files and their format.")
    if splits["train"]["sequences"] == 0:
        raise DataError(f"the text is too short for seq_len {seq_len}: it gives no full training "
                        "sequence; add more text or lower --seq-len.")
    manifest = {
        "format": FORMAT,
        "vocab_size": vocab,
        "seq_len": seq_len,
        "dtype": dtype,
        "tokenizer_file": TOKENIZER_FILE,
        "tokenizer_sha256": _sha256(tokenizer_text),
        "tokenizer_kind": kind,
        "tokenizer_source": tokenizer if kind == "file" else None,
        "special_tokens": specials,
        "splits": splits,
        "unigram_entropy": entropy,
        "sources": [str(p) for p in inputs],
        "skipped": {key: counts[key] for key in ("empty", "not_json", "no_text_field")},
        "non_utf8_documents": counts["non_utf8_documents"],
        "input_files": counts["files"],
        "input_documents": counts["documents"],
        "val_fraction": val_fraction,
        "seed": seed,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _pack(tok, inputs: list[Path], out_dir: Path, seq_len: int, dtype: str, sep: int, vocab: int,
          val_fraction: float, seed: int, shard_sequences: int, progress: bool,
          force_val: bool) -> tuple[dict, dict, float]:
    """One pass: tokenize, split, pack, write shards. Returns (source counts, splits,
    unigram entropy of train). `force_val` sends the first documents to val (docstring)."""
    writers = {split: SplitWriter(out_dir, split, seq_len, dtype, sep, shard_sequences,
                                  count_vocab=vocab if split == "train" else 0)
               for split in ("train", "val")}
    counts = new_counts()
    next_index = 0
    val_tokens = 0  # tokens (separators included) sent to the val split so far
    with DocumentProgress(enabled=progress) as bar:
        for batch in _batches(iter_documents(inputs, counts=counts), BATCH_DOCUMENTS):
            encodings = tok.encode_batch(batch, add_special_tokens=False)
            is_val = val_mask(seed, np.arange(next_index, next_index + len(batch)), val_fraction)
            next_index += len(batch)
            train_ids, val_ids = [], []
            for enc, to_val in zip(encodings, is_val):
                if not enc.ids:  # e.g. only characters the normalizer removes
                    counts["empty"] += 1
                    continue
                to_val = to_val or (force_val and val_tokens < seq_len)
                if to_val:
                    val_tokens += len(enc.ids) + 1
                (val_ids if to_val else train_ids).append(enc.ids)
            writers["train"].add(train_ids)
            writers["val"].add(val_ids)
            bar.advance(len(batch), sum(len(d.encode("utf-8")) for d in batch))
    splits = {split: writer.finish() for split, writer in writers.items()}
    return counts, splits, unigram_entropy(writers["train"].counts)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
