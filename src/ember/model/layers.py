"""The parts of a transformer block: norm, rotary positions, attention, MLP, the block.

Every projection is a plain `nn.Linear` with a stable name (`q_proj`, `k_proj`, `v_proj`,
`o_proj`; `up`, `gate`, `down`) so that initialisation, checkpoints, export and
tensor-parallel plans applied from outside can address them; nothing here knows about
devices, precision or parallelism. With `fused` (the default) attention computes q, k and v,
and a gated MLP gate and up, in one matmul each over those same parameters
(`ember.model.fused`); ember's tensor-parallel plan turns it off, and a projection with
hooks of its own (an outside plan) is always called on its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
import ember.model.flex as flex_kernel
from ember.model.fused import fusable, fused_linear


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer) in the rotate-half layout of GPT-NeoX/Llama:
    dimension i is paired with i + d/2 and the pair is rotated by pos * theta^(-2i/d)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        # Derived from the config, so kept out of checkpoints.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """Compute the tables where the buffers live (again after a model built on the meta
        device is given real memory); float64 then rounded once."""
        if self.cos.is_meta:
            return
        d = self.head_dim
        inv_freq = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=self.cos.device) / d)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=self.cos.device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_seq_len, head_dim]
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, T, head_dim] -> x rotated by its position along T."""
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin


def attention_mask(causal: bool, key_padding_mask: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None,
                   flex: bool = False) -> torch.Tensor | flex_kernel.BlockMask | None:
    """The boolean mask [B, 1, T, T] (or [B, 1, 1, T]) every layer's attention shares, True
    where a query may attend to a key, or None when the objective's own pattern suffices.

    Packed pretraining rows have no padding: MLM attends everywhere, causal LM to the past,
    and SDPA keeps its fast kernels. Right-padded batches (fine-tuning) give
    `key_padding_mask` [B, T] (True = a real token); a causal model never sees later pads,
    so only MLM needs it. `document_ids` [B, T] keeps every token inside its own document
    (causal: the past of its document); it costs a [B, T, T] mask and SDPA's flash path,
    unless `flex` asks for the same rule as a FlexAttention BlockMask (`ember.model.flex`)."""
    if document_ids is None:
        if key_padding_mask is None or causal:
            return None
        return key_padding_mask[:, None, None, :]
    if flex:
        return flex_kernel.document_block_mask(document_ids, causal, key_padding_mask)
    seq = document_ids.shape[1]
    mask = document_ids[:, :, None] == document_ids[:, None, :]
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    elif key_padding_mask is not None:
        # A pad query keeps itself, so that no row is all False (SDPA would give NaN).
        diagonal = torch.eye(seq, dtype=torch.bool, device=mask.device)
        mask = mask & (key_padding_mask[:, None, :] | diagonal)
    return mask[:, None]


class Attention(nn.Module):
    """Multi-head attention, or grouped-query attention (Ainslie et al. 2023) when
    `cfg.kv_heads` is below `heads`: k_proj and v_proj then have kv_heads heads, each read by
    heads / kv_heads consecutive query heads, the layout of Llama's checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.kv_heads = cfg.kv_heads or cfg.heads
        self.causal = cfg.objective == "causal"
        self.dropout = cfg.dropout
        kv_hidden = self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_hidden, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_hidden, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.fused = True
        self.rotary = (Rotary(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
                       if cfg.positions == "rotary" else None)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, hidden] -> [B, heads, T, head_dim]; -1 lets a tensor-parallel shard
        # (fewer local heads) pass through unchanged.
        batch, seq, _ = x.shape
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (from `attention_mask`, True = may attend, or a FlexAttention BlockMask)
        replaces the objective's own pattern; None keeps SDPA's fast paths (causal or no mask)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.fused and fusable(projections):
            q, k, v = fused_linear(x, projections)
            if self.rotary is not None:
                # Rotary makes new q and k; a copy of v lets the fused output go instead
                # of staying alive, at least 3x v's size, for attention's backward.
                v = v.contiguous()
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self._split(q), self._split(k), self._split(v)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if isinstance(mask, flex_kernel.BlockMask):  # documents kept apart by a block-sparse fused kernel
            out = flex_kernel.attend(q, k, v, mask)
        else:
            # Query head i reads key/value head i // group. Counted on the heads at hand: tensor
            # parallelism gives each rank heads / tp and kv_heads / tp of them, the same groups.
            group = q.shape[1] // k.shape[1]
            if group > 1 and (mask is not None or (q.is_cuda and q.dtype == torch.float32)):
                # CUDA's flash kernel takes no mask and no fp32, its memory-efficient one no
                # enable_gqa: either would fall to the math kernel and its T x T scores.
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.dropout if self.training else 0.0,
                                                 is_causal=self.causal and mask is None,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        batch, _, seq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """gelu: down(gelu(up x)); geglu/swiglu: down(act(gate x) * up x), both of width mlp_hidden."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.up = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=cfg.bias)
        self.gate = (nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=cfg.bias)
                     if cfg.activation in ("geglu", "swiglu") else None)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=cfg.bias)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return self.down(F.gelu(self.up(x)))
        act = F.gelu if self.activation == "geglu" else F.silu
        if self.fused and fusable((self.gate, self.up)):
            gate, up = fused_linear(x, (self.gate, self.up))
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(act(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        # Residual dropout as in GPT-2/BERT; a no-op at the default dropout of 0.
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def sinusoidal_table(max_seq_len: int, hidden: int) -> torch.Tensor:
    """The fixed position table of Vaswani et al. (sin on even, cos on odd dimensions),
    scaled by 1/sqrt(hidden) as in FLASH and Cramming. Unscaled, its entries (RMS 0.7)
    would drown token embeddings initialised at std 0.02, and a small masked LM then
    learns visibly slower (Vaswani et al. scale the tokens up by sqrt(hidden) instead)."""
    position = torch.arange(max_seq_len, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float64) * (-math.log(10000.0) / hidden))
    table = torch.zeros(max_seq_len, hidden, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : hidden // 2]
    return (table / math.sqrt(hidden)).float()
