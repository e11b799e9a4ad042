"""How long the work of one micro-batch takes on one GPU: matmuls at a shape-dependent
efficiency, attention, memory-bound elementwise work, and tensor-parallel communication.

Matmul efficiency. A GEMM of an [M, K] by a [K, N] matrix is cut into output tiles that the
GPU's streaming multiprocessors (SMs) work through in waves, one tile per SM at a time. The
tile is 256 x 128: the kernels cuBLAS picks for the large bf16 GEMMs of training are
`ampere_bf16_s16816gemm_bf16_256x128_...` on A100 and `sm90_xmma_gemm_..._tilesize128x256x64`
on H100 (the names profiles of Megatron-LM show; CUTLASS's default SM80 tensor-op tile is
the same size). The last wave is on average half empty, so with w = tiles / SMs waves the SMs
are busy w / (w + 1/2) of the time. Each tile also pays a fixed prologue and epilogue
(filling its operand pipeline, writing its output), about k0 = 64 steps of its K loop on an
A100, so the main loop runs K / (K + k0) of the time. They wait on memory where a K step is
tensor-core work, so k0 grows with FLOPs per byte of HBM: 64 · max(1, balance / A100's), 123
on an H100 SXM (989 TFLOP/s over 3.35 TB/s), twice that in FP8; no public run goes below an
A100's balance (V100; CPUs, where tiles are not the picture). Times the best efficiency
measured on the GPU (`matmul_eff`, see hardware.py):

    eff(M, N, K) = matmul_eff · w/(w + 0.5) · K/(K + k0),  w = M·N / (256·128 · SMs)

A smooth function of the dimensions after tensor-parallel splits: on an A100 an [8192,
8192] x [8192, 8192] matmul runs at 0.83 of peak, an [8192, 4096] x [4096, 512] one (a
layer split 8 ways: 1.2 waves) at 0.60, a [512, 128] x [128, 512] one at 0.07. For small
matmuls cuBLAS switches to smaller tiles, which fill the SMs better at a lower rate per
tile; the model keeps the large tile, so it is pessimistic there.
A skinny matmul is also bounded by moving its operands; the two bounds combine as a soft
maximum, (t_compute³ + t_memory³)^(1/3). One too skinny for the tiles (a matrix-vector
product) may instead run untiled on the CUDA cores at 1/16 of the tensor-core peak; the
faster of the two is taken.

Attention. Fused (flash) attention is priced in plan/flash.py. The unfused path (before FlashAttention)
runs Q·Kᵀ and P·V as batched GEMMs and moves the s x s scores through HBM for the softmax
and its dropout. Megatron-LM's fused scale-mask-softmax kernel reads and writes the 2-byte
scores once; it exists only for some shapes (`fused_softmax`), and elsewhere Megatron falls
back to five PyTorch kernels in fp32: cast, scale, mask, softmax, cast back.

Elementwise work (norms, residual adds, activation functions, dropout, rotary embedding,
the loss, the embedding lookup and its dense gradient) is priced by bytes moved at `hbm_eff`
of the HBM bandwidth; its backward moves about 1.5x the forward's bytes (it reads the saved
input and the incoming gradient). Activations are 2-byte (bf16 autocast); `width` = 2 prices
a run without autocast (fp32, as on a CPU): every activation byte count doubles, in memory
traffic and in tensor-parallel messages alike.

FP8. With `fp8` the four weight matmuls of every block run in FP8 as Transformer Engine and
torchao's float8 training run them (tensor-wise scales; forward, input gradient and weight
gradient all in FP8), at twice the bf16 peak on GPUs that have it; the attention core, the
output layer and everything else stay bf16. A K step of the tile's main loop then takes
half as long while its prologue and epilogue (loading, writing the bf16 output) do not, so
the fixed cost is 2 x k0 K steps; operands move 1 byte per element. Each matmul's input is
cast forward and its output gradient backward: read in bf16, written in FP8 and FP8
transposed (Hopper's FP8 GEMMs take only the TN layout), 4 bytes per element, one kernel
each. The weights' casts are paid once per step (plan/predict.py).

Eager composites. Where the software runs RMSNorm, the rotary embedding and the gated
activation as eager PyTorch's composites instead of one kernel each (Stack.fused_elementwise
false: torchtitan without torch.compile), each passes fp32 intermediates through memory
(plan/eager.py): about 9x the fused norm's bytes, 5x the rotary's, 1.7x the gate's.

Kernel launches. Every kernel leaves the GPU idle for about KERNEL_S = 3 µs beyond its work:
the launch itself (~1 µs when launches are queued ahead, NVIDIA's "Getting Started with CUDA
Graphs") and the ramp-up and tail of its grid, more when PyTorch's eager dispatch (several
µs per op) cannot run ahead of small kernels. Negligible for large layers, dominant for tiny
ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ember.plan import comm, overlap
from ember.plan.flash import FLASH_BACKWARD, flash_s
from ember.plan.eager import eager_elementwise
from ember.cost import gated, kv_hidden, layer_matmuls

TILE_M, TILE_N = 256, 128
SIMT_RATIO = 16  # bf16 tensor-core peak over fp32 CUDA-core FMA peak: A100 312/19.5, H100 989/67
K_OVERHEAD = 64  # K steps of a tile's prologue and epilogue on an A100
A100_FLOPS_PER_BYTE = 312e12 / 2039e9  # bf16 peak over HBM bandwidth, where K_OVERHEAD was read
WAVE_TAIL = 0.5
BACKWARD_BYTES = 1.5
KERNEL_S = 3e-6
BACKWARD_KERNELS = 2
LOSS_FWD_BYTES = 38
LOSS_BWD_BYTES = 14
LOSS_KERNELS = (9, 6)
EMBED_KERNELS = (1, 5)
UNFUSED_SOFTMAX_BYTES = (36, 40)  # forward, backward, per score element (see _attention_core)
UNFUSED_SOFTMAX_KERNELS = 5
FP8_SPEEDUP = 2  # FP8 tensor-core peak over bf16 (hardware.py: GPU.fp8)
FP8_CAST_BYTES = 4  # per element cast: bf16 read (2), FP8 and FP8-transposed written (1 + 1)
FP8_CAST_KERNELS = 4  # one cast per weight matmul's input (forward) or output gradient (backward)


def k_overhead(gpu, fp8: bool = False) -> float:  # a tile's fixed cost in K steps (module docstring)
    balance = gpu.peak_bf16_flops * (FP8_SPEEDUP if fp8 else 1) / (gpu.hbm_gbps * 1e9)
    return K_OVERHEAD * max(1.0, balance / A100_FLOPS_PER_BYTE)


def matmul_efficiency(m: float, n: float, k: float, gpu, batch: int = 1, fp8: bool = False) -> float:
    waves = batch * m * n / (TILE_M * TILE_N * gpu.sms)
    return gpu.matmul_eff * waves / (waves + WAVE_TAIL) * k / (k + k_overhead(gpu, fp8))


def matmul_s(m: float, n: float, k: float, gpu, batch: int = 1, fp8: bool = False) -> float:
    if gpu.matmul_times is not None and not fp8:  # measured on this GPU (`ember plan calibrate --model`)
        measured = gpu.matmul_times.get(m, n, k, batch)
        if measured is not None:
            return measured
    flops = 2.0 * m * n * k * batch
    operand = 1.0 if fp8 else 2.0
    memory = memory_s(batch * (operand * (m * k + k * n) + 2.0 * m * n), gpu)
    peak = gpu.peak_bf16_flops * (FP8_SPEEDUP if fp8 else 1)
    tiled = flops / (peak * matmul_efficiency(m, n, k, gpu, batch, fp8))
    # A matmul too skinny to fill the SMs with tiles runs as a matrix-vector kernel on the
    # CUDA cores instead (cuBLAS's GEMV and split-K paths): no tile tail, a lower rate.
    untiled = flops / (gpu.peak_bf16_flops / SIMT_RATIO)
    return min((tiled**3 + memory**3) ** (1 / 3), (untiled**3 + memory**3) ** (1 / 3))


def memory_s(nbytes: float, gpu) -> float:
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_eff)


@dataclass(frozen=True)
class Work:
    """Seconds of one pass over a layer (or a stage), by kind."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0  # tensor- and context-parallel communication left exposed
    launch: float = 0.0  # the GPU idles between kernels: KERNEL_S per compute kernel

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.elementwise + self.launch

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm

    def __add__(self, other: "Work") -> "Work":
        return Work(self.matmul + other.matmul, self.attention + other.attention,
                    self.elementwise + other.elementwise, self.tp_comm + other.tp_comm,
                    self.launch + other.launch)

    def __mul__(self, k: float) -> "Work":
        return Work(self.matmul * k, self.attention * k, self.elementwise * k, self.tp_comm * k,
                    self.launch * k)


