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
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from ember.config import ConfigError, ModelConfig
from ember.parallel.stages import StageModule, split_model, stage_ranks
from ember.device import autocast_forward

try:  # DTensor grads come from FSDP2 / tensor parallel wrapping of a stage.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older layouts of the package
    from torch.distributed._tensor import DTensor

# schedule name -> (class name in torch.distributed.pipelining, stages per rank > 1 allowed,
# stage placement). Names missing from the installed torch are refused by check_pipeline.
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved": ("ScheduleInterleaved1F1B", True, "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", True, "v"),
}


ZERO_BUBBLE = ("zero_bubble", "zbv")


def available_schedules() -> list[str]:
    return [name for name, (cls, _, _) in SCHEDULES.items() if hasattr(pipelining, cls)]


def check_pipeline(model: ModelConfig, parallel: Any, micro_batches: int | None = None,
                   compile: bool = False) -> None:
    """Refuse a pipeline layout that cannot run, in one sentence (ConfigError). `parallel`
    is anything with `pp`, `vpp` and `schedule`; `micro_batches` (per step and
    data-parallel rank) and `compile` (train.compile), when given, are checked too."""
    pp, vpp, schedule = int(parallel.pp), int(parallel.vpp), str(parallel.schedule)
    if pp < 1 or vpp < 1:
        raise ConfigError(f"parallel.pp ({pp}) and parallel.vpp ({vpp}) must be at least 1.")
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}.")
    if pp == 1:
        if vpp > 1:
            raise ConfigError(f"parallel.vpp={vpp} needs pipeline parallelism; set parallel.pp > 1 or vpp=1.")
        return
    if schedule not in available_schedules():
        raise ConfigError(f"parallel.schedule={schedule!r} is not in this PyTorch ({torch.__version__}); "
                          f"choose one of {', '.join(available_schedules())}.")
    multi = SCHEDULES[schedule][1]
    if vpp > 1 and not multi:
        raise ConfigError(f"parallel.vpp={vpp} (virtual stages) needs parallel.schedule='interleaved' "
                          f"(or a zero-bubble schedule); {schedule} runs one stage per rank, so set vpp=1.")
    if schedule == "zbv" and vpp != 2:
        raise ConfigError(f"parallel.schedule='zbv' places exactly two stages per rank; set parallel.vpp=2 (got {vpp}).")
    if model.layers % (pp * vpp) != 0:
        raise ConfigError(f"model.layers ({model.layers}) must be divisible by parallel.pp x parallel.vpp "
                          f"({pp} x {vpp} = {pp * vpp}) so that every stage holds the same number of blocks.")
    if compile and schedule in ZERO_BUBBLE:
        _refuse_compiled(schedule)
    if micro_batches is not None:
        check_micro_batches(micro_batches, pp, schedule)


def _refuse_compiled(schedule: str) -> None:
    raise ConfigError(f"parallel.schedule={schedule!r} cannot run compiled stages (PyTorch splits their backward "
                      f"into input and weight gradients); set train.compile=false or use schedule 'interleaved'.")


def check_micro_batches(micro_batches: int, pp: int, schedule: str) -> None:
    """The micro-batches of one step must fill the pipeline: 1F1B and the interleaved and
    zero-bubble schedules need at least pp of them, the multi-stage ones a multiple of pp."""
    if schedule == "gpipe" or pp == 1:
        return
    if micro_batches < pp:
        raise ConfigError(f"parallel.schedule={schedule!r} needs at least parallel.pp={pp} micro-batches per step "
                          f"and data-parallel rank, got {micro_batches}; raise train.global_batch or lower "
                          f"train.micro_batch (or use schedule 'gpipe').")
    if SCHEDULES[schedule][1] and micro_batches % pp != 0:
        raise ConfigError(f"parallel.schedule={schedule!r} needs the micro-batches per step and data-parallel rank "
                          f"({micro_batches}) to be a multiple of parallel.pp={pp}; change train.global_batch "
                          f"or train.micro_batch.")


