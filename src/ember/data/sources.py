"""Documents from .txt and .jsonl files and folders, streamed, with counted skips.

A `.txt` file holds one document per block of lines separated by a blank line; a
`.jsonl` (or `.json`, read as JSON lines) file holds one document per row, in the row's
text field. Rows that cannot be used are counted, not fatal: a large scraped corpus
always has a few. Bytes that are not UTF-8 become U+FFFD and the document is counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from ember.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".json")
_BLANK_LINE = re.compile(r"\n[ \t\f\v]*\n")


def new_counts() -> dict[str, int]:
    """Counters that `iter_documents` fills in; the manifest records them."""
    return {"files": 0, "documents": 0, "empty": 0, "not_json": 0, "no_text_field": 0,
            "non_utf8_documents": 0}


def input_files(inputs: list[Path]) -> list[Path]:
    """The files to read, in a fixed order: folders are searched recursively and sorted."""
    if not inputs:
        raise DataError("no inputs given; name at least one .txt or .jsonl file or folder.")
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                           and not p.name.startswith("."))
            if not found:
                raise DataError(f"folder {item} holds no .txt or .jsonl files; point at a folder of text files.")
            files += found
        elif item.is_file():
            if item.suffix not in SUFFIXES:
                raise DataError(f"{item} is not a .txt or .jsonl file; convert it or rename it to one of those.")
            files.append(item)
        else:
            raise DataError(f"input {item} does not exist; check the path.")
    return files


def _decode(data: bytes) -> tuple[str, bool]:
    """Text and whether any bytes were not valid UTF-8."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _txt_documents(path: Path, counts: dict[str, int]) -> Iterator[str]:
    text, damaged = _decode(path.read_bytes())
    for block in _BLANK_LINE.split(text.replace("\r\n", "\n")):
        block = block.strip()
        if not block:
            continue
        if damaged and "\ufffd" in block:
            counts["non_utf8_documents"] += 1
        yield block


def _jsonl_documents(path: Path, text_field: str, counts: dict[str, int]) -> Iterator[str]:
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            line, damaged = _decode(raw)
            try:
                row = json.loads(line)
            except ValueError:
                counts["not_json"] += 1
                continue
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                counts["no_text_field"] += 1
                continue
            text = text.strip()
            if not text:
                counts["empty"] += 1
                continue
            if damaged and "\ufffd" in text:
                counts["non_utf8_documents"] += 1
            yield text


def iter_documents(inputs: list[Path], text_field: str = "text",
                   counts: dict[str, int] | None = None) -> Iterator[str]:
    """Yield every non-empty document of `inputs`; pass `counts` (from `new_counts()`)
    to learn how many rows were skipped and why."""
    counts = new_counts() if counts is None else counts
    for path in input_files(inputs):
        counts["files"] += 1
        if path.suffix == ".txt":
            docs = _txt_documents(path, counts)
        else:
            docs = _jsonl_documents(path, text_field, counts)
        for doc in docs:
            counts["documents"] += 1
            yield doc
