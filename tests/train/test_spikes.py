"""Non-finite losses and loss spikes: the run rolls back to the newest checkpoint before the
spike and skips the data up to it, or stops without saving, as train.on_spike says. The
spike is injected by a test hook that corrupts the loss (and, for the rollback, the
weights) that one step returns."""

import json
import math

import torch

from conftest import REPO, TINY
from ember.config import load_config
from ember.train.trainer import Trainer

RECIPE = REPO / "configs/tiny-gpt.toml"


def _trainer(dataset, out, *sets):
    cfg = load_config(RECIPE, TINY + ["train.checkpoint_every=10steps", "train.eval_every=1000steps",
                                      "train.budget=40steps", "train.spike_window=20", *sets])
    return Trainer(cfg, dataset, out, progress=False)


def _inject(trainer, at_call: int, corrupt):
    """The `at_call`-th training step returns `corrupt(loss)`, and ruins the weights."""
    step, calls = trainer.train_step, []

    def train_step(n, lr):
        calls.append(n)
        loss, norm, count = step(n, lr)
        if len(calls) == at_call:
            with torch.no_grad():
                for p in trainer.engine.parts[0].parameters():
                    p.mul_(float("nan"))
            return corrupt(loss), norm, count
        return loss, norm, count

    trainer.train_step = train_step
    return calls


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_non_finite_loss_rolls_back_skips_its_data_and_finishes(dataset, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(dataset, out)
    calls = _inject(trainer, 25, lambda loss: loss * float("nan"))
    summary = trainer.run()
    assert summary["status"] == "finished" and math.isfinite(summary["train_loss"])
    records = _records(out)
    [event] = [r for r in records if r.get("event") == "loss spike"]
    assert event["spike_step"] == 25 and event["action"] == "rollback" and event["checkpoint_step"] == 20
    assert event["skipped_sequences"] == 5 * 8  # steps 21-25 of 8 sequences
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 41))  # each step once: the undone ones were taken out
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert len(calls) == 45  # steps 21-25 ran twice
    assert (out / "model.safetensors").exists()


def test_a_spike_is_judged_against_the_recent_losses(dataset, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(dataset, out)
    _inject(trainer, 33, lambda loss: loss * 50)
    assert trainer.run()["status"] == "finished"
    [event] = [r for r in _records(out) if r.get("event") == "loss spike"]
    assert event["spike_step"] == 33 and event["checkpoint_step"] == 30 and "above the mean" in event["reason"]


def test_stop_ends_without_saving_the_spiked_state(dataset, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(dataset, out, "train.on_spike=stop")
    _inject(trainer, 25, lambda loss: loss * float("inf"))
    summary = trainer.run()
    assert summary["status"] == "stopped on a loss spike"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]
    assert not (out / "model.safetensors").exists()
    [event] = [r for r in _records(out) if r.get("event") == "loss spike"]  # the stop is in the record too
    assert event["spike_step"] == 25 and event["action"] == "stop"


def test_every_rollback_stays_in_the_record_and_a_resume_keeps_them(dataset, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(dataset, out)
    first = _inject(trainer, 25, lambda loss: loss * float("nan"))
    step = trainer.train_step

    def second_spike(n, lr):  # the 36th call, step 31 after the first rollback, spikes too
        loss, norm, count = step(n, lr)
        if len(first) == 36:
            with torch.no_grad():
                for p in trainer.engine.parts[0].parameters():
                    p.mul_(float("nan"))
            return loss * float("nan"), norm, count
        return loss, norm, count

    trainer.train_step = second_spike
    assert trainer.run()["status"] == "finished"
    events = [(r["spike_step"], r["checkpoint_step"]) for r in _records(out) if r.get("event") == "loss spike"]
    assert events == [(25, 20), (31, 30)]  # the second rollback's rewind kept the first's line
    # A resume from the step-30 checkpoint runs steps 31-40 again: their records go, the events stay.
    cfg = load_config(RECIPE, TINY + ["train.checkpoint_every=10steps", "train.eval_every=1000steps",
                                      "train.budget=40steps", "train.spike_window=20", "train.keep_checkpoints=5"])
    (out / "model.safetensors").unlink()
    import shutil
    shutil.rmtree(out / "checkpoints" / "step_00000040")
    assert Trainer(cfg, dataset, out, progress=False, resume=True).run()["status"] == "finished"
    assert [r["spike_step"] for r in _records(out) if r.get("event")] == [25, 31]


def test_the_last_step_is_saved_once(dataset, tmp_path):
    """The schedule saves step 40 and the run ends there: one checkpoint write, not two."""
    trainer = _trainer(dataset, tmp_path / "run")
    written, build = [], trainer.build

    def build_and_watch():
        build()
        save = trainer.checkpointer.save

        def counted(run_dir, step, *args, **kwargs):
            written.append(step)
            return save(run_dir, step, *args, **kwargs)

        trainer.checkpointer.save = counted

    trainer.build = build_and_watch
    assert trainer.run()["status"] == "finished"
    assert written == [10, 20, 30, 40]


def test_off_trains_on_regardless(dataset, tmp_path):
    out = tmp_path / "run"
    trainer = _trainer(dataset, out, "train.on_spike=off", "train.budget=12steps")
    _inject(trainer, 5, lambda loss: loss * 50)
    assert trainer.run()["status"] == "finished"
    assert not [r for r in _records(out) if r.get("event")]


def test_a_spike_seen_late_rolls_back_past_checkpoints_saved_after_it(dataset, tmp_path):
    """Losses are read on logged steps only (every 10th here): the NaN of step 21 is seen at
    step 30, after the step-25 checkpoint saved the ruined weights; the rollback goes to 20."""
    out = tmp_path / "run"
    trainer = _trainer(dataset, out, "train.log_every=10", "train.checkpoint_every=5steps")
    _inject(trainer, 21, lambda loss: loss * float("nan"))
    assert trainer.run()["status"] == "finished"
    [event] = [r for r in _records(out) if r.get("event") == "loss spike"]
    assert event["spike_step"] == 21 and event["checkpoint_step"] == 20 and event["skipped_sequences"] == 8
    assert all(math.isfinite(r["loss"]) for r in _records(out) if "loss" in r)


def test_a_spike_seen_late_sets_aside_the_checkpoints_saved_after_it(dataset, tmp_path):
    """--resume takes the newest checkpoint: after a stop, that must be one from before the
    spike, not the step-25 one saved between the spike (21) and the step that saw it (30)."""
    from ember.train import checkpoint

    out = tmp_path / "run"
    trainer = _trainer(dataset, out, "train.on_spike=stop", "train.log_every=10", "train.checkpoint_every=5steps",
                       "train.keep_checkpoints=10")
    _inject(trainer, 21, lambda loss: loss * float("nan"))
    assert trainer.run()["status"] == "stopped on a loss spike"
    assert checkpoint.step_of(checkpoint.latest(out)) == 20
    assert (out / "checkpoints" / "step_00000025.after-spike").is_dir()  # kept for a look
