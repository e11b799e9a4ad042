"""Training with data.document_mask through FlexAttention (model.document_kernel=flex)
takes the steps the dense-mask SDPA path takes, with and without selective recomputation,
and a CPU run asking for it is refused before anything is built (PyTorch has no
FlexAttention backward there; the comparison lifts that refusal to run its reference one)."""

import pytest

from conftest import REPO, TINY
from ember.config import ConfigError, load_config
from ember.layout import check_run as real_check
from ember.train.trainer import Trainer

TINY_GPT = str(REPO / "configs/tiny-gpt.toml")


def _steps(data, run_dir, *overrides, steps=2, monkeypatch=None):
    cfg = load_config(TINY_GPT, TINY + ["data.document_mask=true", "model.dropout=0", *overrides])
    if monkeypatch is not None:  # as if on CUDA: the refusal and PyTorch's CPU guard lifted
        import torch.nn.attention.flex_attention as flex_module

        import ember.train.trainer as trainer_module

        monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
        monkeypatch.setattr(trainer_module, "check_run", lambda cfg, world, seq_len, device_type: real_check(
            cfg, world, seq_len, None))
    trainer = Trainer(cfg, data, run_dir, progress=False)
    trainer.build()
    out = [tuple(float(x) for x in trainer.train_step(8, lr=1e-3)[:2]) for _ in range(steps)]
    return out, trainer.evaluate()


@pytest.mark.parametrize("objective,recompute", [("causal", "none"), ("mlm", "selective")])
def test_flex_trains_the_steps_of_the_dense_mask(bounded_dataset, tmp_path, objective, recompute, monkeypatch):
    runs = {kernel: _steps(bounded_dataset, tmp_path / kernel, f"model.objective={objective}",
                           f"model.document_kernel={kernel}", f"parallel.recompute={recompute}",
                           monkeypatch=monkeypatch if kernel == "flex" else None)
            for kernel in ("sdpa", "flex")}
    (dense, dense_eval), (flex, flex_eval) = runs["sdpa"], runs["flex"]
    for (loss, norm), (loss_f, norm_f) in zip(dense, flex):
        assert loss_f == pytest.approx(loss, rel=1e-5) and norm_f == pytest.approx(norm, rel=1e-4)
    assert flex_eval == pytest.approx(dense_eval, rel=1e-5)


def test_flex_on_a_cpu_is_refused_before_building(bounded_dataset, tmp_path):
    cfg = load_config(TINY_GPT, TINY + ["data.document_mask=true", "model.dropout=0", "model.document_kernel=flex"])
    with pytest.raises(ConfigError, match="document_kernel=flex trains on CUDA only"):
        Trainer(cfg, bounded_dataset, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
