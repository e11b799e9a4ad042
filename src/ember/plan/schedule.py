"""How long a pipeline schedule takes to pass a step's micro-batches through the stages.

Stage i spends t_i per micro-batch (forward, backward, recomputation, its tensor-parallel
communication, activation sends to its neighbours, ZeRO-3 gathers that could not hide
behind compute). With m micro-batches and v virtual stages per GPU, the slowest stage paces
the steady state and every stage's work passes once through fill and drain:
    pipeline = m·max(t) + (Σ t_i − max(t)) / v.
Balanced stages give m·t·(1 + (p−1)/(v·m)): the bubble fraction (p−1)/m of GPipe and
1F1B, (p−1)/(v·m) interleaved (Narayanan et al. 2021). The first stage carries the
embedding, the last the output layer and the loss, so unequal stages are priced too.

The zero-bubble schedules split each backward into the input gradient I, which the stage
below waits for, and the weight gradient W, which nothing waits for and which fills the
idle slots; a stage's t is F + I + W. Of the (p − 1) chunk times of fill and drain they
leave idle, for PyTorch's schedules (simulated action by action from the orders
`torch.distributed.pipelining` builds, tests/plan/test_zero_bubble.py):
- `zero_bubble` (ScheduleInterleavedZeroBubble, ZB-1P): F + I − W per chunk, whatever v;
- `zbv` (ScheduleZBVZeroBubble, two stages per rank in a V): max(F, I, 2(I − W)) per
  chunk with at least 2p − 1 micro-batches, 2I with fewer (its warm-up is cut short).
These hold where I ≥ F ≥ W, as in a transformer block: W is the weight-gradient matmuls,
as long as the forward's; I the input-gradient matmuls plus attention's and the
elementwise backward and any recomputation. Every stage the planner prices has these
proportions (tested); other times are moved to the nearest that do.

DeepSpeed's pipeline engine runs in lockstep instead (`lockstep_s`): with a backward pass
b about three times the forward f under full recomputation, its steady state costs 2·b
per micro-batch where 1F1B costs f + b, 1.5x as long.
"""

from __future__ import annotations


def idle_share(schedule: str, forward: float, backward_input: float, backward_weight: float,
               micro_batches: int, pp: int) -> float:
    """The share of a stage's per-micro-batch time F + I + W that the schedule's fill and
    drain leave idle (per chunk when the stage is cut into virtual stages); 1 for the
    schedules that run each backward whole."""
    f, i, w = forward, max(backward_input, forward), min(backward_weight, forward)
    whole = forward + backward_input + backward_weight
    if whole <= 0 or schedule not in ("zero_bubble", "zbv"):
        return 1.0
    if schedule == "zero_bubble":
        idle = f + i - w
    elif micro_batches >= 2 * pp - 1:
        idle = max(f, i, 2 * (i - w))
    else:
        idle = 2 * i
    return idle / whole


def pipeline_s(stage_times: list[float], micro_batches: int, vpp: int = 1,
               idle: list[float] | None = None) -> tuple[float, float]:
    """(time through the pipeline, of which fill and drain) for per-micro-batch stage times;
    `idle`: each stage's `idle_share` (1 for all when not given)."""
    shares = idle or [1.0] * len(stage_times)
    slowest = max(range(len(stage_times)), key=stage_times.__getitem__)
    exposed = [t * s for t, s in zip(stage_times, shares)]
    bubble = (sum(exposed) - exposed[slowest]) / vpp
    return micro_batches * stage_times[slowest] + bubble, bubble


def lockstep_s(forward: list[float], backward: list[float], micro_batches: int) -> tuple[float, float]:
    """(time through the pipeline, of which not the slowest stage's own work) for DeepSpeed's
    TrainSchedule (deepspeed/runtime/pipe/schedule.py): 2(m + p − 1) steps; in each, even
    stages run a forward while odd ones run a backward, or the reverse, and neighbours
    exchange activations and gradients with blocking sends and receives before the next.
    Every step therefore lasts as long as the slowest pass run in it: the p − 1 steps of
    the fill run forwards only, every other step has a backward somewhere."""
    p, f, b = len(forward), max(forward), max(backward)
    total = (p - 1) * f + (2 * micro_batches + p - 1) * max(f, b)
    return total, total - micro_batches * max(fi + bi for fi, bi in zip(forward, backward))
