"""A run checkpointed under one layout resumes under another with the same losses:
sharded checkpoints, loader position and step counter carry over layouts and world sizes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, ember_cmd
from ember.train.checkpoint import list_checkpoints



def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def _train_records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in lines if "loss" in r}


def _launch(nproc, args, settings):
    """`ember train` in one process (nproc 1) or under torchrun, with --set parallel.* values."""
    sets = [x for key, value in settings.items() for x in ("--set", f"parallel.{key}={value}")]
    if nproc == 1:
        return ember_cmd(*args, *sets)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "ember", *args, *sets]


# A batch ramp of 4 to 8 sequences over the first 80% of the steps: its sizes must not
# depend on the layout (one process takes 2 a micro-batch, two data-parallel ranks 4).
RAMP = ["train.global_batch=8", "schedule.batch_start=4", "schedule.batch_ramp=0.8"]
# (objective, processes and layout that saved, processes and layout that resume, other settings)
CASES = [
    ("mlm", 2, {"zero": 3}, 1, {}, []),
    ("causal", 2, {"zero": 3}, 2, {"tp": 2}, []),
    ("causal", 2, {"pp": 2, "schedule": "1f1b"}, 1, {}, []),
    ("mlm", 4, {"zero": 0}, 2, {"zero": 0}, []),
    ("causal", 1, {}, 2, {"zero": 2}, RAMP),
]


@pytest.mark.parametrize("objective,save_n,save_layout,resume_n,resume_layout,extra", CASES,
                         ids=["zero3x2-to-one", "zero3x2-to-tp2", "pp2-to-one", "dp4-to-dp2", "ramp-one-to-zero2x2"])
def test_a_checkpoint_resumes_under_another_layout(dataset, tmp_path, objective, save_n, save_layout,
                                                   resume_n, resume_layout, extra):
    sets = TINY + [f"model.objective={objective}", "model.dropout=0", "train.precision=fp32",
                   "train.device=cpu", "train.checkpoint_every=3steps", "train.eval_every=1000steps",
                   "train.micro_batch=2", "train.checkpoint_async=true", *extra]  # written in the background
    args = ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--budget", "6steps",
            "--quiet", *[x for s in sets for x in ("--set", s)]]
    whole = tmp_path / "whole"
    done = subprocess.run(_launch(save_n, [*args, "--out", str(whole)], save_layout),
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [c.name for c in list_checkpoints(whole)] == ["step_00000003", "step_00000006"]

    # The same run as if it had stopped after step 3, then resumed under the other layout.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    resumed = subprocess.run(_launch(resume_n, [*args, "--out", str(cut), "--resume"], resume_layout),
                             capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stderr
    before, after = _train_records(whole), _train_records(cut)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # same data position, weights and optimizer states: same losses
        assert after[step] == pytest.approx(before[step], rel=1e-5), step
