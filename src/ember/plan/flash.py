"""Fused (flash) attention's time: measured for a shape where the profile has it, else its
FLOPs at a rate that depends on the shape.

FlashAttention's rate is `attn_eff` at head size 128 on long sequences, lower for short
ones (its 128-row blocks and per-block softmax rescaling are amortised over the sequence:
s/(s + 512)) and for small heads (d/(d + 24), normalised at d = 128): 0.5 of the
long-sequence rate at s = 512, 0.8 at 2k, 0.94 at 8k, and 0.86 at d = 64, roughly the shape
of the FlashAttention-2 paper's A100 curves. Causal attention computes half the s x s
square. The backward pass does 2.5x the forward FLOPs (it recomputes the scores). The curve
is a GPU's: a profile calibrated with `--model` holds the model's own shapes, timed
(plan/kernels.py), and those replace it (on a CPU, short sequences run at about twice the
rate the curve gives them).
"""

from __future__ import annotations

ATTN_SEQ = 512
ATTN_HEAD = 24
FLASH_BACKWARD = 2.5


def flash_efficiency(seq: int, head_dim: int, gpu) -> float:
    head = (head_dim / (head_dim + ATTN_HEAD)) / (128 / (128 + ATTN_HEAD))
    return min(1.0, gpu.attn_eff * seq / (seq + ATTN_SEQ) * head)  # never above the tensor-core peak


def flash_s(b: int, heads: int, s: int, d: int, causal: bool, gpu) -> float:
    """Seconds of one fused attention's forward and backward over `b` sequences of `s`
    tokens, `heads` heads of size `d`: measured for this shape if the profile has it
    (`ember plan calibrate --model`), else the FLOPs at the shape's flash efficiency."""
    if gpu.attention_times is not None:
        measured = gpu.attention_times.get(b, heads, s, d, int(causal))
        if measured is not None:
            return measured
    flops = 4.0 * b * heads * s * s * d * (0.5 if causal else 1.0)
    return (1 + FLASH_BACKWARD) * flops / (gpu.peak_bf16_flops * flash_efficiency(s, d, gpu))
