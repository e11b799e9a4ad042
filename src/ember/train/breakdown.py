"""Where a step's time goes: computing, communicating where nothing hides it, and waiting
on the neighbouring pipeline stages (the bubble), read from the PyTorch profiler.

The profiler records, for the steps it is switched on for, when each piece of work ran:
on a GPU the CUDA kernels (NCCL's kernels are communication), on a CPU the aten operators
of every thread and gloo's collectives (which run on gloo's own threads). Then

- compute        = the union of the time computing (minus, per thread, the time that
                   thread spent inside a communication call);
- comm           = the union of the time communicating;
- exposed comm   = collectives (all-reduce, all-gather, reduce-scatter, ...) while nothing
                   computes: what overlapping failed to hide;
- bubble         = point-to-point sends and receives while nothing computes and no
                   collective runs: with pipeline parallelism, a stage waiting for its
                   neighbour's activations or gradients (the transfer itself is small).

Unions, not sums: work on two streams or threads at once counts once. This is a
measurement of one rank; `reduce_over_ranks` averages the ranks.

A thread is inside a communication call only where it is blocked in it. gloo's send and
receive are recorded on the thread that issued them from the issue to the return of their
`wait()`: a schedule that issues them asynchronously and waits later (PyTorch's
interleaved and zero-bubble schedules wait for their sends at the end of the step) computes
inside those spans. Work that starts inside such a span is the thread's, not the call's, so
a call blocks its thread only before the first piece of work started after its issue and
after the last one that ended before its return (`blocked`); that part is what is
subtracted from compute and, for sends and receives, what counts as communication. (A GPU
stream runs one kernel at a time: there nothing starts inside a kernel and nothing changes.)
"""

from __future__ import annotations

import bisect
import contextlib
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

Interval = tuple[int, int]  # nanoseconds

FIELDS = ("compute_s", "comm_s", "exposed_comm_s", "bubble_s")


def kind_of(name: str, on_device: bool) -> str | None:
    """'collective', 'p2p', 'compute' or None (bookkeeping that is neither)."""
    low = name.lower()
    if low.startswith("gloo:"):  # gloo:all_reduce, gloo:send, ...
        return "p2p" if low[5:] in ("send", "recv") else "collective"
    if "nccl" in low:  # ncclDevKernel_SendRecv, ncclDevKernel_AllGather_RING_LL, ...
        return "p2p" if any(word in low for word in ("sendrecv", "_send", "_recv")) else "collective"
    if on_device or low.startswith("aten::"):
        return "compute"
    return None


