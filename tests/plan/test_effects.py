"""One test per physical effect of the step-time model that the first version lacked: each
fails if its effect is removed (see docs/planner.md, "The cost model")."""

import dataclasses

import pytest

from ember.hardware import gpu_by_name
from ember.layout import Layout
from ember.plan import comm
from ember.plan.cluster import make_cluster
from ember.plan.comm import Links
from ember.plan.layout import TrainShape
from ember.plan.memory import stage_params
from ember.plan.models import PRESETS
from ember.plan.search import search
from ember.plan.stacks import stack
from ember.plan.fsdp import fsdp_copy_bytes
from ember.plan.predict import (
    HOST_OVERLAP_POWER,
    DDP_BUCKET_BYTES,
    _as_run,
    _reduction_units,
    _stage_work,
    boundary_s,
    lockstep_s,
    pipeline_s,
    predict,
    tp_collectives,
)
from ember.plan.timing import (
    KERNEL_S,
    Work,
    embed_times,
    fused_softmax,
    head_times,
    layer_kernel_count,
    layer_times,
    matmul_efficiency,
    memory_s,
)

A100 = gpu_by_name("A100-80GB")
LINKS = Links(8, A100.intra_gbps, A100.inter_gbps)
LLAMA = PRESETS["llama3-8b"]


def test_wave_quantisation_counts_256x128_tiles():
    # M·N equal to one 256x128 tile per SM is exactly one wave: busy 1/(1 + 1/2) of the time.
    # With 128x128 tiles the same matmul would be two waves (2/2.5): 20% faster.
    m, n, k = 256, 128 * A100.sms, 8192
    expected = A100.matmul_eff * (1 / 1.5) * k / (k + 64)
    assert matmul_efficiency(m, n, k, A100) == pytest.approx(expected)
    # Twice the tiles, two waves: the tail matters less.
    assert matmul_efficiency(2 * m, n, k, A100) == pytest.approx(A100.matmul_eff * (2 / 2.5) * k / (k + 64))


def test_loss_streams_fp32_logits_several_times():
    """The vocabulary-parallel cross-entropy casts the logits to fp32 and makes five passes
    over them forward (38 bytes per logit) and two backward (14)."""
    seq, mbs = 8192, 1
    fwd, bwd = head_times(LLAMA, A100, LINKS, seq, mbs, 1, False)
    logits = seq * mbs * LLAMA.padded_vocab
    assert fwd.elementwise >= memory_s(38 * logits, A100)
    assert bwd.elementwise >= memory_s(14 * logits, A100)
    # ...and it is a real share of the last stage: more than 2% of an 8B model's 16 layers.
    layer = layer_times(LLAMA, A100, LINKS, seq, mbs, 1, False, "selective", "flash")
    stage = 16 * (layer.forward.total + layer.backward.total + layer.recompute.total)
    assert memory_s(52 * logits, A100) > 0.02 * stage


def test_llm_foundrys_fused_cross_entropy_moves_six_bytes_a_logit():
    """flash-attn's Triton cross-entropy (llm-foundry's default loss) reads the bf16 logits
    once and writes their gradient once: 2 + 4 bytes a logit against 38 + 14. For a small
    model with a large vocabulary that is a real part of the step."""
    mpt = dataclasses.replace(PRESETS["gpt2-small"], vocab_size=50368, max_seq_len=2048)
    seq, mbs = 2048, 8
    logits = seq * mbs * mpt.padded_vocab
    fsdp = head_times(mpt, A100, LINKS, seq, mbs, 1, False)
    foundry = head_times(mpt, A100, LINKS, seq, mbs, 1, False, loss_bytes=(2, 4))
    assert fsdp[0].elementwise - foundry[0].elementwise == pytest.approx(memory_s(36 * logits, A100), rel=0.01)
    assert fsdp[1].elementwise - foundry[1].elementwise == pytest.approx(memory_s(10 * logits, A100), rel=0.01)
    shape, lo = TrainShape(seq, 64, "bf16"), Layout(dp_shard=8, zero=3, micro_batch=mbs)
    slow, fast = (predict(mpt, make_cluster("A100-80GB", 8, stack=stack(name)), shape, lo).step_time_s
                  for name in ("fsdp", "llm-foundry"))
    assert 1.1 < slow / fast < 1.6


