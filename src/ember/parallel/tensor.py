"""Tensor and sequence parallelism for the plain Transformer, through DTensor.

Megatron-style splits applied from outside the model with `parallelize_module`:
attention q/k/v and MLP up/gate are column-parallel (each rank holds heads/tp heads and
mlp_hidden/tp channels), o_proj and down are row-parallel (their partial sums are
all-reduced, or reduce-scattered over the sequence under sequence parallelism). The token
embedding is split over the vocabulary (row-parallel embedding: each rank looks up the
ids in its slice, the partial rows are summed) and so is the output layer, whose logits
stay sharded on the vocabulary and go straight into a vocabulary-parallel cross-entropy
(`loss_parallel`), so full-vocabulary logits never exist on one rank.

Every module boundary (embedding output, the input and output of a run of blocks, hence
of a pipeline stage, and the trunk's output that the masked LM indexes with `h[keep]`)
carries a plain, replicated [B, T, hidden] tensor. Sequence parallelism lives inside a
run of blocks only: the first block takes its sequence slice (no communication), the
norms and residual dropouts run on [B, T/tp, hidden] slices, and the last block's output
is all-gathered once. This keeps the model free of distributed code.

Every parameter becomes a DTensor on the tp mesh (sharded or replicated), so
`clip_grad_norm_`, optimizers, FSDP and torch.distributed.checkpoint see one kind of
tensor; a tied head and embedding (both sharded on the vocabulary) stay one Parameter.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from ember.parallel.recompute import blocks_of


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Splits, in place, whichever of `embed`, `pos_embed`, `blocks`, `norm` and `head` the
    module has (the whole
    Transformer or a pipeline stage) over the 1-D `tp_mesh`. Build the model identically
    on every rank first (rank 0's values are the ones distributed); `ember.layout` checks
    that the model splits. Run forward and backward under
    loss_parallel_context(module)."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp mesh, got a {tp_mesh.ndim}-D mesh.")
    embed, head = getattr(module, "embed", None), getattr(module, "head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight

    if embed is not None:
        _vocab_parallel_embedding(embed, tp_mesh)
        # The output is a view of the DTensor's local tensor; fed as such into a
        # torch.compile'd block, backward fails or, with sequence parallelism, silently
        # yields wrong gradients (seen on PyTorch 2.13). A copy of one [B, T, hidden]
        # tensor avoids it.
        embed.register_forward_hook(lambda _m, _args, out: out.clone())
    if getattr(module, "pos_embed", None) is not None:
        _replicate(module.pos_embed, tp_mesh)

    blocks = [block for _, block in blocks_of(module)]
    for block in blocks:
        # The plan's hooks and DTensor weights are the projections' own: each is called alone.
        block.attn.fused = block.mlp.fused = False
        parallelize_module(block, tp_mesh, _block_plan(block, tp_mesh, sequence_parallel))
    if sequence_parallel and blocks:
        blocks[0].register_forward_pre_hook(_take_sequence_slice(tp_mesh))
        blocks[-1].register_forward_hook(_gather_sequence(tp_mesh))

    if getattr(module, "norm", None) is not None:
        _replicate(module.norm, tp_mesh)
    if head is not None:
        # Logits stay sharded on the vocabulary (a DTensor) for loss_parallel.
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                          use_local_output=False))
        # The model then takes the cross-entropy of these logits, which must run (with
        # its backward) under loss_parallel; found again through any wrapper via .modules().
        head.vocab_parallel = True
        if tied:
            # Both layers shard the [vocab, hidden] weight on the vocabulary (Shard(0)),
            # so one Parameter serves both, as before.
            head.weight = embed.weight

    plain = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(f"apply_tensor_parallel left parameters unsplit: {', '.join(plain)}; "
                         "this module has parts the tensor-parallel plan does not know.")
    if not any(p.is_meta for p in module.parameters()):
        keep_gradient_layouts(module)


def keep_gradient_layouts(module: nn.Module) -> None:
    """Give every DTensor parameter's gradient its parameter's layout (`_in_layout`). Hooks
    live on the tensor, so a module built on the meta device gets them once materialised."""
    for param in module.parameters():
        if param.requires_grad and isinstance(param, DTensor):
            param.register_hook(_in_layout(param.device_mesh, param.placements))


def loss_parallel_context(module_or_flag: Any) -> contextlib.AbstractContextManager:
    """The context forward and backward must both run under: loss_parallel when the
    module (or anything it wraps) has a vocabulary-parallel output layer, or when given
    True; a no-op otherwise (no tensor parallelism, or a pipeline stage without the head).
    Under it, the model's loss is a replicated DTensor: take `.full_tensor()` for a value."""
    if isinstance(module_or_flag, bool):
        active = module_or_flag
    else:
        active = any(getattr(m, "vocab_parallel", False) for m in module_or_flag.modules())
    return loss_parallel() if active else contextlib.nullcontext()


