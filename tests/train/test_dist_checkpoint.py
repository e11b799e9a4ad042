"""Sharded checkpoints: saved under one layout, loaded under another or in one process,
with parameters and AdamW states exactly equal and the next step's losses unchanged.

Two launches of real processes (gloo, CPU) are shared by the tests: 4 ranks (FSDP x4
saves) then 2 ranks (FSDP x2 and two pipeline-style ranks save; tensor parallel x2 and
FSDP x2 load). See dist_checkpoint_worker.py."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember import atomic
from ember.config import ConfigError
from ember.model.transformer import Transformer
from ember.train import checkpoint as ckpt
from ember.train.model_file import load_model, save_model

WORKER = Path(__file__).with_name("dist_checkpoint_worker.py")
_spec = importlib.util.spec_from_file_location("dist_checkpoint_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(launch: str, world: int, work: Path) -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(ckpt.__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), launch, str(work)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            proc.kill()
    results = work / f"results_{launch}.json"
    assert all(p.returncode == 0 for p in procs) and results.is_file(), "\n".join(logs)[-4000:]
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    work = tmp_path_factory.mktemp("dcp")
    worker.save_single_process(work)
    results = _launch("dp4", 4, work)
    results.update(_launch("two", 2, work))
    return work, results


def _check(results: dict[str, str], *labels: str) -> None:
    for label in labels:
        assert results[label] == "ok", f"{label}:\n{results[label]}"


def test_zero3_x2_checkpoint_resumes_under_tensor_parallel_x2(saved):
    _check(saved[1], "save_fsdp2", "tp2_from_fsdp2")  # with the tp ranks' own RNG streams


def test_rng_streams_are_restored_only_into_the_same_layout():
    zero3_x2 = worker.layout(dp_shard=2)
    saved = {"world_size": 2, "layout": zero3_x2}
    assert ckpt.restores_rng(saved, 2, worker.layout(dp_shard=2))  # DDP x2 or ZeRO-1 x2: same degrees
    assert not ckpt.restores_rng(saved, 2, worker.layout(tp=2))  # same size: tp ranks need equal streams
    assert not ckpt.restores_rng(saved, 2, worker.layout(pp=2))
    assert not ckpt.restores_rng(saved, 4, worker.layout(dp_shard=4))
    assert not ckpt.restores_rng({"world_size": 2}, 2, zero3_x2)  # a checkpoint that names no layout
    vpp = {**worker.layout(pp=2), "vpp": 2}
    assert not ckpt.restores_rng({"world_size": 2, "layout": worker.layout(pp=2)}, 2, vpp)


def test_dp4_checkpoint_resumes_under_fsdp_x2(saved):
    _check(saved[1], "save_fsdp4", "fsdp2_from_dp4")


def test_dp4_checkpoint_resumes_under_hybrid_sharding(saved):
    _check(saved[1], "save_fsdp4", "hsdp2x2_from_dp4")


def test_zero3_checkpoint_resumes_under_ddp(saved):
    _check(saved[1], "save_fsdp2", "ddp2_from_fsdp2")  # the same degrees: RNG streams restored too


def test_one_process_checkpoint_resumes_under_zero3_x2(saved):
    _check(saved[1], "fsdp2_from_single")


def test_one_process_checkpoint_resumes_as_pipeline_parts(saved):
    work = saved[0]
    model = worker.plain_model()
    parts = [part for rank_parts in worker.pipeline_parts(model) for part in rank_parts]
    optimizers = [worker.adamw(part) for part in parts]
    state = ckpt.load(work / "single" / "checkpoints" / "step_00000001", parts, optimizers)
    assert state == {"progress": {"step": 1}, "data": {"position": 17}}
    ref = torch.load(work / "ref_single.pt", weights_only=True)
    worker.assert_same_state(worker.full_state(parts, optimizers), ref["state"])
    worker.assert_same_losses(worker.continuation(model, optimizers), ref["losses"])


def _assert_restored(model: Transformer, opt: torch.optim.Optimizer, ref: dict) -> None:
    """Compares through the plain model and optimizer, not the state-dict helpers the
    checkpoint code itself uses."""
    want = ref["state"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), want["model." + name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[param][key], want[f"optim.state.{name}.{key}"]), (name, key)
    assert opt.state[next(model.parameters())]["step"].item() == 1
    worker.assert_same_losses(worker.continuation(model, [opt]), ref["losses"])


def test_zero3_checkpoint_resumes_in_one_process(saved):
    work, results = saved
    _check(results, "save_fsdp2")
    model = worker.plain_model()
    opt = worker.adamw(model)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    state = ckpt.load(ckpt.latest(work / "fsdp2"), [model], [opt])
    assert torch.equal(torch.rand(3), expected_draw), "RNG of a 2-rank run must not be applied to 1 process"
    assert state == {"progress": {"step": 1}, "data": {"position": 17}}
    _assert_restored(model, opt, torch.load(work / "ref_fsdp2.pt", weights_only=True))


def test_pipeline_parts_resume_as_whole_model_in_one_process(saved):
    work, results = saved
    _check(results, "save_pp2")
    model = worker.plain_model()
    opt = worker.adamw(model)
    path = ckpt.latest(work / "pp2")
    assert ckpt.is_checkpoint(path)
    assert ckpt.load(path, [model], [opt]) == {"progress": {"step": 1}}
    _assert_restored(model, opt, torch.load(work / "ref_pp2.pt", weights_only=True))


@pytest.mark.parametrize("name", ["fsdp2", "pp2", "dp4", "tp2_from_fsdp2", "hsdp2x2_from_dp4"])
def test_full_model_gathered_from_shards_and_stages_is_what_eval_reads(saved, name):
    work, results = saved
    _check(results, "save_fsdp2", "save_fsdp4", "save_pp2", "tp2_from_fsdp2", "hsdp2x2_from_dp4")
    ref = torch.load(work / f"ref_{name.split('_from_')[-1]}.pt", weights_only=True)["state"]
    model = Transformer(worker.CFG)
    load_model(model, work / f"{name}.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(value, ref["model." + key]), key


def test_tied_weights_from_two_stages_are_stored_once(tmp_path):
    cfg = _tied_config()
    torch.manual_seed(0)
    tied = Transformer(cfg)
    first = worker.Part(tied, [0, 1], embed=True)
    last = worker.Part(tied, [], head=True)
    last.head = torch.nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)
    with torch.no_grad():
        last.head.weight.copy_(tied.embed.weight)  # a later stage's own copy, kept in sync
    save_model([first, last], tmp_path / "model.safetensors")
    restored = Transformer(cfg)
    load_model(restored, tmp_path / "model.safetensors")
    assert restored.head.weight is restored.embed.weight
    assert torch.equal(restored.embed.weight, tied.embed.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_file_reads_back_as_safetensors_writes_it(tmp_path, dtype):
    """The file is written a tensor at a time behind a header made first: every tensor, its
    dtype and shape, and an untied head of the embedding's shape are what safetensors reads."""
    from safetensors.torch import load_file

    cfg = worker.CFG.__class__(**{**worker.CFG.__dict__, "tie_embeddings": False})
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    save_model([model], tmp_path / "model.safetensors")
    stored = load_file(str(tmp_path / "model.safetensors"))
    expected = model.state_dict()
    assert sorted(stored) == sorted(expected)
    assert all(stored[k].dtype == dtype and torch.equal(stored[k], expected[k]) for k in expected)


