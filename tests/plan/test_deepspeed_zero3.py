"""DeepSpeed's ZeRO-3 as Narayanan et al. (2021) ran it against 3D parallelism: every
sub-module gathered on its own, again for the forward that full recomputation reruns, and
into a list of per-rank tensors, one copy per rank after each gather."""

import dataclasses

import pytest

from ember.layout import Layout
from ember.plan import comm, overlap
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.memory import stage_params
from ember.plan.models import PRESETS
from ember.plan.predict import _edge_units, predict
from ember.plan.stacks import GATHER_COPY_S, stack

GPT = PRESETS["gpt3-175b"]
SHAPE = TrainShape(2048, 768)
LAYOUT = Layout(dp_shard=384, zero=3, micro_batch=1, recompute="full")  # two micro-batches a step


def _step(layout: Layout = LAYOUT, **changes) -> float:
    return predict(GPT, make_cluster("A100-80GB", 384, stack=stack("deepspeed", **changes)), SHAPE, layout).step_time_s


def _gather_units() -> int:
    return GPT.layers * stack("deepspeed").zero3_collectives_per_layer + _edge_units(GPT, LAYOUT, 0)


def test_the_recomputed_forward_gathers_the_weights_again():
    links = make_cluster("A100-80GB", 384).links
    shard = comm.groups(1, 384, 1, 1, 8)["dp_shard"]
    one_pass = overlap.sharded_s(stage_params(GPT, LAYOUT, 0) * 2, _gather_units(), shard, links)
    extra = _step(gather_s_per_rank=0.0) - _step(gather_s_per_rank=0.0, zero3_regathers_for_recompute=False)
    assert extra == pytest.approx(2 * one_pass, rel=1e-6)  # once per micro-batch, nothing hides it
    # Without full recomputation there is no rerun to gather for.
    kept = dataclasses.replace(LAYOUT, recompute="selective")
    assert _step(kept) == pytest.approx(_step(kept, zero3_regathers_for_recompute=False), rel=1e-12)


def test_a_list_all_gather_pays_a_copy_per_rank():
    # Three gathers a micro-batch (forward, rerun, backward), each copying out 384 chunks.
    extra = _step() - _step(gather_s_per_rank=0.0)
    assert extra == pytest.approx(2 * 3 * _gather_units() * 384 * GATHER_COPY_S, rel=1e-6)
    # The cost grows with the ranks of the gather, which is how ZeRO-3 stopped scaling.
    assert stack("fsdp").gather_s_per_rank == 0.0 and not stack("fsdp").zero3_regathers_for_recompute