@pytest.mark.parametrize("sp", [False, True])
def test_output_layer_and_embedding_communicate_over_tensor_parallel_ranks(sp):
    seq, tp = 4096, 8
    group = comm.place(tp, 1, 8)
    activation = seq * LLAMA.hidden * 2
    head_fwd, head_bwd = head_times(LLAMA, A100, LINKS, seq, 1, tp, sp)
    embed_fwd, embed_bwd = embed_times(LLAMA, A100, LINKS, seq, 1, tp, sp)
    if sp:  # gather the final norm's output, scatter its gradient; the embedding the reverse
        assert head_fwd.tp_comm > comm.all_gather_s(activation, group, LINKS)
        assert head_bwd.tp_comm == pytest.approx(comm.reduce_scatter_s(activation, group, LINKS))
        assert embed_fwd.tp_comm == pytest.approx(comm.reduce_scatter_s(activation, group, LINKS))
        assert embed_bwd.tp_comm == pytest.approx(comm.all_gather_s(activation, group, LINKS))
    else:  # the output layer's input gradient and the embedding's output are all-reduced
        assert head_bwd.tp_comm == pytest.approx(comm.all_reduce_s(activation, group, LINKS))
        assert embed_fwd.tp_comm == pytest.approx(comm.all_reduce_s(activation, group, LINKS))
    one = head_times(LLAMA, A100, LINKS, seq, 1, 1, sp)
    assert one[0].tp_comm == one[1].tp_comm == 0.0


def test_embedding_gradient_is_a_dense_table_on_the_first_stage():
    seq = 2048
    fwd, bwd = embed_times(LLAMA, A100, LINKS, seq, 1, 1, False)
    assert bwd.elementwise >= memory_s(LLAMA.padded_vocab * LLAMA.hidden * 2, A100)
    # The first stage of a pipeline carries it: its work is its layers, the embedding, and
    # accumulating its weight gradients, nothing else.
    cluster = make_cluster("A100-80GB", 2)
    cluster = dataclasses.replace(cluster, stack=dataclasses.replace(cluster.stack, host_s_per_kernel=0.0))
    lo = Layout(pp=2, micro_batch=1, recompute="selective")
    stage_fwd, stage_bwd, _ = _stage_work(LLAMA, cluster, TrainShape(seq, 16), lo, 0)
    layer = layer_times(LLAMA, A100, cluster.links, seq, 1, 1, False, "selective", "flash")
    layers = 16 * (layer.forward.total + layer.backward.total + layer.recompute.total)
    accumulate = memory_s(stage_params(LLAMA, lo, 0) * 2 * cluster.stack.grad_bytes, A100)
    assert stage_fwd.total + stage_bwd.total == pytest.approx(layers + fwd.total + bwd.total + accumulate)


def test_kernel_launch_gaps_dominate_a_tiny_model():
    """Every kernel costs KERNEL_S even when its work is nothing: a 2-layer, 64-wide model
    on 32 tokens is all launch gaps."""
    tiny = PRESETS["gpt2-small"].with_shape(layers=2, hidden=64, heads=2, mlp_hidden=256, vocab_size=128)
    layer = layer_times(tiny, A100, LINKS, 32, 1, 1, False, "none", "flash")
    kernels = layer_kernel_count(tiny, "flash")
    assert kernels >= 10
    assert layer.forward.launch == pytest.approx(kernels * KERNEL_S)
    assert layer.backward.launch == pytest.approx(2 * kernels * KERNEL_S)
    assert layer.forward.launch > layer.forward.matmul + layer.forward.elementwise
    p = predict(tiny, make_cluster("A100-80GB", 1), TrainShape(32, 1), Layout())
    assert p.step_time_s > 2 * 3 * kernels * KERNEL_S
    assert p.detail["launch_s"] > 0.3 * p.step_time_s


