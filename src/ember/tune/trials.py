"""`ember tune`: confirm the planner's best layouts on this machine with short runs.

The planner ranks every layout of the recipe's model for N local processes (the cluster is
this machine: a calibrated profile, or the GPU table's row for the local GPU); the top K that
fit each train for a few steps under `torchrun --standalone --nproc-per-node N`, in a
subprocess with a timeout. Each trial's throughput comes from its metrics.jsonl (the first
logged steps are warm-up and skipped), its peak memory from summary.json's
`peak_memory_gib`, or else from the operating system's peak resident set size of the
largest process (a CPU's "device memory"). A trial that fails (out of memory, a crash, a
timeout) is reported with its reason; the fastest trial that finished is the winner, written
as a recipe (the recipe with its [parallel] section and train.micro_batch set).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ember.config import Config, ConfigError, load_config, to_toml
from ember.layout import run_problems
from ember.plan.cluster import Cluster, make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import ModelSpec, from_config
from ember.plan.predict import Prediction

GIB = 2**30
# Keys every trial sets so that it measures steps, not evaluation or checkpoints.
TRIAL_SETTINGS = {"train.log_every": 1, "train.eval_every": "1000000steps", "train.eval_batches": 1,
                  "train.checkpoint_every": "1000000steps", "train.breakdown": "off"}


def plan_inputs(config: Config, manifest: dict, name: str, device=None) -> tuple[ModelSpec, TrainShape]:
    """The planner's model and training shape for a recipe trained on prepared data: the data
    fixes the sequence length, and the vocabulary where the recipe leaves it to the data; the
    recipe's precision on `device` (default: the one it would train on) fixes the element
    size (fp32 without autocast, as on a CPU; fp16 or bf16 otherwise, priced alike)."""
    from ember.device import autocast_dtype, pick_device, precision_name

    model = config.model
    if model.vocab_size <= 0:
        model = dataclasses.replace(model, vocab_size=int(manifest["vocab_size"]))
    spec = from_config(model, name, config.data.mlm_rate)
    device = pick_device(config.train.device) if device is None else device
    precision = precision_name(autocast_dtype(config.train.precision, device))
    return spec, TrainShape(int(manifest["seq_len"]), config.train.global_batch, precision)


def local_cluster(nproc: int, profile: str | Path | None) -> Cluster:
    """This machine as a planner cluster of `nproc` processes on one node."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, not {nproc}.")
    if profile is not None:
        return make_cluster(None, nproc, gpus_per_node=nproc, profile=profile)
    import torch

    from ember.hardware import find_gpu

    if not torch.cuda.is_available():
        raise ConfigError("this machine has no GPU the planner knows; measure it with "
                          "`ember plan calibrate --out profile.json` and pass --profile profile.json.")
    if nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc} asks for more processes than the {torch.cuda.device_count()} GPUs here.")
    name = torch.cuda.get_device_name(0)
    gpu = find_gpu(name)
    if gpu is None:
        raise ConfigError(f"{name} is not in the GPU table; measure it with `ember plan calibrate "
                          "--out profile.json` and pass --profile profile.json.")
    return make_cluster(gpu.name, nproc, gpus_per_node=nproc)


def select(ranked: list[Prediction], top: int, config: Config, nproc: int,
           seq_len: int, device_type: str | None = None) -> tuple[list[Prediction], int]:
    """The first `top` fitting layouts the recipe can train on `nproc` processes (the
    trainer's own rules, with the recipe's compile, document mask and batch ramp), and how
    many better-ranked ones were passed over because it cannot."""
    chosen, passed = [], 0
    for prediction in ranked:
        if len(chosen) == top:
            break
        if run_problems(prediction.layout, config, nproc, seq_len, device_type):
            passed += 1
            continue
        chosen.append(prediction)
    return chosen, passed


