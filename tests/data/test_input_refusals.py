"""Inputs, configs and outputs that are refused with one sentence and exit 2, before any work."""

import json
from pathlib import Path

import pytest

import ember.data.corpus as corpus
from ember.cli import main
from ember.data import iter_documents


def _good(path: Path, n: int = 3000) -> Path:
    path.write_text("".join(json.dumps({"text": f"Row {i} holds a plain sentence about data and models."}) + "\n"
                            for i in range(n)))
    return path


def _refused(argv: list[str], words: str, capsys) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_cut_short_zst_file_is_refused_like_a_cut_short_gz(tmp_path, capsys):
    import zstandard

    rows = _good(tmp_path / "a.jsonl").read_bytes()
    # Two frames, as concatenated .zst files have: both are read.
    whole = zstandard.ZstdCompressor().compress(rows) + zstandard.ZstdCompressor().compress(b'{"text": "last"}\n')
    (tmp_path / "whole.jsonl.zst").write_bytes(whole)
    docs = list(iter_documents([tmp_path / "whole.jsonl.zst"]))
    assert len(docs) == 3001 and docs[-1] == "last"
    packed = zstandard.ZstdCompressor().compress(rows)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(packed[:len(packed) // 2])
    out = tmp_path / "o"
    _refused(["data", "prepare", str(cut), "--out", str(out), "--vocab-size", "300", "--quiet", "--workers", "0"],
             f"{cut} is not a readable .zst file", capsys)
    assert not out.exists()


@pytest.mark.parametrize("toml, words", [
    ("prepare = 3\n", "[prepare] must be one table of settings"),
    ("[[prepare]]\nseq_len = 128\n", "[prepare] must be one table of settings"),
    ("[prepare]\nseq_len = '8'\n", "[prepare] seq_len = '8' has the wrong type; it must be a whole number"),
    ("[prepare]\nshard_size = 1.5\n", 'it must be a number of sequences or a size such as "64MB"'),
    ("source = [1, 2]\n", "each source must be a [[source]] table with a path, not 1"),
    ('source = ["in.jsonl"]\n', "each source must be a [[source]] table with a path, not 'in.jsonl'"),
    ("[[source]]\npath = 3\n", "[[source]] path = 3 has the wrong type; it must be text"),
    ('[[source]]\npath = "{src}"\ntext_field = 3\n', "[[source]] text_field = 3 has the wrong type; it must be text"),
    ('[[source]]\npath = "{src}"\nsplit = 1\n', "[[source]] split = 1 has the wrong type"),
    ('[[source]]\npath = "{src}"\nconfig = true\n', "[[source]] config = True has the wrong type"),
    ('[[source]]\npath = "{src}"\ndata_files = [1]\n', "it must be text or a list of texts"),
])
def test_a_badly_shaped_preparation_config_is_one_sentence(tmp_path, capsys, toml, words):
    src = _good(tmp_path / "in.jsonl", n=200)
    config = tmp_path / "prep.toml"
    config.write_text(toml.replace("{src}", str(src)))
    out = tmp_path / "o"
    # With [[source]] tables the config names the inputs; otherwise the command line does.
    inputs = [] if "source" in toml else [str(src)]
    _refused(["data", "prepare", *inputs, "--out", str(out), "--config", str(config), "--vocab-size", "300",
              "--quiet", "--workers", "0"], words, capsys)
    assert not out.exists()


def _no_work(monkeypatch):
    def refuse(root):
        raise AssertionError("the corpus was built before --out was checked")

    monkeypatch.setattr(corpus, "stdlib_files", refuse)


def test_corpus_refuses_a_folder_before_building(tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch)
    folder = tmp_path / "a_folder"
    folder.mkdir()
    _refused(["data", "corpus", "--out", str(folder)], f"--out {folder} is a folder", capsys)
    assert not any(folder.iterdir())


@pytest.mark.parametrize("content", [
    "my own notes\n",
    json.dumps({"text": "a row of the user's own", "id": 7}) + "\n",
    json.dumps({"text": "a last row without its newline"}),
])
def test_corpus_never_overwrites_a_file_it_did_not_write(tmp_path, capsys, monkeypatch, content):
    _no_work(monkeypatch)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(content)
    _refused(["data", "corpus", "--out", str(mine)], "already exists and is not a corpus ember wrote", capsys)
    assert mine.read_text() == content



def test_vocabulary_flags_with_a_tokenizer_file_are_refused(tmp_path, capsys):
    from ember.cli import main

    (tmp_path / "in.jsonl").write_text('{"text": "a few words"}\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    code = main(["data", "prepare", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out"),
                 "--tokenizer", str(tmp_path / "tokenizer.json"), "--vocab-size", "4096"])
    err = capsys.readouterr().err
    assert code == 2 and "--vocab-size only applies to a tokenizer ember trains" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [[], ["--vocab-size", "512"], ["--tokenizer-documents", "10"]])
def test_a_misspelled_tokenizer_is_named_whatever_flags_come_with_it(tmp_path, capsys, flags):
    from ember.cli import main

    (tmp_path / "in.jsonl").write_text('{"text": "a few words"}\n')
    code = main(["data", "prepare", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out"),
                 "--tokenizer", "bep", "--seq-len", "64", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "--tokenizer bep names neither a kind to train (wordpiece, bpe)" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
