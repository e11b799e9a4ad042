"""Named training software stacks: what each does where it changes cost (`--stack NAME`).

Published runs were made with other software than ember's trainer. Predicting them means
naming what that software does, not tuning ember's own constants to it:

- `ember`: PyTorch SDPA (flash) attention, bf16 gradients, FSDP2-style per-block ZeRO-3
  gathers with prefetch, DDP/FSDP bucketed reduction overlapped with the backward pass.
- `megatron`: Megatron-LM / Megatron-Core with its defaults: fp32 main gradients, the
  gradient all-reduce after the backward pass (--overlap-grad-reduce and
  --overlap-param-gather are off unless asked for), Transformer Engine flash attention.
- `nemo`: the same Megatron-Core as NeMo's performance recipes (and Megatron-Core's own
  scaling tables) run it: the distributed optimizer's gradient reduction and parameter
  gathers overlapped with compute, and sequence parallelism's collectives overlapped with
  the matmuls (--tp-comm-overlap, Transformer Engine userbuffers), and gradients kept and
  reduced in bf16 (the recipes set grad_reduce_in_fp32 false, where Megatron-LM accumulates
  bf16 training's gradients in fp32). Same kernels, so the same fitted figures as `megatron`.
- `megatron-2021`: Megatron-LM as Narayanan et al. ran it in 2021 (PyTorch 1.8-era kernels,
  unfused attention with its fused scale-mask-softmax, fp32 main gradients, no overlap):
  other software than today's Megatron-Core, so its kernel rate is its own.
- `deepspeed`: Megatron-DeepSpeed: unfused attention, 2-byte gradients, no gradient
  bucketing overlap, ZeRO-3 fetching each parameter-holding sub-module with its own
  collective (four weights and two norms per block) and without reliable prefetch, again
  for the forward that full recomputation reruns (its pre-forward hooks fire on the rerun:
  DeepSpeed issue #4784), and into a list of per-rank tensors as its 2021 code did, one
  copy per rank after every gather (the copies DeepSpeed's later in-place all-gather
  removed: issue #1069);
  DeepSpeed's pipeline engine, which runs its stages in lockstep and sends the whole
  activation from every tensor-parallel rank (read from its TrainSchedule, not fitted).
- `megatron-deepspeed`: the same with DeepSpeed's pipeline engine off
  (--no-pipeline-parallel): Megatron-LM's own schedules (1F1B, interleaved) and its
  pipeline sends, each tensor-parallel rank's 1/tp slice. vTrain's measured sweep ran so.
  Same kernels, so the same fitted figures as `deepspeed`.
- `fsdp`: PyTorch FSDP (Composer/llm-foundry, torchtitan): flash attention, gradients
  reduced in fp32 (mixed-precision default), per-block gathers with prefetch; selective
  recomputation is torchtitan's op-level policy (Composer checkpoints whole blocks only).
  FSDP2 as torchtitan runs it: every gathered weight copied out of its flat buffer and every
  gradient into one on the compute stream (plan/predict.py: fsdp_copy_bytes).
- `llm-foundry`: the same FSDP as MosaicML's llm-foundry runs it, whose default loss is
  flash-attn's Triton cross-entropy: the bf16 logits read once forward, their gradient
  written once backward (6 bytes a logit where an fp32 softmax moves 52; it matters where
  the vocabulary is large beside the width: predicted, a sixth of an MPT-125m step). Its
  FSDP is FSDP1, which gathers into its flat parameter in place: no copies. Same kernels
  otherwise, so the same fitted figures as `fsdp`.
- `fsdp-eager`: the same without torch.compile (torchtitan's default): RMSNorm, rotary
  embedding and SwiGLU run as eager PyTorch's composites of several kernels each, which
  move fp32 intermediates through memory (plan/timing.py). Same kernels otherwise, so the
  same fitted figures as `fsdp`.

Three figures per stack are fitted on the fitted rows of the public sets
(benchmarks/planner_fit.py; held-out rows never enter): `kernel_eff`, the share of the
GPU table's matmul rate the stack's kernels reach end to end; `attention_eff`, the share of
the table's FlashAttention rate its fused attention kernel reaches (stacks with one); and
`host_s_per_kernel`, the host time per call it issues (a kernel, or a tensor-parallel
collective) that bounds small passes (plan/predict.py: _as_run). DeepSpeed's also has a
fourth, `host_s_per_micro_batch`: the host work around its per-micro-batch sync, which
only vTrain's layer sweep separates from the per-call time (the others keep 0). ember's are not fitted
to other software: its kernel_eff and attention_eff are 1 (its rates are what `ember plan
calibrate` measures) and its host time is that of eager PyTorch with fused blocks.
"""

