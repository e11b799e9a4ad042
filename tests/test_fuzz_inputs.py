"""Damaged files a user may hand ember, fed to each reader: random bytes, and JSON or TOML
of the right syntax with values of the wrong kinds. Every reader answers with one sentence
and exit status 2 (or, for a run's log, reads what is whole), never a traceback."""

import json
import random
import shutil

import pytest

from conftest import REPO
from ember.cli import main

SEEDS = range(12)


def _garbage(seed: int) -> bytes:
    rng = random.Random(seed)
    kind = seed % 3
    if kind == 0:  # raw bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    if kind == 1:  # printable noise
        return "".join(rng.choice("{}[]\":,=.#\n abc123-_") for _ in range(rng.randrange(1, 300))).encode()
    values = [None, True, -1, 0, 1e400, "x", [], {}, [1, "a"], {"a": [None]}, 3.5, "nan"]
    return json.dumps({rng.choice(["gpu", "links", "stack", "vocab_size", "seq_len", "step", "loss", "format",
                                   "splits", "special_tokens", "dtype", "name"]): rng.choice(values)
                       for _ in range(rng.randrange(1, 6))}).encode()


def _one_sentence(capsys, code: int) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ember: error:") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("seed", SEEDS)
def test_a_damaged_recipe(seed, dataset, tmp_path, capsys):
    recipe = tmp_path / "recipe.toml"
    recipe.write_bytes(_garbage(seed) + b"\n[model]\nhidden = 'wide'\n")  # never a valid recipe
    _one_sentence(capsys, main(["train", str(recipe), "--data", str(dataset), "--out", str(tmp_path / "r")]))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_damaged_manifest(seed, dataset, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    (data / "manifest.json").write_bytes(_garbage(seed))
    _one_sentence(capsys, main(["data", "stats", str(data)]))
    _one_sentence(capsys, main(["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(data),
                                "--out", str(tmp_path / "r")]))


# Right syntax, wrong kinds: each once ended in a traceback.
PROFILES = ['{"gpu": [1]}', '{"gpu": {"name": "H100", "memory_gib": "lots"}}', '{"gpu": {"name": 5}}',
            '{"gpu": {"name": "H100"}, "stack": {"overlap_grad_reduce": 3}}', '{"gpu": {"name": "H100"}, "links": 7}']


@pytest.mark.parametrize("content", [*SEEDS, *PROFILES])
def test_a_damaged_profile(content, tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_bytes(_garbage(content) if isinstance(content, int) else content.encode())
    _one_sentence(capsys, main(["plan", "--profile", str(profile), "--model", "llama3-8b", "--gpus", "8",
                                "--global-batch", "64"]))


@pytest.mark.parametrize("seed", [*SEEDS, '[1, 2]\n{"step": "x", "loss": "y"}\n{"loss": 1}'])
def test_a_damaged_metrics_log_is_read_for_what_is_whole(seed, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    whole = {"step": 1, "tokens": 64, "elapsed_s": 1.0, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
             "tokens_per_s": 64.0, "mfu": None}
    damage = _garbage(seed) if isinstance(seed, int) else seed.encode()
    (run / "metrics.jsonl").write_bytes(json.dumps(whole).encode() + b"\n" + damage)
    (run / "summary.json").write_bytes(_garbage(len(str(seed)) + 100))
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    assert "5.0000" in capsys.readouterr().out


def test_log_lines_missing_a_timing_field_still_report(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 1, "tokens": 64, "loss": 5.0, "tokens_per_s": 64.0},  # no elapsed_s
             {"step": 2, "tokens": 128, "loss": 4.0, "tokens_per_s": 64.0, "compute_s": 0.5}]  # no exposed_comm_s
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "4.0000" in out and "time" not in out and "exposed communication" not in out
