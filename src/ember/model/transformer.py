"""One pre-norm transformer for both objectives: a masked LM (BERT, Cramming) and a
causal LM (GPT-2, Llama). The objective only decides the attention mask and whether the
output layer sees every position or the masked ones alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import ModelConfig
from ember.model.init import init_buffers, init_weights
from ember.model.layers import Block, attention_mask, make_norm, sinusoidal_table
from ember.model.loss import IGNORE, OutputLayer


class Transformer(nn.Module):
    """Attributes are the targets of parallelism plans applied from outside: `embed`,
    `pos_embed` (learned positions only), `blocks` (an nn.ModuleDict keyed by the layer
    index, "0", "1", ...), `norm`, `head`. A pipeline stage is this model with the parts it
    does not hold deleted (set to None, blocks removed): the forward skips what is missing,
    so a stage keeps the whole model's parameter names and computes exactly its share."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be resolved (> 0) before building the model.")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden) if cfg.positions == "learned" else None
        if cfg.positions == "sinusoidal":
            # Fixed, so kept out of checkpoints and the optimizer.
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.hidden), persistent=False)
        else:
            self.pos_table = None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = make_norm(cfg)
        self.head = OutputLayer(cfg.hidden, cfg.padded_vocab)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Initial weights by parameter name (`ember.model.init`): the same numbers whatever
        builds the model or holds which part of it. `seed` None draws one from torch's global
        generator, so `torch.manual_seed` still decides; a model on the meta device is left
        for `ember.parallel.materialize` to fill once each rank holds only its share."""
        if any(p.is_meta for p in self.parameters()):
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
        init_weights(self, self.cfg, seed)
        init_buffers(self, self.cfg)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Trainable parameters, a tied weight counted once; optionally without the token
        and learned position embeddings (a tied head goes with its embedding)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed.weight.numel()
            if self.pos_embed is not None:
                total -= self.pos_embed.weight.numel()
        return total

    def trunk(self, input_ids: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
              document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> hidden states [B, T, hidden] after the last block, before
        the final norm (without `embed`, a later pipeline stage: hidden states in and out).
        `key_padding_mask` [B, T] (True = real token) keeps a masked LM from attending to
        the pads of a right-padded batch; `document_ids` [B, T] (equal ids = one document)
        keeps attention inside each document of a packed row.
        Positions still count from the row's start, not the document's: rotary attention
        depends only on distances, so there a document sees what it would alone."""
        x = self._embed(input_ids) if self.embed is not None else input_ids
        flex = document_ids is not None and self._flex(document_ids.device)
        mask = attention_mask(self.cfg.objective == "causal", key_padding_mask, document_ids, flex)
        for block in self.blocks.values():
            x = block(x, mask)
        return x

    def _flex(self, device: torch.device) -> bool:
        """Whether document masks go to FlexAttention (`model.document_kernel`): "auto" on
        CUDA, where it keeps a fused kernel, and only without attention dropout, which it
        lacks; a CPU's SDPA already fuses the dense mask into its own kernel."""
        kernel = self.cfg.document_kernel
        return kernel == "flex" or (kernel == "auto" and device.type == "cuda" and not self.cfg.dropout)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model max_seq_len {self.cfg.max_seq_len}.")
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq, device=input_ids.device))
        elif self.pos_table is not None:
            x = x + self.pos_table[:seq].to(x.dtype)
        return self.drop(x)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                reduction: str = "mean", document_ids: torch.Tensor | None = None,
                target_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Without labels: logits [B, T, padded_vocab]. With labels: the cross-entropy over
        positions whose label is not -100, averaged ("mean") or summed ("sum"; the
        trainer divides by the targets of a whole step, across accumulation and ranks),
        computed in chunks that never hold the full logits (`ember.model.loss`).
        `document_ids` [B, T]: attend only within each document (see `trunk`).
        `target_positions`: for a masked LM with sparse prediction, the flat indices
        (into B x T) of the labelled positions, made where the labels were made; without
        them the model finds them itself, which waits for the device (a host sync)."""
        h = self.trunk(input_ids, document_ids=document_ids)
        if self.head is None:  # a pipeline stage before the last
            return h
        if labels is None:
            return self.head(self.norm(h))
        if self.cfg.objective == "mlm" and self.cfg.sparse_prediction:
            # Only masked positions are predicted, so only they pass through the largest
            # matmul of a masked LM; norm is per token, so gathering first changes nothing.
            h, labels = labelled_positions(h, labels, target_positions)
        h = self.norm(h)
        if self.head.vocab_parallel:  # logits sharded on the vocabulary: a cross-entropy made for them
            logits = self.head(h)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE, reduction=reduction)
        return self.head(h, labels, reduction)


def labelled_positions(h: torch.Tensor, labels: torch.Tensor,
                       positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states [N, hidden] and labels [N] of the labelled positions of h [B, T,
    hidden], in row-major order."""
    if positions is None:
        keep = labels != IGNORE
        return h[keep], labels[keep]
    return h.reshape(-1, h.shape[-1]).index_select(0, positions), labels.reshape(-1).index_select(0, positions)


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat indices of `labels` [B, T] that are not -100: on the host, where the
    labels are made, so that the device never reports a count back."""
    return (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
