"""Pipeline parallelism: the Transformer cut into stages, driven by the schedules of
torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, zero bubble).

Gradients equal one device's: the last stage returns the summed cross-entropy of its
micro-batch, the schedule's loss function multiplies it by the step's `scale` (1 / the
targets of the whole global step), and the schedule does not divide again by the number
of micro-batches (scale_grads=False). A tied embedding lives twice, on the first stage
(embed) and the last (head); after every backward the two gradient copies are summed
between those two ranks, so both copies see the single-device gradient and, with the
same optimizer, stay equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.fsdp import FSDPModule

from ember.config import ModelConfig
from ember.device import autocast_forward
from ember.layout import SCHEDULES, Layout
from ember.parallel.dtensor import local_tensor
from ember.parallel.grads import clip_grad_norm
from ember.parallel.stages import StageModule, split_model


def _reshard(parts: list[nn.Module]) -> None:
    """Free the parameters FSDP gathered for a forward without backward (with
    reshard_after_forward=False they would stay gathered until the next backward)."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _no_documents(document_ids: torch.Tensor | None) -> None:
    # ember.layout refuses data.document_mask with pp > 1; reaching here is a bug.
    if document_ids is not None:
        raise ValueError("pipeline stages cannot carry document ids; data.document_mask needs parallel.pp=1.")


