"""Memory per GPU: model states by ZeRO stage, activations by checkpointing policy, buffers.

Model states (mixed-precision Adam, Rajbhandari et al. 2020): 2 bytes of bf16 weight,
2 of gradient (4 where the stack keeps fp32 main gradients) and 12 of fp32 master weight
and two moments per parameter. ZeRO-1 shards the 12 over the dp_shard ranks (and the cp
ranks among them, which hold the same weights: `Layout.shard_ranks`), ZeRO-2 also
the gradients, ZeRO-3 also the weights.

Activations per layer and micro-batch (Korthikanti et al. 2022, arXiv 2205.05198), in
bytes, s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor parallel:
no recomputation sbh(34 + 5as/h), with tensor + sequence parallelism (sbh/t)(34 + 5as/h),
selective recomputation drops the 5as/h softmax terms, full recomputation keeps only the
layer input, 2sbh (/t with sequence parallelism). Their 34 counts, per token: the two norm
inputs 4h, QKV input 2h, Q and K 4h, V 2h, projection input 2h, MLP input 2h, GELU input
8h, down-projection input 8h, and three 1-byte dropout masks of h. Generalised here to
grouped-query attention (K and V are 2·h_kv each), gated MLPs (gate and up outputs, 4f,
plus the 2f down-projection input) and models without dropout (no masks). Without sequence
parallelism the norm inputs, the QKV and MLP inputs and the residual dropout masks (10h)
are replicated on every tensor-parallel rank. FlashAttention never stores the s×s
softmax, only a 4-byte log-sum-exp per head and token. An FP8 run keeps each weight
matmul's input as its 1-byte cast (`fp8_saved_per_token`).

Micro-batches in flight: the first stage holds p under 1F1B (stage i holds p - i), all m
under GPipe, and p·(1 + (p-1)/(p·v)) under the interleaved schedule (Narayanan et al.
2021); the zero-bubble schedules hold p on every rank, fewer on the first under zbv with
few micro-batches, and also keep the weights' output gradients between the split backward's
two halves; the loss's state is one micro-batch's but under GPipe and zero-bubble
(plan/held.py). The embedding sits on the first stage, the output layer
and the logits on the last (with pp > 1 a tied output layer is a second copy there). Each rank
holds the layers `Layout.split` gives its stages, so uneven splits are sized rank by rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ember.cost import chunk_tokens, gated, kv_hidden, matmul_params
from ember.layout import ZERO_BUBBLE, Layout
from ember.plan.cluster import Stack
from ember.plan.eager import autocast_fp32_weights, eager_saved_bytes
from ember.plan.held import awaiting_weight_grads, in_flight, output_in_flight, weight_grad_inputs
from ember.plan.layout import TrainShape
from ember.plan.stacks import STACKS

GIB = 2**30
# What memory assumes of software it is not told about: Megatron-LM's habits (its selective
# recomputation, an unfused loss, persistent gradient buffers, sequence parallelism that
# gathers again in backward).
MEGATRON = STACKS["megatron"]
WEIGHT_BYTES = 2
OPTIMIZER_BYTES = 12  # fp32 master weight, Adam's first and second moment
RUNTIME_BYTES = 1.0 * GIB  # CUDA context, cuBLAS and NCCL workspaces, outside the allocator
FRAGMENTATION = 0.05  # of what the caching allocator holds: cached but unusable blocks
DRIVER_RESERVE = 0.01  # of the nominal capacity, never handed to the program
BUCKET_BYTES = 2 * 25e6  # two gradient buckets of 25 MB in flight (DDP's default size)


def layer_params(model) -> int:
    """Parameters of one block: matmul weights, their biases, and the norms."""
    h, f = model.hidden, model.mlp_hidden
    biases = (h + 2 * kv_hidden(model) + h + (2 if gated(model) else 1) * f + h) if model.bias else 0
    norms = 2 * (2 * h if model.norm == "layernorm" else h)
    return matmul_params(model)["layer"] + biases + norms


def total_params(model) -> int:
    positions = model.max_seq_len * model.hidden if model.positions == "learned" else 0
    embed = model.padded_vocab * model.hidden + positions
    output = 0 if model.tie_embeddings else model.padded_vocab * model.hidden
    return model.layers * layer_params(model) + embed + output + 2 * model.hidden


def holds(layout: Layout, stage: int) -> tuple[bool, bool]:
    """(the embedding, the output layer): whether pipeline rank `stage` holds them."""
    owner = layout.stage_owner()
    return owner[0] == stage, owner[-1] == stage


def pipeline_ranks(model, layout: Layout) -> dict[int, int]:
    """Each pipeline rank -> the rank that stands for it: ranks holding the same layers and
    neither end cost the same, and the earliest of them has the most micro-batches in flight."""
    owners = layout.stage_owner()
    return dict(enumerate(_stand_ins(owners[0], owners[-1], layout.rank_layers(model))))


@functools.lru_cache(maxsize=4096)  # asked for every layout a search prices, and pure
def _stand_ins(first: int, last: int, layers: tuple[int, ...]) -> tuple[int, ...]:
    kind = [(rank == first, rank == last, n) for rank, n in enumerate(layers)]
    return tuple(kind.index(k) for k in kind)


def stage_params(model, layout: Layout, stage: int) -> float:
    """Parameters one GPU of pipeline rank `stage` holds (before ZeRO sharding)."""
    t, p = layout.tp, layout.pp
    vocab = model.padded_vocab * model.hidden / t  # vocabulary-parallel embedding and output
    params = layout.rank_layers(model)[stage] * layer_params(model) / t
    embedding, output = holds(layout, stage)
    if embedding:
        params += vocab + (model.max_seq_len * model.hidden if model.positions == "learned" else 0)
    if output:
        params += 2 * model.hidden + (vocab if (not model.tie_embeddings or p > 1) else 0)
    return params


def activation_bytes_per_token(model, seq_len: int, layout: Layout, attention: str,
                               stack: Stack = MEGATRON) -> float:
    """Bytes one layer keeps per token of a micro-batch until its backward pass, as `stack`
    runs it: what its selective recomputation reruns (Megatron's attention core, ember's
    elementwise work), and whether its sequence parallelism keeps the gathered inputs."""
    h, kv, f, t = model.hidden, kv_hidden(model), model.mlp_hidden, layout.tp
    mask = 1 if model.dropout else 0
    split_norms = t if layout.sp else 1
    if layout.recompute == "full":
        return 2 * h / split_norms
    policy = stack.recompute_policy(layout.recompute)
    if policy == "selective" and attention == "flash":
        return _kept_matmul_outputs(model, layout)
    if policy == "selective-half-matmul":
        return _kept_every_other_matmul(model, layout)
    norms, inputs = 4 * h + 2 * mask * h, 2 * h + 2 * h  # norm inputs and masks; q/k/v and MLP inputs
    # DTensor's sequence parallelism all-gathers the q/k/v and MLP inputs and autograd keeps
    # the whole gathered tensor for the weight gradient; Megatron-LM keeps its slice and
    # gathers again in backward.
    gathered_split = 1 if layout.sp and stack.sp_keeps_gathered else split_norms
    attention_part = 2 * h + 4 * kv + 2 * h
    mlp_part = (6 * f) if gated(model) else (4 * f)
    per_token = norms / split_norms + inputs / gathered_split + (attention_part + mlp_part) / t
    if attention == "flash":
        per_token += 4 * model.heads / t
    elif layout.recompute == "none":
        per_token += model.heads * seq_len * (2 + 3 * mask) / t
    return per_token


def _kept_matmul_outputs(model, layout: Layout) -> float:
    """What ember's selective policy (parallel/recompute.py) keeps per token: the block's
    input and the outputs of its matmuls, attention kernel and tensor-parallel collectives.
    The row-parallel projections (attention output, MLP down) keep their local partial sum
    and the collective's result; sequence parallelism also keeps the two all-gathered
    [B, T, h] inputs of the column-parallel ones. Norm outputs and the MLP's activation
    (2h + 2h + 2f of the 34-term count) are what it saves by rerunning them."""
    h, kv, f, t = model.hidden, kv_hidden(model), model.mlp_hidden, layout.tp
    sharded = (2 * h + 4 * kv) + 2 * h + (4 if gated(model) else 2) * f + 4 * model.heads
    if t == 1:
        return 2 * h + sharded + 2 * (2 * h)
    if not layout.sp:
        return 2 * h + sharded / t + 2 * (2 * h + 2 * h)
    return 2 * h / t + sharded / t + 2 * (2 * h + 2 * h / t) + 2 * (2 * h)


def _kept_every_other_matmul(model, layout: Layout) -> float:
    """What torchtitan's op-level policy keeps per token (activation_checkpoint.py: its
    save list holds mm, the attention kernel, reduce-scatter and max; of the mm outputs only
    every other one, counted within each block): the block's input, the 1st, 3rd, ...
    matmul outputs in the order the block runs them (q, k, v, o, then gate, up, down), the
    attention output and its log-sum-exp, and sequence parallelism's two reduce-scattered
    outputs. A row-parallel matmul's output is a full-width partial sum before its
    reduce-scatter. The rest (norms, rotary, activations, the other matmuls, all-gathers)
    reruns."""
    h, kv, f, t = model.hidden, kv_hidden(model), model.mlp_hidden, layout.tp
    column, row = True, False
    mlp = [(f, column), (f, column), (h, row)] if gated(model) else [(f, column), (h, row)]
    matmuls = [(h, column), (kv, column), (kv, column), (h, row)] + mlp
    kept = sum(2 * width / (t if split else 1) for width, split in matmuls[::2])
    sequence_split = t if layout.sp else 1
    kept += 2 * h / sequence_split + 2 * h / t + 4 * model.heads / t  # input; attention output, LSE
    if layout.sp and t > 1:
        kept += 2 * (2 * h / t)
    return kept


def layer_activation_bytes(model, seq_len: int, layout: Layout, attention: str, stack: Stack = MEGATRON) -> float:
    """Bytes per token a layer keeps on average when only some layers are recomputed
    (`recompute_every`): the covered share keeps the policy's, the rest everything."""
    covered = layout.recomputed_fraction(model.layers)
    kept = activation_bytes_per_token(model, seq_len, layout, attention, stack)
    if covered in (0.0, 1.0):
        return kept
    return covered * kept + (1 - covered) * activation_bytes_per_token(model, seq_len, _no_recompute(layout),
                                                                        attention, stack)


