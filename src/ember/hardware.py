"""What each GPU can do, found by the name `torch.cuda.get_device_name()` reports or by the
short name a user types (`--gpu H100`).

Peaks are dense tensor-core FLOP/s in bf16 with fp32 accumulation, without 2:4 sparsity
(NVIDIA's datasheets print the sparse figure, twice these, first). Cards without bf16
(V100, RTX 2080 Ti; `bf16` false) list fp16 with fp32 accumulation, which ember's trainer
runs with loss scaling. GeForce cards list the fp32-accumulate
rate, half of their fp16-accumulate figure, because training accumulates in fp32.
Memory is the nominal capacity on the datasheet; the driver reserves a little of it.

The planner also needs what the datasheets say about memory and links, and two measured
efficiencies; all are per GPU and one direction:
- `hbm_gbps`: memory bandwidth (GB/s); `sms`: streaming multiprocessors (matmul tiles
  are spread over them, see plan/timing.py);
- `intra_gbps`: the link to GPUs in the same node: NVLink per direction (A100 600 GB/s
  bidirectional -> 300; A800/H800 are export parts capped at 400 -> 200; H100/H200 900 -> 450),
  or PCIe where a card has no NVLink switch (Gen4 x16 ~25 GB/s, Gen5 ~50; GeForce cards have
  peer-to-peer disabled and go through the host, ~16);
- `inter_gbps`: the network between nodes per GPU, as rail-optimised clusters give each GPU
  its own NIC: HDR InfiniBand 200 Gb/s = 25 GB/s (DGX A100), NDR 400 Gb/s = 50 GB/s
  (DGX H100). PCIe servers are assumed to share 100 GbE among 8 cards;
- `matmul_eff`: the best fraction of peak a large bf16 GEMM sustains (the "maximum
  achievable matmul FLOPS" measured by S. Bekman, ml-engineering: A100 SXM 267.9 of 312 =
  0.86, H100 SXM 792 of 989 = 0.80); cards without a published figure get 0.75-0.80,
  which `ember plan calibrate` is meant to replace with a measurement;
- `attn_eff`: fraction of peak that fused (flash) attention reaches forward + backward at
  head size 128 on long sequences (plan/timing.py scales it to other shapes):
  FlashAttention-2 reaches 50-73% of peak on A100 (Dao 2023), ~0.62 for causal training
  at head size 128, but only ~35% on H100, where it does not use Hopper's asynchronous
  tensor cores (Shah et al. 2024, FlashAttention-3); PyTorch's SDPA runs FlashAttention-2.
  Ada is taken to be like Ampere at a lower clock (0.55). Turing and Volta have no
  FlashAttention-2 and run memory-efficient attention at a lower rate (0.35);
- `hbm_eff`: the share of `hbm_gbps` that memory-bound (elementwise) kernels reach;
- `fp8`: whether the tensor cores multiply FP8 (e4m3/e5m2), at twice their bf16 rate
  (Hopper, Ada and Blackwell datasheets: H100 SXM 1,979 dense against 989). Large FP8 GEMMs
  reach about the same share of that peak as bf16 ones (cuBLASLt, 8192^3 on H100 SXM: about
  1,600 TFLOP/s, 0.81), so `matmul_eff` serves both;
- `matmul_times`, `attention_times`: measured seconds of exact matmul and attention shapes
  on this device (`ember plan calibrate --model`), which the planner takes instead of its
  model for those shapes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace


class ShapeTimes:
    """Measured seconds by exact shape, a few whole numbers each: matmuls as (m, n, k,
    batch) for an (m x k) @ (k x n) product repeated `batch` times; attention as (batch,
    heads, sequence, head size, causal). Hashable (the planner caches per GPU) without
    hashing the whole table on every lookup."""

    def __init__(self, rows):
        self._times = {tuple(int(v) for v in row[:-1]): float(row[-1]) for row in rows}
        self._key = tuple(sorted(self._times.items()))
        self._hash = hash(self._key)

    def get(self, *shape: float) -> float | None:
        return self._times.get(tuple(round(v) for v in shape))

    def rows(self) -> list[list]:
        return [[*shape, seconds] for shape, seconds in self._key]

    def __len__(self) -> int:
        return len(self._times)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, ShapeTimes) and self._key == other._key

    def __repr__(self) -> str:
        return f"ShapeTimes({len(self)} shapes)"


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float  # dense, FLOP/s
    memory_gib: float
    pattern: str  # regex searched in the lower-cased device name
    hbm_gbps: float = 1000.0
    sms: int = 100
    intra_gbps: float = 25.0
    inter_gbps: float = 1.5625  # 100 GbE shared by 8 GPUs
    matmul_eff: float = 0.75
    attn_eff: float = 0.5
    hbm_eff: float = 0.8  # streaming kernels reach 80-90% of the datasheet bandwidth
    fp8: bool = False  # FP8 tensor cores at twice the bf16 rate (Hopper, Ada, Blackwell)
    bf16: bool = True  # bf16 tensor cores (Ampere and later); without, training runs fp16 with loss scaling
    # Memory the device holds outside the training program: the CUDA context, cuBLAS and
    # NCCL workspaces on a GPU; on a CPU the idle process (interpreter, torch, process
    # group), which a calibration measures.
    runtime_gib: float = 1.0
    matmul_times: ShapeTimes | None = None
    attention_times: ShapeTimes | None = None


def at_fp32(gpu: GPU) -> GPU:
    """`gpu` multiplying in fp32 (a run without autocast): on TF32 tensor cores at half the
    bf16 rate where it has them (Ampere and later, the GPUs with bf16; ember's trainer turns
    TF32 on), else on its CUDA cores at an eighth of the fp16 tensor-core rate (V100: 15.7
    against 125 TFLOP/s; T4: 8.1 against 65). Its timed kernels were timed in bf16 and go.
    A calibrated CPU's peak is the fp32 rate it measured, and stays."""
    if gpu.name.startswith("cpu"):
        return gpu
    rate = 0.5 if gpu.bf16 else 1 / 8
    return replace(gpu, matmul_eff=gpu.matmul_eff * rate, attn_eff=gpu.attn_eff * rate, matmul_times=None,
                   attention_times=None)