def _vocab_parallel_embedding(embed: nn.Embedding, mesh: DeviceMesh) -> None:
    """Each rank looks up the ids of its vocabulary slice (zeros elsewhere) and the partial
    rows are summed, giving every rank the full embedding output. The lookup runs on the
    local shard, as Megatron-LM's VocabParallelEmbedding does, so the weight's gradient is
    made as that shard: DTensor's own embedding (RowwiseParallel) computes the gradient of
    the whole vocabulary on every rank, 2.1 GB per rank for a 128k x 8,192 bf16 table,
    before it is sliced."""
    embed.weight = nn.Parameter(distribute_tensor(embed.weight, mesh, [Shard(0)]))
    # A bound method, not a closure, so that a copy of the module looks up in its own weight.
    embed.forward = types.MethodType(_shard_lookup, embed)


def _shard_lookup(embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    weight = embed.weight  # read at each call: FSDP swaps in its gathered parameter
    local = weight.to_local()  # differentiable: its gradient returns as the weight's shard
    start = weight.device_mesh.get_local_rank() * local.shape[0]
    mine = (ids >= start) & (ids < start + local.shape[0])
    rows = nn.functional.embedding(torch.where(mine, ids - start, 0), local) * mine.unsqueeze(-1)
    # Summed over the ranks (forward); backward hands every rank the whole output gradient.
    return DTensor.from_local(rows, weight.device_mesh, [Partial()]).redistribute(
        weight.device_mesh, [Replicate()]).to_local()


def _in_layout(mesh: DeviceMesh, placements: tuple):
    """A gradient in its parameter's layout. DTensor leaves the sequence-parallel norms'
    gradients as unreduced partial sums; code that pairs a parameter's local shard with its
    gradient's (optimizers, tied-weight sums, norms) would then see the wrong thing. It
    costs one small all-reduce per norm parameter. (The embedding's gradient is made as its
    shard: `_vocab_parallel_embedding`.)"""
    def hook(grad):
        if isinstance(grad, DTensor) and grad.placements != placements:
            return grad.redistribute(mesh, placements)
        return grad
    return hook


def _block_plan(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> dict[str, Any]:
    # Under sequence parallelism the residual stream between the sub-layers is a
    # [B, T/tp, hidden] slice: the norms run on it, the attention and MLP inputs are
    # all-gathered (backward: reduce-scattered), and the row-parallel outputs are
    # reduce-scattered instead of all-reduced. Without it the stream is replicated.
    stream = Shard(1) if sequence_parallel else Replicate()
    # One DTensor input per sub-layer, shared by q/k/v (up/gate): their input gradients
    # add up as partial sums and are reduced once, not once per projection.
    plan: dict[str, Any] = {
        "attn": PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=stream),
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=stream),
    }
    if getattr(block.mlp, "gate", None) is not None:
        plan["mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel(use_local_output=True)
        plan["mlp_norm"] = SequenceParallel(use_local_output=True)
    else:
        _replicate(block.attn_norm, mesh)
        _replicate(block.mlp_norm, mesh)
    return plan


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters replicated on every rank (as DTensors, rank 0's values), computing on
    the full, replicated input: norms outside sequence parallelism, learned positions."""
    distribute_module(module, mesh, None, _replicated_input, _local_output)


def _replicated_input(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) if not isinstance(x, DTensor) else x
                 for x in inputs)


def _local_output(_module: nn.Module, output: DTensor, _mesh: DeviceMesh):
    return output.to_local()


def _take_sequence_slice(mesh: DeviceMesh):
    def hook(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        # Replicate -> Shard(1) keeps this rank's slice; its backward all-gathers. The
        # copy keeps a view of a DTensor out of a compiled block (see the embedding).
        dx = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return (dx.redistribute(mesh, (Shard(1),)).to_local().clone(), *args[1:])
    return hook


def _gather_sequence(mesh: DeviceMesh):
    def hook(_module: nn.Module, _args: tuple, output):
        dx = DTensor.from_local(output, mesh, (Shard(1),), run_check=False)
        # A tensor of its own, not a view of the DTensor's (FSDP warns about views).
        return dx.redistribute(mesh, (Replicate(),)).to_local().clone()
    return hook
