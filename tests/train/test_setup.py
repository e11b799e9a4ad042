import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY
from ember.config import ConfigError, load_config, to_toml
from ember.model import Transformer
from ember.device import autocast_dtype, pick_device
from ember.train.setup import build_optimizer, check_data_fits, check_resume_config, check_resume_data, resolve
from ember.train import clock
from ember.train.trainer import Trainer


def test_no_weight_decay_on_norms_and_biases():
    cfg = load_config(None, ["model.vocab_size=100", "model.hidden=32", "model.heads=2", "model.layers=2",
                             "model.mlp_hidden=64", "model.bias=true", "optim.weight_decay=0.1"])
    model = Transformer(cfg.model)
    decay, no_decay = build_optimizer(model, cfg.optim, torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_vocabulary_resolved_from_data():
    cfg = load_config(None, [])
    manifest = {"vocab_size": 1000, "seq_len": 64, "special_tokens": {"mask": 4}}
    check_data_fits(cfg, manifest)
    resolved = resolve(cfg, manifest, budget="5steps")
    assert resolved.model.vocab_size == 1000 and resolved.model.padded_vocab == 1024
    assert resolved.train.budget == "5steps"
    assert cfg.model.vocab_size == 0 and cfg.train.budget != "5steps"  # the caller's config is left alone
    with pytest.raises(ConfigError, match=r"train.global_batch \(64\) is larger than the data's train split \(40"):
        check_data_fits(cfg, {**manifest, "splits": {"train": {"sequences": 40}}})
    check_data_fits(cfg, {**manifest, "splits": {"train": {"sequences": 64}}})
    no_mask = load_config(None, ["model.objective=mlm"])
    with pytest.raises(ConfigError, match="no mask token"):
        check_data_fits(no_mask, {**manifest, "special_tokens": {"mask": None}})


def test_resume_refuses_a_changed_recipe_but_accepts_a_longer_budget(tmp_path):
    saved = load_config(None, ["model.vocab_size=512"])
    (tmp_path / "config.toml").write_text(to_toml(saved))
    check_resume_config(load_config(None, ["model.vocab_size=512", "train.budget=9h"]), tmp_path / "config.toml")
    with pytest.raises(ConfigError, match="optim.lr"):
        check_resume_config(load_config(None, ["model.vocab_size=512", "optim.lr=1"]), tmp_path / "config.toml")
    harmless = ["train.timeout_s=60", "train.eval_every=7steps", "train.eval_batches=3", "train.breakdown=off",
                "train.on_spike=stop", "train.micro_batch=8", 'train.trackers=["tensorboard"]',
                "parallel.grad_dtype=bf16"]
    check_resume_config(load_config(None, ["model.vocab_size=512", *harmless]), tmp_path / "config.toml")
    with pytest.raises(ConfigError, match="train.global_batch"):
        check_resume_config(load_config(None, ["model.vocab_size=512", "train.global_batch=32"]),
                            tmp_path / "config.toml")


def test_resume_compares_precision_as_the_device_resolves_it(tmp_path):
    """`ember plan` prints train.precision=fp32 for a CPU; a run recorded with "auto" ran in
    fp32 there, so that command resumes it. bf16 is another run."""
    (tmp_path / "config.toml").write_text(to_toml(load_config(None, ["model.vocab_size=512"])))
    cpu = torch.device("cpu")
    check_resume_config(load_config(None, ["model.vocab_size=512", "train.precision=fp32"]),
                        tmp_path / "config.toml", cpu)
    with pytest.raises(ConfigError, match="train.precision is 'bf16'"):
        check_resume_config(load_config(None, ["model.vocab_size=512", "train.precision=bf16"]),
                            tmp_path / "config.toml", cpu)
    with pytest.raises(ConfigError, match="train.precision is 'fp32'"):  # no device: nothing to resolve with
        check_resume_config(load_config(None, ["model.vocab_size=512", "train.precision=fp32"]),
                            tmp_path / "config.toml")


def test_a_run_resumed_with_another_micro_batch_takes_the_same_steps(dataset, tmp_path):
    def train(run, micro, resume=False):
        cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + [f"train.micro_batch={micro}",
                                                                  "train.checkpoint_every=3steps", "train.eval_every=2steps"])
        Trainer(cfg, dataset, run, budget="5steps", resume=resume, progress=False).run()
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in lines if "loss" in r], [r["val_loss"] for r in lines if "val_loss" in r]

    straight, straight_val = train(tmp_path / "straight", 4)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    for later in ("checkpoints/step_00000005", "model.safetensors", "summary.json"):  # as if stopped at step 3
        shutil.rmtree(tmp_path / "resumed" / later, ignore_errors=True)
        (tmp_path / "resumed" / later).unlink(missing_ok=True)
    resumed, resumed_val = train(tmp_path / "resumed", 2, resume=True)
    assert len(straight) == 5 and resumed == pytest.approx(straight, rel=1e-5)
    # The held-out set is counted at the run's start: the same rows, so the curve goes on.
    assert len(resumed_val) == len(straight_val) >= 2 and resumed_val == pytest.approx(straight_val, rel=1e-5)


