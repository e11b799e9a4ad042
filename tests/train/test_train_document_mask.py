"""data.document_mask: training, evaluation and the refusals, on data prepared with boundaries."""

import json

import pytest
import torch

from conftest import REPO, TINY
from ember.cli import main
from ember.config import ConfigError, load_config
from ember.eval.lm import evaluate_lm
from ember.layout import check_run
from ember.train.trainer import Trainer

TINY_GPT = str(REPO / "configs/tiny-gpt.toml")
MASK = "data.document_mask=true"


@pytest.fixture
def bounded(bounded_dataset):
    return bounded_dataset


def _args(data, out, *settings, budget="3steps"):
    return ["train", TINY_GPT, "--data", str(data), "--out", str(out), "--quiet", "--budget", budget,
            *[x for s in [*TINY, *settings] for x in ("--set", s)]]


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_trains_and_evaluates_with_the_mask(objective, bounded, tmp_path):
    run = tmp_path / "run"
    assert main(_args(bounded, run, MASK, f"model.objective={objective}")) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert "document_mask = true" in (run / "config.toml").read_text()
    # ember eval lm follows the run's setting: the trainer's held-out loss again.
    assert evaluate_lm(run, bounded, batches=2, batch_size=4)["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)


def test_data_without_boundaries_is_refused_before_training(dataset, bounded, tmp_path, capsys):
    assert main(_args(dataset, tmp_path / "run", MASK)) == 2
    err = capsys.readouterr().err
    assert "--doc-boundaries" in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert main(_args(bounded, tmp_path / "masked", MASK, budget="1steps")) == 0
    assert main(["eval", "lm", "--checkpoint", str(tmp_path / "masked"), "--data", str(dataset)]) == 2
    assert "--doc-boundaries" in capsys.readouterr().err


def test_pipeline_parallelism_is_refused():
    cfg = load_config(TINY_GPT, TINY + [MASK, "parallel.pp=2"])
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        check_run(cfg, 2)


def _trainer(data, run_dir, *overrides):
    cfg = load_config(TINY_GPT, TINY + ["model.objective=mlm", *overrides])
    trainer = Trainer(cfg, data, run_dir, progress=False)
    trainer.build()
    return trainer


def test_micro_batches_get_their_own_documents(bounded, tmp_path):
    # The ids are sliced with the rows: accumulating micro-batches of 2 equals one of 8,
    # and both differ from the unmasked step on the same rows.
    big = _trainer(bounded, tmp_path / "a", MASK, "train.micro_batch=8")
    small = _trainer(bounded, tmp_path / "b", MASK, "train.micro_batch=2")
    plain = _trainer(bounded, tmp_path / "c", "train.micro_batch=8")
    loss_big, norm_big, _ = big.train_step(8, lr=1e-3)
    loss_small, norm_small, _ = small.train_step(8, lr=1e-3)
    loss_plain, _, _ = plain.train_step(8, lr=1e-3)
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-5, atol=0)
    assert float(norm_small) == pytest.approx(float(norm_big), rel=1e-4)
    assert abs(float(loss_plain) - float(loss_big)) > 1e-4
    assert big.evaluate() != plain.evaluate()
