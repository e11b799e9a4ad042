"""Mistakes a careless user makes with every verb: each gets exit status 2 and one
sentence on stderr, never a traceback, and the data and run it was pointed at are left
exactly as they were. (Training's own settings are swept in tests/test_cli_errors.py,
the planner's in tests/plan/test_cli_plan.py, damaged files in tests/test_fuzz_inputs.py.)"""

import hashlib
import shutil

import pytest

from conftest import REPO, TINY
from ember.cli import main

RECIPE = str(REPO / "configs/tiny-gpt.toml")
SETS = [x for s in TINY for x in ("--set", s)]


@pytest.fixture(scope="module")
def places(dataset, tmp_path_factory):
    """A copy of the prepared data, a trained run, and paths that cannot be used."""
    root = tmp_path_factory.mktemp("bad-input")
    data = root / "data"
    shutil.copytree(dataset, data)
    run = root / "run"
    assert main(["train", RECIPE, "--data", str(data), "--out", str(run), "--budget", "2steps", "--quiet",
                 *SETS]) == 0
    (root / "a_file").write_text("x")
    (root / "notes.txt").write_text("not a recipe = [")
    (root / "glue").mkdir()
    return {"data": str(data), "run": str(run), "root": root, "file": str(root / "a_file"),
            "missing": str(root / "missing"), "notes": str(root / "notes.txt"), "glue": str(root / "glue")}


