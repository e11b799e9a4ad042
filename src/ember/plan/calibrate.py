"""`ember plan calibrate`: measure the machine this runs on and write a profile file
(`ember-plan-profile/1`, see plan/cluster.py) that `ember plan --profile` and `ember tune`
read.

What it measures:
- matmul throughput over a few shapes (every rank at once, the slowest rank counts: that is
  what each rank gets while all of them train). The best shape's rate is the peak the
  planner's efficiencies apply to: on a GPU in the table the datasheet peak stays (it is the
  MFU convention) and `matmul_eff` becomes best / datasheet; on anything else (a CPU, an
  unknown GPU) the best measured rate becomes the peak;
- memory bandwidth (a large copy), into `hbm_gbps` / `hbm_eff` the same way;
- under torchrun: all-reduce, all-gather, reduce-scatter and point-to-point by message size,
  reported as nccl-tests does (algbw = bytes / time; busbw = algbw x 2(n-1)/n for
  all-reduce, x (n-1)/n for all-gather and reduce-scatter, with bytes the whole buffer).
  The best all-reduce busbw sets the link the planner prices collectives on, the smallest
  message's time its per-collective latency, and the best all-gather and reduce-scatter
  busbw over it their `all_gather_ratio` and `reduce_scatter_ratio` (about 1 on NCCL, whose
  rings run all three alike; far less on gloo). With several nodes (WORLD_SIZE >
  LOCAL_WORLD_SIZE) the collectives run once inside each node (intra) and once over all
  ranks (inter; the planner drives one NIC per GPU, so per-GPU inter = busbw / ranks per node).
- under torchrun on one node: the host time an eager tensor-parallel block, and a block
  sharded with FSDP2 as ZeRO-1/2 and ZeRO-3 run it, add beyond their collectives
  (tune/host_cost.py), into the stack's `tp_host_s_per_layer`, `shard_host_s_per_layer` and
  `reshard_host_s_per_layer`.
- with `--model`: the model's matmul and attention shapes, and what one of its blocks spends
  outside them, as the stack's `eager_elementwise_scale` (plan/kernels.py).

Run alone it measures one process and leaves the links at the device's defaults.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from ember.atomic import write_text
from ember.config import ConfigError
from ember.hardware import machine_memory_gib
from ember.process import end_process_group

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIN_TIME = {True: 0.05, False: 0.5}  # seconds each measurement runs (quick, full)
# Each measurement runs REPEATS times and keeps its fastest: on a shared machine another
# process only ever slows a burst down, so the fastest is the machine's own rate (the
# measured runs the planner is checked against keep their fastest round too). On a 2-core
# machine the matmul rate of successive calibrations moved 21% with one burst and 2% with
# three (benchmarks/calibration_spread.py).
REPEATS = 3
# The host figures a calibration under torchrun measures (tune/host_cost.py) into the
# profile's stack section.
HOST_FIGURES = ("tp_host_s_per_layer", "shard_host_s_per_layer", "reshard_host_s_per_layer")
MATMUL_SIZES = {("cpu", True): (256, 512, 1024), ("cpu", False): (256, 512, 1024, 2048),
                ("cuda", True): (1024, 2048, 4096), ("cuda", False): (1024, 2048, 4096, 8192, 16384)}
COPY_BYTES = {("cpu", True): 2**25, ("cpu", False): 2**28, ("cuda", True): 2**28, ("cuda", False): 2**30}
# Causal attention (batch, heads, sequence, head size), forward and backward.
ATTENTION = {("cpu", True): (1, 4, 256, 64), ("cpu", False): (2, 8, 512, 64),
             ("cuda", True): (4, 16, 1024, 128), ("cuda", False): (8, 16, 4096, 128)}
MESSAGE_BYTES = {("cpu", True): [2**i for i in range(12, 23, 2)], ("cpu", False): [2**i for i in range(10, 27, 2)],
                 ("cuda", True): [2**i for i in range(12, 27, 2)], ("cuda", False): [2**i for i in range(10, 31, 2)]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, min_time: float, max_iters: int = 10_000) -> float:
    """Seconds per call of `fn`, after a warm-up call: the fastest of REPEATS bursts, each
    repeated until `min_time` has passed."""
    fn()
    _sync(device)
    return min(_burst(fn, device, min_time, max_iters) for _ in range(REPEATS))


def _burst(fn, device: torch.device, min_time: float, max_iters: int) -> float:
    if dist.is_initialized():  # every rank's burst at once: the rate each gets while all train
        dist.barrier()
    iters, start = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        if iters >= max_iters or (iters & (iters - 1)) == 0:  # look at the clock at powers of two
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time or iters >= max_iters:
                return elapsed / iters


def _slowest(value: float, device: torch.device) -> float:
    """The largest `value` (seconds) over all ranks."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_matmuls(device: torch.device, dtype: torch.dtype, sizes, min_time: float) -> list[dict]:
    """TFLOP/s of square and tall matmuls (M x K @ K x N), the slowest rank's."""
    from ember.plan.kernels import time_matmuls

    shapes = [(s, s, s, 1) for s in sizes] + [(4 * sizes[-1], sizes[-1], sizes[-1] // 4 or 1, 1)]
    rows = time_matmuls(shapes, device, dtype, lambda fn: _slowest(_timed(fn, device, min_time), device))
    return [{"m": m, "n": n, "k": k, "tflops": 2.0 * m * n * k / seconds / 1e12} for m, n, k, _, seconds in rows]


def measure_attention(device: torch.device, dtype: torch.dtype, shape, min_time: float) -> dict:
    """Causal scaled-dot-product attention (PyTorch SDPA, what ember's model runs), forward
    and backward, in TFLOP/s counted the planner's way: 4·b·h·s²·d/2 forward, 2.5x that
    backward."""
    from ember.plan.kernels import attention_step

    b, h, s, d = shape
    seconds = _slowest(_timed(attention_step(b, h, s, d, True, device, dtype), device, min_time), device)
    flops = 3.5 * 4.0 * b * h * s * s * d * 0.5
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "tflops": flops / seconds / 1e12}


def measure_copy(device: torch.device, nbytes: int, min_time: float) -> float:
    """GB/s of a device-to-device copy (read + write), the slowest rank's."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _slowest(_timed(lambda: dst.copy_(src), device, min_time), device)
    return 2.0 * nbytes / seconds / 1e9


def collective_call(kind: str, nbytes: int, n: int, device: torch.device, group):
    """A no-argument call running one `kind` collective over a buffer of `nbytes` in total."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: _all_gather(full, part, group=group)
    return lambda: _reduce_scatter(part, full, group=group)


# Newer PyTorch (2.13 here) names these all_gather_single and reduce_scatter_single and warns on
# the old names; older versions have only the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


def _agreed_time(fn, device: torch.device, min_time: float, max_iters: int, group) -> float:
    """Seconds per call of a collective `fn`, with every rank running the same number of calls
    (a count agreed from the slowest rank's first call), the slowest rank's total counting;
    the fastest of REPEATS such bursts."""
    fn()
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = _slowest(time.perf_counter() - start, device)
    iters = max(1, min(max_iters, int(min_time / max(first, 1e-7))))
    best = float("inf")
    for _ in range(REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, _slowest((time.perf_counter() - start) / iters, device))
    return best


def measure_collectives(sizes, device: torch.device, min_time: float, group=None) -> dict[str, list[dict]]:
    """busbw by message size for all-reduce, all-gather and reduce-scatter over `group`."""
    n = dist.get_world_size(group)
    out: dict[str, list[dict]] = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        rows = []
        for nbytes in sizes:
            seconds = _agreed_time(collective_call(kind, nbytes, n, device, group), device, min_time, 1000, group)
            algbw = nbytes / seconds / 1e9
            rows.append({"bytes": nbytes, "time_s": seconds, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * BUS_FACTOR[kind](n)})
        out[kind] = rows
    return out


def measure_p2p(sizes, device: torch.device, peer: int, min_time: float) -> list[dict]:
    """One-way send bandwidth between rank 0 and `peer` (half a ping-pong); the other ranks wait."""
    rank, rows = dist.get_rank(), []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)

        def ping_pong():
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        seconds = _agreed_time(ping_pong, device, min_time, 1000, None) / 2
        rows.append({"bytes": nbytes, "time_s": seconds, "busbw_gbps": nbytes / seconds / 1e9})
    return rows