class PipelineEngine:
    """The engine of one pipeline rank: `parts` are its stage modules (wrapped), one
    optimizer per part. All ranks of a pipeline group call every method together."""

    def __init__(self, model: nn.Module, mesh, layout: Layout, device: torch.device,
                 wrap: Callable[[nn.Module], nn.Module], make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 amp_dtype: torch.dtype | None = None, grad_scale: float = 1.0):
        """Split `model` (a Transformer) into the layout's pp * vpp stages (`Layout.split`),
        keep this rank's (mesh["pp"]),
        run their forwards (and the loss) under `amp_dtype` autocast, wrap each (tensor/data
        parallel, checkpointing, compile: the trainer's `wrap`) and give each an optimizer.
        `grad_scale` multiplies every loss (the data-parallel wrappers average)."""
        self.cfg: ModelConfig = model.cfg
        self.grad_scale = grad_scale
        self.pp, self.vpp, self.schedule_name = layout.pp, layout.vpp, layout.schedule
        self.micro_batch, self.device = layout.micro_batch, device
        pp_mesh = mesh["pp"]
        self.group = pp_mesh.get_group()
        self.rank = pp_mesh.get_local_rank()
        self._multi, _, cls_name = SCHEDULES[self.schedule_name]
        self._schedule_cls = getattr(pipelining, cls_name)
        self.n_stages = layout.stages
        self.owner = layout.stage_owner()  # pipeline rank of each stage
        ids = [s for s, r in enumerate(self.owner) if r == self.rank]
        self.stage_modules: list[StageModule] = split_model(model, ids, layout.split(model.cfg))
        if not any(p.is_meta for p in model.parameters()):
            self.stage_modules = [m.to(device) for m in self.stage_modules]
        for m in self.stage_modules:  # the precision of the other engines; the schedules enter no autocast
            autocast_forward(m, device, amp_dtype)
        self.parts: list[nn.Module] = [wrap(m) for m in self.stage_modules]
        self.optimizers = [make_optimizer(p) for p in self.parts]
        self.first = next((m for m in self.stage_modules if m.is_first), None)
        self.last = next((m for m in self.stage_modules if m.is_last), None)
        self.tied = self.cfg.tie_embeddings and self.n_stages > 1
        self._scale = 1.0
        self._built: tuple | None = None  # (micro-batch count, batch shape) of the schedule
        self._current = None

    # ---- schedules ---------------------------------------------------------------

    def _schedule(self, n_micro: int, inputs: torch.Tensor, labels: torch.Tensor):
        """The schedule (and its PipelineStage objects, which remember the micro-batch
        count and shapes) for this micro-batch count and batch shape; only the current one is
        kept, so a batch-size ramp does not hold a set of stage buffers per size. The stages get example
        inputs and outputs, so the library runs no shape inference of its own (newer
        versions infer with real forwards, which would take labels from the last stage's
        queue); the examples come from one forward of the first micro-batch."""
        key = (n_micro, tuple(inputs.shape))
        if key != self._built:
            self._current = None  # its buffers go before the next one's are made
            examples = self._example_activations(inputs[:self.micro_batch], labels[:self.micro_batch])
            stages = [pipelining.PipelineStage(part, module.index, self.n_stages, self.device,
                                               input_args=examples[module.index][0],
                                               output_args=examples[module.index][1], group=self.group)
                      for part, module in zip(self.parts, self.stage_modules)]
            self._current = self._schedule_cls(stages if self._multi else stages[0], n_micro,
                                               loss_fn=self._loss_fn, scale_grads=False)
            self._built = key
        return self._current

    @torch.no_grad()
    def _example_activations(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[int, tuple]:
        """Stage index -> (example input, example output), empty tensors of the shapes and
        dtypes a micro-batch produces under the trainer's wrapping (precision, tensor parallel)."""
        examples: dict[int, tuple] = {}
        if self.last is not None:
            self.last.queue_labels([labels])

        def example(t: torch.Tensor) -> torch.Tensor:
            # Newer versions read requires_grad from the examples to decide which
            # activations get gradients sent back.
            e = torch.empty_like(local_tensor(t))
            return e.requires_grad_(True) if e.is_floating_point() else e

        def record(stage: int, x: torch.Tensor, y: torch.Tensor) -> None:
            examples[stage] = (example(x), example(y))

        with self._eval_mode(), self._loss_context():  # shapes only: no dropout, RNG untouched
            self._forward_in_order(inputs, record)
        if self.last is not None:
            self.last.queue_labels([])
        _reshard(self.parts)
        return examples

    @contextlib.contextmanager
    def _eval_mode(self):
        modes = [p.training for p in self.parts]
        for p in self.parts:
            p.eval()
        try:
            yield
        finally:
            for p, mode in zip(self.parts, modes):
                p.train(mode)

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.last.last_labels_ptr != target.data_ptr():
            raise RuntimeError("the pipeline schedule computed a loss with labels of another micro-batch")
        return output.sum() * self._scale

    # ---- the engine interface ----------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                         document_ids: torch.Tensor | None = None,
                         positions: list[torch.Tensor] | None = None) -> torch.Tensor:
        _no_documents(document_ids)
        n_micro = inputs.shape[0] // self.micro_batch  # whole micro-batches: the trainer's ramp rounds to them
        schedule = self._schedule(n_micro, inputs, labels)
        self._scale = scale * self.grad_scale
        if self.last is not None:
            # The same split as the schedule's, so the loss function can check the labels.
            self.last.queue_labels(list(labels.tensor_split(n_micro)), positions)
        args = (inputs,) if self.first is not None else ()
        target = labels if self.last is not None else None
        with self._loss_context():
            schedule.step(*args, target=target, losses=[] if self.last is not None else None, return_outputs=False)
        self._sum_tied_grads()
        return self._collect_loss()

    @torch.no_grad()
    def loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only, one micro-batch at a time through the stages in order (no
        overlap: evaluation is rare, and this needs no schedule state)."""
        _no_documents(document_ids)
        with self._eval_mode(), self._loss_context():
            if self.last is not None:
                self.last.queue_labels(list(labels.split(self.micro_batch)))
            for chunk in inputs.split(self.micro_batch):
                self._forward_in_order(chunk)
        _reshard(self.parts)
        return self._collect_loss()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The gradient norm over all stages, a tied embedding counted once and both its
        copies clipped."""
        return clip_grad_norm(list(self._params(count_tied_copy=False)), list(self._params(count_tied_copy=True)),
                              max_norm, group=self.group)

    # ---- helpers -----------------------------------------------------------------

    def _params(self, count_tied_copy: bool):
        for module in self.stage_modules:
            for p in module.parameters():
                if not count_tied_copy and self.tied and module.is_last and p is module.head.weight:
                    continue  # the copy of the embedding: its gradient is the embedding's
                yield p

    def _forward_in_order(self, x: torch.Tensor, record: Callable | None = None) -> None:
        """One micro-batch through the stages in order, each rank running the stages it
        holds and passing activations point to point (no overlap)."""
        for s in range(self.n_stages):
            if self.owner[s] != self.rank:
                continue
            if s > 0 and self.owner[s - 1] != self.rank:
                x = self._recv(self.owner[s - 1])
            y = self.parts[self._local_index(s)](x)
            if record is not None:
                record(s, x, y)
            if s < self.n_stages - 1 and self.owner[s + 1] != self.rank:
                self._send(y, self.owner[s + 1])
            x = y

    def _loss_context(self):
        """The vocabulary-parallel loss context when this rank's last stage has a
        tensor-parallel output layer (its cross-entropy then runs on sharded logits)."""
        if self.last is None:
            return contextlib.nullcontext()
        from ember.parallel.tensor import loss_parallel_context

        return loss_parallel_context(self.parts[self._local_index(self.last.index)])

    def _local_index(self, stage: int) -> int:
        return next(i for i, m in enumerate(self.stage_modules) if m.index == stage)

    def _collect_loss(self) -> torch.Tensor:
        if self.last is None or not self.last.sums:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        return torch.stack(self.last.sums).sum().float()

    def _sum_tied_grads(self) -> None:
        """Sum the gradients of the embedding (first stage) and its output-layer copy
        (last stage): point to point between the two ranks holding them."""
        if not self.tied:
            return
        mine = []
        if self.first is not None:
            mine.append(self.first.embed.weight)
        if self.last is not None:
            mine.append(self.last.head.weight)
        if not mine:
            return
        for p in mine:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if len(mine) == 2:
            total = local_tensor(mine[0].grad) + local_tensor(mine[1].grad)
            for p in mine:
                local_tensor(p.grad).copy_(total)
            return
        grad = local_tensor(mine[0].grad)
        peer = self.owner[-1] if self.first is not None else self.owner[0]
        peer_global = dist.get_global_rank(self.group, peer)
        other = torch.empty_like(grad)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grad.contiguous(), peer_global, self.group),
                                        dist.P2POp(dist.irecv, other, peer_global, self.group)])
        for work in works:
            work.wait()
        grad.add_(other)

    def _send(self, x: torch.Tensor, rank: int) -> None:
        x = local_tensor(x).contiguous()
        header = torch.zeros(8, dtype=torch.int64, device=x.device)
        header[0] = x.dim()
        header[1:1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        header[7] = _DTYPES.index(x.dtype)
        dist.send(header, dist.get_global_rank(self.group, rank), group=self.group)
        dist.send(x, dist.get_global_rank(self.group, rank), group=self.group)

    def _recv(self, rank: int) -> torch.Tensor:
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        dist.recv(header, dist.get_global_rank(self.group, rank), group=self.group)
        shape = header[1:1 + int(header[0])].tolist()
        x = torch.empty(shape, dtype=_DTYPES[int(header[7])], device=self.device)
        dist.recv(x, dist.get_global_rank(self.group, rank), group=self.group)
        return x


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