def trial_command(config: str | Path, data: str | Path, run_dir: Path, nproc: int, steps: int,
                  settings: dict[str, object], overrides: list[str] = ()) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m ember train ...` for one trial, with the
    user's own --set overrides first and the layout's and the trial's after them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "ember", "train", str(config), "--data", str(data), "--out", str(run_dir),
           "--budget", f"{steps}steps", "--quiet"]
    for item in list(overrides) + [f"{k}={v}" for k, v in {**settings, **TRIAL_SETTINGS}.items()]:
        cmd += ["--set", item]
    return cmd


def measured_throughput(records: list[dict], warmup: int) -> tuple[float | None, int]:
    """Tokens/s over the logged training steps after the first `warmup` (total tokens over
    total seconds, so slow steps weigh as much as they cost), and how many steps that covers."""
    steps = [r for r in records if "tokens_per_s" in r and r.get("tokens_per_s")]
    if len(steps) > warmup:
        steps_before = steps[warmup - 1]["tokens"] if warmup > 0 else 0
        kept = steps[warmup:]
    else:  # too few steps to skip any: better a warm figure than none
        steps_before, kept = 0, steps
    if not kept:
        return None, 0
    tokens, seconds, previous = 0, 0.0, steps_before
    for r in kept:
        window = r["tokens"] - previous
        previous = r["tokens"]
        tokens += window
        seconds += window / r["tokens_per_s"]
    return tokens / seconds, len(kept)


def read_trial(run_dir: Path, warmup: int) -> dict:
    """tokens/s, the steps it covers and peak memory (GiB, None if not reported) of a run."""
    from ember.train.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    tokens_per_s, steps = measured_throughput(records, warmup)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"tokens_per_s": tokens_per_s, "measured_steps": steps,
            # The peak as the planner predicts it (the allocator's reservation on a GPU).
            "peak_memory_gib": summary.get("peak_reserved_gib", summary.get("peak_memory_gib")),
            "status": summary.get("status")}


_OOM = re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|std::bad_alloc|MemoryError"
                  r"|Signal 9 \(SIGKILL\)", re.I)


def failure_reason(returncode: int | None, log: str, timed_out: bool, timeout: float) -> str:
    """One line saying why a trial did not finish."""
    if timed_out:
        return f"timed out after {timeout:g} s"
    if _OOM.search(log) or returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "out of memory"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(ember: error:|\w+(\.\w+)*(Error|Exception)\b)", ln)]
    last = errors[0] if errors else (lines[-1] if lines else "no output")
    return f"exit status {returncode}: {last[:200]}"


def run_process(cmd: list[str], log_path: Path, timeout: float) -> tuple[int | None, bool, float | None]:
    """Run `cmd` in its own process group with its output in `log_path`; returns (exit status,
    whether it timed out, the peak resident set size in GiB of its largest process)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    status, usage, timed_out = None, None, False
    try:
        while status is None:
            if hasattr(os, "wait4"):
                pid, raw, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    status = os.waitstatus_to_exitcode(raw)
                    proc.returncode = status  # reaped here; keep Popen from waiting again
                    break
            else:
                status = proc.poll()
                if status is not None:
                    break
            if time.monotonic() > deadline:
                timed_out = True
                status = _stop(proc)
                break
            time.sleep(0.1)
    except BaseException:  # Ctrl-C: the trial has its own session, so end it here
        _stop(proc)
        raise
    rss = None
    if usage is not None and usage.ru_maxrss:
        # Linux reports kibibytes, macOS bytes; this counts the largest process, which under
        # torchrun is one worker: the per-rank figure the planner predicts.
        rss = usage.ru_maxrss / (GIB if sys.platform == "darwin" else 2**20)
    return status, timed_out, rss


def _stop(proc: subprocess.Popen) -> int | None:
    """End a trial's whole process group (torchrun and its workers): SIGTERM lets the
    trainer stop cleanly; whatever is left after 10 s is killed."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


@dataclass
class Trial:
    index: int
    prediction: Prediction
    command: list[str]
    run_dir: Path
    settings: dict  # the layout's --set keys
    planner_rank: int | None = None  # its place in the planner's ranking of every fitting layout (None: does not fit)
    status: str = "pending"  # finished, failed, not run
    reason: str = ""
    tokens_per_s: float | None = None
    measured_steps: int = 0
    peak_memory_gib: float | None = None
    memory_source: str = ""  # "trainer" (summary.json) or "rss" (the OS's peak resident set)
    device_type: str = "cpu"  # where the trial ran: which part of the predicted memory it measures
    seconds: float = 0.0

    @property
    def predicted_memory_gib(self) -> float:
        """The predicted peak this trial's measurement compares with (plan.memory.Memory.measured_as)."""
        return self.prediction.memory.measured_as(self.device_type) / GIB

    def to_dict(self, n_gpus: int) -> dict:
        p = self.prediction
        return {"trial": self.index, "layout": p.layout.text(), "planner_rank": self.planner_rank,
                "status": self.status, "reason": self.reason,
                "predicted": {"tokens_per_s": p.tokens_per_s_per_gpu * n_gpus, "step_time_s": p.step_time_s,
                              "memory_gib_per_gpu": self.predicted_memory_gib},
                "measured": {"tokens_per_s": self.tokens_per_s, "steps": self.measured_steps,
                             "peak_memory_gib": self.peak_memory_gib, "memory_source": self.memory_source},
                "seconds": self.seconds, "run_dir": str(self.run_dir), "command": self.command}


def run_trial(trial: Trial, timeout: float, warmup: int, host_memory: bool = True) -> Trial:
    """Run one trial and fill in what it measured. `host_memory`: the device is the CPU, so
    the peak resident set stands in for device memory where the trainer does not report it."""
    log_path = trial.run_dir.with_name(trial.run_dir.name + ".log")
    start = time.monotonic()
    status, timed_out, rss = run_process(trial.command, log_path, timeout)
    trial.seconds = time.monotonic() - start
    trial.device_type = "cpu" if host_memory else "cuda"
    result = read_trial(trial.run_dir, warmup)
    trial.tokens_per_s, trial.measured_steps = result["tokens_per_s"], result["measured_steps"]
    if result["peak_memory_gib"] is not None:
        trial.peak_memory_gib, trial.memory_source = result["peak_memory_gib"], "trainer"
    elif rss is not None and host_memory and trial.tokens_per_s is not None:  # not a run that never trained
        trial.peak_memory_gib, trial.memory_source = rss, "rss"
    if status == 0 and not timed_out and trial.tokens_per_s is not None:
        trial.status = "finished"
    else:
        trial.status = "failed"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        trial.reason = failure_reason(status, log, timed_out, timeout) if status != 0 or timed_out \
            else "finished without logging a training step"
    return trial


def best_recipe(config_path: str | Path, overrides: list[str], settings: dict[str, object]) -> str:
    """The recipe with the user's overrides and the winning layout, as TOML (validated by
    loading it back the way `ember train` will)."""
    config = load_config(config_path, list(overrides) + [f"{k}={v}" for k, v in settings.items()])
    return to_toml(config)



