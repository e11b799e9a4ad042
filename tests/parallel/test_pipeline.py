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
from ember.cost import block_forward_flops_per_token, output_forward_flops_per_token
from ember.model import Transformer
from ember.layout import Layout, available_schedules, problems
from ember.parallel.stages import split_model

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_worker  # noqa: E402


def refusal(model: ModelConfig, pp=2, vpp=1, schedule="1f1b", micro_batches=None, compile=False,
            stage_layers=()) -> list[str]:
    """ember.layout's problems of a pipeline layout with `micro_batches` per step (one rank
    of micro-batch 1: the global batch is the micro-batch count)."""
    global_batch = micro_batches or pp * vpp * 4
    return problems(Layout(pp=pp, vpp=vpp, schedule=schedule, stage_layers=stage_layers), model, global_batch,
                    compile=compile)


@pytest.mark.parametrize("model, parallel, words", [
    (ModelConfig(layers=3), dict(pp=4), "must be at least parallel.pp x parallel.vpp"),
    (ModelConfig(layers=6), dict(pp=2, vpp=2, schedule="interleaved"), None),
    (ModelConfig(layers=6), dict(pp=2, stage_layers=(3, 2)), "6 (model.layers) in all"),
    (ModelConfig(layers=6), dict(pp=2, stage_layers=(3, 3, 0)), "6 (model.layers) in all"),
    (ModelConfig(layers=6), dict(pp=2, stage_layers=(6, 0)), "at least one layer"),
    (ModelConfig(layers=6), dict(pp=1, stage_layers=(6,)), "needs parallel.pp > 1"),
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
    if words is None:  # uneven stages are a layout like any other
        assert found == []
        return
    assert any(words in reason for reason in found), found
    assert all(reason.count(". ") == 0 and "\n" not in reason for reason in found)


def test_valid_pipeline_layouts_pass():
    assert refusal(ModelConfig(layers=8), pp=4, schedule="gpipe", micro_batches=1) == []
    assert refusal(ModelConfig(layers=8), pp=2, vpp=2, schedule="interleaved", micro_batches=4) == []
    assert refusal(ModelConfig(layers=8, tie_embeddings=True), pp=2, micro_batches=2) == []
    assert refusal(ModelConfig(layers=3), pp=1, micro_batches=1) == []


def test_stage_placement():
    model = ModelConfig(layers=8)
    assert Layout(pp=4).split(model) == (2, 2, 2, 2)
    assert Layout(pp=2, vpp=2, schedule="interleaved").stage_owner() == (0, 1, 0, 1)  # rank r holds r, r + pp
    assert Layout(pp=2, vpp=2, schedule="zbv").stage_owner() == (0, 1, 1, 0)  # V: r and 2pp - 1 - r
    assert Layout(pp=2, vpp=2, schedule="zbv", stage_layers=(1, 2, 3, 2)).rank_layers(model) == (3, 5)
    assert Layout(pp=3, stage_layers=(2, 4, 2)).split(model) == (2, 4, 2)


def _compositions(layers: int, stages: int):
    if stages == 1:
        yield (layers,)
        return
    for first in range(1, layers - stages + 2):
        for rest in _compositions(layers - first, stages - 1):
            yield (first,) + rest


@pytest.mark.parametrize("layers, stages, vocab", [(5, 2, 32000), (5, 4, 32000), (7, 3, 1000), (9, 4, 200000),
                                                   (9, 9, 32000), (12, 5, 50000)])
def test_uneven_stages_minimise_the_slowest_stage(layers, stages, vocab):
    """Against every way of cutting the layers: no split has a cheaper slowest stage, where a
    block costs its forward FLOPs per token and the last stage adds the output layer's."""
    model = ModelConfig(layers=layers, vocab_size=vocab, hidden=256, heads=4, mlp_hidden=1024, max_seq_len=128)
    # Block and output-layer costs from the cost model, the one the split must balance.
    block = block_forward_flops_per_token(model, model.max_seq_len)
    head = output_forward_flops_per_token(model)

    def slowest(split):
        return max(n * block + (head if i == len(split) - 1 else 0) for i, n in enumerate(split))

    split = Layout(pp=stages).split(model)
    assert sum(split) == layers and min(split) >= 1 and len(split) == stages
    if layers % stages:
        assert slowest(split) == min(slowest(c) for c in _compositions(layers, stages))
    else:
        assert split == (layers // stages,) * stages  # divisible: equal, as every framework does


def test_a_heavier_output_layer_takes_more_layers_off_the_last_stage():
    light = ModelConfig(layers=22, vocab_size=1000, hidden=256, heads=4, mlp_hidden=1024, max_seq_len=128)
    heavy = ModelConfig(layers=22, vocab_size=600000, hidden=256, heads=4, mlp_hidden=1024, max_seq_len=128)
    assert Layout(pp=4).split(light) == (6, 6, 5, 5)
    heavy_split = Layout(pp=4).split(heavy)
    assert heavy_split[-1] < 5 and sum(heavy_split) == 22


@pytest.mark.parametrize("tied", [True, False])
def test_stages_keep_parameter_names(tied):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, vocab_multiple=8, hidden=16, layers=4, heads=2, mlp_hidden=32,
                      max_seq_len=8, tie_embeddings=tied)
    model = Transformer(cfg)
    stages = split_model(model, [0, 1, 2, 3], (1, 1, 1, 1))
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
    assert len(pipeline_worker.cases()) >= 12
    # Ranks 0 and 1 hold the first stages of the two pipelines (mesh (pp, dp)): together they ran
    # every case once.
    pp_done = sorted(d.rsplit(" ", 1)[0] for r in (0, 1) for d in results[r]["done"] if d.startswith("run_case"))
    assert pp_done == sorted(f"run_case {case}" for case in pipeline_worker.cases())
    for result in results:
        assert sum(d.startswith("run_dp_case") for d in result["done"]) == len(pipeline_worker.DP_CASES)


def test_pipeline_stages_run_under_the_trainers_autocast(tmp_path):
    """pp2 in real processes: with bf16 autocast every Linear of every stage computes in
    bf16 (the precision of the other engines), parameters and gradients stay fp32 and the
    loss stays near fp32's; without it, fp32 throughout."""
    mp.spawn(pipeline_worker.precision_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    errors = [f"rank {rank}: {e}" for rank, result in enumerate(results) for e in result["errors"]]
    assert errors == [], "\n".join(errors)
    assert all(result["done"] == ["torch.bfloat16", "None"] for result in results)
