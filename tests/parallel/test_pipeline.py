"""Pipeline parallelism: layout validation, stage cutting, and pp2 training equal to one
device (every schedule the installed PyTorch has, both objectives, tied and untied
embeddings) in real processes over gloo, one launch for all cases."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from ember.config import ConfigError, ModelConfig
from ember.model import Transformer
from ember.parallel.pipeline import available_schedules, check_pipeline
from ember.parallel.stages import split_model, stage_layers, stage_ranks

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_worker  # noqa: E402


def layout(pp=2, vpp=1, schedule="1f1b"):
    return SimpleNamespace(pp=pp, vpp=vpp, schedule=schedule)


@pytest.mark.parametrize("model, parallel, micro_batches, words", [
    (ModelConfig(layers=6), layout(pp=4), None, "divisible by parallel.pp x parallel.vpp"),
    (ModelConfig(layers=8), layout(pp=2, vpp=2, schedule="1f1b"), None, "needs parallel.schedule='interleaved'"),
    (ModelConfig(layers=8), layout(pp=2, vpp=2, schedule="gpipe"), None, "set vpp=1"),
    (ModelConfig(layers=8), layout(pp=1, vpp=2), None, "set parallel.pp > 1"),
    (ModelConfig(layers=8), layout(schedule="chimera"), None, "is not one of"),
    (ModelConfig(layers=8), layout(pp=1, schedule="chimera"), None, "is not one of"),
    (ModelConfig(layers=8), layout(pp=4, schedule="1f1b"), 2, "at least parallel.pp=4 micro-batches"),
    (ModelConfig(layers=8), layout(pp=2, vpp=2, schedule="interleaved"), 3, "multiple of parallel.pp=2"),
    (ModelConfig(layers=8), layout(pp=0), None, "must be at least 1"),
    (ModelConfig(layers=8), layout(pp=2, vpp=3, schedule="zbv"), None, "set parallel.vpp=2"),
    (ModelConfig(layers=8), layout(pp=2, vpp=2, schedule="zbv"), "compile", "set train.compile=false"),
])
def test_check_pipeline_refuses_in_one_sentence(model, parallel, micro_batches, words):
    if parallel.schedule not in available_schedules() and parallel.schedule != "chimera":
        pytest.skip(f"this PyTorch has no {parallel.schedule} schedule")
    compile = micro_batches == "compile"
    with pytest.raises(ConfigError) as info:
        check_pipeline(model, parallel, micro_batches=None if compile else micro_batches, compile=compile)
    message = str(info.value)
    assert words in message and message.count(". ") == 0 and "\n" not in message


def test_check_pipeline_accepts_valid_layouts():
    check_pipeline(ModelConfig(layers=8), layout(pp=4, schedule="gpipe"), micro_batches=1)
    check_pipeline(ModelConfig(layers=8), layout(pp=2, vpp=2, schedule="interleaved"), micro_batches=4)
    check_pipeline(ModelConfig(layers=8, tie_embeddings=True), layout(pp=2), micro_batches=2)
    check_pipeline(ModelConfig(layers=3), layout(pp=1), micro_batches=1)


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
