"""The matmuls and attention of one model's layouts, timed on this device (`ember plan
calibrate --model`).

The planner prices a matmul from its shape (plan/timing.py: tiles, waves, the K loop), a
model that is smooth in the shape and fitted to a few large GEMMs per GPU, and a fused
attention from its FLOPs at an efficiency that grows with the sequence and the head size,
set by one measured shape. Libraries choose a kernel per shape, and how far a given shape
lands from the smooth curve on a given device and library version is not something a
formula can know (on a CPU, attention over short sequences runs at twice the rate the
curve gives it). Timing the exact shapes a model's layouts run takes that part of the error
out for that model on that machine; communication and the host's calls are still modelled.

So a calibration given a model asks the planner which matmuls and attention it prices for
that model's layouts that fit (every (m, n, k, batch) and every (batch, heads, sequence,
head size, causal) it looks up, the backward's too), times each one here, and stores the
seconds in the profile (`matmuls`, `attention`); the planner then takes the measured time
for those exact shapes (hardware.ShapeTimes) and its model for the rest. The times are of
the calibration's dtype (bf16 on GPUs that have it); FP8 matmuls are always modelled. Each
matmul is timed as a plain (m x k) @ (k x n) product, while a backward pass multiplies
transposed operands, which libraries run as other kernels at similar rates; each attention
as PyTorch's SDPA forward and backward, split between the passes as the model splits it.

The rest of a block (norms, activations, rotary embedding, residual adds, casts, and on a
CPU each operator's dispatch and the autograd engine) the planner prices by the bytes its
fused kernels would move at the copy rate. Eager PyTorch runs it as many operators, some
through fp32 intermediates, and on a CPU at one thread bound by arithmetic and per-operator
overhead rather than by bandwidth: 3-4 times that price on the 2-core CPU this project is
developed on (benchmarks/cpu_step_parts.py). So the calibration also runs one of ember's
blocks of the model (the trainer's code, uncompiled) forward and backward at the best
layout's micro-batch under the PyTorch profiler, sums the time of every operator that is
not a matmul or attention, and stores its ratio to the planner's price of the block's
elementwise work (less the launches it prices apart where the host shares the cores) as the
stack's `eager_elementwise_scale`. The planner scales the blocks' elementwise work by it
where ember runs them uncompiled (Stack.elementwise_scale); a compiled block fuses that work
into kernels the calibration did not run, and other stacks run their own kernels.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ember.atomic import write_text
from ember.config import ConfigError
from ember.hardware import ShapeTimes
from ember.plan.layout import TrainShape
from ember.plan.search import rank, runnable, search
from ember.plan.flash import flash_s
from ember.plan.predict import one_block
from ember.plan.timing import matmul_s


# Matmuls the model prices above this are left to it: with many waves of tiles and a long K
# loop a GEMM runs near the steady rate the model gives it (its error is in small and
# middling shapes), while the largest cost the most to time and to hold (Llama 3 8B's output
# layer at 16 x 8192 tokens multiplies a 33 GB logits gradient). With the cap, Llama 3 8B on
# a node of 8 at sequence 8192 and batch 512 leaves 205 shapes.
MAX_TIMED_S = 0.02
# Attention shapes are few (one per micro-batch and tensor-parallel degree), and the fitted
# curve errs most where they are large for the device (short sequences on a CPU, where it
# prices a micro-batch of 16 at 2.3 times its time): they are timed up to ten times longer.
# On an H100, Llama 3 8B's micro-batch of 16 at sequence 8192 models at about 0.15 s.
MAX_TIMED_ATTENTION_S = 0.2


def priced_shapes(model, cluster, shape: TrainShape) -> tuple[list[tuple], list[tuple]]:
    """Every matmul (m, n, k, batch) and every fused attention (batch, heads, sequence, head
    size, causal) the planner prices for the layouts of `model` on `cluster` that fit (or,
    if none fits, for all of them) and models at MAX_TIMED_S or less (attention:
    MAX_TIMED_ATTENTION_S), each in a stable order."""
    result = search(model, cluster, shape)
    layouts = [p.layout for p in (result.ranked or result.too_big)]
    recorder = _Recorder()
    gpu = replace(cluster.gpu, matmul_times=recorder, attention_times=recorder)
    rank(model, replace(cluster, gpu=gpu), shape, layouts)
    plain = replace(cluster.gpu, matmul_times=None, attention_times=None)
    matmuls = sorted(s for s in recorder.shapes if len(s) == 4 and min(s) >= 1
                     and matmul_s(*s[:3], plain, s[3]) <= MAX_TIMED_S)
    attention = sorted(s for s in recorder.shapes if len(s) == 5 and min(s[:4]) >= 1
                       and flash_s(*s, plain) <= MAX_TIMED_ATTENTION_S)
    return matmuls, attention


class _Recorder(ShapeTimes):
    """A table with no times that notes every shape the planner looks up in it (every bf16
    matmul and every fused attention it prices: FP8 matmuls never look). Equal only to
    itself, so the planner's per-layer caches price afresh for it rather than answer from
    an earlier GPU's entries."""

    def __init__(self):
        super().__init__([])
        self.shapes: set[tuple[int, ...]] = set()

    def get(self, *shape: float) -> None:
        self.shapes.add(tuple(round(v) for v in shape))
        return None

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def block_micro_batch(model, cluster, shape: TrainShape) -> int:
    """The micro-batch one block is timed at: the best layout's, so its tensors are the size
    training runs."""
    result = search(model, cluster, shape)
    return (result.ranked or result.too_big)[0].layout.micro_batch


