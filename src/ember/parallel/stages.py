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
from torch import nn

from ember.model.loss import OutputLayer
from ember.model.transformer import Transformer
from ember.parallel.dtensor import local_tensor


class StageModule(Transformer):
    """One contiguous piece of the Transformer: the model itself with the parts this stage
    does not hold left out, so its forward is the model's. Input: token ids on the first
    stage, hidden states [B, T, hidden] elsewhere. Output: hidden states, or on the last
    stage the summed cross-entropy over its micro-batch's labelled positions, shape [1]."""

    def __init__(self, model: Transformer, index: int, n_stages: int, layers: range):
        nn.Module.__init__(self)  # shares `model`'s modules rather than building new ones
        cfg = self.cfg = model.cfg
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.embed = model.embed if self.is_first else None
        self.pos_embed = model.pos_embed if self.is_first else None
        self.register_buffer("pos_table", model.pos_table if self.is_first else None, persistent=False)
        self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None
        if self.is_last and cfg.tie_embeddings and not self.is_first:
            # The embedding lives on the first stage; this one gets its own copy (the
            # pipeline engine keeps the two copies' gradients summed).
            self.head = OutputLayer(cfg.hidden, cfg.padded_vocab, device=model.head.weight.device,
                                    dtype=model.head.weight.dtype)
            with torch.no_grad():
                self.head.weight.copy_(model.head.weight)
        # Labels of the micro-batches still to run (last stage only); see the module doc.
        self.pending_labels: collections.deque[tuple] = collections.deque()
        self.last_labels_ptr: int | None = None
        self.sums: list[torch.Tensor] = []  # detached sum-losses of this step's micro-batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_last:
            return self.trunk(x)
        if not self.pending_labels:
            raise RuntimeError("the last pipeline stage ran a micro-batch it was given no labels for")
        labels, positions = self.pending_labels.popleft()
        self.last_labels_ptr = labels.data_ptr()
        # replicated under loss_parallel
        loss = local_tensor(super().forward(x, labels, reduction="sum", target_positions=positions))
        self.sums.append(loss.detach())
        # [1], not a scalar: older schedules concatenate the last stage's outputs on dim 0.
        return torch.stack([loss])  # a new tensor: FSDP warns about views returned from forward

    def queue_labels(self, chunks: list[torch.Tensor], positions: list[torch.Tensor] | None = None) -> None:
        """The labels of the coming micro-batches, and (sparse MLM) their labelled positions."""
        self.pending_labels.clear()
        self.pending_labels.extend(zip(chunks, positions or [None] * len(chunks)))
        self.sums = []


def split_model(model: Transformer, stage_ids: list[int], split: tuple[int, ...]) -> list[StageModule]:
    """The stage modules `stage_ids` of `model`, cut into stages of `split` layers each
    (`Layout.split`), sharing its parameters, except a tied output layer on a last stage
    that is not also the first."""
    starts = [sum(split[:i]) for i in range(len(split) + 1)]
    return [StageModule(model, index, len(split), range(starts[index], starts[index + 1])) for index in stage_ids]
