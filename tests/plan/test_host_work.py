"""Host work the calibration measures (tune/host_cost.py) lands where the trainer pays it:
eager tensor parallelism's dispatch on every tensor-parallel layer, FSDP2's hooks and
buffer copies on every sharded unit."""

import dataclasses

import pytest

from conftest import REPO
from ember.config import load_config
from ember.layout import Layout
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS
from ember.plan.predict import _stage_work, predict
from ember.plan.stacks import run_stack

TINY = PRESETS["gpt2-small"].with_shape(layers=2, hidden=256, heads=4, mlp_hidden=1024)


def _cpu_like(**figures):
    """A cluster whose host shares the cores with the compute (a calibrated CPU), so that
    host work adds outright, with the given measured figures on its stack."""
    base = make_cluster("A100-80GB", 2)
    return dataclasses.replace(base, stack=dataclasses.replace(base.stack, host_overlaps=False, **figures))


def _pass_s(cluster, shape, lo, stage=0):
    fwd, bwd, _ = _stage_work(TINY, cluster, shape, lo, stage)
    return fwd.total + bwd.total


def test_eager_tensor_parallelism_adds_its_measured_host_time():
    """A calibrated stack's tp_host_s_per_layer lands on every tensor-parallel layer's host
    time: added outright where host and compute share the cores (a CPU), through the soft
    maximum on a GPU; a compiled run (run_stack) has none."""
    tiny = TINY
    shape, lo = TrainShape(128, 8), Layout(tp=2, micro_batch=8)
    base = make_cluster("A100-80GB", 2)
    cpu_like = dataclasses.replace(base, stack=dataclasses.replace(base.stack, host_overlaps=False))
    measured = dataclasses.replace(cpu_like, stack=dataclasses.replace(cpu_like.stack, tp_host_s_per_layer=6e-3))
    without = _stage_work(tiny, cpu_like, shape, lo, 0)
    with_tp = _stage_work(tiny, measured, shape, lo, 0)
    # two layers, each paying 6 ms across its forward and backward
    assert (with_tp[0].total + with_tp[1].total) - (without[0].total + without[1].total) == pytest.approx(2 * 6e-3)
    assert _stage_work(tiny, measured, shape, Layout(micro_batch=8), 0)[0].total == pytest.approx(
        _stage_work(tiny, cpu_like, shape, Layout(micro_batch=8), 0)[0].total)  # no tensor parallelism, no cost
    compiled_run = load_config(REPO / "configs/tiny-gpt.toml", ["train.compile=true"])
    compiled = dataclasses.replace(measured, stack=run_stack(measured.stack, compiled_run, "cpu"))
    assert _stage_work(tiny, compiled, shape, lo, 0)[0].total == pytest.approx(without[0].total)
    eager_run = load_config(REPO / "configs/tiny-gpt.toml", ["train.compile=false"])
    eager = dataclasses.replace(measured, stack=run_stack(measured.stack, eager_run, "cpu"))
    assert _stage_work(tiny, eager, shape, lo, 0)[0].total == pytest.approx(with_tp[0].total)


def test_fsdp_host_work_lands_on_every_sharded_unit_as_often_as_it_runs():
    """ZeRO-3 pays the resharded figure on each unit (two blocks, and GPT-2's tied embedding
    and output layer as one) every micro-batch; ZeRO-2 the kept figure every micro-batch;
    ZeRO-1 and ZeRO under a pipeline gather and reduce once a step, so a micro-batch pays
    its share; DDP and a stack with nothing measured pay none."""
    shape = TrainShape(128, 16)  # 2 ranks: 8 sequences each, micro-batches of 4 -> 2 a step
    plain, measured = _cpu_like(), _cpu_like(shard_host_s_per_layer=2e-3, reshard_host_s_per_layer=5e-3)
    units = 2 + 1

    def added(lo, stage=0):
        return _pass_s(measured, shape, lo, stage) - _pass_s(plain, shape, lo, stage)

    assert added(Layout(dp_shard=2, zero=3, micro_batch=4)) == pytest.approx(units * 5e-3)
    assert added(Layout(dp_shard=2, zero=2, micro_batch=4)) == pytest.approx(units * 2e-3)
    assert added(Layout(dp_shard=2, zero=1, micro_batch=4)) == pytest.approx(units * 2e-3 / 2)
    assert added(Layout(dp_replicate=2, zero=0, micro_batch=4)) == 0
    # Under a pipeline (2 stages of one block; 16 sequences, micro-batches of 4 -> 4 a step)
    # ZeRO-3 keeps its weights over the step: each stage's block and its edge unit.
    piped = Layout(pp=2, dp_shard=1, zero=3, micro_batch=4)
    assert added(piped, 0) == pytest.approx(2 * 2e-3 / 4)
    # The step pays it: a sharded run is predicted slower by what its micro-batches add.
    lo = Layout(dp_shard=2, zero=3, micro_batch=4)
    step = predict(TINY, measured, shape, lo).step_time_s - predict(TINY, plain, shape, lo).step_time_s
    assert step == pytest.approx(2 * units * 5e-3, rel=1e-6)