_NV_A100 = dict(sms=108, intra_gbps=300.0, inter_gbps=25.0, matmul_eff=0.86, attn_eff=0.62)
_NV_A800 = dict(_NV_A100, intra_gbps=200.0)
_PCIE4 = dict(intra_gbps=25.0, inter_gbps=1.5625)
_NV_H100 = dict(sms=132, intra_gbps=450.0, inter_gbps=50.0, matmul_eff=0.80, attn_eff=0.35, fp8=True)
_PCIE5_H = dict(sms=114, intra_gbps=50.0, inter_gbps=1.5625, matmul_eff=0.75, attn_eff=0.35, fp8=True)
# Blackwell (DGX B200, GB200 NVL72 datasheets): dense bf16 2.25 / 2.5 PFLOP/s, FP8 twice that,
# 8 TB/s HBM3e, NVLink 5 at 1.8 TB/s both ways, 400 Gb/s per GPU between nodes. No large-GEMM
# or attention efficiency has been published to carry over: 0.75 and 0.5 are assumptions,
# for `ember plan calibrate` to replace.
_NV_B200 = dict(sms=148, intra_gbps=900.0, inter_gbps=50.0, matmul_eff=0.75, attn_eff=0.5, fp8=True)

# Most specific first: the first pattern that matches wins ("gh200" before "h200",
# "h100.*pcie" before "h100"). A name that matches nothing is unknown (None), never guessed.
GPUS: tuple[GPU, ...] = (
    # Ampere data centre: "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB"
    GPU("A100 SXM4 80GB", 312e12, 80, r"a100.*sxm.*80\s*gb", hbm_gbps=2039, **_NV_A100),
    GPU("A100 SXM4 40GB", 312e12, 40, r"a100.*sxm", hbm_gbps=1555, **_NV_A100),
    GPU("A100 PCIe 80GB", 312e12, 80, r"a100.*80\s*gb", hbm_gbps=1935, sms=108, matmul_eff=0.80,
        attn_eff=0.62, **_PCIE4),
    GPU("A100 PCIe 40GB", 312e12, 40, r"a100", hbm_gbps=1555, sms=108, matmul_eff=0.80, attn_eff=0.62,
        **_PCIE4),
    GPU("A800 SXM4 80GB", 312e12, 80, r"a800.*sxm", hbm_gbps=2039, **_NV_A800),
    GPU("A800 PCIe 80GB", 312e12, 80, r"a800.*80\s*gb", hbm_gbps=1935, sms=108, matmul_eff=0.80,
        attn_eff=0.62, **_PCIE4),
    GPU("A800 PCIe 40GB", 312e12, 40, r"a800", hbm_gbps=1555, sms=108, matmul_eff=0.80, attn_eff=0.62,
        **_PCIE4),
    # Hopper: "NVIDIA H100 80GB HBM3" is the SXM part; "NVIDIA H100 PCIe"; "NVIDIA H200"
    GPU("GH200", 989e12, 96, r"gh200", hbm_gbps=4000, **_NV_H100),
    # Meta's Grand Teton H100 (torchtitan's published runs): the SXM part with 95 GB of HBM2e
    # at a lower power limit. torchtitan's authors give its peak only as "between SXM and
    # NVL" (989 and 835): the middle is taken. Six HBM2e stacks at the H100 PCIe's pin rate
    # (five give it 2.0 TB/s): 2.46 TB/s. Both are assumptions, for `ember plan calibrate`
    # to replace.
    GPU("H100 SXM HBM2e", 912e12, 95, r"h100.*hbm2e", hbm_gbps=2458, **_NV_H100),
    GPU("H100 NVL", 835e12, 94, r"h100.*nvl", hbm_gbps=3900, **_PCIE5_H),
    GPU("H100 PCIe", 756e12, 80, r"h100.*pcie", hbm_gbps=2000, **_PCIE5_H),
    GPU("H100 SXM", 989e12, 80, r"h100", hbm_gbps=3350, **_NV_H100),
    GPU("H800 PCIe", 756e12, 80, r"h800.*pcie", hbm_gbps=2000, **_PCIE5_H),
    GPU("H800 SXM", 989e12, 80, r"h800", hbm_gbps=3350, **dict(_NV_H100, intra_gbps=200.0)),
    GPU("H200 NVL", 835e12, 141, r"h200.*nvl", hbm_gbps=4800, **dict(_PCIE5_H, sms=132)),
    GPU("H200 SXM", 989e12, 141, r"h200", hbm_gbps=4800, **_NV_H100),
    # Blackwell: "NVIDIA B200", "NVIDIA GB200". GB200's NVLink reaches the 72 GPUs of an NVL72
    # rack (`--gpus-per-node 72` prices that); see _NV_B200 for what is assumed.
    GPU("GB200", 2.5e15, 186, r"gb200", hbm_gbps=8000, **_NV_B200),
    GPU("B200", 2.25e15, 180, r"\bb200", hbm_gbps=8000, **_NV_B200),
    # Ada and Ampere inference cards: "NVIDIA L4", "NVIDIA L40S", "NVIDIA A10G"
    GPU("L40S", 362e12, 48, r"\bl40s\b", hbm_gbps=864, sms=142, attn_eff=0.55, fp8=True, **_PCIE4),
    GPU("L40", 181e12, 48, r"\bl40\b", hbm_gbps=864, sms=142, attn_eff=0.55, fp8=True, **_PCIE4),
    GPU("L4", 121e12, 24, r"\bl4\b", hbm_gbps=300, sms=58, attn_eff=0.55, fp8=True, **_PCIE4),
    # Ampere workstation cards (Cramming's A4000 and A6000): "NVIDIA RTX A6000"; and the A40.
    GPU("RTX A6000", 154.8e12, 48, r"rtx a6000", hbm_gbps=768, sms=84, attn_eff=0.55, **_PCIE4),
    GPU("RTX A5000", 111.1e12, 24, r"rtx a5000", hbm_gbps=768, sms=64, attn_eff=0.55, **_PCIE4),
    GPU("RTX A4000", 76.7e12, 16, r"rtx a4000", hbm_gbps=448, sms=48, attn_eff=0.55, **_PCIE4),
    GPU("A40", 149.7e12, 48, r"\ba40\b", hbm_gbps=696, sms=84, attn_eff=0.55, **_PCIE4),
    # Turing, fp16 only (Colab's and many clouds' small GPU): "Tesla T4", 70 W.
    GPU("T4", 65e12, 16, r"\bt4\b", hbm_gbps=320, sms=40, attn_eff=0.35, bf16=False, **_PCIE4),
    # AWS's A10G trades tensor throughput for shader throughput: 70 TFLOP/s against the A10's 125.
    GPU("A10G", 70e12, 24, r"\ba10g\b", hbm_gbps=600, sms=80, attn_eff=0.55, **_PCIE4),
    GPU("A10", 125e12, 24, r"\ba10\b", hbm_gbps=600, sms=72, attn_eff=0.55, **_PCIE4),
    # GeForce: "NVIDIA GeForce RTX 4090"; variants (Ti, D, Laptop) differ, so match exactly.
    GPU("RTX 4090", 165.2e12, 24, r"rtx 4090$", hbm_gbps=1008, sms=128, intra_gbps=16, matmul_eff=0.80,
        attn_eff=0.55, fp8=True),
    GPU("RTX 3090", 71e12, 24, r"rtx 3090$", hbm_gbps=936, sms=82, intra_gbps=16, matmul_eff=0.80,
        attn_eff=0.55),
    GPU("RTX 2080 Ti", 56.9e12, 11, r"rtx 2080 ti$", hbm_gbps=616, sms=68, intra_gbps=10, attn_eff=0.35,
        bf16=False),
    # Volta, fp16 only: "Tesla V100-SXM2-16GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB"
    GPU("V100S PCIe 32GB", 130e12, 32, r"v100s", hbm_gbps=1134, sms=80, intra_gbps=12, attn_eff=0.35,
        bf16=False),
    GPU("V100 SXM2 32GB", 125e12, 32, r"v100.*sxm.*32\s*gb", hbm_gbps=900, sms=80, intra_gbps=150,
        inter_gbps=6.25, attn_eff=0.35, bf16=False),
    GPU("V100 SXM2 16GB", 125e12, 16, r"v100.*sxm", hbm_gbps=900, sms=80, intra_gbps=150, inter_gbps=6.25,
        attn_eff=0.35, bf16=False),
    GPU("V100 PCIe 32GB", 112e12, 32, r"v100.*32\s*gb", hbm_gbps=900, sms=80, intra_gbps=12, attn_eff=0.35,
        bf16=False),
    GPU("V100 PCIe 16GB", 112e12, 16, r"v100", hbm_gbps=900, sms=80, intra_gbps=12, attn_eff=0.35,
        bf16=False),
)

