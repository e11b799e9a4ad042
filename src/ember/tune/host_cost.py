"""What tensor parallelism costs the host, measured: one of ember's blocks, forward and
backward on tensors too small for compute to matter, plain and split over a tensor-parallel
mesh of every rank (eager DTensor), beside the collectives the split block issues.

    host time the split adds = split block - plain block - collectives x (one small all-reduce)

Eager DTensor dispatch (sharding propagation, redistribution, the wrapper tensors) costs
the host far more than a plain op. `ember plan calibrate` stores the figure as the stack's
`tp_host_s_per_layer`, which the planner adds to every tensor-parallel layer's host time
(plan/predict.py); ember's command line hands this function to it, since the planner's
package does not import the model. A compiled block traces the dispatch away, so this
prices eager runs. All ranks of the (initialised) default process group must call it.
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


def split_block_host(device: torch.device, iters: int) -> dict:
    """Seconds per forward and backward of a small block, plain and split over all ranks;
    the collectives in the split pass; one small all-reduce; and what the split adds."""
    from torch.distributed.device_mesh import init_device_mesh

    from ember.config import ModelConfig
    from ember.device import synchronize
    from ember.model.layers import Block
    from ember.plan.calibrate import REPEATS
    from ember.parallel.tensor import apply_tensor_parallel

    n = dist.get_world_size()
    cfg = ModelConfig(objective="causal", vocab_size=128, hidden=64 * n, layers=1, heads=2 * n, mlp_hidden=256 * n,
                      max_seq_len=16)

    class OneBlock(nn.Module):  # the layout apply_tensor_parallel expects: blocks by name
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"0": Block(cfg)})

        def forward(self, x):
            return self.blocks["0"](x)

    def sync():
        synchronize(device)
        dist.barrier()

    def seconds(fn) -> float:
        """The fastest of REPEATS bursts: `extra` below is a difference of measurements, so
        a burst slowed by another process would land in it whole."""
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

    torch.manual_seed(0)  # the same block and input on every rank, as tensor parallelism expects
    x = torch.randn(1, 16, cfg.hidden, device=device, requires_grad=True)
    plain, split = OneBlock().to(device), OneBlock().to(device)
    plain_s = seconds(lambda: plain(x).sum().backward())
    apply_tensor_parallel(split, init_device_mesh(device.type, (n,)), sequence_parallel=False)
    split_s = seconds(lambda: split(x).sum().backward())
    with CountCollectives() as counter:
        split(x).sum().backward()
    small = torch.zeros(16, device=device)
    all_reduce_s = seconds(lambda: dist.all_reduce(small))
    extra = split_s - plain_s - counter.count * all_reduce_s
    return {"hidden": cfg.hidden, "tp": n, "plain_s": plain_s, "split_s": split_s, "collectives": counter.count,
            "all_reduce_s": all_reduce_s, "tp_host_s_per_layer": max(0.0, extra)}
