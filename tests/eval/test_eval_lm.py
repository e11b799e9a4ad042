"""`ember eval lm`: the held-out numbers of a checkpoint, comparable between runs."""

import json
import math
import shutil

import numpy as np
import pytest
from eval_helpers import trained_run

from ember.cli import main
from ember.data.manifest import file_sha256
from ember.eval.lm import evaluate_lm


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_reproduces_the_trainers_held_out_loss(objective, dataset, tmp_path_factory):
    run = trained_run(objective, dataset, tmp_path_factory)
    summary = json.loads((run / "summary.json").read_text())
    # The trainer scores eval_batches (2) micro-batches (4) with fixed masks; so does this.
    result = evaluate_lm(run, dataset, batches=2, batch_size=4)
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert 0.0 <= result["accuracy"] <= 1.0 and result["sequences"] == 8
    if objective == "mlm":
        assert 0.05 * 8 * 64 < result["targets"] < 0.3 * 8 * 64  # the masked positions only
    else:
        assert result["targets"] == 8 * 63
    # masks do not depend on the batch size
    assert evaluate_lm(run, dataset, batches=1, batch_size=8)["loss"] == pytest.approx(result["loss"], rel=1e-6)


def test_command_scores_the_whole_split_and_writes_json(dataset, tmp_path_factory, tmp_path, capsys):
    run = trained_run("mlm", dataset, tmp_path_factory)
    out = tmp_path / "lm.json"
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--out", str(out)]) == 0
    assert "masked-token accuracy" in capsys.readouterr().out
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert json.loads(out.read_text())["sequences"] == manifest["splits"]["val"]["sequences"]


def test_data_the_model_cannot_read_is_refused(dataset, tmp_path_factory, tmp_path, capsys):
    run = trained_run("causal", dataset, tmp_path_factory)
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"tokenizer_sha256": "0" * 64}))
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(other)]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    (other / "manifest.json").write_text(json.dumps(manifest | {"vocab_size": 100_000}))
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 100000" in err and err.count("\n") == 1


def test_a_damaged_held_out_shard_or_run_record_is_one_sentence(dataset, tmp_path_factory, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run("causal", dataset, tmp_path_factory), run, ignore=shutil.ignore_patterns("eval"))
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    shard = manifest["splits"]["val"]["shards"][0]
    ids = np.load(data / shard["file"], mmap_mode="r+")
    ids[0, 3] = 60_000  # beyond the vocabulary of 512
    ids.flush()
    del ids
    args = ["eval", "lm", "--checkpoint", str(run), "--data", str(data), "--out", str(tmp_path / "lm.json")]
    for words in ("does not match its checksum", "holds the token id 60000"):
        err = (main(args), capsys.readouterr().err)
        assert err[0] == 2 and words in err[1] and err[1].count("\n") == 1, err
        shard["sha256"] = file_sha256(data / shard["file"])  # damage the checksum cannot see
        (data / "manifest.json").write_text(json.dumps(manifest))
    (run / "data.json").write_text("[1, 2")
    args = ["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--out", str(tmp_path / "lm.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "data.json is damaged" in err and err.count("\n") == 1, err
    assert not (tmp_path / "lm.json").exists()


def test_checkpoint_folders_and_unfinished_runs(dataset, tmp_path_factory, tmp_path):
    run = trained_run("causal", dataset, tmp_path_factory)
    final = evaluate_lm(run, dataset, batches=1)
    step = sorted((run / "checkpoints").iterdir())[-1]
    assert evaluate_lm(step, dataset, batches=1)["loss"] == final["loss"]  # the last step is the final model
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished)
    (unfinished / "model.safetensors").unlink()  # as a run stopped before its end leaves it
    result = evaluate_lm(unfinished, dataset, batches=1)
    assert result["weights"].endswith(step.name) and result["loss"] == final["loss"]


def test_a_sharded_checkpoint_scores_like_the_model_it_holds(dataset, tmp_path_factory, tmp_path):
    """Runs under torchrun leave sharded checkpoints; evaluation reads them in one process."""
    import torch
    from safetensors.torch import load_model

    from ember.config import load_config
    from ember.model import Transformer
    from ember.train.checkpoint import save

    run = trained_run("causal", dataset, tmp_path_factory)
    final = evaluate_lm(run, dataset, batches=1)
    sharded = tmp_path / "sharded"
    shutil.copytree(run, sharded, ignore=shutil.ignore_patterns("checkpoints", "model.safetensors"))
    model = Transformer(load_config(run / "config.toml").model)
    load_model(model, str(run / "model.safetensors"))
    save(sharded, 7, [model], [torch.optim.AdamW(model.parameters())], {"progress": {"step": 7}})
    result = evaluate_lm(sharded, dataset, batches=1)
    assert result["weights"].endswith("step_00000007") and result["loss"] == pytest.approx(final["loss"], rel=1e-6)
    torch.nn.init.zeros_(model.head.weight)  # a different model scores differently: the test can fail
    save(sharded, 8, [model], [torch.optim.AdamW(model.parameters())], {"progress": {"step": 8}})
    assert evaluate_lm(sharded, dataset, batches=1)["loss"] != pytest.approx(final["loss"], rel=1e-3)


def test_a_checkpoints_numbers_do_not_replace_the_final_models(dataset, tmp_path_factory, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run("causal", dataset, tmp_path_factory), run)
    step = sorted((run / "checkpoints").iterdir())[-1]
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "1"]) == 0
    assert main(["eval", "lm", "--checkpoint", str(step), "--data", str(dataset), "--batches", "1"]) == 0
    capsys.readouterr()
    final = json.loads((run / "eval" / "lm.json").read_text())
    earlier = json.loads((run / "eval" / f"lm_{step.name}.json").read_text())
    assert final["weights"].endswith("model.safetensors") and earlier["weights"] == str(step)


