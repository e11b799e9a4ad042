"""What `ember data prepare` reads and where it writes: a folder it did not start is never
written into, a resumed preparation whose inputs changed starts over, no file is read
twice, a pattern never reads the output, and trained ids do not depend on the process."""

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

from test_data_resume import interrupted

from ember.data import prepare
from ember.data.errors import DataError
from ember.data.tokenizer import WORDPIECE_SPECIALS, _fixed_ids, train_tokenizer

ARGS = dict(tokenizer="bpe", vocab_size=300, seq_len=16, progress=False, workers=0)


def _jsonl(path, n: int, word: str = "alpha"):
    rng = random.Random(n)
    path.write_text("".join(json.dumps({"text": f"{word} {i} " + " ".join(rng.choice(["x", "yy", "zzz"])
                                                                             for _ in range(30))}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.parametrize("mine", [["tokenizer.json"], ["features.npy"], ["train_00000.npy", "notes.txt"]])
def test_a_folder_it_did_not_start_is_never_written_into(mine, tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", 200)
    out = tmp_path / "proj"
    out.mkdir()
    for name in mine:
        (out / name).write_bytes(b"the user's own " + name.encode())
    with pytest.raises(DataError, match="holds files that are not a preparation's"):
        prepare([src], out, **ARGS)
    assert sorted(p.name for p in out.iterdir()) == sorted(mine)
    assert all((out / name).read_bytes() == b"the user's own " + name.encode() for name in mine)


def test_changed_inputs_start_over_instead_of_continuing(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", 400, "old")
    interrupted(monkeypatch, [src], tmp_path / "out", at_save=4, **ARGS, shard_sequences=40)
    _jsonl(src, 400, "new")  # same name, other text
    redone = prepare([src], tmp_path / "out", **ARGS, shard_sequences=40)
    fresh = prepare([src], tmp_path / "fresh", **ARGS, shard_sequences=40)
    assert redone["tokenizer_sha256"] == fresh["tokenizer_sha256"]
    assert redone["splits"] == fresh["splits"]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert "old" not in tok.decode(np.load(tmp_path / "out" / "train_00000.npy")[0].tolist())


def test_no_file_is_read_twice(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    src = _jsonl(folder / "a.jsonl", 100)
    for inputs in ([folder, src], [src, src]):
        with pytest.raises(DataError, match="is an input twice"):
            prepare(inputs, tmp_path / "out", **ARGS)
    assert not (tmp_path / "out").exists()


def test_a_pattern_never_reads_the_output(tmp_path):
    (tmp_path / "g").mkdir()
    _jsonl(tmp_path / "g" / "a.jsonl", 100)
    with pytest.raises(DataError, match="would read .* own tokenizer.json as text"):
        prepare([str(tmp_path / "g" / "**" / "*.json*")], tmp_path / "g" / "prep", **ARGS)
    flat = prepare([str(tmp_path / "g" / "*.jsonl")], tmp_path / "g" / "prep", **ARGS)  # cannot reach prep/
    assert flat["input_files"] == 1


def test_a_dedup_seed_numpy_cannot_take_is_refused_before_work(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", 100)
    with pytest.raises(DataError, match=r"\[dedup\] seed -1 must lie in"):
        prepare([src], tmp_path / "out", **ARGS, dedup={"near": True, "seed": -1})
    assert not (tmp_path / "out").exists()


def test_the_only_documents_too_long_are_named(tmp_path):
    (tmp_path / "big.txt").write_text("x y z\n" * 40)
    with pytest.raises(DataError, match="1 were longer than max_document_bytes"):
        prepare([tmp_path / "big.txt"], tmp_path / "out", **ARGS, max_document_bytes=100)


def test_wordpiece_ids_do_not_depend_on_the_trainers_hash_order():
    docs = [" ".join(random.Random(i).choice(["lorem", "ipsum", "dolor", "sit", "amet"]) for _ in range(20))
            for i in range(200)]
    tok = train_tokenizer("wordpiece", iter(docs), 150)
    vocab = tok.get_vocab()
    assert [vocab[t] for t in WORDPIECE_SPECIALS] == list(range(len(WORDPIECE_SPECIALS)))
    rest = sorted((i, t) for t, i in vocab.items() if t not in WORDPIECE_SPECIALS)
    assert [t for _, t in rest] == sorted(t for _, t in rest)
    # Another numbering of the same tokens (as another process's trainer gives) ends the same.
    data = json.loads(tok.to_str())
    shuffled = list(data["model"]["vocab"])[len(WORDPIECE_SPECIALS):]
    random.Random(0).shuffle(shuffled)
    data["model"]["vocab"] = {t: i for i, t in enumerate(WORDPIECE_SPECIALS + shuffled)}
    assert _fixed_ids(Tokenizer.from_str(json.dumps(data))).to_str() == tok.to_str()


def test_an_empty_source_of_a_mix_is_named(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    src = _jsonl(tmp_path / "a.jsonl", 200)
    with pytest.raises(DataError, match="source .*empty.txt holds no documents"):
        prepare([f"{tmp_path / 'empty.txt'}:0.5", f"{src}:0.5"], tmp_path / "out", **ARGS)


def test_a_gz_cut_inside_its_first_row_is_one_sentence(tmp_path):
    import gzip

    packed = gzip.compress((json.dumps({"text": "word " * 5000}) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match="is not a readable .gz file"):
        prepare([tmp_path / "cut.jsonl.gz"], tmp_path / "out", **ARGS)