def block_rest_s(step, device: torch.device, passes: int = 5, bursts: int = 3) -> float:
    """Seconds per call of `step` (a block's forward and backward) spent outside its matmuls
    and attention: the PyTorch profiler's self time of every other operator, on the device's
    clock for a GPU (its kernels), on the host's for a CPU (where an operator's time includes
    the dispatcher's). Measured directly rather than as the block less its timed matmuls: on
    a small model the rest is a tenth of the block, less than the timings' noise. The median
    of `bursts` bursts of `passes` calls: on a shared machine (the other ranks of a
    calibration on the same cores) one burst's rest moved by half."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rests = []
    for _ in range(bursts):
        with profile(activities=activities) as prof:
            for _ in range(passes):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rests.append(sum(getattr(event, field) for event in prof.key_averages()
                         if event.key not in MATMUL_OPS and "scaled_dot_product" not in event.key) / 1e6 / passes)
    return sorted(rests)[len(rests) // 2]


# The operators a block's matmuls run as (linear and matmul dispatch to these).
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def elementwise_scale(rest_s: float, priced, host_shares_cores: bool) -> float | None:
    """The measured rest of a block over the planner's price of its elementwise work, less
    what the planner prices apart: its launches where the host's time adds to the device's
    (a CPU, whose operator times include their dispatch). None when nothing is left (noise),
    which keeps the planner's price."""
    rest = rest_s - (priced.launch if host_shares_cores else 0.0)
    return rest / priced.elementwise if rest > 0 and priced.elementwise > 0 else None


def time_matmuls(shapes, device: torch.device, dtype: torch.dtype, timer) -> list[list]:
    """[m, n, k, batch, seconds] of each shape: (m x k) @ (k x n), `batch` times in one
    batched call. `timer(fn)` gives seconds per call (the calibration's, which every rank
    runs at once and which keeps the slowest rank's time). A shape that does not fit in
    this device's memory is left to the model."""
    rows = []
    for m, n, k, batch in shapes:
        lead = (batch,) if batch > 1 else ()
        try:
            a = torch.randn(*lead, m, k, device=device, dtype=dtype)
            b = torch.randn(*lead, k, n, device=device, dtype=dtype)
            rows.append([m, n, k, batch, timer(lambda: torch.matmul(a, b))])
        except torch.OutOfMemoryError:
            continue
        finally:
            a = b = None
    return rows


def time_attention(shapes, device: torch.device, dtype: torch.dtype, timer) -> list[list]:
    """[batch, heads, sequence, head size, causal, seconds] of each shape: PyTorch's scaled
    dot-product attention (what ember's model runs), forward and backward. As for matmuls, a
    shape that does not fit is left to the model."""
    rows = []
    for shape in shapes:
        try:
            rows.append([*shape, timer(attention_step(*shape, device, dtype))])
        except torch.OutOfMemoryError:
            continue
    return rows


