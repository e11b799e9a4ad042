"""Fine-tune a pretrained encoder with a classification or regression head (the
Cramming protocol) and predict with it.

Pooling: a masked LM reads the first position (its [CLS] or leading separator); a causal
LM reads its last real token, the only one that has seen the whole input, so the two
objectives are compared on equal terms. Either way the hidden state goes through the
model's own final norm, then BERT's pooler (dense + tanh), dropout and a linear layer.
The pooler is new and randomly initialised: ember pretrains no next-sentence task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.eval.encode import equal_length_batches, pad, steps_per_epoch, train_batches
from ember.model import Transformer
from ember.device import autocast


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
    eval_batch: int = 64

    def to_dict(self) -> dict:
        return asdict(self)


class Classifier(nn.Module):
    def __init__(self, encoder: Transformer, outputs: int, dropout: float):
        super().__init__()
        self.encoder = encoder
        self.first_token = encoder.cfg.objective == "mlm"
        hidden = encoder.cfg.hidden
        self.pooler = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, outputs)
        for layer in (self.pooler, self.out):
            nn.init.normal_(layer.weight, std=encoder.cfg.init_std)
            nn.init.zeros_(layer.bias)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids [B, T] right-padded, lengths [B] -> logits [B, outputs] (scores for regression)."""
        real = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        h = self.encoder.trunk(ids, key_padding_mask=real)
        at = torch.zeros_like(lengths) if self.first_token else lengths - 1
        pooled = self.encoder.norm(h[torch.arange(len(ids), device=ids.device), at])
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


def finetune(model: Classifier, rows: list[list[int]], labels: list, regression: bool, pad_id: int,
             seed: int, p: Protocol, device: torch.device, amp_dtype: torch.dtype | None,
             on_step: Callable[[int, torch.Tensor], None] = lambda step, loss: None) -> None:
    """Train `model` in place; `seed` orders the data (the caller seeds the head and dropout)."""
    model.to(device).train()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    rng = np.random.default_rng(seed)
    target = torch.tensor(labels, dtype=torch.float32 if regression else torch.long)
    lengths = [len(r) for r in rows]
    total, step = total_steps(len(rows), p), 0
    for _ in range(p.epochs):
        for batch in train_batches(lengths, p.batch_size, rng):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, p)
            ids, lens = pad([rows[i] for i in batch], pad_id)
            y = target[batch].to(device)
            with autocast(device, amp_dtype):
                out = model(ids.to(device), lens.to(device)).float()
            loss = F.mse_loss(out.squeeze(-1), y) if regression else F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            on_step(step, loss.detach())
            step += 1


@torch.no_grad()
def predict(model: Classifier, rows: list[list[int]], regression: bool, p: Protocol,
            device: torch.device, amp_dtype: torch.dtype | None) -> list:
    """Class indices (or scores) in the order of `rows`."""
    model.to(device).eval()
    out: list = [None] * len(rows)
    for batch in equal_length_batches([len(r) for r in rows], p.eval_batch):
        ids = torch.tensor([rows[i] for i in batch], device=device)
        lens = torch.full((len(batch),), ids.shape[1], device=device)
        with autocast(device, amp_dtype):
            scores = model(ids, lens).float()
        values = scores.squeeze(-1).tolist() if regression else scores.argmax(-1).tolist()
        for i, value in zip(batch, values):
            out[i] = value
    return out
