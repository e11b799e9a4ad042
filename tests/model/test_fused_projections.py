"""q/k/v (and gate/up) in one matmul: the same numbers as one nn.Linear per projection,
under fp32 and bf16 autocast, compiled or not, without saving more for backward."""

import copy

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.layers import MLP, Attention, Block

HIDDEN, MLP_HIDDEN = 64, 96


def config(**overrides) -> ModelConfig:
    base = dict(vocab_size=100, hidden=HIDDEN, layers=2, heads=4, mlp_hidden=MLP_HIDDEN, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def unfused(module: torch.nn.Module) -> torch.nn.Module:
    other = copy.deepcopy(module)
    for sub in other.modules():
        if hasattr(sub, "fused"):
            sub.fused = False
    return other


def with_random_biases(module: torch.nn.Module) -> torch.nn.Module:
    """Biases start at zero; random ones show whether each lands on its own projection."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return module


def run(module, inputs, amp: bool, **kwargs):
    """Output, input gradient (if any) and every parameter's gradient."""
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = module(inputs, **kwargs)
    (out if out.dim() == 0 else out.float().square().mean()).backward()
    grad_in = inputs.grad.clone() if inputs.grad is not None else None
    inputs.grad = None
    return out.detach(), grad_in, {n: p.grad for n, p in module.named_parameters()}


def assert_same(module, inputs, amp, **kwargs):
    other = unfused(module)
    assert any(getattr(m, "fused", False) for m in module.modules())
    out, grad_in, grads = run(module, inputs, amp, **kwargs)
    out_u, grad_in_u, grads_u = run(other, inputs, amp, **kwargs)
    tol = dict(rtol=2e-2, atol=2e-2) if amp else dict(rtol=1e-5, atol=1e-6)
    assert out.dtype == out_u.dtype
    torch.testing.assert_close(out, out_u, **tol)
    if grad_in is not None:
        assert grad_in.dtype == grad_in_u.dtype
        torch.testing.assert_close(grad_in, grad_in_u, **tol)
    assert grads.keys() == grads_u.keys()
    for name in grads:
        assert grads[name].dtype == grads_u[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], grads_u[name], **tol, msg=name)


def hidden_states(seed=1):
    return torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(seed), requires_grad=True)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["gelu", "geglu", "swiglu"])
def test_fused_transformer_equals_one_linear_per_projection(activation, bias, amp):
    torch.manual_seed(0)
    cfg = config(activation=activation, bias=bias, positions="rotary" if activation == "swiglu" else "learned")
    model = with_random_biases(Transformer(cfg))
    ids = torch.randint(0, 100, (2, 16))
    assert_same(model, ids, amp, labels=ids)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_fused_attention_equals_one_linear_per_projection(positions, bias, amp):
    torch.manual_seed(0)
    assert_same(with_random_biases(Attention(config(positions=positions, bias=bias))), hidden_states(), amp)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["geglu", "swiglu"])
def test_fused_mlp_equals_one_linear_per_projection(activation, bias, amp):
    torch.manual_seed(0)
    assert_same(with_random_biases(MLP(config(activation=activation, bias=bias))), hidden_states(), amp)


def test_a_projection_with_hooks_of_its_own_is_called_on_its_own():
    # As an outside tensor-parallel plan (parallelize_module) installs them on each projection.
    torch.manual_seed(0)
    block = Block(config(activation="swiglu"))
    calls = []
    block.attn.k_proj.register_forward_pre_hook(lambda module, args: calls.append("k"))
    block.mlp.up.register_forward_hook(lambda module, args, out: calls.append("up"))
    out = block(hidden_states())
    assert calls == ["k", "up"]
    torch.testing.assert_close(out, unfused(block)(hidden_states()), rtol=1e-5, atol=1e-6)


def saved_bytes(module, inputs, amp) -> tuple[int, set[int]]:
    """Bytes of the storages autograd keeps for backward (parameters aside: they live
    anyway), and the element counts of those storages."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = (storage.nbytes(), storage.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = module(inputs)
    del out
    return sum(b for b, _ in storages.values()), {n for _, n in storages.values()}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_fused_block_saves_no_more_for_backward(positions, amp):
    torch.manual_seed(0)
    block = Block(config(positions=positions, activation="swiglu", bias=True))
    fused, fused_sizes = saved_bytes(block, hidden_states(), amp)
    plain, _ = saved_bytes(unfused(block), hidden_states(), amp)
    assert fused <= plain
    # Neither concatenated weight is kept: [3 hidden, hidden] for q/k/v, [2 mlp_hidden, hidden] for gate/up.
    assert not fused_sizes & {3 * HIDDEN * HIDDEN, 2 * MLP_HIDDEN * HIDDEN}
    if not amp:  # same tensors, one of them whole instead of in pieces
        assert fused == plain


def test_compiled_fused_block_equals_eager():
    torch.manual_seed(0)
    block = with_random_biases(Block(config(positions="rotary", activation="swiglu", bias=True)))
    compiled = copy.deepcopy(block)
    compiled.forward = torch.compile(compiled.forward, fullgraph=True)  # no graph break around the function
    out, grad_in, grads = run(block, hidden_states(), amp=False)
    out_c, grad_in_c, grads_c = run(compiled, hidden_states(), amp=False)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_in_c, grad_in, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_compiled_fused_block_keeps_no_concatenated_weight(amp):
    """torch.compile's partitioner keeps whatever backward needs that forward computed: were
    the backward to use the concatenated weight, every layer's [3h, h] and [2f, h] copy would
    stay alive from forward to backward (and under ZeRO-3 the gathered weights with it)."""
    torch.manual_seed(0)
    block = Block(config(positions="rotary", activation="swiglu"))
    block.forward = torch.compile(block.forward, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        block(hidden_states()).sum().backward()  # compile outside the measurement
    _, sizes = saved_bytes(block, hidden_states(), amp)
    assert not sizes & {3 * HIDDEN * HIDDEN, 2 * MLP_HIDDEN * HIDDEN}


def _input_gradient_flops(model: torch.nn.Module) -> int:
    """Matmul FLOPs of the input-gradient half of backward alone, as zero-bubble pipeline
    schedules ask for it (the weight gradients come in a later pass)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(2, 16, HIDDEN, requires_grad=True)
    out = next(iter(model.blocks.values()))(x)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(out.sum(), x)
    return counter.get_total_flops()


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_zero_bubble_stages_compute_only_the_gradient_each_backward_pass_asks_for(schedule):
    from ember.config import load_config
    from ember.parallel.engine import Wrapper
    from ember.parallel.mesh import Topology

    cfg = load_config(overrides=["parallel.pp=2", "parallel.vpp=2", f"parallel.schedule={schedule}"])
    torch.manual_seed(0)
    fused = Transformer(config(activation="swiglu"))
    wrapped = Wrapper(cfg, Topology(), torch.device("cpu"), None)(copy.deepcopy(fused))
    # The fused function computes the weight gradients too, whichever half is asked for.
    assert _input_gradient_flops(wrapped) < 0.75 * _input_gradient_flops(fused)
    plain = load_config(overrides=["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"])
    kept = Wrapper(plain, Topology(), torch.device("cpu"), None)(copy.deepcopy(fused))
    assert _input_gradient_flops(kept) == _input_gradient_flops(fused)  # other schedules keep fusing
