"""`ember tune`'s printed table names each trial's status as tune.json does."""

import json
from pathlib import Path

from rich.console import Console

from ember.plan.layout import TrainShape
from ember.plan.models import resolve_model
from ember.plan.search import search
from ember.tune.command import table
from ember.tune.trials import Trial, local_cluster


def _profile(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({
        "format": "ember-plan-profile/1", "source": "calibrated (test)",
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": 8.0, "sms": 2,
                "hbm_gbps": 20.0, "matmul_eff": 1.0, "hbm_eff": 1.0, "intra_gbps": 0.7, "inter_gbps": 0.7},
        "links": {"gpus_per_node": 1, "intra_gbps": 0.7, "inter_gbps": 0.7, "intra_eff": 1.0,
                  "intra_latency_s": 1e-3}}))
    return path


def test_trials_a_stopped_tuning_never_ran_are_not_run_not_failed(tmp_path):
    cluster = local_cluster(1, _profile(tmp_path))
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