def test_pipeline_boundary_regathers_scattered_activations_without_sp():
    cluster = make_cluster("A100-80GB", 64)
    shape = TrainShape(2048, 64)
    groups = comm.groups(8, 1, 1, 8, 8)
    plain = Layout(tp=8, pp=8, micro_batch=1)
    sp = Layout(tp=8, pp=8, micro_batch=1, sp=True)
    full = 2048 * LLAMA.hidden * 2
    send = comm.p2p_s(full / 8, groups["pp"], cluster.links)
    assert boundary_s(LLAMA, shape, sp, groups, cluster.links) == pytest.approx(send)
    gather = comm.all_gather_s(full, groups["tp"], cluster.links)
    assert gather > 0
    assert boundary_s(LLAMA, shape, plain, groups, cluster.links) == pytest.approx(send + gather)


def test_deepspeed_sends_whole_activations_across_pipeline_boundaries():
    # DeepSpeed's pipeline engine knows nothing of tensor parallelism: every rank sends the
    # full tensor over its own link, and the receivers need no gather.
    cluster = make_cluster("A100-80GB", 64)
    groups = comm.groups(8, 1, 1, 8, 8)
    full = 2048 * LLAMA.hidden * 2
    whole = boundary_s(LLAMA, TrainShape(2048, 64), Layout(tp=8, pp=8), groups, cluster.links, slices=False)
    assert whole == pytest.approx(comm.p2p_s(full, groups["pp"], cluster.links))
    assert whole > 4 * boundary_s(LLAMA, TrainShape(2048, 64), Layout(tp=8, pp=8, sp=True), groups, cluster.links)


def test_deepspeed_pipeline_runs_in_lockstep():
    # 2(m + p - 1) steps: p - 1 of forwards only, the rest as long as a backward.
    total, bubble = lockstep_s([1.0] * 4, [3.0] * 4, 16)
    assert total == pytest.approx(3 * 1.0 + (2 * 16 + 3) * 3.0)
    assert bubble == pytest.approx(total - 16 * 4.0)
    assert total / pipeline_s([4.0] * 4, 16)[0] == pytest.approx(108 / 76)
    # A forward slower than the backward paces the steps instead.
    assert lockstep_s([2.0, 1.0], [1.0, 1.0], 8)[0] == pytest.approx(1 * 2.0 + 17 * 2.0)
    # Priced as the stack says: with full recomputation (backward about 3x the forward) the
    # engine takes about 1.5x as long as 1F1B; without a pipeline nothing changes.
    gpt = PRESETS["gpt3-175b"]
    shape = TrainShape(2048, 512)
    engine = make_cluster("A100-80GB", 64, stack=stack("deepspeed"))
    one_f_one_b = make_cluster("A100-80GB", 64, stack=stack("deepspeed", pipeline_lockstep=False))
    piped = Layout(tp=8, pp=8, micro_batch=1, recompute="full")
    ratio = predict(gpt, engine, shape, piped).step_time_s / predict(gpt, one_f_one_b, shape, piped).step_time_s
    assert 1.3 < ratio < 1.6
    flat = Layout(tp=8, dp_replicate=8, micro_batch=1, recompute="full")
    assert predict(gpt, engine, shape, flat).step_time_s == predict(gpt, one_f_one_b, shape, flat).step_time_s
    # The engine has no other schedule, so the search offers none.
    found = search(gpt, engine, shape, fixed={"tp": 8, "pp": 8}, ember_only=False).ranked
    assert found and {p.layout.schedule for p in found} == {"1f1b"}
    assert "interleaved" in {p.layout.schedule for p in search(gpt, one_f_one_b, shape, fixed={"tp": 8, "pp": 8},
                                                                ember_only=False).ranked}


