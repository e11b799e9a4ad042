"""Reading --layout, and the divisibility rules every layout must obey."""

import re

import pytest

from ember.config import ConfigError
from ember.layout import Layout, problems
from ember.plan.layout import TrainShape, candidates, parse_layout
from ember.plan.models import PRESETS

LLAMA = PRESETS["llama3-8b"]  # 32 heads, 8 key/value heads, 32 layers
SHAPE = TrainShape(4096, 64)


def test_parse_full_form():
    lo = parse_layout("tp=8,pp=12,dp=4,zero=1,mbs=1,recompute=full", 384)
    assert lo == Layout(tp=8, pp=12, dp_shard=4, dp_replicate=1, zero=1, micro_batch=1, recompute="full")
    lo = parse_layout("tp=2, sp=1, pp=4, vpp=2, dp=8, zero=3, dp_shard=4", 64)
    assert (lo.sp, lo.schedule, lo.dp_shard, lo.dp_replicate) == (True, "interleaved", 4, 2)
    assert parse_layout("tp=1,sp=1", 8).sp is True  # kept, so the layout rules refuse it (it needs tp > 1)
    assert parse_layout("tp=2", 16).dp == 8  # dp defaults to what is left
    assert parse_layout("dp=8", 8).dp_replicate == 8  # zero 0 replicates
    assert (parse_layout("pp=2,schedule=zbv", 8).vpp, parse_layout("pp=2,vpp=3,schedule=zero_bubble", 8).vpp) == (2, 3)


