"""Activation checkpointing recomputes the same numbers: loss and gradients of a step with
`full` and `selective` equal those without, parameter names stay the plain model's, and
each recomputes what it should in backward."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, TINY
from ember.config import ConfigError, load_config
from ember.model import Transformer
from ember.parallel.recompute import apply_recompute, blocks_of
from ember.parallel.stages import split_model
from ember.train.trainer import Trainer


def _step(dataset, run_dir, recompute, objective, every=1):
    sets = TINY + ["model.layers=3", f"model.objective={objective}", f"parallel.recompute={recompute}",
                   f"parallel.recompute_every={every}",
                   "model.dropout=0.1"]  # dropout on: recomputation must redraw the same masks
    trainer = Trainer(load_config(REPO / "configs/tiny-gpt.toml", sets), dataset, run_dir, progress=False)
    trainer.build()
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    loss, norm, _ = trainer.train_step(8, lr=1e-3)
    return float(loss), float(norm), grads


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_recompute_gives_the_same_loss_and_gradients(dataset, tmp_path, objective):
    loss, norm, grads = _step(dataset, tmp_path / "none", "none", objective)
    for mode, every in (("full", 1), ("selective", 1), ("full", 2), ("selective", 2)):
        loss_r, norm_r, grads_r = _step(dataset, tmp_path / f"{mode}{every}", mode, objective, every)
        assert loss_r == pytest.approx(loss, rel=1e-6) and norm_r == pytest.approx(norm, rel=1e-6)
        assert grads_r.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads_r[name], grads[name], rtol=1e-5, atol=1e-8)


def test_recompute_checkpoints_the_blocks_it_names():
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["model.vocab_size=128", "model.layers=4"])
    names = [n for n, _ in Transformer(cfg.model).named_parameters()]
    for mode, chosen in (("full", [0, 1, 2, 3]), ("selective", [0, 1, 2, 3]), ("none", [])):
        model = Transformer(cfg.model)
        apply_recompute(model, mode)
        assert [i for i, b in enumerate(model.blocks.values()) if "forward" in vars(b)] == chosen
        assert [n for n, _ in model.named_parameters()] == names


def _checkpointed(module):
    return [i for i, b in blocks_of(module) if "forward" in vars(b)]


def test_recompute_every_picks_blocks_by_their_layer_index_also_in_pipeline_stages():
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["model.vocab_size=128", "model.layers=6"])
    for mode in ("full", "selective"):
        for every, chosen in ((1, [0, 1, 2, 3, 4, 5]), (2, [0, 2, 4]), (3, [0, 3]), (4, [0, 4]), (7, [0])):
            model = Transformer(cfg.model)
            apply_recompute(model, mode, every)
            assert _checkpointed(model) == chosen
            # Stages of 3 blocks (0-2, 3-5) and of 2 (0-1, 2-3, 4-5) pick the same blocks:
            # the count is by the plain model's index, not the position inside a stage.
            for n_stages in (2, 3):
                stages = split_model(Transformer(cfg.model), list(range(n_stages)), (6 // n_stages,) * n_stages)
                for stage in stages:
                    apply_recompute(stage, mode, every)
                assert [i for stage in stages for i in _checkpointed(stage)] == chosen


def test_recompute_every_must_be_at_least_one():
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/tiny-gpt.toml", ["parallel.recompute_every=0"])
    assert "parallel.recompute_every must be at least 1" in str(info.value)
    assert "\n" not in str(info.value) and str(info.value).count(". ") == 0


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode, every=1, fused=True):
    """Ops that run during backward: recomputed forward ops show up here."""
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["model.vocab_size=128", "model.layers=4"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for block in model.blocks.values():
        block.attn.fused = block.mlp.fused = fused
    apply_recompute(model, mode, every)
    ids = torch.randint(0, 128, (2, 64))
    loss = model(ids, ids, reduction="sum")
    with _CountOps() as counter:
        loss.backward()
    attention = sum(n for name, n in counter.counts.items()
                    if name.startswith("_scaled_dot_product") and "backward" not in name)
    return attention, sum(counter.counts[name] for name in ("mm", "addmm", "bmm", "baddbmm"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_selective_recomputes_neither_attention_nor_projections(fused):
    attention, mm = {}, {}
    for mode in ("none", "selective", "full"):
        attention[mode], mm[mode] = _backward_ops(mode, fused=fused)
    assert attention["none"] == attention["selective"] == 0 and attention["full"] == 4  # once per block
    assert mm["selective"] == mm["none"] < mm["full"]  # projections kept, not recomputed
    # Full recomputation reruns each block's forward up to the last tensor backward needs (not
    # the down projection): q/k/v in one matmul or three, o_proj, gate/up in one or two.
    assert mm["full"] - mm["none"] == 4 * (3 if fused else 6)


def test_fused_projections_take_one_matmul_per_gradient_in_backward():
    # Per block, input and weight gradients: q/k/v 2 instead of 6, gate/up 2 instead of 4 (swiglu).
    assert _backward_ops("none", fused=False)[1] - _backward_ops("none", fused=True)[1] == 4 * (4 + 2)


def test_recompute_every_recomputes_only_the_chosen_blocks_in_backward():
    none_mm = _backward_ops("none")[1]
    full_mm = _backward_ops("full")[1]
    per_block = (full_mm - none_mm) // 4  # the projections of one recomputed block
    for every, blocks in ((2, 2), (3, 2), (4, 1)):  # 4 layers: blocks 0,2 / 0,3 / 0
        attention, mm = _backward_ops("selective", every)
        assert attention == 0 and mm == none_mm
        attention, mm = _backward_ops("full", every)
        assert attention == blocks and mm == none_mm + blocks * per_block


def test_compiled_blocks_train_the_same_steps(dataset, tmp_path):
    # One objective only: compilation is the slow part, the objective changes no block.
    runs = {}
    for compiled in (False, True):
        sets = TINY + [f"train.compile={str(compiled).lower()}", "parallel.recompute=selective",
                       "model.objective=mlm"]
        trainer = Trainer(load_config(REPO / "configs/tiny-gpt.toml", sets), dataset, tmp_path / str(compiled),
                          progress=False)
        trainer.build()
        assert trainer.model.head.compiled == compiled  # the loss's chunks too, not only the blocks
        runs[compiled] = [tuple(float(x) for x in trainer.train_step(8, lr=1e-3)[:2]) for _ in range(2)]
    for (loss, norm), (loss_c, norm_c) in zip(runs[False], runs[True]):
        assert loss_c == pytest.approx(loss, rel=1e-5) and norm_c == pytest.approx(norm, rel=1e-5)
