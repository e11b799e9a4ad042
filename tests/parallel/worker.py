"""One rank of a shared launch: trains every layout of a JSON list for a few steps and,
on rank 0, writes each step's loss and gradient norm to a JSON file.

    torchrun --standalone --nproc-per-node N tests/parallel/worker.py DATA OUT_DIR SPEC.json
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from ember.config import load_config
from ember.train.trainer import Trainer


def settings(common: list[str], layout: dict, objective: str) -> list[str]:
    return common + [f"model.objective={objective}"] + [f"{k}={v}" for k, v in layout["set"].items()]


def run_layout(data: Path, out: Path, spec: dict, layout: dict, objective: str) -> dict:
    cfg = load_config(spec["recipe"], settings(spec["common"], layout, objective))
    trainer = Trainer(cfg, data, out / f"{layout['name']}-{objective}", progress=False)
    trainer.build()
    losses, norms = [], []
    for _ in range(spec["steps"]):
        loss, norm, _ = trainer.train_step(cfg.train.global_batch, lr=spec["lr"])
        losses.append(float(loss))
        norms.append(float(norm))
    return {"name": layout["name"], "objective": objective, "loss": losses, "grad_norm": norms}


def main() -> None:
    data, out, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    results = []
    for layout in spec["layouts"]:
        for objective in spec["objectives"]:
            results.append(run_layout(data, out, spec, layout, objective))
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