@dataclass(frozen=True)
class LayerTimes:
    forward: Work
    backward: Work
    recompute: Work  # what checkpointing reruns before the backward pass

    def scaled_elementwise(self, k: float) -> "LayerTimes":
        if k == 1.0:
            return self
        return LayerTimes(*(replace(w, elementwise=w.elementwise * k) for w in (self.forward, self.backward,
                                                                               self.recompute)))


def fused_softmax(model, b: int, s: int, t: int) -> bool:
    """Whether Megatron-LM's fused scale-mask-softmax kernel takes a micro-batch of `b`
    sequences of `s` tokens with the heads split `t` ways (FusedScaleMaskSoftmax.
    is_kernel_available): 16 < s <= 4096, s a multiple of 4, and the b x heads/t score
    matrices a multiple of 4 and of the kernel's batches per block (a causal mask), or s a
    multiple of that (a padding mask). A 16-head model at tp=8 and micro-batch 1 falls back."""
    batches = b * model.heads // t
    if not (16 < s <= 4096 and s % 4 == 0 and batches % 4 == 0):
        return False
    width = 1 << (s - 1).bit_length()  # the kernel's per-row width: the next power of two
    per_block = (128 // min(width, 32)) * (2 if width <= 128 else 1)
    return (batches if model.causal else s) % per_block == 0


def _attention_core(model, b: int, s: int, t: int, gpu, attention: str, width: int = 1) -> tuple[Work, Work]:
    """Forward and backward of softmax(Q·Kᵀ)·V for one micro-batch on one GPU."""
    heads, d = model.heads // t, model.head_dim
    if attention == "flash":
        fwd = flash_s(b, heads, s, d, model.causal, gpu) / (1 + FLASH_BACKWARD)
        return Work(attention=fwd), Work(attention=FLASH_BACKWARD * fwd)
    n = b * heads
    scores = matmul_s(s, s, d, gpu, n)  # Q·Kᵀ; P·V has the same FLOPs with K = s
    values = matmul_s(s, d, s, gpu, n)
    mask = 1 if model.dropout else 0
    elems = n * s * s
    # Fused: the 2-byte scores in and probabilities out (backward: probabilities and gradient
    # in, gradient out). Fallback, in fp32: cast (2 + 4), scale (4 + 4), mask (4 + 4), softmax
    # (4 + 4), cast back (4 + 2); backward about as much again. Dropout: in, out, mask.
    softmax_fwd, softmax_bwd = (4, 6) if fused_softmax(model, b, s, t) else UNFUSED_SOFTMAX_BYTES
    fwd_bytes = elems * (softmax_fwd + 5 * mask) * width
    bwd_bytes = elems * (softmax_bwd + 5 * mask) * width
    fwd = Work(matmul=scores + values, elementwise=memory_s(fwd_bytes, gpu))
    bwd = Work(matmul=2 * (scores + values), elementwise=memory_s(bwd_bytes, gpu))
    return fwd, bwd


@lru_cache(maxsize=4096)
def layer_times(model, gpu, links, seq: int, mbs: int, tp: int, sp: bool, recompute: str,
                attention: str, width: int = 1, fp8: bool = False, tp_overlap: bool = False,
                cp: int = 1, fused_elementwise: bool = True) -> LayerTimes:
    """One transformer block's forward, backward and recomputation for one micro-batch;
    `width` 2: 4-byte activations (no autocast); `fp8`: the weight matmuls in FP8;
    `tp_overlap`: sequence parallelism's collectives run beside the weight matmuls
    (Stack.overlap_tp_comm), priced as any overlapped communication (plan/overlap.py);
    `cp`: the sequence split over cp ranks (`_context_parallel`); `fused_elementwise`
    false: eager composites (`eager_elementwise`)."""
    tokens = mbs * seq / cp
    h, f = model.hidden, model.mlp_hidden
    fwd_mm = bwd_mm = cast_fwd = cast_bwd = 0.0
    per_matmul = []  # (name, forward, backward) of each weight matmul
    for name, (k, n) in layer_matmuls(model).items():
        if name in ("qkv", "up"):
            n = n / tp  # column parallel: the output is split
        else:
            k = k / tp  # row parallel: the input is split
        per_matmul.append((name, matmul_s(tokens, n, k, gpu, fp8=fp8),
                           matmul_s(tokens, k, n, gpu, fp8=fp8) + matmul_s(k, n, tokens, gpu, fp8=fp8)))
        fwd_mm += per_matmul[-1][1]
        bwd_mm += per_matmul[-1][2]  # input grad, weight grad
        if fp8:
            cast_fwd += memory_s(tokens * k * FP8_CAST_BYTES, gpu)
            cast_bwd += memory_s(tokens * n * FP8_CAST_BYTES, gpu)
    core_fwd, core_bwd = _attention_core(model, mbs, seq, tp, gpu, attention, width)
    cp_fwd = cp_bwd = 0.0
    if cp > 1:
        core_fwd, core_bwd, cp_fwd, cp_bwd = _context_parallel(model, links, mbs, seq, tp, cp, width,
                                                               core_fwd, core_bwd)

    mask = 1 if model.dropout else 0
    split = tp if sp else 1
    per_token = (8 * h + (12 + 2 * mask) * h) / split  # two norms; two residual adds with dropout
    per_token += (6 if gated(model) else 4) * f / tp  # the activation function
    if model.positions == "rotary":
        per_token += 4 * (h + kv_hidden(model)) / tp
    elem_fwd = memory_s(tokens * per_token * width, gpu)
    elem_bwd = BACKWARD_BYTES * elem_fwd
    if not fused_elementwise:
        eager_fwd, eager_bwd, _ = eager_elementwise(model, tp, split)
        elem_fwd += memory_s(tokens * eager_fwd * width, gpu)
        elem_bwd += memory_s(tokens * eager_bwd * width, gpu)

    tp_fwd = tp_bwd = gathers = 0.0
    if tp > 1:  # two all-reduces, or with sequence parallelism two all-gathers + two reduce-scatters
        group = comm.place(tp, 1, links.gpus_per_node)
        activation = tokens * h * 2 * width
        if sp:
            gathers = 2 * comm.all_gather_s(activation, group, links)
            tp_fwd = gathers + 2 * comm.reduce_scatter_s(activation, group, links)
        else:
            tp_fwd = 2 * comm.all_reduce_s(activation, group, links)
        tp_bwd = tp_fwd
        if sp and tp_overlap:
            # Each weight matmul hides one collective of its pass, its all-gathered input or
            # the reduce-scatter of its output (forward; backward the mirror image), fed in
            # tp chunks: the first chunk's transfer (or the last's) stays exposed.
            each = tp_fwd / len(per_matmul)
            hidden = {name: overlap.hidden_cost(each, fwd, each / tp) for name, fwd, _ in per_matmul}
            tp_fwd = sum(hidden.values())
            tp_bwd = sum(overlap.hidden_cost(each, bwd, each / tp) for _, _, bwd in per_matmul)
            gathers = hidden["qkv"] + hidden["up"]  # the column-parallel matmuls take the gathered inputs

    softmax_fused = fused_softmax(model, mbs, seq, tp)
    core_kernels = core_kernel_count(model, attention, softmax_fused)
    kernels = layer_kernel_count(model, attention, softmax_fused, fp8, fused_elementwise)
    forward = Work(matmul=fwd_mm, elementwise=elem_fwd + cast_fwd, tp_comm=tp_fwd + cp_fwd,
                   launch=kernels * KERNEL_S) + core_fwd
    backward = Work(matmul=bwd_mm, elementwise=elem_bwd + cast_bwd, tp_comm=tp_bwd + cp_bwd,
                    launch=BACKWARD_KERNELS * kernels * KERNEL_S) + core_bwd
    if recompute == "full":
        again = forward
    elif recompute == "selective-half-matmul":
        # Every other matmul and the elementwise forward; its save list keeps reduce-scatter
        # outputs but not all-gathers, so sequence parallelism's two gathers run again.
        again = Work(matmul=fwd_mm / 2, elementwise=elem_fwd, tp_comm=gathers,
                     launch=(kernels - core_kernels) * KERNEL_S)
    elif recompute == "selective-attention":
        again = core_fwd + Work(launch=core_kernels * KERNEL_S)
    elif recompute == "selective":  # norms, activations, rotary: the elementwise forward
        again = Work(elementwise=elem_fwd, launch=(kernels - core_kernels) * KERNEL_S)
    else:
        again = Work()
    return LayerTimes(forward, backward, again)


def _context_parallel(model, links, mbs: int, seq: int, tp: int, cp: int, width: int,
                      core_fwd: Work, core_bwd: Work) -> tuple[Work, Work, float, float]:
    """Ring attention over cp ranks (Megatron-Core/Transformer Engine's P2P context
    parallelism, torchtitan's ring attention): each rank holds two of the sequence's 2·cp
    chunks, so causal attention's work is shared evenly and each rank does 1/cp of it, and
    in cp − 1 steps it passes its key and value blocks to the next rank while it attends to
    the ones it holds. The backward pass sends them again with their gradients (twice the
    bytes). The sends hide behind the attention they run beside (plan/overlap.py); the cp
    group's link is the rank mapping's (plan/comm.py: cp next to tp)."""
    group = comm.place(cp, tp, links.gpus_per_node)
    blocks = 2 * mbs * (seq / cp) * kv_hidden(model) / tp * 2 * width  # K and V, bf16
    ring = (cp - 1) * comm.p2p_s(blocks, group, links)
    fwd, bwd = core_fwd * (1 / cp), core_bwd * (1 / cp)
    return (fwd, bwd, overlap.hidden_cost(ring, fwd.compute),
            overlap.hidden_cost(2 * ring, bwd.compute))


def core_kernel_count(model, attention: str, softmax_fused: bool = True) -> int:
    """Kernels of the attention core's forward: one fused kernel, or Q·Kᵀ, the softmax (one
    fused kernel or the five of the fallback), the dropout of the probabilities and P·V."""
    if attention == "flash":
        return 1
    return 2 + (1 if softmax_fused else UNFUSED_SOFTMAX_KERNELS) + (1 if model.dropout else 0)


def layer_kernel_count(model, attention: str, softmax_fused: bool = True, fp8: bool = False,
                       fused_elementwise: bool = True) -> int:
    """Compute kernels of one block's forward as fused training stacks launch them: two norms,
    four weight matmuls (gate and up are one), the activation, two fused bias-dropout-residual
    adds, the rotary embedding of Q and K, and the attention core; in FP8, a cast before each
    weight matmul; eager composites add theirs (`eager_elementwise`). Its backward launches
    about twice as many (input and weight gradient of every matmul, two passes per norm)."""
    rotary = 2 if model.positions == "rotary" else 0
    casts = FP8_CAST_KERNELS if fp8 else 0
    eager = 0 if fused_elementwise else eager_elementwise(model, 1, 1)[2]
    return 2 + 4 + 1 + 2 + rotary + casts + eager + core_kernel_count(model, attention, softmax_fused)


@lru_cache(maxsize=4096)
def head_times(model, gpu, links, seq: int, mbs: int, tp: int, sp: bool, width: int = 1,
               loss_bytes: tuple = (LOSS_FWD_BYTES, LOSS_BWD_BYTES)) -> tuple[Work, Work]:
    """The last stage's extra work: final norm, output projection and the loss.

    The loss is a vocabulary-parallel cross-entropy over fp32 logits as Megatron-LM writes it
    (tensor_parallel/cross_entropy.py; ember's F.cross_entropy on `logits.float()` moves about
    as much): forward casts the bf16 logits to fp32 (2 + 4 bytes per logit), takes the max
    (4), subtracts it (4 + 4), exponentiates in place (4 + 4), sums (4) and normalises in place
    (4 + 4): 38 bytes; backward scales the saved softmax by the incoming gradient (4 + 4) and
    casts it back to bf16 (4 + 2): 14 bytes (`loss_bytes`: a stack's own, e.g. a fused loss
    that reads the bf16 logits once and writes their gradient once, 2 and 4). With tensor
    parallelism the output layer's input is all-gathered (sequence parallel) and its gradient
    reduce-scattered, or, without SP, its input gradient all-reduced; the loss all-reduces
    three per-token fp32 scalars (max, target logit, sum of exponentials)."""
    tokens = mbs * seq
    predicted = tokens * model.predicted_fraction
    h, vocab = model.hidden, model.padded_vocab / tp
    fwd_mm = matmul_s(predicted, vocab, h, gpu)
    bwd_mm = matmul_s(predicted, h, vocab, gpu) + matmul_s(h, vocab, predicted, gpu)
    norm = memory_s(tokens * 4 * h * width / (tp if sp else 1), gpu)
    loss_fwd = memory_s(predicted * vocab * loss_bytes[0], gpu)
    loss_bwd = memory_s(predicted * vocab * loss_bytes[1], gpu)
    comm_fwd = comm_bwd = 0.0
    if tp > 1:
        group = comm.place(tp, 1, links.gpus_per_node)
        activation = tokens * h * 2 * width
        if sp:
            comm_fwd = comm.all_gather_s(activation, group, links)
            comm_bwd = comm.reduce_scatter_s(activation, group, links)
        else:
            comm_bwd = comm.all_reduce_s(activation, group, links)
        comm_fwd += 3 * comm.all_reduce_s(tokens * 4, group, links)
    kernels_fwd, kernels_bwd = LOSS_KERNELS
    return (Work(matmul=fwd_mm, elementwise=norm + loss_fwd, tp_comm=comm_fwd, launch=kernels_fwd * KERNEL_S),
            Work(matmul=bwd_mm, elementwise=BACKWARD_BYTES * norm + loss_bwd, tp_comm=comm_bwd,
                 launch=kernels_bwd * KERNEL_S))


@lru_cache(maxsize=4096)
def embed_times(model, gpu, links, seq: int, mbs: int, tp: int, sp: bool, width: int = 1) -> tuple[Work, Work]:
    """The first stage's extra work: the embedding lookup and its gradient.

    Forward gathers a row of h per token (read and written, bf16; a dropout reads, writes and
    keeps a mask). The vocabulary-parallel embedding then sums the ranks' partial lookups: an
    all-reduce, or a reduce-scatter with sequence parallelism. Backward writes a dense
    gradient of the whole local table (PyTorch's embedding backward zero-fills it and adds
    the token rows), which then waits to be accumulated like any other weight gradient; with
    sequence parallelism the output gradient is first all-gathered."""
    tokens = mbs * seq
    h, rows = model.hidden, model.padded_vocab / tp
    split = tp if sp else 1
    lookup = (tokens * h * 4 + (tokens * h * 5 / split if model.dropout else 0.0)) * width
    dense = (rows * h * 2 + tokens * h * 4) * width
    comm_fwd = comm_bwd = 0.0
    if tp > 1:
        group = comm.place(tp, 1, links.gpus_per_node)
        activation = tokens * h * 2 * width
        if sp:
            comm_fwd = comm.reduce_scatter_s(activation, group, links)
            comm_bwd = comm.all_gather_s(activation, group, links)
        else:
            comm_fwd = comm.all_reduce_s(activation, group, links)
    kernels_fwd, kernels_bwd = EMBED_KERNELS
    return (Work(elementwise=memory_s(lookup, gpu), tp_comm=comm_fwd, launch=kernels_fwd * KERNEL_S),
            Work(elementwise=memory_s(dense, gpu), tp_comm=comm_bwd, launch=kernels_bwd * KERNEL_S))
