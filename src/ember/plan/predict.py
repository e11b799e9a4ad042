"""One layout's prediction: step time from stage times, the pipeline, data-parallel
communication and the optimizer; memory; and the figures a user compares layouts by.

Pipeline. Each stage's time per micro-batch, and how the schedule passes the step's
micro-batches through the stages, fill and drain included (plan/schedule.py). ember's
trainer compiles its blocks on a GPU but cannot under the zero-bubble schedules, whose
backward PyTorch splits in two: those stages are priced as eager PyTorch runs them
(`_as_scheduled`).

Data parallelism. Gradients are reduced once per step (ZeRO-0: all-reduce; ZeRO-1:
reduce-scatter over the shard group), or per micro-batch (ZeRO-2 reduce-scatters as the
gradients appear; ZeRO-3 also all-gathers weights before each forward and backward, one
collective per sharded unit). Hybrid sharding adds an all-reduce of each shard over the
replicas. Under a pipeline, FSDP reduces once a step, after the stage's last backward
(memory.py: defers_reduction), where only the stages below it, which finish their last
backwards later, leave it time to hide; ZeRO-3 then gathers its weights once a step too.
What overlapping them with compute costs (contention, the exposed first gather and last
bucket, what outlasts the compute) is plan/overlap.py's; stacks without overlap pay all
of it.

Optimizer. Adam streams every local parameter's master weight, moments and gradient
through HBM once (reads and writes: 26 bytes + 3 gradient reads/writes for clipping,
stepping and zeroing); memory-bound. An FP8 run then casts the weights it multiplies with
(`fp8_weight_cast_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ember.config import ConfigError
from ember.cost import matmul_params, model_flops_per_token, recompute_flops_per_token
from ember.hardware import at_fp32
from ember.layout import ZERO_BUBBLE, Layout
from ember.plan import comm, overlap, uncertainty
from ember.plan.cluster import Cluster
from ember.plan.fsdp import fsdp_copy_bytes, fsdp_host_s
from ember.plan.layout import TrainShape
from ember.plan.memory import (
    GIB,
    defers_reduction,
    Memory,
    holds,
    memory,
    pipeline_ranks,
    stage_params,
)
from ember.plan.schedule import idle_share, lockstep_s, pipeline_s
from ember.plan.timing import (
    BACKWARD_KERNELS,
    FP8_CAST_BYTES,
    LayerTimes,
    Work,
    embed_times,
    fused_softmax,
    head_times,
    layer_kernel_count,
    layer_times,
    memory_s,
)

ADAM_BYTES = 26
DDP_BUCKET_BYTES = 25e6  # PyTorch DDP's bucket_cap_mb
HOST_OVERLAP_POWER = 4.0  # fitted (benchmarks/results/2026-11-25-planner-fit.txt); see _as_run


@dataclass
class Prediction:
    layout: Layout
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # model FLOPs (the MFU convention, no recomputation)
    hw_tflops_per_gpu: float  # hardware FLOPs (recomputation included)
    mfu: float
    memory: Memory
    shares: dict[str, float]  # of the step time: compute, tp_comm, pp_comm, dp_comm, bubble, optimizer
    detail: dict[str, float] = field(default_factory=dict)
    interval: dict = field(default_factory=dict)  # plan/uncertainty.py: the range measured runs fell in

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        return {"layout": self.layout.text(), "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu,
                "hw_tflops_per_gpu": self.hw_tflops_per_gpu, "mfu": self.mfu,
                "memory_gib_per_gpu": self.memory.total / GIB, "memory_capacity_gib": self.memory.capacity / GIB,
                "memory_gib": self.memory.parts_gib(), "memory_stage": self.memory.stage, "fits": self.fits,
                "time_shares": self.shares, "detail": self.detail, "interval": self.interval}


def element_width(shape: TrainShape) -> int:
    """Activation (and gathered weight) bytes over 2: a run without autocast (fp32, as on a
    CPU) moves 4-byte elements where a bf16 run moves 2."""
    return 2 if shape.precision == "fp32" else 1


def gradient_bytes(stack, shape: TrainShape) -> int:
    """Bytes per reduced gradient: the stack's choice in mixed precision, 4 in an fp32 run
    (bf16 gradient reduction is refused there)."""
    return 4 if shape.precision == "fp32" else stack.grad_bytes


def _stage_work(model, cluster: Cluster, shape: TrainShape, lo: Layout, stage: int) -> tuple[Work, Work, float]:
    """Forward and backward (incl. recomputation) Work of one micro-batch on `stage`, and how
    far the slower pass sits above the larger of its host and GPU time (`_as_run`)."""
    stack, width = cluster.stack, element_width(shape)
    fp8 = shape.precision == "fp8"
    layers = _layers(model, cluster, shape, lo)
    local_seq = shape.seq_len // lo.cp  # the tokens of each sequence this rank holds
    n = lo.rank_layers(model)[stage]
    embedding, output = holds(lo, stage)
    # Only the layers `recompute_every` covers rerun their forward.
    again = n * lo.recomputed_fraction(model.layers)
    fwd, bwd = layers.forward * n, layers.backward * n + layers.recompute * again
    # Host calls per layer: its kernels, and its tensor-parallel collectives (each a
    # torch.distributed call that costs the host about as much as a launch).
    softmax_fused = fused_softmax(model, lo.micro_batch, shape.seq_len, lo.tp)
    kernels = layer_kernel_count(model, stack.attention, softmax_fused, fp8, stack.fused_elementwise)
    calls = tp_collectives(lo)
    rerun = kernels + (calls if lo.recompute == "full" else 0)
    fwd_kernels = n * (kernels + calls)
    bwd_kernels = n * (kernels * BACKWARD_KERNELS + calls) + again * rerun
    # Eager tensor parallelism's own host work (DTensor dispatch), measured per layer pass
    # and shared between forward and backward as their kernels are.
    tp_host = stack.tp_host_s_per_layer if lo.tp > 1 and not stack.compiled else 0.0
    # ZeRO's FSDP2 host work, on every sharded unit: the blocks, the embedding and the output layer.
    fsdp_host = (n + _edge_units(model, lo, stage)) * fsdp_host_s(lo, stack, lo.micro_batches(shape.global_batch))
    share = 1 / (1 + BACKWARD_KERNELS)
    fwd_host = n * tp_host * share + fsdp_host * share
    bwd_host = (n * tp_host * (1 - share) + fsdp_host * (1 - share)
                + (again * tp_host * share if lo.recompute == "full" else 0.0))
    if embedding:
        embed_fwd, embed_bwd = embed_times(model, cluster.gpu, cluster.links, local_seq, lo.micro_batch, lo.tp,
                                           lo.sp, width)
        fwd, bwd = fwd + embed_fwd, bwd + embed_bwd
    if output:
        head_fwd, head_bwd = head_times(model, cluster.gpu, cluster.links, local_seq, lo.micro_batch, lo.tp,
                                        lo.sp, width, (stack.loss_fwd_bytes, stack.loss_bwd_bytes))
        fwd, bwd = fwd + head_fwd, bwd + head_bwd
    # Accumulating this micro-batch's weight gradients: read and write the gradient buffer.
    accumulate = memory_s(stage_params(model, lo, stage) * 2 * gradient_bytes(stack, shape)
                          / (lo.shard_ranks if lo.zero >= 2 and not defers_reduction(lo, stack) else 1),
                          gpu=cluster.gpu)
    bwd = bwd + Work(elementwise=accumulate)
    copy_fwd, copy_bwd = fsdp_copy_bytes(stage_params(model, lo, stage), lo, stack, shape,
                                         lo.micro_batches(shape.global_batch), gradient_bytes(stack, shape))
    fwd = fwd + Work(elementwise=memory_s(copy_fwd, cluster.gpu))
    bwd = bwd + Work(elementwise=memory_s(copy_bwd, cluster.gpu))
    # The per-micro-batch host work outside the kernels is not hidden (Stack.host_s_per_micro_batch).
    between = Work(launch=stack.host_s_per_micro_batch)
    fwd, fwd_cross = _as_run(fwd, fwd_kernels, stack, fwd_host)
    bwd, bwd_cross = _as_run(bwd, bwd_kernels, stack, bwd_host)
    return fwd + between, bwd, max(fwd_cross, bwd_cross)


def fp8_weight_cast_s(model, shape: TrainShape, lo: Layout, stage: int, gpu) -> float:
    """Casting the weights the stage multiplies with to FP8 (and FP8 transposed), once per
    step: Transformer Engine keeps them over the micro-batches of a step (Megatron-LM's
    is_first_microbatch), and torchtitan runs one micro-batch per step. 0 outside FP8."""
    if shape.precision != "fp8":
        return 0.0
    weights = matmul_params(model)["layer"] / lo.tp
    return memory_s(lo.rank_layers(model)[stage] * weights * FP8_CAST_BYTES, gpu)


def tp_collectives(lo: Layout) -> int:
    """Tensor-parallel collectives of one layer's forward: two all-reduces, or with sequence
    parallelism two all-gathers and two reduce-scatters."""
    return 0 if lo.tp <= 1 else (4 if lo.sp else 2)


def _as_run(work: Work, kernels: float, stack, extra_host_s: float = 0.0) -> tuple[Work, float]:
    """`work` as `stack` runs it: its matmuls at `kernel_eff` and its fused attention at
    `attention_eff` of the planner's rates, and the pass no faster than the host can issue its `kernels` host calls.

    An eager framework issues kernels from Python while the GPU runs earlier ones. With an
    unbounded queue the pass would take max(host, GPU); it takes longer near the crossover,
    because the host only runs ahead while long kernels (the matmuls) execute and loses the
    lead on runs of short ones (norms, activations, collectives) and at every sync point. A
    soft maximum (host^p + GPU^p)^(1/p) with p = HOST_OVERLAP_POWER prices that: equal to
    the larger term far from the crossover, 2^(1/p) times it at the crossover (1.19 for the
    fitted p = 4). Where
    the host shares its cores with the compute (a CPU: `stack.host_overlaps` false) the
    two add. `extra_host_s`: host work beyond the calls (eager tensor parallelism's).

    Also returns the pass time over max(host, GPU): 1 far from the crossover, up to 2^(1/p)
    at it. Near it the measured cost is the least certain (`uncertainty.CROSSOVER`)."""
    if stack.kernel_eff != 1.0 or stack.attention_eff != 1.0:
        work = Work(work.matmul / stack.kernel_eff, work.attention / stack.attention_eff, work.elementwise,
                    work.tp_comm, work.launch)
    host, device = kernels * stack.host_s_per_kernel + extra_host_s, work.total
    if not stack.host_overlaps:
        return work + Work(launch=host), 1.0
    if host <= 0 or device <= 0:
        return work + Work(launch=max(0.0, host - device)), 1.0
    p, big = HOST_OVERLAP_POWER, max(host, device)  # scaled, so absurd rates do not overflow
    run = big * ((host / big) ** p + (device / big) ** p) ** (1 / p)
    return work + Work(launch=run - device), run / max(host, device)


def boundary_s(model, shape: TrainShape, lo: Layout, groups: dict, links, slices: bool = True) -> float:
    """One tensor crossing a pipeline boundary. Each of the tp ranks sends only its 1/tp slice
    (Narayanan et al. 2021, scatter/gather optimisation). Without sequence parallelism the
    next stage needs the whole activation on every rank, so the receivers all-gather it over
    NVLink; with sequence parallelism the slice is what the next layer takes. A stack
    without the optimisation (`Stack.p2p_slices` False) sends the whole tensor from every
    rank, each over its own link, and needs no gather."""
    full = lo.micro_batch * shape.seq_len / lo.cp * model.hidden * 2 * element_width(shape)
    if not slices:
        return comm.p2p_s(full, groups["pp"], links)
    send = comm.p2p_s(full / lo.tp, groups["pp"], links)
    gather = comm.all_gather_s(full, groups["tp"], links) if lo.tp > 1 and not lo.sp else 0.0
    return send + gather


def check_precision(gpu, precision: str) -> None:
    """Refuse FP8 on a GPU whose tensor cores cannot multiply in it."""
    if precision == "fp8" and not gpu.fp8:
        raise ConfigError(f"{gpu.name} has no FP8 tensor cores (Hopper, Ada and Blackwell have); "
                          "use --precision bf16.")


def _as_scheduled(cluster: Cluster, lo: Layout) -> Cluster:
    """`cluster` as ember's trainer runs `lo`: its zero-bubble stages cannot be compiled
    (PyTorch asks them for input and weight gradients in two passes), so on a GPU, where the
    other layouts compile, they run eager PyTorch's elementwise composites and tensor
    parallelism's eager host work. A CPU runs every layout eager and is priced alike."""
    stack = cluster.stack
    if stack.name != "ember" or lo.pp == 1 or lo.schedule not in ZERO_BUBBLE:
        return cluster
    fused = stack.fused_elementwise and not stack.host_overlaps
    return replace(cluster, stack=replace(stack, compiled=False, fused_elementwise=fused))


def predict(model, cluster: Cluster, shape: TrainShape, lo: Layout) -> Prediction:
    cluster = _as_scheduled(cluster, lo)
    if shape.precision == "fp32":
        cluster = replace(cluster, gpu=at_fp32(cluster.gpu))
    links, gpu, stack = cluster.links, cluster.gpu, cluster.stack
    check_precision(gpu, shape.precision)
    groups = comm.groups(lo.tp, lo.dp_shard, lo.dp_replicate, lo.pp, links.gpus_per_node, lo.cp)
    m = lo.micro_batches(shape.global_batch)
    if m < 1:  # a step with no micro-batch would price as free
        raise ConfigError(f"layout {lo.text()} needs at least dp x mbs = {lo.dp * lo.micro_batch} sequences "
                          f"per step; the global batch is {shape.global_batch}.")
    grad_bytes, weight_bytes = gradient_bytes(stack, shape), 2 * element_width(shape)
    p2p = 2 * lo.vpp * boundary_s(model, shape, lo, groups, links, stack.p2p_slices) if lo.pp > 1 else 0.0

    shard, rep = groups["dp_shard"], groups["dp_replicate"]
    stand_in = pipeline_ranks(model, lo)  # ranks that cost the same are priced once
    stages = sorted(set(stand_in.values()))
    times, halves, idle, parts, dp_exposed, optimizer = {}, {}, {}, {}, 0.0, 0.0
    passes = {i: _stage_work(model, cluster, shape, lo, i) for i in stages}
    # Under a pipeline FSDP reduces once a step (`defers_reduction`), and ZeRO-3 keeps its
    # weights gathered over the micro-batches (ember, torchtitan).
    deferred = defers_reduction(lo, stack)
    for i in stages:
        fwd, bwd, _ = passes[i]
        params = stage_params(model, lo, i)
        grads = params * grad_bytes
        buckets = _reduction_units(model, lo, i, params, grads, shard, stack)
        per_mb = 0.0
        if lo.zero >= 3 and not deferred:  # gather weights for forward and backward, every micro-batch
            layers = max(1, lo.rank_layers(model)[i])
            units = layers * stack.zero3_collectives_per_layer + _edge_units(model, lo, i)
            gather = (overlap.sharded_s(params * weight_bytes, units, shard, links)
                      + units * shard.size * stack.gather_s_per_rank)
            scatter = overlap.sharded_s(grads, units, shard, links, "reduce_scatter")
            # A stack that gathers again for the recomputed forward does so in the backward pass.
            rerun = (gather * lo.recomputed_fraction(model.layers)
                     if lo.recompute == "full" and stack.zero3_regathers_for_recompute else 0.0)
            per_mb = (overlap.hidden_cost(gather, fwd.compute, gather / units, stack.overlap_param_gather)
                      + overlap.hidden_cost(gather + rerun + scatter, bwd.compute, scatter / units,
                                            stack.overlap_param_gather and stack.overlap_grad_reduce))
        elif lo.zero == 2 and not deferred:  # gradients reduce-scattered as they appear, every micro-batch
            scatter = overlap.sharded_s(grads, buckets, shard, links, "reduce_scatter")
            per_mb = overlap.hidden_cost(scatter, bwd.compute, scatter / buckets, stack.overlap_grad_reduce)
        times[i] = fwd.total + bwd.total + p2p + per_mb
        halves[i] = (fwd.total + p2p / 2, bwd.total + p2p / 2 + per_mb)
        # A zero-bubble schedule runs the weight-gradient matmuls (as long as the forward's)
        # apart from the rest of the backward.
        weight = min(fwd.matmul, halves[i][1])
        idle[i] = idle_share(lo.schedule, halves[i][0], halves[i][1] - weight, weight, m, lo.pp)
        parts[i] = (fwd + bwd, per_mb)

        if lo.zero == 0:  # over the replicas, and the cp ranks that hold the same weights
            reduce = comm.all_reduce_s(grads, rep, links) + comm.all_reduce_s(grads, shard, links)
        elif lo.zero == 1 or deferred:
            reduce = (overlap.sharded_s(grads, buckets, shard, links, "reduce_scatter")
                      + comm.all_reduce_s(grads / lo.shard_ranks, rep, links))
        else:
            reduce = comm.all_reduce_s(grads / lo.shard_ranks, rep, links)
        if deferred:
            # Issued after the stage's last backward: nothing hides it but the last
            # micro-batch's backward through the ranks below, which finish after this one
            # (through one of their vpp chunks each when interleaved).
            below = sum(passes[stand_in[j]][1].total for j in range(i))
            reduce = max(0.0, reduce - below / lo.vpp)
        else:
            # The last micro-batch's backward hides the step's reduction, all but its last bucket.
            reduce = overlap.hidden_cost(reduce, bwd.compute, reduce / buckets, stack.overlap_grad_reduce)
        once = lo.zero in (1, 2) or deferred  # weights gathered once a step
        gather = overlap.sharded_s(params * weight_bytes, buckets, shard, links) if once else 0.0
        gather = overlap.hidden_cost(gather, fwd.compute, gather / buckets, stack.overlap_param_gather)
        dp_exposed = max(dp_exposed, reduce + gather)
        local = params / (lo.shard_ranks if lo.zero >= 1 else 1)
        optimizer = max(optimizer, memory_s(local * (ADAM_BYTES + 3 * grad_bytes), gpu)
                        + fp8_weight_cast_s(model, shape, lo, i, gpu))

    every_stage = [times[stand_in[i]] for i in range(lo.pp)]
    if stack.pipeline_lockstep and lo.pp > 1 and lo.vpp == 1:
        pipeline, bubble = lockstep_s([halves[stand_in[i]][0] for i in range(lo.pp)],
                                      [halves[stand_in[i]][1] for i in range(lo.pp)], m)
    else:
        pipeline, bubble = pipeline_s(every_stage, m, lo.vpp, [idle[stand_in[i]] for i in range(lo.pp)])
    slowest = max(times, key=times.get)
    t_max, mean = times[slowest], sum(every_stage) / lo.pp
    step = pipeline + dp_exposed + optimizer
    if not (math.isfinite(step) and step > 0):
        raise ConfigError(f"the cluster's rates price a step of {lo.text()} at {step} s; check the profile's or "
                          "--intra-bw/--inter-bw's numbers and units (docs/planner.md).")

    work, zero3 = parts[slowest]
    crossover = passes[slowest][2]
    tokens = shape.tokens
    per_gpu = tokens / step / cluster.n_gpus
    model_flops = model_flops_per_token(model, shape.seq_len, model.predicted_fraction)
    rerun = recompute_flops_per_token(model, shape.seq_len, cluster.stack.recompute_policy(lo.recompute))
    hw_flops = model_flops + rerun * lo.recomputed_fraction(model.layers)
    shares = {"compute": m * work.compute / step, "tp_comm": m * work.tp_comm / step,
              "pp_comm": m * p2p / step, "dp_comm": (dp_exposed + m * zero3) / step,
              "bubble": bubble / step, "optimizer": optimizer / step}
    detail = {"micro_batches": m, "slowest_stage": slowest, "stage_imbalance": m * (t_max - mean) / step,
              "matmul_s": m * work.matmul, "attention_s": m * work.attention,
              "elementwise_s": m * work.elementwise, "launch_s": m * work.launch,
              "recompute_s": m * _recompute_s(model, cluster, shape, lo),
              "pipeline_s": pipeline, "dp_exposed_s": dp_exposed, "optimizer_s": optimizer,
              "host_crossover": crossover}
    mem = memory(model, lo, shape, gpu, grad_bytes, stack.attention, stack)
    mfu = per_gpu * model_flops / gpu.peak_bf16_flops
    return Prediction(lo, step, per_gpu, per_gpu * model_flops / 1e12, per_gpu * hw_flops / 1e12, mfu, mem,
                      shares, detail, uncertainty.interval(lo, gpu.name, per_gpu, mfu, shape.precision, crossover))


def _edge_units(model, lo: Layout, stage: int) -> int:
    """Sharded groups of their own beside the blocks: the embedding and the output layer
    where this pipeline rank holds them (ember and torchtitan wrap each; tied, they are one)."""
    embedding, output = holds(lo, stage)
    return int(embedding or output) if model.tie_embeddings else embedding + output


def _reduction_units(model, lo: Layout, stage: int, params: float, grads: float, shard: comm.Group, stack) -> int:
    """How many collectives the data-parallel gradient reduction (and the ZeRO-1/2 weight
    gather) of one stage is issued as. Each pays the ring's latency, which over hundreds of
    ranks is milliseconds, so the count is what the software's bucketing decides:
    - FSDP (ember's ZeRO-1/2, torchtitan, llm-foundry): one flat tensor per wrapped block,
      and the embedding and output layer's (`_edge_units`);
    - PyTorch DDP (ZeRO-0 on those stacks): buckets of DDP_BUCKET_BYTES (`bucket_cap_mb`);
    - Megatron-Core with overlapped reduction: buckets of max(40M, 1M x dp) parameters (its
      DistributedDataParallelConfig default, sized so that large groups stay off latency);
    - without overlap (Megatron-LM's default, DeepSpeed's 500M-element buckets): the whole
      gradient at once, or a handful."""
    if stack.per_block_grads:
        if lo.zero == 0:
            return max(1, math.ceil(grads / DDP_BUCKET_BYTES))
        return max(1, lo.rank_layers(model)[stage]) + _edge_units(model, lo, stage)
    if not stack.overlap_grad_reduce:
        return 1
    return max(1, math.ceil(params / max(40e6, 1e6 * shard.size)))


def _layers(model, cluster: Cluster, shape: TrainShape, lo: Layout) -> LayerTimes:
    """One block's passes under `lo`, its elementwise work at the stack's measured scale."""
    stack = cluster.stack
    layers = layer_times(model, cluster.gpu, cluster.links, shape.seq_len, lo.micro_batch, lo.tp, lo.sp,
                         stack.recompute_policy(lo.recompute), stack.attention, element_width(shape),
                         shape.precision == "fp8", stack.overlap_tp_comm, lo.cp, stack.fused_elementwise)
    return layers.scaled_elementwise(stack.elementwise_scale)


def one_block(model, cluster: Cluster, shape: TrainShape, micro_batch: int) -> Work:
    """One block's forward and backward on one GPU (no tensor parallelism, no
    recomputation) as the host runs them, its elementwise work unscaled: the price
    `ember plan calibrate --model` sets beside the same block timed (plan/kernels.py)."""
    stack = replace(cluster.stack, eager_elementwise_scale=1.0)
    layers = _layers(model, replace(cluster, stack=stack), shape, Layout(micro_batch=micro_batch))
    kernels = layer_kernel_count(model, stack.attention, fused_softmax(model, micro_batch, shape.seq_len, 1),
                                 False, stack.fused_elementwise)
    return _as_run(layers.forward, kernels, stack)[0] + _as_run(layers.backward, kernels * BACKWARD_KERNELS, stack)[0]


def _recompute_s(model, cluster: Cluster, shape: TrainShape, lo: Layout) -> float:
    layers = _layers(model, cluster, shape, lo)
    return layers.recompute.compute * max(lo.rank_layers(model)) * lo.recomputed_fraction(model.layers)
