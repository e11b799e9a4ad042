"""What eager PyTorch's composite ops cost beyond the fused kernels they stand for.

Without torch.compile (and without Megatron-Core's or Transformer Engine's fused kernels),
RMSNorm, the rotary embedding and a gated activation run as several PyTorch ops each, and
every op reads and writes its tensor through HBM, often in fp32. plan/timing.py prices a
block's elementwise work as fused kernels; a stack with `fused_elementwise` false
(`--stack fsdp-eager`: torchtitan without compile) adds what is below. LayerNorm and GELU
are one kernel in eager PyTorch too.
"""

from __future__ import annotations

from ember.cost import gated, kv_hidden

# Eager PyTorch's composites: bytes per element (forward, backward) and forward kernels; the
# fused kernels they stand for move (4, 6), (4, 6) and (6, 9) in one kernel each.
# RMSNorm (aten's composite before PyTorch's fused kernel of 2025, and Llama's reference
# module): cast to fp32 (2 + 4), square (4 + 4), mean (4), add eps and rsqrt (per row),
# scale (4 + 4), cast back (4 + 2), times the weight (2 + 2); autograd runs each op's
# backward and adds the two paths into the input's gradient.
EAGER_RMSNORM = (36, 66, 7)
# Rotary as a complex product (Llama's reference, torchtitan), per q and k element: cast to
# fp32 (2 + 4), complex multiply (4 + 4), cast back (4 + 2); backward the mirror image.
EAGER_ROTARY = (20, 20, 3)
# SwiGLU/GeGLU per element of the MLP width: the activation (2 + 2), the product (2 + 2 + 2);
# backward the product's two gradients and the activation's.
EAGER_GATE = (10, 18, 2)


def eager_elementwise(model, tp: int, split: int) -> tuple[float, float, int]:
    """What eager composites add to one block over fused kernels, per token: forward bytes,
    backward bytes, forward kernels. Only RMSNorm, rotary and gated activations have
    composites; LayerNorm and GELU are one kernel in eager PyTorch too. `split`: the norms'
    tokens are divided over tp ranks under sequence parallelism."""
    fwd = bwd = 0.0
    kernels = 0
    if model.norm == "rmsnorm":
        fwd += 2 * (EAGER_RMSNORM[0] - 4) * model.hidden / split
        bwd += 2 * (EAGER_RMSNORM[1] - 6) * model.hidden / split
        kernels += 2 * (EAGER_RMSNORM[2] - 1)
    if model.positions == "rotary":
        width = (model.hidden + kv_hidden(model)) / tp
        fwd += (EAGER_ROTARY[0] - 4) * width
        bwd += (EAGER_ROTARY[1] - 6) * width
        kernels += 2 * (EAGER_ROTARY[2] - 1)
    if gated(model):
        fwd += (EAGER_GATE[0] - 6) * model.mlp_hidden / tp
        bwd += (EAGER_GATE[1] - 9) * model.mlp_hidden / tp
        kernels += EAGER_GATE[2] - 1
    return fwd, bwd, kernels


def eager_saved_bytes(model, tp: int, split: int, fp32: bool) -> float:
    """Bytes per token a block keeps for backward beyond the fused kernels' count when its
    composites run eager and are not recomputed: each RMSNorm's normalised input beside its
    output (the weight multiply's backward needs it; fp32 even under autocast, where the
    composite computes), and a gated activation's output beside its input (the product's
    backward needs it). LayerNorm and GELU keep nothing more eager; rotary only its shared
    cos/sin tables. `split`: the norms' tokens over tp ranks under sequence parallelism."""
    saved = 0.0
    if model.norm == "rmsnorm":
        saved += 2 * 4 * model.hidden / split
    if gated(model):
        saved += (4 if fp32 else 2) * model.mlp_hidden / tp
    return saved
