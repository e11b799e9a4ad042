"""ember's transformer as transformers remote code: `ember export hf` copies this file
next to the weights of a model no built-in transformers class computes exactly (the
masked LMs: pre-norm, GeGLU, no biases, scaled sinusoidal or learned or rotary positions),
so that `AutoModelForMaskedLM` and `AutoModelForSequenceClassification` load it with
`trust_remote_code=True`, where ember is not installed.

It imports only torch and transformers, and computes what `ember.model.Transformer`
computes (the export's tests compare the logits to 1e-5). Classification pools as ember's
fine-tuning does: the first position of a masked LM (the last real token of a causal one)
through the final norm, then a dense + tanh pooler, dropout and a linear layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput


class EmberConfig(PretrainedConfig):
    model_type = "ember"

    def __init__(self, vocab_size: int = 32768, hidden: int = 768, layers: int = 12, heads: int = 12,
                 mlp_hidden: int = 3072, max_seq_len: int = 128, objective: str = "mlm",
                 activation: str = "geglu", norm: str = "layernorm", positions: str = "sinusoidal",
                 bias: bool = False, norm_eps: float = 1e-12, rope_theta: float = 10000.0,
                 dropout: float = 0.0, classifier_dropout: float = 0.1, initializer_range: float = 0.02,
                 kv_heads: int = 0, **kwargs):
        self.vocab_size, self.hidden, self.layers, self.heads = vocab_size, hidden, layers, heads
        self.kv_heads = kv_heads or heads  # grouped-query attention below heads
        self.mlp_hidden, self.max_seq_len, self.objective = mlp_hidden, max_seq_len, objective
        self.activation, self.norm, self.positions, self.bias = activation, norm, positions, bias
        self.norm_eps, self.rope_theta, self.dropout = norm_eps, rope_theta, dropout
        self.classifier_dropout, self.initializer_range = classifier_dropout, initializer_range
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = hidden, layers, heads
        kwargs.setdefault("tie_word_embeddings", False)  # the output layer is stored as its own tensor
        super().__init__(**kwargs)


def _norm(cfg: EmberConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions in the rotate-half layout; tables made in float64, rounded once."""
    seq, d = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64, device=x.device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().float().to(x.dtype), angles.sin().float().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _sinusoidal(seq: int, hidden: int, device) -> torch.Tensor:
    """The fixed position table scaled by 1/sqrt(hidden) (FLASH, Cramming)."""
    position = torch.arange(seq, dtype=torch.float64, device=device)[:, None]
    inv_freq = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / hidden))
    table = torch.zeros(seq, hidden, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : hidden // 2]
    return (table / math.sqrt(hidden)).float()


class Attention(nn.Module):
    def __init__(self, cfg: EmberConfig):
        super().__init__()
        self.cfg, self.head_dim = cfg, cfg.hidden // cfg.heads
        kv_hidden = cfg.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_hidden, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_hidden, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.cfg.positions == "rotary":
            q, k = _rotate(q, self.cfg.rope_theta), _rotate(k, self.cfg.rope_theta)
        # Query head i reads key/value head i // group; copies work on any torch, enable_gqa needs 2.5.
        group = self.cfg.heads // self.cfg.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        causal = self.cfg.objective == "causal"
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                             dropout_p=self.cfg.dropout if self.training else 0.0, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: EmberConfig):
        super().__init__()
        self.activation = cfg.activation
        self.up = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=cfg.bias)
        self.gate = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=cfg.bias) if cfg.activation != "gelu" else None
        self.down = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return self.down(F.gelu(self.up(x)))
        act = F.gelu if self.activation == "geglu" else F.silu
        return self.down(act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: EmberConfig):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = _norm(cfg), Attention(cfg), _norm(cfg), MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class EmberPreTrainedModel(PreTrainedModel):
    config_class = EmberConfig
    base_model_prefix = "model"

    def _init_weights(self, module: nn.Module) -> None:  # only for what the checkpoint lacks (classifiers)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


class EmberModel(EmberPreTrainedModel):
    """Token ids -> hidden states after the final norm."""

    def __init__(self, config: EmberConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_embed = nn.Embedding(config.max_seq_len, config.hidden) if config.positions == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm = _norm(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        seq = input_ids.shape[1]
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(seq, device=input_ids.device))
        elif self.config.positions == "sinusoidal":
            x = x + _sinusoidal(seq, self.config.hidden, input_ids.device).to(x.dtype)
        x = self.drop(x)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.blocks.values():
            x = block(x, mask)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class EmberForMaskedLM(EmberPreTrainedModel):
    def __init__(self, config: EmberConfig):
        super().__init__(config)
        self.model = EmberModel(config)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> MaskedLMOutput:
        logits = self.head(self.model(input_ids, attention_mask).last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


class EmberForSequenceClassification(EmberPreTrainedModel):
    def __init__(self, config: EmberConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = EmberModel(config)
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.out = nn.Linear(config.hidden, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> SequenceClassifierOutput:
        h = self.model(input_ids, attention_mask).last_hidden_state
        if self.config.objective == "causal":  # the last real token has seen the whole input
            last = (attention_mask.sum(1) - 1) if attention_mask is not None else torch.full(
                (len(h),), h.shape[1] - 1, device=h.device)
            pooled = h[torch.arange(len(h), device=h.device), last]
        else:
            pooled = h[:, 0]
        logits = self.out(self.drop(torch.tanh(self.pooler(self.drop(pooled)))))
        loss = None
        if labels is not None:
            loss = (F.mse_loss(logits.squeeze(-1), labels.float()) if self.num_labels == 1
                    else F.cross_entropy(logits, labels))
        return SequenceClassifierOutput(loss=loss, logits=logits)
