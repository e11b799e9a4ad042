"""What overlapping communication with compute costs, and what of it stays exposed.

The planner used to charge overlapped communication only where it outlasted the compute
beside it (max(0, comm - compute)). Measured runs show three costs that rule misses:

1. Contention. NCCL kernels run on the same GPU as the matmuls they hide behind: a ring
   takes SMs (one per channel and direction) and reads and writes every byte it moves
   through HBM. Compute that runs beside a collective is slower by a fraction
   COMM_SLOWDOWN for as long as they overlap. GEMMs sharing an A100/H100 with NCCL lose
   10-30% in the measurements of the overlap literature (e.g. Jangda et al. 2022, "Breaking
   the computation and communication abstraction barrier"; Rashidi et al. 2021); the
   value here is fitted on the public set (see below).
2. Exposure. A pipeline of gathers cannot hide its first one (the first layer's weights
   are needed before any compute starts), nor can a bucketed reduction hide its last
   bucket (it is filled by the last backward kernel). Per-micro-batch collectives
   (ZeRO-2 reduce-scatter every micro-batch, ZeRO-3 gathers in forward and backward and a
   reduce-scatter every micro-batch) pay these per micro-batch, not per step.
3. Latency. A ring over n ranks runs in n-1 steps (2(n-1) for an all-reduce), each
   paying a per-hop latency (plan/comm.py: NCCL's own tuning model). ZeRO-3 issues one
   collective per sharded unit: one per layer for FSDP, one per parameter-holding
   sub-module for DeepSpeed. Over 1,536 ranks, a few hundred such collectives per pass
   cost seconds however small the micro-batch, which is why ZeRO-3 stops scaling at a
   fixed global batch while tensor and pipeline parallelism keep their rate.

A stack that does not prefetch (`overlap_param_gather` false) pays ZeRO-3's gathers in
full. Small per-GPU batches leave little compute to hide behind: the hidden share is
bounded by the compute of the pass it runs beside.

Fitted constants (fitted on the fitted rows of the public sets only, by
benchmarks/planner_fit.py; held-out rows never enter): COMM_SLOWDOWN. Everything else
here is derived from the layout and the link model.
"""

from __future__ import annotations

from ember.plan import comm

# Compute beside a collective runs this much slower (fitted:
# benchmarks/results/2026-11-29-planner-fit.txt).
COMM_SLOWDOWN = 0.3


def hidden_cost(comm_s: float, compute_s: float, exposed_floor_s: float = 0.0, overlap: bool = True) -> float:
    """Seconds that `comm_s` of communication adds to `compute_s` of compute it may run
    beside: what outlasts the compute (at least `exposed_floor_s`, the first gather or the
    last bucket), plus the contention slowdown of the compute it overlaps."""
    if comm_s <= 0:
        return 0.0
    if not overlap:
        return comm_s
    exposed = max(exposed_floor_s, comm_s - compute_s)
    overlapped = min(comm_s - exposed, compute_s)
    return exposed + COMM_SLOWDOWN * max(0.0, overlapped)


def sharded_s(nbytes: float, collectives: int, group: comm.Group, links: comm.Links,
              kind: str = "all_gather") -> float:
    """`collectives` all-gathers (or, `kind` "reduce_scatter", reduce-scatters) that together
    move `nbytes` (the full, unsharded size) over `group`: each pays the ring's latency, the
    bytes pay bandwidth."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    latency = comm.ring_latency_s(n - 1, group, links)
    return max(1, collectives) * latency + (n - 1) / n * nbytes / comm.bus_bandwidth(group, links, kind)