def test_an_fp32_run_moves_4_byte_elements():
    """Without autocast (a CPU run) every activation, gathered weight and reduced gradient is
    4 bytes: elementwise traffic and tensor-parallel, ZeRO and data-parallel messages double;
    the matmuls (priced at the measured rate of the run's dtype) do not change."""
    seq = 2048
    bf16 = layer_times(LLAMA, A100, LINKS, seq, 1, 2, True, "none", "flash")
    fp32 = layer_times(LLAMA, A100, LINKS, seq, 1, 2, True, "none", "flash", 2)
    assert fp32.forward.elementwise == pytest.approx(2 * bf16.forward.elementwise)
    assert fp32.forward.matmul == bf16.forward.matmul and fp32.forward.attention == bf16.forward.attention
    assert fp32.forward.tp_comm > 1.5 * bf16.forward.tp_comm
    assert embed_times(LLAMA, A100, LINKS, seq, 1, 1, False, 2)[0].elementwise == pytest.approx(
        2 * embed_times(LLAMA, A100, LINKS, seq, 1, 1, False)[0].elementwise)
    # the loss already works on fp32 logits: only the final norm's traffic doubles
    head = [head_times(LLAMA, A100, LINKS, seq, 1, 1, False, width)[0].elementwise for width in (1, 2)]
    assert head[0] < head[1] < 1.1 * head[0]
    cluster = make_cluster("A100-80GB", 16)
    for layout in (Layout(dp_replicate=16), Layout(dp_shard=16, zero=3), Layout(tp=2, dp_replicate=8)):
        half, full = (predict(LLAMA, cluster, TrainShape(seq, 64, precision), layout)
                      for precision in ("bf16", "fp32"))
        assert full.step_time_s > half.step_time_s
        assert 1.5 * half.detail["elementwise_s"] < full.detail["elementwise_s"] <= 2 * half.detail["elementwise_s"]
        assert full.shares["dp_comm"] * full.step_time_s > 1.5 * half.shares["dp_comm"] * half.step_time_s


def test_an_eager_host_bounds_a_pass_softly():
    """A pass takes the soft maximum of the host's time to issue its calls and the GPU's
    work: the larger far from the crossover, more than either near it."""
    eager = stack("deepspeed", kernel_eff=1.0)
    busy = Work(matmul=1e-3)
    host = 100 * eager.host_s_per_kernel
    both, crossover = _as_run(busy, 100, eager)
    p = HOST_OVERLAP_POWER
    assert both.total == pytest.approx((host**p + 1e-3**p) ** (1 / p))
    assert both.total > max(host, 1e-3) and crossover == pytest.approx(both.total / max(host, 1e-3))
    assert _as_run(busy, 1, eager)[0].total == pytest.approx(1e-3, rel=0.01)  # GPU-bound
    assert _as_run(Work(matmul=1e-6), 1000, eager)[0].total == pytest.approx(1000 * eager.host_s_per_kernel, rel=0.01)


def test_tensor_parallel_collectives_are_host_calls():
    """Each tensor-parallel collective is a torch.distributed call the host must issue: a
    host-bound stack's pass grows with them even where the GPU work would not."""
    eager = make_cluster("A100-80GB", 8, stack=stack("deepspeed", host_s_per_micro_batch=0.0))
    tiny = PRESETS["gpt2-small"].with_shape(layers=2, hidden=256, heads=4, mlp_hidden=1024)
    shape = TrainShape(128, 8)
    assert tp_collectives(Layout(tp=2)) == 2 and tp_collectives(Layout(tp=2, sp=True)) == 4
    assert tp_collectives(Layout()) == 0
    counted = _stage_work(tiny, eager, shape, Layout(tp=2, micro_batch=1, recompute="full"), 0)
    silent = stack("deepspeed", host_s_per_kernel=0.0, host_s_per_micro_batch=0.0)
    gpu_only = _stage_work(tiny, dataclasses.replace(eager, stack=silent), shape,
                           Layout(tp=2, micro_batch=1, recompute="full"), 0)
    kernels = layer_kernel_count(tiny, eager.stack.attention, fused_softmax(tiny, 1, 128, 2))
    # forward: each layer's kernels and two all-reduces; the host bounds this tiny pass
    host_fwd, p = 2 * (kernels + 2) * eager.stack.host_s_per_kernel, HOST_OVERLAP_POWER
    assert host_fwd > gpu_only[0].total
    assert counted[0].total == pytest.approx((host_fwd**p + gpu_only[0].total**p) ** (1 / p))


def test_each_stack_reruns_what_its_selective_recomputation_reruns():
    assert stack("ember").recompute_policy("selective") == "selective"
    assert stack("megatron").recompute_policy("selective") == "selective-attention"
    assert stack("fsdp").recompute_policy("selective") == "selective-half-matmul"  # torchtitan's op policy
    assert stack("fsdp").recompute_policy("full") == "full"
    rerun = {policy: layer_times(LLAMA, A100, LINKS, 4096, 1, 1, False, policy, "flash").recompute
             for policy in ("selective", "selective-half-matmul", "full")}
    assert rerun["selective"].matmul == 0 and rerun["selective"].attention == 0
    assert rerun["selective-half-matmul"].matmul == pytest.approx(rerun["full"].matmul / 2)
    assert rerun["selective-half-matmul"].attention == 0 < rerun["full"].attention


