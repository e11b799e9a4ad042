"""Documents from local files, folders, globs and Hugging Face datasets, streamed, with
counted skips.

A `.txt` file holds one document per block of lines separated by a blank line; a
`.jsonl` (or `.json`, read as JSON lines) file holds one document per row, in the row's
text field; a `.parquet` file holds one per row of its text column, read in row
batches. Any of the line formats may be compressed as `.gz` or `.zst` and is then
decompressed as a stream. Rows that cannot be used are counted, not fatal: a large
scraped corpus always has a few. Bytes that are not UTF-8 become U+FFFD and the document
is counted. A document longer than `max_document_bytes` is skipped and counted without
ever being held in memory whole.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from ember.data.errors import DataError

FORMATS = (".txt", ".jsonl", ".json", ".parquet")
COMPRESSIONS = (".gz", ".zst")
MAX_DOCUMENT_BYTES = 16 << 20
_READ_LIMIT = 1 << 20  # bytes per readline call, so one huge line is never read whole
_BLANK = b" \t\f\v\r\n"
_GLOB_CHARS = set("*?[")


def new_counts() -> dict[str, int]:
    """Counters that `iter_documents` fills in; the manifest records them."""
    return {"files": 0, "documents": 0, "empty": 0, "not_json": 0, "no_text_field": 0,
            "non_utf8_documents": 0, "empty_files": 0, "too_long": 0}


def file_format(path: Path) -> tuple[str, str]:
    """(format, compression) from the name: ('.jsonl', '.gz') for a.jsonl.gz; format '' if unknown."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSIONS else ""
    fmt = suffixes[-1] if suffixes and suffixes[-1] in FORMATS else ""
    if fmt == ".parquet" and compression:
        fmt = ""  # parquet compresses inside the file
    return fmt, compression


def _readable(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and file_format(path)[0] != ""


def is_hf_spec(item: str) -> bool:
    return str(item).startswith("hf:")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def input_files(inputs: list) -> list[Path]:
    """The files (and dataset names) to read, in a fixed order: folders are searched
    recursively and sorted, globs are expanded and sorted."""
    if not inputs:
        raise DataError("no inputs given; name at least one .txt, .jsonl or .parquet file or folder.")
    files: list = []
    for raw in inputs:
        if is_hf_spec(str(raw)):
            files.append(str(raw))
            continue
        item = Path(raw)
        if _GLOB_CHARS & set(str(raw)):
            found = sorted(Path(p) for p in glob.glob(str(raw), recursive=True) if _readable(Path(p)))
            if not found:
                raise DataError(f"the pattern {raw} matches no .txt, .jsonl or .parquet files; check it.")
            files += found
        elif is_saved_dataset(item):
            files.append(item)
        elif item.is_dir():
            found = sorted(p for p in item.rglob("*") if _readable(p))
            if not found:
                raise DataError(f"folder {item} holds no .txt, .jsonl or .json files (plain, .gz or .zst), nor .parquet; "
                                "point at a folder of text files.")
            files += found
        elif item.is_file():
            if not file_format(item)[0]:
                raise DataError(f"{item} is not a .txt, .jsonl or .json file (plain, .gz or .zst), nor .parquet; "
                                "convert it or rename it to one of those.")
            files.append(item)
        else:
            raise DataError(f"input {item} does not exist; check the path.")
    return files


def open_input(path: Path, compression: str) -> io.BufferedIOBase:
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"reading {path} needs the zstandard package; pip install 'ember[data]'.") from None
        return io.BufferedReader(_ZstdFrames(path, zstandard), 1 << 16)
    return open(path, "rb")


def _unreadable(path: Path, kind: str, reason) -> DataError:
    return DataError(f"{path} is not a readable {kind} file ({reason}); check the file.")


