"""One rank of the build-memory test: build the run's model and engine the way `ember train`
does, and write how far this process's resident memory rose above where it stood before
(peak, from the kernel's high-water mark) beside the bytes of the whole model.

    torchrun --standalone --nproc-per-node N tests/parallel/build_memory_worker.py DATA OUT RECIPE SET...
"""

import json
import sys
from pathlib import Path

from ember.config import load_config
from ember.device import peak_memory_bytes, reset_peak_memory, resident_bytes
from ember.model import Transformer
from ember.parallel.mesh import init_distributed
from ember.process import leave
from ember.train.trainer import Trainer


def main() -> None:
    data, out, recipe, sets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    cfg = load_config(recipe, sets)
    trainer = Trainer(cfg, data, out / "run", progress=False)
    if trainer.world > 1:
        init_distributed(trainer.device)  # the process group's own memory is not the model's
    import torch

    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in Transformer(trainer.cfg.model).parameters())
    before = resident_bytes()
    reset_peak_memory(trainer.device)
    trainer.build = _build_only(trainer)
    trainer.build()
    rise = peak_memory_bytes(trainer.device) - before
    held = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4
               for part in trainer.engine.parts for p in part.parameters())
    (out / f"rank{trainer.rank}.json").write_text(json.dumps({"rise": rise, "whole": whole, "held": held}))
    trainer.close()


def _build_only(trainer: Trainer):
    """Trainer.build, without resetting the peak at its end (this test reads that peak)."""
    import ember.train.trainer as module

    def build():
        reset, module.reset_peak_memory = module.reset_peak_memory, lambda device: None
        try:
            Trainer.build(trainer)
        finally:
            module.reset_peak_memory = reset

    return build


if __name__ == "__main__":
    main()
    leave(0)
