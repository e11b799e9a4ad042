"""train.compile compiles the end of the model too: the final norm and the chunked loss's
work on each chunk of logits. Compiled, loss and gradients equal eager (CPU, fp32 and
bf16 autocast)."""

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.loss import linear_cross_entropy
from ember.parallel.recompute import apply_compile


def _loss_and_grads(x, w, y, compiled, chunk):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_cross_entropy(x, w, y, "sum", chunk=chunk, compiled=compiled)
    (out * 0.5).backward()
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_compiled_chunks_equal_eager(amp):
    torch.manual_seed(0)
    x, w = torch.randn(53, 32), torch.randn(300, 32) * 0.3
    y = torch.randint(0, 300, (53,))
    y[::4] = -100
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        for chunk in (16, 53):  # the last chunk of 16 is shorter: a second shape
            want = _loss_and_grads(x, w, y, False, chunk)
            got = _loss_and_grads(x, w, y, True, chunk)
            tol = dict(rtol=1e-5, atol=1e-5) if amp is None else dict(rtol=2e-2, atol=2e-2)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_a_compiled_model_computes_the_eager_loss_and_gradients(objective):
    cfg = ModelConfig(objective=objective, vocab_size=97, hidden=32, layers=2, heads=2, mlp_hidden=64,
                      max_seq_len=32, norm="rmsnorm", positions="rotary", activation="swiglu")
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (4, 32))
    labels = torch.roll(ids, -1, 1) if objective == "causal" else torch.where(torch.rand(4, 32) < 0.25, ids, -100)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(1)
        model = Transformer(cfg)
        if compiled:
            apply_compile(model)
            assert model.head.compiled
        loss = model(ids, labels, reduction="sum")
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager, eager_grads), (comp, comp_grads) = runs
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-4)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
