"""Token rows -> what a step feeds the model, made on the host and sent to the device
without waiting: inputs, labels, document ids, the number of targets and, for a masked
LM with sparse prediction, each micro-batch's labelled positions. Nothing the step needs
is ever counted on the device, so the host can run ahead of it.

`Prefetcher` makes step n+1's batch on a background thread while step n runs (masking a
large MLM batch takes hundreds of milliseconds of CPU), and keeps the data position a
checkpoint records at the batches actually trained on.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ember.config import Config
from ember.data import Batches, make_targets
from ember.model.transformer import target_positions


@dataclass
class StepBatch:
    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor | None
    positions: list[torch.Tensor] | None  # per micro-batch, flat indices of the labelled positions
    count: int  # targets on this rank, counted on the host
    rows: int  # global rows this batch is this rank's share of
    data_state: dict  # the loader's state before these rows were taken


class Inputs:
    def __init__(self, cfg: Config, manifest: dict, device: torch.device):
        self.cfg, self.manifest, self.device = cfg, manifest, device
        self.sparse = cfg.model.objective == "mlm" and cfg.model.sparse_prediction

    def __call__(self, ids: torch.Tensor, seed: int, first_row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, labels) on the device and the number of targets."""
        inputs, labels = self.targets(ids, seed, first_row)
        return self.to_device(inputs), self.to_device(labels), int((labels != -100).sum())

    def targets(self, ids: torch.Tensor, seed: int, first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_targets(ids, self.cfg.model.objective, self.cfg.data, self.manifest["special_tokens"],
                            self.manifest["vocab_size"], seed, first_row)

    def step(self, ids: torch.Tensor, documents: torch.Tensor | None, seed: int, first_row: int,
             rows: int, data_state: dict) -> StepBatch:
        inputs, labels = self.targets(ids, seed, first_row)
        positions = None
        if self.sparse:
            mb = self.cfg.train.micro_batch
            positions = [self.to_device(target_positions(chunk)) for chunk in labels.split(mb)]
        return StepBatch(self.to_device(inputs), self.to_device(labels), self.to_device(documents), positions,
                         int((labels != -100).sum()), rows, data_state)

    def to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


class Prefetcher:
    """The training batches of a run, one step ahead on a background thread (`ahead`), or
    made when asked (`ahead` False). Either way the same rows, masks and order: a batch
    made ahead for a batch size the next step does not use is put back (the loader
    rewound) and made again. `state_dict` is the loader's state after the batches handed
    out, not after one made ahead, so a checkpoint resumes at the next untrained row."""

    def __init__(self, batches: Batches, inputs: Inputs, seed: int, dp_rank: int, dp_size: int, ahead: bool):
        self.batches, self.inputs, self.seed = batches, inputs, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ember-prefetch") if ahead else None
        self.pending: Future | None = None
        self.handed_out = batches.state_dict()  # the loader's state after the batches handed out

    def _make(self, rows: int) -> StepBatch:
        state = self.batches.state_dict()
        # This rank's rows are global rows first_row.. of the step (masks hash the global row).
        first_row = self.batches.position + self.dp_rank * (rows // self.dp_size)
        ids, documents = self.batches.next(rows)
        return self.inputs.step(ids, documents, self.seed, first_row, rows, state)

    def next(self, rows: int) -> StepBatch:
        batch = self.pending.result() if self.pending is not None else None
        self.pending = None
        if batch is not None and batch.rows != rows:
            self.batches.load_state_dict(batch.data_state)
            batch = None
        if batch is None:
            batch = self._make(rows)
        self.handed_out = self.batches.state_dict()  # before the thread moves the loader on
        if self.pool is not None:
            self.pending = self.pool.submit(self._make, rows)
        return batch

    def _settle(self) -> None:
        """Wait for a batch in the making and put it back."""
        if self.pending is not None:
            batch = self.pending.result()
            self.pending = None
            self.batches.load_state_dict(batch.data_state)

    @property
    def position(self) -> int:
        return self.handed_out["position"]

    @position.setter
    def position(self, value: int) -> None:
        self.load_state_dict({**self.handed_out, "position": value})

    def state_dict(self) -> dict:
        return dict(self.handed_out)

    def load_state_dict(self, state: dict) -> None:
        self._settle()
        self.batches.load_state_dict(state)
        self.handed_out = self.batches.state_dict()

    def close(self) -> None:
        self._settle()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
