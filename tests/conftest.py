"""Shared fixtures: one small real-text corpus and one prepared dataset per test session."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n N` the N workers share the cores: one thread each (and in the
    # processes they start), or their thread pools wait on each other's threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# A model small enough that a few hundred steps take seconds on two CPU cores.
TINY = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.mlp_hidden=64",
        "model.max_seq_len=64", "train.micro_batch=4", "train.global_batch=8",
        "train.log_every=1", "train.eval_batches=2", "train.checkpoint_every=1000steps"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The first few hundred documents of the built-in standard-library corpus."""
    from ember.data.corpus import write_stdlib_corpus

    folder = tmp_path_factory.mktemp("corpus")
    full = folder / "stdlib.jsonl"
    write_stdlib_corpus(full)
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    small = folder / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in rows[:1500]))
    return small


@pytest.fixture(scope="session")
def dataset(corpus, tmp_path_factory) -> Path:
    from ember.data.prepare import prepare

    out = tmp_path_factory.mktemp("prepared") / "bpe"
    prepare([corpus], out, tokenizer="bpe", vocab_size=512, seq_len=64, val_fraction=0.05,
            progress=False)
    return out


@pytest.fixture(scope="session")
def bounded_dataset(corpus, tmp_path_factory) -> Path:
    """`dataset` prepared with --doc-boundaries: document starts beside every shard."""
    from ember.data.prepare import prepare

    out = tmp_path_factory.mktemp("bounded") / "bpe"
    prepare([corpus], out, tokenizer="bpe", vocab_size=512, seq_len=64, val_fraction=0.05,
            doc_boundaries=True, progress=False)
    return out


def ember_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ember", *args]
