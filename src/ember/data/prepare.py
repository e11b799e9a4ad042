"""`ember data prepare`: text in, token shards + tokenizer.json + manifest.json out.

The manifest is written last and atomically, so a folder with a manifest is a finished
preparation (never overwritten) and a folder without one is an interrupted one: the same
command continues it from its last completed shard (resume.py), or, when the state of
that shard is missing or damaged, removes its leftovers and starts over. A state saved
with other inputs or settings is refused, naming what differs, and the folder kept.

Which split a document goes to depends only on (seed, document index), through a hash,
so the split is reproducible and needs no shuffling pass. The index is the document's
place in the stream, or in an `all_exhausted` mix, which reads sources again, its place
within its source (mixing.keyed_documents): the same at every reading, so its copies never
land on both sides. One extra rule keeps the
held-out split from ending up empty on a small corpus: if the hashed split gives the
validation split no full sequence, the packing pass is redone with the first documents
of the corpus sent to validation until it holds `seq_len` tokens. Only small corpora
(or a tiny val_fraction) ever take the second pass, so it costs little, and a normal
corpus's held-out set is not biased towards its first documents.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import itertools
import json
import os
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ember.atomic import TMP_SUFFIX, write_text
from ember.data.clean import CleanConfig, transform
from ember.data.dedup import DedupConfig
from ember.data.errors import DataError
from ember.data.mixing import Source, check_sources, keyed_documents, mixed_documents, parse_source
from ember.data.packing import token_dtype
from ember.data.prep_config import shard_sequences_for
from ember.data.resume import (STARTED, STATE_FILE, clear_state, load_state, refuse_pickled_state, save_state,
                               written_files)
from ember.data.pipeline import HISTOGRAM_BINS, Workers, pack_pass
from ember.data.sources import MAX_DOCUMENT_BYTES, file_format, input_files, is_hf_spec, new_counts, open_input
from ember.data.tokenizer import (KINDS, load_tokenizer, min_vocab_size, special_token_ids, with_cleaning,
                                  train_tokenizer)

FORMAT = "ember-shards/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
CURRICULA = ("sentence-length",)  # per-row keys `--curriculum` can record
# The tokenizers library allocates tables in proportion to the vocabulary before it reads
# a document: 2e9 asked for 141 GB and aborted the process.
MAX_TRAINED_VOCAB = 2**22
_LEFTOVER = re.compile(r"^((train|val)_(\d{5,}(\.npy|\.docs\.npz)|curriculum\.npy)|tokenizer\.json|manifest\.json)"
                       + "(" + re.escape(TMP_SUFFIX) + ")?$")


def validate_args(sources: list[Source], out_dir: Path, tokenizer: str, vocab_size: int, seq_len: int,
                  val_fraction: float, shard_sequences: int, stopping: str = "first_exhausted",
                  workers: int = 0, curriculum: str | None = None) -> None:
    """Refuse bad arguments before any compute is spent."""
    if curriculum is not None and curriculum not in CURRICULA:
        raise DataError(f"curriculum {curriculum!r} is not known; use {' or '.join(CURRICULA)}.")
    if seq_len < 8:
        raise DataError(f"seq_len {seq_len} is too short; use at least 8.")
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"val_fraction {val_fraction} must lie in [0, 0.5); 0.01 is typical.")
    if shard_sequences < 1:
        raise DataError("shard_sequences must be at least 1.")
    if tokenizer not in KINDS and not Path(tokenizer).exists():
        raise DataError(f"--tokenizer {tokenizer} names neither a kind to train ({', '.join(KINDS)}) nor an "
                        "existing tokenizer.json; the file does not exist.")
    if tokenizer in KINDS and vocab_size < min_vocab_size(tokenizer):
        raise DataError(f"vocab_size {vocab_size} is too small for {tokenizer}; "
                        f"use at least {min_vocab_size(tokenizer)}.")
    if tokenizer in KINDS and vocab_size > MAX_TRAINED_VOCAB:
        raise DataError(f"vocab_size {vocab_size:,} is too large to train; use at most {MAX_TRAINED_VOCAB:,} "
                        "(the largest vocabularies in use hold about 256k tokens).")
    if not isinstance(workers, int) or workers < 0:
        raise DataError(f"workers {workers!r} must be a whole number >= 0 (0: tokenize in this process).")
    cores = os.cpu_count() or 1
    if workers > 4 * cores:  # each holds a tokenizer and its batches: past the cores they only add memory
        raise DataError(f"workers {workers} is more than four per core on this machine ({cores} cores); "
                        f"use at most {4 * cores}, or leave --workers out for one per core.")
    check_sources(sources, stopping)  # raises DataError for missing inputs or folders without text
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file; choose a folder.")
    for source in sources:  # a folder or pattern is searched again while the output grows in it
        folder = Path(source.path)
        if folder.is_dir() and out_dir.resolve().is_relative_to(folder.resolve()):
            raise DataError(f"--out {out_dir} lies inside the input folder {folder}, whose files are read as text; "
                            "put the output elsewhere.")
        if any(_glob_matches(source.path, out_dir / name) for name in (TOKENIZER_FILE, MANIFEST)):
            raise DataError(f"the pattern {source.path} would read {out_dir}'s own {TOKENIZER_FILE} as text; "
                            "put the output elsewhere.")
    if (out_dir / MANIFEST).exists():
        raise DataError(f"{out_dir} already holds prepared data; choose another --out or delete it.")
    names = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(".")) if out_dir.is_dir() else []
    if names and not (out_dir / STARTED).is_file():  # only an interrupted preparation's folder is continued
        # A run directory, someone's shards or tokenizer: they would be replaced.
        others = [n for n in names if not _LEFTOVER.match(n) and n != STATE_FILE] or names
        raise DataError(f"--out {out_dir} holds files that are not a preparation's ({', '.join(others[:3])}); "
                        "give a new or empty folder.")


def _glob_matches(pattern: str, path: Path) -> bool:
    """Whether glob.glob(pattern, recursive=True) would list `path` ("**" spans folders)."""
    if not set("*?[") & set(pattern):
        return False
    want = Path(os.path.abspath(pattern)).parts
    have = Path(os.path.abspath(path)).parts

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "**":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and fnmatch.fnmatchcase(have[j], want[i]) and match(i + 1, j + 1)

    return match(0, 0)


def check_text_field(sources: list[Source], files: list[list], text_field: str, rows: int = 100) -> None:
    """A text field that none of the first rows of a source's first JSON Lines file holds is
    refused now, not after both passes have read the whole corpus for nothing."""
    for source, found in zip(sources, files):
        field = source.text_field or text_field
        first = next((f for f in found if isinstance(f, Path) and f.is_file()
                      and file_format(f)[0] in (".jsonl", ".json") and f.stat().st_size), None)
        if first is None:
            continue
        keys: set[str] = set()
        try:
            with open_input(first, file_format(first)[1]) as handle:
                for line in itertools.islice((line for line in handle if line.strip()), rows):
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # damaged rows are counted by the passes, not judged here
                    if isinstance(row, dict):
                        if field in row:
                            break
                        keys |= set(row)
                else:
                    if keys:
                        raise DataError(f"the first rows of {first} have no field {field!r} (they have "
                                        f"{', '.join(sorted(keys)[:8])}); pass --text-field with the text's field.")
        except (OSError, EOFError):
            continue  # a damaged file: the first pass names it in one sentence


def input_identity(sources: list[Source], files: list[list]) -> list[list]:
    """Every input file by path, size and modification time, in reading order (dataset names
    as given); a file that two sources, or a folder and a file, both name is refused: it
    would be read twice, and each of its held-out documents would have a twin in train."""
    seen: dict[Path, str] = {}
    out = []
    for source, found in zip(sources, files):
        for item in found:
            if isinstance(item, str):
                out.append([item])
                continue
            path = item.resolve()
            if path in seen:
                raise DataError(f"{item} is an input twice (by {seen[path]} and by {source.path}); name each "
                                "file once, or give it a larger weight.")
            seen[path] = source.path
            stat = path.stat()
            out.append([str(path), stat.st_size, stat.st_mtime_ns])
    return out


def _source_identity(source: Source) -> list:
    path = source.path if is_hf_spec(source.path) else os.path.realpath(source.path)
    return [path, source.weight, source.text_field, source.split, source.data_files, source.config]


def remove_leftovers(out_dir: Path, keep: set[str] = frozenset()) -> None:
    """Delete what an interrupted preparation left behind (only files this module writes)."""
    for path in out_dir.iterdir():
        if path.is_file() and path.name not in keep and _LEFTOVER.match(path.name):
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


def prepare(inputs: list, out_dir: Path, tokenizer: str = "bpe", vocab_size: int = 8192,
            seq_len: int = 128, val_fraction: float = 0.01, seed: int = 0,
            shard_sequences: int = 65536, progress: bool = True, *, text_field: str = "text",
            clean: CleanConfig | dict | None = None, dedup: DedupConfig | dict | None = None,
            workers: int = 0, doc_boundaries: bool = False, stopping: str = "first_exhausted",
            max_document_bytes: int = MAX_DOCUMENT_BYTES, shard_size: int | str | None = None,
            curriculum: str | None = None, tokenizer_documents: int = 0) -> dict:
    """Tokenize `inputs` into packed shards in `out_dir`; return the manifest.

    `inputs` are paths, `path:weight` strings or `Source`s (see mixing.py); `clean` and
    `dedup` are their configs or TOML-style tables; `workers` processes tokenize (0: this
    process does); `shard_size` (sequences, or a size such as "64MB") replaces
    `shard_sequences`; `curriculum` ("sentence-length") records a per-row ordering key;
    `tokenizer_documents` > 0 trains the tokenizer on the first that many documents only
    (a pretraining corpus is far larger than a tokenizer needs). A preparation interrupted
    in `out_dir` continues from its last completed shard (resume.py)."""
    sources = [parse_source(item) for item in inputs]
    out_dir, tokenizer = Path(out_dir), str(tokenizer)
    clean = clean if isinstance(clean, CleanConfig) else CleanConfig.from_dict(clean)
    dedup = dedup if isinstance(dedup, DedupConfig) else DedupConfig.from_dict(dedup)
    validate_args(sources, out_dir, tokenizer, vocab_size, seq_len, val_fraction, shard_sequences,
                  stopping, workers, curriculum)
    refuse_pickled_state(out_dir)
    if shard_size is not None:
        shard_sequences_for(shard_size, seq_len, 2)  # refuse a malformed size before any work
    if not isinstance(tokenizer_documents, int) or tokenizer_documents < 0:
        raise DataError(f"tokenizer_documents {tokenizer_documents!r} must be a whole number >= 0 (0: all).")
    files = [input_files([s.path]) for s in sources]  # each folder searched, each pattern expanded, once
    check_text_field(sources, files, text_field)

    def stream():
        return mixed_documents(sources, text_field, stopping, max_document_bytes)

    def keyed_stream():
        return keyed_documents(sources, text_field, stopping, max_document_bytes)

    # What a saved state must match to be continued. Paths are compared resolved: the same
    # file named from another directory, absolutely or through a symlink is the same input.
    # The files themselves (path, size, modification time) too: an edited input is other data.
    settings = {"sources": [_source_identity(s) for s in sources], "files": input_identity(sources, files),
                "tokenizer": tokenizer if tokenizer in KINDS else "file",
                "tokenizer_file": _sha256(Path(tokenizer).read_text(encoding="utf-8", errors="replace"))
                if tokenizer not in KINDS and Path(tokenizer).is_file() else None,
                "vocab_size": vocab_size, "seq_len": seq_len, "val_fraction": val_fraction, "seed": seed,
                "shard": shard_sequences if shard_size is None else shard_size, "text_field": text_field,
                "clean": clean.to_dict(), "dedup": dedup.to_dict(), "boundaries": doc_boundaries,
                "stopping": stopping, "max_document_bytes": max_document_bytes, "curriculum": curriculum,
                "tokenizer_documents": tokenizer_documents}
    state = load_state(out_dir, settings) if (out_dir / TOKENIZER_FILE).is_file() else None
    if state is not None:  # the interrupted run's own tokenizer, not a new training
        tok, kind = load_tokenizer(out_dir / TOKENIZER_FILE), state["kind"]
    elif tokenizer in KINDS:
        texts = (transform(doc, clean) for _, doc in stream())
        if tokenizer_documents:
            texts = itertools.islice(texts, tokenizer_documents)
        tok = train_tokenizer(tokenizer, texts, vocab_size, show_progress=progress)
        kind = tokenizer
    else:
        tok, kind = load_tokenizer(Path(tokenizer)), "file"
    specials = special_token_ids(tok)
    vocab = max(tok.get_vocab_size(), max(tok.get_vocab().values(), default=-1) + 1)
    dtype = token_dtype(vocab)
    if shard_size is not None:
        shard_sequences = shard_sequences_for(shard_size, seq_len, np.dtype(dtype).itemsize)
    # The workers encode cleaned text; the file also carries the (idempotent) cleaning for text
    # never cleaned. Without it the workers keep byte-level BPE's fast path (no normaliser).
    work_text = tok.to_str(pretty=True)
    tokenizer_text = with_cleaning(tok, clean).to_str(pretty=True) if state is None and kind in KINDS else work_text
    if kind == "file" and state is None:  # a trained tokenizer's leftovers are this command's own: redo them
        _refuse_other_tokenizer(out_dir, tokenizer_text)

    existed = out_dir.exists()
    fresh = not existed or not any(out_dir.iterdir())  # then a refusal leaves nothing behind
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / STARTED).touch()  # before anything else: what is in here from now on is this command's
        remove_leftovers(out_dir, keep={TOKENIZER_FILE} | (written_files(state) if state else set()))
        if state is None:
            clear_state(out_dir)
            write_text(out_dir / TOKENIZER_FILE, tokenizer_text)
        options = dict(seq_len=seq_len, dtype=dtype, sep=specials["sep"], vocab=vocab, val_fraction=val_fraction,
                       seed=seed, shard_sequences=shard_sequences, progress=progress, dedup=dedup,
                       boundaries=doc_boundaries, val_mask=val_mask, curriculum=curriculum)

        def saver(force_val: bool):
            return lambda s: save_state(out_dir, settings, s | {"kind": kind, "force_val": force_val})

        with Workers(workers, work_text, clean.to_dict(), dedup.to_dict(), curriculum) as pool:
            if state is None or not state["force_val"]:
                result = pack_pass(keyed_stream(), pool, out_dir, len(sources), force_val=False, **options,
                                   resume=state, save=saver(False))
            if val_fraction > 0 and (state is not None and state["force_val"]
                                     or result.splits["val"]["sequences"] == 0):
                if state is None or not state["force_val"]:
                    clear_state(out_dir)
                    remove_leftovers(out_dir, keep={TOKENIZER_FILE})
                    state = None
                result = pack_pass(keyed_stream(), pool, out_dir, len(sources), force_val=True, **options,
                                   resume=state, save=saver(True))
        counts = _total_counts(sources)
        empty = [s.path for s in sources if s.counts["documents"] == 0]
        if empty and len(sources) > 1 and sources[0].weight is not None and stopping == "first_exhausted":
            raise DataError(f"source {empty[0]} holds no documents, so a mix that stops when its first source "
                            "runs out is empty; fix or drop that source.")
        if counts["documents"] == 0:
            raise DataError(f"the inputs hold no documents ({counts['not_json']} rows were not JSON, "
                            f"{counts['no_text_field']} had no text field, {counts['too_long']} were longer than "
                            f"max_document_bytes ({max_document_bytes:,}), {counts['empty_files']} files were "
                            "empty); check the files and their format.")
        if result.splits["train"]["sequences"] == 0:
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
            "splits": result.splits,
            "unigram_entropy": result.entropy,
            "sources": [s.describe() for s in sources],
            "source_stats": _source_stats(sources, result.per_source),
            "mixing": {"weighted": sources[0].weight is not None and len(sources) > 1, "stopping": stopping},
            "skipped": {key: counts[key] for key in ("empty", "not_json", "no_text_field")},
            "skipped_inputs": {key: counts[key] for key in ("too_long", "empty_files")},
            "non_utf8_documents": counts["non_utf8_documents"],
            "input_files": counts["files"],
            "input_documents": counts["documents"],
            "cleaning": {"config": clean.to_dict(), "changed": dict(result.changed),
                         "dropped": {k: v for k, v in result.dropped.items() if not k.endswith("_duplicates")}},
            "dedup": {"config": dedup.to_dict(), "exact_duplicates": result.dropped.get("exact_duplicates", 0),
                      "near_duplicates": result.dropped.get("near_duplicates", 0)},
            "documents": sum(s["documents"] for s in result.per_source),
            "document_tokens": sum(s["tokens"] for s in result.per_source),
            "characters": sum(s["characters"] for s in result.per_source),
            "document_length_histogram": {"bin_start_tokens": [2**k for k in range(HISTOGRAM_BINS)],
                                          "documents": result.histogram.tolist()},
            "doc_boundaries": doc_boundaries,
            "curriculum": curriculum,
            "workers": workers,
            "val_fraction": val_fraction,
            "seed": seed,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        clear_state(out_dir)
        (out_dir / STARTED).unlink(missing_ok=True)
    except DataError:
        if fresh and not (out_dir / STATE_FILE).exists():  # no completed shard to continue from
            for made in (out_dir.iterdir() if existed else [out_dir]):
                shutil.rmtree(made, ignore_errors=True) if made.is_dir() else made.unlink(missing_ok=True)
        raise
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"the disk holding {out_dir} is full ({err.strerror}); free some space and run the "
                            "same command again (it continues from the last completed shard).") from None
        raise
    return manifest


def _refuse_other_tokenizer(out_dir: Path, tokenizer_text: str) -> None:
    """An interrupted preparation in `out_dir` made with another tokenizer is someone's
    other dataset, not leftovers to redo: refuse rather than delete its shards."""
    old = out_dir / TOKENIZER_FILE
    if not old.is_file() or (out_dir / MANIFEST).exists():
        return
    has_shards = any(_LEFTOVER.match(p.name) and p.name.endswith(".npy") for p in out_dir.iterdir())
    if has_shards and old.read_text(encoding="utf-8", errors="replace") != tokenizer_text:
        raise DataError(f"{out_dir} holds shards of an unfinished preparation made with another tokenizer; "
                        "choose another --out, or delete that folder to start over.")


def _total_counts(sources: list[Source]) -> dict[str, int]:
    total = new_counts()
    for source in sources:
        for key, value in source.counts.items():
            total[key] += value
    return total


def _source_stats(sources: list[Source], kept: list[dict]) -> list[dict]:
    return [{"source": s.path, "weight": s.weight, "documents_read": s.counts["documents"],
             "skipped": {k: v for k, v in s.counts.items() if k not in ("documents", "files") and v},
             **k} for s, k in zip(sources, kept)]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
