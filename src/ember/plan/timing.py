"""How long the work of one micro-batch takes on one GPU: matmuls at a shape-dependent
efficiency, attention, memory-bound elementwise work, and tensor-parallel communication.

Matmul efficiency. A GEMM of an [M, K] by a [K, N] matrix is cut into 128 x 128 output
tiles that the GPU's streaming multiprocessors (SMs) work through in waves; the last wave
is on average half empty, so with w = tiles / SMs waves the SMs are busy w / (w + 1/2) of
the time. Each tile also pays a fixed prologue and epilogue, about 64 steps of its K loop,
so the main loop runs K / (K + 64) of the time. Times the best efficiency measured on the
GPU (`matmul_eff`, see hardware.py):

    eff(M, N, K) = matmul_eff · w/(w + 0.5) · K/(K + 64),  w = M·N / (128² · SMs)

A smooth function of the dimensions after tensor-parallel splits: on an A100 an [8192,
8192] x [8192, 8192] matmul runs at 0.84 of peak, an [8192, 4096] x [4096, 512] one (a
layer split 8 ways: 2.4 waves) at 0.70, a [512, 128] x [128, 512] one at 0.13.
A skinny matmul is also bounded by moving its operands; the two bounds combine as a soft
maximum, (t_compute³ + t_memory³)^(1/3).

Attention. FlashAttention's rate is `attn_eff` at head size 128 on long sequences, lower
for short ones (its 128-row blocks and per-block softmax rescaling are amortised over the
sequence: s/(s + 512)) and for small heads (d/(d + 24), normalised at d = 128): 0.5 of
the long-sequence rate at s = 512, 0.8 at 2k, 0.94 at 8k, and 0.86 at d = 64, roughly the
shape of the FlashAttention-2 paper's A100 curves. Causal attention computes half the
s x s square. The backward pass does
2.5x the forward FLOPs (it recomputes the scores). The unfused path (before FlashAttention)
runs Q·Kᵀ and P·V as batched GEMMs and moves the s x s scores through HBM for the softmax
and its dropout.

Elementwise work (norms, residual adds, activation functions, dropout, rotary embedding,
the loss) is priced by bytes moved at `hbm_eff` of the HBM bandwidth; its backward moves
about 1.5x the forward's bytes (it reads the saved input and the incoming gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ember.plan import comm
from ember.plan.cost import gated, kv_hidden, layer_matmuls

TILE = 128
K_OVERHEAD = 64
WAVE_TAIL = 0.5
ATTN_SEQ = 512
ATTN_HEAD = 24
BACKWARD_BYTES = 1.5
FLASH_BACKWARD = 2.5


def matmul_efficiency(m: float, n: float, k: float, gpu, batch: int = 1) -> float:
    waves = batch * m * n / (TILE * TILE * gpu.sms)
    return gpu.matmul_eff * waves / (waves + WAVE_TAIL) * k / (k + K_OVERHEAD)


def matmul_s(m: float, n: float, k: float, gpu, batch: int = 1) -> float:
    compute = 2.0 * m * n * k * batch / (gpu.peak_bf16_flops * matmul_efficiency(m, n, k, gpu, batch))
    memory = memory_s(2.0 * batch * (m * k + k * n + m * n), gpu)
    return (compute**3 + memory**3) ** (1 / 3)


def memory_s(nbytes: float, gpu) -> float:
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_eff)


def flash_efficiency(seq: int, head_dim: int, gpu) -> float:
    head = (head_dim / (head_dim + ATTN_HEAD)) / (128 / (128 + ATTN_HEAD))
    return gpu.attn_eff * seq / (seq + ATTN_SEQ) * head


@dataclass(frozen=True)
class Work:
    """Seconds of one pass over a layer (or a stage), by kind."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.elementwise

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm

    def __add__(self, other: "Work") -> "Work":
        return Work(self.matmul + other.matmul, self.attention + other.attention,
                    self.elementwise + other.elementwise, self.tp_comm + other.tp_comm)

    def __mul__(self, k: float) -> "Work":
        return Work(self.matmul * k, self.attention * k, self.elementwise * k, self.tp_comm * k)


@dataclass(frozen=True)
class LayerTimes:
    forward: Work
    backward: Work
    recompute: Work  # what checkpointing reruns before the backward pass