def _reshard(parts: list[nn.Module]) -> None:
    """Free the parameters FSDP gathered for a forward without backward (with
    reshard_after_forward=False they would stay gathered until the next backward)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - no FSDP2 in this PyTorch
        return
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _no_documents(document_ids: torch.Tensor | None) -> None:
    # check_layout refuses data.document_mask with pp > 1; reaching here is a bug.
    if document_ids is not None:
        raise ValueError("pipeline stages cannot carry document ids; data.document_mask needs parallel.pp=1.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class PipelineEngine:
    """The engine of one pipeline rank: `parts` are its stage modules (wrapped), one
    optimizer per part. All ranks of a pipeline group call every method together."""

    def __init__(self, model: nn.Module, mesh, parallel: Any, micro_batch: int, device: torch.device,
                 wrap: Callable[[nn.Module], nn.Module], make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 amp_dtype: torch.dtype | None = None):
        check_pipeline(model.cfg, parallel)
        self.cfg: ModelConfig = model.cfg
        self.pp, self.vpp, self.schedule_name = int(parallel.pp), int(parallel.vpp), str(parallel.schedule)
        self.micro_batch, self.device = micro_batch, device
        pp_mesh = mesh["pp"]
        self.group = pp_mesh.get_group()
        self.rank = pp_mesh.get_local_rank()
        cls_name, self._multi, style = SCHEDULES[self.schedule_name]
        self._schedule_cls = getattr(pipelining, cls_name)
        self.n_stages = self.pp * self.vpp
        self.owner = stage_ranks(self.pp, self.vpp, style)  # pipeline rank of each stage
        ids = [s for s, r in enumerate(self.owner) if r == self.rank]
        self.stage_modules: list[StageModule] = [m.to(device) for m in split_model(model, ids, self.n_stages)]
        for m in self.stage_modules:  # the precision of the other engines; the schedules enter no autocast
            autocast_forward(m, device, amp_dtype)
        self.parts: list[nn.Module] = [wrap(m) for m in self.stage_modules]
        if self.schedule_name in ZERO_BUBBLE:
            from torch._dynamo.eval_frame import OptimizedModule

            if any(isinstance(m, OptimizedModule) for p in self.parts for m in p.modules()):
                _refuse_compiled(self.schedule_name)
        self.optimizers = [make_optimizer(p) for p in self.parts]
        self.first = next((m for m in self.stage_modules if m.is_first), None)
        self.last = next((m for m in self.stage_modules if m.is_last), None)
        self.tied = self.cfg.tie_embeddings and self.n_stages > 1
        self._scale = 1.0
        self._schedules: dict[tuple, Any] = {}
        self._step_kwargs = ({"return_outputs": False}
                             if "return_outputs" in inspect.signature(self._schedule_cls.step).parameters else {})

    # ---- schedules ---------------------------------------------------------------

    def _schedule(self, n_micro: int, inputs: torch.Tensor, labels: torch.Tensor):
        """One schedule (and its PipelineStage objects, which remember the micro-batch
        count and shapes) per micro-batch count and batch shape. The stages get example
        inputs and outputs, so the library runs no shape inference of its own (newer
        versions infer with real forwards, which would take labels from the last stage's
        queue); the examples come from one forward of the first micro-batch."""
        key = (n_micro, tuple(inputs.shape))
        if key not in self._schedules:
            examples = self._example_activations(inputs[:self.micro_batch], labels[:self.micro_batch])
            stages = [pipelining.PipelineStage(part, module.index, self.n_stages, self.device,
                                               input_args=examples[module.index][0],
                                               output_args=examples[module.index][1], group=self.group)
                      for part, module in zip(self.parts, self.stage_modules)]
            self._schedules[key] = self._schedule_cls(stages if self._multi else stages[0], n_micro,
                                                      loss_fn=self._loss_fn, scale_grads=False)
        return self._schedules[key]

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
            e = torch.empty_like(_local(t))
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

    def _micro_batches(self, rows: int) -> int:
        if rows % self.micro_batch != 0:
            raise ConfigError(f"the {rows} rows of this data-parallel rank do not split into micro-batches "
                              f"of train.micro_batch={self.micro_batch}.")
        n_micro = rows // self.micro_batch
        check_micro_batches(n_micro, self.pp, self.schedule_name)
        return n_micro

    # ---- the engine interface ----------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                         document_ids: torch.Tensor | None = None) -> torch.Tensor:
        _no_documents(document_ids)
        n_micro = self._micro_batches(inputs.shape[0])
        schedule = self._schedule(n_micro, inputs, labels)
        self._scale = scale
        if self.last is not None:
            # The same split as the schedule's, so the loss function can check the labels.
            self.last.queue_labels(list(labels.tensor_split(n_micro)))
        args = (inputs,) if self.first is not None else ()
        target = labels if self.last is not None else None
        with self._loss_context():
            schedule.step(*args, target=target, losses=[] if self.last is not None else None, **self._step_kwargs)
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
        """The gradient norm over all stages (a tied embedding counted once), then every
        gradient scaled by min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_."""
        grads = [p.grad for p in self._params(count_tied_copy=False) if p.grad is not None]
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(id(g.device_mesh) if isinstance(g, DTensor) else None, []).append(g)
        square = torch.zeros((), device=self.device, dtype=torch.float32)
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, 2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            square = square + norm.float() ** 2
        dist.all_reduce(square, group=self.group)
        total = square.sqrt()
        coef = min(1.0, float(max_norm / (total + 1e-6)))
        if coef < 1.0:
            with torch.no_grad():
                for p in self._params(count_tied_copy=True):
                    if p.grad is not None:
                        _local(p.grad).mul_(coef)
        return total

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
            total = _local(mine[0].grad) + _local(mine[1].grad)
            for p in mine:
                _local(p.grad).copy_(total)
            return
        grad = _local(mine[0].grad)
        peer = self.owner[-1] if self.first is not None else self.owner[0]
        peer_global = dist.get_global_rank(self.group, peer)
        other = torch.empty_like(grad)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grad.contiguous(), peer_global, self.group),
                                        dist.P2POp(dist.irecv, other, peer_global, self.group)])
        for work in works:
            work.wait()
        grad.add_(other)

    def _send(self, x: torch.Tensor, rank: int) -> None:
        x = _local(x).contiguous()
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


def build_pipeline_engine(model: nn.Module, mesh, parallel: Any, micro_batch: int, device: torch.device,
                          wrap: Callable[[nn.Module], nn.Module],
                          make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                          amp_dtype: torch.dtype | None = None) -> PipelineEngine:
    """Split `model` (a Transformer) into pp * vpp stages, keep this rank's (mesh["pp"]),
    run their forwards (and the loss) under `amp_dtype` autocast, wrap each (tensor/data
    parallel, checkpointing, compile: the trainer's `wrap`), and give each an optimizer;
    the engine builds schedules per micro-batch count on demand."""
    return PipelineEngine(model, mesh, parallel, micro_batch, device, wrap, make_optimizer, amp_dtype)
