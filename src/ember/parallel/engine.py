"""Engines: what one optimizer step runs on this rank, whatever the layout.

The trainer hands an engine this data-parallel rank's rows of the global batch and the
scale 1 / (targets of the whole global batch); after `forward_backward` the gradients equal
the single-device gradient of the global sum-loss times that scale, in every layout. So the
trainer's step, schedule, clipping and logging are the same code for one process and many.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from ember.config import Config
from ember.device import NO_TIMER, PhaseTimer, autocast
from ember.layout import Layout, compiles, fuses_projections
from ember.parallel import tensor
from ember.parallel.data import DataParallel, apply_data_parallel
from ember.parallel.dtensor import local_tensor
from ember.parallel.grads import clip_grad_norm
from ember.parallel.materialize import is_meta, materialize
from ember.parallel.mesh import Topology
from ember.parallel.pipeline import PipelineEngine
from ember.parallel.recompute import apply_compile, apply_recompute, blocks_of


class Engine:
    parts: list[nn.Module]
    optimizers: list[Optimizer]
    timer: PhaseTimer = NO_TIMER  # the trainer's; engines that can split their work time it

    # `document_ids` (rows x sequence, or None) keeps attention inside each document;
    # layouts whose engine cannot carry it are refused by `ember.layout`. `positions`: per
    # micro-batch of `micro_batch` rows, the flat indices of its labelled positions (a
    # masked LM's sparse prediction), made on the host so the device never reports them.
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                         document_ids: torch.Tensor | None = None,
                         positions: list[torch.Tensor] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError


def _documents(document_ids: torch.Tensor | None, start: int, end: int) -> dict:
    """The micro-batch's document ids as a keyword, left out when there are none so that a
    module without the argument (an outside model the trainer is given) still runs."""
    return {} if document_ids is None else {"document_ids": document_ids[start:end]}


def _positions(positions: list[torch.Tensor] | None, index: int) -> dict:
    return {} if positions is None else {"target_positions": positions[index]}


class LocalEngine(Engine):
    """One module on this rank: a whole model alone, or under data and tensor parallelism.
    Micro-batches accumulate gradients; with ZeRO-0/1 only the last one reduces them."""

    def __init__(self, module: nn.Module, optimizer: Optimizer, micro_batch: int, device: torch.device,
                 amp_dtype: torch.dtype | None = None, data_parallel: DataParallel | None = None,
                 loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 grad_scale: float = 1.0):
        self.parts, self.optimizers = [module], [optimizer]
        self.module, self.micro_batch, self.device, self.amp_dtype = module, micro_batch, device, amp_dtype
        self.data_parallel, self.loss_context, self.grad_scale = data_parallel, loss_context, grad_scale

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                         document_ids: torch.Tensor | None = None,
                         positions: list[torch.Tensor] | None = None) -> torch.Tensor:
        dp = self.data_parallel
        factor = scale * self.grad_scale
        total = torch.zeros((), device=self.device)
        starts = range(0, len(inputs), self.micro_batch)
        for i, start in enumerate(starts):
            if dp is not None:
                dp.set_sync(i == len(starts) - 1)
            end = start + self.micro_batch
            with self.loss_context():
                with self.timer.phase("forward"), autocast(self.device, self.amp_dtype):
                    part = self.module(inputs[start:end], labels[start:end], reduction="sum",
                                       **_documents(document_ids, start, end), **_positions(positions, i))
                with self.timer.phase("backward"):
                    (part * factor).backward()
            total += local_tensor(part.detach()).float()
        return total

    @torch.no_grad()
    def loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.module.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for start in range(0, len(inputs), self.micro_batch):
            end = start + self.micro_batch
            with self.loss_context(), autocast(self.device, self.amp_dtype):
                part = self.module(inputs[start:end], labels[start:end], reduction="sum",
                                   **_documents(document_ids, start, end))
                total += local_tensor(part).double()
        self.module.train()
        return total

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = list(self.module.parameters())
        return clip_grad_norm(params, params, max_norm)


class Wrapper:
    """`wrap(module)`: tensor parallel, recompute, compile, then data parallel, in the order
    they must compose (FSDP shards the DTensors tensor parallel made; checkpointing sits
    inside FSDP's hooks). A module still on the meta device gets its memory after FSDP has
    sharded it (DDP needs real parameters to start, so before it). Remembers each module's
    data-parallel handle."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device, amp_dtype: torch.dtype | None):
        self.cfg, self.topo, self.device, self.amp_dtype = cfg, topo, device, amp_dtype
        self.data_parallel: dict[int, DataParallel | None] = {}
        self.tensor = tensor if cfg.parallel.tp > 1 else None

    def __call__(self, module: nn.Module) -> nn.Module:
        p = self.cfg.parallel
        meta = is_meta(module)
        if self.tensor is not None:
            self.tensor.apply_tensor_parallel(module, self.topo.mesh["tp"], p.sp)
        if not fuses_projections(p):  # plain nn.Linear computes only what each pass asks for
            for _, block in blocks_of(module):
                block.attn.fused = block.mlp.fused = False
        apply_recompute(module, p.recompute, p.recompute_every)
        if compiles(self.cfg, self.device.type):
            apply_compile(module)
        if p.zero == 0:
            self._materialize(module, meta)
        reduce_dtype = torch.bfloat16 if p.grad_dtype == "bf16" else torch.float32
        self.data_parallel[id(module)] = apply_data_parallel(module, self.topo, p.zero, self.device,
                                                             self.amp_dtype, reduce_dtype=reduce_dtype,
                                                             pipelined=p.pp > 1)
        self._materialize(module, meta and p.zero > 0)
        return module

    def _materialize(self, module: nn.Module, meta: bool) -> None:
        if not meta:
            return
        materialize(module, self.cfg.model, self.cfg.train.seed, self.device)
        if self.tensor is not None:  # gradient hooks are the tensor's: register them on the real ones
            self.tensor.keep_gradient_layouts(module)

    def loss_context(self, module: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
        if self.tensor is None:
            return contextlib.nullcontext
        return lambda: self.tensor.loss_parallel_context(module)


def build_engine(cfg: Config, layout: Layout, model: nn.Module, topo: Topology, device: torch.device,
                 amp_dtype: torch.dtype | None, make_optimizer: Callable[[nn.Module], Optimizer]) -> Engine:
    """The engine for the run's `layout`; `model` is the plain Transformer, on `device` or
    on the meta device (then each rank allocates only what the layout gives it)."""
    wrap = Wrapper(cfg, topo, device, amp_dtype)
    # DDP and FSDP average gradients over the data-parallel ranks; scaling the loss by their
    # number first makes that reduction the sum the single-device gradient needs.
    grad_scale = float(topo.size("dp"))
    if cfg.parallel.pp > 1:
        return PipelineEngine(model, topo.mesh, layout, device, wrap, make_optimizer, amp_dtype, grad_scale)
    module = wrap(model)
    # The optimizer is built after wrapping so that it holds the sharded parameters.
    return LocalEngine(module, make_optimizer(module), cfg.train.micro_batch, device, amp_dtype,
                       wrap.data_parallel[id(module)], wrap.loss_context(module), grad_scale)
