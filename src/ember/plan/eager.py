"""What a block costs and keeps run as eager PyTorch runs it, beyond the fused kernels the
rest of the cost model stands for: composite ops, and autocast over fp32 weights.

Without torch.compile (and without Megatron-Core's or Transformer Engine's fused kernels),
RMSNorm, the rotary embedding and a gated activation run as several PyTorch ops each, and
every op reads and writes its tensor through HBM, often in fp32. plan/timing.py prices a
block's elementwise work as fused kernels; a stack with `fused_elementwise` false
(`--stack fsdp-eager`: torchtitan without compile) adds what is below. LayerNorm and GELU
are one kernel in eager PyTorch too.
"""

from __future__ import annotations

from ember.cost import gated, kv_hidden, matmul_params
from ember.layout import Layout, fuses_projections

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


def autocast_fp32_weights(model, layout: Layout, eager: bool) -> tuple[float, float]:
    """What one layer keeps beyond the count where ember's trainer autocasts over fp32
    weights (no FSDP to hold them in bf16: one device, DDP, tensor or pipeline parallelism
    without data parallelism): bytes per token and bytes per micro-batch. The residual
    stream stays fp32, so each residual the layer keeps (the block input, and the sum
    after attention unless recomputed) takes 2 bytes an element more. Eager, each
    projection that runs as its own nn.Linear also keeps its weight's bf16 copy until
    backward (compiled, the cast reruns instead); fused projections (q/k/v, gate/up) keep
    the fp32 weights they already have, except under tensor parallelism or a zero-bubble
    schedule, which turn fusion off; then each projection also casts and keeps its own
    bf16 copy of the shared fp32 input (three for q/k/v, two for gate/up, where the
    count has one each)."""
    h, f, t = model.hidden, model.mlp_hidden, layout.tp
    covered = layout.recomputed_fraction(model.layers)
    per_token = (covered + 2 * (1 - covered)) * 2 * h / (t if layout.sp else 1)
    if not eager:
        return per_token, 0.0
    if not fuses_projections(layout):
        alone = matmul_params(model)["layer"]
        per_token += (2 + (1 if gated(model) else 0)) * 2 * h
    else:
        alone = h * h + f * h * (1 if gated(model) else 2)  # attention output, down (and up)
    return per_token, 2 * alone / t
