"""Decisions the loop takes between steps: whether a periodic action is due, and what the
per-step policies ask for.

A policy looks at every finished step and may ask the loop to save and stop. Policies see
only what the step already brought to the host, so they add no device synchronisation,
and they run on every rank with the same inputs, so all ranks take the same decision.
Stopping on SIGINT/SIGTERM is one such policy; a loss-spike rollback would be another.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ember.config import Budget
from ember.train.schedule import Progress

CONTINUE, STOP = "continue", "stop"


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


class Policy:
    def after_step(self, result: StepResult) -> str:
        return CONTINUE


class StopOnSignal(Policy):
    """SIGINT/SIGTERM become a request to save and stop at the next step boundary; a second
    signal falls back to the default behaviour (the process ends at once)."""

    def __init__(self):
        self.signal: int | None = None
        self._old: dict = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum
        self._restore()

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
