"""SDPA's kernel order: cuDNN first on Hopper, set once for the process, PyTorch's own
order elsewhere and on every device that is not CUDA."""

import torch
from torch.nn.attention import SDPBackend

from ember import device as ember_device
from ember.device import attention_priority, prefer_attention_kernels, use_device

HOPPER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def test_the_order_by_compute_capability():
    assert attention_priority((9, 0)) == HOPPER
    for other in ((8, 0), (8, 9), (10, 0), (12, 0)):  # Ampere, Ada, Blackwell keep PyTorch's order
        assert attention_priority(other) is None


def test_hopper_sets_the_order_once_for_the_process():
    before = torch._C._get_sdp_priority_order()
    try:
        prefer_attention_kernels((9, 0))
        prefer_attention_kernels((9, 0))  # a second call changes nothing
        assert len(ember_device._KERNEL_ORDER) == 1
        assert torch._C._get_sdp_priority_order()[:4] == [int(b) for b in HOPPER]
    finally:
        for context in ember_device._KERNEL_ORDER:
            context.__exit__(None, None, None)
        ember_device._KERNEL_ORDER.clear()
    assert torch._C._get_sdp_priority_order() == before


def test_a_cpu_keeps_pytorchs_order():
    before = torch._C._get_sdp_priority_order()
    use_device(torch.device("cpu"))
    prefer_attention_kernels((8, 0))
    assert torch._C._get_sdp_priority_order() == before and not ember_device._KERNEL_ORDER