def best_bus(rows: list[dict]) -> float:
    return max(row["busbw_gbps"] for row in rows)


def describe_device(device: torch.device, local_world: int, idle_bytes: int | None = None) -> tuple[object, dict]:
    """(the GPU table's row or None, and name / memory_gib / sms of what was measured)."""
    from ember.hardware import find_gpu

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        return find_gpu(name), {"name": name, "memory_gib": props.total_memory / 2**30,
                                "sms": props.multi_processor_count}
    # The processes of one machine share its memory and its cores.
    return None, {"name": "cpu (calibrated)", "memory_gib": machine_memory_gib() / local_world,
                  "sms": torch.get_num_threads(), "runtime_gib": idle_bytes / 2**30 if idle_bytes else None}


def build_profile(known, device: dict, dtype_name: str, matmuls: list[dict], copy_gbps: float,
                  collectives: dict, world: int, local_world: int, attention: dict | None = None,
                  host_blocks: dict | None = None) -> dict:
    """The profile file's content from the measurements (see the module docstring). `known`
    is the GPU table's row for the device (None for CPUs and unknown GPUs)."""
    from ember.hardware import GPU

    best = max(matmuls, key=lambda row: row["tflops"])
    if known is not None:
        gpu = {"name": known.name, "matmul_eff": round(best["tflops"] * 1e12 / known.peak_bf16_flops, 4),
               "hbm_eff": round(copy_gbps / known.hbm_gbps, 4)}
        if gpu["matmul_eff"] > 1:  # clocked above its table entry: a profile's efficiencies are at most 1
            gpu |= {"peak_bf16_flops": best["tflops"] * 1e12, "matmul_eff": 1.0}
        if gpu["hbm_eff"] > 1:
            gpu |= {"hbm_gbps": round(copy_gbps, 2), "hbm_eff": 1.0}
        base = known
    else:
        gpu = {"name": device["name"], "peak_bf16_flops": best["tflops"] * 1e12,
               "memory_gib": round(device["memory_gib"], 2), "sms": device["sms"], "hbm_gbps": round(copy_gbps, 2),
               "matmul_eff": 1.0, "hbm_eff": 1.0}
        if device.get("runtime_gib"):
            gpu["runtime_gib"] = round(device["runtime_gib"], 3)
        base = GPU(device["name"], gpu["peak_bf16_flops"], device["memory_gib"], "$^")
    if attention is not None:
        gpu["attn_eff"] = attention_efficiency(attention, base)
    links = {"gpus_per_node": local_world, "intra_gbps": base.intra_gbps, "inter_gbps": base.inter_gbps}
    intra, inter = collectives.get("intra"), collectives.get("inter")
    if intra:
        _set_link(links, "intra", best_bus(intra["all_reduce"]), intra["all_reduce"][0]["time_s"], known)
        for kind in ("all_gather", "reduce_scatter"):  # their rings' rate beside the all-reduce's
            if intra.get(kind):
                links[f"{kind}_ratio"] = round(best_bus(intra[kind]) / best_bus(intra["all_reduce"]), 4)
    if inter:
        per_gpu = best_bus(inter["all_reduce"]) / local_world
        _set_link(links, "inter", per_gpu, inter["all_reduce"][0]["time_s"], known)
    if known is None:
        gpu["intra_gbps"], gpu["inter_gbps"] = links["intra_gbps"], links["inter_gbps"]
    processes = f"{world} process{'es' if world > 1 else ''}"
    source = (f"calibrated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {socket.gethostname()} "
              f"({processes}, {dtype_name})")
    measured = {"dtype": dtype_name, "world_size": world, "local_world_size": local_world,
                "matmul": matmuls, "best_matmul_tflops": best["tflops"], "copy_gbps": copy_gbps,
                "attention": attention, "host_blocks": host_blocks, **collectives}
    profile = {"format": "ember-plan-profile/1", "source": source, "gpu": gpu, "links": links, "measured": measured}
    stack = {}
    for block in (host_blocks or {}).values():  # {"tp": {...}, "sharded": {...}}
        stack |= {key: block[key] for key in HOST_FIGURES if key in block}
    if device["name"] == "cpu (calibrated)":
        # gloo's collectives run on the same cores as the compute they would hide behind,
        # and so does the host's dispatch: on a CPU nothing overlaps.
        stack |= {"overlap_grad_reduce": False, "overlap_param_gather": False, "host_overlaps": False}
    if stack:
        profile["stack"] = stack
    return profile


