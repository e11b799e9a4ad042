"""The device's part of a training step never makes the host wait for it.

On CUDA a `nonzero`, an `.item()`, a `float(tensor)` or a boolean-mask index blocks the
host until the GPU has caught up, so the CPU can no longer prepare the next step while
this one runs. A CPU has no such wait to observe, so these tests watch for the operators
that cause it, inside the engine's forward/backward and gradient clipping of real steps.
(The optimizer is left out: ember uses the fused AdamW on CUDA, which keeps its step
counters on the device and, in fp16, skips an overflowed step on the device too; the CPU's
AdamW reads them on the host.)
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, TINY
from ember.config import load_config
from ember.train.trainer import Trainer

_SYNCING = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.masked_select.default,
            torch.ops.aten.unique_consecutive.default, torch.ops.aten._unique2.default}


class SyncWatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func in _SYNCING or boolean_index:
            self.seen.append(str(func))
        return func(*args, **kwargs)


def _watched(fn, watch: SyncWatch):
    def run(*args, **kwargs):
        with watch:
            return fn(*args, **kwargs)
    return run


def _syncs_in_steps(dataset, run_dir, *overrides, positions: bool = True) -> list[str]:
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + list(overrides))
    trainer = Trainer(cfg, dataset, run_dir, progress=False)
    trainer.build()
    watch = SyncWatch()
    engine = trainer.engine
    forward_backward = engine.forward_backward
    if not positions:  # the control: the model finds the labelled positions itself
        engine.forward_backward = lambda *a, positions=None, **k: forward_backward(*a, **k)
    engine.forward_backward = _watched(engine.forward_backward, watch)
    engine.clip_grad_norm = _watched(engine.clip_grad_norm, watch)
    trainer.scaler.unscale = _watched(trainer.scaler.unscale, watch)  # fp16: unscale and check, on the device
    for _ in range(2):
        trainer.train_step(8, lr=1e-3)
    trainer.release()
    return watch.seen


@pytest.mark.parametrize("overrides", [
    ("model.objective=mlm", "model.sparse_prediction=true", "train.micro_batch=4"),
    ("model.objective=mlm", "model.sparse_prediction=false"),
    ("model.objective=causal", "optim.clip=1.0"),
    ("model.objective=causal", "optim.clip=1.0", "train.precision=fp16"),
], ids=["sparse-mlm", "dense-mlm", "causal", "causal-fp16"])
def test_no_host_sync_in_the_device_part_of_a_step(dataset, tmp_path, overrides):
    assert _syncs_in_steps(dataset, tmp_path / "run", *overrides) == []


def test_the_watch_sees_the_sync_of_a_boolean_mask(dataset, tmp_path):
    """Without the host's positions the model indexes with a mask: the test must see it."""
    seen = _syncs_in_steps(dataset, tmp_path / "run", "model.objective=mlm", "model.sparse_prediction=true",
                           positions=False)
    assert seen and all("index" in op or "nonzero" in op for op in seen)