# Short names users type; SXM is what clusters are built from, so a bare "H100" means SXM.
_ALIASES = {
    "a100": "A100 SXM4 80GB", "a10080gb": "A100 SXM4 80GB", "a10040gb": "A100 SXM4 40GB",
    "a800": "A800 SXM4 80GB", "a80080gb": "A800 SXM4 80GB",
    "h100": "H100 SXM", "h10080gb": "H100 SXM", "h800": "H800 SXM", "h80080gb": "H800 SXM",
    "h200": "H200 SXM", "h200141gb": "H200 SXM",
    "4090": "RTX 4090", "2080ti": "RTX 2080 Ti", "3090": "RTX 3090", "b200": "B200", "gb200": "GB200",
    "a6000": "RTX A6000", "a5000": "RTX A5000", "a4000": "RTX A4000",
    # A bare "V100" in a training paper is a DGX's SXM2 part (DGX-1 16 GB, DGX-2 32 GB).
    "v100": "V100 SXM2 32GB", "v10032gb": "V100 SXM2 32GB", "v10016gb": "V100 SXM2 16GB",
}


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower().replace("nvidia", "").replace("geforce", ""))


def find_gpu(device_name: str) -> GPU | None:
    """The table entry for a device name as torch reports it, or None if unknown."""
    name = device_name.strip().lower()
    for gpu in GPUS:
        if re.search(gpu.pattern, name):
            return gpu
    return None


def gpu_by_name(name: str) -> GPU | None:
    """The table entry for a short name a user types ("H100", "A100-40GB", "RTX 4090", or
    any table name); None if unknown. Case, spaces and dashes do not matter."""
    key = _key(name)
    by_key = {_key(gpu.name): gpu for gpu in GPUS}
    if key in by_key:
        return by_key[key]
    if key in _ALIASES:
        return by_key[_key(_ALIASES[key])]
    return by_key.get(_key(_ALIASES.get(key.removeprefix("rtx"), "")))


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the named device; None for CPUs and unknown GPUs."""
    gpu = find_gpu(device_name)
    return gpu.peak_bf16_flops if gpu is not None else None


def machine_memory_gib() -> float:
    """This machine's memory (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0