from __future__ import annotations

from dataclasses import replace

from ember.config import ConfigError
from ember.plan.cluster import Stack

# One copy launched from C++ (cudaMemcpyAsync or a copy kernel): a few microseconds of
# host and device each; what every rank's chunk costs after a list all-gather.
GATHER_COPY_S = 5e-6

# kernel_eff, attention_eff and host_s_per_kernel (and deepspeed's host_s_per_micro_batch)
# of every stack but ember's: fitted
# (benchmarks/results/2026-11-29-planner-fit.txt). Megatron-LM's selective recomputation
# (and Megatron-DeepSpeed's) reruns the attention core; torchtitan's op-level policy reruns
# every other matmul (torchtitan/distributed/activation_checkpoint.py: mm outputs are kept
# on odd counts within a block, attention and reduce-scatter outputs always) and the
# elementwise work; ember's reruns only the elementwise work.
STACKS: dict[str, Stack] = {
    "ember": Stack(name="ember"),
    "megatron": Stack(name="megatron", attention="flash", grad_dtype="fp32", overlap_grad_reduce=False,
                      overlap_param_gather=False, host_s_per_kernel=2e-6, kernel_eff=0.975, attention_eff=0.95,
                      selective="attention", fused_loss=False, frees_grads=False,
                      sp_keeps_gathered=False, per_block_grads=False, fsdp2_copies=False),
    "megatron-2021": Stack(name="megatron-2021", attention="unfused", grad_dtype="fp32", overlap_grad_reduce=False,
                           overlap_param_gather=False, host_s_per_kernel=100e-6, kernel_eff=0.9,
                           selective="attention", fused_loss=False, frees_grads=False,
                           sp_keeps_gathered=False, per_block_grads=False, fsdp2_copies=False),
    "deepspeed": Stack(name="deepspeed", attention="unfused", grad_dtype="bf16", overlap_grad_reduce=False,
                       overlap_param_gather=False, zero3_collectives_per_layer=6, zero3_regathers_for_recompute=True,
                       gather_s_per_rank=GATHER_COPY_S, host_s_per_kernel=60e-6,
                       host_s_per_micro_batch=2e-3,
                       kernel_eff=1.025, selective="attention", fused_loss=False, frees_grads=False,
                       sp_keeps_gathered=False, per_block_grads=False, p2p_slices=False, fsdp2_copies=False,
                       pipeline_lockstep=True),
    "fsdp": Stack(name="fsdp", attention="flash", grad_dtype="fp32", host_s_per_kernel=100e-6, kernel_eff=0.85,
                  attention_eff=0.55, selective="half-matmul", fused_loss=False),
}


STACKS["megatron-deepspeed"] = replace(STACKS["deepspeed"], name="megatron-deepspeed", pipeline_lockstep=False,
                                       p2p_slices=True)
STACKS["fsdp-eager"] = replace(STACKS["fsdp"], name="fsdp-eager", fused_elementwise=False)
STACKS["llm-foundry"] = replace(STACKS["fsdp"], name="llm-foundry", loss_fwd_bytes=2, loss_bwd_bytes=4,
                                fsdp2_copies=False)  # Composer's FSDP1
STACKS["nemo"] = replace(STACKS["megatron"], name="nemo", overlap_grad_reduce=True, overlap_param_gather=True,
                         overlap_tp_comm=True, grad_dtype="bf16")


def stack(name: str, **changes) -> Stack:
    """The named stack, with `changes` (e.g. attention="unfused") applied."""
    if name not in STACKS:
        raise ConfigError(f"unknown --stack {name!r}; use one of {', '.join(STACKS)}.")
    return replace(STACKS[name], **changes)


def run_stack(base: Stack, config, device_type: str = "cuda") -> Stack:
    """`base` as ember's trainer would run the recipe `config` on `device_type`: gradients
    reduced in its `parallel.grad_dtype`, and no eager tensor-parallel host cost where it
    compiles its blocks (compilation traces DTensor's dispatch away). Other stacks price
    their own software, not the recipe's settings."""
    from ember.layout import compiles

    if base.name != "ember":
        return base
    stack = replace(base, grad_dtype=config.parallel.grad_dtype)
    return replace(stack, compiled=compiles(config, device_type))
