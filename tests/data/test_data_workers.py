"""Worker processes give byte-identical output; document boundaries; the CLI and stats."""

import json
import random

import numpy as np

from ember.cli import main
from ember.data import load_manifest, load_tokenizer, prepare
from ember.data.packing import document_starts


def test_worker_counts_give_identical_shards_and_boundaries(corpus, tmp_path):
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    path = tmp_path / "docs.jsonl"
    # A few duplicates so that dedup decisions (made in order) are part of what must match.
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:600] + docs[:40]))
    args = dict(tokenizer="bpe", vocab_size=400, seq_len=32, val_fraction=0.05, shard_size=300,
                doc_boundaries=True, dedup={"exact": True, "near": True}, clean={"lowercase": True},
                progress=False)
    inline = prepare([path], tmp_path / "w0", workers=0, **args)
    # The tokenizer is given to the worker runs so that only tokenizing is compared.
    given = dict(args, tokenizer=str(tmp_path / "w0" / "tokenizer.json"))
    one = prepare([path], tmp_path / "w1", workers=1, **given)
    two = prepare([path], tmp_path / "w2", workers=2, **given)
    for m in (one, two):
        assert m["splits"] == inline["splits"]
        assert m["dedup"] == inline["dedup"] and m["cleaning"] == inline["cleaning"]
    assert inline["dedup"]["exact_duplicates"] >= 40
    assert len(inline["splits"]["train"]["shards"]) > 1

    # Boundaries: each row's starts are exactly the positions after a separator (and 0
    # when the previous row, in file order, ended with one).
    out = tmp_path / "w2"
    m = load_manifest(out, verify=True)
    sep = m["special_tokens"]["sep"]
    previous_was_sep = True
    for shard in m["splits"]["train"]["shards"]:
        rows = np.load(out / shard["file"])
        bounds = np.load(out / shard["doc_boundaries"]["file"])
        assert len(bounds["indptr"]) == len(rows) + 1
        for r, row in enumerate(rows):
            starts = bounds["starts"][bounds["indptr"][r]:bounds["indptr"][r + 1]].tolist()
            expected = ([0] if previous_was_sep else []) + [i + 1 for i in range(len(row) - 1) if row[i] == sep]
            assert starts == expected
            previous_was_sep = row[-1] == sep
    # A row that holds whole documents decodes, segment by segment, to those documents.
    tok = load_tokenizer(out / "tokenizer.json")
    lowered = {d.lower() for d in docs}
    row = rows[1]
    starts = bounds["starts"][bounds["indptr"][1]:bounds["indptr"][2]].tolist()
    for a, b in zip(starts, starts[1:]):
        assert tok.decode(row[a:b - 1].tolist()) in lowered


def test_document_starts_on_a_small_stream():
    rows = np.array([[5, 0, 6, 7], [0, 8, 0, 9]])
    starts, indptr = document_starts(rows, sep_id=0, after_sep=False)
    assert indptr.tolist() == [0, 1, 3] and starts.tolist() == [2, 1, 3]
    starts, indptr = document_starts(rows[:1], sep_id=0, after_sep=True)
    assert starts.tolist() == [0, 2]


def test_cli_prepare_with_sources_and_stats(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative source names, as a user types them
    rng = random.Random(2)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    for name, n in (("a", 300), ("b", 200)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"body": f"{name} {i} " + " ".join(rng.choice(words) for _ in range(30))}) + "\n"
            for i in range(n)))
    out = tmp_path / "out"
    code = main(["data", "prepare", "--source", "a.jsonl:0.5", "--source", "b.jsonl:0.5",
                 "--out", str(out), "--text-field", "body", "--vocab-size", "300", "--seq-len", "16",
                 "--workers", "0", "--dedup", "exact", "--quiet"])
    assert code == 0
    m = load_manifest(out)
    assert [s["documents"] for s in m["source_stats"]] == [s["documents_read"] for s in m["source_stats"]]
    assert abs(m["source_stats"][0]["characters"] - m["source_stats"][1]["characters"]) < 300
    capsys.readouterr()
    assert main(["data", "stats", str(out), "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "Sources" in text and "a.jsonl" in text and "characters per token" in text
    assert "Most frequent train tokens" in text and "duplicate ratio" in text
    png = (out / "document_lengths.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_cli_takes_sources_and_settings_from_the_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text("\n\n".join(f"{name} paragraph {i} with a few plain words."
                                                          for i in range(150)))
    (tmp_path / "prep.toml").write_text(
        '[prepare]\nseq_len = 16\nvocab_size = 300\nworkers = 1\ndoc_boundaries = true\n'
        '[[source]]\npath = "a.txt"\nweight = 2\n[[source]]\npath = "b.txt"\nweight = 1\n'
        '[clean]\nlowercase = true\n')
    assert main(["data", "prepare", "--config", "prep.toml", "--out", "out", "--seq-len", "24", "--quiet"]) == 0
    m = load_manifest(tmp_path / "out", verify=True)
    assert m["seq_len"] == 24 and m["vocab_size"] == 300 and m["workers"] == 1 and m["doc_boundaries"]
    assert m["sources"] == ["a.txt:2", "b.txt:1"] and m["cleaning"]["config"]["lowercase"]
    a, b = (s["characters"] for s in m["source_stats"])
    assert abs(a / (a + b) - 2 / 3) < 0.02


def test_a_worker_that_dies_fails_the_run_instead_of_hanging(tmp_path):
    import pytest

    from ember.data import DataError, train_tokenizer
    from ember.data.pipeline import Workers

    tok = train_tokenizer("bpe", ["some words to learn from"], 260)
    batches = ((i, ["a document of a few words"] * 200) for i in range(200))
    with Workers(1, tok.to_str(), {}, {}) as workers:
        results = workers.map(batches)
        next(results)
        for process in list(workers.pool._processes.values()):
            process.kill()  # as the kernel's out-of-memory killer would
        with pytest.raises(DataError, match="worker process died"):
            list(results)
        manager = workers.pool._executor_manager_thread
    # The executor's bookkeeping thread ends too: the interpreter joins it at exit.
    manager.join(timeout=10)
    assert not manager.is_alive()


def test_a_worker_killed_while_sending_a_result_does_not_hang_the_exit():
    """CPython gh-94777: a worker killed halfway through writing its result leaves the
    executor's bookkeeping thread waiting for the rest, and the interpreter joins that
    thread at exit. Here the half-written result is made by hand."""
    import os
    import struct

    import pytest

    from ember.data import DataError, train_tokenizer
    from ember.data.pipeline import Workers

    tok = train_tokenizer("bpe", ["some words to learn from"], 260)
    with Workers(1, tok.to_str(), {}, {}) as workers:
        results = workers.map((i, ["a document"] * 2) for i in range(4))
        next(results)
        pool = workers.pool
        # A header promising 1,000 bytes, and 10 of them: the reader now waits for 990.
        os.write(pool._result_queue._writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)
        for process in list(pool._processes.values()):
            process.kill()
        with pytest.raises(DataError, match="worker process died"):
            list(results)
        manager = pool._executor_manager_thread
    manager.join(timeout=10)
    assert not manager.is_alive()
