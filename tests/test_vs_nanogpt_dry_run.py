"""benchmarks/vs_nanogpt.py at toy shapes: both comparisons (ember against the nanoGPT-style
loop over seeds, ember against transformers' Trainer on BERT MLM) train, are scored by the
one evaluator and reported, so the committed benchmark cannot rot."""

import json
import math
import subprocess
import sys

from conftest import REPO


def test_vs_nanogpt_dry_run(tmp_path):
    out, numbers = tmp_path / "report.txt", tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/vs_nanogpt.py"), "--dry-run", "--seeds", "2",
                           "--work", str(tmp_path / "work"), "--out", str(out), "--json", str(numbers)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(numbers.read_text())
    gpt, bert = result["gpt"], result["bert"]
    assert [r["seed"] for r in gpt["runs"]] == [0, 1]
    for r in gpt["runs"]:
        assert set(r["params"]) == {"ember", "nanogpt"} and r["params"]["ember"] == r["params"]["nanogpt"]
        for side in ("ember", "nanogpt"):
            assert r[side]["tokens_per_s"] > 0 and math.isfinite(r[side]["val_loss"]) and r[side]["val_loss"] > 0
    for side in ("ember", "nanogpt"):
        assert len(gpt[side]["val_loss"]["values"]) == 2 and math.isfinite(gpt[side]["val_loss"]["std"])
    assert math.isfinite(gpt["speed_ratio"]) and isinstance(gpt["speed_met"], bool)
    run = bert["run"]
    assert run["steps"]["ember"] == run["steps"]["transformers"] == bert["steps"]
    for side in ("ember", "transformers"):
        assert run[side]["tokens_per_s"] > 0 and math.isfinite(run[side]["val_loss"])
    assert math.isfinite(bert["speed_ratio"]) and isinstance(bert["speed_met"], bool)
    assert result["load_start"] and result["load_end"] and result["dry_run"] is True
    text = out.read_text()
    assert "DRY RUN" in text and "CPU numbers, not GPU numbers" in text and "held-out loss" in text
    assert "GPT precision: ember fp32, nanoGPT fp32" in text and gpt["runs"][0]["precision"]["ember"] == "fp32"


def test_vs_nanogpt_gpt_only_with_ember_in_bf16(tmp_path):
    out, numbers = tmp_path / "report.txt", tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/vs_nanogpt.py"), "--dry-run", "--seeds", "1",
                           "--bert-steps", "0", "--set", "train.precision=bf16", "--work", str(tmp_path / "work"),
                           "--out", str(out), "--json", str(numbers)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(numbers.read_text())
    assert result["bert"] is None and result["gpt"]["runs"][0]["precision"] == {"ember": "bfloat16 autocast",
                                                                                 "nanogpt": "fp32"}
    text = out.read_text()
    assert "GPT precision: ember bfloat16 autocast, nanoGPT fp32" in text and "BERT" not in text
