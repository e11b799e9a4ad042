"""Which device a run uses, in which precision, and what that device can do at peak."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ember.config import ConfigError
from ember.hardware import peak_flops


def pick_device(name: str = "auto", setting: str = "train.device") -> torch.device:
    """The device `name` means; `setting` is what the user wrote it as, for the error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{setting} {name!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    auto = "--device auto" if setting.startswith("--") else f"{setting}=auto"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting} asks for CUDA but this machine has no CUDA GPU; use {auto}.")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{setting} asks for Apple's MPS but this machine has none; use {auto}.")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{setting} {name!r} is a device ember does not run on; use auto, cpu, cuda or cuda:N.")
    return device


def use_device(device: torch.device) -> None:
    """Make `device` the current CUDA device (kernels and allocations of `cuda` without
    an index land there, not on GPU 0), let fp32 matmuls use TF32 tensor cores, as
    nanoGPT and most training code do (10 mantissa bits in the multiply, fp32
    accumulation), and order SDPA's kernels for the GPU (`attention_priority`). Nothing
    on other devices."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    # The fp32_precision settings replace allow_tf32 from PyTorch 2.9 (the old flags warn).
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    prefer_attention_kernels(torch.cuda.get_device_capability(device))


def attention_priority(capability: tuple[int, int]) -> list[SDPBackend] | None:
    """SDPA's kernel order for a CUDA device of `capability`, or None to keep PyTorch's.
    Hopper (9.x): cuDNN's attention first, then FlashAttention-2, memory-efficient, math.
    cuDNN's kernels outrun FlashAttention-2 on Hopper, but published measurements have them
    slower on Ampere and Blackwell, so elsewhere PyTorch's own order stands."""
    if capability[0] != 9:
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


_KERNEL_ORDER: list = []  # the context that holds the order, kept open for the process


def prefer_attention_kernels(capability: tuple[int, int]) -> None:
    """Set `attention_priority` once for the process: a global setting, so backward and
    recomputation in checkpointed blocks pick the same kernels as the forward did."""
    order = attention_priority(capability)
    if order is None or _KERNEL_ORDER:
        return
    context = sdpa_kernel(order, set_priority=True)
    context.__enter__()
    _KERNEL_ORDER.append(context)  # never exited: exiting (or collecting it) restores the old order


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default, fp16 (with loss scaling, ember.train.loss_scale)
    on CUDA GPUs without bf16 tensor cores (before Ampere: V100, T4, RTX 20xx, where bf16
    would be emulated); fp32 (None) elsewhere unless asked for. (A CPU with AVX512-BF16 or
    AMX runs bf16 matmuls about twice as fast as fp32, and larger models train faster under
    it, but a small model's loss suffers: see benchmarks/cpu_bf16.py; so on a CPU bf16 is
    the user's choice, not the default.)"""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "fp16" or (precision == "auto" and not cuda_has_bf16(device)):
        return torch.float16
    if device.type == "cuda" and not cuda_has_bf16(device):
        raise ConfigError(f"train.precision=bf16 needs bf16 tensor cores, which {device_name(device)} lacks "
                          "(PyTorch would emulate them, many times slower); use train.precision=fp16 or auto.")
    return torch.bfloat16


def precision_name(dtype: torch.dtype | None) -> str:
    """The name of an `autocast_dtype` result: "fp32" (no autocast), "fp16" or "bf16"."""
    return {None: "fp32", torch.float16: "fp16"}.get(dtype, "bf16")


def cuda_has_bf16(device: torch.device) -> bool:
    """Whether the CUDA device multiplies bf16 on its tensor cores (compute capability 8+)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def autocast_forward(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Run `module`'s forward under `autocast(device, dtype)`, in place on the instance, for
    modules that something else calls (pipeline stages run by a schedule). Only the forward:
    backward then follows the dtypes the forward chose, as in a plain autocast region."""
    if dtype is None:
        return
    forward = module.forward

    def forward_under_autocast(*args, **kwargs):
        with autocast(device, dtype):
            return forward(*args, **kwargs)

    module.forward = forward_under_autocast


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of the device, or None where it is not known (CPUs)."""
    return peak_flops(device_name(device)) if device.type == "cuda" else None


def _proc_status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux)."""
    return _proc_status_bytes("VmRSS")


def _stat_bytes(path: str, *fields: str) -> int | None:
    """The sum of `fields` in a "name value" file (/proc/meminfo in kB, a cgroup's memory.stat
    in bytes); None if the file or a field is missing."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name.rstrip(":") in fields:
                    found[name.rstrip(":")] = int(rest.split()[0]) * (1024 if rest.rstrip().endswith("kB") else 1)
    except (OSError, ValueError, IndexError):
        return None
    return sum(found.values()) if len(found) == len(fields) else None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # missing, or "max" (no limit)
        return None


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes this process can still allocate on `device` now, or None where that is not known.
    On CUDA, the device's free memory plus the caching allocator's own free blocks. On a CPU,
    what the kernel could still hand out (its estimate of available memory, and free swap),
    within the container's limit (cgroup v2 or v1) where one is set; a cgroup's usage counts
    page cache, which it would reclaim, so its inactive file pages count as available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    machine = _stat_bytes("/proc/meminfo", "MemAvailable", "SwapFree")
    known = [machine] if machine is not None else []
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage, stat, cache in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                                       "/sys/fs/cgroup/memory.stat", "inactive_file"),
                                      (v1 + "limit_in_bytes", v1 + "usage_in_bytes", v1 + "stat",
                                       "total_inactive_file")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 2**60:  # v1 writes "no limit" as a huge number
            known.append(max(cap - used + (_stat_bytes(stat, cache) or 0), 0))
    return min(known) if known else None


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak-memory counter again: the CUDA allocator's, or elsewhere the process's
    peak resident set (Linux resets it on writing 5 to /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: the peak stays the process's lifetime peak


def peak_memory_bytes(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`: allocated GPU memory on CUDA, the process's
    peak resident set elsewhere."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return float(peak)


def peak_reserved_bytes(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory` as `ember plan` predicts it: on CUDA what the
    caching allocator reserved (allocated plus its cached, fragmented blocks), elsewhere the
    process's peak resident set."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device))
    return peak_memory_bytes(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Seconds spent in the phases of the steps it is enabled for: CUDA events on a GPU
    (read once the step is synchronised, so timing adds no wait), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = False
        self._events: list[tuple[str, object, object]] = []
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            begin = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - begin

    def read(self) -> dict[str, float]:
        """{phase}_s of the timed steps since the last read; call after synchronising."""
        for name, start, end in self._events:
            self._seconds[name] += start.elapsed_time(end) / 1000
        out = {f"{name}_s": round(value, 6) for name, value in self._seconds.items()}
        self._events, self._seconds = [], defaultdict(float)
        return out


NO_TIMER = PhaseTimer(torch.device("cpu"))  # never enabled
