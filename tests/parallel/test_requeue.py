"""A job that loses a rank ends, and the same command started again (a Slurm requeue,
`torchrun --max-restarts`) continues from the newest complete checkpoint by itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, TINY
from ember.cli import main


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def _args(dataset, out, budget, *sets):
    return ["train", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--out", str(out),
            "--budget", budget, "--quiet", "--resume",
            *[x for s in TINY + ["train.checkpoint_every=10steps", "train.eval_every=1000steps", *sets]
              for x in ("--set", s)]]


def _steps(out: Path) -> list[int]:
    if not (out / "metrics.jsonl").exists():
        return []
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and '"loss"' in line]


def _children(pid: int) -> list[int]:
    """Every descendant process of `pid` (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def test_resume_with_no_checkpoint_starts_and_says_so(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(dataset, out, "3steps")) == 0
    assert "no checkpoint in" in capsys.readouterr().err
    assert _steps(out) == [1, 2, 3]


def test_a_killed_rank_ends_the_attempt_and_the_restart_continues(dataset, tmp_path):
    """Two ranks under `torchrun --max-restarts=1`; one is killed with SIGKILL after step 25.
    torchrun ends that attempt and starts the same command again, which resumes from the
    step-20 checkpoint and finishes; the log holds every step once, in order."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--monitor-interval=0.5", "-m", "ember", *_args(dataset, out, "60steps", "parallel.zero=1",
                                                            "train.timeout_s=30")]
    # torchrun's agent otherwise shares its store with the workers, and a restarted worker can
    # read the previous attempt's addresses (pytorch/pytorch#135712); docs/launching.md says so.
    env = dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    killed = None
    while time.time() - start < 240 and proc.poll() is None:
        if killed is None and max(_steps(out), default=0) >= 25:
            workers = [p for p in _children(proc.pid) if "ember" in Path(f"/proc/{p}/cmdline").read_text()]
            if workers:
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert killed is not None, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert time.time() - start < 240
    assert "resuming from" in err and "step 20" in err
    assert _steps(out) == list(range(1, 61))
    assert (out / "model.safetensors").exists()


def test_a_spike_on_one_rank_rolls_every_rank_back(dataset, tmp_path):
    """ZeRO-1 x2 under torchrun: only rank 1's weights go bad, the reduced loss is NaN on
    both, both roll back to step 20 and finish."""
    out = tmp_path / "run"
    sets = [f"model.{k}" for k in ()] + TINY + [
        "model.objective=causal", "train.budget=40steps", "train.checkpoint_every=10steps",
        "train.eval_every=1000steps", "parallel.zero=1", "train.device=cpu"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests/parallel/spike_worker.py"), str(dataset), str(out), *sets]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"status": "finished", "calls": 45}] * 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [event] = [r for r in records if r.get("event")]
    assert event["spike_step"] == 25 and event["checkpoint_step"] == 20 and event["action"] == "rollback"
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))
