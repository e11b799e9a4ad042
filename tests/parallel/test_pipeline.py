"""Pipeline parallelism: layout validation, stage cutting, and pp2 training equal to one
device (every schedule the installed PyTorch has, both objectives, tied and untied
embeddings) in real processes over gloo, one launch for all cases."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ember.config import ModelConfig
from ember.model import Transformer
from ember.layout import Layout, available_schedules, problems
from ember.parallel.stages import split_model, stage_layers, stage_ranks

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_worker  # noqa: E402


def refusal(model: ModelConfig, pp=2, vpp=1, schedule="1f1b", micro_batches=None, compile=False) -> list[str]:
    """ember.layout's problems of a pipeline layout with `micro_batches` per step (one rank
    of micro-batch 1: the global batch is the micro-batch count)."""
    global_batch = micro_batches or pp * vpp * 4
    return problems(Layout(pp=pp, vpp=vpp, schedule=schedule), model, global_batch, compile=compile)


@pytest.mark.parametrize("model, parallel, words", [
    (ModelConfig(layers=6), dict(pp=4), "divisible by parallel.pp x parallel.vpp"),
    (ModelConfig(layers=8), dict(pp=2, vpp=2, schedule="1f1b"), "needs parallel.schedule=interleaved"),
    (ModelConfig(layers=8), dict(pp=2, vpp=2, schedule="gpipe"), "needs parallel.schedule=interleaved"),
    (ModelConfig(layers=8), dict(pp=1, vpp=2), "needs parallel.pp > 1"),
    (ModelConfig(layers=8), dict(schedule="chimera"), "is not one of"),
    (ModelConfig(layers=8), dict(pp=1, schedule="chimera"), "is not one of"),
    (ModelConfig(layers=8), dict(pp=4, schedule="1f1b", micro_batches=2), "at least parallel.pp=4 micro-batches"),
    (ModelConfig(layers=8), dict(pp=2, vpp=2, schedule="interleaved", micro_batches=3), "multiple of parallel.pp=2"),
    (ModelConfig(layers=8), dict(pp=2, schedule="interleaved"), "needs parallel.vpp >= 2"),
    (ModelConfig(layers=8), dict(pp=2, vpp=3, schedule="zbv"), "set parallel.vpp=2"),
    (ModelConfig(layers=8), dict(pp=2, vpp=2, schedule="zbv", compile=True), "set train.compile=false"),
])
def test_pipeline_layouts_are_refused_in_one_sentence(model, parallel, words):
    schedule = parallel.get("schedule", "1f1b")
    if schedule not in available_schedules() and schedule != "chimera":
        pytest.skip(f"this PyTorch has no {schedule} schedule")
    found = refusal(model, **parallel)
    assert any(words in reason for reason in found), found
    assert all(reason.count(". ") == 0 and "\n" not in reason for reason in found)


def test_valid_pipeline_layouts_pass():
    assert refusal(ModelConfig(layers=8), pp=4, schedule="gpipe", micro_batches=1) == []
    assert refusal(ModelConfig(layers=8), pp=2, vpp=2, schedule="interleaved", micro_batches=4) == []
    assert refusal(ModelConfig(layers=8, tie_embeddings=True), pp=2, micro_batches=2) == []
    assert refusal(ModelConfig(layers=3), pp=1, micro_batches=1) == []


def test_stage_placement():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_ranks(2, 2) == [0, 1, 0, 1]  # looped: rank r holds r, r + pp
    assert stage_ranks(2, 2, "v") == [0, 1, 1, 0]  # V: rank r holds r and 2pp - 1 - r


@pytest.mark.parametrize("tied", [True, False])
def test_stages_keep_parameter_names(tied):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, vocab_multiple=8, hidden=16, layers=4, heads=2, mlp_hidden=32,
                      max_seq_len=8, tie_embeddings=tied)
    model = Transformer(cfg)
    stages = split_model(model, [0, 1, 2, 3], 4)
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())
    assert "blocks.2.attn.q_proj.weight" in stages[2].state_dict()
    if tied:  # a tied head on another stage is a copy: same values, its own tensor
        assert torch.equal(stages[3].head.weight, model.embed.weight)
        assert stages[3].head.weight is not model.embed.weight
    else:
        assert stages[3].head.weight is model.head.weight


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pipeline_training_equals_one_device(tmp_path):
    """One launch of 4 ranks: pp2 with every schedule (both objectives, tied and untied),
    then pp2 x dp2 with FSDP2-sharded stages."""
    assert {"gpipe", "1f1b", "interleaved"} <= set(available_schedules())
    mp.spawn(pipeline_worker.main, args=(4, _free_port(), str(tmp_path)), nprocs=4, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    errors = [f"rank {rank}: {e}" for rank, result in enumerate(results) for e in result["errors"]]
    assert errors == [], "\n".join(errors)
    expected = len(pipeline_worker.cases()) + len(pipeline_worker.DP_CASES)
    assert len(pipeline_worker.cases()) >= 12
    for result in results:
        assert len(result["done"]) == expected


def test_pipeline_stages_run_under_the_trainers_autocast(tmp_path):
    """pp2 in real processes: with bf16 autocast every Linear of every stage computes in
    bf16 (the precision of the other engines), parameters and gradients stay fp32 and the
    loss stays near fp32's; without it, fp32 throughout."""
    mp.spawn(pipeline_worker.precision_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    errors = [f"rank {rank}: {e}" for rank, result in enumerate(results) for e in result["errors"]]
    assert errors == [], "\n".join(errors)
    assert all(result["done"] == ["torch.bfloat16", "None"] for result in results)
