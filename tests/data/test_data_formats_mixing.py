"""More input formats (parquet, .gz, .zst, globs, Hugging Face datasets) and weighted mixing."""

import gzip
import json
from pathlib import Path

import pytest

from ember.data import DataError, iter_documents, load_manifest, prepare
from ember.data.mixing import Source, mixed_documents, parse_source
from ember.data.sources import new_counts


def _docs(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document number {i} says something about {prefix} and item {i * 7}." for i in range(n)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def test_parquet_gz_zst_and_globs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = _docs("alpha", 2500)  # more than one parquet row batch
    pq.write_table(pa.table({"body": docs, "other": list(range(len(docs)))}), tmp_path / "a.parquet",
                   row_group_size=700)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps({"body": d}) + "\n" for d in _docs("beta", 3)))
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"gamma one\n\ngamma two\n"))
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(b"delta one\n\ndelta two\n"))

    assert list(iter_documents([tmp_path / "a.parquet"], text_field="body")) == docs
    assert list(iter_documents([tmp_path / "b.jsonl.gz"], text_field="body")) == _docs("beta", 3)
    assert list(iter_documents([tmp_path / "c.txt.zst"])) == ["gamma one", "gamma two"]
    assert list(iter_documents([str(tmp_path / "*.txt.*")])) == ["gamma one", "gamma two", "delta one", "delta two"]
    counts = new_counts()
    every = list(iter_documents([tmp_path], text_field="body", counts=counts))
    assert len(every) == 2500 + 3 + 4 and counts["files"] == 4  # sorted: a, b, c, d
    assert every[:2] == docs[:2] and every[2500] == _docs("beta", 3)[0] and every[-1] == "delta two"
    with pytest.raises(DataError, match="no column 'text' .it has body, other.; pass --text-field"):
        list(iter_documents([tmp_path / "a.parquet"]))
    with pytest.raises(DataError, match="matches no"):
        list(iter_documents([str(tmp_path / "*.csv")]))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="not a readable .gz file"):
        list(iter_documents([tmp_path / "bad.jsonl.gz"]))


def test_hugging_face_datasets_saved_and_by_builder(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    docs = _docs("hub", 30)
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(tmp_path / "saved"))
    assert list(iter_documents([tmp_path / "saved"], text_field="content")) == docs
    with pytest.raises(DataError, match="no column 'text'"):
        list(iter_documents([tmp_path / "saved"]))
    data_file = _jsonl(tmp_path / "local.jsonl", docs)
    source = Source("hf:json", text_field="text", split="train", data_files=str(data_file))
    assert [d for _, d in mixed_documents([source])] == docs
    with pytest.raises(DataError, match="cannot open the dataset"):
        list(mixed_documents([Source("hf:json", data_files=str(tmp_path / "absent.jsonl"))]))


def test_source_specs():
    assert parse_source("wiki.jsonl:0.7") == Source("wiki.jsonl", 0.7)
    assert parse_source("code/") == Source("code/")
    assert parse_source("hf:json") == Source("hf:json")
    assert parse_source("hf:wikitext@train:2") == Source("hf:wikitext@train", 2.0)
    with pytest.raises(DataError, match="positive"):
        parse_source("a.txt:0")


def test_weighted_mix_follows_the_weights(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _docs("apple", 400))
    b = _jsonl(tmp_path / "b.jsonl", _docs("banana", 100))
    sources = [Source(str(a), 0.75), Source(str(b), 0.25)]
    mixed = list(mixed_documents(sources))
    chars = [sum(len(d) for s, d in mixed if s == i) for i in (0, 1)]
    assert abs(chars[1] / sum(chars) - 0.25) < 0.01
    assert sum(1 for s, _ in mixed if s == 1) == 100  # banana ran out first and ended the mix
    assert [d for s, d in mixed if s == 0] == _docs("apple", 400)[: len(mixed) - 100]
    everything = list(mixed_documents(sources, stopping="all_exhausted"))
    apples = [d for s, d in everything if s == 0]
    assert apples == _docs("apple", 400)  # read through once; bananas repeat to keep their share
    assert sum(1 for s, _ in everything if s == 1) > 100

    m = prepare([f"{a}:3", f"{b}:1"], tmp_path / "out", vocab_size=300, seq_len=16, progress=False)
    stats = {Path(s["source"]).name: s for s in m["source_stats"]}
    assert m["sources"] == [f"{a}:3", f"{b}:1"] and m["mixing"]["weighted"]
    assert stats["b.jsonl"]["documents"] == 100 and stats["b.jsonl"]["weight"] == 1.0
    assert stats["a.jsonl"]["documents"] == len(mixed) - 100
    assert sum(s["tokens"] for s in stats.values()) == m["document_tokens"] > 0
    load_manifest(tmp_path / "out", verify=True)
    with pytest.raises(DataError, match="every source a weight"):
        prepare([f"{a}:3", str(b)], tmp_path / "out2", vocab_size=300, seq_len=16, progress=False)


def _split_documents(out: Path, split: str, sep: int) -> list[tuple]:
    """The whole documents of a split, as token tuples (rows are the stream cut in order)."""
    import numpy as np

    stream = np.concatenate([np.load(p).reshape(-1) for p in sorted(out.glob(f"{split}_[0-9]*.npy"))])
    cuts = np.flatnonzero(stream == sep)
    return [tuple(piece.tolist()) for piece in np.split(stream, cuts + 1)[1:-1]]  # the first may have no start


def test_a_document_read_again_stays_on_its_side_of_the_split(tmp_path):
    """With all_exhausted the smaller source is read several times: each copy of a document
    goes where its first went, so no held-out document is also trained on."""
    a = _jsonl(tmp_path / "a.jsonl", _docs("apple", 400))
    b = _jsonl(tmp_path / "b.jsonl", _docs("banana", 50))
    m = prepare([f"{a}:0.5", f"{b}:0.5"], tmp_path / "out", vocab_size=300, seq_len=16, val_fraction=0.3,
                stopping="all_exhausted", progress=False, workers=0)
    assert m["source_stats"][1]["documents"] > 200  # bananas were read several times
    train, val = (_split_documents(tmp_path / "out", s, m["special_tokens"]["sep"]) for s in ("train", "val"))
    assert len(val) > 50 and len(set(train)) < len(train)  # the repeats are there, on one side each
    shared = set(val) & set(train)
    assert not shared, f"{len(shared)} of {len(set(val))} held-out documents are also in train"
