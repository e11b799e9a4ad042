"""Time in a run: the clock every rank agrees on, and the throughput of the logged window.

Ranks must take the same decisions (stop, evaluate, save) at the same step, so under
torchrun they adopt the slowest rank's clock and stop when any rank was signalled; both
travel in one small all-reduce per step over gloo, off the GPU's stream. Its latency
grows with the ranks (gloo passes it around a ring of hosts), but only the host waits: a step
that is not logged never waits for the device, so the GPU keeps working through the steps
already queued as long as the host's own time per step stays below the GPU's. Throughput
(tokens/s, MFU) is measured over the steps between two log lines, the last of which is
synchronised so that its time covers the work it queued.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ember.device import synchronize
from ember.parallel.mesh import Topology


class Clock:
    """Seconds of the run so far, carried over from a checkpoint and agreed across ranks."""

    def __init__(self, topo: Topology, elapsed_s: float = 0.0):
        self.topo = topo
        self._start = time.perf_counter() - elapsed_s

    def local(self) -> float:
        return time.perf_counter() - self._start

    def agree(self, signal: int | None, step_s: float) -> tuple[float, int | None, float]:
        """(elapsed seconds, a stop signal, the step's seconds) as every rank sees them: the
        slowest rank's clock and step, and the signal any rank received."""
        if self.topo.world == 1:
            return self.local(), signal, step_s
        state = torch.tensor([self.local(), float(signal or 0), step_s], dtype=torch.float64)
        self.topo.all_reduce(state, ("world",), op=dist.ReduceOp.MAX)
        return float(state[0]), (int(state[1]) or None), float(state[2])


class Throughput:
    """Tokens, model FLOPs and seconds of the steps since the last log line."""

    def __init__(self, device: torch.device, peak_flops: float | None):
        self.device, self.peak = device, peak_flops
        self._reset()

    def _reset(self) -> None:
        self.tokens, self.flops, self.seconds = 0, 0.0, 0.0

    def start(self) -> None:
        self._begin = time.perf_counter()

    def stop(self, tokens: int, flops: float, synchronise: bool) -> None:
        """End one step; a step that is logged waits for the device first, so that the
        window's time covers the work it queued."""
        if synchronise:
            synchronize(self.device)
        self.seconds += time.perf_counter() - self._begin
        self.tokens += tokens
        self.flops += flops

    def read(self) -> dict[str, float | None]:
        """tokens/s and MFU of the window (MFU only on a device with a known peak); resets it."""
        seconds = max(self.seconds, 1e-9)
        out = {"tokens_per_s": self.tokens / seconds,
               "mfu": self.flops / seconds / self.peak if self.peak else None}
        self._reset()
        return out
