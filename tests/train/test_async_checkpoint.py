"""Checkpoints written in the background: what is written is the state at the save, the
folder appears only when complete, and a failed write leaves the previous one in place."""

import threading
from concurrent.futures import Future

import pytest
import torch
from torch.distributed.checkpoint import state_dict_saver

from ember.train import checkpoint
from ember.train.checkpoint import Checkpointer, latest, list_checkpoints, load


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model, opt):
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_training_after_the_call_does_not_change_what_is_written(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    _step(model, opt)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    avg_at_save = opt.state_dict()["state"][0]["exp_avg"].clone()
    # Hold the writer thread before it writes anything until the model has moved on: what
    # it then writes must be the copy taken during the call.
    release = threading.Event()
    original = state_dict_saver.save

    def held_save(*args, **kwargs):
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save", held_save)
    saver = Checkpointer(asynchronous=True)
    final = saver.save(tmp_path, 5, [model], [opt], {"progress": {"step": 5}})
    for _ in range(3):
        _step(model, opt)
    assert latest(tmp_path) is None  # not published while still being written
    release.set()
    saver.wait()
    assert latest(tmp_path) == final
    other, other_opt = _model_and_optimizer(1)
    _step(other, other_opt)
    assert load(final, [other], [other_opt]) == {"progress": {"step": 5}}
    for key, value in other.state_dict().items():
        assert torch.equal(value, at_save[key]), key
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], avg_at_save)
    assert not torch.equal(model.state_dict()["0.weight"], at_save["0.weight"])  # the model did move on
    saver.close()


def test_a_failed_write_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    _step(model, opt)
    saver = Checkpointer(asynchronous=True)
    saver.save(tmp_path, 1, [model], [opt], {"progress": {"step": 1}})
    saver.wait()

    def failing_async_save(*args, **kwargs):
        failed = Future()
        failed.set_exception(OSError("disk full"))
        return failed

    monkeypatch.setattr(checkpoint.dcp, "async_save", failing_async_save)
    saver.save(tmp_path, 2, [model], [opt], {"progress": {"step": 2}})
    with pytest.raises(OSError, match="disk full"):
        saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    other, other_opt = _model_and_optimizer(1)
    _step(other, other_opt)
    assert load(latest(tmp_path), [other], [other_opt]) == {"progress": {"step": 1}}
    saver.close()


def test_asynchronous_saves_keep_the_newest_and_wait_for_each_other(tmp_path):
    model, opt = _model_and_optimizer(0)
    saver = Checkpointer(asynchronous=True)
    for step in (1, 2, 3):
        _step(model, opt)
        saver.save(tmp_path, step, [model], [opt], {"progress": {"step": step}}, keep=2)
    saver.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
