"""Run under torchrun (2 ranks, gloo): tensor-parallel (and sequence-parallel) training of
tiny Transformers against the same model trained in one process on the same batches.

Usage: torchrun --nproc-per-node 2 tensor_worker.py OUT.json. Rank 0 writes one record per
case (losses, grad norms and parameter differences of both runs); the test judges them.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ember.config import ModelConfig
from ember.model import Transformer
from ember.model.transformer import IGNORE
import ember.parallel.tensor as tensor_module
from ember.parallel.tensor import apply_tensor_parallel, loss_parallel_context
from ember.process import end_process_group, leave

STEPS, BATCH, SEQ, CLIP = 3, 4, 8, 1.0

# Each option value appears at least once on each side of the ones the plan cares about.
CASES = {
    "mlm-learned-gelu-tied-bias": dict(objective="mlm", positions="learned", activation="gelu",
                                       tie_embeddings=True, norm="layernorm", bias=True),
    "mlm-rotary-swiglu-untied": dict(objective="mlm", positions="rotary", activation="swiglu",
                                     tie_embeddings=False, norm="rmsnorm"),
    "mlm-dense-sinusoidal-geglu-tied": dict(objective="mlm", positions="sinusoidal", activation="geglu",
                                            tie_embeddings=True, sparse_prediction=False),
    "causal-rotary-swiglu-tied": dict(objective="causal", positions="rotary", activation="swiglu",
                                      tie_embeddings=True, norm="rmsnorm"),
    "causal-learned-gelu-untied-bias": dict(objective="causal", positions="learned", activation="gelu",
                                            tie_embeddings=False, bias=True),
    # Grouped-query attention: each rank holds 2 of the 4 query heads and the 1 of the 2
    # key/value heads they read.
    "causal-gqa-rotary-swiglu-bias": dict(objective="causal", positions="rotary", activation="swiglu",
                                          tie_embeddings=True, norm="rmsnorm", bias=True, kv_heads=2),
}


def config(**overrides) -> ModelConfig:
    base = dict(vocab_size=50, vocab_multiple=16, hidden=32, layers=2, heads=4, mlp_hidden=48,
                max_seq_len=16)
    return ModelConfig(**{**base, **overrides})


def batches(cfg: ModelConfig, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=gen)
        if cfg.objective == "mlm":
            chosen = torch.rand(BATCH, seq, generator=gen) < 0.3
            chosen[:, 0] = True
            labels = torch.where(chosen, ids, IGNORE)
        else:
            labels = torch.roll(ids, -1, dims=1)
            labels[:, -1] = IGNORE
        out.append((ids, labels))
    return out


def value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model: nn.Module, data, step_fn) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, norms = [], []
    for ids, labels in data:
        scale = 1.0 / int((labels != IGNORE).sum())
        loss = step_fn(ids, labels, scale)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(value(loss)))
        norms.append(float(value(norm)))
    params = {name: value(p.detach()).clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def whole_model_step(model: nn.Module):
    def step(ids, labels, scale):
        with loss_parallel_context(model):
            loss = model(ids, labels, reduction="sum")
            (loss * scale).backward()
        check_grad_layouts(model)
        return loss.detach()
    return step


GRAD_LAYOUTS: list[str] = []  # parameters whose gradient came back in another layout


# Gradients that arrive whole for a parameter split over the ranks (DTensor's own embedding
# made the whole vocabulary's on every rank): what the layout hook had to slice.
ARRIVED_WHOLE: list[str] = []
_in_layout = tensor_module._in_layout


def _recording_in_layout(mesh, placements):
    inner = _in_layout(mesh, placements)

    def hook(grad):
        if isinstance(grad, DTensor) and any(p.is_shard() for p in placements) and grad.placements != placements:
            ARRIVED_WHOLE.append(f"{tuple(grad.shape)} as {grad.placements} for {placements}")
        return inner(grad)
    return hook


tensor_module._in_layout = _recording_in_layout


def check_grad_layouts(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.grad.placements != p.placements:
            GRAD_LAYOUTS.append(f"{name}: {p.grad.placements} for {p.placements}")


class Stage(nn.Module):
    """A pipeline stage as the pipeline module builds one: a subset of the Transformer's
    attributes with the original names, blocks in a ModuleDict keyed by layer index."""

    def __init__(self, model: Transformer, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        if first:
            self.embed, self.pos_embed, self.drop = model.embed, model.pos_embed, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.drop(self.embed(x) + self.pos_embed(torch.arange(x.shape[1])))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        if self.cfg.objective == "mlm" and self.cfg.sparse_prediction:
            keep = labels != IGNORE
            x, labels = x[keep], labels[keep]
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")


def two_stage_step(first: Stage, last: Stage):
    """Runs the stages one after the other, handing the activation and its gradient over
    as a pipeline does, each stage's backward under its own loss-parallel context."""
    def step(ids, labels, scale):
        with loss_parallel_context(first):
            sent = first(ids)
        received = sent.detach().requires_grad_(True)
        with loss_parallel_context(last):
            loss = last(received, labels)
            (loss * scale).backward()
        with loss_parallel_context(first):
            sent.backward(received.grad)
        check_grad_layouts(first)
        check_grad_layouts(last)
        return loss.detach()
    return step


