"""TensorBoard beside metrics.jsonl: event files read back with TensorBoard's own reader hold
every logged step once, also after a resume; a tracker that cannot start is a warning."""

import importlib.util
import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, TINY
from ember.config import ConfigError, load_config
from ember.train.trainer import Trainer

RECIPE = REPO / "configs/tiny-gpt.toml"


def _run(dataset, out, budget, resume=False, *sets):
    cfg = load_config(RECIPE, TINY + ["train.trackers=[tensorboard]", "train.eval_every=5steps",
                                      "train.checkpoint_every=5steps", f"train.budget={budget}", *sets])
    return Trainer(cfg, dataset, out, resume=resume, progress=False).run()


def _scalars(out, tag):
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_holds_every_logged_value_also_after_a_resume(dataset, tmp_path):
    out = tmp_path / "run"
    _run(dataset, out, "8steps")
    shutil.rmtree(out / "checkpoints" / "step_00000008")  # the resume goes back to step 5: 6-8 run again
    _run(dataset, out, "12steps", resume=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [s for s, _ in _scalars(out, "loss")] == [s for s, _ in losses] == list(range(1, 13))
    assert [v for _, v in _scalars(out, "loss")] == pytest.approx([v for _, v in losses], rel=1e-6)
    assert [s for s, _ in _scalars(out, "val_loss")] == [r["step"] for r in records if "val_loss" in r]
    for tag in ("lr", "grad_norm", "tokens_per_s", "tokens", "elapsed_s"):  # once a step, evaluations or not
        assert [s for s, _ in _scalars(out, tag)] == list(range(1, 13)), tag
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert any("config" in tag for tag in events.Tags()["tensors"])


def test_a_tracker_that_cannot_start_is_a_warning(dataset, tmp_path, monkeypatch):
    import torch.utils.tensorboard

    def broken(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", broken)
    with pytest.warns(UserWarning, match="the tensorboard tracker did not start"):
        summary = _run(dataset, tmp_path / "run", "3steps")
    assert summary["status"] == "finished"


def test_an_unknown_tracker_is_refused():
    with pytest.raises(ConfigError, match="train.trackers takes"):
        load_config(RECIPE, ["train.trackers=[mlflow]"])


def test_wandb_offline_writes_its_run_folder_and_a_resume_continues_the_same_run(dataset, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the machine is logged into
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = load_config(RECIPE, TINY + ["train.trackers=[wandb]", "train.checkpoint_every=4steps", "train.budget=4steps"])
    Trainer(cfg, dataset, out, progress=False).run()
    run_id = (out / "wandb_id").read_text().strip()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    log = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    for key in (b"loss", b"grad_norm", b"tokens_per_s", b"val_loss", b"hidden"):  # metrics and the config
        assert key in log, key
    cfg.train.budget = "6steps"
    Trainer(cfg, dataset, out, resume=True, progress=False).run()
    assert (out / "wandb_id").read_text().strip() == run_id  # the same W&B run, resumed
    assert all(p.name.endswith(run_id) for p in (out / "wandb").glob("offline-run-*"))


def test_trackio_writes_its_database_in_the_run_folder_and_a_resume_continues_the_run(dataset, tmp_path, monkeypatch):
    if importlib.util.find_spec("trackio") is None:  # not imported here: trackio reads TRACKIO_DIR on import
        pytest.skip("trackio is not installed")
    monkeypatch.delenv("TRACKIO_DIR", raising=False)  # restored (absent) after the test
    out = tmp_path / "run"
    cfg = load_config(RECIPE, TINY + ["train.trackers=[trackio]", "train.checkpoint_every=4steps",
                                      "train.eval_every=2steps", "train.budget=4steps"])
    Trainer(cfg, dataset, out, progress=False).run()
    cfg.train.budget = "6steps"
    Trainer(cfg, dataset, out, resume=True, progress=False).run()
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path("ember").is_relative_to(out / "trackio")
    assert SQLiteStorage.get_runs("ember") == ["run"]  # one run, continued by the resume
    logs = [r for r in SQLiteStorage.get_logs("ember", "run") if "loss" in r]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [r["loss"] for r in logs] == pytest.approx([r["loss"] for r in records if "loss" in r], rel=1e-6)
    assert SQLiteStorage.get_run_config("ember", "run")["model"]["hidden"] == cfg.model.hidden
