"""An interrupted `ember data prepare` continues from its last completed shard: the same
command finishes the folder that an uninterrupted run writes (every shard's sha256, the
splits and the counts), without training the tokenizer again or tokenizing the documents
already packed; also for a streamed Hugging Face dataset (local parquet files)."""

import importlib
import json
import os
import random

import numpy as np
import pytest

import ember.data.packing as packing
import ember.data.pipeline as pipeline
import ember.data.work as work
from ember.data import load_manifest, prepare
from ember.data.errors import DataError
from ember.data.mixing import Source
from ember.data.resume import PICKLED_STATE_FILE, STARTED, STATE_FILE

prepare_module = importlib.import_module("ember.data.prepare")  # ember.data.prepare is also the function

WORDS = "model data token layer value return the a of to in is for with that by list string file".split()


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = [f"Doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for i in range(n)]
    return docs + docs[: n // 8]  # repeats, so that exact dedup's memory matters after a resume


def _comparable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created"}


def interrupted(monkeypatch, inputs, out, at_save: int = 6, **args) -> None:
    """`prepare` stopped by a KeyboardInterrupt (Ctrl-C, a killed job or a lost stream) while
    it writes its `at_save`-th shard; batches of 40 documents, so states are saved along the way."""
    monkeypatch.setattr(pipeline, "BATCH_DOCUMENTS", 40)
    real_save, calls = packing.save_shard, []

    def failing_save(path, rows):
        calls.append(path)
        if len(calls) == at_save:
            raise KeyboardInterrupt
        return real_save(path, rows)

    monkeypatch.setattr(packing, "save_shard", failing_save)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, **args)
    monkeypatch.setattr(packing, "save_shard", real_save)
    assert (out / STATE_FILE).is_file() and not (out / "manifest.json").exists()
    with np.load(out / STATE_FILE, allow_pickle=False) as state:  # no object in it needs unpickling
        assert all(state[name].dtype != object for name in state.files)


def _interrupt_then_resume(monkeypatch, inputs, out, clean_out, **args):
    interrupted(monkeypatch, inputs, out, **args)

    def no_training(*a, **k):
        raise AssertionError("a resumed preparation must reuse its tokenizer")

    tokenized = []
    real_process = work.process
    monkeypatch.setattr(prepare_module, "train_tokenizer", no_training)
    monkeypatch.setattr(pipeline, "process", lambda docs: tokenized.append(len(docs)) or real_process(docs))
    resumed = prepare(inputs, out, **args)
    monkeypatch.undo()
    monkeypatch.setattr(pipeline, "BATCH_DOCUMENTS", 40)
    clean = prepare(inputs, clean_out, **args)
    return resumed, clean, sum(tokenized)


ARGS = dict(tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.05, seed=3, shard_sequences=60,
            progress=False, workers=0, dedup={"exact": True})


def test_an_interrupted_preparation_continues_and_writes_what_an_uninterrupted_one_does(tmp_path, monkeypatch):
    docs = _documents(600)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    resumed, clean, tokenized = _interrupt_then_resume(monkeypatch, [src], tmp_path / "out", tmp_path / "clean", **ARGS)
    assert _comparable(resumed) == _comparable(clean)
    assert resumed["dedup"]["exact_duplicates"] == len(docs) - 600 > 0
    assert 0 < tokenized < len(docs)  # only what the interrupted run had not packed
    load_manifest(tmp_path / "out", verify=True)  # every listed shard's checksum
    assert not (tmp_path / "out" / STATE_FILE).exists()
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.npy"))
    assert shards == sorted(p.name for p in (tmp_path / "clean").glob("*.npy"))


def test_near_dedup_boundaries_and_curriculum_continue_as_they_were(tmp_path, monkeypatch):
    """The near-duplicate index, the document boundaries and the curriculum keys of the rows
    still waiting are part of the state: documents after the interruption that nearly repeat
    ones before it are still found, and every file equals an uninterrupted run's."""
    docs = _documents(600)
    docs += [d + " value" for d in docs[:60]]  # one word more: near, not exact, duplicates
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    args = {**ARGS, "dedup": {"exact": True, "near": True}, "doc_boundaries": True, "curriculum": "sentence-length"}
    resumed, clean, tokenized = _interrupt_then_resume(monkeypatch, [src], tmp_path / "out", tmp_path / "clean", **args)
    assert _comparable(resumed) == _comparable(clean)
    assert resumed["dedup"]["near_duplicates"] >= 50 and resumed["dedup"]["exact_duplicates"] > 0
    assert 0 < tokenized < len(docs)
    load_manifest(tmp_path / "out", verify=True)
    names = [sorted(p.name for p in (tmp_path / folder).iterdir()) for folder in ("out", "clean")]
    assert names[0] == names[1]


def test_an_earlier_versions_pickled_state_is_refused_and_kept(tmp_path, capsys):
    from ember.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(50)))
    out = tmp_path / "out"
    out.mkdir()
    (out / STARTED).touch()
    kept = {PICKLED_STATE_FILE: b"\x80\x05N.", "tokenizer.json": b"{}", "train_00000.npy": b"rows"}
    for name, content in kept.items():
        (out / name).write_bytes(content)
    assert main(["data", "prepare", str(src), "--out", str(out), "--seq-len", "32", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"holds an unfinished preparation saved by an earlier ember ({PICKLED_STATE_FILE})" in err
    assert err.count("\n") == 1
    assert all((out / name).read_bytes() == content for name, content in kept.items())


def test_other_settings_are_refused_naming_the_difference_and_the_folder_is_kept(tmp_path, monkeypatch, capsys):
    from ember.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(400)))
    out = tmp_path / "out"
    interrupted(monkeypatch, [src], out, **ARGS)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for change, named in (({"seq_len": 24}, "--seq-len 32 (not 24)"), ({"dedup": {"near": True}}, "--dedup"),
                          ({"seed": 4}, "--seed 3 (not 4)")):
        with pytest.raises(DataError) as refused:
            prepare([src], out, **{**ARGS, **change})
        assert named in str(refused.value) and "run the command that started it to continue it" in str(refused.value)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["data", "prepare", str(src), "--out", str(out), "--seq-len", "64", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds an unfinished preparation with" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_same_input_named_by_another_path_continues(tmp_path, monkeypatch):
    """A relative path, an absolute one and a symlink name the same file: the preparation
    continues instead of starting over."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(600)))
    (tmp_path / "link.jsonl").symlink_to(src)
    interrupted(monkeypatch, [src], tmp_path / "out", **ARGS)
    monkeypatch.chdir(tmp_path)
    tokenized, real_process = [], work.process
    monkeypatch.setattr(pipeline, "process", lambda docs: tokenized.append(len(docs)) or real_process(docs))
    resumed = prepare(["link.jsonl"], "out", **ARGS)
    assert 0 < sum(tokenized) < 600
    assert resumed["splits"] == prepare([src], tmp_path / "clean", **ARGS)["splits"]


def test_a_damaged_state_starts_over(tmp_path, monkeypatch):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(400)))
    interrupted(monkeypatch, [src], tmp_path / "out", **ARGS)
    (tmp_path / "out" / STATE_FILE).write_bytes(b"not a zip file")
    redone = prepare([src], tmp_path / "out", **ARGS)
    assert _comparable(redone) == _comparable(prepare([src], tmp_path / "clean", **ARGS))


def test_a_streamed_hugging_face_dataset_resumes(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "parquet"
    folder.mkdir()
    docs = _documents(500, seed=1)
    for part in range(3):  # a dataset published as parquet parts, as FineWeb is
        pq.write_table(pa.table({"text": docs[part::3]}), folder / f"part-{part:05d}.parquet")
    source = Source("hf:parquet", data_files=str(folder / "*.parquet"), split="train")
    resumed, clean, tokenized = _interrupt_then_resume(monkeypatch, [source], tmp_path / "out", tmp_path / "clean",
                                                       **ARGS)
    assert _comparable(resumed) == _comparable(clean)
    assert 0 < tokenized < len(docs)


_MEASURE = r"""
import sys, threading, time
from ember.data import prepare
from ember.data.errors import DataError
from ember.data.mixing import Source

peak, done = [0], [False]

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.01)

