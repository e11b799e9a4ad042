"""What each GPU can do at peak, found by the name `torch.cuda.get_device_name()` reports.

Peaks are dense tensor-core FLOP/s in bf16 with fp32 accumulation, without 2:4 sparsity
(NVIDIA's datasheets print the sparse figure, twice these, first). Cards without bf16
(V100, RTX 2080 Ti) list fp16 with fp32 accumulation. GeForce cards list the fp32-accumulate
rate, half of their fp16-accumulate figure, because training accumulates in fp32.
Memory is the nominal capacity on the datasheet; the driver reserves a little of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float  # dense, FLOP/s
    memory_gib: float
    pattern: str  # regex searched in the lower-cased device name


# Most specific first: the first pattern that matches wins ("gh200" before "h200",
# "h100.*pcie" before "h100"). A name that matches nothing is unknown (None), never guessed.
GPUS: tuple[GPU, ...] = (
    # Ampere data centre: "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"
    GPU("A100 SXM4 80GB", 312e12, 80, r"a100.*sxm.*80\s*gb"),
    GPU("A100 SXM4 40GB", 312e12, 40, r"a100.*sxm"),
    GPU("A100 PCIe 80GB", 312e12, 80, r"a100.*80\s*gb"),
    GPU("A100 PCIe 40GB", 312e12, 40, r"a100"),
    GPU("A800 SXM4 80GB", 312e12, 80, r"a800.*sxm"),
    GPU("A800 PCIe 80GB", 312e12, 80, r"a800.*80\s*gb"),
    GPU("A800 PCIe 40GB", 312e12, 40, r"a800"),
    # Hopper: "NVIDIA H100 80GB HBM3" is the SXM part; "NVIDIA H100 PCIe"; "NVIDIA H200"
    GPU("GH200", 989e12, 96, r"gh200"),
    GPU("H100 NVL", 835e12, 94, r"h100.*nvl"),
    GPU("H100 PCIe", 756e12, 80, r"h100.*pcie"),
    GPU("H100 SXM", 989e12, 80, r"h100"),
    GPU("H800 PCIe", 756e12, 80, r"h800.*pcie"),
    GPU("H800 SXM", 989e12, 80, r"h800"),
    GPU("H200 NVL", 835e12, 141, r"h200.*nvl"),
    GPU("H200 SXM", 989e12, 141, r"h200"),
    # Ada and Ampere inference cards: "NVIDIA L4", "NVIDIA L40S", "NVIDIA A10G"
    GPU("L40S", 362e12, 48, r"\bl40s\b"),
    GPU("L40", 181e12, 48, r"\bl40\b"),
    GPU("L4", 121e12, 24, r"\bl4\b"),
    # AWS's A10G trades tensor throughput for shader throughput: 70 TFLOP/s against the A10's 125.
    GPU("A10G", 70e12, 24, r"\ba10g\b"),
    GPU("A10", 125e12, 24, r"\ba10\b"),
    # GeForce: "NVIDIA GeForce RTX 4090"; variants (Ti, D, Laptop) differ, so match exactly.
    GPU("RTX 4090", 165.2e12, 24, r"rtx 4090$"),
    GPU("RTX 3090", 71e12, 24, r"rtx 3090$"),
    GPU("RTX 2080 Ti", 56.9e12, 11, r"rtx 2080 ti$"),
    # Volta, fp16 only: "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB"
    GPU("V100S PCIe 32GB", 130e12, 32, r"v100s"),
    GPU("V100 SXM2 32GB", 125e12, 32, r"v100.*sxm.*32\s*gb"),
    GPU("V100 SXM2 16GB", 125e12, 16, r"v100.*sxm"),
    GPU("V100 PCIe 32GB", 112e12, 32, r"v100.*32\s*gb"),
    GPU("V100 PCIe 16GB", 112e12, 16, r"v100"),
)


def find_gpu(device_name: str) -> GPU | None:
    """The table entry for a device name as torch reports it, or None if unknown."""
    name = device_name.strip().lower()
    for gpu in GPUS:
        if re.search(gpu.pattern, name):
            return gpu
    return None


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the named device; None for CPUs and unknown GPUs."""
    gpu = find_gpu(device_name)
    return gpu.peak_bf16_flops if gpu is not None else None
