"""Cutting the plain Transformer into pipeline stage modules.

A stage keeps the Transformer's parameter names: the first stage holds `embed` (and
`pos_embed` or the fixed `pos_table`), every stage a slice of `blocks` in an nn.ModuleDict
keyed by the original layer index ("3", "4", ...), the last stage `norm` and `head`. So a
stage's state_dict keys are the plain model's ("blocks.3.attn.q_proj.weight"), and
checkpoints stay layout-independent.

The last stage also computes the loss. A masked LM with sparse prediction sends only the
labelled positions through the head, so the last stage needs the labels before its head;
the pipeline schedules hand labels only to the loss function, after the stage's forward.
The last stage therefore takes its labels from a queue filled per step in micro-batch
order (every schedule runs a stage's forwards in micro-batch order), and the loss
function checks that the labels it is given are the ones the forward used.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.model.transformer import IGNORE, Transformer


def stage_layers(layers: int, n_stages: int) -> list[range]:
    """The layer indices of each stage: equal consecutive slices (layers divisible by n_stages)."""
    per = layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def stage_ranks(pp: int, vpp: int, style: str = "loop") -> list[int]:
    """The pipeline rank holding each of the pp * vpp stages. "loop": rank r holds stages
    r, r + pp, ... (interleaved 1F1B); "v": rank r holds stages r and 2pp - 1 - r (ZB-V)."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * vpp)]


class StageModule(nn.Module):
    """One contiguous piece of the Transformer. Input: token ids on the first stage,
    hidden states [B, T, hidden] elsewhere. Output: hidden states, or on the last stage
    the summed cross-entropy over its micro-batch's labelled positions, shape [1]."""

    def __init__(self, cfg: ModelConfig, index: int, n_stages: int, layers: range):
        super().__init__()
        self.cfg = cfg
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.layer_ids = list(layers)
        self.blocks = nn.ModuleDict()
        # Labels of the micro-batches still to run (last stage only); see the module doc.
        self.pending_labels: collections.deque[torch.Tensor] = collections.deque()
        self.last_labels_ptr: int | None = None
        self.sums: list[torch.Tensor] = []  # detached sum-losses of this step's micro-batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self._embed(x)
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        if x.device.type == "meta":
            # Shape inference at the first step: only the output's shape and dtype matter.
            return torch.zeros(1, dtype=torch.float32, device=x.device)
        return self._loss(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Mirrors Transformer.trunk up to the first block.
        seq = input_ids.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model max_seq_len {self.cfg.max_seq_len}.")
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq, device=input_ids.device))
        elif self.pos_table is not None:
            x = x + self.pos_table[:seq].to(x.dtype)
        return self.drop(x)

    def _loss(self, h: torch.Tensor) -> torch.Tensor:
        # Mirrors Transformer.forward with labels and reduction="sum".
        if not self.pending_labels:
            raise RuntimeError("the last pipeline stage ran a micro-batch it was given no labels for")
        labels = self.pending_labels.popleft()
        self.last_labels_ptr = labels.data_ptr()
        if self.cfg.objective == "mlm" and self.cfg.sparse_prediction:
            keep = labels != IGNORE
            h, labels = h[keep], labels[keep]
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
        if hasattr(loss, "to_local"):  # a replicated DTensor under the vocabulary-parallel loss
            loss = loss.to_local()
        self.sums.append(loss.detach())
        # [1], not a scalar: older schedules concatenate the last stage's outputs on dim 0.
        return torch.stack([loss])  # a new tensor: FSDP warns about views returned from forward

    def queue_labels(self, chunks: list[torch.Tensor]) -> None:
        self.pending_labels.clear()
        self.pending_labels.extend(chunks)
        self.sums = []


def split_model(model: Transformer, stage_ids: list[int], n_stages: int) -> list[StageModule]:
    """The stage modules `stage_ids` (of n_stages) of `model`, sharing its parameters,
    except a tied output layer on a last stage that is not also the first: it gets its own
    copy of the embedding (the pipeline engine keeps the two copies' gradients summed)."""
    cfg = model.cfg
    slices = stage_layers(cfg.layers, n_stages)
    stages = []
    for index in stage_ids:
        stage = StageModule(cfg, index, n_stages, slices[index])
        if stage.is_first:
            stage.embed = model.embed
            stage.pos_embed = model.pos_embed
            if model.pos_table is not None:
                stage.register_buffer("pos_table", model.pos_table, persistent=False)
            else:
                stage.pos_table = None
            stage.drop = model.drop
        for i in stage.layer_ids:
            stage.blocks[str(i)] = model.blocks[i]
        if stage.is_last:
            stage.norm = model.norm
            if cfg.tie_embeddings and not stage.is_first:
                head = nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False,
                                 device=model.head.weight.device, dtype=model.head.weight.dtype)
                with torch.no_grad():
                    head.weight.copy_(model.head.weight)
                stage.head = head
            else:
                stage.head = model.head
        stages.append(stage)
    return stages