before = anon()
threading.Thread(target=sample, daemon=True).start()
prepare([Source("hf:parquet", data_files=sys.argv[1], split="train")], sys.argv[2], tokenizer=sys.argv[3],
        seq_len=128, val_fraction=0.01, shard_sequences=2048, progress=False, workers=0)
done[0] = True
print(peak[0] - before)
"""


def test_a_streamed_dataset_is_prepared_in_bounded_memory(tmp_path):
    """A corpus of 16 times as many parquet parts needs no more memory: documents stream
    through in batches and shards are written as they fill. Anonymous memory, sampled
    (mapped files excluded); what `datasets` holds is bounded by the part it reads."""
    pytest.importorskip("datasets")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    import subprocess
    import sys

    docs = _documents(3000, seed=2)
    tokenizer = tmp_path / "tok"
    prepare([_write_jsonl(tmp_path / "sample.jsonl", docs[:500])], tokenizer, tokenizer="bpe", vocab_size=400,
            seq_len=32, progress=False, workers=0)
    peaks, text = {}, {}
    for parts in (2, 32):  # 1.2 MB of text per part
        folder = tmp_path / f"parquet-{parts}"
        folder.mkdir()
        for part in range(parts):
            pq.write_table(pa.table({"text": docs * 3}), folder / f"part-{part:05d}.parquet", row_group_size=2000)
        command = [sys.executable, "-c", _MEASURE, str(folder / "*.parquet"), str(tmp_path / f"out-{parts}"),
                   str(tokenizer / "tokenizer.json")]
        # Arrow's default pool (jemalloc/mimalloc) hands freed memory back on a timer, so on a
        # busy machine its cache, not what the pipeline holds, sets the peak (+17 MB measured
        # with two cores saturated); the system allocator returns it at once.
        env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system")
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[parts], text[parts] = int(done.stdout.split()[-1]), sum(len(d) for d in docs) * 3 * parts
    assert text[32] - text[2] > 35e6
    assert peaks[32] < peaks[2] + 25e6, peaks  # 36 MB more text, not 36 MB more memory


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
