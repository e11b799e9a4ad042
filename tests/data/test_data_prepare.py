"""prepare(): shards, manifest, splits, atomic writing; load_manifest()'s checks."""

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

import ember.data.packing as packing
from ember.data import DataError, load_manifest, load_tokenizer, prepare
from ember.data.packing import SplitWriter, token_dtype
from ember.data.prepare import val_mask

WORDS = ("model data token layer value return the a of to in is for with that by this list "
         "string number file object function class module parser error result index").split()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, list[str]]:
    """Unique, varied ASCII documents; each starts with its own tag so it can be traced."""
    rng = random.Random(1)
    docs = []
    for i in range(400):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                     for _ in range(rng.randint(1, 4))]
        docs.append(f"Note {i}: " + " ".join(sentences))
    path = tmp_path_factory.mktemp("synthetic") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


@pytest.fixture(scope="module")
def prepared(synthetic, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "bpe"
    prepare([synthetic[0]], out, tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.1,
            seed=3, shard_sequences=100, progress=False)
    return out


def _rows(out: Path, split: str) -> list[list[int]]:
    manifest = load_manifest(out)
    return [row for shard in manifest["splits"][split]["shards"] for row in np.load(out / shard["file"]).tolist()]


def _cut(tok, ids: list[int], sep: int) -> list[str]:
    """Decoded pieces of `ids` between separators."""
    cuts = [i for i, t in enumerate(ids) if t == sep]
    return [tok.decode(ids[a + 1:b]) for a, b in zip([-1] + cuts, cuts + [len(ids)])]


def test_manifest_and_shards(prepared, synthetic):
    m = load_manifest(prepared, verify=True)
    assert m["format"] == "ember-shards/1" and m["tokenizer_kind"] == "bpe"
    assert m["vocab_size"] == 300 and m["seq_len"] == 32 and m["dtype"] == "uint16"
    assert m["tokenizer_file"] == "tokenizer.json"
    assert m["tokenizer_sha256"] == hashlib.sha256((prepared / "tokenizer.json").read_bytes()).hexdigest()
    assert m["sources"] == [str(synthetic[0])]
    assert m["skipped"] == {"empty": 0, "not_json": 0, "no_text_field": 0}
    assert set(m["special_tokens"]) == {"sep", "pad", "mask"}
    assert 0 < m["unigram_entropy"] < np.log(300)
    for split in ("train", "val"):
        info = m["splits"][split]
        assert info["sequences"] > 0 and info["tokens"] == info["sequences"] * 32
        assert sum(s["sequences"] for s in info["shards"]) == info["sequences"]
        for shard in info["shards"]:
            array = np.load(prepared / shard["file"])
            assert array.shape == (shard["sequences"], 32) and array.dtype == np.uint16
            assert shard["sequences"] <= 100
            assert hashlib.sha256((prepared / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    assert len(m["splits"]["train"]["shards"]) > 1  # shard_sequences=100 split the train split
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(synthetic[1])
    assert not list(prepared.glob("*.tmp"))


def test_rows_decode_to_corpus_text_and_splits_are_disjoint(prepared, synthetic):
    docs = synthetic[1]
    tok = load_tokenizer(prepared / "tokenizer.json")
    sep = load_manifest(prepared)["special_tokens"]["sep"]
    for row in _rows(prepared, "train"):
        pieces = _cut(tok, row, sep)
        if len(pieces) == 1:  # a row inside one long document
            assert any(pieces[0] in d for d in docs)
            continue
        assert any(d.endswith(pieces[0]) for d in docs)  # the row starts inside a document,
        assert all(piece in docs for piece in pieces[1:-1])  # holds whole ones,
        assert any(d.startswith(pieces[-1]) for d in docs)  # and ends inside one

    # Each split's rows, end to end, are its documents in corpus order, each followed by a
    # separator; only the final partial row was dropped.
    position = {d: i for i, d in enumerate(docs)}
    found = {}
    for split in ("train", "val"):
        stream = [t for row in _rows(prepared, split) for t in row]
        *whole, partial = _cut(tok, stream, sep)
        assert all(piece in position for piece in whole)
        order = [position[piece] for piece in whole]
        assert order == sorted(order)
        assert any(d.startswith(partial) for d in docs)
        found[split] = set(order)
    assert not found["train"] & found["val"]
    assert len(found["val"]) > 10
    assert len(found["train"] | found["val"]) >= len(docs) - 4  # at most a tail per split is lost


def test_val_fraction_is_roughly_honoured_and_depends_on_seed():
    indices = np.arange(100_000)
    assert abs(val_mask(0, indices, 0.05).mean() - 0.05) < 0.005
    assert (val_mask(0, indices, 0.05) != val_mask(1, indices, 0.05)).any()
    assert not val_mask(0, indices, 0.0).any()
    # Every position, the first included, is drawn afresh for each seed.
    first_doc_in_val = sum(bool(val_mask(seed, np.arange(1), 0.05)[0]) for seed in range(2000))
    assert 60 < first_doc_in_val < 140


def test_small_corpus_still_gets_a_validation_sequence(tmp_path):
    path = tmp_path / "few.txt"
    path.write_text("\n\n".join(f"Paragraph {i} about some words and values." for i in range(60)))
    assert not val_mask(0, np.arange(60), 0.001).any()  # the hashed split alone gives val nothing
    m = prepare([path], tmp_path / "out", vocab_size=256, seq_len=16, val_fraction=0.001, progress=False)
    assert m["splits"]["val"]["sequences"] >= 1 and m["splits"]["train"]["sequences"] >= 1
    # The rule: the first documents go to val until it holds one sequence; train keeps the rest.
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert tok.decode(sum(_rows(tmp_path / "out", "val"), [])).startswith("Paragraph 0 about some")
    assert "Paragraph 0 " not in tok.decode(sum(_rows(tmp_path / "out", "train"), []))
    assert load_manifest(tmp_path / "out", verify=True)["tokenizer_sha256"] == m["tokenizer_sha256"]
    none = prepare([path], tmp_path / "out0", vocab_size=256, seq_len=16, val_fraction=0.0, progress=False)
    assert none["splits"]["val"] == {"sequences": 0, "tokens": 0, "documents": 0, "shards": []}
    assert load_manifest(tmp_path / "out0")["splits"]["val"]["sequences"] == 0


def test_wordpiece_and_a_given_tokenizer_file(prepared, synthetic, tmp_path):
    wp = prepare([synthetic[0]], tmp_path / "wp", tokenizer="wordpiece", vocab_size=200, seq_len=32,
                 progress=False)
    assert wp["tokenizer_kind"] == "wordpiece" and set(wp["special_tokens"]) == {"sep", "pad", "mask", "cls", "unk"}
    given = prepare([synthetic[0]], tmp_path / "given", tokenizer=str(prepared / "tokenizer.json"),
                    seq_len=32, val_fraction=0.1, seed=3, shard_sequences=100, progress=False)
    assert given["tokenizer_kind"] == "file"
    original = load_manifest(prepared)
    assert given["tokenizer_sha256"] == original["tokenizer_sha256"]
    assert [s["sha256"] for s in given["splits"]["train"]["shards"]] == \
        [s["sha256"] for s in original["splits"]["train"]["shards"]]


def test_wide_vocabularies_use_uint32(tmp_path):
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"  # ids 0 .. 65535 fit in 16 bits
    writer = SplitWriter(tmp_path, "train", seq_len=4, dtype=token_dtype(100_000), sep_id=0, shard_sequences=10)
    writer.add([[70_000, 99_999, 5], [1, 2, 3, 4]])
    info = writer.finish()
    rows = np.load(tmp_path / info["shards"][0]["file"])
    assert rows.dtype == np.uint32 and rows.tolist() == [[70_000, 99_999, 5, 0], [1, 2, 3, 4]]


def test_a_partial_row_carries_over_between_batches_of_documents(tmp_path):
    """Documents arrive in batches; the row a batch leaves unfinished is finished by the next
    one's tokens, none lost or repeated. Each document ends in the separator (0)."""
    writer = SplitWriter(tmp_path, "train", seq_len=4, dtype=token_dtype(100), sep_id=0, shard_sequences=10)
    writer.add([[1, 2]])  # 1 2 0: no whole row yet
    writer.add([[3, 4, 5]])  # 1 2 0 3 | 4 5 0
    writer.add([[6, 7, 8, 9, 10]])  # 4 5 0 6 | 7 8 9 10 | 0
    info = writer.finish()
    rows = np.load(tmp_path / info["shards"][0]["file"])
    assert rows.tolist() == [[1, 2, 0, 3], [4, 5, 0, 6], [7, 8, 9, 10]]
    assert info["documents"] == 3 and info["sequences"] == 3


def test_bad_arguments_are_refused_before_work(synthetic, tmp_path):
    good = dict(inputs=[synthetic[0]], out_dir=tmp_path / "o", progress=False)
    for bad, words in [(dict(seq_len=4), "at least 8"), (dict(val_fraction=0.5), "val_fraction"),
                       (dict(tokenizer="bpe", vocab_size=100), "at least 256"),
                       (dict(tokenizer="wordpiece", vocab_size=50), "at least 100"),
                       (dict(inputs=[tmp_path / "nope.txt"]), "does not exist"),
                       (dict(tokenizer=str(tmp_path / "nope.json")), "names neither a kind to train")]:
        with pytest.raises(DataError, match=words):
            prepare(**{**good, **bad})
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_text_too_short_for_seq_len(tmp_path):
    (tmp_path / "tiny.txt").write_text("A few words only.")
    with pytest.raises(DataError, match="too short for seq_len 512"):
        prepare([tmp_path / "tiny.txt"], tmp_path / "out", seq_len=512, vocab_size=256, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_inputs_without_documents(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "x", "text": 5}\nnot json\n')
    with pytest.raises(DataError, match="no documents .1 rows were not JSON, 1 had no text field, 0 were longer"):
        prepare([tmp_path / "rows.jsonl"], tmp_path / "out", vocab_size=256, progress=False)
    # A field that none of the first rows has is refused before either pass reads the corpus.
    (tmp_path / "rows.jsonl").write_text('{"body": "wrong field"}\nnot json\n' * 1000)
    with pytest.raises(DataError, match="the first rows of .* have no field 'text' .they have body."):
        prepare([tmp_path / "rows.jsonl"], tmp_path / "out", vocab_size=256, progress=False)


def test_finished_preparation_is_never_overwritten(prepared, synthetic):
    before = (prepared / "manifest.json").read_bytes()
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare([synthetic[0]], prepared, vocab_size=300, seq_len=32, progress=False)
    assert (prepared / "manifest.json").read_bytes() == before


def test_interrupted_preparation_leaves_no_manifest_and_is_redone(synthetic, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = dict(tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.1, seed=3, shard_sequences=20,
                progress=False)
    real_save, calls = packing.save_shard, []

    def failing_save(path, rows):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the third shard was written
        return real_save(path, rows)

    monkeypatch.setattr(packing, "save_shard", failing_save)
    with pytest.raises(KeyboardInterrupt):
        prepare([synthetic[0]], out, **args)
    monkeypatch.setattr(packing, "save_shard", real_save)
    assert not (out / "manifest.json").exists()
    assert (out / "train_00000.npy").exists()  # shards written before the interruption remain
    (out / "train_00099.npy").write_bytes(b"stale")
    (out / "val_00000.npy.tmp").write_bytes(b"half-written")
    (out / "notes.txt").write_text("the user's own file")

    redone = prepare([synthetic[0]], out, **args)
    clean = prepare([synthetic[0]], tmp_path / "clean", **args)
    assert load_manifest(out, verify=True)["splits"] == clean["splits"] == redone["splits"]
    assert not (out / "train_00099.npy").exists() and not list(out.glob("*.tmp"))
    assert (out / "notes.txt").read_text() == "the user's own file"


def test_load_manifest_errors(prepared, tmp_path):
    with pytest.raises(DataError, match="nowhere has no manifest.json"):
        load_manifest(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no manifest.json; run `ember data prepare` first"):
        load_manifest(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "train_00000.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one token changed; the shape is still right
    shard.write_bytes(bytes(data))
    load_manifest(copy)  # the quick check only looks at shapes
    with pytest.raises(DataError, match="checksum"):
        load_manifest(copy, verify=True)
    np.save(shard, np.zeros((3, 32), dtype=np.uint16))
    with pytest.raises(DataError, match="not the uint16"):
        load_manifest(copy)
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        load_manifest(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "other/9"}))
    with pytest.raises(DataError, match="format"):
        load_manifest(copy)


def test_the_tokenizer_can_be_trained_on_the_first_documents_only(synthetic, tmp_path):
    """tokenizer_documents=N: the tokenizer of the first N documents, every document packed."""
    src, docs = synthetic
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:50]))
    args = dict(tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.1, seed=3, progress=False)
    sampled = prepare([src], tmp_path / "sampled", tokenizer_documents=50, **args)
    only_first = prepare([first], tmp_path / "only_first", **args)
    full = prepare([src], tmp_path / "full", **args)
    assert sampled["tokenizer_sha256"] == only_first["tokenizer_sha256"] != full["tokenizer_sha256"]
    assert sampled["input_documents"] == full["input_documents"] == len(docs)
    with pytest.raises(DataError, match="tokenizer_documents"):
        prepare([src], tmp_path / "bad", tokenizer_documents=-1, **args)


def test_prepare_never_writes_into_a_folder_that_is_not_a_preparation(tmp_path):
    """A run directory given as --out: its tokenizer.json would be replaced."""
    text = tmp_path / "t.txt"
    text.write_text("some words here\n\nand more words there\n" * 50)
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_text("the run's own")
    (run / "config.toml").write_text("[model]")
    with pytest.raises(DataError, match=r"holds files that are not a preparation's \(config.toml\)"):
        prepare([str(text)], run, tokenizer="bpe", vocab_size=300, seq_len=16, progress=False)
    assert (run / "tokenizer.json").read_text() == "the run's own"
