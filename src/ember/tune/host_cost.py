"""What tensor parallelism and ZeRO cost the host, measured: one of ember's blocks, forward
and backward on tensors too small for compute to matter, plain and in the parallel form,
beside the collectives the parallel form issues.

    host time a form adds = parallel block - plain block - its collectives, timed alone

- Split over a tensor-parallel mesh of every rank (eager DTensor): dispatch (sharding
  propagation, redistribution, the wrapper tensors) costs the host far more than a plain
  op. `ember plan calibrate` stores the figure as the stack's `tp_host_s_per_layer`; a
  compiled block traces the dispatch away, so it prices eager runs.
- Sharded with FSDP2 (`fully_shard`) over every rank, as ZeRO-1/2 (parameters kept after
  forward) and ZeRO-3 (resharded after forward, gathered again for backward) run it: the
  hooks around each pass, the copies into and out of the flat collective buffers, and the
  DTensor bookkeeping of the sharded parameters and gradients. Stored as
  `shard_host_s_per_layer` and `reshard_host_s_per_layer`; compiling the blocks leaves the
  hooks outside the compiled graph, so every run pays them.

The planner adds these to each layer's host time (plan/predict.py). ember's command line
hands the functions to the calibration, since the planner's package does not import the
model. All ranks of the (initialised) default process group must call them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class CountCollectives(TorchDispatchMode):
    """Counts the collectives that reach the dispatcher (DTensor issues functional c10d ops)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d") and any(k in func.__name__ for k in COLLECTIVES):
            self.count += 1
        return func(*args, **(kwargs or {}))


class RecordGathers(TorchDispatchMode):
    """Notes the all-gathers and reduce-scatters FSDP2 issues (c10d's ops, which reach the
    dispatcher), each with the bytes of its full (unsharded) buffer, so they can be timed alone."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "c10d" and ("allgather" in name or "reduce_scatter" in name):
            kind = "all_gather" if "allgather" in name else "reduce_scatter"
            full = max(args[0], args[1], key=lambda t: t.numel())  # the output of a gather, the input of a scatter
            self.calls.append((kind, full.numel() * full.element_size()))
        return func(*args, **(kwargs or {}))


def block_config(n: int):
    from ember.config import ModelConfig

    return ModelConfig(objective="causal", vocab_size=128, hidden=64 * n, layers=1, heads=2 * n,
                       mlp_hidden=256 * n, max_seq_len=16)


def seconds_per_call(fn, device: torch.device, iters: int) -> float:
    """Seconds per call: the fastest of REPEATS bursts, all ranks in step. What a form adds
    is a difference of measurements, so a burst slowed by another process would land in it
    whole."""
    from ember.device import synchronize
    from ember.plan.calibrate import REPEATS

    def sync():
        synchronize(device)
        dist.barrier()

    for _ in range(min(10, iters)):
        fn()
    best = float("inf")
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def split_block_host(device: torch.device, iters: int) -> dict:
    """Seconds per forward and backward of a small block, plain and split over all ranks;
    the collectives in the split pass; one small all-reduce; and what the split adds."""
    from torch.distributed.device_mesh import init_device_mesh

    from ember.model.layers import Block
    from ember.parallel.tensor import apply_tensor_parallel

    n = dist.get_world_size()
    cfg = block_config(n)

    class OneBlock(nn.Module):  # the layout apply_tensor_parallel expects: blocks by name
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"0": Block(cfg)})

        def forward(self, x):
            return self.blocks["0"](x)

    torch.manual_seed(0)  # the same block and input on every rank, as tensor parallelism expects
    x = torch.randn(1, 16, cfg.hidden, device=device, requires_grad=True)
    plain, split = OneBlock().to(device), OneBlock().to(device)
    plain_s = seconds_per_call(lambda: plain(x).sum().backward(), device, iters)
    apply_tensor_parallel(split, init_device_mesh(device.type, (n,)), sequence_parallel=False)
    split_s = seconds_per_call(lambda: split(x).sum().backward(), device, iters)
    with CountCollectives() as counter:
        split(x).sum().backward()
    small = torch.zeros(16, device=device)
    all_reduce_s = seconds_per_call(lambda: dist.all_reduce(small), device, iters)
    extra = split_s - plain_s - counter.count * all_reduce_s
    return {"hidden": cfg.hidden, "tp": n, "plain_s": plain_s, "split_s": split_s, "collectives": counter.count,
            "all_reduce_s": all_reduce_s, "tp_host_s_per_layer": max(0.0, extra)}


def sharded_block_host(device: torch.device, iters: int) -> dict:
    """Seconds per forward and backward of a small block, plain and sharded with FSDP2 over
    all ranks, kept after forward (ZeRO-1/2) and resharded (ZeRO-3); the collectives each
    sharded pass issued, timed alone at their sizes; and what each form adds beyond them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ember.model.layers import Block
    from ember.plan.calibrate import collective_call

    n = dist.get_world_size()
    cfg = block_config(n)
    mesh = init_device_mesh(device.type, (n,))
    torch.manual_seed(0)
    x = torch.randn(1, 16, cfg.hidden, device=device, requires_grad=True)
    plain = Block(cfg).to(device)
    plain_s = seconds_per_call(lambda: plain(x).sum().backward(), device, iters)
    out = {"hidden": cfg.hidden, "ranks": n, "plain_s": plain_s}
    for name, reshard in (("shard", False), ("reshard", True)):
        block = Block(cfg).to(device)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        sharded_s = seconds_per_call(lambda: block(x).sum().backward(), device, iters)
        with RecordGathers() as recorder:
            block(x).sum().backward()
        # Each timed alone at its size (fp32 like the block's: no mixed-precision policy here).
        collectives_s = sum(seconds_per_call(collective_call(kind, nbytes, n, device, None), device, iters)
                            for kind, nbytes in recorder.calls)
        out |= {f"{name}_s": sharded_s, f"{name}_collectives": [c[0] for c in recorder.calls],
                f"{name}_collectives_s": collectives_s,
                f"{name}_host_s_per_layer": max(0.0, sharded_s - plain_s - collectives_s)}
    return out


def model_block_step(spec, micro_batch: int, seq: int, device: torch.device, dtype: torch.dtype):
    """A call that runs one of ember's blocks of the planner's model `spec` (plan/models.py)
    forward and backward on `micro_batch` sequences of `seq` tokens, as the trainer runs an
    uncompiled block: fp32 weights, autocast below fp32, gradients returned rather than
    accumulated (a fresh micro-batch's). None where ember's model has no such block (a
    preset with ALiBi positions). `ember plan calibrate --model` times it (plan/kernels.py)."""
    from ember.config import ModelConfig
    from ember.model.layers import Block
    from ember.plan.models import MODEL_KEYS

    if spec.positions not in ("learned", "sinusoidal", "rotary"):
        return None
    shape = {key: getattr(spec, key) for key in MODEL_KEYS} | {"layers": 1, "max_seq_len": max(seq, spec.max_seq_len)}
    block = Block(ModelConfig(**shape, dropout=0.1 if spec.dropout else 0.0)).to(device)
    x = torch.randn(micro_batch, seq, spec.hidden, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    inputs = [x, *block.parameters()]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            out = block(x)
        torch.autograd.grad(out, inputs, grad)

    return step
