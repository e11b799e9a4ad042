"""`ember train` under torchrun through the real command line, and a layout that cannot
run refused before any process group or model exists."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_model

from conftest import REPO, TINY, ember_cmd
from ember.config import load_config
from ember.model import Transformer


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def _args(dataset, out, *sets):
    return ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(out),
            "--budget", "4steps", "--quiet",
            *[x for s in TINY + ["train.eval_every=2steps", *sets] for x in ("--set", s)]]


def test_torchrun_two_processes_writes_one_run(dataset, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ember",
           *_args(dataset, out, "parallel.zero=2", "train.breakdown=on")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("finished after 4 steps") == 1  # the summary from rank 0 only
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    for r in (r for r in records if "loss" in r):  # every step is logged, so every step is timed
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["forward_s"] + r["backward_s"] <= r["forward_backward_s"]
        # train.breakdown=on profiles every logged step: ZeRO-2 reduce-scatters gradients.
        assert r["compute_s"] > 0 and r["comm_s"] > 0 and 0 <= r["exposed_comm_s"] <= r["comm_s"]
        assert r["bubble_s"] == 0  # no pipeline, no point-to-point transfers
    report = subprocess.run(ember_cmd("report", str(out)), capture_output=True, text=True, env=_env(), timeout=120)
    assert report.returncode == 0 and "exposed communication" in report.stdout and "over 3 profiled steps" in report.stdout
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_size"] == 2 and summary["peak_memory_gib"] > 0
    assert summary["peak_reserved_gib"] >= summary["peak_memory_gib"]
    # The final model gathered from both shards loads into the plain model and scores
    # the logged held-out loss again.
    cfg = load_config(out / "config.toml")
    model = Transformer(cfg.model)
    load_model(model, str(out / "model.safetensors"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not (out / "model.safetensors.tmp").exists()


def test_a_layout_that_cannot_run_is_refused_before_anything_starts(dataset, tmp_path):
    # WORLD_SIZE as torchrun sets it; the master address points nowhere, so reaching the
    # process group would hang or fail with a traceback, not exit 2 with a sentence.
    env = dict(_env(), WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    done = subprocess.run(ember_cmd(*_args(dataset, tmp_path / "run", "parallel.dp_shard=4")),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error: the layout pp x dp_replicate x dp_shard x tp")
    assert "world size 2" in lines[0]
    assert not (tmp_path / "run").exists()
