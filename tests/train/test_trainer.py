import json

import pytest
import torch

from conftest import REPO, TINY
from ember.config import ConfigError, load_config
from ember.train.trainer import Trainer


def _trainer(dataset, run_dir, *overrides):
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + list(overrides))
    trainer = Trainer(cfg, dataset, run_dir, progress=False)
    trainer.build()
    return trainer


def test_gradient_accumulation_equals_one_big_batch(dataset, tmp_path):
    # MLM makes the number of targets differ between micro-batches: the loss must still be
    # normalised over the whole step, not averaged per micro-batch.
    big = _trainer(dataset, tmp_path / "a", "model.objective=mlm", "train.micro_batch=8")
    small = _trainer(dataset, tmp_path / "b", "model.objective=mlm", "train.micro_batch=2")
    grads = {}
    for name, trainer in (("big", big), ("small", small)):
        # Compare gradients, not Adam's update: Adam turns rounding noise in near-zero
        # gradients into full-size steps.
        params = list(trainer.model.parameters())
        trainer.optimizer.step = lambda name=name, params=params: grads.__setitem__(
            name, [p.grad.clone() for p in params])
    loss_big, norm_big, n_big = big.train_step(8, lr=1e-3)
    loss_small, norm_small, n_small = small.train_step(8, lr=1e-3)
    assert n_big == n_small
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-5, atol=0)
    assert abs(float(norm_small) - float(norm_big)) <= 1e-5 * float(norm_big)
    for a, b in zip(grads["big"], grads["small"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * float(norm_big))


def test_training_beats_the_unigram_baseline(dataset, tmp_path):
    cfg = load_config(REPO / "configs/tiny-gpt.toml",
                      TINY + ["model.hidden=64", "model.heads=4", "model.mlp_hidden=172", "train.log_every=50",
                              "train.eval_every=1000steps", "optim.lr=3e-3"])
    summary = Trainer(cfg, dataset, tmp_path / "run", budget="300steps", progress=False).run()
    assert summary["status"] == "finished"
    assert summary["val_loss"] < summary["unigram_entropy"] - 0.5, summary
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 3 and (tmp_path / "run" / "model.safetensors").exists()


def test_bf16_autocast_trains_on_a_cpu(dataset, tmp_path):
    """CPUs with AVX512-BF16 or AMX gain from it on larger models (benchmarks/cpu_bf16.py)."""
    trainer = _trainer(dataset, tmp_path / "bf16", "train.precision=bf16", "train.device=cpu")
    assert trainer.amp_dtype == torch.bfloat16
    losses = [float(trainer.train_step(8, lr=1e-3)[0]) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_a_grouped_query_run_checkpoints_and_resumes(dataset, tmp_path):
    from safetensors import safe_open

    sets = ["model.heads=4", "model.kv_heads=2", "train.checkpoint_every=2steps"]
    run = tmp_path / "gqa"
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + sets)
    assert Trainer(cfg, dataset, run, budget="2steps", progress=False).run()["status"] == "finished"
    with safe_open(str(run / "model.safetensors"), "pt") as f:
        # 2 key/value heads of hidden 32 / 4 heads: k and v are 16 wide, q stays 32.
        assert f.get_slice("blocks.0.attn.k_proj.weight").get_shape() == [16, 32]
        assert f.get_slice("blocks.0.attn.q_proj.weight").get_shape() == [32, 32]
    resumed = Trainer(cfg, dataset, run, budget="4steps", resume=True, progress=False)
    assert resumed.run()["status"] == "finished" and resumed.resume_from is not None
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 4
    other = load_config(REPO / "configs/tiny-gpt.toml", TINY + sets + ["model.kv_heads=4"])
    with pytest.raises(ConfigError, match="model.kv_heads is 4 but the run being resumed used 2"):
        Trainer(other, dataset, run, budget="6steps", resume=True, progress=False)
