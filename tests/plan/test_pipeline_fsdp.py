"""FSDP under a pipeline, priced as torch.distributed.pipelining runs it: every micro-batch's
backward runs without reducing, and the stage reduces once a step after its last backward,
where nothing but the stages below it can hide the reduction."""

import dataclasses

import pytest

from ember.layout import Layout
from ember.plan import comm, overlap
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.memory import defers_reduction, stage_params
from ember.plan.models import PRESETS
from ember.plan.predict import _stage_work, predict
from ember.plan.stacks import stack

LLAMA = PRESETS["llama3-8b"]
SHAPE = TrainShape(4096, 256, "bf16")


def _predict(name: str, layout: Layout, **changes):
    cluster = make_cluster("H100", 64, stack=stack(name, **changes))
    return predict(LLAMA, cluster, SHAPE, layout)


def _layout(zero: int, pp: int = 2) -> Layout:
    return Layout(tp=1, pp=pp, dp_shard=64 // pp, zero=zero, micro_batch=2)


def test_only_fsdp_stacks_under_a_pipeline_defer_the_reduction():
    assert defers_reduction(_layout(1), stack("ember"))
    assert defers_reduction(_layout(3), stack("fsdp"))
    assert not defers_reduction(_layout(1, pp=1), stack("ember"))
    assert not defers_reduction(_layout(0), stack("ember"))
    assert not defers_reduction(_layout(1), stack("megatron"))


def test_zero2_under_a_pipeline_costs_what_zero1_does():
    """With every backward unsynced, ZeRO-2 reduce-scatters no more often than ZeRO-1 and
    accumulates the same whole gradients: the same step, not one reduction per micro-batch."""
    z1, z2 = _predict("ember", _layout(1)), _predict("ember", _layout(2))
    assert z2.step_time_s == pytest.approx(z1.step_time_s, rel=1e-9)
    assert z2.shares["dp_comm"] == pytest.approx(z1.shares["dp_comm"], rel=1e-9)


def test_the_first_stage_finishes_last_so_only_its_reduction_is_exposed():
    """No compute runs beside a reduction issued after the last backward, and the last
    micro-batch's backward reaches the first stage last: every later stage has that long
    to finish its own reduction, so the step pays the first stage's whole (its blocks and
    the embedding), even where a later stage's is five times as large. The step's one
    gather (left unhidden here) comes before every stage's first forward: nothing hides it."""
    lo = dataclasses.replace(_layout(3, pp=4), stage_layers=(2, 10, 10, 10))
    cluster = make_cluster("H100", 64, stack=stack("ember", overlap_param_gather=False))
    exposed = predict(LLAMA, cluster, SHAPE, lo).detail["dp_exposed_s"]
    shard = comm.groups(lo.tp, lo.dp_shard, lo.dp_replicate, lo.pp, 8, lo.cp)["dp_shard"]
    # bf16 weights and gradients: a stage's gather and reduction move the same bytes in the
    # same collectives, one per block and per embedding or output layer.
    moved = [overlap.sharded_s(stage_params(LLAMA, lo, i) * 2, lo.rank_layers(LLAMA)[i] + (i in (0, 3)),
                               shard, cluster.links) for i in range(4)]
    assert moved[3] > 2 * moved[0]
    assert exposed == pytest.approx(max(2 * moved[0], *moved[1:]), rel=1e-6)


def test_zero3_under_a_pipeline_gathers_once_a_step():
    """The pipeline keeps a stage's weights gathered from its first backward on, so ZeRO-3
    keeps them from the first forward (ember and torchtitan) and costs what ZeRO-1 does,
    where outside a pipeline it gathers for every pass of every micro-batch."""
    for name in ("ember", "fsdp"):
        z1, z3 = _predict(name, _layout(1)), _predict(name, _layout(3))
        assert z3.step_time_s == pytest.approx(z1.step_time_s, rel=1e-9)
    flat = Layout(dp_shard=64, zero=3, micro_batch=2)
    zero1 = dataclasses.replace(flat, zero=1)
    assert _predict("ember", flat).shares["dp_comm"] > _predict("ember", zero1).shares["dp_comm"]


def test_interleaved_stages_hide_a_reduction_behind_one_chunk_of_the_ranks_below():
    """Interleaved, the last micro-batch's backward passes each rank below through one of
    its vpp chunks, not all of them: that is all the time a later rank's reduction has."""
    lo = Layout(tp=1, pp=2, dp_shard=32, zero=1, micro_batch=2, schedule="interleaved", vpp=2,
                stage_layers=(1, 15, 1, 15))  # rank 0: 2 layers and the embedding; rank 1: 30 and the output
    cluster = make_cluster("H100", 64, stack=stack("ember", overlap_param_gather=False))
    exposed = predict(LLAMA, cluster, SHAPE, lo).detail["dp_exposed_s"]
    shard = comm.groups(lo.tp, lo.dp_shard, lo.dp_replicate, lo.pp, 8, lo.cp)["dp_shard"]
    moved = [overlap.sharded_s(stage_params(LLAMA, lo, i) * 2, lo.rank_layers(LLAMA)[i] + 1, shard, cluster.links)
             for i in range(2)]
    below = _stage_work(LLAMA, cluster, SHAPE, lo, 0)[1].total
    assert moved[1] > below / 2 > 0
    assert exposed == pytest.approx(max(2 * moved[0], moved[1] - below / 2 + moved[1]), rel=1e-6)


def test_gradients_held_for_the_deferred_reduction_are_in_its_dtype():
    """FSDP2 upcasts an unsharded gradient it does not reduce yet to its reduce_dtype and
    accumulates there: with fp32 reduction a stage holds 4 bytes a weight until the step's
    reduction, with bf16 reduction 2."""
    lo = _layout(3)
    fp32, bf16 = _predict("fsdp", lo, grad_dtype="fp32"), _predict("fsdp", lo, grad_dtype="bf16")
    params = stage_params(LLAMA, lo, fp32.memory.stage)  # the stage whose memory is reported
    assert fp32.memory.grads == pytest.approx(4 * params, rel=1e-9)
    assert bf16.memory.grads == pytest.approx(2 * params, rel=1e-9)