def test_device_and_precision_choices():
    assert pick_device("cpu").type == "cpu"
    assert autocast_dtype("auto", torch.device("cpu")) is None
    assert autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigError):
        pick_device("warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA"):
            pick_device("cuda")


class SteppingClock:
    """A clock that every reading moves on by a fixed tick, and one reading by a long
    stall: a time budget's logic seen on a machine whose load never changes the answer."""

    def __init__(self, tick: float, stall_at: int = -1, stall: float = 0.0):
        self.now, self.reads, self.tick, self.stall_at, self.stall = 0.0, 0, tick, stall_at, stall

    def perf_counter(self) -> float:
        self.reads += 1
        self.now += self.stall if self.reads == self.stall_at else self.tick
        return self.now


def test_a_time_budget_ends_on_time_and_annealed(dataset, tmp_path, monkeypatch):
    fake = SteppingClock(tick=0.01, stall_at=150, stall=0.3)
    monkeypatch.setattr(clock, "time", fake)
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["schedule.lr=triangle", "train.eval_every=1000steps"])
    summary = Trainer(cfg, dataset, tmp_path / "run", budget="3s", progress=False).run()
    assert 2.9 <= summary["elapsed_s"] < 3.5  # within half a step of the budget, either side
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    lrs = [json.loads(x)["lr"] for x in lines if '"lr"' in x]
    # The last step starts one step-time before the end: past the peak and well down the
    # decay. The stall (a checkpoint, a busy machine) never sends the schedule back up.
    assert max(lrs) > 0.5 * cfg.optim.lr and lrs[-1] < 0.5 * max(lrs)
    peak = lrs.index(max(lrs))
    assert all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1:]))


@pytest.mark.parametrize("tick", [0.013, 0.029, 0.047])
def test_no_step_of_a_time_budget_trains_at_the_triangles_end(dataset, tmp_path, monkeypatch, tick):
    """A step started less than half a step before the end reads the schedule past the end
    (a triangle's lr 0): it would change nothing and overrun the budget."""
    monkeypatch.setattr(clock, "time", SteppingClock(tick=tick))
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["schedule.lr=triangle", "train.log_every=1",
                                                              "train.eval_every=1000steps"])
    summary = Trainer(cfg, dataset, tmp_path / "run", budget="1s", progress=False).run()
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "lr" in r]
    assert len(steps) == summary["steps"] > 3 and all(r["lr"] > 0 for r in steps)
    last_step_s = steps[-1]["elapsed_s"] - steps[-2]["elapsed_s"]
    assert 1.0 - last_step_s <= summary["elapsed_s"] < 1.0 + last_step_s


def test_the_last_step_of_a_time_budget_is_logged(dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(clock, "time", SteppingClock(tick=0.01))
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.log_every=1000", "train.eval_every=1000steps"])
    summary = Trainer(cfg, dataset, tmp_path / "run", budget="2s", progress=False).run()
    assert summary["steps"] > 5
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [summary["steps"]]


def test_resume_refuses_data_from_another_tokenizer(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps({"tokenizer_sha256": "aaa"}))
    check_resume_data({"tokenizer_sha256": "aaa"}, tmp_path / "data.json")
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_resume_data({"tokenizer_sha256": "bbb"}, tmp_path / "data.json")
    for damaged in ("[1, 2]", "{broken"):
        (tmp_path / "data.json").write_text(damaged)
        with pytest.raises(ConfigError, match="is damaged"):
            check_resume_data({"tokenizer_sha256": "aaa"}, tmp_path / "data.json")


def test_resume_on_another_tokenizers_data_names_the_data_before_the_vocabulary(tmp_path):
    """Data with another vocabulary also changes model.vocab_size, which the user never set
    (0 takes the data's); the data is what to name."""
    from ember.train.setup import check_run_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(load_config(None, ["model.vocab_size=4096"])))
    (run / "data.json").write_text(json.dumps({"tokenizer_sha256": "aaa", "seq_len": 128}))
    with pytest.raises(ConfigError, match="--data was prepared with another tokenizer"):
        check_run_dir(load_config(None, ["model.vocab_size=2048"]), {"tokenizer_sha256": "bbb", "seq_len": 128},
                      run, resume=True)


