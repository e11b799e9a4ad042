"""One rank of the torchrun spike test: rank 1 alone ruins its weights and its loss at the
25th step; the loss is reduced over the ranks, so every rank sees the spike and rolls back.

    torchrun --standalone --nproc-per-node 2 tests/parallel/spike_worker.py DATA OUT SET...
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ember.config import load_config
from ember.process import leave
from ember.train.trainer import Trainer


def main() -> None:
    data, out, sets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    trainer = Trainer(load_config(None, sets), data, out, progress=False)
    step, calls = trainer.train_step, []

    def train_step(n, lr):
        calls.append(n)
        if len(calls) == 25 and dist.get_rank() == 1:
            with torch.no_grad():
                for p in trainer.engine.parts[0].parameters():
                    p.mul_(float("nan"))
        return step(n, lr)

    trainer.train_step = train_step
    summary = trainer.run()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"status": summary["status"], "calls": len(calls)}))
    trainer.close()


if __name__ == "__main__":
    main()
    leave(0)
