"""Attention kept inside documents by FlexAttention, a fused block-sparse kernel.

A dense boolean [B, 1, T, T] mask costs B x T^2 bytes and pushes SDPA off FlashAttention
onto the memory-efficient or math kernel. FlexAttention takes a `BlockMask` instead: for
every 128 x 128 tile of (query, key) whether it is empty (skipped), full (computed with no
mask) or partial (the mask function evaluated per element), so a row of short packed
documents computes only the tiles along the diagonal. The BlockMask is made once per batch
from the document ids and shared by every layer, as the dense mask was.

Both functions are fast only compiled: eager `flex_attention` materialises the scores as the
math kernel does, and eager `create_block_mask` builds the dense mask first. On CUDA each is
compiled once for the process (as torchtitan does), so every layer and every step reuse the
same compiled code; inside a compiled block, torch.compile traces through the inner one.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

__all__ = ["BlockMask", "attend", "document_block_mask"]


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


def _fast(device: torch.device) -> bool:
    """Whether to run the compiled kernels: on CUDA (Triton). Elsewhere the eager forms give
    the same numbers, which is what a CPU test of this path needs."""
    return device.type == "cuda"


def _document_mask_mod(document_ids: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None):
    # The same rule as ember.model.layers.attention_mask, one (query, key) pair at a time.
    def same_document(b, h, q, kv):
        keep = document_ids[b, q] == document_ids[b, kv]
        if causal:
            return keep & (q >= kv)
        if key_padding_mask is not None:
            # A pad query keeps itself, as in the dense mask.
            return keep & (key_padding_mask[b, kv] | (q == kv))
        return keep

    return same_document


def document_block_mask(document_ids: torch.Tensor, causal: bool,
                        key_padding_mask: torch.Tensor | None = None) -> BlockMask:
    """The BlockMask of `document_ids` [B, T] (equal ids = one document): each query sees its
    own document (its past, when causal), and for a masked LM only real keys
    (`key_padding_mask` [B, T], True = a real token) besides itself."""
    batch, seq = document_ids.shape
    make = _compiled(create_block_mask) if _fast(document_ids.device) else create_block_mask
    # H=None: one mask broadcast over the heads, so a tensor-parallel shard's heads share it.
    return make(_document_mask_mod(document_ids, causal, key_padding_mask), batch, None, seq, seq,
                device=document_ids.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the pairs `block_mask` allows; q [B, heads, T, d], k and v
    [B, kv_heads, T, d], query head i reading key/value head i // (heads / kv_heads)."""
    fn = _compiled(flex_attention) if _fast(q.device) else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
