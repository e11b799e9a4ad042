"""Several sources mixed by weight into one stream of documents.

A source is a file, folder, glob, saved dataset or `hf:` name, with a weight:
`wiki.jsonl:0.7` on the command line, or a `[[source]]` table in the prep TOML. The
weight is the source's share of the mixed stream's *characters*, enforced
deterministically (no random draws): the next document always comes from the source
furthest below its share. With `stopping = "first_exhausted"` (the default) the mix
ends when any source runs out, so the shares are exact and the rest of the larger
sources is left unused; with `"all_exhausted"` a source that runs out starts again
(repeating its documents) until every source has been read through once. Plain inputs
without weights are read one after the other, each whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ember.data.errors import DataError
from ember.data.sources import MAX_DOCUMENT_BYTES, file_documents, input_files, is_hf_spec, new_counts

STOPPING = ("first_exhausted", "all_exhausted")


@dataclass
class Source:
    path: str
    weight: float | None = None
    text_field: str | None = None  # None: the preparation's --text-field
    split: str | None = None  # for datasets with splits
    data_files: str | list[str] | None = None  # for `hf:json` and similar builders
    config: str | None = None  # a Hugging Face dataset's configuration name
    counts: dict[str, int] = field(default_factory=new_counts)

    def describe(self) -> str:
        return self.path if self.weight is None else f"{self.path}:{self.weight:g}"


def parse_source(text) -> Source:
    """`path` or `path:weight` (the last colon-separated part is a weight if it is a number)."""
    if isinstance(text, Source):
        return text
    text = str(text)
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            weight = float(tail)
        except ValueError:
            # A colon is allowed in a path, but when the part before it names a file or folder,
            # the rest was meant as a weight: "does not exist" would point at the wrong part.
            if not is_hf_spec(text) and not Path(text).exists() and Path(head).exists():
                raise DataError(f"source {text}: the weight {tail!r} after the colon is not a number; "
                                f"give a positive number, e.g. {head}:0.5.") from None
            return Source(text)
        if not 0 < weight < math.inf:
            raise DataError(f"source {text} has weight {tail}; weights must be positive numbers.")
        return Source(head, weight)
    return Source(text)


def source_from_table(table: dict) -> Source:
    allowed = {"path", "weight", "text_field", "split", "data_files", "config"}
    if not isinstance(table, dict):
        raise DataError(f"each source must be a [[source]] table with a path, not {table!r}.")
    unknown = set(table) - allowed
    if unknown or "path" not in table:
        raise DataError(f"a [[source]] table needs path and may hold {', '.join(sorted(allowed - {'path'}))}; "
                        f"it has {', '.join(sorted(table))}.")
    for key, value in table.items():
        files = key == "data_files" and isinstance(value, list) and all(isinstance(v, str) for v in value)
        if key != "weight" and not isinstance(value, str) and not files:
            kind = "text or a list of texts" if key == "data_files" else "text"
            raise DataError(f"[[source]] {key} = {value!r} has the wrong type; it must be {kind}.")
    weight = table.get("weight")
    if weight is not None and not (isinstance(weight, (int, float)) and not isinstance(weight, bool)
                                   and 0 < weight < math.inf):
        raise DataError(f"source {table['path']} has weight {weight!r}; weights must be positive numbers.")
    return Source(str(table["path"]), None if weight is None else float(weight), table.get("text_field"),
                  table.get("split"), table.get("data_files"), table.get("config"))


def check_sources(sources: list[Source], stopping: str) -> None:
    """Refuse bad sources before any compute (missing paths, mixed weighted/unweighted)."""
    if not sources:
        raise DataError("no inputs given; name at least one .txt, .jsonl or .parquet file or folder.")
    if stopping not in STOPPING:
        raise DataError(f"stopping {stopping!r} is unknown; use {' or '.join(STOPPING)}.")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise DataError("give every source a weight (path:weight) or none of them.")
    if all(weighted) and not sum(s.weight for s in sources) < math.inf:  # shares are weight / total
        raise DataError("the sources' weights add up to more than a float holds; give them as shares, "
                        "e.g. 0.7 and 0.3.")
    for source in sources:
        input_files([source.path])


def _documents(source: Source, text_field: str, limit: int) -> Iterator[str]:
    for path in input_files([source.path]):
        yield from file_documents(path, source.text_field or text_field, source.counts, limit,
                                  source.split, source.data_files, source.config)


def mixed_documents(sources: list[Source], text_field: str = "text", stopping: str = "first_exhausted",
                    limit: int = MAX_DOCUMENT_BYTES) -> Iterator[tuple[int, str]]:
    """(source index, document) in mixing order; each source's `counts` are filled in."""
    for index, doc, _ in keyed_documents(sources, text_field, stopping, limit):
        yield index, doc


def keyed_documents(sources: list[Source], text_field: str = "text", stopping: str = "first_exhausted",
                    limit: int = MAX_DOCUMENT_BYTES) -> Iterator[tuple[int, str, int]]:
    """(source index, document, key) in mixing order. The key is the document's position in
    the stream, except in a mix that reads sources again (`all_exhausted`): there it is the
    document's place within its source (times the number of sources, plus the source's
    index), the same at every reading, so everything decided by the key (the held-out split)
    treats its copies alike, and nothing is kept per document to know it."""
    for source in sources:
        source.counts = new_counts()
    position = 0
    if len(sources) == 1 or sources[0].weight is None:
        for index, source in enumerate(sources):
            for doc in _documents(source, text_field, limit):
                yield index, doc, position
                position += 1
        return
    total = sum(s.weight for s in sources)
    shares = [s.weight / total for s in sources]
    streams = [_documents(s, text_field, limit) for s in sources]
    taken = [0] * len(sources)
    finished = [False] * len(sources)
    within = [0] * len(sources)  # the next document's place in its source, this reading
    while True:
        # The source furthest below its share of the characters taken so far.
        index = min(range(len(sources)), key=lambda i: (taken[i] + 1) / shares[i])
        doc = next(streams[index], None)
        if doc is None:
            finished[index] = True
            if stopping == "first_exhausted" or all(finished):
                return
            streams[index] = _documents(sources[index], text_field, limit)
            within[index] = 0
            doc = next(streams[index], None)
            if doc is None:  # a source with no documents at all
                return
        taken[index] += len(doc)
        key = within[index] * len(sources) + index if stopping == "all_exhausted" else position
        within[index] += 1
        yield index, doc, key
        position += 1
