"""Bad input: each case is a counted skip, or one sentence and exit 2 with nothing damaged."""

import errno
import json
from pathlib import Path

import ember.data.packing as packing
from ember.cli import main
from ember.data import load_manifest, prepare

ARGS = dict(tokenizer="bpe", vocab_size=300, seq_len=16, val_fraction=0.1, progress=False)


def _good(path: Path, n: int = 200) -> Path:
    path.write_text("".join(json.dumps({"text": f"Row {i} holds a plain sentence about data and models."}) + "\n"
                            for i in range(n)))
    return path


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_counted_skips(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    _good(inputs / "a.jsonl")
    (inputs / "b_empty.jsonl").write_bytes(b"")
    (inputs / "c_empty.txt").write_bytes(b"")
    (inputs / "d.jsonl").write_bytes(b'{"body": "no text field"}\n{"text": "caf\xe9 latin-1 bytes"}\n{"text": 3}\n')
    with open(inputs / "e_huge.txt", "wb") as handle:  # one line of 100 MB, then a normal paragraph
        block = b"x" * (1 << 20)
        for _ in range(100):
            handle.write(block)
        handle.write(b"\n\nA normal paragraph after the huge line.\n")
    (inputs / "f_huge.jsonl").write_bytes(b'{"text": "' + b"y" * (17 << 20) + b'"}\n{"text": "short one"}\n')
    m = prepare([inputs], tmp_path / "out", **ARGS)
    assert m["skipped"] == {"empty": 0, "not_json": 0, "no_text_field": 2}
    assert m["skipped_inputs"] == {"too_long": 2, "empty_files": 2}
    assert m["non_utf8_documents"] == 1
    assert m["input_documents"] == 200 + 1 + 1 + 1 and m["input_files"] == 6


def test_a_tokenizer_that_does_not_match_unfinished_shards(tmp_path, monkeypatch, capsys):
    src = _good(tmp_path / "a.jsonl")
    prepare([src], tmp_path / "first", **ARGS)
    other = tmp_path / "other_tokenizer.json"
    prepare([src], tmp_path / "second", **{**ARGS, "vocab_size": 280})
    other.write_bytes((tmp_path / "second" / "tokenizer.json").read_bytes())
    out = tmp_path / "first"
    (out / "manifest.json").unlink()  # as if that preparation had been interrupted
    before = _snapshot(out)
    code = main(["data", "prepare", str(src), "--out", str(out), "--tokenizer", str(other), "--seq-len", "16",
                 "--quiet", "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "unfinished preparation made with another tokenizer" in err
    assert _snapshot(out) == before
    # The same tokenizer resumes (redoes) the unfinished preparation.
    same = prepare([src], out, **ARGS)
    assert load_manifest(out, verify=True)["splits"] == same["splits"]


def test_a_full_disk(tmp_path, monkeypatch, capsys):
    src = _good(tmp_path / "a.jsonl", 400)
    done = tmp_path / "done"
    prepare([src], done, **ARGS)
    finished = _snapshot(done)
    real_write, calls = packing.write_atomic, []

    def filling_write(path, write):
        def half_then_full(handle):
            calls.append(path)
            if len(calls) == 2:
                handle.write(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device")
            write(handle)
        real_write(path, half_then_full)

    monkeypatch.setattr(packing, "write_atomic", filling_write)
    out = tmp_path / "out"
    code = main(["data", "prepare", str(src), "--out", str(out), "--vocab-size", "300", "--seq-len", "16",
                 "--shard-size", "10", "--quiet", "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is full" in err and "Traceback" not in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
    assert _snapshot(done) == finished
    monkeypatch.setattr(packing, "write_atomic", real_write)
    assert main(["data", "prepare", str(src), "--out", str(out), "--vocab-size", "300", "--seq-len", "16",
                 "--shard-size", "10", "--quiet", "--workers", "0"]) == 0
    load_manifest(out, verify=True)


def test_other_mistakes_are_one_sentence(tmp_path, capsys):
    src = _good(tmp_path / "a.jsonl")
    for argv, words in [
        ([str(src), "--shard-size", "huge"], "size like 64MB"),
        ([str(src), "--workers", "-1"], "workers -1"),
        (["--source", f"{src}:2", str(src)], "every source a weight"),
        ([], "no inputs given"),
        ([str(src), "--config", str(tmp_path / "missing.toml")], "does not exist"),
    ]:
        assert main(["data", "prepare", *argv, "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
    assert main(["data", "stats", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
