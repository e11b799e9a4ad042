"""Held-out evaluation: the mean loss per target token over a fixed set of validation
rows with fixed masks, so every evaluation of a run (and of its resumption) scores the same
targets."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ember.config import Config
from ember.data import Batches, held_out_seed
from ember.parallel.engine import Engine
from ember.parallel.mesh import Topology
from ember.train.inputs import Inputs
from ember.train.policies import Every
from ember.train.schedule import Progress


def held_out_rows(cfg: Config, saved: Path | None = None) -> int:
    """train.eval_batches micro-batches of rows, counted at the run's start: a run resumed
    with another micro_batch (`saved`: its data.json) scores the same rows, so its curve
    goes on; one resumed with another eval_batches asked for another set."""
    rows = cfg.train.eval_batches * cfg.train.micro_batch
    try:
        before = json.loads(saved.read_text()) if saved is not None else {}
    except (OSError, ValueError):
        return rows  # a damaged data.json is refused by the resume checks themselves
    same = isinstance(before, dict) and before.get("eval_batches") == cfg.train.eval_batches
    return int(before["eval_rows"]) if same and isinstance(before.get("eval_rows"), int) else rows


class Evaluator:
    def __init__(self, cfg: Config, batches: Batches, inputs: Inputs, engine: Engine, topo: Topology,
                 n_rows: int | None = None):
        n_rows = held_out_rows(cfg) if n_rows is None else n_rows
        self.ids, self.documents = batches.fixed(n_rows)
        self.cfg, self.inputs, self.engine, self.topo = cfg, inputs, engine, topo
        self.every: Every | None = None  # set by the loop, from train.eval_every

    def due(self, progress: Progress) -> bool:
        return self.every is not None and self.every.due(progress)

    @torch.no_grad()
    def __call__(self) -> float:
        if len(self.ids) == 0:
            return float("nan")
        # Every data-parallel rank scores the whole (small) set: the same forwards on every
        # rank keep FSDP's collectives matched, and no sum over dp is needed.
        parts, count = [], 0
        mb = self.cfg.train.micro_batch
        for start in range(0, len(self.ids), mb):
            parts.append(self.inputs(self.ids[start:start + mb], held_out_seed(self.cfg.data.seed), start))
            count += parts[-1][2]
        inputs, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = self.engine.loss_sum(inputs, labels, document_ids=self.inputs.to_device(self.documents))
        total = self.topo.all_reduce(loss, ("pp",))
        return float(total) / max(count, 1)