def fp8_saved_per_token(model, layout: Layout, stack: Stack = MEGATRON) -> float:
    """Bytes per token and layer an FP8 run keeps less: Transformer Engine saves each weight
    matmul's input for the weight gradient as its 1-byte FP8 cast, not in bf16 (the q/k/v
    and MLP inputs, the attention projection's and the down projection's). Layers that
    fully recompute keep only their input, which is not cast. Under torchtitan's op-level
    selective policy nothing changes: it keeps matmul outputs, and the casts rerun (its
    FP8 and bf16 runs of Llama 3.1 8B peaked at the same memory, 76.8 and 77.0 GiB)."""
    if stack.recompute_policy(layout.recompute) == "selective-half-matmul":
        return 0.0
    h, f, t = model.hidden, model.mlp_hidden, layout.tp
    kept = 1.0 - (layout.recomputed_fraction(model.layers) if layout.recompute == "full" else 0.0)
    gathered_split = 1 if layout.sp and stack.sp_keeps_gathered else (t if layout.sp else 1)
    return kept * (2 * h / gathered_split + (h + f) / t)


@dataclass
class Memory:
    """Bytes per GPU on the fullest pipeline stage, by part."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    runtime: float
    fragmentation: float
    stage: int
    capacity: float
    # Counted twice above: gradients made in backward in the room the freed activations
    # leave (one micro-batch, one stage, gradients freed after every step).
    shared: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.buffers + self.runtime + self.fragmentation - self.shared)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def measured_as(self, device_type: str) -> float:
        """The part of the prediction a run's measured peak is compared with. On a GPU the run
        reports its caching allocator's peak reservation (torch.cuda.max_memory_reserved):
        everything but the runtime, which lives outside the allocator. Elsewhere it reports
        the process's peak resident set, runtime included (a calibrated profile measures it)."""
        return self.total - self.runtime if device_type == "cuda" else self.total

    def parts_gib(self) -> dict[str, float]:
        names = ("weights", "grads", "optimizer", "activations", "logits", "buffers", "runtime", "fragmentation")
        parts = {name: round(getattr(self, name) / GIB, 2) for name in names}
        return parts | ({"shared": -round(self.shared / GIB, 2)} if self.shared else {})


