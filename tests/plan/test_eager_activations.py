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
from ember.plan.eager import autocast_fp32_weights, eager_saved_bytes
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


def saved_bytes_per_token(block: torch.nn.Module, hidden: int, autocast: bool = False) -> float:
    shared = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, SEQ, hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = block(x)
    y.float().sum().backward()
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


@pytest.mark.parametrize("tp_plan", [False, True])
def test_bf16_autocast_over_fp32_weights(tp_plan):
    """ember without FSDP autocasts over fp32 weights: the residual stream stays fp32, and
    each projection run as its own nn.Linear keeps a bf16 copy of its weight (all of them
    where fusion is off, as tensor parallelism turns it)."""
    cfg = load_config("configs/tiny-gpt.toml", [f"model.max_seq_len={SEQ}", "model.vocab_size=512"])
    torch.manual_seed(0)
    block = Block(cfg.model)
    if tp_plan:
        block.attn.fused = block.mlp.fused = False
    measured = saved_bytes_per_token(block, cfg.model.hidden, autocast=True)
    spec = from_config(cfg.model, "llama")
    layout = replace(Layout(), tp=2) if tp_plan else Layout()
    per_token, per_layer = autocast_fp32_weights(spec, layout, eager=True)
    # The model's own count is per rank: a tp=2 rank holds half, one process here holds all.
    per_layer *= layout.tp
    one = Layout()
    counted = activation_bytes_per_token(spec, SEQ, one, "flash", STACKS["ember"])  # bf16: 2 bytes an element
    predicted = counted + eager_saved_bytes(spec, 1, 1, fp32=False) + per_token + per_layer / SEQ
    assert predicted == pytest.approx(measured, rel=0.03), (measured, counted, predicted)
    assert counted + eager_saved_bytes(spec, 1, 1, fp32=False) < 0.85 * measured


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


def test_model_states_of_a_run_without_fsdp():
    """One process in bf16 autocast: the fp32 parameters are the master copy, so a step
    leaves 4 bytes of weight, 4 of gradient and Adam's 8 per parameter, all the planner
    counts (no 2-byte copy beside 12 bytes of master and moments)."""
    from ember.model.transformer import Transformer
    from ember.train.setup import build_optimizer

    cfg = load_config("configs/tiny-gpt.toml", [f"model.max_seq_len={SEQ}", "model.vocab_size=512"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    tokens = torch.randint(0, 512, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens)
    loss.float().backward()
    optimizer.step()
    params = list(model.parameters())
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(p.grad.numel() * p.grad.element_size() for p in params)
    held += sum(t.numel() * t.element_size() for state in optimizer.state.values()
                for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    spec = from_config(cfg.model, "tiny")
    mem = stage_memory(spec, Layout(), TrainShape(SEQ, 2), 0, 4, "flash", 2**40, runtime=0.0, stack=STACKS["ember"])
    assert mem.weights + mem.grads + mem.optimizer == pytest.approx(held, rel=0.01)
    assert held == pytest.approx(16 * sum(p.numel() for p in params))
