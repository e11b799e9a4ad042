"""The two baselines of benchmarks/vs_nanogpt.py, written as their users write them.

1. nanoGPT's GPT and the body of its train.py (Karpathy, github.com/karpathy/nanoGPT,
   model.py and train.py): pre-LN blocks, one c_attn projection for q, k and v,
   F.scaled_dot_product_attention, GELU MLP of 4x, learned positions, tied wte/lm_head,
   N(0, 0.02) init with c_proj at 0.02/sqrt(2 * n_layer), AdamW with 2-D parameters
   decayed (fused only on CUDA, as train.py asks), warmup then cosine to lr/10, gradient
   clipping. Not compiled. The one change: the loss ignores label -100, the label of the
   last position of ember's rows, so that both sides predict exactly the same tokens.
2. Hugging Face `transformers`' Trainer on BertForMaskedLM with
   DataCollatorForLanguageModeling, fed the rows ember trains on in the same order.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if use_fused else {}))


def get_lr(it, warmup_iters, lr_decay_iters, learning_rate, min_lr):
    """nanoGPT train.py's schedule: linear warmup, then cosine down to min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def nanogpt_step(model, optimizer, X, Y, lr, grad_clip) -> torch.Tensor:
    """One iteration of train.py's loop (one micro-step, no scaler: fp32)."""
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    _, loss = model(X, Y)
    loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def hf_tokenizer(data_dir, manifest):
    """ember's tokenizer.json as the PreTrainedTokenizerFast a transformers user loads."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = str(data_dir / manifest.get("tokenizer_file", "tokenizer.json"))
    raw = Tokenizer.from_file(path)
    roles = {f"{role}_token": raw.id_to_token(i) for role, i in manifest["special_tokens"].items()
             if i is not None and role in ("sep", "pad", "mask", "cls", "unk")}
    return PreTrainedTokenizerFast(tokenizer_file=path, **roles)


def hf_bert_trainer(model, rows, tokenizer, out_dir, *, micro_batch, global_batch, steps, lr, betas, eps,
                    weight_decay, clip, mlm_rate, seed, lr_at, between_steps=None):
    """Train `model` with transformers' Trainer on `rows` (in this order: the sampler is
    sequential so both sides see the same rows per step), masking with
    DataCollatorForLanguageModeling. `lr_at(step, steps)` is the lr multiplier (the same
    schedule ember runs), `between_steps(step)` is called after each optimizer step and its
    time is left out of the Trainer's. Returns the Trainer's seconds per step and the
    optimizer it chose."""
    from torch.utils.data import SequentialSampler
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda k: lr_at(k, num_training_steps))
            return self.lr_scheduler

    class Clock(TrainerCallback):
        """Seconds of each Trainer step: from the end of the previous step (after what
        `between_steps` did) to the end of this one, so data loading and masking count."""

        def __init__(self):
            self.seconds, self.mark = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self.mark)
            if between_steps is not None:
                between_steps(state.global_step)
            self.mark = time.perf_counter()

    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=global_batch // micro_batch, max_steps=steps, learning_rate=lr,
        adam_beta1=betas[0], adam_beta2=betas[1], adam_epsilon=eps, weight_decay=weight_decay, max_grad_norm=clip,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, seed=seed,
        data_seed=seed, dataloader_num_workers=0, disable_tqdm=True)
    clock = Clock()
    dataset = [{"input_ids": row} for row in rows]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_rate)
    InOrder(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[clock]).train()
    return clock.seconds, str(getattr(args.optim, "value", args.optim))
