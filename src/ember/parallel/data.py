"""Data parallelism over the "dp" ranks: DDP (ZeRO-0) or FSDP2 (ZeRO-1/2/3, hybrid).

- zero=0: PyTorch's composable DDP (`replicate`), which keeps parameter names; gradients
  are all-reduced once per step, after the last micro-batch.
- zero=1: FSDP2 without resharding after forward, and no gradient reduce-scatter until the
  last micro-batch: unsharded gradients accumulate locally, optimizer states are sharded.
- zero=2: FSDP2 without resharding after forward; gradients reduce-scattered per micro-batch.
- zero=1/2: parameters are gathered once per step, not per micro-batch (no resharding
  after the backward of a micro-batch that is not the step's last).
- zero=3: FSDP2 resharding parameters after forward (all-gathered again for backward).
- dp_replicate > 1 with zero >= 1: FSDP2 on the 2-D (dp_replicate, dp_shard) mesh, i.e.
  hybrid sharding: states sharded inside a replica, gradients all-reduced across replicas.

Every wrapper averages gradients over the data-parallel ranks; the engines multiply the
loss by the dp size (`build_engine`) so that the result is the gradient of the global sum.
bf16 mixed precision keeps fp32 master weights and reduces gradients in fp32, or in bf16
with `parallel.grad_dtype = "bf16"` (half the bytes on the wire): FSDP2's reduce_dtype, and
for DDP a communication hook (each bucket cast to bf16, averaged, cast back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember.parallel.mesh import Topology
from ember.parallel.recompute import blocks_of


@dataclass
class DataParallel:
    """How one wrapped module's gradients are summed across data-parallel ranks."""

    module: nn.Module
    zero: int
    reduce_dtype: torch.dtype = torch.float32  # what gradients cross the wire in

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last (True) or accumulates (False).
        ZeRO-0/1 reduce gradients only after the last; ZeRO-2/3 reduce-scatter every
        micro-batch so that only shards are ever kept. ZeRO-1/2 keep parameters gathered
        from the first micro-batch's forward to the last one's backward (they already hold
        them whole through each forward and backward, so this costs no peak memory and
        saves an all-gather per extra micro-batch); ZeRO-3 gathers them per use."""
        if self.zero in (0, 1):
            self.module.set_requires_gradient_sync(sync)
        if self.zero in (1, 2):
            self.module.set_reshard_after_backward(sync)


def bf16_reduce_hook(group, bucket):
    """DDP communication hook: the bucket averaged in bf16, written back in fp32. PyTorch's
    own `bf16_compress_hook` does the same but refuses anything but NCCL and XCCL, and a
    CPU run (gloo) is where ember's layouts are checked against one process."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def written_back(future):
        buffer.copy_(future.value()[0])
        return buffer

    return work.then(written_back)


def _fsdp():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # public since 2.6
    return fully_shard, MixedPrecisionPolicy


def apply_data_parallel(module: nn.Module, topo: Topology, zero: int, device: torch.device,
                        param_dtype: torch.dtype | None, alone: bool = False,
                        reduce_dtype: torch.dtype = torch.float32, pipelined: bool = False) -> DataParallel | None:
    """Wrap `module` in place for the run's data-parallel layout; None when dp is 1, unless
    `alone` asks for the wrappers over one rank anyway (to measure their own cost).
    Gradients are reduced in `reduce_dtype` (fp32 or bf16) and kept in fp32.

    `pipelined`: `module` is a pipeline stage. PyTorch's schedules run its backwards
    without resharding and reduce once a step, so the weights its first backward gathers
    stay gathered anyway; ZeRO-3 then keeps them from the first forward on too (as
    torchtitan does), instead of freeing them after every forward and gathering them again
    for every pass of every micro-batch, which saves little peak memory."""
    dp = topo.size("dp")
    if dp == 1 and not alone:
        return None
    if zero == 0:
        from torch.distributed._composable.replicate import replicate

        kwargs = {"device_ids": [device]} if device.type == "cuda" else {}
        # Gradients as views into the reduction buckets: no second copy of every gradient,
        # and no copy from bucket to gradient after each reduction.
        replicate(module, process_group=topo.group("dp"), gradient_as_bucket_view=True, **kwargs)
        if reduce_dtype == torch.bfloat16:  # registered now, installed by replicate at the first forward
            module.register_comm_hook(topo.group("dp"), bf16_reduce_hook)
        return DataParallel(module, zero, reduce_dtype)
    fully_shard, MixedPrecisionPolicy = _fsdp()
    mesh = topo.mesh["dp_shard"] if topo.size("dp_replicate") == 1 else topo.mesh["dp_replicate", "dp_shard"]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = zero == 3 and not pipelined
    for _, block in blocks_of(module):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    embed, norm, head = (getattr(module, name, None) for name in ("embed", "norm", "head"))
    if embed is None or head is None or head.weight is not embed.weight:
        # As torchtitan does: the embedding and the output layer (the largest matrices of
        # a model with a large vocabulary) are groups of their own, so that each is
        # gathered only around its own forward and backward, never both for the whole
        # step. The output layer runs last and its backward first: no reshard in between.
        if embed is not None:
            fully_shard(embed, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        if head is not None:
            fully_shard([norm, head], mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    # The root holds the rest (a tied head shares the embedding's weight, so both then sit
    # in the root's group); nothing runs after it, so keep it.
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return DataParallel(module, zero, reduce_dtype)