def test_run_files_are_as_readable_as_any_new_file(tmp_path):
    """safetensors writes 0600 files; the model of a run on a shared filesystem is read by
    others, so every atomically written file gets the mode the umask gives."""
    import os

    from safetensors.torch import save_file

    from ember.atomic import atomic_path

    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_a_model_vocabulary_far_beyond_the_datas_gets_a_note(dataset, tmp_path, capsys):
    data_vocab = json.loads((dataset / "manifest.json").read_text())["vocab_size"]
    for vocab, noted in ((data_vocab + 64, False), (8 * data_vocab, True)):
        cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + [f"model.vocab_size={vocab}"])
        Trainer(cfg, dataset, tmp_path / f"run{vocab}", budget="1steps", progress=False).run()
        err = capsys.readouterr().err
        assert ("never see a target" in err) == noted, err


def test_resume_never_restarts_a_run_whose_checkpoints_were_set_aside(dataset, tmp_path):
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.checkpoint_every=2steps"])
    run = tmp_path / "run"
    Trainer(cfg, dataset, run, budget="2steps", progress=False).run()
    weights = (run / "model.safetensors").read_bytes()
    (run / "checkpoints" / "step_00000002").rename(run / "checkpoints" / "step_00000002.damaged")
    with pytest.raises(ConfigError, match="no intact checkpoint to resume from"):
        Trainer(cfg, dataset, run, budget="4steps", resume=True, progress=False)
    assert (run / "model.safetensors").read_bytes() == weights


def test_a_killed_saves_leftovers_are_removed_when_the_run_resumes(dataset, tmp_path):
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.checkpoint_every=2steps"])
    run = tmp_path / "run"
    Trainer(cfg, dataset, run, budget="2steps", progress=False).run()
    (run / "checkpoints" / "step_00000003.tmp" / "rng").mkdir(parents=True)
    (run / "model.safetensors.tmp").write_bytes(b"half")
    (run / "eval" / "notes.tmp").mkdir(parents=True)  # not the trainer's: kept
    assert Trainer(cfg, dataset, run, budget="4steps", resume=True, progress=False).run()["steps"] == 4
    assert not list(run.glob("*.tmp")) and not list(run.glob("checkpoints/*.tmp"))
    assert (run / "eval" / "notes.tmp").is_dir()


def test_resume_after_a_spike_before_any_checkpoint_starts_again(dataset, tmp_path):
    """Every checkpoint at or after the spike is set aside (.after-spike, the spiked weights):
    --resume then starts from step 0, as the stop's message says."""
    from ember.train import checkpoint

    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.checkpoint_every=2steps"])
    run = tmp_path / "run"
    Trainer(cfg, dataset, run, budget="3steps", progress=False).run()
    (run / "model.safetensors").unlink()  # as a run stopped on a spike leaves it: no final model
    checkpoint.set_aside(run, 1)
    resumed = Trainer(cfg, dataset, run, budget="3steps", resume=True, progress=False)
    assert resumed.resume_from is None and resumed.run()["steps"] == 3


def test_resume_refuses_a_checkpoint_folder_it_cannot_write_before_training(dataset, tmp_path, monkeypatch):
    import os

    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.checkpoint_every=2steps"])
    run = tmp_path / "run"
    Trainer(cfg, dataset, run, budget="2steps", progress=False).run()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "checkpoints" and access(path, mode))
    with pytest.raises(ConfigError, match="cannot write checkpoints"):
        Trainer(cfg, dataset, run, budget="4steps", resume=True, progress=False)