def test_megatron_softmax_falls_back_where_its_fused_kernel_does_not_exist():
    """Megatron-LM's fused causal softmax needs the micro-batch's score matrices per rank
    (batch x heads/tp) in multiples of 4: a 16-head model at tp=8 and micro-batch 1 (two
    matrices) runs PyTorch's five fp32 kernels instead, and pays for them in host calls and
    bytes. Measured (vTrain, Megatron-DeepSpeed): those runs alone were 36-50% slower than
    the fused-kernel pricing."""
    gpt = PRESETS["gpt2-small"].with_shape(layers=2, hidden=1024, heads=16, mlp_hidden=4096)
    assert fused_softmax(gpt, 1, 1024, 4) and fused_softmax(gpt, 2, 1024, 8)
    assert not fused_softmax(gpt, 1, 1024, 8)
    assert not fused_softmax(gpt, 4, 8192, 1)  # beyond the kernel's 4,096 keys
    assert not fused_softmax(gpt, 4, 1022, 1)  # keys not a multiple of 4
    # Short rows pack two per warp: 8 matrices per block at 64 keys, so 4 is not enough.
    assert not fused_softmax(gpt.with_shape(heads=4), 1, 64, 1) and fused_softmax(gpt, 1, 64, 2)
    assert layer_kernel_count(gpt, "unfused", False) == layer_kernel_count(gpt, "unfused", True) + 4
    assert layer_kernel_count(gpt, "flash", False) == layer_kernel_count(gpt, "flash", True)
    fused = layer_times(gpt, A100, LINKS, 1024, 2, 8, False, "none", "unfused")
    fallback = layer_times(gpt, A100, LINKS, 1024, 1, 8, False, "none", "unfused")
    # Half the tokens, yet more elementwise time: the fp32 fallback moves 9x the softmax bytes.
    assert fallback.forward.elementwise > fused.forward.elementwise
    assert fallback.forward.launch == fused.forward.launch + 4 * KERNEL_S
    deepspeed = make_cluster("A100-80GB", 8, stack=stack("deepspeed"))
    shape = TrainShape(1024, 8)
    one, two = (predict(gpt, deepspeed, shape, Layout(tp=8, micro_batch=b, recompute="full")) for b in (1, 2))
    # Host-bound, so twice the micro-batches take about twice as long (1.9x with the fused
    # kernel priced everywhere); the fallback's extra calls make each dearer still.
    assert one.step_time_s > 2.1 * two.step_time_s


@pytest.mark.parametrize("pp", [1, 2])
def test_host_work_per_micro_batch_is_paid_on_every_stage_and_not_hidden(pp):
    """A stack that syncs with the GPU once per micro-batch (Megatron-LM's get_batch) pays
    its per-micro-batch host work outright, on every stage: m times in a plain loop, and
    m + p - 1 times through a 1F1B pipeline's fill and drain."""
    gpt = PRESETS["gpt2-small"].with_shape(layers=4, hidden=1024, heads=16, mlp_hidden=4096)
    shape, lo = TrainShape(1024, 8), Layout(pp=pp, micro_batch=2, recompute="full")
    base = make_cluster("A100-80GB", pp, stack=stack("deepspeed", host_s_per_micro_batch=0.0,
                                                     pipeline_lockstep=False))
    paying = make_cluster("A100-80GB", pp, stack=stack("deepspeed", host_s_per_micro_batch=2e-3,
                                                       pipeline_lockstep=False))
    m = lo.micro_batches(shape.global_batch)
    extra = predict(gpt, paying, shape, lo).step_time_s - predict(gpt, base, shape, lo).step_time_s
    assert extra == pytest.approx((m + pp - 1) * 2e-3, rel=1e-6)
    assert stack("deepspeed").host_s_per_micro_batch > 0 and stack("ember").host_s_per_micro_batch == 0


