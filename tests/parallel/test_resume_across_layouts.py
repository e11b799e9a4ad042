"""A run checkpointed by two processes (ZeRO-3) resumes in one process with the same
losses: sharded checkpoints, loader position and step counter carry over layouts."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, ember_cmd
from ember.train.checkpoint import list_checkpoints
from ember.train.saving import sharded_available

pytestmark = pytest.mark.skipif(not sharded_available(), reason="this build has no sharded checkpoints")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def _train_records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in lines if "loss" in r}


@pytest.mark.parametrize("objective", ["mlm"])
def test_zero3_checkpoint_resumes_in_one_process(dataset, tmp_path, objective):
    sets = TINY + [f"model.objective={objective}", "model.dropout=0", "train.precision=fp32",
                   "train.device=cpu", "train.checkpoint_every=3steps", "train.eval_every=1000steps"]
    args = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--budget", "6steps",
            "--quiet", *[x for s in sets for x in ("--set", s)]]
    whole = tmp_path / "whole"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ember",
           *args, "--out", str(whole), "--set", "parallel.zero=3"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [c.name for c in list_checkpoints(whole)] == ["step_00000003", "step_00000006"]

    # The same run as if it had stopped after step 3, then resumed by one process.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    resumed = subprocess.run(ember_cmd(*args, "--out", str(cut), "--resume"), capture_output=True, text=True,
                             env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stderr
    before, after = _train_records(whole), _train_records(cut)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert after[step] == pytest.approx(before[step], rel=1e-5), step