class _ZstdFrames(io.RawIOBase):
    """Every frame of a .zst file, decompressed as a stream. zstandard's own readers end
    quietly where a cut-off file ends; this one refuses it there. Its errors are DataErrors
    already, as the file is read in more places than `_read_lines_format`."""

    def __init__(self, path: Path, zstandard):
        self._path = path
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor()
        self._damaged = zstandard.ZstdError
        self._frame = None  # the frame being decoded; None between frames
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            data = self._file.read(1024)  # small: zstd packs up to 32 MiB of text into 1 KiB
            if not data:
                if self._frame is not None:
                    raise _unreadable(self._path, ".zst", "it ends inside a zstd frame, so it was cut short")
                return 0
            out = []
            while data:
                if self._frame is None:
                    self._frame = self._decompressor.decompressobj()
                try:
                    out.append(self._frame.decompress(data))
                except self._damaged as err:
                    raise _unreadable(self._path, ".zst", err) from None
                data = b""
                if self._frame.eof:
                    data, self._frame = self._frame.unused_data, None
            self._out = memoryview(b"".join(out))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _decode(data: bytes) -> tuple[str, bool]:
    """Text and whether any bytes were not valid UTF-8."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _lines(handle, limit: int, counts: dict[str, int]) -> Iterator[bytes | None]:
    """Lines of `handle`; a line longer than `limit` is skipped (read in pieces, never
    whole) and yields None so the caller can end its document there."""
    while True:
        line = handle.readline(_READ_LIMIT)
        if not line:
            return
        if len(line) == _READ_LIMIT and not line.endswith(b"\n"):
            parts = [line]
            size = len(line)
            while size <= limit and not parts[-1].endswith(b"\n"):
                part = handle.readline(_READ_LIMIT)
                if not part:
                    break
                parts.append(part)
                size += len(part)
            if size > limit:
                line = parts[-1]
                while not line.endswith(b"\n"):  # skip the rest of the huge line
                    line = handle.readline(_READ_LIMIT)
                    if not line:
                        break
                counts["too_long"] += 1
                yield None
                continue
            line = b"".join(parts)
        yield line


def _finish_block(block: list[bytes], counts: dict[str, int]) -> str | None:
    text, damaged = _decode(b"".join(block))
    text = text.replace("\r\n", "\n").strip()
    if not text:
        return None
    if damaged and "\ufffd" in text:
        counts["non_utf8_documents"] += 1
    return text


def _txt_documents(handle, counts: dict[str, int], limit: int) -> Iterator[str]:
    block: list[bytes] = []
    size = 0
    skipping = False  # inside a block that grew past the limit
    for line in _lines(handle, limit, counts):
        if line is None or (size + len(line) > limit and not skipping):
            if line is not None:
                counts["too_long"] += 1
            block, size, skipping = [], 0, True
            continue
        if not line.strip(_BLANK) and b"\r" not in line.rstrip(b"\r\n"):
            if block and not skipping:
                text = _finish_block(block, counts)
                if text:
                    yield text
            block, size, skipping = [], 0, False
        elif not skipping:
            block.append(line)
            size += len(line)
    if block and not skipping:
        text = _finish_block(block, counts)
        if text:
            yield text


def _row_text(row, text_field: str, damaged: bool, counts: dict[str, int]) -> str | None:
    text = row.get(text_field) if isinstance(row, dict) else None
    if not isinstance(text, str):
        counts["no_text_field"] += 1
        return None
    text = text.strip()
    if not text:
        counts["empty"] += 1
        return None
    if not text.isascii() and _SURROGATE.search(text):
        # JSON's \ud800 escapes decode to lone surrogates, which no UTF-8 encoder (the
        # tokenizer's, the shards' text) accepts: repaired as undecodable bytes are.
        text, damaged = _SURROGATE.sub("\ufffd", text), True
    if damaged and "\ufffd" in text:
        counts["non_utf8_documents"] += 1
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def _jsonl_documents(handle, text_field: str, counts: dict[str, int], limit: int) -> Iterator[str]:
    for raw in _lines(handle, limit, counts):
        if raw is None or not raw.strip():
            continue
        if len(raw) > limit:  # the row's bytes bound its text's (JSON escapes only add)
            counts["too_long"] += 1
            continue
        line, damaged = _decode(raw)
        try:
            row = json.loads(line)
        except ValueError:
            counts["not_json"] += 1
            continue
        text = _row_text(row, text_field, damaged, counts)
        if text is not None:
            yield text


def _parquet_documents(path: Path, text_field: str, counts: dict[str, int], limit: int) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs the pyarrow package; pip install 'ember[data]'.") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid for damaged files
        raise DataError(f"{path} is not a readable parquet file ({err}); check the file.") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path} has no column {text_field!r} (it has {', '.join(names)}); "
                        "pass --text-field with the text column's name.")
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and len(text) * 4 > limit and len(text.encode("utf-8", "replace")) > limit:
                counts["too_long"] += 1
                continue
            text = _row_text({text_field: text}, text_field, False, counts)
            if text is not None:
                yield text


def file_documents(path, text_field: str, counts: dict[str, int],
                   limit: int = MAX_DOCUMENT_BYTES, split: str | None = None,
                   data_files=None, config: str | None = None) -> Iterator[str]:
    """Documents of one input (a file, a saved dataset folder or an `hf:` name)."""
    counts["files"] += 1
    if is_hf_spec(str(path)) or is_saved_dataset(Path(path)):
        from ember.data.hf import hf_documents

        docs = hf_documents(str(path), text_field, counts, limit, split, data_files, config)
    else:
        path = Path(path)
        if path.stat().st_size == 0:
            counts["empty_files"] += 1
            return
        fmt, compression = file_format(path)
        if fmt == ".parquet":
            docs = _parquet_documents(path, text_field, counts, limit)
        else:
            docs = _read_lines_format(path, fmt, compression, text_field, counts, limit)
    for doc in docs:
        counts["documents"] += 1
        yield doc


def _read_lines_format(path: Path, fmt: str, compression: str, text_field: str,
                       counts: dict[str, int], limit: int) -> Iterator[str]:
    with open_input(path, compression) as handle:
        try:
            if fmt == ".txt":
                yield from _txt_documents(handle, counts, limit)
            else:
                yield from _jsonl_documents(handle, text_field, counts, limit)
        except (OSError, EOFError) as err:  # what gzip raises for a damaged stream
            if isinstance(err, OSError) and err.errno is not None:
                raise
            raise _unreadable(path, compression or fmt, err) from None


def iter_documents(inputs: list, text_field: str = "text",
                   counts: dict[str, int] | None = None,
                   max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[str]:
    """Yield every non-empty document of `inputs`; pass `counts` (from `new_counts()`)
    to learn how many rows were skipped and why."""
    counts = new_counts() if counts is None else counts
    for path in input_files(inputs):
        yield from file_documents(path, text_field, counts, max_document_bytes)
