"""The output layer and its loss, computed in chunks of tokens so that the logits of the
whole micro-batch never exist.

A language model's output layer and cross-entropy are its largest tensors: for 16,384
tokens and a 50k vocabulary the fp32 logits alone take 3.3 GB, and an unfused loss keeps
them (and their gradient, as large) for backward. Here the forward runs over chunks of
tokens: each chunk's logits are made in the compute dtype (bf16 under autocast, with the
matmul's fp32 accumulation), their log-sum-exp taken in fp32, and the gradient of the
loss with respect to the chunk's logits turned at once into the gradients of the hidden
states and the weight (as Liger-Kernel's fused linear cross-entropy does). Backward then
only scales the saved gradients. Peak memory is one chunk of logits plus the gradients
that backward needs anyway; no matmul is repeated.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ember.cost import chunk_tokens

IGNORE = -100  # label of positions that predict nothing (the data side's convention)


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b in place. bf16/fp16 operands keep their fast matmul and
    accumulate into fp32 directly on CUDA (addmm's out_dtype); elsewhere they are widened."""
    # The out= form, not addmm_: the same kernel, and FLOP counters see it.
    if a.dtype == total.dtype:
        torch.addmm(total, a, b, out=total)
    elif a.is_cuda:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        torch.addmm(total, a.to(total.dtype), b.to(total.dtype), out=total)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


def _chunk_loss(xs: torch.Tensor, wc: torch.Tensor, ys: torch.Tensor,
                needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: the summed loss of its logits xs @ wc.T against ys and, when `needs_grad`,
    d loss / d logits (softmax - one_hot, zero where nothing is predicted) in the logits'
    dtype. Everything after the matmul reads and writes the chunk's logits only, so
    compiled (`compiled_chunk_loss`) it fuses into a few passes over them."""
    logits = (xs @ wc.T).float()
    valid = ys != IGNORE
    safe = torch.where(valid, ys, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not needs_grad:
        return loss, None
    # In place over the chunk's logits, so that eager holds one such buffer.
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
    grad.mul_(valid[:, None])
    return loss, grad.to(xs.dtype)


@functools.cache
def compiled_chunk_loss():
    """`_chunk_loss` under torch.compile, made once per process (train.compile)."""
    return torch.compile(_chunk_loss)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (x @ weight.T) against labels, over labels != IGNORE."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                compiled: bool) -> torch.Tensor:
        dtype = _compute_dtype(x, weight)
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        chunk_loss = compiled_chunk_loss() if compiled else _chunk_loss
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(dtype), weight.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
            grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                      if ctx.needs_input_grad[1] else None)
            for start in range(0, x.shape[0], chunk):
                xs, ys = xc[start:start + chunk], labels[start:start + chunk]
                loss, grad = chunk_loss(xs, wc, ys, needs_grad)
                total += loss
                if grad is None:
                    continue
                if grad_x is not None:
                    grad_x[start:start + chunk] = (grad @ wc).to(x.dtype)
                if grad_w is not None:
                    _accumulate(grad_w, grad.T, xs)
                del grad  # before the next chunk's logits exist, not after
        if grad_w is not None and weight.dtype == torch.bfloat16:
            # A bf16 weight (FSDP's gathered parameter) gets its gradient in bf16 in backward
            # anyway; kept so, it waits for backward at half the size, once per micro-batch
            # in flight (every one under GPipe, p under zero-bubble). fp16 keeps fp32: its
            # loss scale, applied in backward, is what keeps small gradients from flushing.
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_output.to(grad_x.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_output).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "mean", chunk: int | None = None, compiled: bool = False) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), labels, ignore_index=-100) without
    the full logits. x [..., hidden], labels [...]; "sum" or "mean" over labelled positions.
    `compiled`: each chunk's loss and gradient by torch.compile's fused kernels."""
    x2, y = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    chunk = chunk or chunk_tokens(x2.shape[0], weight.shape[0], weight.shape[1])
    total = _LinearCrossEntropy.apply(x2, weight, y, chunk, compiled)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / (y != IGNORE).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


class OutputLayer(nn.Linear):
    """The vocabulary projection. Called with labels it returns the summed or mean loss
    (fused above), so that wrappers hooked on this module (FSDP gathers its weight around
    its forward) see the one call that uses the weight. Whatever splits the weight over
    the vocabulary sets `vocab_parallel`: the model then asks for (sharded) logits and
    takes the ordinary cross-entropy of them, which that splitter makes vocabulary-parallel."""

    vocab_parallel = False
    compiled = False  # set by ember.parallel.recompute.apply_compile (train.compile)

    def __init__(self, hidden: int, vocab: int, device=None, dtype=None):
        super().__init__(hidden, vocab, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, labels, reduction, compiled=self.compiled)
