"""Model FLOPs: the one cost model that the trainer's MFU and the planner both call.

Derivation. A matmul of an [n, k] input with a [k, m] weight costs 2·n·k·m FLOPs (a
multiply and an add per term), i.e. 2 FLOPs per weight per token in the forward pass. The
backward pass costs twice that: one matmul for the gradient of the input and one for the
gradient of the weight. A training step therefore costs 6 FLOPs per matmul weight per token
it is applied to (3x forward). Per token of a sequence of length s:

- every block's projections (q, k, v, o and the MLP's up, gate, down) see every token:
  6 · L · (4h² + k·h·m), k = 2 for GELU, 3 for gated (GeGLU, SwiGLU);
- the output projection (h × padded vocab) sees every token of a causal LM, but only the
  masked tokens of a sparse-prediction masked LM: 6 · h · V · predicted_fraction;
- attention scores Q·Kᵀ and the weighted sum P·V are two matmuls of 2·s·h FLOPs per token
  and layer in the forward pass, 4·s·h, so 12 · L · h · s per token for a training step.
  This counts the full s × s square also for causal attention, as PyTorch's FLOP counter
  does and as Megatron-LM's and PaLM's MFU conventions do, though a causal kernel can skip
  half of it.

Excluded, by definition: embedding lookups (not matmuls), biases, norms, activations,
softmax, the loss, and recomputation (that is hardware FLOPs, not model FLOPs);
`recompute_flops_per_token` adds the last for hardware-FLOPs utilisation.

The functions take a `ModelConfig` or anything with the same shape fields (the planner's
`ModelSpec`). A shape with `kv_heads` below `heads` (grouped-query attention) has smaller
key and value projections: 2h² + 2·h·h_kv attention weights, h_kv = h·kv_heads/heads.
"""

from __future__ import annotations

import math
from typing import Protocol


class ModelShape(Protocol):
    """What the cost model reads of a model (`ModelConfig`, `ModelSpec`)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int  # 0 = heads
    mlp_hidden: int
    activation: str

    @property
    def padded_vocab(self) -> int: ...


def kv_hidden(cfg: ModelShape) -> int:
    """Width of the key (and of the value) projection: `hidden` unless heads are grouped."""
    return cfg.hidden * (cfg.kv_heads or cfg.heads) // cfg.heads


def gated(cfg: ModelShape) -> bool:
    return cfg.activation in ("geglu", "swiglu")


def matmul_params(cfg: ModelShape) -> dict[str, int]:
    """Weights used in matmuls: per layer (`attention`, `mlp`, `layer`), all layers together
    (`layers`) and the output projection (`output`, hidden × padded vocabulary, counted
    also when tied to the embedding: tying shares storage, not compute)."""
    h = cfg.hidden
    attention = 2 * h * h + 2 * h * kv_hidden(cfg)
    mlp = (3 if gated(cfg) else 2) * h * cfg.mlp_hidden
    return {
        "attention": attention,
        "mlp": mlp,
        "layer": attention + mlp,
        "layers": cfg.layers * (attention + mlp),
        "output": h * cfg.padded_vocab,
    }


def block_forward_flops_per_token(cfg: ModelShape, seq_len: int) -> float:
    """Forward-pass FLOPs per token of one block: its projections and its attention."""
    return 2.0 * matmul_params(cfg)["layer"] + 4.0 * cfg.hidden * seq_len


def output_forward_flops_per_token(cfg: ModelShape, predicted_fraction: float = 1.0) -> float:
    """Forward-pass FLOPs per input token of the output projection."""
    return 2.0 * matmul_params(cfg)["output"] * predicted_fraction


def forward_flops_per_token(cfg: ModelShape, seq_len: int, predicted_fraction: float = 1.0) -> float:
    """Forward-pass model FLOPs per input token (one third of a training step's)."""
    return (cfg.layers * block_forward_flops_per_token(cfg, seq_len)
            + output_forward_flops_per_token(cfg, predicted_fraction))


def model_flops_per_token(cfg: ModelShape, seq_len: int, predicted_fraction: float = 1.0) -> float:
    """Training (forward + backward) model FLOPs per input token:
    6·(matmul weights of the layers) + 6·(output projection)·predicted_fraction
    + 12·layers·hidden·seq_len.

    `predicted_fraction` is the share of tokens the output projection is applied to:
    1.0 for a causal LM or dense MLM; masked tokens / tokens for sparse MLM prediction."""
    if not 0.0 <= predicted_fraction <= 1.0:
        raise ValueError(f"predicted_fraction must lie in [0, 1], not {predicted_fraction}.")
    return 3.0 * forward_flops_per_token(cfg, seq_len, predicted_fraction)


def layer_matmuls(cfg: ModelShape) -> dict[str, tuple[int, int]]:
    """Each weight matmul of a block as (input width, output width) before any tensor-parallel
    split; the products add up to `matmul_params(cfg)["layer"]`. Column-parallel layers
    (`qkv`, `up`) split the output width, row-parallel ones (`out`, `down`) the input width."""
    h, f = cfg.hidden, cfg.mlp_hidden
    return {"qkv": (h, h + 2 * kv_hidden(cfg)), "out": (h, h),
            "up": (h, (2 if gated(cfg) else 1) * f), "down": (f, h)}


def recompute_flops_per_token(cfg: ModelShape, seq_len: int, policy: str) -> float:
    """FLOPs per token that activation recomputation adds to a training step (the difference
    between hardware and model FLOPs). `full` reruns every block's forward pass; ember's
    `selective` keeps every matmul and the attention kernel's output and reruns only
    elementwise work (no FLOPs counted); `selective-attention` (Megatron-LM, Korthikanti et
    al. 2022) reruns the attention core, softmax(Q·Kᵀ)·V; `selective-half-matmul`
    (torchtitan's op-level policy) keeps the attention kernel's output and every other
    matmul's, and reruns the rest: about half the blocks' matmul FLOPs; `none` adds 0."""
    attention_core = 4.0 * cfg.layers * cfg.hidden * seq_len
    if policy == "full":
        return 2.0 * matmul_params(cfg)["layers"] + attention_core
    if policy == "selective-attention":
        return attention_core
    if policy == "selective-half-matmul":
        return matmul_params(cfg)["layers"]
    if policy in ("selective", "none"):
        return 0.0
    raise ValueError(f"recompute policy must be none, selective or full, not {policy!r}.")


# Chunks of fewer logits than this (64 MiB in fp32) would turn the output layer's matmuls
# into many thin ones that reread the whole weight, for no memory worth saving.
_MIN_CHUNK_LOGITS = 2**24


def chunk_tokens(n_tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of the fused output layer and loss (model/loss.py; the planner sizes
    its memory by it): chunk logits about the size of the hidden states themselves (vocab /
    hidden chunks, as Liger-Kernel), so the loss holds no more than an activation does, but
    never fewer logits than _MIN_CHUNK_LOGITS."""
    by_activation = math.ceil(n_tokens / max(1, math.ceil(vocab / hidden)))
    return max(1, min(n_tokens, max(by_activation, _MIN_CHUNK_LOGITS // vocab)))
