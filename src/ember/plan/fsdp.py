"""What ZeRO costs as FSDP2 runs it, beyond its collectives (plan/comm.py, plan/overlap.py):
the host work of its hooks, and the copies into and out of its flat collective buffers on
the compute stream. ember's ZeRO-1/2/3 are FSDP2 (parallel/data.py), and so is torchtitan's."""

from __future__ import annotations

from ember.layout import Layout
from ember.plan.layout import TrainShape
from ember.plan.memory import defers_reduction


def fsdp_host_s(lo: Layout, stack, micro_batches: int) -> float:
    """Host seconds FSDP2 adds to one sharded unit's micro-batch (forward and backward),
    from the stack's measured figures (tune/host_cost.py times a unit's whole pass with its
    gathers and reduction). ZeRO-3 gathers again and reduces every micro-batch, ZeRO-2
    reduces every micro-batch; ZeRO-1, and any ZeRO under a pipeline (`defers_reduction`),
    gathers and reduces once a step, so its pass's cost is spread over the micro-batches."""
    if lo.zero == 0:
        return 0.0
    deferred = defers_reduction(lo, stack)
    if lo.zero >= 3 and not deferred:
        return stack.reshard_host_s_per_layer
    if lo.zero == 2 and not deferred:
        return stack.shard_host_s_per_layer
    return stack.shard_host_s_per_layer / micro_batches


def fsdp_copy_bytes(params: float, lo: Layout, stack, shape: TrainShape, micro_batches: int,
                    grad_bytes: int) -> tuple[float, float]:
    """Bytes FSDP2 copies on the compute stream in one micro-batch's forward and backward of
    a stage holding `params` (unsharded), reduced in `grad_bytes`: every all-gather's output out of its flat buffer
    into the parameters (read and write; _fsdp_collectives.foreach_all_gather_copy_out, after
    the gather's event), and every reduction's gradients into the flat reduce-scatter input,
    cast to the reduce dtype (chunk_cat, before the reduce-scatter stream takes over). ZeRO-3
    gathers in forward and again in backward and reduces every micro-batch; ZeRO-2 gathers
    once a step and reduces every micro-batch; ZeRO-1, and ZeRO under a pipeline, do both
    once a step, a micro-batch's share here. Only a stack that runs FSDP2
    (`Stack.fsdp2_copies`): FSDP1 gathers into its flat parameter in place, Megatron-LM and
    DeepSpeed into their own buffers."""
    if lo.zero == 0 or not stack.fsdp2_copies:
        return 0.0, 0.0
    weight = 4 if shape.precision == "fp32" else 2
    gather = 2 * params * weight
    reduce = params * (weight + grad_bytes)
    deferred = defers_reduction(lo, stack)
    if lo.zero >= 3 and not deferred:
        return gather, gather + reduce
    if lo.zero == 2 and not deferred:
        return gather / micro_batches, reduce
    return gather / micro_batches, reduce / micro_batches