CASES = [
    # bench
    ("bench-missing-data", ["bench", RECIPE, "--data", "{missing}"], "manifest"),
    ("bench-missing-recipe", ["bench", "{missing}.toml", "--data", "{data}"], "missing.toml"),
    ("bench-bad-recipe", ["bench", "{notes}", "--data", "{data}"], "notes.txt"),
    ("bench-bad-set", ["bench", RECIPE, "--data", "{data}", "--set", "train.micro_batch=0"], "train.micro_batch"),
    ("bench-unknown-key", ["bench", RECIPE, "--data", "{data}", "--set", "train.nope=1"], "unknown config key"),
    ("bench-zero-steps", ["bench", RECIPE, "--data", "{data}", "--steps", "0"], "--steps"),
    ("bench-negative-warmup", ["bench", RECIPE, "--data", "{data}", "--warmup", "-1"], "--warmup"),
    ("bench-layout-too-big", ["bench", RECIPE, "--data", "{data}", "--set", "parallel.tp=4"], "parallel"),
    # train
    ("train-seed-beyond-64-bits", ["train", RECIPE, "--data", "{data}", "--out", "{root}/t1", "--set",
                                   "train.seed=1e30"], "train.seed must be"),
    ("train-mps-not-here", ["train", RECIPE, "--data", "{data}", "--out", "{root}/t2", "--set", "train.device=mps"],
     "MPS"),
    ("train-nan-mask-fraction", ["train", RECIPE, "--data", "{data}", "--out", "{root}/t3", "--set",
                                 "data.mask_token_frac=nan"], "mask_token_frac"),
    # tune
    ("tune-zero-processes", ["tune", RECIPE, "--data", "{data}", "--nproc", "0", "--dry-run"], "--nproc"),
    ("tune-missing-data", ["tune", RECIPE, "--data", "{missing}", "--nproc", "2", "--dry-run"], "manifest"),
    ("tune-zero-top", ["tune", RECIPE, "--data", "{data}", "--nproc", "2", "--top", "0", "--dry-run"], "--top"),
    ("tune-zero-steps", ["tune", RECIPE, "--data", "{data}", "--nproc", "2", "--steps", "0", "--dry-run"], "--steps"),
    ("tune-warmup-not-below-steps", ["tune", RECIPE, "--data", "{data}", "--nproc", "2", "--steps", "2", "--warmup",
                                     "2", "--dry-run"], "--warmup (2) must be less than --steps (2)"),
    ("tune-missing-profile", ["tune", RECIPE, "--data", "{data}", "--nproc", "2", "--profile", "{missing}",
                              "--dry-run"], "missing"),
    ("tune-bad-set", ["tune", RECIPE, "--data", "{data}", "--nproc", "2", "--set", "optim.lr=-1", "--dry-run"],
     "optim.lr"),
    # eval lm
    ("eval-lm-missing-run", ["eval", "lm", "--checkpoint", "{missing}", "--data", "{data}"], "missing"),
    ("eval-lm-not-a-run", ["eval", "lm", "--checkpoint", "{glue}", "--data", "{data}"], "glue"),
    ("eval-lm-missing-data", ["eval", "lm", "--checkpoint", "{run}", "--data", "{missing}"], "manifest"),
    ("eval-lm-zero-batches", ["eval", "lm", "--checkpoint", "{run}", "--data", "{data}", "--batches", "0"],
     "--batches"),
    ("eval-lm-zero-batch-size", ["eval", "lm", "--checkpoint", "{run}", "--data", "{data}", "--batch-size", "0"],
     "--batch-size"),
    ("eval-lm-bad-device", ["eval", "lm", "--checkpoint", "{run}", "--data", "{data}", "--device", "tpu9"],
     "--device 'tpu9' is not a device"),
    ("eval-lm-out-under-file", ["eval", "lm", "--checkpoint", "{run}", "--data", "{data}", "--out",
                                "{file}/r.json"], "a_file"),
    # eval glue
    ("eval-glue-missing-dir", ["eval", "glue", "--checkpoint", "{run}", "--glue-dir", "{missing}"], "missing"),
    ("eval-glue-unknown-task", ["eval", "glue", "--checkpoint", "{run}", "--glue-dir", "{glue}", "--tasks",
                                "squad"], "squad"),
    ("eval-glue-task-not-there", ["eval", "glue", "--checkpoint", "{run}", "--glue-dir", "{glue}", "--tasks", "rte"],
     "RTE"),
    ("eval-glue-zero-seeds", ["eval", "glue", "--checkpoint", "{run}", "--glue-dir", "{glue}", "--seeds", "0"],
     "--seeds"),
    ("eval-glue-missing-run", ["eval", "glue", "--checkpoint", "{missing}", "--glue-dir", "{glue}"], "missing"),
    # export
    ("export-missing-run", ["export", "hf", "--checkpoint", "{missing}", "--out", "{root}/hf1"], "missing"),
    ("export-onto-a-file", ["export", "hf", "--checkpoint", "{run}", "--out", "{file}"], "a_file"),
    ("export-under-a-file", ["export", "hf", "--checkpoint", "{run}", "--out", "{file}/x"],
     "as a folder: it is a file"),
    ("export-onto-the-run", ["export", "hf", "--checkpoint", "{run}", "--out", "{run}"], "run"),
    ("export-missing-tokenizer", ["export", "hf", "--checkpoint", "{run}", "--out", "{root}/hf2", "--tokenizer",
                                 "{missing}.json"], "does not exist; pass an existing tokenizer.json"),
    ("export-bad-tokenizer", ["export", "hf", "--checkpoint", "{run}", "--out", "{root}/hf3", "--tokenizer",
                              "{notes}"], "notes.txt"),
    # report
    ("report-missing", ["report", "{missing}"], "missing"),
    ("report-a-file", ["report", "{file}"], "a_file"),
    ("report-data-folder", ["report", "{data}"], "metrics.jsonl"),
    # data
    ("stats-missing", ["data", "stats", "{missing}"], "manifest"),
    ("stats-negative-top", ["data", "stats", "{data}", "--top", "-5"], "--top"),
    ("stats-a-run", ["data", "stats", "{run}"], "manifest"),
    ("prepare-missing-input", ["data", "prepare", "{missing}.txt", "--out", "{root}/p1"], "missing.txt"),
    ("prepare-out-under-file", ["data", "prepare", "{notes}", "--out", "{file}/p"], "a_file"),
    ("prepare-onto-data", ["data", "prepare", "{notes}", "--out", "{data}"], "data"),
    ("prepare-zero-seq-len", ["data", "prepare", "{notes}", "--out", "{root}/p2", "--seq-len", "0"], "seq_len 0"),
    ("prepare-tiny-vocab", ["data", "prepare", "{notes}", "--out", "{root}/p3", "--vocab-size", "3"],
     "vocab_size 3"),
    ("corpus-onto-a-folder", ["data", "corpus", "--out", "{data}"], "data"),
    # plan
    ("plan-unknown-preset", ["plan", "--model", "gpt9", "--gpu", "a100-80gb", "--gpus", "8"], "gpt9"),
    ("plan-zero-gpus", ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "0"], "--gpus"),
    ("plan-no-gpu", ["plan", "--model", "gpt3-175b", "--gpus", "8"], "--gpu"),
    ("plan-no-global-batch", ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "8"],
     "--global-batch"),
    ("plan-bad-layout", ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "64",
                         "--layout", "tp=three"], "tp"),
]


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv,words", [(argv, words) for _, argv, words in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_sentence_and_status_2(places, capsys, argv, words):
    from pathlib import Path

    before = {name: _snapshot(Path(places[name])) for name in ("data", "run")}
    filled = [a.format(**places) for a in argv]
    code = main(filled)
    err = capsys.readouterr().err
    assert code == 2, (filled, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err, err
    after = {name: _snapshot(Path(places[name])) for name in ("data", "run")}
    assert after == before  # nothing the user made is touched
    assert Path(places["file"]).read_text() == "x"


def test_resume_of_a_run_with_a_damaged_config_is_one_sentence(places, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(places["run"], run)
    (run / "config.toml").write_text("[model")
    code = main(["train", RECIPE, "--data", places["data"], "--out", str(run), "--budget", "3steps", "--resume",
                 *SETS])
    err = capsys.readouterr().err
    assert code == 2 and "config.toml is damaged" in err and err.count("\n") == 1, err


def test_training_refuses_a_tokenizer_the_shards_were_not_made_with(places, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(places["data"], data)
    tokenizer = data / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")  # another file: its hash differs
    for damage, words in ((None, "not the tokenizer the data's shards were made with"), ("missing", "is missing")):
        if damage == "missing":
            tokenizer.unlink()
        code = main(["train", RECIPE, "--data", str(data), "--out", str(tmp_path / "run"), "--budget", "2steps",
                     *SETS])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()


def test_an_unreadable_file_is_named_as_unreadable_not_as_damaged(places, tmp_path, capsys, monkeypatch):
    """Permissions (chmod 000 on a shared filesystem) are the user's to fix; preparing the
    data again or retraining would not help. (Root reads anything, so the refusal is forced.)"""
    import builtins
    import errno

    import numpy as np

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(np, "load", denied)
        code = main(["train", RECIPE, "--data", places["data"], "--out", str(tmp_path / "r1"), "--budget", "2steps",
                     *SETS])
    err = capsys.readouterr().err
    assert code == 2 and "cannot use" in err and "Permission denied" in err and "prepare" not in err, err
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file).endswith(("model.safetensors", "tokenizer.json")):
            denied(file)
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", guarded)
        code = main(["eval", "lm", "--checkpoint", places["run"], "--data", places["data"]])
    err = capsys.readouterr().err
    assert code == 2 and "Permission denied" in err and "does not hold weights" not in err, err
