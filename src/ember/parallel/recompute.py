"""Activation checkpointing and torch.compile, applied per transformer block (compile also
to the final norm and the loss).

Both replace the block's `forward` on the instance instead of wrapping the block in a new
module, so parameter names stay those of the plain Transformer ("blocks.3.attn.q_proj.weight")
and checkpoints, tensor-parallel plans and FSDP see the same tree in every layout.

- full: every block keeps only its input; its activations are recomputed in backward.
- selective: every block keeps the outputs of its matrix multiplications (the q/k/v, output
  and MLP projections), of its fused attention kernel and of its tensor-parallel
  collectives, and recomputes the rest: norms, activations, rotary, dropout. Backward then
  reruns no matmul, no attention and no communication, only memory-bound elementwise work
  (torchtitan's op-level policy). A fused attention kernel never stores the T x T scores,
  so recomputing it (Korthikanti et al.'s selective recomputation) would save only its
  [B, T, hidden] output for a second pass of the most expensive kernel of long sequences.

`every = k` applies the policy to blocks 0, k, 2k, ... only, counted by the plain model's
layer index, so a pipeline stage holding blocks 6..8 picks the same blocks the whole model
would. The rest keep all their activations: memory traded back for speed, like
Megatron-LM's partial recomputation. Block 0 is always included because the first
pipeline stage holds the most micro-batches in flight under 1F1B.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Saved under `selective`; every other op of the block is recomputed.
_KEEP = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
    # Whichever kernel SDPA picks: FlashAttention, memory-efficient, cuDNN, the CPU's.
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch._higher_order_ops.flex_attention,  # document masks (ember.model.flex)
    # Tensor parallelism's collectives inside a block (DTensor issues them functionally).
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def blocks_of(module: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, block) of a whole Transformer or a pipeline stage, in forward order."""
    return [(int(key), block) for key, block in module.blocks.items()]


def _checkpointed(forward, *args, **kwargs):
    # Non-reentrant: works with keyword arguments, DTensors and FSDP2's hooks.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(forward, *args, **kwargs):
    contexts = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def recomputed(index: int, mode: str, every: int = 1) -> bool:
    """Whether the block with plain-model layer `index` is checkpointed."""
    return mode != "none" and index % every == 0


def apply_recompute(module: nn.Module, mode: str, every: int = 1) -> None:
    """Checkpoint, in place, the blocks that `mode` ("none", "selective", "full") and
    `every` (blocks 0, every, 2 x every, ...) select."""
    if mode == "none":
        return
    wrapper = _checkpointed if mode == "full" else _selective
    for index, block in blocks_of(module):
        if recomputed(index, mode, every):
            block.forward = functools.partial(wrapper, block.forward)


def apply_compile(module: nn.Module) -> None:
    """Compile each block on its own: one small graph reused by every layer, and graph
    breaks at the block boundaries, where FSDP and pipeline stages need them anyway. Then
    the end of the model: the final norm, and the chunked loss's work on each chunk of
    logits (the output layer's loss is a custom autograd function that forms gradients in
    its forward, so its loop stays eager and each chunk's fused kernels are compiled). Not
    under tensor parallelism: its vocabulary-parallel head takes PyTorch's loss_parallel
    cross-entropy, and its replicated norm is left as before."""
    for _, block in blocks_of(module):
        block.forward = torch.compile(block.forward)
    norm, head = getattr(module, "norm", None), getattr(module, "head", None)
    # The last pipeline stage or the whole model, with ember's own output layer.
    if norm is not None and hasattr(head, "compiled") and not head.vocab_parallel:
        norm.forward = torch.compile(norm.forward)
        head.compiled = True
