"""One rank of a shared launch: trains every layout of a JSON list for a few steps and,
on rank 0, writes each step's loss and gradient norm to a JSON file.

    torchrun --standalone --nproc-per-node N tests/parallel/worker.py DATA OUT_DIR SPEC.json
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from ember.config import load_config
from ember.process import end_process_group, leave
from ember.train.trainer import Trainer


def settings(common: list[str], layout: dict, objective: str) -> list[str]:
    return common + [f"model.objective={objective}"] + [f"{k}={v}" for k, v in layout["set"].items()]


_GATHERS = [0]  # FSDP's parameter all-gathers (dist.all_gather_single), counted per step
_all_gather_single = dist.all_gather_single


def _counted_all_gather_single(*args, **kwargs):
    _GATHERS[0] += 1
    return _all_gather_single(*args, **kwargs)


dist.all_gather_single = _counted_all_gather_single


def run_flex_on_cpu() -> None:
    """model.document_kernel=flex forced on a CPU: ember's refusal (no FlexAttention
    backward there) and PyTorch's guard lifted, so its reference backward runs."""
    import torch.nn.attention.flex_attention as flex_module

    import ember.train.trainer as trainer_module

    check_run = trainer_module.check_run
    flex_module._validate_device = lambda *args: None
    trainer_module.check_run = lambda cfg, world, seq_len, device_type: check_run(cfg, world, seq_len, None)


def run_layout(data: Path, out: Path, spec: dict, layout: dict, objective: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    cfg = load_config(spec["recipe"], settings(spec["common"], layout, objective))
    trainer = Trainer(cfg, data, out / f"{layout['name']}-{objective}", progress=False)
    trainer.build()
    losses, norms = [], []
    for _ in range(spec["steps"]):
        _GATHERS[0] = 0
        loss, norm, _ = trainer.train_step(cfg.train.global_batch, lr=spec["lr"])
        losses.append(float(loss))
        norms.append(float(norm))
    groups = sum(isinstance(m, FSDPModule) for part in trainer.engine.parts for m in part.modules())
    return {"name": layout["name"], "objective": objective, "loss": losses, "grad_norm": norms,
            "gathers_last_step": _GATHERS[0], "fsdp_groups": groups}


def main() -> None:
    data, out, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    if any(layout["set"].get("model.document_kernel") == "flex" for layout in spec["layouts"]):
        run_flex_on_cpu()
    results = []
    for layout in spec["layouts"]:
        for objective in spec["objectives"]:
            results.append(run_layout(data, out, spec, layout, objective))
    finish(results, out)


def finish(results: list[dict], out: Path) -> None:
    """Rank 0 writes the launch's results; then every rank leaves the process group."""
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    end_process_group()


if __name__ == "__main__":
    main()
    leave(0)