def attention_step(b: int, heads: int, s: int, d: int, causal: bool, device: torch.device, dtype: torch.dtype):
    """One call of PyTorch's scaled dot-product attention, forward and backward, on random
    (b, heads, s, d) inputs made once."""
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        torch.autograd.grad(out, (q, k, v), grad)

    return step


def check_model_plan(model_plan: tuple, per_node: int) -> None:
    """What `add_model_matmuls` would refuse after the measurements, refused before them:
    GPUs that do not fill whole nodes, or a model and batch with no layout on them."""
    from ember.hardware import GPU
    from ember.plan.cluster import Cluster
    from ember.plan.comm import Links

    model, gpus, shape = model_plan
    if gpus is not None and gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus {gpus} does not fill whole nodes of {per_node}; use a multiple of {per_node}.")
    sizes_only = Cluster(GPU("any", 1.0, 1.0, "$^"), gpus or per_node, Links(per_node, 1.0, 1.0))
    runnable(model, sizes_only, shape)


def add_model_kernels(out: Path, profile: dict | None, model_plan: tuple, per_node: int, device: torch.device,
                      dtype: torch.dtype, timer, block_step=None) -> None:
    """The calibration's last step: every rank times the shapes at once (`timer` keeps the
    slowest rank's time); rank 0 (`profile` given) adds them to the profile it wrote to
    `out` and writes it again. `model_plan`: (model, GPUs or None for this node, shape).
    `block_step(model, micro_batch, seq, device, dtype)`: a call that runs one of ember's
    blocks of the model forward and backward (ember.tune.host_cost), to measure the stack's
    `eager_elementwise_scale`; without it the blocks' elementwise work stays modelled."""
    from ember.plan.cluster import make_cluster

    if dist.is_initialized():
        dist.barrier()  # rank 0 has written the profile the shapes are found with
    model, gpus, shape = model_plan
    cluster = make_cluster(None, gpus or per_node, profile=out)
    matmuls, attention = priced_shapes(model, cluster, shape)
    rows = time_matmuls(matmuls, device, dtype, timer)
    attention_rows = time_attention(attention, device, dtype, timer)
    block = None
    if block_step is not None:
        micro_batch = block_micro_batch(model, cluster, shape)
        try:
            step = block_step(model, micro_batch, shape.seq_len, device, dtype)
            block = (micro_batch, block_rest_s(step, device)) if step is not None else None
        except torch.OutOfMemoryError:
            pass
        step = None
    if profile is not None:
        about = {"model": model.name, "gpus": cluster.n_gpus, "seq_len": shape.seq_len,
                 "global_batch": shape.global_batch, "dtype": profile["measured"]["dtype"]}
        profile["matmuls"] = {**about, "times": rows}
        profile["attention"] = {**about, "times": attention_rows}
        write_text(out, json.dumps(profile, indent=2) + "\n")
        if block is not None:
            _add_block(out, profile, model, gpus or per_node, shape, *block)


def _add_block(out: Path, profile: dict, model, gpus: int, shape: TrainShape, micro_batch: int,
               rest_s: float) -> None:
    """The block's measured rest beside its price: the stack's `eager_elementwise_scale`, and
    the figures it came from under `measured.block`."""
    from ember.plan.cluster import make_cluster

    cluster = make_cluster(None, gpus, profile=out)
    shape = replace(shape, precision=profile["measured"]["dtype"])  # the precision the block ran in
    priced = one_block(model, cluster, shape, micro_batch)
    scale = elementwise_scale(rest_s, priced, not cluster.stack.host_overlaps)
    profile["measured"]["block"] = {"model": model.name, "micro_batch": micro_batch, "seq_len": shape.seq_len,
                                    "rest_s": rest_s, "elementwise_s": priced.elementwise,
                                    "launch_s": priced.launch, "scale": scale}
    if scale is not None:
        profile.setdefault("stack", {})["eager_elementwise_scale"] = round(scale, 4)
    write_text(out, json.dumps(profile, indent=2) + "\n")
