"""A user's mistake gets one sentence and exit status 2, before any compute is spent."""

import shutil
import subprocess

import pytest

from conftest import REPO, TINY, ember_cmd
from ember.cli import main
from ember.config import ConfigError

TINY_GPT = str(REPO / "configs/tiny-gpt.toml")


def _train(dataset, tmp_path, *extra):
    return ["train", TINY_GPT, "--data", str(dataset), "--out", str(tmp_path / "run"), "--quiet",
            *[x for s in TINY for x in ("--set", s)], *extra]


@pytest.mark.parametrize("extra, words", [
    (["--set", "model.hiden=3"], "unknown config key"),
    (["--budget", "soon"], "not understood"),
    (["--set", "model.vocab_size=100"], "smaller than the data's vocabulary"),
    (["--set", "model.max_seq_len=16"], "shorter than the data's sequences"),
    (["--set", "data.order=curriculum"], "needs data prepared with --curriculum sentence-length"),
    # Numeric settings outside their range, refused before anything is built.
    (["--set", "optim.lr=nan"], "optim.lr must be a finite number in (0, 1]"),
    (["--set", "optim.lr=1e9"], "optim.lr must be a finite number"),
    (["--set", "optim.betas=[0.9,1.0]"], "optim.betas must be two numbers in [0, 1)"),
    (["--set", "optim.eps=-1e-8"], "optim.eps must be"),
    (["--set", "optim.weight_decay=-0.1"], "optim.weight_decay must be"),
    (["--set", "optim.clip=-1"], "optim.clip must be"),
    (["--set", "train.log_every=0"], "train.log_every must be"),
    (["--set", "train.eval_batches=0"], "train.eval_batches must be"),
    (["--set", "train.keep_checkpoints=-1"], "train.keep_checkpoints must be"),
    (["--set", "model.hidden=inf"], "model.hidden must be a whole number"),
    (["--set", "model.kv_heads=3"], "model.kv_heads must be 0 (one per query head) or a divisor of model.heads (2), "
                                    "not 3."),
    (["--set", "train.micro_batch=1e400"], "train.micro_batch must be a whole number"),
    (["--set", "model.norm_eps=0"], "model.norm_eps must be"),
    (["--set", "model.init_std=-0.02"], "model.init_std must be"),
    (["--budget", "1e400tok"], "must be a positive, finite amount"),
    (["--budget", "-5m"], "budget '-5m' must be a positive, finite amount"),
    (["--set", "parallel.stage_layers=[a,b]"], "parallel.stage_layers must be a list of whole numbers"),
])
def test_train_mistakes(dataset, tmp_path, capsys, extra, words):
    assert main(_train(dataset, tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_data_and_existing_run(dataset, tmp_path, capsys):
    assert main(["train", TINY_GPT, "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]) == 2
    assert "manifest" in capsys.readouterr().err
    assert main(_train(dataset, tmp_path, "--budget", "2steps")) == 0
    capsys.readouterr()
    assert main(_train(dataset, tmp_path, "--budget", "2steps")) == 2
    assert "--resume" in capsys.readouterr().err


def test_report_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_no_traceback_from_the_real_command(tmp_path):
    proc = subprocess.run(ember_cmd("data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "d")),
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("ember: error:")


def test_a_damaged_shard_stops_training_before_any_step(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    shard = data / "train_00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # the high byte of the last id: still a valid id, so only the checksum can tell
    shard.write_bytes(bytes(raw))
    args = _train(data, tmp_path, "--budget", "2steps")
    proc = subprocess.run(ember_cmd(*args), capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "shard" in proc.stderr and str(shard) in proc.stderr and "checksum" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # Turning verification off trains on the same data (the damage is a valid id).
    assert main([*args, "--set", "data.verify=false"]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_paths_that_cannot_be_used_are_one_sentence(dataset, tmp_path, capsys):
    """Outputs under a file or a missing folder, a folder where a file goes, a binary recipe."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    cases = [
        (["data", "corpus", "--out", str(tmp_path / "a_folder")], "a_folder"),
        (["data", "corpus", "--out", str(tmp_path / "a_file" / "c.jsonl")], "a_file"),
        (["data", "stats", str(dataset), "--png", str(tmp_path / "a_file" / "x.png")], "a_file"),
        (["train", str(tmp_path / "binary.toml"), "--data", str(dataset), "--out", str(tmp_path / "run")],
         "is not a text (TOML) file"),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert (tmp_path / "a_file").read_text() == "x"


def test_out_never_writes_into_a_folder_that_is_not_a_run(dataset, tmp_path, capsys):
    """A data folder or someone's notes given as --out: refused, every file as it was."""
    notes = tmp_path / "run"
    notes.mkdir()
    (notes / "config.toml").write_text("my notes")
    (notes / "plan.txt").write_text("keep me")
    for extra in ([], ["--resume"]):
        assert main(_train(dataset, tmp_path, "--budget", "2steps", *extra)) == 2
        err = capsys.readouterr().err
        assert "not an ember run (plan.txt)" in err and err.count("\n") == 1
    assert (notes / "config.toml").read_text() == "my notes" and sorted(p.name for p in notes.iterdir()) == [
        "config.toml", "plan.txt"]


def test_resume_of_a_finished_run_changes_nothing(dataset, tmp_path, capsys):
    """A requeued job whose run had finished: exit 0, and no file is written again."""
    assert main(_train(dataset, tmp_path, "--budget", "3steps")) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert main(_train(dataset, tmp_path, "--budget", "2steps", "--resume")) == 0
    out, err = capsys.readouterr()
    assert "already finished after 3 steps" in out and "nothing was changed" in err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()} == before


def test_resume_refuses_data_cut_to_another_length(tmp_path):
    from ember.train.setup import check_resume_data

    (tmp_path / "data.json").write_text('{"tokenizer_sha256": "aaa", "seq_len": 64}')
    check_resume_data({"tokenizer_sha256": "aaa", "seq_len": 64}, tmp_path / "data.json")
    with pytest.raises(ConfigError, match="sequences of 32 tokens but the run being resumed trained on 64"):
        check_resume_data({"tokenizer_sha256": "aaa", "seq_len": 32}, tmp_path / "data.json")


def test_a_damaged_checkpoint_state_is_one_sentence(dataset, tmp_path, capsys):
    assert main(_train(dataset, tmp_path, "--budget", "2steps", "--set", "train.checkpoint_every=1steps")) == 0
    capsys.readouterr()
    newest = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    (newest / "state.json").write_text("garbage")
    assert main(_train(dataset, tmp_path, "--budget", "4steps", "--resume")) == 2
    err = capsys.readouterr().err
    assert "the checkpoint is damaged" in err and f"{newest.name}.damaged" in err and err.count("\n") == 1
    newest.rename(newest.with_name(newest.name + ".damaged"))  # what the sentence says to do
    assert main(_train(dataset, tmp_path, "--budget", "4steps", "--resume")) == 0


def test_a_fractional_step_budget_is_refused():
    from ember.budget import parse_budget

    assert parse_budget("2steps").amount == 2
    with pytest.raises(ConfigError, match="not a whole number of steps"):
        parse_budget("1.5steps")


@pytest.mark.parametrize("began", [False, True])
def test_a_terminated_train_says_whether_there_is_a_run_to_resume(dataset, tmp_path, capsys, monkeypatch, began):
    """Under torchrun, a rank that refuses its input ends the job and its peers are sent
    SIGTERM while still checking theirs: they must not claim a run to resume."""
    import os
    import signal

    import ember.train.trainer as trainer_module

    class Cancelled:
        def __init__(self, *args, **kwargs):
            if not began:
                os.kill(os.getpid(), signal.SIGTERM)

        def run(self):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trainer_module, "Trainer", Cancelled)
    with pytest.raises(SystemExit) as stop:
        main(_train(dataset, tmp_path))
    assert stop.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert ("--resume continues the run" in err) is began
    assert ("training had not begun, so nothing was changed" in err) is not began


HUGE = ["--set", "model.hidden=100000", "--set", "model.mlp_hidden=400000"]  # one weight alone is 40 GB


def test_a_model_too_big_for_memory_is_one_sentence(dataset, tmp_path, capsys):
    assert main(_train(dataset, tmp_path, "--budget", "3steps", *HUGE)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: the model does not fit") and err.count("\n") == 1, err
    assert "GiB available" in err and "parallel.zero=3" in err
    assert not (tmp_path / "run").exists()


def test_the_allocators_own_out_of_memory_is_the_same_sentence(dataset, tmp_path, capsys, monkeypatch):
    import ember.parallel.materialize as materialize

    monkeypatch.setattr(materialize, "available_memory_bytes", lambda device: None)  # free memory not known
    assert main(_train(dataset, tmp_path, "--budget", "3steps", *HUGE)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: the model does not fit") and err.count("\n") == 1, err
    assert "ran out of memory" in err


def test_a_reader_that_goes_away_ends_the_output_quietly(dataset, tmp_path, capsys, monkeypatch):
    """`ember report RUN | head -1`: the closed pipe is not a file the user named."""
    import os
    import signal
    import sys

    run = tmp_path / "run"
    sets = [x for s in TINY for x in ("--set", s)]
    assert main(["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(run),
                 "--budget", "2steps", "--quiet", *sets]) == 0
    capsys.readouterr()
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = os.fdopen(write_end, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", closed)
    code = main(["report", str(run)])
    monkeypatch.undo()
    closed.close()
    assert code == 128 + signal.SIGPIPE
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["plan", "--model", "gpt2-small", "--gpu", "H100", "--inter-bw", "abc"], "argument --inter-bw: invalid float"),
    (["plan", "calibrate", "--out", "p.json", "--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    (["train", "configs/tiny-gpt.toml"], "the following arguments are required: --data, --out"),
])
def test_argument_mistakes_are_one_sentence_too(capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and err.count("\n") == 1 and "usage:" not in err, err
