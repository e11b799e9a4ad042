"""`ember tune` from the command line: at a global batch the recipe's own train.micro_batch does
not divide (tune chooses each trial's micro-batch, so only those are held against the global
batch), and its printed table names each trial's status as tune.json does."""

import json
from pathlib import Path

import pytest
from rich.console import Console

from ember.cli import main
from ember.plan.layout import TrainShape
from ember.plan.models import resolve_model
from ember.plan.search import search
from ember.tune.command import table
from ember.tune.trials import Trial, local_cluster

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


def _profile(tmp_path, per_node: int = 2):
    """A CPU profile as `ember plan calibrate` writes one."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({
        "format": "ember-plan-profile/1", "source": "calibrated (test)",
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": 8.0, "sms": 2,
                "hbm_gbps": 20.0, "matmul_eff": 1.0, "hbm_eff": 1.0, "intra_gbps": 0.7, "inter_gbps": 0.7},
        "links": {"gpus_per_node": per_node, "intra_gbps": 0.7, "inter_gbps": 0.7, "intra_eff": 1.0,
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


def test_trials_a_stopped_tuning_never_ran_are_not_run_not_failed(tmp_path):
    cluster = local_cluster(1, _profile(tmp_path, per_node=1))
    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml"
    model, _ = resolve_model(str(recipe), ["model.vocab_size=512"])
    ranked = search(model, cluster, TrainShape(64, 8)).ranked
    trials = [Trial(i, p, [], tmp_path / f"trial-{i}", {}) for i, p in enumerate(ranked[:3], 1)]
    trials[0].status, trials[0].tokens_per_s = "finished", 1000.0
    trials[1].status, trials[1].reason = "failed", "timed out after 5 s"
    trials[2].status, trials[2].reason = "not run", "the tuning was stopped"
    console = Console(width=250, record=True)
    console.print(table(trials, [trials[0]], cluster.n_gpus))
    rows = console.export_text().splitlines()
    status = {i: next(r for r in rows if r.lstrip("│ ").startswith(f"{i} ")) for i in (1, 2, 3)}
    assert status[1].rstrip(" │").endswith("ok")
    assert "failed: timed out after 5 s" in status[2]
    assert status[3].rstrip(" │").endswith("not run") and "failed" not in status[3]
    assert [t.to_dict(cluster.n_gpus)["status"] for t in trials] == ["finished", "failed", "not run"]
