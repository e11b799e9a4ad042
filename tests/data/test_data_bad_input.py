"""Bad input: each case is a counted skip, or one sentence and exit 2 with nothing damaged."""

import errno
import json
from pathlib import Path

import ember.data.packing as packing
from ember.cli import main
from ember.data import load_manifest, prepare
from ember.data.resume import STARTED

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
    (out / STARTED).touch()
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
        ([str(src), "--workers", "100000"], "more than four per core"),
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


def test_lone_surrogates_and_the_byte_limit_in_json_lines(tmp_path):
    """JSON's \\ud800 escape decodes to a lone surrogate no UTF-8 encoder takes: repaired and
    counted like undecodable bytes. max_document_bytes holds for JSON lines too."""
    src = _good(tmp_path / "a.jsonl")
    with open(src, "a") as handle:
        handle.write('{"text": "a lone \\ud800 surrogate in a scraped row"}\n')
        handle.write(json.dumps({"text": "long " * 400}) + "\n")  # 2,000 bytes
    m = prepare([src], tmp_path / "out", **ARGS, max_document_bytes=1000)
    assert m["non_utf8_documents"] == 1 and m["skipped_inputs"]["too_long"] == 1
    assert m["input_documents"] == 201


def test_damaged_or_mistyped_inputs_are_one_sentence(tmp_path, capsys):
    import zstandard

    src = _good(tmp_path / "a.jsonl")
    packed = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(src.read_bytes()))
    packed[len(packed) // 2] ^= 0xFF  # the frame's checksum catches it
    (tmp_path / "b.jsonl.zst").write_bytes(bytes(packed))
    configs = {"lowercase.toml": '[clean]\nlowercase = "yes"\n', "threshold.toml": '[dedup]\nthreshold = "0.8"\n',
               "perm.toml": "[dedup]\nnum_perm = 16.5\n", "clean.toml": "clean = 5\n",
               "nan.toml": "[dedup]\nthreshold = nan\n"}
    for name, text in configs.items():
        (tmp_path / name).write_text(text)
    for argv, words in [
        ([str(tmp_path / "b.jsonl.zst")], "is not a readable .zst file"),
        ([str(src), "--config", str(tmp_path / "lowercase.toml")], "[clean] lowercase = 'yes' must be true or false"),
        ([str(src), "--config", str(tmp_path / "threshold.toml")], "[dedup] threshold = '0.8' must be a finite number"),
        ([str(src), "--config", str(tmp_path / "perm.toml")], "[dedup] num_perm = 16.5 must be a whole number"),
        ([str(src), "--config", str(tmp_path / "clean.toml")], "[clean] must be a table of settings"),
        ([str(src), "--config", str(tmp_path / "nan.toml")], "[dedup] threshold = nan must be a finite number"),
        (["--source", f"{src}:inf", "--source", f"{src}:1"], "weights must be positive numbers"),
        (["--source", f"{src}:1e308", "--source", f"{src}:1e308"], "add up to more than a float holds"),
        (["--source", f"{src}:abc"], "the weight 'abc' after the colon is not a number"),
        ([str(src), "--vocab-size", "2000000000"], "too large to train"),
        ([str(tmp_path)], "lies inside the input folder"),
    ]:
        out = tmp_path / "o" if argv != [str(tmp_path)] else tmp_path / "o_inside"
        assert main(["data", "prepare", *argv, "--out", str(out), "--quiet", "--workers", "0"]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_colon_in_an_existing_path_is_part_of_the_path(tmp_path):
    from ember.data.mixing import Source, parse_source

    (tmp_path / "notes").mkdir()
    named = tmp_path / "notes:v2.jsonl"
    _good(named)
    assert parse_source(str(named)) == Source(str(named))  # the whole name exists: no weight in it
    assert parse_source(str(tmp_path / "other:abc")) == Source(str(tmp_path / "other:abc"))


def test_a_refused_preparation_leaves_no_files(tmp_path, capsys):
    src = _good(tmp_path / "a.jsonl", n=20)
    out = tmp_path / "o"
    assert main(["data", "prepare", str(src), "--out", str(out), "--seq-len", "100000", "--vocab-size", "300",
                 "--quiet", "--workers", "0"]) == 2
    assert "too short" in capsys.readouterr().err and not out.exists()
    out.mkdir()  # a folder the user made stays, empty
    assert main(["data", "prepare", str(src), "--out", str(out), "--seq-len", "100000", "--vocab-size", "300",
                 "--quiet", "--workers", "0"]) == 2
    assert out.is_dir() and not any(out.iterdir())


def test_every_document_read_is_kept_or_counted_where_it_went(tmp_path):
    """ASCII-only cleaning empties the CJK rows and exact dedup drops the repeats: the
    manifest accounts for each document read (an empty row is skipped before it counts)."""
    from ember.data.clean import CleanConfig
    from ember.data.dedup import DedupConfig

    src = _good(tmp_path / "a.jsonl", n=100)
    with open(src, "a") as handle:
        for i in range(5):
            handle.write(json.dumps({"text": "漢字だけの文書です"}) + "\n")  # nothing left once ASCII-only
        handle.write(json.dumps({"text": "Row 7 holds a plain sentence about data and models."}) + "\n")
        handle.write(json.dumps({"text": "   "}) + "\n")
    m = prepare([src], tmp_path / "out", **ARGS, clean=CleanConfig(ascii_only=True), dedup=DedupConfig(exact=True))
    assert m["cleaning"]["dropped"] == {"empty": 5} and m["dedup"]["exact_duplicates"] == 1
    assert m["skipped"]["empty"] == 1
    assert m["input_documents"] == m["documents"] + 5 + 1 == 106