def test_a_steps_time_includes_the_device_catching_up_at_a_logged_step(dataset, tmp_path, monkeypatch):
    """On a GPU the host queues a step in little time and waits for the device only where a
    step is logged: the time a step takes is between agreements, waits included."""
    fake = SteppingClock(tick=0.001)
    monkeypatch.setattr(clock, "time", fake)

    def device_catches_up(device):
        fake.now += 0.2

    monkeypatch.setattr(clock, "synchronize", device_catches_up)
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["schedule.lr=triangle", "train.log_every=1",
                                                              "train.eval_every=1000steps"])
    summary = Trainer(cfg, dataset, tmp_path / "run", budget="1s", progress=False).run()
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"lr"' in x]
    assert all(r["lr"] > 0 for r in steps)
    assert summary["elapsed_s"] < 1.0 + 0.11  # at most about half a 0.2 s step past the budget


class _StopAfter:
    """A SIGTERM that arrives at `step`, as the loop sees it (save, then stop)."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, result) -> str:
        from ember.train.policies import CONTINUE, STOP

        return STOP if result.progress.step >= self.step else CONTINUE


def _interrupted_run(dataset, run, budget: str, step: int):
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY)
    trainer = Trainer(cfg, dataset, run, budget=budget, progress=False)
    trainer.policies.append(_StopAfter(step))
    assert trainer.run()["status"] == "interrupted"
    trainer.close()


@pytest.mark.parametrize("budget, said", [("3steps", "at step 4,"), ("1000tok", "at step 4 (2,048 tokens)"),
                                          ("0.001s", "at step 4 (")])
def test_resume_with_a_budget_the_run_has_already_spent_changes_nothing(dataset, tmp_path, capsys, budget, said):
    """An interrupted run is not a finished one: a smaller --budget must not turn it into
    one (a model file of unannealed weights, a summary saying "finished")."""
    from ember.cli import main

    run = tmp_path / "run"
    _interrupted_run(dataset, run, "1000steps", 4)
    capsys.readouterr()
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    argv = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(run), "--quiet",
            *[x for s in TINY for x in ("--set", s)], "--resume", "--budget"]
    assert main([*argv, budget]) == 2
    err = capsys.readouterr().err
    assert f"already {said}" in err and f"budget of {budget}" in err and err.count("\n") == 1, err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()} == before
    assert main([*argv, "6steps"]) == 0  # a larger budget goes on from step 4
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_resume_finishes_a_run_stopped_at_the_end_of_its_budget(dataset, tmp_path):
    """Stopped after its last step but before its model file was written: the same budget
    finishes it (the weights are the budget's end) rather than being refused."""
    run = tmp_path / "run"
    _interrupted_run(dataset, run, "4steps", 4)
    assert not (run / "model.safetensors").exists()
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY)
    summary = Trainer(cfg, dataset, run, budget="4steps", resume=True, progress=False).run()
    assert summary["status"] == "finished" and summary["steps"] == 4 and (run / "model.safetensors").is_file()


def test_a_finished_run_resumed_to_train_on_is_not_reported_finished_meanwhile(dataset, tmp_path):
    """Until the resumed run ends, its summary must not say the old run's "finished" (a kill
    would leave it so), and `--resume` of a finished run names the folder it is in now."""
    import shutil

    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY)
    run = tmp_path / "run"
    assert Trainer(cfg, dataset, run, budget="3steps", progress=False).run()["status"] == "finished"
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    again = Trainer(cfg, dataset, moved, budget="3steps", progress=False, resume=True).run()
    assert again["status"] == "already finished" and again["run_dir"] == str(moved)
    trainer = Trainer(cfg, dataset, run, budget="6steps", progress=False, resume=True)
    seen, step = [], trainer.train_step

    def watch(n, lr):
        seen.append(json.loads((run / "summary.json").read_text())["status"])
        return step(n, lr)

    trainer.train_step = watch
    assert trainer.run()["status"] == "finished"
    assert seen == ["running or killed"] * 3
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_an_interrupted_runs_summary_says_when_its_held_out_loss_was_measured(dataset, tmp_path, capsys):
    from ember.cli import _print_summary

    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["train.eval_every=3steps"])
    trainer = Trainer(cfg, dataset, tmp_path / "run", budget="1000steps", progress=False)
    trainer.policies.append(_StopAfter(4))
    summary = trainer.run()
    trainer.close()
    assert (summary["status"], summary["steps"], summary["val_step"]) == ("interrupted", 4, 3)
    _print_summary(summary)
    out = capsys.readouterr().out
    assert "(at step 3)" in out and "held-out loss" in out.split("(at step 3)")[0]
