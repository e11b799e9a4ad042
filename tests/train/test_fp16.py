"""fp16 training with dynamic loss scaling (GPUs without bf16): an overflow skips the
step everywhere and halves the scale, clean steps grow it back, the scale survives a
checkpoint, and fp16 trains the same steps as fp32 to fp16's rounding. CPU autocast runs
fp16, so all of it runs here."""

import json
import functools

import pytest
import torch

from conftest import REPO, TINY
from ember.config import load_config
from ember.device import autocast_dtype, precision_name
from ember.train import loss_scale, trainer as trainer_module
from ember.train.loss_scale import LossScaler
from ember.train.trainer import Trainer

RECIPE = REPO / "configs/tiny-gpt.toml"


def _model_and_optimizer(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


def _backward(model, scaler, overflow: bool):
    loss = model(torch.ones(2, 4)).sum()
    (loss * scaler.factor()).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_an_overflow_skips_the_step_and_halves_the_scale(fused):
    model, optimizer = _model_and_optimizer(fused)
    scaler = LossScaler(torch.device("cpu"), enabled=True, growth_interval=2)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, scaler, overflow=True)
    scaler.unscale([optimizer])
    scaler.step([optimizer])
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(s.get("step", 0)) == 0 for s in optimizer.state.values())
    assert scaler.log() == {"loss_scale": 2.0**15, "skipped_steps": 1}
    for _ in range(2):  # two clean steps: the parameters move and the scale doubles back
        _backward(model, scaler, overflow=False)
        scaler.unscale([optimizer])
        scaler.step([optimizer])
        optimizer.zero_grad()
    assert not torch.equal(before[0], model.weight)
    assert scaler.log() == {"loss_scale": 2.0**16, "skipped_steps": 1}


def test_unscaled_gradients_are_the_unscaled_runs():
    plain, _ = _model_and_optimizer(fused=False)
    scaled, optimizer = _model_and_optimizer(fused=False)
    _backward(plain, LossScaler(torch.device("cpu"), enabled=False), overflow=False)
    scaler = LossScaler(torch.device("cpu"), enabled=True)
    _backward(scaled, scaler, overflow=False)
    assert not torch.equal(plain.weight.grad, scaled.weight.grad)  # scaled by 2^16 before unscale
    scaler.unscale([optimizer])
    for a, b in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(a.grad, b.grad)  # a power of two: exact


def test_auto_precision_is_fp16_on_a_gpu_without_bf16(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    assert autocast_dtype("auto", cuda) == torch.float16
    assert autocast_dtype("fp16", torch.device("cpu")) == torch.float16
    from ember.config import ConfigError
    with pytest.raises(ConfigError, match="V100.*fp16"):
        autocast_dtype("bf16", cuda)
    assert precision_name(autocast_dtype("auto", cuda)) == "fp16"  # what calibration measures and tune prices
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert autocast_dtype("auto", cuda) == torch.bfloat16
    assert [precision_name(autocast_dtype(p, torch.device("cpu"))) for p in ("auto", "bf16")] == ["fp32", "bf16"]


def _losses(dataset, run_dir, precision, steps=4):
    cfg = load_config(RECIPE, TINY + ["model.dropout=0", f"train.precision={precision}", "train.device=cpu",
                                      "train.compile=false"])
    trainer = Trainer(cfg, dataset, run_dir, progress=False)
    trainer.build()
    out = [trainer.train_step(8, lr=1e-3) for _ in range(steps)]
    scaler = trainer.scaler
    trainer.release()
    return [float(loss) for loss, _, _ in out], [float(norm) for _, norm, _ in out], scaler


def test_fp16_trains_the_steps_fp32_trains(dataset, tmp_path):
    loss16, norm16, scaler = _losses(dataset, tmp_path / "fp16", "fp16")
    loss32, norm32, plain = _losses(dataset, tmp_path / "fp32", "fp32")
    assert scaler.enabled and not plain.enabled
    assert scaler.log() == {"loss_scale": 2.0**16, "skipped_steps": 0}
    assert loss16 == pytest.approx(loss32, rel=5e-3)
    assert norm16 == pytest.approx(norm32, rel=5e-2)
    assert loss16 != loss32  # fp16 did compute in fp16


def test_overflowing_steps_are_skipped_and_the_scale_is_checkpointed(dataset, tmp_path, monkeypatch):
    """A scale so large that every gradient overflows: no step changes the model, the scale
    halves each step, and a resumed run goes on from the checkpointed scale."""
    sets = TINY + ["train.precision=fp16", "train.device=cpu", "train.compile=false",
                   "train.checkpoint_every=3steps"]
    cfg = load_config(RECIPE, sets)
    run = tmp_path / "run"
    monkeypatch.setattr(trainer_module, "LossScaler", functools.partial(LossScaler, init_scale=2.0**120))
    first = Trainer(cfg, dataset, run, budget="3steps", progress=False)
    assert first.run()["status"] == "finished"
    fresh = Trainer(cfg, dataset, tmp_path / "fresh", progress=False)
    fresh.build()
    trained = first.engine.parts[0].state_dict()
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    first.release()
    fresh.release()
    monkeypatch.undo()  # the resumed run must get its scale from the checkpoint, not from here
    resumed = Trainer(cfg, dataset, run, budget="5steps", resume=True, progress=False)
    resumed.run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scales = {r["step"]: (r["loss_scale"], r["skipped_steps"]) for r in records if "loss_scale" in r}
    assert scales[3] == (2.0**117, 3)
    assert scales[5] == (2.0**115, 5)
    resumed.release()


def test_scaler_constants_are_torchs():
    scaler = torch.amp.GradScaler("cpu")
    assert (loss_scale.INIT_SCALE, loss_scale.GROWTH_FACTOR, loss_scale.BACKOFF_FACTOR,
            loss_scale.GROWTH_INTERVAL) == (scaler.get_scale(), scaler.get_growth_factor(),
                                            scaler.get_backoff_factor(), scaler.get_growth_interval())


def test_fp16_on_a_cpu_says_it_is_emulated(dataset, tmp_path, capsys):
    from ember.cli import main

    sets = [x for s in TINY + ["train.precision=fp16", "train.device=cpu"] for x in ("--set", s)]
    assert main(["train", str(RECIPE), "--data", str(dataset), "--out", str(tmp_path / "run"), "--budget", "1steps",
                 "--quiet", *sets]) == 0
    captured = capsys.readouterr()
    assert "train.precision=fp16 on a CPU runs emulated fp16 matmuls" in captured.out + captured.err
