"""`ember tune` at a global batch the recipe's own train.micro_batch does not divide: tune
chooses each trial's micro-batch, so only those are held against the global batch."""

import json

import pytest

from ember.cli import main

RECIPE = """[model]
objective = "causal"
hidden = 32
layers = 2
heads = 2
mlp_hidden = 64
max_seq_len = 64

[train]
micro_batch = 32
global_batch = 64
budget = "2h"
"""


def _profile(tmp_path):
    """A CPU profile as `ember plan calibrate` writes one."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({
        "format": "ember-plan-profile/1", "source": "calibrated (test)",
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": 8.0, "sms": 2,
                "hbm_gbps": 20.0, "matmul_eff": 1.0, "hbm_eff": 1.0, "intra_gbps": 0.7, "inter_gbps": 0.7},
        "links": {"gpus_per_node": 2, "intra_gbps": 0.7, "inter_gbps": 0.7, "intra_eff": 1.0,
                  "intra_latency_s": 1e-3}}))
    return path


@pytest.fixture
def args(tmp_path, dataset):
    recipe = tmp_path / "big-micro.toml"
    recipe.write_text(RECIPE)
    return ["tune", str(recipe), "--data", str(dataset), "--nproc", "2", "--profile", str(_profile(tmp_path)),
            "--top", "1", "--out", str(tmp_path / "tune"), "--dry-run"]


@pytest.mark.parametrize("batch", [16, 24])  # below the recipe's micro_batch of 32; above it, not a multiple
def test_a_global_batch_the_recipes_micro_batch_does_not_divide_is_tuned(args, batch, capsys):
    assert main(args + ["--set", f"train.global_batch={batch}"]) == 0
    printed = capsys.readouterr().out
    assert f"train.global_batch={batch}" in printed and "train.micro_batch=" in printed
    assert main(args + ["--set", f"train.global_batch={batch}", "--layout", "tp=2,sp=1,mbs=8"]) == 0
    assert "train.micro_batch=8" in capsys.readouterr().out


def test_the_other_checks_still_refuse_before_any_trial(args, capsys):
    # A layout whose micro-batch does not divide the global batch is still refused, by its own numbers.
    assert main(args + ["--set", "train.global_batch=16", "--layout", "tp=2,sp=1,mbs=32"]) == 2
    err = capsys.readouterr().err
    assert "cannot train this recipe" in err and "Traceback" not in err
    # Every other recipe check is kept.
    assert main(args + ["--set", "train.global_batch=16", "--set", "schedule.warmup=2"]) == 2
    assert "schedule.warmup must be a fraction" in capsys.readouterr().err
    assert main(args + ["--set", "train.global_batch=0"]) == 2
    assert "train.global_batch" in capsys.readouterr().err