@pytest.mark.parametrize("text,words", [
    ("tp8", "not key=value"), ("tq=8", "not key=value"), ("tp=two", "positive whole number"),
    ("tp=0", "positive whole number"), ("recompute=some", "recompute must be one of"),
    ("schedule=zigzag", "schedule must be one of"), ("zero=4", "zero must be 0, 1, 2 or 3"),
    ("dp=8,dp_shard=3", "dp (8) must equal"), ("dp=8,dp_shard=4", "needs zero"), ("sp=maybe", "sp must be 0 or 1"),
    ("recompute_every=2", "give it with recompute=full or selective"), ("tp=3", "= 3 does not divide the 8 GPUs"),
    ("", "--layout is empty"), ("  ", "--layout is empty"), ("tp=2,,dp=4", "empty item"),
    ("tp=2,dp=4,tp=4", "gives tp twice"),
])
def test_parse_rejects_malformed(text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_layout(text, 8)


@pytest.mark.parametrize("layout,words", [
    (Layout(tp=3, dp_replicate=2), "must equal the world size 8"),  # 6 GPUs, not 8
    (Layout(tp=16, dp_replicate=1), "must equal the world size 8"),
    (Layout(tp=8, pp=2), "must equal the world size 8"),
    (Layout(tp=8), None),
    (Layout(pp=3, dp_replicate=1, tp=1), "must equal the world size 8"),
])
def test_world_size(layout, words):
    found = problems(layout, LLAMA, SHAPE.global_batch, 8, ember=False)
    assert (found == []) if words is None else any(words in reason for reason in found)


@pytest.mark.parametrize("layout,gpus,words", [
    (Layout(tp=16), 16, "model.kv_heads (8) must be divisible by parallel.tp (16)"),
    (Layout(pp=8, vpp=5, schedule="interleaved"), 8, "model.layers (32) must be at least parallel.pp x parallel.vpp"),
    (Layout(pp=4, stage_layers=(8, 8, 8, 9)), 4, "32 (model.layers) in all"),
    (Layout(dp_replicate=8, micro_batch=16), 8, "must be a multiple of data-parallel ranks x train.micro_batch"),
    (Layout(pp=2, vpp=2), 2, "needs parallel.schedule=interleaved"),
    (Layout(pp=2, schedule="interleaved"), 2, "needs parallel.vpp >= 2"),
    (Layout(pp=4, vpp=2, schedule="interleaved", dp_replicate=2, micro_batch=16), 8,
     "needs at least parallel.pp=4 micro-batches"),
])
def test_divisibility_rejections(layout, gpus, words):
    assert any(words in reason for reason in problems(layout, LLAMA, SHAPE.global_batch, gpus, ember=False))


def test_uneven_pipeline_stages_are_layouts_too():
    """32 layers on 3 stages and on 4 x 3 virtual stages: the layers need not divide."""
    assert problems(Layout(pp=3, dp_replicate=2), LLAMA, SHAPE.global_batch, 6, ember=False) == []
    assert problems(Layout(pp=4, vpp=3, schedule="interleaved"), LLAMA, SHAPE.global_batch, 4, ember=False) == []
    assert Layout(pp=3).split(LLAMA) in ((11, 11, 10), (11, 10, 11), (10, 11, 11))
    lo = parse_layout("pp=4,stage_layers=7/9/9/7", 4)
    assert lo.stage_layers == (7, 9, 9, 7) and lo.rank_layers(LLAMA) == (7, 9, 9, 7)
    with pytest.raises(ConfigError):
        parse_layout("pp=2,stage_layers=16-16", 2)


def test_search_space_is_legal_and_keeps_tp_in_a_node():
    layouts = candidates(LLAMA, 32, 8, TrainShape(8192, 128))
    assert layouts and all(problems(lo, LLAMA, 128, 32) == [] for lo in layouts)
    assert max(lo.tp for lo in layouts) == 8
    assert {lo.zero for lo in layouts} == {0, 1, 2, 3}
    assert {lo.recompute for lo in layouts} == {"none", "selective", "full"}
    assert any(lo.schedule == "interleaved" for lo in layouts)
    assert any(lo.dp_replicate > 1 and lo.zero for lo in layouts)  # hybrid: shard in a node, replicate across
    assert len(set(layouts)) == len(layouts)


def test_the_search_offers_only_layouts_embers_trainer_runs():
    everything = candidates(LLAMA, 32, 8, TrainShape(8192, 128), ember_only=False)
    runnable = candidates(LLAMA, 32, 8, TrainShape(8192, 128))
    refused = [lo for lo in everything if problems(lo, LLAMA, 128, 32)]
    # Refused by ember alone: plain DDP beside tp/pp, and 1F1B with fewer micro-batches than stages.
    assert refused and all((lo.zero == 0 and lo.dp > 1 and (lo.tp > 1 or lo.pp > 1))
                           or lo.micro_batches(128) < lo.pp for lo in refused)
    assert any(lo.zero == 0 and lo.dp > 1 and lo.tp > 1 for lo in refused)
    zero_bubble = {lo for lo in runnable if lo.schedule in ("zero_bubble", "zbv")}  # ember's own (PyTorch's)
    assert zero_bubble and not any(problems(lo, LLAMA, 128, 32) for lo in zero_bubble)
    assert set(runnable) - zero_bubble == set(everything) - set(refused)
    assert any(lo.zero == 0 and lo.tp == lo.pp == 1 for lo in runnable)  # plain DDP alone stays


def test_recompute_every_is_read_written_and_handed_to_the_trainer():
    lo = parse_layout("tp=2,dp=4,zero=1,recompute=selective,recompute_every=3", 8)
    assert lo.recompute_every == 3 and lo.recomputed_fraction(32) == 11 / 32  # layers 0, 3, ..., 30
    assert lo.text().endswith("recompute=selective,recompute_every=3")
    assert parse_layout(lo.text(), 8) == lo
    assert lo.settings(SHAPE.global_batch)["parallel.recompute_every"] == 3
    assert parse_layout("recompute=none", 8).recomputed_fraction(32) == 0.0
    with pytest.raises(ConfigError, match="recompute_every must be a positive whole number"):
        parse_layout("recompute=full,recompute_every=0", 8)
