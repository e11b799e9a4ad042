"""Decisions the loop takes between steps: whether a periodic action is due, and what the
per-step policies ask for.

A policy looks at every finished step and may ask the loop to save and stop, to stop, or
to roll back to a checkpoint. Policies read device values only on steps the loop already
synchronises (the logged ones), so they add no synchronisation, and they run on every rank
with the same inputs (the loss is reduced over all ranks), so all ranks take the same
decision. Stopping on SIGINT/SIGTERM is one such policy, the loss-spike guard another.
"""

from __future__ import annotations

import math
import signal
from collections import deque
from dataclasses import dataclass

import torch

from ember.budget import Budget
from ember.train.schedule import Progress

CONTINUE, STOP, HALT, ROLLBACK = "continue", "stop", "halt", "rollback"  # stop saves first; halt does not


class Every:
    """An interval in steps or seconds and when it last fired. Step intervals fall on
    multiples of the interval, so a resumed run evaluates and saves where the original did."""

    def __init__(self, interval: Budget, progress: Progress):
        self.interval = interval
        self.last_step, self.last_s = progress.step, progress.elapsed_s

    def due(self, progress: Progress) -> bool:
        if self.interval.kind == "steps":
            return progress.step % int(self.interval.amount) == 0
        return progress.elapsed_s - self.last_s >= self.interval.amount

    def done(self, progress: Progress) -> None:
        self.last_step, self.last_s = progress.step, progress.elapsed_s


@dataclass
class StepResult:
    """What one optimizer step reports to the policies (host values only)."""

    progress: Progress
    signal: int | None  # a stop signal any rank received (agreed across ranks)
    loss: torch.Tensor | None = None  # the step's mean loss over all ranks, on the device
    synced: bool = False  # the loop reads device values on this step anyway (a logged step)
    data_position: int = 0  # where the training data stands after this step


class Policy:
    def after_step(self, result: StepResult) -> str:
        return CONTINUE


class StopOnSignal(Policy):
    """SIGINT/SIGTERM become a request to save and stop at the next step boundary. A second
    Ctrl-C falls back to what it did before (the user insists: the process ends at once);
    a second SIGTERM is ignored, since Slurm signals torchrun and every worker of a step
    within milliseconds, and the first one's checkpoint must still be written."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is None:
            self.signal = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._old[signal.SIGINT])

    def _restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def __exit__(self, *exc):
        self._restore()

    def after_step(self, result: StepResult) -> str:
        if result.signal is not None:
            self.signal = result.signal  # another rank's, if this one was not signalled
            return STOP
        return CONTINUE


@dataclass
class Spike:
    step: int  # the first step whose loss was non-finite or a spike
    loss: float
    reason: str
    data_position: int  # the data after that step: a rollback skips to here


class SpikeGuard(Policy):
    """Non-finite losses and loss spikes (a loss more than `sigma` standard deviations above
    the mean of the last `window` steps, judged once `window // 4` steps are known). Losses
    stay on the device and are read together on synchronised steps. On a spike it asks for
    "rollback" (to the newest checkpoint before the spike, skipping the data up to it) or
    "halt" (end without saving the spiked state), as `action` says; after `max_rollbacks`
    rollbacks it halts."""

    def __init__(self, action: str, sigma: float, window: int, max_rollbacks: int = 5):
        self.action, self.sigma, self.max_rollbacks = action, sigma, max_rollbacks
        self.recent: deque[float] = deque(maxlen=window)
        self.pending: list[tuple[int, torch.Tensor, int]] = []
        self.spike: Spike | None = None
        self.rollbacks = 0

    def after_step(self, result: StepResult) -> str:
        if result.loss is None:
            return CONTINUE
        self.pending.append((result.progress.step, result.loss.detach(), result.data_position))
        if not result.synced:
            return CONTINUE
        values = torch.stack([loss for _, loss, _ in self.pending]).float().cpu().tolist()
        steps, self.pending = self.pending, []
        for (step, _, position), value in zip(steps, values):
            reason = self._judge(value)
            if reason:
                self.spike = Spike(step, value, reason, position)
                if self.action == "rollback" and self.rollbacks < self.max_rollbacks:
                    self.rollbacks += 1
                    return ROLLBACK
                return HALT
            self.recent.append(value)
        return CONTINUE

    def _judge(self, value: float) -> str:
        if not math.isfinite(value):
            return "non-finite loss"
        if len(self.recent) < max(4, self.recent.maxlen // 4):
            return ""
        mean = sum(self.recent) / len(self.recent)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / len(self.recent))
        if value > mean + self.sigma * max(std, 1e-3 * abs(mean)):
            return f"loss {value:.4g} above the mean {mean:.4g} of the last {len(self.recent)} steps by over {self.sigma:g} sd"
        return ""

    def rolled_back(self) -> None:
        """The steps after the checkpoint are undone: their pending losses go too."""
        self.pending = []