def defers_reduction(layout: Layout, stack: Stack) -> bool:
    """Whether FSDP's gradient reduction waits for the step's last micro-batch under a
    pipeline: torch.distributed.pipelining runs every micro-batch's backward through an
    FSDP-wrapped stage without resharding or reducing (PipelineStage.
    backward_maybe_with_nosync) and reduces once a step, after the stage's last backward:
    it calls FSDP's post-backward itself then (since 2024; since PyTorch 2.10 as an
    action of the schedule, REDUCE_GRAD). ember's pipeline and torchtitan's run so."""
    return layout.pp > 1 and layout.zero >= 1 and stack.per_block_grads


def stage_memory(model, layout: Layout, shape: TrainShape, stage: int, grad_bytes: int,
                 attention: str, capacity: float, runtime: float = RUNTIME_BYTES,
                 stack: Stack = MEGATRON) -> Memory:
    """Memory of one GPU of pipeline rank `stage`. `shape.precision` "fp32" (a CPU run, or
    a GPU without autocast) keeps 4-byte weights, gradients and activations and no master
    copy (Adam's two moments only); `runtime` is what the device holds outside the program;
    `stack`: the software's habits that change memory (`Stack`: selective recomputation,
    a fused loss, gradients freed every step, sequence parallelism's gathered inputs)."""
    s, b, t = shape.seq_len, layout.micro_batch, layout.tp
    m = layout.micro_batches(shape.global_batch)
    shard = layout.shard_ranks
    fp32 = shape.precision == "fp32"
    width = 2 if fp32 else 1  # activations are counted in 2-byte elements
    grad_bytes = 4 if fp32 else grad_bytes
    params = stage_params(model, layout, stage)
    # ember's trainer without FSDP autocasts over fp32 weights, which are then the master
    # copy: 4 bytes of weight and Adam's 8, no 2-byte copy (autocast_fp32_weights).
    plain = stack.name == "ember" and not fp32 and not (layout.zero >= 1 and layout.dp > 1)
    # Until the deferred reduction the stage's gradients accumulate whole, and ZeRO-3's
    # weights stay gathered from the first forward on (beside their shards, which are the
    # fp32 masters in mixed precision).
    deferred = defers_reduction(layout, stack)
    # An FSDP stack (`per_block_grads`) keeps no bf16 shard under ZeRO-3: its fp32 shards are
    # the master weights, counted with the optimizer. DeepSpeed keeps a bf16 shard besides.
    weights = params * (4 if fp32 or plain else WEIGHT_BYTES)
    if layout.zero >= 3:
        weights = 0.0 if stack.per_block_grads and not fp32 else weights / shard
    if deferred and layout.zero >= 3:
        weights = params * (4 * (1 + 1 / shard) if fp32 else WEIGHT_BYTES)
    # ZeRO-1 on an FSDP stack reduce-scatters at the step's last micro-batch: with only one,
    # the full gradients never exist at once.
    sharded_grads = not deferred and (layout.zero >= 2 or (layout.zero == 1 and m == 1 and stack.per_block_grads))
    # What an FSDP stack keeps is fp32 whatever crosses the wire: DDP's gradients are its
    # fp32 parameters' (a bf16 reduction is a cast copy per bucket), and FSDP2 casts each
    # reduced shard back to its fp32 parameter's dtype. Only gradients accumulated whole
    # over the step's micro-batches (ZeRO-1, or any stage under a pipeline) stay in the
    # reduce dtype. A persistent buffer (Megatron-LM, DeepSpeed) is in the reduce dtype.
    accumulated_whole = layout.zero >= 1 and not sharded_grads
    kept_bytes = 4 if stack.per_block_grads and not accumulated_whole else grad_bytes
    grads = params * kept_bytes / (shard if sharded_grads else 1)
    optimizer = params * (8 if fp32 or plain else OPTIMIZER_BYTES) / (shard if layout.zero >= 1 else 1)
    layers = layout.rank_layers(model)[stage]
    embedding, output = holds(layout, stage)
    tokens = s * b / layout.cp  # a rank holds 1/cp of each sequence
    kept = layer_activation_bytes(model, s, layout, attention, stack)
    if shape.precision == "fp8":
        kept -= fp8_saved_per_token(model, layout, stack)
    acts = in_flight(layout, m, stage) * layers * tokens * kept
    if embedding:  # embedding output (and its dropout mask) feeds the first block
        acts += in_flight(layout, m, stage) * tokens * model.hidden * (2 + model.dropout) / (t if layout.sp else 1)
    acts *= width
    uncovered = layers * (1 - layout.recomputed_fraction(model.layers))
    if stack.eager_blocks:
        split = t if layout.sp else 1
        acts += in_flight(layout, m, stage) * uncovered * tokens * eager_saved_bytes(model, t, split, fp32)
    if plain:
        per_token, per_layer = autocast_fp32_weights(model, layout, stack.eager_blocks)
        acts += in_flight(layout, m, stage) * (layers * tokens * per_token + uncovered * per_layer)
    # A split backward keeps each weight's output gradient from I to W (plan/held.py).
    awaiting = awaiting_weight_grads(layout, m, stage)
    if awaiting:
        acts += awaiting * layers * tokens * weight_grad_inputs(model, layout, 4 if fp32 or plain else 2, 2 * width)
    logits = 0.0
    vocab_t = model.padded_vocab / t
    chunked = stack.fused_loss and t == 1
    predicted = tokens * model.predicted_fraction
    if output and chunked:  # the gradients the fused loss hands to backward, final norm input
        # Under FSDP the hidden states and the gathered weight are bf16 (fp16) and the loss
        # keeps their gradients so, the weight's in fp32 under fp16 (model/loss.py).
        h, x_bytes = model.hidden, 4 if fp32 or plain else 2
        w_bytes = 2 if x_bytes == 2 and shape.precision != "fp16" else 4
        logits = predicted * x_bytes * h + w_bytes * model.padded_vocab * h + tokens * 2 * width * h
    elif output:  # fp32 softmax kept for the loss's backward, final norm input
        logits = predicted * vocab_t * 4 + tokens * 2 * width * model.hidden
    logits *= output_in_flight(layout, m)  # one micro-batch's, but GPipe's and zero-bubble's wait
    # Transients, the largest one at a time: recomputing one layer's activations (full
    # checkpointing), bf16 logits and their fp32 gradient during the loss, the MLP's widest
    # intermediate; plus communication buffers.
    full_layer = width * tokens * activation_bytes_per_token(model, s, _no_recompute(layout), attention, stack)
    # The loss's logits and their gradient: the micro-batch's, or one chunk's (model/loss.py).
    # ember's vocabulary-parallel loss is PyTorch's cross-entropy under DTensor's
    # loss_parallel, which raises the peak by four fp32 copies of the (sharded) logits
    # (measured on CPU: 0.98 GiB for 4,096 tokens x 16,000 words per rank); Megatron-LM's
    # fused vocabulary-parallel cross-entropy works in place.
    rows = chunk_tokens(predicted, model.padded_vocab, model.hidden) if chunked else predicted
    per_logit = 16 if stack.fused_loss and not chunked else (8 if fp32 else 6)
    loss = rows * vocab_t * per_logit if output else 0.0
    widest = width * tokens * 2 * (2 if gated(model) else 1) * model.mlp_hidden / t
    # Recomputation rebuilds one layer at a time: all of it (full), or what the selective
    # policy did not keep.
    rebuilt = {"none": 0.0, "full": full_layer}.get(
        layout.recompute, full_layer - width * tokens * activation_bytes_per_token(model, s, layout, attention, stack))
    transient = max(rebuilt, loss, widest)
    if fp32:
        # ember's CPU optimizer is the unfused AdamW: it makes two temporaries the size of
        # each parameter in turn (fused AdamW on a GPU makes none). It runs once the
        # activations are gone, so it only counts where it exceeds them.
        largest = max(model.padded_vocab * model.hidden / t, model.hidden * model.mlp_hidden / t)
        step = 2 * 4 * largest / (shard if layout.zero >= 3 else 1)
        transient = max(transient, step - acts - logits)
    comm = BUCKET_BYTES if layout.dp * layout.cp > 1 else 0.0
    if layout.zero in (1, 2) and shard > 1 and stack.per_block_grads and not deferred:
        # Each block's gradients are made whole and reduce-scattered while the next block's
        # backward runs: two blocks' unsharded gradients at once.
        comm += 2 * layer_params(model) / t * grad_bytes
    if layout.zero >= 3 and not deferred:
        # Gathered weights and gradients: the current layer and the next (prefetched), or the
        # current layer and the embedding or output layer, FSDP groups of their own.
        layer = layer_params(model) / t
        vocab_group = model.padded_vocab * model.hidden / t if (embedding or output) else 0.0
        comm += (layer + max(layer, vocab_group)) * ((4 if fp32 else WEIGHT_BYTES) + grad_bytes)
    buffers = transient + comm
    # With one micro-batch on one stage nothing runs forward while gradients exist: backward
    # makes them as it frees the activations (unless DDP keeps them in its buckets).
    alone = m == 1 and layout.pp == 1 and not (layout.zero == 0 and layout.dp > 1)
    shared = min(grads, acts + logits) if stack.frees_grads and alone else 0.0
    held = weights + grads + optimizer + acts + logits + buffers - shared
    return Memory(weights, grads, optimizer, acts, logits, buffers, runtime, FRAGMENTATION * held,
                  stage, capacity, shared)


def _no_recompute(layout: Layout) -> Layout:
    return replace(layout, recompute="none")


def memory(model, layout: Layout, shape: TrainShape, gpu, grad_bytes: int = 2, attention: str = "flash",
           stack: Stack = MEGATRON) -> Memory:
    """Memory of the fullest GPU: every distinct pipeline rank is sized and the largest returned."""
    capacity = gpu.memory_gib * GIB * (1 - DRIVER_RESERVE)
    stages = set(pipeline_ranks(model, layout).values())
    if layout.schedule in ZERO_BUBBLE:  # later ranks can hold more (plan/held.py): size each
        stages = set(range(layout.pp))
    runtime = getattr(gpu, "runtime_gib", RUNTIME_BYTES / GIB) * GIB
    return max((stage_memory(model, layout, shape, i, grad_bytes, attention, capacity, runtime, stack)
                for i in stages),
               key=lambda mem: mem.total)
