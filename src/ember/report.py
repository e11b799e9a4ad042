"""`ember report RUN_DIR`: loss and throughput curves as PNG, and a text summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ember.config import ConfigError
from ember.train.metrics import read_metrics


_TRAIN_KEYS = ("step", "tokens", "loss", "tokens_per_s")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _load(run_dir: Path) -> tuple[list[dict], list[dict]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"{run_dir} has no metrics.jsonl; give the --out folder of an `ember train` run.")
    records = read_metrics(path)
    # Only records of the shape the trainer writes: a damaged or foreign line is left out.
    train = [r for r in records if all(_number(r.get(k)) for k in _TRAIN_KEYS)]
    evals = [r for r in records if _number(r.get("val_loss")) and _number(r.get("tokens"))]
    if not train:
        raise ConfigError(f"{path} holds no logged steps yet; let the run log at least once.")
    return train, evals


def plot(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: reports are made on headless machines
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    train, evals = _load(run_dir)
    summary = _summary_json(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out")
    if summary.get("unigram_entropy"):
        ax.axhline(summary["unigram_entropy"], ls="--", c="gray", label="unigram baseline")
    ax.set(xlabel="tokens", ylabel="loss (nats/token)", title=f"{run_dir.name}: loss")
    ax.legend()
    fig.tight_layout()
    loss_png = run_dir / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], lw=1)
    ax.set(xlabel="step", ylabel="tokens/s", title=f"{run_dir.name}: throughput")
    mfu = [(r["step"], 100 * r["mfu"]) for r in train if r.get("mfu") is not None]
    if mfu:
        twin = ax.twinx()
        twin.plot(*zip(*mfu), c="tab:orange", lw=1)
        twin.set_ylabel("MFU (%)")
    fig.tight_layout()
    speed_png = run_dir / "throughput.png"
    fig.savefig(speed_png, dpi=120)
    plt.close(fig)
    return [loss_png, speed_png]


def _summary_json(run_dir: Path) -> dict:
    """summary.json, or nothing when it is missing or damaged (the metrics still report)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def summary_text(run_dir: Path) -> str:
    train, evals = _load(run_dir)
    summary = _summary_json(run_dir)
    last = train[-1]
    # Skip the first logged window: it carries start-up and compilation.
    steady = [r["tokens_per_s"] for r in train[1:]] or [last["tokens_per_s"]]
    mfus = [r["mfu"] for r in train[1:] if r.get("mfu") is not None]
    lines = [
        f"run        {run_dir}",
        f"status     {summary.get('status', 'running or killed')}",
        f"steps      {last['step']:,}   tokens {last['tokens']:,}"
        + (f"   time {last['elapsed_s']:.0f}s" if _number(last.get("elapsed_s")) else ""),
        f"train loss {last['loss']:.4f}",
    ]
    if evals:
        val = evals[-1]["val_loss"]
        lines.append(f"held-out   {val:.4f} (perplexity {math.exp(min(val, 50)):.1f})")
    if summary.get("unigram_entropy"):
        lines.append(f"unigram    {summary['unigram_entropy']:.4f} (loss of a model that knows only token frequencies)")
    lines.append(f"tokens/s   {sorted(steady)[len(steady) // 2]:,.0f} (median of logged windows)")
    if mfus:
        lines.append(f"MFU        {100 * sorted(mfus)[len(mfus) // 2]:.1f}% (median)")
    names = ("compute", "exposed_comm", "bubble")
    profiled = [r for r in train[1:] if all(_number(r.get(f"{n}_s")) and math.isfinite(r[f"{n}_s"]) for n in names)]
    if profiled:  # runs under torchrun: where the profiled steps' time went
        parts = {name: sum(r[f"{name}_s"] for r in profiled) for name in names}
        lines.append(f"compute    {parts['compute']:.2f}s   exposed communication {parts['exposed_comm']:.2f}s   "
                     f"pipeline bubble {parts['bubble']:.2f}s (over {len(profiled)} profiled steps)")
    return "\n".join(lines)
