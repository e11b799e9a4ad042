"""The intervals: which kind of published error bounds a prediction, and how wide it is."""

import pytest

from ember.layout import Layout
from ember.plan import uncertainty
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import ModelSpec
from ember.plan.predict import HOST_OVERLAP_POWER, _as_run, predict
from ember.plan.stacks import stack
from ember.plan.timing import Work

# A vTrain-sized GPT (h 2048, 12 layers) on one node of A100s under Megatron-DeepSpeed.
GPT = ModelSpec("GPT h2048 L12", 12, 2048, 16, 8192, 50257, bias=True, dropout=True, max_seq_len=1024)
SHAPE = TrainShape(1024, 8)


def test_host_and_gpu_time_level_is_the_crossover():
    """Where the host's calls take as long as the GPU's work the pass is 2^(1/p) times
    either and the interval is the crossover's, whatever the split; far from it the
    layout's own kind. FP8 keeps its own."""
    eager = stack("deepspeed", kernel_eff=1.0)
    host = 100 * eager.host_s_per_kernel
    _, level = _as_run(Work(matmul=host), 100, eager)
    assert level == pytest.approx(2 ** (1 / HOST_OVERLAP_POWER))
    _, far = _as_run(Work(matmul=10 * host), 100, eager)
    assert far < uncertainty.CROSSOVER < level
    lo = Layout(tp=2, dp_replicate=4)
    assert uncertainty.kind(lo, "bf16", level) == "crossover"
    assert uncertainty.kind(lo, "bf16", far) == "tensor"
    assert uncertainty.kind(lo, "fp8", level) == "fp8"


def test_the_crossover_interval_is_wider_on_both_sides():
    lo = Layout(tp=2, dp_replicate=4)
    wide = uncertainty.interval(lo, "A100", 1000.0, 0.3, "bf16", 1.2)["tokens_per_s_per_gpu"]
    narrow = uncertainty.interval(lo, "A100", 1000.0, 0.3, "bf16", 1.0)["tokens_per_s_per_gpu"]
    assert wide[0] < narrow[0] < 1000.0 < narrow[1] < wide[1]


def test_a_prediction_says_how_near_the_crossover_it_runs():
    """Micro-batch 1 at tp 4 is host-bound, 8 is GPU-bound; in between the two meet, and
    only there is the layout priced as the crossover's kind."""
    cluster = make_cluster("A100-80GB", 8, 8, stack=stack("deepspeed", pipeline_lockstep=False))
    kinds = {}
    for mbs in (1, 2, 4, 8):
        lo = Layout(tp=4, pp=2, micro_batch=mbs, recompute="full")
        p = predict(GPT, cluster, SHAPE, lo)
        assert p.detail["host_crossover"] >= 1.0
        kinds[mbs] = (p.interval["kind"], p.detail["host_crossover"])
    assert kinds[8][0] == "pipeline" and kinds[8][1] < uncertainty.CROSSOVER
    assert any(kind == "crossover" for kind, _ in kinds.values())
