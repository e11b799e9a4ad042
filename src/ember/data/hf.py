"""Documents from Hugging Face `datasets` (optional): a hub or builder name, streamed,
or a folder written by `save_to_disk`, read in memory-mapped batches.

Input names: `hf:NAME` or `hf:NAME@SPLIT` (e.g. `hf:wikitext@train`, or `hf:json` with
`data_files` given in the prep TOML). A saved folder is named by its path.
"""

from __future__ import annotations

from collections.abc import Iterator

from ember.data.errors import DataError


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the datasets package; "
                        "pip install datasets, or export the data to .jsonl or .parquet.") from None
    datasets.disable_progress_bars()
    return datasets


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _open(spec: str, split: str | None, data_files, config: str | None):
    datasets = _datasets()
    if spec.startswith("hf:"):
        name, _, named_split = spec[3:].partition("@")
        split = named_split or split or "train"
        try:
            return datasets.load_dataset(name, config, split=split, streaming=True, data_files=data_files)
        except Exception as err:  # datasets raises many kinds: not found, offline, bad split
            raise DataError(f"cannot open the dataset {name!r} split {split!r} ({_first_line(err)}); "
                            "check its name and split, or that it is cached when offline.") from None
    try:
        loaded = datasets.load_from_disk(spec)
    except Exception as err:
        raise DataError(f"{spec} is not a readable saved dataset ({_first_line(err)}).") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or ("train" if "train" in loaded else next(iter(loaded)))
        if split not in loaded:
            raise DataError(f"{spec} has no split {split!r}; it has {', '.join(loaded)}.")
        loaded = loaded[split]
    return loaded


def hf_documents(spec: str, text_field: str, counts: dict[str, int], limit: int,
                 split: str | None = None, data_files=None, config: str | None = None) -> Iterator[str]:
    dataset = _open(spec, split, data_files, config)
    columns = getattr(dataset, "column_names", None)
    if columns is not None and text_field not in columns:
        raise DataError(f"{spec} has no column {text_field!r} (it has {', '.join(columns)}); "
                        "pass --text-field with the text column's name.")
    if hasattr(dataset, "iter") and not spec.startswith("hf:"):
        rows = (text for batch in dataset.select_columns([text_field]).iter(batch_size=1024)
                for text in batch[text_field])
    else:
        rows = (row.get(text_field) for row in dataset)
    for text in rows:
        if text is None:
            counts["no_text_field"] += 1
            continue
        if not isinstance(text, str):
            counts["no_text_field"] += 1
            continue
        if len(text) > limit:
            counts["too_long"] += 1
            continue
        text = text.strip()
        if not text:
            counts["empty"] += 1
            continue
        yield text