def test_eager_composites_cost_llama_blocks_but_not_gpt_ones():
    """Without torch.compile (`--stack fsdp-eager`) RMSNorm, the rotary embedding and
    SwiGLU run as eager PyTorch's composites and move fp32 intermediates through memory:
    Llama 3 8B at 8k tokens on H100 was measured 16% slower without compile (torchtitan,
    bf16, FSDP on 8 and 128 GPUs). A GPT block (LayerNorm, GELU, learned positions) is the
    same kernels either way."""
    h100 = make_cluster("H100", 8, stack=stack("fsdp", grad_dtype="bf16"))
    eager = make_cluster("H100", 8, stack=stack("fsdp-eager", grad_dtype="bf16"))
    shape, lo = TrainShape(8192, 16), Layout(dp_shard=8, zero=3, micro_batch=2, recompute="selective")
    compiled_s, eager_s = (predict(LLAMA, c, shape, lo).step_time_s for c in (h100, eager))
    assert 1.08 < eager_s / compiled_s < 1.25
    gpt = PRESETS["gpt3-175b"].with_shape(layers=4, hidden=2048, heads=16, mlp_hidden=8192)
    assert predict(gpt, h100, shape, lo).step_time_s == predict(gpt, eager, shape, lo).step_time_s
    fused = layer_times(LLAMA, A100, LINKS, 4096, 1, 1, False, "none", "flash")
    composite = layer_times(LLAMA, A100, LINKS, 4096, 1, 1, False, "none", "flash", 1, False, False, 1, False)
    assert composite.forward.matmul == fused.forward.matmul
    # The backward's composites move more than 1.5x the forward's extra bytes (autograd of each op).
    extra_fwd = composite.forward.elementwise - fused.forward.elementwise
    extra_bwd = composite.backward.elementwise - fused.backward.elementwise
    assert extra_fwd > fused.forward.elementwise and extra_bwd > 1.5 * extra_fwd
    assert layer_kernel_count(LLAMA, "flash", fused_elementwise=False) == layer_kernel_count(LLAMA, "flash") + 17


def test_torchtitan_selective_recomputation_gathers_again_under_sequence_parallelism():
    """torchtitan's op-level policy saves reduce-scatter outputs but not all-gathers, so
    with sequence parallelism the two gathered block inputs are gathered again in the
    recomputation; without sequence parallelism, or recomputing only elementwise work
    (ember), nothing is communicated again."""
    rerun = layer_times(LLAMA, A100, LINKS, 4096, 1, 8, True, "selective-half-matmul", "flash").recompute
    forward = layer_times(LLAMA, A100, LINKS, 4096, 1, 8, True, "none", "flash").forward
    assert rerun.tp_comm == pytest.approx(forward.tp_comm / 2)  # two gathers of two gathers + two scatters
    assert layer_times(LLAMA, A100, LINKS, 4096, 1, 8, False, "selective-half-matmul", "flash").recompute.tp_comm == 0
    assert layer_times(LLAMA, A100, LINKS, 4096, 1, 8, True, "selective", "flash").recompute.tp_comm == 0
    # Overlapped (async TP), each gather hides behind its own matmul, in the rerun too.
    hidden = layer_times(LLAMA, A100, LINKS, 4096, 1, 8, True, "selective-half-matmul", "flash", 1, False, True)
    assert 0 < hidden.recompute.tp_comm < rerun.tp_comm


def test_fsdp_reduces_gradients_once_per_block_not_per_bucket():
    """FSDP (and ember's ZeRO-1/2, built on it) reduce-scatters each block's gradients as one
    flat tensor: a 3B model's 32 blocks and its tied embedding pay 33 rings' latency, not one per
    25-50 MB bucket of its 10 GB of fp32 gradients (~300 rings of 511 steps). Over 512 ranks a
    ring's latency is milliseconds, so the count decides whether ZeRO-2 still scales there;
    llm-foundry's MPT-3b loses 8% per GPU from 128 to 512 H100s."""
    mpt3b = dataclasses.replace(PRESETS["gpt2-small"], layers=32, hidden=2560, heads=20, mlp_hidden=10240,
                                vocab_size=50368, max_seq_len=2048)
    per_gpu = {}
    for n in (128, 512):
        cluster = make_cluster("H100", n, stack=stack("fsdp"))
        lo = Layout(dp_shard=n, zero=2, micro_batch=8)
        per_gpu[n] = predict(mpt3b, cluster, TrainShape(2048, 8 * n, "bf16"), lo).tokens_per_s_per_gpu
    assert 0.9 < per_gpu[512] / per_gpu[128] < 1.0