def test_a_damaged_checkpoint_is_named_without_resume_advice(dataset, tmp_path_factory, tmp_path, capsys):
    """Evaluation reads a checkpoint, it does not resume one: the sentence names the damaged
    file, and setting the folder aside for --resume is not evaluation's business (a folder
    already set aside must not be told to become NAME.damaged.damaged)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run("causal", dataset, tmp_path_factory), run, ignore=shutil.ignore_patterns("eval"))
    step = sorted((run / "checkpoints").iterdir())[-1]
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for folder in (step, step.with_name(step.name + ".damaged")):
        if not folder.exists():
            step.rename(folder)  # as the user would set it aside
        assert main(["eval", "lm", "--checkpoint", str(folder), "--data", str(dataset), "--batches", "1"]) == 2
        err = capsys.readouterr().err
        assert f"{folder / shard.name} is missing or does not match its checksum" in err, err
        assert "--resume" not in err and "rename" not in err and ".damaged.damaged" not in err, err
        assert err.count("\n") == 1 and not list(run.glob("eval/*.json"))


def test_a_checkpoint_further_on_than_the_model_file_is_the_one_scored(dataset, tmp_path_factory, tmp_path):
    """A finished run resumed to train on and stopped again keeps its earlier model file;
    its newest checkpoint holds the weights it reached, and evaluation scores those."""
    import torch
    from safetensors.torch import load_model, save_model

    from ember.config import load_config
    from ember.model import Transformer
    from ember.train.checkpoint import save
    from ember.train.model_file import model_step

    run = tmp_path / "run"
    shutil.copytree(trained_run("causal", dataset, tmp_path_factory), run)
    assert model_step(run / "model.safetensors") == 20
    final = evaluate_lm(run, dataset, batches=1)
    model = Transformer(load_config(run / "config.toml").model)
    load_model(model, str(run / "model.safetensors"))
    torch.nn.init.zeros_(model.head.weight)
    save(run, 27, [model], [torch.optim.AdamW(model.parameters())], {"progress": {"step": 27}})
    further = evaluate_lm(run, dataset, batches=1)
    assert further["weights"].endswith("step_00000027") and further["loss"] != pytest.approx(final["loss"], rel=1e-3)
    # A model file from before the step was recorded: the newer of the two by time.
    load_model(model, str(run / "model.safetensors"))
    save_model(model, str(run / "model.safetensors"))  # rewritten after the checkpoint, without a step
    assert model_step(run / "model.safetensors") is None
    assert evaluate_lm(run, dataset, batches=1)["weights"].endswith("model.safetensors")
