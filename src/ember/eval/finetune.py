"""Fine-tune a pretrained encoder with a classification or regression head (the
Cramming protocol) and predict with it.

Pooling (`Protocol.pooling`): "auto" reads, for a masked LM, the first position (its [CLS]
or leading separator) and, for a causal LM, its last real token, the only one that has seen
the whole input, so the two objectives are compared on equal terms. "mean" averages the
real tokens' hidden states instead: a briefly pretrained masked LM has learned nothing at
its first position (masked-token prediction never asks it for the sentence), while every
token's state carries what pretraining taught. Either way the pooled state goes through the
model's own final norm, then dropout, BERT's pooler (dense + tanh), dropout again and a
linear layer.
The pooler is new and randomly initialised: ember pretrains no next-sentence task.

The step path reads nothing back from the device: the examples are padded into one array
once, a batch is a slice of it, the running loss stays on the device until the end of an
epoch, and a batch without padding passes no attention mask (SDPA keeps its fast
kernels). AdamW is torch's fused kernel where it has one (CPU, CUDA): the same update in
one kernel per step instead of a loop over the parameter tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.eval.encode import equal_length_batches, steps_per_epoch, train_batches
from ember.model import Transformer
from ember.device import autocast
from ember.train.loss_scale import LossScaler


POOLING = ("auto", "mean")


@dataclass(frozen=True)
class Protocol:
    """Cramming's fine-tuning hyperparameters, the same for every task."""

    epochs: int = 5
    batch_size: int = 16
    lr: float = 4e-5
    warmup: float = 0.1  # fraction of the steps, then cosine decay to 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    max_len: int = 128
    dropout: float = 0.1
    pooling: str = "auto"  # "auto": first token (masked LM) or last (causal LM); "mean": all real tokens
    eval_batch: int = 256  # examples of one length per prediction batch (no padding)
    fused: bool = True  # AdamW's fused kernel where torch has one; False: its loop over tensors

    def to_dict(self) -> dict:
        return asdict(self)


class Classifier(nn.Module):
    def __init__(self, encoder: Transformer, outputs: int, dropout: float, pooling: str = "auto"):
        super().__init__()
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, not {pooling!r}")
        self.encoder = encoder
        self.mean = pooling == "mean"
        self.first_token = encoder.cfg.objective == "mlm"
        hidden = encoder.cfg.hidden
        self.pooler = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, outputs)
        for layer in (self.pooler, self.out):
            nn.init.normal_(layer.weight, std=encoder.cfg.init_std)
            nn.init.zeros_(layer.bias)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] right-padded, lengths [B] -> logits [B, outputs] (scores for regression);
        lengths None: no example is padded."""
        if lengths is None:
            h = self.encoder.trunk(ids)
            pooled = h.mean(1) if self.mean else h[:, 0] if self.first_token else h[:, -1]
        else:
            real = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
            h = self.encoder.trunk(ids, key_padding_mask=real)
            if self.mean:
                pooled = (h * real[..., None]).sum(1) / lengths[:, None].to(h.dtype)
            else:
                at = torch.zeros_like(lengths) if self.first_token else lengths - 1
                pooled = h[torch.arange(len(ids), device=ids.device), at]
        pooled = self.encoder.norm(pooled)
        pooled = torch.tanh(self.pooler(self.drop(pooled)))
        return self.out(self.drop(pooled))


def lr_at(step: int, total: int, p: Protocol) -> float:
    """Linear warm-up over the first `warmup` of the steps, then cosine decay to 0."""
    warm = max(1, math.ceil(p.warmup * total))
    if step < warm:
        return p.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return p.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def total_steps(n: int, p: Protocol) -> int:
    return p.epochs * steps_per_epoch(n, p.batch_size)


def padded_array(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Every example right-padded to the longest, [N, longest], and the lengths [N]."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.full((len(rows), int(lengths.max())), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    return ids, lengths


def make_optimizer(params: list, p: Protocol, device: torch.device) -> torch.optim.Optimizer:
    fused = p.fused and device.type in ("cpu", "cuda")
    return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
                             **({"fused": True} if fused else {}))


def finetune(model: Classifier, rows: list[list[int]], labels: list, regression: bool, pad_id: int,
             seed: int, p: Protocol, device: torch.device, amp_dtype: torch.dtype | None,
             on_step: Callable[[int, torch.Tensor], None] = lambda step, loss: None,
             on_epoch: Callable[[int, torch.Tensor, int], None] = lambda epoch, loss_sum, steps: None) -> torch.Tensor:
    """Train `model` in place; `seed` orders the data (the caller seeds the head and dropout).
    `on_epoch(epoch, summed loss on the device, steps)` follows each epoch. Returns the last
    epoch's mean loss, on the device."""
    model.to(device).train()
    optimizer = make_optimizer([q for q in model.parameters() if q.requires_grad], p, device)
    scaler = LossScaler(device, amp_dtype == torch.float16)
    rng = np.random.default_rng(seed)
    target = torch.tensor(labels, dtype=torch.float32 if regression else torch.long)
    ids_all, lengths = padded_array(rows, pad_id)
    total, step = total_steps(len(rows), p), 0
    for epoch in range(p.epochs):
        loss_sum, first = torch.zeros((), device=device), step
        for batch in train_batches(lengths, p.batch_size, rng):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, p)
            lens = lengths[batch]
            longest = int(lens.max())
            ids = torch.from_numpy(ids_all[batch, :longest]).to(device, non_blocking=True)
            lens = None if int(lens.min()) == longest else torch.from_numpy(lens).to(device, non_blocking=True)
            y = target[torch.from_numpy(batch)].to(device, non_blocking=True)
            with autocast(device, amp_dtype):
                out = model(ids, lens).float()
            loss = F.mse_loss(out.squeeze(-1), y) if regression else F.cross_entropy(out, y)
            (loss * scaler.factor()).backward()
            scaler.unscale([optimizer])
            scaler.step([optimizer])
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            on_step(step, loss.detach())
            step += 1
        on_epoch(epoch, loss_sum, step - first)
    return loss_sum / max(1, step - first)


@torch.inference_mode()
def predict(model: Classifier, rows: list[list[int]], regression: bool, p: Protocol,
            device: torch.device, amp_dtype: torch.dtype | None) -> list:
    """Class indices (or scores) in the order of `rows`."""
    model.to(device).eval()
    out: list = [None] * len(rows)
    for batch in equal_length_batches([len(r) for r in rows], p.eval_batch):
        ids = torch.tensor([rows[i] for i in batch], device=device)
        with autocast(device, amp_dtype):
            scores = model(ids).float()
        values = scores.squeeze(-1).tolist() if regression else scores.argmax(-1).tolist()
        for i, value in zip(batch, values):
            out[i] = value
    return out