def attention_efficiency(attention: dict, gpu) -> float:
    """The `attn_eff` under which the planner's flash-attention rate (plan/flash.py scales it
    by sequence and head size) equals the measured one at the measured shape."""
    from dataclasses import replace

    from ember.plan.flash import flash_efficiency

    shape_factor = flash_efficiency(attention["seq"], attention["head_dim"], replace(gpu, attn_eff=1.0))
    return round(attention["tflops"] * 1e12 / gpu.peak_bf16_flops / shape_factor, 4)


def _set_link(links: dict, which: str, busbw_gbps: float, latency_s: float, known) -> None:
    """A measured bus bandwidth: a table GPU keeps its link rate and gets the measured share
    of it; anything else gets the measured rate at full efficiency."""
    if known is not None:
        links[f"{which}_eff"] = round(busbw_gbps / links[f"{which}_gbps"], 4)
    else:
        links[f"{which}_gbps"], links[f"{which}_eff"] = round(busbw_gbps, 4), 1.0
    links[f"{which}_latency_s"] = latency_s


def _collective_sections(device: torch.device, quick: bool, world: int, local_world: int) -> dict:
    sizes, min_time = MESSAGE_BYTES[(device.type, quick)], MIN_TIME[quick]
    rank = dist.get_rank()
    out: dict = {}
    if world > local_world:
        nodes = [list(range(i, i + local_world)) for i in range(0, world, local_world)]
        groups = [dist.new_group(ranks) for ranks in nodes]  # every rank creates every group
        if local_world > 1:  # one GPU per node has no intra-node link to measure
            out["intra"] = measure_collectives(sizes, device, min_time, groups[rank // local_world])
        out["inter"] = measure_collectives(sizes, device, min_time)
        out["inter"]["p2p"] = measure_p2p(sizes, device, local_world, min_time)
    else:
        out["intra"] = measure_collectives(sizes, device, min_time)
    if local_world > 1:
        out["intra"]["p2p"] = measure_p2p(sizes, device, 1, min_time)
    return out


def calibrate(out: Path, dtype: str | None = None, quick: bool = False, measure_host_blocks=None,
              model_plan: tuple | None = None, block_step=None) -> dict | None:
    """Measure, and on rank 0 write the profile to `out`; returns the profile on rank 0.
    `measure_host_blocks(device, iters)`: the host cost of a tensor-parallel and of a sharded
    block (ember.tune.host_cost, which `ember plan calibrate` passes in), HOST_FIGURES.
    `model_plan` (model, GPUs or None for this node, TrainShape): also time the matmuls the
    planner prices for that model's layouts (plan/kernels.py) into the profile's `matmuls`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world > 1 and world % local_world:
        raise ConfigError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}.")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dtype is None:  # what the trainer would compute in here
        from ember.device import autocast_dtype, precision_name

        dtype = precision_name(autocast_dtype("auto", device))
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be bf16, fp16 or fp32, not {dtype!r}.")
    # Run alone, the node is every GPU here (one profile serves `ember plan --gpus 8`).
    per_node = local_world if world > 1 else (torch.cuda.device_count() if device.type == "cuda" else 1)
    if model_plan is not None:  # a model with no layout here is refused before anything is measured
        from ember.plan.kernels import check_model_plan

        check_model_plan(model_plan, per_node)
    started = world > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from ember.device import resident_bytes

    idle = resident_bytes()  # before any measurement's tensors: what an idle training process holds
    try:
        torch_dtype = DTYPES[dtype]
        quick_min = MIN_TIME[quick]
        matmuls = measure_matmuls(device, torch_dtype, MATMUL_SIZES[(device.type, quick)], quick_min)
        copy_gbps = measure_copy(device, COPY_BYTES[(device.type, quick)], quick_min)
        attention = measure_attention(device, torch_dtype, ATTENTION[(device.type, quick)], quick_min)
        collectives = _collective_sections(device, quick, world, local_world) if world > 1 else {}
        host_blocks = None
        if measure_host_blocks is not None and world > 1 and world == local_world:  # tp stays in a node
            host_blocks = measure_host_blocks(device, 50 if quick else 300)
        profile = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            known, info = describe_device(device, per_node, idle)
            profile = build_profile(known, info, dtype, matmuls, copy_gbps, collectives, world, per_node,
                                    attention, host_blocks)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text(out, json.dumps(profile, indent=2) + "\n")
        if model_plan is not None:
            from ember.plan.kernels import add_model_kernels

            add_model_kernels(out, profile, model_plan, per_node, device, torch_dtype,
                              lambda fn: _slowest(_timed(fn, device, quick_min / 10), device), block_step)
        return profile
    finally:
        if started:
            end_process_group()
