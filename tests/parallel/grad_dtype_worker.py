"""One rank of the gradient-dtype launch: trains each layout of a JSON list for a few steps
and, on rank 0, writes each step's loss, the wrapper's reduce dtype, and whether every
reduced gradient held only bf16 values (what a reduction in bf16 leaves behind).

    torchrun --standalone --nproc-per-node 2 tests/parallel/grad_dtype_worker.py DATA OUT_DIR SPEC.json
"""

import json
import sys
from pathlib import Path

import torch

from ember.config import load_config
from ember.parallel.dtensor import local_tensor
from ember.process import leave
from ember.train.trainer import Trainer
from worker import finish


def bf16_valued(params) -> bool:
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    return bool(grads) and all(torch.equal(g, g.bfloat16().float()) for g in grads)


def run_layout(data: Path, out: Path, spec: dict, layout: dict) -> dict:
    settings = spec["common"] + [f"{k}={v}" for k, v in layout["set"].items()]
    trainer = Trainer(load_config(spec["recipe"], settings), data, out / layout["name"], progress=False)
    trainer.build()
    exact = []
    # Just before the optimizer step the gradients are the reduced ones (clipping is off).
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: exact.append(
        bf16_valued(p for group in opt.param_groups for p in group["params"])))
    kept = set()  # the dtypes the reduced gradients are kept in (what the planner prices)
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: kept.update(
        str(local_tensor(p.grad).dtype) for group in opt.param_groups for p in group["params"]
        if p.grad is not None))
    losses = [float(trainer.train_step(trainer.cfg.train.global_batch, lr=spec["lr"])[0])
              for _ in range(spec["steps"])]
    reduce_dtype = str(trainer.engine.data_parallel.reduce_dtype)
    return {"name": layout["name"], "loss": losses, "bf16_valued": exact, "reduce_dtype": reduce_dtype,
            "kept_dtypes": sorted(kept)}


def main() -> None:
    data, out, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    results = [run_layout(data, out, spec, layout) for layout in spec["layouts"]]
    finish(results, out)


if __name__ == "__main__":
    main()
    leave(0)