def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def minus(these: list[Interval], those: list[Interval]) -> list[Interval]:
    """Parts of the disjoint sorted `these` that no interval of `those` (same form) covers."""
    out, j = [], 0
    for start, end in these:
        while j < len(those) and those[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(those) and those[k][0] < end:
            if those[k][0] > cursor:
                out.append((cursor, those[k][0]))
            cursor = max(cursor, those[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in intervals)


def blocked(calls: list[Interval], work: list[Interval]) -> list[Interval]:
    """The parts of communication calls in which their thread is blocked, from the calls
    and the work (both of one thread): a call's span less the stretch from the first piece
    of work started inside it to the end of the last one that also ended inside it, where
    the thread went on working while the call was in flight."""
    work = sorted(work)
    starts = [start for start, _ in work]
    out = []
    for start, end in calls:
        first = last = None
        for i in range(bisect.bisect_right(starts, start), bisect.bisect_left(starts, end)):
            if first is None:
                first = work[i][0]
            if work[i][1] <= end:
                last = work[i][1] if last is None else max(last, work[i][1])
        if first is None:  # nothing started inside: blocked from issue to return
            out.append((start, end))
            continue
        out.append((start, first))
        if last is not None:
            out.append((last, end))
    return union(out)


def split_time(events: Iterable[tuple[str, str, int, int]]) -> dict[str, float]:
    """Seconds of compute, comm, exposed comm and bubble from (kind, thread, start_ns,
    end_ns) tuples, `kind` as `kind_of` gives it."""
    by_thread: dict[str, dict[str, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for kind, thread, start, end in events:
        by_thread[thread][kind].append((start, end))
    compute, collective, p2p = [], [], []
    for kinds in by_thread.values():
        waits = blocked(kinds["p2p"], kinds["compute"])
        comm_here = union(blocked(kinds["collective"], kinds["compute"]) + waits)
        compute += minus(union(kinds["compute"]), comm_here)  # a thread blocked in a call is not computing
        # A collective runs on its own (gloo's threads, NCCL's stream) for as long as it is
        # recorded; a send or receive's record only says when it was waited for.
        collective += kinds["collective"]
        p2p += waits
    compute, collective, p2p = union(compute), union(collective), union(p2p)
    exposed = minus(collective, compute)
    bubble = minus(minus(p2p, compute), collective)
    seconds = [length(compute), length(union(collective + p2p)), length(exposed), length(bubble)]
    return {name: value / 1e9 for name, value in zip(FIELDS, seconds)}


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints a line to stderr whenever a profile starts or stops; a training log
    should not carry two lines of it per logged step."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hide
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# Under `auto`, one logged step in this many is profiled: a profiled step pays for the
# profiler's start and stop, a device synchronisation and the parsing of its trace.
AUTO_EVERY = 10


def profiled(mode: str, world: int, logged_index: int) -> bool:
    """Whether the `logged_index`-th logged step (1, 2, ...) is profiled: `on` every one,
    `auto` the first and then one in AUTO_EVERY, under torchrun only, `off` none."""
    if mode == "on":
        return True
    return mode == "auto" and world > 1 and logged_index % AUTO_EVERY == 1


class StepProfiler:
    """`with profiler.step(): ...` records the steps it is enabled for; `read()` returns
    the seconds of each part since the last read ({} when nothing was recorded)."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity

        self.device, self.cuda = device, device.type == "cuda"
        self.activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self.enabled, self.available = False, True
        self._profiles: list = []  # read later, so the reading is not part of a timed step
        self._attempted = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._attempted += 1  # the same count on every rank, so every rank reduces the same keys
        if not self.available:
            yield
            return
        from torch.profiler import profile

        prof = profile(activities=self.activities)
        try:
            with _quiet_stderr():
                prof.__enter__()
        except Exception as err:  # noqa: BLE001 - no profiler (e.g. another one holds CUPTI): train on
            warnings.warn(f"ember: the step-time breakdown is off, the profiler did not start ({err}).")
            self.enabled = self.available = False
            yield
            return
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            with _quiet_stderr():
                prof.__exit__(None, None, None)
        self._profiles.append(prof)

    def _events(self, prof) -> Iterator[tuple[str, str, int, int]]:
        for event in prof.profiler.kineto_results.events():
            on_device = event.device_type() != torch.autograd.DeviceType.CPU
            kind = kind_of(event.name(), on_device)
            if kind is None:
                continue
            # A GPU stream is a "thread": NCCL's stream overlaps the compute streams.
            thread = (f"device{event.device_index()}:{event.device_resource_id()}" if on_device
                      else str(event.start_thread_id()))
            yield kind, thread, event.start_ns(), event.end_ns()

    def read(self) -> dict[str, float]:
        """Seconds of each part since the last read: {} when no step was to be profiled,
        NaN where the profiler could not record them."""
        totals = dict.fromkeys(FIELDS, 0.0) if self._attempted else {}
        for prof in self._profiles:
            for name, value in split_time(self._events(prof)).items():
                totals[name] += value
        if len(self._profiles) < self._attempted:
            totals = dict.fromkeys(FIELDS, float("nan"))
        self._profiles, self._attempted = [], 0
        return {name: round(value, 6) for name, value in totals.items()}


def reduce_over_ranks(values: dict[str, float], topo) -> dict[str, float]:
    """The mean of each value over all ranks (every rank must call it with the same keys)."""
    if topo.world == 1 or not values:
        return values
    names = sorted(values)
    tensor = torch.tensor([values[name] for name in names], dtype=torch.float64)
    topo.all_reduce(tensor, ("world",))
    return {name: round(float(v) / topo.world, 6) for name, v in zip(names, tensor)}