def _attention_core(model, b: int, s: int, t: int, gpu, attention: str) -> tuple[Work, Work]:
    """Forward and backward of softmax(Q·Kᵀ)·V for one micro-batch on one GPU."""
    heads, d = model.heads // t, model.head_dim
    if attention == "flash":
        flops = 4.0 * b * heads * s * s * d * (0.5 if model.causal else 1.0)
        fwd = flops / (gpu.peak_bf16_flops * flash_efficiency(s, d, gpu))
        return Work(attention=fwd), Work(attention=FLASH_BACKWARD * fwd)
    n = b * heads
    scores = matmul_s(s, s, d, gpu, n)  # Q·Kᵀ; P·V has the same FLOPs with K = s
    values = matmul_s(s, d, s, gpu, n)
    mask = 1 if model.dropout else 0
    elems = n * s * s
    fwd_bytes = elems * (4 + 5 * mask)  # scale-mask-softmax in and out; dropout in, out, mask
    bwd_bytes = elems * (6 + 5 * mask)
    fwd = Work(matmul=scores + values, elementwise=memory_s(fwd_bytes, gpu))
    bwd = Work(matmul=2 * (scores + values), elementwise=memory_s(bwd_bytes, gpu))
    return fwd, bwd


@lru_cache(maxsize=4096)
def layer_times(model, gpu, links, seq: int, mbs: int, tp: int, sp: bool, recompute: str,
                attention: str) -> LayerTimes:
    """One transformer block's forward, backward and recomputation for one micro-batch."""
    tokens = mbs * seq
    h, f = model.hidden, model.mlp_hidden
    fwd_mm = bwd_mm = 0.0
    for name, (k, n) in layer_matmuls(model).items():
        if name in ("qkv", "up"):
            n = n / tp  # column parallel: the output is split
        else:
            k = k / tp  # row parallel: the input is split
        fwd_mm += matmul_s(tokens, n, k, gpu)
        bwd_mm += matmul_s(tokens, k, n, gpu) + matmul_s(k, n, tokens, gpu)  # input grad, weight grad
    core_fwd, core_bwd = _attention_core(model, mbs, seq, tp, gpu, attention)

    mask = 1 if model.dropout else 0
    split = tp if sp else 1
    per_token = (8 * h + (12 + 2 * mask) * h) / split  # two norms; two residual adds with dropout
    per_token += (6 if gated(model) else 4) * f / tp  # the activation function
    if model.positions == "rotary":
        per_token += 4 * (h + kv_hidden(model)) / tp
    elem_fwd = memory_s(tokens * per_token, gpu)

    tp_fwd = 0.0
    if tp > 1:  # two all-reduces, or with sequence parallelism two all-gathers + two reduce-scatters
        group = comm.place(tp, 1, links.gpus_per_node)
        activation = tokens * h * 2
        if sp:
            tp_fwd = 2 * (comm.all_gather_s(activation, group, links) + comm.reduce_scatter_s(activation, group, links))
        else:
            tp_fwd = 2 * comm.all_reduce_s(activation, group, links)

    forward = Work(matmul=fwd_mm, elementwise=elem_fwd, tp_comm=tp_fwd) + core_fwd
    backward = Work(matmul=bwd_mm, elementwise=BACKWARD_BYTES * elem_fwd, tp_comm=tp_fwd) + core_bwd
    if recompute == "full":
        again = forward
    elif recompute == "selective":
        again = core_fwd
    else:
        again = Work()
    return LayerTimes(forward, backward, again)


@lru_cache(maxsize=4096)
def head_times(model, gpu, seq: int, mbs: int, tp: int, sp: bool) -> tuple[Work, Work]:
    """The last stage's extra work: final norm, output projection and the loss (fp32
    softmax over the vocabulary: bf16 logits in, fp32 out, max/sum passes; its backward
    writes the bf16 gradient). The first stage's embedding lookup is a gather of
    tokens x h, negligible beside a block, and is left out."""
    tokens = mbs * seq
    predicted = tokens * model.predicted_fraction
    h, vocab = model.hidden, model.padded_vocab / tp
    fwd_mm = matmul_s(predicted, vocab, h, gpu)
    bwd_mm = matmul_s(predicted, h, vocab, gpu) + matmul_s(h, vocab, predicted, gpu)
    norm = memory_s(tokens * 4 * h / (tp if sp else 1), gpu)
    loss_fwd = memory_s(predicted * vocab * (2 + 4 + 8), gpu)
    loss_bwd = memory_s(predicted * vocab * (4 + 2), gpu)
    return (Work(matmul=fwd_mm, elementwise=norm + loss_fwd),
            Work(matmul=bwd_mm, elementwise=BACKWARD_BYTES * norm + loss_bwd))
