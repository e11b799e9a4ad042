"""prepare -> train -> interrupt -> resume, through the real command line."""

import json
import signal
import subprocess
import time

import pytest

from conftest import REPO, TINY, ember_cmd


def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in lines if "loss" in r]
    evals = [(r["step"], r["val_loss"]) for r in lines if "val_loss" in r]
    return train, evals


@pytest.mark.parametrize("objective", ["mlm", "causal"])
def test_interrupted_and_resumed_run_equals_uninterrupted_run(dataset, tmp_path, objective):
    # Dropout on, so that restoring the RNG matters as much as restoring the weights.
    args = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--budget", "300steps",
            "--quiet", *[x for s in TINY + [f"model.objective={objective}", "model.dropout=0.1",
                                             "train.eval_every=25steps"] for x in ("--set", s)]]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(ember_cmd(*args, "--out", str(whole)), check=True, capture_output=True)

    proc = subprocess.Popen(ember_cmd(*args, "--out", str(cut)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 40:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err.decode()
    interrupted_at = len(_losses(cut)[0])
    assert 0 < interrupted_at < 300
    assert not (cut / "model.safetensors").exists()

    done = subprocess.run(ember_cmd(*args, "--out", str(cut), "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stderr
    assert _losses(cut) == _losses(whole)  # bit for bit, evaluations included
    assert (cut / "model.safetensors").exists()


def test_report_writes_plots_and_summary(dataset, tmp_path):
    run = tmp_path / "run"
    args = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(run),
            "--budget", "20steps", "--quiet", *[x for s in TINY + ["train.eval_every=10steps"] for x in ("--set", s)]]
    subprocess.run(ember_cmd(*args), check=True, capture_output=True)
    out = subprocess.run(ember_cmd("report", str(run)), check=True, capture_output=True, text=True).stdout
    assert "held-out" in out and "tokens/s" in out
    assert (run / "tokenizer.json").read_text() == (dataset / "tokenizer.json").read_text()
    for png in ("loss.png", "throughput.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"


def test_a_damaged_metrics_log_or_summary_still_reports_and_resumes(dataset, tmp_path):
    """A crash mid-write leaves a cut last line in metrics.jsonl; damage leaves garbage or a
    broken summary.json. `ember report` reads what is whole, and `--resume` continues."""
    run = tmp_path / "run"
    args = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(run), "--quiet",
            *[x for s in TINY + ["train.checkpoint_every=10steps"] for x in ("--set", s)]]
    subprocess.run(ember_cmd(*args, "--budget", "10steps"), check=True, capture_output=True)
    whole = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(whole + "not json\n" + '{"step": 11, "loss": 2.')
    (run / "summary.json").write_text("{broken")
    report = subprocess.run(ember_cmd("report", str(run)), capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "tokens/s" in report.stdout
    done = subprocess.run(ember_cmd(*args, "--budget", "15steps", "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 15
