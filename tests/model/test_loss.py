"""The chunked output layer + cross-entropy equals the unfused reference, in value and
gradients, and never holds the full logits."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.loss import chunk_tokens, linear_cross_entropy
from ember.model.transformer import target_positions


def _reference(x, w, y, reduction):
    return F.cross_entropy(F.linear(x, w).float(), y, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
def test_chunked_loss_and_gradients_equal_the_reference(reduction, chunk):
    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(101, 16, requires_grad=True)
    y = torch.randint(0, 101, (37,))
    y[::5] = -100
    ref = _reference(x, w, y, reduction)
    ref_grads = torch.autograd.grad(ref * 3.0, (x, w))
    out = linear_cross_entropy(x, w, y, reduction, chunk=chunk)
    grads = torch.autograd.grad(out * 3.0, (x, w))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_labels_gives_zero_loss_and_gradients():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    y = torch.full((5,), -100)
    out = linear_cross_entropy(x, w, y, "sum")
    out.backward()
    assert float(out.detach()) == 0.0 and not x.grad.any() and not w.grad.any()


def test_under_bf16_autocast_the_loss_uses_bf16_logits():
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(300, 32) * 0.3
    y = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(x, w, y, "sum", chunk=16)
    bf16 = F.cross_entropy((x.bfloat16() @ w.bfloat16().T).float(), y, reduction="sum")
    fp32 = _reference(x, w, y, "sum")
    assert abs(float(out) - float(bf16)) < 1e-3 * abs(float(bf16))
    assert abs(float(out) - float(fp32)) > abs(float(out) - float(bf16))  # computed in bf16, not fp32


def test_chunks_hold_about_an_activation_but_never_a_thin_matmul():
    assert chunk_tokens(16384, 50304, 768) == 2**24 // 50304  # the floor of 64 MiB of logits
    assert chunk_tokens(1 << 20, 50304, 768) == -(-(1 << 20) // 66)  # vocab/hidden = 66 chunks
    assert chunk_tokens(10, 50304, 768) == 10


def _model(objective: str, sparse: bool = True) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, hidden=32, layers=2, heads=4, mlp_hidden=64, max_seq_len=16,
                      objective=objective, sparse_prediction=sparse,
                      positions="sinusoidal" if objective == "mlm" else "rotary")
    return Transformer(cfg)


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_model_loss_and_gradients_equal_the_unfused_computation(objective):
    model = _model(objective)
    ids = torch.randint(0, 97, (3, 16))
    labels = torch.randint(0, 97, (3, 16))
    labels[torch.rand(3, 16) < 0.6] = -100
    loss = model(ids, labels, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model.head(model.norm(model.trunk(ids)))  # no labels: plain logits
    ref = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_prediction_with_positions_from_the_host_equals_the_boolean_mask():
    model = _model("mlm")
    ids = torch.randint(0, 97, (3, 16))
    labels = torch.full((3, 16), -100)
    labels[torch.rand(3, 16) < 0.15] = 5
    positions = target_positions(labels)
    assert positions.tolist() == [i for i, v in enumerate(labels.reshape(-1).tolist()) if v != -100]
    with_positions = model(ids, labels, reduction="sum", target_positions=positions)
    without = model(ids, labels, reduction="sum")
    torch.testing.assert_close(with_positions, without)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_what_waits_for_backward_is_the_gradients_in_the_weights_dtype(dtype):
    """Between forward and backward the loss keeps the hidden states' gradient (in their
    dtype) and the weight's: fp32, but bf16 for a bf16 weight, which backward would round
    it to anyway (FSDP's gathered parameter); the gradients then equal the fp32-kept ones
    to bf16 rounding. fp16 keeps fp32 (loss scaling acts in backward)."""
    torch.manual_seed(0)
    n, hidden, vocab = 48, 32, 300
    x = torch.randn(n, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = linear_cross_entropy(x, w, y, "sum", chunk=16)
    w_bytes = 2 if dtype == torch.bfloat16 else 4
    assert sum(t.numel() * t.element_size() for t in kept) == n * hidden * x.element_size() + vocab * hidden * w_bytes
    grads = torch.autograd.grad(out * 0.37, (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ref = _reference(x.float(), w.float(), y, "sum")
    ref_grads = torch.autograd.grad(ref * 0.37, (x, w))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    from ember.device import peak_memory_bytes, reset_peak_memory, resident_bytes
    from ember.model.loss import linear_cross_entropy
    fused = sys.argv[1] == "fused"
    x = torch.randn(2048, 128, requires_grad=True)
    w = (torch.randn(50304, 128) * 0.02).requires_grad_()
    y = torch.randint(0, 50304, (2048,))
    def step():
        loss = (linear_cross_entropy(x, w, y, "sum") if fused
                else F.cross_entropy(F.linear(x, w).float(), y, reduction="sum"))
        loss.backward()
        x.grad = w.grad = None
    step()
    cpu = torch.device("cpu")
    base = resident_bytes()
    reset_peak_memory(cpu)
    step()
    print(json.dumps(peak_memory_bytes(cpu) - base))
""")


def _peak_above_inputs(variant: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, variant], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_the_loss_of_a_50k_vocabulary_takes_at_least_4x_less_memory():
    """Each in its own process, so the kernel's peak resident set is that variant's."""
    reference, fused = _peak_above_inputs("reference"), _peak_above_inputs("fused")
    logits = 2048 * 50304 * 4
    assert reference > 2 * logits  # the reference holds logits and their gradient at once
    assert fused * 4 <= reference, (fused, reference)
