"""clip_grad_norm on one process: the same norm and the same clipped gradients as
torch.nn.utils.clip_grad_norm_, which never scales gradients up."""

import pytest
import torch

from ember.parallel.grads import clip_grad_norm


def _params(norm: float) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    grads = [torch.randn_like(p) for p in params]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    for p, g in zip(params, grads):
        p.grad = g * norm / total
    return params


@pytest.mark.parametrize("norm", [0.5, 2.0])
def test_clipping_matches_torch_and_never_scales_up(norm):
    ours, theirs = _params(norm), _params(norm)
    total = clip_grad_norm(ours, ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    assert total.item() == pytest.approx(norm, rel=1e-5) == expected.item()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])).item()
    assert clipped == pytest.approx(min(norm, 1.0), rel=1e-5)


def test_an_infinite_max_norm_only_measures():
    params = _params(3.0)
    before = [p.grad.clone() for p in params]
    assert clip_grad_norm(params, params, max_norm=float("inf")).item() == pytest.approx(3.0, rel=1e-5)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)
