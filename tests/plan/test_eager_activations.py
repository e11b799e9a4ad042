"""What one block keeps for backward, counted by autograd itself, against the planner.

An uncompiled block runs RMSNorm and the gated activation as eager composites, which keep
more than the fused kernels the planner's base count stands for (plan/eager.py:
eager_saved_bytes). Every tensor autograd saves in one block's forward is seen through
saved_tensors_hooks, each storage counted once, the parameters and the rotary tables
(shared by every block and micro-batch) left out.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ember.config import load_config
from ember.layout import Layout
from ember.model.layers import Block
from ember.plan.cluster import make_cluster
from ember.plan.eager import eager_saved_bytes
from ember.plan.layout import TrainShape
from ember.plan.memory import activation_bytes_per_token, stage_memory
from ember.plan.models import from_config
from ember.plan.predict import _as_scheduled
from ember.plan.stacks import STACKS, stack

SEQ = 64
SHAPES = {
    "llama": [],  # RMSNorm, SwiGLU, rotary: every composite
    "gpt": ["model.norm=layernorm", "model.activation=gelu", "model.positions=learned"],  # none
}


def saved_bytes_per_token(block: torch.nn.Module, hidden: int) -> float:
    shared = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, SEQ, hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    return sum(storages.values()) / SEQ


@pytest.mark.parametrize("shape", SHAPES)
def test_eager_block_keeps_what_the_planner_counts(shape):
    cfg = load_config("configs/tiny-gpt.toml", [f"model.max_seq_len={SEQ}", "model.vocab_size=512", *SHAPES[shape]])
    torch.manual_seed(0)
    measured = saved_bytes_per_token(Block(cfg.model), cfg.model.hidden)
    spec = from_config(cfg.model, shape)
    one = Layout()
    fused = 2 * activation_bytes_per_token(spec, SEQ, one, "flash", STACKS["ember"])  # fp32: 4 bytes an element
    eager = fused + eager_saved_bytes(spec, 1, 1, fp32=True)
    assert eager == pytest.approx(measured, rel=0.03), (shape, measured, fused, eager)
    if shape == "llama":  # the composites' extra is real: the fused count alone falls short
        assert fused < 0.85 * measured


def test_only_an_uncompiled_block_pays_for_its_composites():
    cfg = load_config("configs/tiny-gpt.toml", ["model.max_seq_len=256", "model.vocab_size=512"])
    spec, lo, shape = from_config(cfg.model, "tiny"), Layout(), TrainShape(256, 8, precision="fp32")
    cpu = replace(STACKS["ember"], host_overlaps=False)

    def acts(s, layout=lo) -> float:
        return stage_memory(spec, layout, shape, 0, 4, "flash", 2**40, runtime=0.0, stack=s).activations

    assert cpu.eager_blocks and not replace(cpu, compiled=True).eager_blocks
    assert not STACKS["ember"].eager_blocks  # a GPU compiles ember's blocks
    assert stack("fsdp-eager").eager_blocks and not stack("fsdp").eager_blocks
    # A GPU compiles every layout but the zero-bubble ones, whose stages run eager.
    gpu = make_cluster("H100", 8, 8)
    for schedule, vpp, eager in [("1f1b", 1, False), ("zero_bubble", 2, True), ("zbv", 2, True)]:
        layout = replace(lo, pp=2, vpp=vpp, schedule=schedule)
        assert _as_scheduled(gpu, layout).stack.eager_blocks is eager, schedule
    extra = acts(cpu) - acts(replace(cpu, compiled=True))
    assert extra == pytest.approx(spec.layers * 256 * eager_saved_bytes(spec, 1, 1, fp32=True))
    # Recomputation reruns the composites, so what they keep is transient there.
    full = replace(lo, recompute="full")
    assert acts(cpu, full) == acts(replace(cpu, compiled=True), full)
