"""One rank of the fp16 launch: trains each layout of a JSON list for a few steps in fp16
with loss scaling; then, in the last layout, one step in which only rank 1's gradients
overflow. Rank 0 writes each layout's losses and, for that step, what every rank did.

    torchrun --standalone --nproc-per-node 2 tests/parallel/fp16_worker.py DATA OUT_DIR SPEC.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ember.config import load_config
from ember.parallel.dtensor import local_tensor
from ember.process import leave
from ember.train.trainer import Trainer
from worker import finish


def overflow_on_rank_1(trainer: Trainer) -> dict:
    unscale = trainer.scaler.unscale

    def unscale_after_an_overflow(optimizers):
        if dist.get_rank() == 1:  # this rank's shard of one gradient only
            grad = next(p.grad for o in optimizers for g in o.param_groups for p in g["params"] if p.grad is not None)
            local_tensor(grad).view(-1)[0] = float("inf")
        unscale(optimizers)

    trainer.scaler.unscale = unscale_after_an_overflow
    before = [local_tensor(p).detach().clone() for part in trainer.engine.parts for p in part.parameters()]
    scale = float(trainer.scaler.scale)
    trainer.train_step(trainer.cfg.train.global_batch, lr=1e-3)
    after = [local_tensor(p).detach() for part in trainer.engine.parts for p in part.parameters()]
    mine = {"unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "fused": all(o.defaults["fused"] for o in trainer.engine.optimizers),
            "scale_ratio": float(trainer.scaler.scale) / scale, "skipped": trainer.scaler.log()["skipped_steps"]}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def fused_adamw_as_on_cuda() -> None:
    """Build the fused AdamW ember builds on CUDA (PyTorch has it on CPUs too), so that the
    overflow step goes the GPU's way: the skip decided on the device, with DTensor shards."""
    import ember.train.trainer as trainer_module
    from ember.train.setup import build_optimizer

    trainer_module.build_optimizer = lambda model, cfg, device: build_optimizer(model, cfg, torch.device("cuda"))


def main() -> None:
    data, out, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    results = []
    for layout in spec["layouts"]:
        for objective in spec["objectives"]:
            settings = (spec["common"] + [f"model.objective={objective}"]
                        + [f"{k}={v}" for k, v in layout["set"].items()])
            if layout is spec["layouts"][-1]:
                fused_adamw_as_on_cuda()
            trainer = Trainer(load_config(spec["recipe"], settings), data, out / f"{layout['name']}-{objective}",
                              progress=False)
            trainer.build()
            losses = [float(trainer.train_step(trainer.cfg.train.global_batch, lr=spec["lr"])[0])
                      for _ in range(spec["steps"])]
            result = {"name": layout["name"], "objective": objective, "loss": losses}
            if layout is spec["layouts"][-1]:
                result["overflow_step"] = overflow_on_rank_1(trainer)
            results.append(result)
            trainer.release()
    finish(results, out)


if __name__ == "__main__":
    main()
    leave(0)