def unfused(model: nn.Module) -> bool:
    """Whether every block calls its projections one by one, where the plan's hooks are."""
    return not any(getattr(m, "fused", False) for m in model.modules())


def compare(ref: dict, got: dict) -> dict:
    # k_proj.bias adds q.b to every score of a query, which softmax ignores: its exact
    # gradient is zero, and AdamW turns each run's rounding noise into steps of size lr.
    diffs = {name: float((got["params"][name] - p).norm() / p.norm()) for name, p in ref["params"].items()
             if not name.endswith("k_proj.bias")}
    return {"ref_losses": ref["losses"], "losses": got["losses"], "ref_norms": ref["norms"],
            "norms": got["norms"], "param_names": sorted(got["params"]) == sorted(ref["params"]),
            "param_rel": max(diffs.values()), "worst_param": max(diffs, key=diffs.get)}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    records = {}
    for name, overrides in CASES.items():
        cfg = config(**overrides)
        data = batches(cfg)
        torch.manual_seed(0)
        reference = Transformer(cfg)
        parallel = copy.deepcopy(reference)
        ref = train(reference, data, whole_model_step(reference))
        for sp in (False, True):
            model = copy.deepcopy(parallel)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp)
            tied = model.head.weight is model.embed.weight
            seen = []  # the tokens per sequence a norm inside a block works on
            model.blocks["1"].mlp_norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
            record = compare(ref, train(model, data, whole_model_step(model)))
            record["tied"] = tied == cfg.tie_embeddings
            record["unfused"] = unfused(model)
            record["norm_tokens"] = seen[0]
            records[f"{name}/{'tp2+sp' if sp else 'tp2'}"] = record

    # A model split into two pipeline stages, each tensor-parallel on its own.
    cfg = config(objective="mlm", positions="learned", activation="swiglu", tie_embeddings=False, layers=3)
    data = batches(cfg)
    torch.manual_seed(0)
    reference = Transformer(cfg)
    parallel = copy.deepcopy(reference)
    ref = train(reference, data, whole_model_step(reference))
    for sp in (False, True):
        model = copy.deepcopy(parallel)
        first, last = Stage(model, [0, 1], True, False), Stage(model, [2], False, True)
        for stage in (first, last):
            apply_tensor_parallel(stage, mesh, sequence_parallel=sp)
        seen = []
        last.blocks["2"].mlp_norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
        record = compare(ref, train(model, data, two_stage_step(first, last)))
        record["tied"], record["norm_tokens"], record["unfused"] = True, seen[0], unfused(model)
        records[f"stages-mlm-learned-swiglu/{'tp2+sp' if sp else 'tp2'}"] = record

    # torch.compile'd blocks (as train.compile does), through AOT autograd without code
    # generation: the embedding's output must reach the compiled block as a tensor of its own.
    cfg = config(objective="causal", positions="rotary", activation="swiglu", tie_embeddings=True, layers=1)
    data = batches(cfg)
    torch.manual_seed(0)
    reference = Transformer(cfg)
    model = copy.deepcopy(reference)
    ref = train(reference, data, whole_model_step(reference))
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    for block in model.blocks.values():
        block.compile(backend="aot_eager")
    seen = []
    model.blocks["0"].mlp_norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    record = compare(ref, train(model, data, whole_model_step(model)))
    record["tied"], record["norm_tokens"] = model.head.weight is model.embed.weight, seen[0]
    record["unfused"] = unfused(model)
    records["compiled-causal-rotary-swiglu-tied/tp2+sp"] = record

    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"cases": records, "grad_layouts": sorted(set(GRAD_LAYOUTS)),
                       "arrived_whole": sorted(set(ARRIVED_WHOLE))}, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    leave(0)
