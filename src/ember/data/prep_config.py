"""The preparation TOML (`ember data prepare --config prep.toml`): its schema and loading.

    [prepare]            # any of prepare()'s settings; command-line flags override them
    tokenizer = "wordpiece"
    seq_len = 128
    shard_size = "64MB"  # or a number of sequences
    workers = 2
    [[source]]           # repeatable; or name inputs on the command line
    path = "wiki.jsonl"
    weight = 0.7
    [clean]              # see clean.py
    normalize = "NFKC"
    [dedup]              # see dedup.py
    exact = true

Paths are relative to the current directory. See docs/data.md for every key.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from ember.data.clean import CleanConfig
from ember.data.dedup import DedupConfig
from ember.data.errors import DataError
from ember.data.mixing import source_from_table

PREPARE_KEYS = {"tokenizer": str, "vocab_size": int, "seq_len": int, "val_fraction": float, "seed": int,
                "shard_size": (int, str), "workers": int, "doc_boundaries": bool, "text_field": str,
                "stopping": str, "max_document_bytes": int, "curriculum": str, "tokenizer_documents": int}
SECTIONS = {"prepare", "source", "clean", "dedup"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*$", re.IGNORECASE)
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_KIND_NAMES = {str: "text", int: "a whole number", float: "a number", bool: "true or false",
               (int, str): 'a number of sequences or a size such as "64MB"'}


def load_prep_config(path: Path) -> dict:
    """prepare() keyword arguments from a TOML file (`inputs` only if it has [[source]] tables)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"preparation config {path} does not exist; check the path.")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid TOML ({err}).") from None
    unknown = sorted(set(table) - SECTIONS)
    if unknown:
        raise DataError(f"{path} has unknown section {', '.join(unknown)}; "
                        f"use {', '.join(sorted(SECTIONS))}.")
    out: dict = {}
    settings = table.get("prepare", {})
    if not isinstance(settings, dict):
        raise DataError(f"{path}: [prepare] must be one table of settings (a [prepare] header), not {settings!r}.")
    for key, value in settings.items():
        if key not in PREPARE_KEYS:
            raise DataError(f"[prepare] has no setting {key}; it knows {', '.join(sorted(PREPARE_KEYS))}.")
        kind = PREPARE_KEYS[key]
        accepted = (int, float) if kind is float else kind  # `val_fraction = 0` is a TOML integer
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise DataError(f"[prepare] {key} = {value!r} has the wrong type; it must be {_KIND_NAMES[kind]}.")
        out[key] = float(value) if kind is float else value
    if "source" in table:
        if not isinstance(table["source"], list):
            raise DataError(f"{path}: write sources as [[source]] tables, one per source.")
        out["inputs"] = [source_from_table(t) for t in table["source"]]
    out["clean"] = CleanConfig.from_dict(table.get("clean"))
    out["dedup"] = DedupConfig.from_dict(table.get("dedup"))
    return out


def shard_sequences_for(shard_size: int | str, seq_len: int, bytes_per_token: int) -> int:
    """Sequences per shard from a count (64000, "64000") or a size ("64MB", "1GiB")."""
    if isinstance(shard_size, int) or str(shard_size).strip().isdigit():
        sequences = int(shard_size)
    else:
        match = _SIZE.match(str(shard_size))
        if not match:
            raise DataError(f"shard size {shard_size!r} is neither a number of sequences nor a size like 64MB.")
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]
        sequences = int(size // (seq_len * bytes_per_token))
    if sequences < 1:
        raise DataError(f"shard size {shard_size!r} holds no whole sequence of {seq_len} tokens; make it larger.")
    return sequences
