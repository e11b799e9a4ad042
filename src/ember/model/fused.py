"""Several linear layers that read the same input, computed as one matmul (attention's
q/k/v, the MLP's gate/up), their parameters left where they are.

Each layer keeps its own `nn.Linear` and parameter names, so initialisation, checkpoints,
export and parallelism plans address them as before; only the arithmetic is fused. The
autograd function saves the input and the layers' own weights, never their concatenation:
a saved [3h, h] copy would stay alive from forward to backward in every layer, and under
ZeRO-3 (which frees gathered parameters after forward and gathers them again for
backward) it would undo the sharding. A concatenation exists only while its matmul runs
(forward or backward), compiled or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in: autocast's where it applies, else the input's."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, count: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:count], params[count:]
        ctx.count, ctx.bias = count, bool(biases)
        ctx.save_for_backward(x, *weights)
        # Parameters in the compute dtype (the input already is): what autocast gives nn.Linear.
        weight = torch.cat([w.to(x.dtype) for w in weights])
        bias = torch.cat([b.to(x.dtype) for b in biases]) if biases else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Autograd casts each gradient to its input's dtype (fp32 weights under autocast).
        x, *weights = ctx.saved_tensors
        rows = [w.shape[0] for w in weights]
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            # One matmul against the weights joined again, and joined differently from the
            # forward's (columns of the transposes): were it the same expression, torch.compile
            # would merge the two and keep the forward's copy alive until backward, in every
            # layer (and under ZeRO-3, gathered weights it means to free).
            joined = torch.cat([w.to(x.dtype).t() for w in weights], dim=1)
            grad_x = (flat @ joined.t()).view(x.shape)
        grad_weights = [None] * ctx.count
        if any(ctx.needs_input_grad[2:2 + ctx.count]):
            grad_weights = (flat.t() @ x.reshape(-1, x.shape[-1])).split(rows)
        grad_biases = flat.sum(0).split(rows) if ctx.bias else ()
        return (grad_x, None, *grad_weights, *grad_biases)


def fusable(layers: Sequence[nn.Linear]) -> bool:
    """Whether calling the layers one by one does nothing the fused matmul would skip: no
    hooks on them (a tensor-parallel plan applied from outside, a per-layer FSDP wrap)."""
    return not any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """The outputs of `layers` (all with or all without bias) on `x`, from one matmul: views
    into one [..., sum of widths] tensor, equal to calling each layer."""
    dtype = _compute_dtype(x)
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers] if layers[0].bias is not None else []
    out = _FusedLinear.apply(x.to(dtype), len(weights), *weights, *biases)
    return out.split([w.shape[0] for w in weights], dim=-1)
