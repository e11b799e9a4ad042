"""Peak FLOP/s looked up by the names torch.cuda.get_device_name() reports."""

import pytest

from ember.hardware import GPUS, find_gpu, peak_flops


@pytest.mark.parametrize("name,peak,memory", [
    ("NVIDIA H100 80GB HBM3", 989e12, 80),  # SXM
    ("NVIDIA H100 PCIe", 756e12, 80),
    ("NVIDIA H100 NVL", 835e12, 94),
    ("NVIDIA H100 96GB HBM2e", 912e12, 95),  # Grand Teton's lower-power SXM part
    ("NVIDIA H800", 989e12, 80),
    ("NVIDIA H200", 989e12, 141),
    ("NVIDIA GH200 480GB", 989e12, 96),
    ("NVIDIA A100-SXM4-80GB", 312e12, 80),
    ("NVIDIA A100-SXM4-40GB", 312e12, 40),
    ("NVIDIA A100 80GB PCIe", 312e12, 80),
    ("NVIDIA A100-PCIE-40GB", 312e12, 40),
    ("NVIDIA A800-SXM4-80GB", 312e12, 80),
    ("NVIDIA L4", 121e12, 24),
    ("NVIDIA L40S", 362e12, 48),
    ("NVIDIA A10", 125e12, 24),
    ("NVIDIA A10G", 70e12, 24),
    ("NVIDIA GeForce RTX 4090", 165.2e12, 24),
    ("NVIDIA GeForce RTX 3090", 71e12, 24),
    ("NVIDIA GeForce RTX 2080 Ti", 56.9e12, 11),
    ("Tesla V100-SXM2-16GB", 125e12, 16),
    ("Tesla V100-SXM2-32GB", 125e12, 32),
    ("Tesla V100-PCIE-32GB", 112e12, 32),
])
def test_known_gpus(name, peak, memory):
    assert peak_flops(name) == peak
    assert find_gpu(name).memory_gib == memory


@pytest.mark.parametrize("name", [
    "cpu", "mps", "", "NVIDIA H20", "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 4080", "AMD Instinct MI300X", "NVIDIA L400", "NVIDIA RTX 6000 Ada Generation",
])
def test_unknown_devices_have_no_peak(name):
    assert peak_flops(name) is None


def test_table_is_sane():
    names = [gpu.name for gpu in GPUS]
    assert len(names) == len(set(names))
    for gpu in GPUS:
        assert 1e13 < gpu.peak_bf16_flops < 1e16 and 8 <= gpu.memory_gib <= 200
        # Every entry is reachable: its own name is not shadowed by an earlier pattern.
        assert find_gpu("NVIDIA " + gpu.name) is gpu, gpu.name