def test_each_stack_issues_its_gradient_reduction_as_its_software_buckets_it():
    """The number of data-parallel collectives (each paying a ring's latency) is the
    software's: FSDP one per block plus the embedding's and the output layer's, PyTorch DDP
    25 MB buckets, Megatron-Core max(40M, 1M x dp) parameters per bucket when it overlaps the
    reduction, one reduction of the whole buffer when it does not."""
    dp = 64
    shard = comm.place(dp, 1, 8)
    params = stage_params(LLAMA, Layout(dp_shard=dp, zero=1), 0)
    grads = 4 * params

    def units(name, zero):
        return _reduction_units(LLAMA, Layout(dp_shard=dp, zero=zero), 0, params, grads, shard, stack(name))

    assert units("ember", 1) == units("fsdp", 2) == LLAMA.layers + 2  # the embedding, the output layer
    tied = dataclasses.replace(LLAMA, tie_embeddings=True)
    tied_units = _reduction_units(tied, Layout(dp_shard=dp, zero=2), 0, params, grads, shard, stack("fsdp"))
    assert tied_units == LLAMA.layers + 1
    assert units("ember", 0) == -(-grads // DDP_BUCKET_BYTES)
    assert units("nemo", 1) == -(-params // 64e6)  # 1M x 64 ranks > 40M
    assert units("megatron", 1) == units("deepspeed", 2) == 1


def test_fsdp2_copies_gathered_weights_and_reduced_gradients_on_the_compute_stream():
    """ZeRO-3 under FSDP2 reads and writes every gathered weight in forward and again in
    backward, and casts every gradient into the reduce-scatter input, each micro-batch;
    ZeRO-2 gathers once a step; ZeRO-1 does both once a step; FSDP1 (llm-foundry) and
    Megatron-LM copy nothing. A stage's compute pays it at the memory rate."""
    p, shape, mb = 1e9, TrainShape(2048, 64), 8
    fp32_reduce = stack("ember", grad_dtype="fp32")  # bf16 weights, gradients reduced in fp32
    zero = {z: Layout(dp_shard=8, zero=z, micro_batch=1) for z in (0, 1, 2, 3)}
    assert fsdp_copy_bytes(p, zero[3], fp32_reduce, shape, mb, 4) == (4 * p, 4 * p + 6 * p)
    assert fsdp_copy_bytes(p, zero[2], fp32_reduce, shape, mb, 4) == (4 * p / mb, 6 * p)
    assert fsdp_copy_bytes(p, zero[1], fp32_reduce, shape, mb, 4) == (4 * p / mb, 6 * p / mb)
    assert fsdp_copy_bytes(p, zero[0], fp32_reduce, shape, mb, 4) == (0, 0)
    for other in ("llm-foundry", "megatron", "deepspeed"):
        assert fsdp_copy_bytes(p, zero[3], stack(other), shape, mb, 4) == (0, 0)
    model = PRESETS["llama3-8b"]
    cluster = make_cluster("H100", 8, stack=fp32_reduce)
    without = dataclasses.replace(cluster, stack=dataclasses.replace(fp32_reduce, fsdp2_copies=False))
    copies = fsdp_copy_bytes(stage_params(model, zero[3], 0), zero[3], fp32_reduce, shape, mb, 4)
    with_fwd, with_bwd, _ = _stage_work(model, cluster, shape, zero[3], 0)
    plain_fwd, plain_bwd, _ = _stage_work(model, without, shape, zero[3], 0)
    assert with_fwd.elementwise - plain_fwd.elementwise == pytest.approx(memory_s(copies[0], cluster.gpu))
    assert with_bwd.elementwise - plain_bwd.elementwise == pytest.approx(memory_s(copies[1], cluster.gpu))
