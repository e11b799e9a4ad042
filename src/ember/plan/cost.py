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
softmax, the loss, and recomputation (that is hardware FLOPs, not model FLOPs).
"""

from __future__ import annotations

from ember.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> dict[str, int]:
    """Weights used in matmuls: per layer (`attention`, `mlp`, `layer`), all layers together
    (`layers`) and the output projection (`output`, hidden × padded vocabulary, counted
    also when tied to the embedding: tying shares storage, not compute)."""
    h = cfg.hidden
    attention = 4 * h * h
    mlp = (3 if cfg.activation in ("geglu", "swiglu") else 2) * h * cfg.mlp_hidden
    return {
        "attention": attention,
        "mlp": mlp,
        "layer": attention + mlp,
        "layers": cfg.layers * (attention + mlp),
        "output": h * cfg.padded_vocab,
    }


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, predicted_fraction: float = 1.0) -> float:
    """Forward-pass model FLOPs per input token (one third of a training step's)."""
    params = matmul_params(cfg)
    return (2.0 * params["layers"] + 2.0 * params["output"] * predicted_fraction
            + 4.0 * cfg.layers * cfg.hidden * seq_len)


def model_flops_per_token(cfg: ModelConfig, seq_len: int, predicted_fraction: float = 1.0) -> float:
    """Training (forward + backward) model FLOPs per input token:
    6·(matmul weights of the layers) + 6·(output projection)·predicted_fraction
    + 12·layers·hidden·seq_len.

    `predicted_fraction` is the share of tokens the output projection is applied to:
    1.0 for a causal LM or dense MLM; masked tokens / tokens for sparse MLM prediction."""
    if not 0.0 <= predicted_fraction <= 1.0:
        raise ValueError(f"predicted_fraction must lie in [0, 1], not {predicted_fraction}.")
    return 3.0 * forward_flops_per_token(cfg, seq_len, predicted_fraction)
