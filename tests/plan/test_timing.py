"""Time predictions: matmul efficiency by shape, pipeline bubbles, and the directions a
planner must get right (slower links, recomputation)."""

import pytest

from ember.plan.cluster import make_cluster
from ember.hardware import gpu_by_name
from ember.layout import Layout
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS
from ember.plan.predict import pipeline_s, predict
from ember.plan.timing import K_OVERHEAD, k_overhead, matmul_efficiency, matmul_s

A100 = gpu_by_name("A100-80GB")


def test_small_matmuls_run_far_below_peak_and_efficiency_is_smooth():
    big = matmul_efficiency(8192, 8192, 8192, A100)
    assert 0.8 < big <= A100.matmul_eff
    assert matmul_efficiency(256, 256, 64, A100) < 0.1 * big
    sizes = [64 * 1.1**i for i in range(60)]
    for dim in range(3):
        effs = [matmul_efficiency(*(s if d == dim else 4096 for d in range(3)), A100) for s in sizes]
        assert all(b > a for a, b in zip(effs, effs[1:]))  # grows with every dimension...
        assert max(b / a for a, b in zip(effs, effs[1:])) < 1.1  # ...without jumps (no lookup table)
    # Splitting a layer 8 ways costs efficiency: 8 small matmuls take longer than 1/8 of the big one.
    assert 8 * matmul_s(4096, 4096 / 8, 4096, A100) > 1.03 * matmul_s(4096, 4096, 4096, A100)
    # A skinny matmul is bound by memory: at one row it costs about its bytes at HBM speed.
    weights = 2 * 8192 * 8192 / (A100.hbm_gbps * 1e9 * A100.hbm_eff)
    assert weights < matmul_s(1, 8192, 8192, A100) < 1.15 * weights


def test_a_tiles_fixed_cost_in_k_steps_grows_with_flops_per_byte():
    """The prologue and epilogue wait on memory while a K step is tensor-core work: an H100
    (989 TFLOP/s on 3.35 TB/s) pays 1.93x an A100's 64 steps, FP8 twice that again, and a
    device below an A100's balance keeps 64. So a thin-K matmul loses more on an H100."""
    h100, v100 = gpu_by_name("H100"), gpu_by_name("V100")
    assert k_overhead(A100) == K_OVERHEAD and k_overhead(v100) == K_OVERHEAD
    assert k_overhead(h100) == pytest.approx(K_OVERHEAD * (989 / 3350) / (312 / 2039), rel=1e-3)
    assert k_overhead(h100, fp8=True) == pytest.approx(2 * k_overhead(h100))

    def loss(gpu, k):  # the share of the best rate a k-deep matmul gives up to the fixed cost
        return 1 - matmul_efficiency(8192, 8192, k, gpu) / matmul_efficiency(8192, 8192, 1e9, gpu)

    assert loss(h100, 1024) == pytest.approx(k_overhead(h100) / (1024 + k_overhead(h100)), rel=1e-3)
    assert loss(h100, 1024) > 1.8 * loss(A100, 1024)


@pytest.mark.parametrize("p,m,v", [(4, 16, 1), (8, 32, 1), (4, 16, 2), (8, 64, 4)])
def test_bubble_fractions(p, m, v):
    t = 0.25
    total, bubble = pipeline_s([t] * p, m, v)
    assert bubble / (m * t) == pytest.approx((p - 1) / (v * m))  # (p-1)/m, interleaved (p-1)/(v·m)
    assert total == pytest.approx(m * t + bubble)
    # An unequal stage paces the steady state.
    assert pipeline_s([t] * (p - 1) + [2 * t], m, v)[0] > m * 2 * t


def _predict(layout, gpus=8, per_node=8, model="llama2-13b", **shape):
    cluster = make_cluster("A100-80GB", gpus, per_node)
    return predict(PRESETS[model], cluster, TrainShape(**{"seq_len": 4096, "global_batch": 64, **shape}), layout)


def test_tensor_parallelism_over_the_network_is_slower():
    inside = _predict(Layout(tp=8, sp=True), per_node=8)
    across = _predict(Layout(tp=8, sp=True), per_node=4)
    assert across.step_time_s > 1.2 * inside.step_time_s
    tp_seconds = [p.shares["tp_comm"] * p.step_time_s for p in (inside, across)]
    assert tp_seconds[1] > 2 * tp_seconds[0]  # 4 NICs x 25 GB/s against 300 GB/s NVLink
    # On nodes of 4, keeping tp inside the node and pipelining across is the better plan.
    assert _predict(Layout(tp=4, sp=True, pp=2), per_node=4).step_time_s < across.step_time_s


def test_full_recompute_lowers_memory_and_raises_time():
    base = Layout(tp=2, sp=True, dp_shard=4, zero=1, micro_batch=2)
    none, full = _predict(base), _predict(Layout(**{**base.__dict__, "recompute": "full"}))
    assert full.memory.total < none.memory.total
    assert full.step_time_s > 1.2 * none.step_time_s
    assert full.hw_tflops_per_gpu > full.tflops_per_gpu  # recomputed FLOPs count as hardware FLOPs only
    assert none.hw_tflops_per_gpu == pytest.approx(none.tflops_per_gpu)


def test_step_figures_agree_with_each_other():
    p = _predict(Layout(tp=2, sp=True, pp=2, dp_shard=2, zero=1, micro_batch=1))
    tokens = 4096 * 64
    assert p.tokens_per_s_per_gpu == pytest.approx(tokens / p.step_time_s / 8)
    assert p.mfu == pytest.approx(p.tflops_per_gpu * 1e12 / A100.peak_bf16_flops)
    assert sum(p.shares.values()) == pytest.approx(1.0, abs=0.02)
    assert 0.2 < p.mfu < A100.matmul_eff


def test_recomputing_every_kth_layer_lies_between_none_and_all():
    base = Layout(tp=2, sp=True, dp_shard=4, zero=1, micro_batch=2)  # llama2-13b: 40 layers
    none = _predict(base)
    full = _predict(Layout(**{**base.__dict__, "recompute": "full"}))
    assert _predict(Layout(**{**base.__dict__, "recompute": "full", "recompute_every": 1})) == full
    every = {k: _predict(Layout(**{**base.__dict__, "recompute": "full", "recompute_every": k})) for k in (2, 4)}
    # Layers 0, 2, ... (20 of 40) and 0, 4, ... (10 of 40) rerun their forward and free their activations.
    assert every[2].layout.recomputed_fraction(40) == 0.5 and every[4].layout.recomputed_fraction(40) == 0.25
    assert full.memory.activations < every[2].memory.activations < every[4].memory.activations < none.memory.activations
    assert every[2].memory.activations == pytest.approx((full.memory.activations + none.memory.activations) / 2)
    assert none.step_time_s < every[4].step_time_s < every[2].step_time_s < full.step_time_s
    assert every[2].detail["recompute_s"] == pytest.approx(full.detail["recompute_s"] / 2)
    assert every[2].hw_tflops_per_gpu < full.hw_tflops_per_gpu
