"""Schedules keyed to the budget: learning rate and batch size as functions of the
fraction of the budget spent, so a run cut off by its clock still ends annealed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember.budget import Budget
from ember.config import ScheduleConfig


@dataclass
class Progress:
    """How much of the budget a run has used; saved in every checkpoint."""

    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    step_s: float = 0.0  # the last step's time (the slowest rank's), 0 before the first

    def fraction(self, budget: Budget) -> float:
        used = {"steps": self.step, "tokens": self.tokens, "seconds": self.elapsed_s}[budget.kind]
        return min(1.0, used / budget.amount)

    def done(self, budget: Budget) -> bool:
        """Whether the budget is spent. A time budget also ends when the next step would
        end more than half past it: that step would train at the schedule's end (a
        triangle's learning rate of 0) and overrun the budget by most of a step, so the run
        ends within half a step of its budget, either side."""
        if self.fraction(budget) >= 1.0:
            return True
        return budget.kind == "seconds" and self.step_s > 0 and self.elapsed_s + self.step_s / 2 >= budget.amount

    def step_fraction(self, budget: Budget, step_tokens: int, step_seconds: float) -> float:
        """The fraction of the budget at the middle of the next step, which trains
        `step_tokens` and is expected to take `step_seconds` (the last step's time; 0 before
        the first): where that step reads its learning rate. The schedule there is about its
        mean over the step. Read at the step's start, the first step of a warmup trains at
        a learning rate of 0, a step whose gradient is thrown away (a run of 40 steps with
        4 of warmup then trains at 1.5 steps' worth of warmup lr instead of 2); read at its
        end, the last step of a triangle would."""
        used = {"steps": self.step + 0.5, "tokens": self.tokens + step_tokens / 2,
                "seconds": self.elapsed_s + step_seconds / 2}[budget.kind]
        return min(1.0, used / budget.amount)


def lr_factor(fraction: float, s: ScheduleConfig) -> float:
    """Multiplier of the peak learning rate at `fraction` (0..1) of the budget."""
    f = min(max(fraction, 0.0), 1.0)
    if s.lr == "triangle":
        # Cramming: start at a fraction of the peak, climb to the peak, fall linearly to 0.
        if f < s.triangle_peak:
            return s.triangle_start + (1.0 - s.triangle_start) * f / s.triangle_peak
        return (1.0 - f) / (1.0 - s.triangle_peak) if s.triangle_peak < 1.0 else 1.0
    if s.warmup > 0 and f < s.warmup:
        return f / s.warmup
    if s.lr == "constant":
        return 1.0
    if s.lr == "cosine":
        progress = (f - s.warmup) / max(1e-12, 1.0 - s.warmup)
        return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # warmup-stable-decay: flat until the last `decay` of the budget, then linear down.
    decay_start = 1.0 - s.decay
    if f < decay_start or s.decay == 0:
        return 1.0
    return 1.0 - (1.0 - s.min_lr_ratio) * (f - decay_start) / s.decay


def batch_size(fraction: float, s: ScheduleConfig, global_batch: int) -> int:
    """Sequences in the optimizer step at `fraction`: a linear ramp from `batch_start` to
    `global_batch`, rounded down to a multiple of `batch_start` (Megatron-LM's ramp grows in
    such increments too). The rounding depends on nothing of the layout, so every layout, and
    a run resumed under another one, takes the same steps; each layout's data-parallel
    ranks x micro-batch must divide `batch_start` (ember.layout.problems)."""
    if not s.batch_start or s.batch_ramp <= 0 or fraction >= s.batch_ramp:
        return global_batch
    size = s.batch_start + (global_batch - s.batch_start) * fraction / s.batch_ramp
    return min(global_batch, int(size) // s.batch_start * s.batch_start)