def _tied_config():
    return worker.CFG.__class__(**{**worker.CFG.__dict__, "tie_embeddings": True})


def test_tied_model_checkpoint_loads_into_stages_holding_embedding_and_head_apart(tmp_path):
    cfg = _tied_config()
    torch.manual_seed(0)
    tied = Transformer(cfg)
    opt = worker.adamw(tied)
    worker.train_step(tied, [opt], worker.batches()[0])
    path = ckpt.save(tmp_path, 1, [tied], [opt], {})

    torch.manual_seed(1)
    other = Transformer(cfg)
    first = worker.Part(other, [0, 1], embed=True)
    last = worker.Part(other, [], head=True)
    last.head = torch.nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)  # the last stage's own copy
    optimizers = [worker.adamw(first), worker.adamw(last)]
    ckpt.load(path, [first, last], optimizers)
    shared = opt.state[tied.embed.weight]
    for module, part_opt in ((first.embed, optimizers[0]), (last.head, optimizers[1])):
        assert torch.equal(module.weight, tied.embed.weight)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(part_opt.state[module.weight][key], shared[key]), key


def test_interrupted_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    model = worker.plain_model()
    opt = worker.adamw(model)
    data = worker.batches()
    worker.train_step(model, [opt], data[0])
    ckpt.save(tmp_path, 1, [model], [opt], {"progress": {"step": 1}})
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    worker.train_step(model, [opt], data[1])

    real_replace = os.replace

    def crash_before_publish(src, dst):
        if Path(dst).name == "step_00000002":
            raise KeyboardInterrupt("killed between writing and renaming")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", crash_before_publish)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, [model], [opt], {"progress": {"step": 2}})
    monkeypatch.setattr(atomic.os, "replace", real_replace)

    assert (tmp_path / "checkpoints" / "step_00000002.tmp" / ".metadata").is_file()  # fully written
    assert ckpt.latest(tmp_path).name == "step_00000001"
    fresh = worker.plain_model()
    assert ckpt.load(ckpt.latest(tmp_path), [fresh], [worker.adamw(fresh)]) == {"progress": {"step": 1}}
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, at_step_1[key]), key

    # The next save of that step replaces the leftover, and old checkpoints are pruned.
    ckpt.save(tmp_path, 2, [model], [opt], {"progress": {"step": 2}})
    ckpt.save(tmp_path, 3, [model], [opt], {"progress": {"step": 3}}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000003"]


def test_a_checkpoint_of_an_older_ember_gets_one_sentence_and_still_evaluates(tmp_path):
    model = worker.plain_model()
    old = tmp_path / "checkpoints" / "step_00000001"
    old.mkdir(parents=True)
    from safetensors.torch import save_model as save_safetensors
    save_safetensors(model, str(old / "model.safetensors"))
    torch.save(worker.adamw(model).state_dict(), old / "optimizer.pt")
    assert not ckpt.is_checkpoint(old)
    with pytest.raises(ConfigError, match="older ember"):
        ckpt.load(old, [model], [worker.adamw(model)])
    fresh = worker.plain_model()
    load_model(fresh, old)  # its weights still evaluate and export
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    with pytest.raises(ConfigError, match="not an ember checkpoint"):
        ckpt.load(tmp_path, [model], None)


def test_another_model_gets_one_clear_sentence_and_the_update_keeps_its_kernels(tmp_path):
    model = worker.plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    worker.train_step(model, [opt], worker.batches()[0])
    path = ckpt.save(tmp_path, 1, [model], [opt], {})
    wider = Transformer(worker.CFG.__class__(**{**worker.CFG.__dict__, "hidden": 64}))
    with pytest.raises(ConfigError, match="Size mismatch.*embed.weight"):
        ckpt.load(path, [wider], [worker.adamw(wider)])

    same = worker.plain_model()
    other_kernels = torch.optim.AdamW(same.parameters(), lr=1e-3, foreach=True)
    ckpt.load(path, [same], [other_kernels])
    assert other_kernels.param_groups[0]["foreach"] is True
    assert other_kernels.param_groups[0]["lr"] == 1e-2  # training state does come from the checkpoint
