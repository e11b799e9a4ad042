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
from ember.plan.predict import predict
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
    the embedding), even where a later stage's is five times as large."""
    # ZeRO-3 (no once-a-step gather beside the reduction), and a light first stage.
    lo = dataclasses.replace(_layout(3, pp=4), stage_layers=(2, 10, 10, 10))
    cluster = make_cluster("H100", 64, stack=stack("ember"))
    exposed = predict(LLAMA, cluster, SHAPE, lo).detail["dp_exposed_s"]
    groups = comm.groups(lo.tp, lo.dp_shard, lo.dp_replicate, lo.pp, 8, lo.cp)
    units = [lo.rank_layers(LLAMA)[i] + 1 for i in range(4)]  # the blocks, and the embedding or output layer
    first = overlap.sharded_s(stage_params(LLAMA, lo, 0) * 2, units[0], groups["dp_shard"], cluster.links)
    assert first * 0.99 < exposed < first * 1.01


def test_zero3_gathers_every_micro_batch_unless_the_stack_keeps_the_weights():
    """ember reshards ZeRO-3's weights after every forward and gathers them again for each
    pass; torchtitan keeps them gathered under a pipeline (reshard_after_forward off), so
    its ZeRO-3 costs what its ZeRO-1 does."""
    ember_z1, ember_z3 = _predict("ember", _layout(1)), _predict("ember", _layout(3))
    assert ember_z3.step_time_s > ember_z1.step_time_s
    titan_z1, titan_z3 = _predict("fsdp", _layout(1)), _predict("fsdp", _layout(3))
    assert titan_z3.step_time_s == pytest.approx(titan_z1.step_time_s, rel=1e-9)
    regathers = _predict("fsdp", _layout(3), pp_keeps_gathered=False)
    assert regathers.step_time_s > titan_z3.step_time_s
