"""What `ember plan` shows: a ranked table, the reasons the best layout wins, JSON, and the
command that trains with it."""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.table import Table

from ember.layout import ZERO_BUBBLE, Layout, problems
from ember.plan.cluster import Cluster
from ember.plan.layout import TrainShape
from ember.plan.memory import GIB, total_params
from ember.plan.models import MODEL_KEYS
from ember.plan.predict import Prediction
from ember.plan.uncertainty import overlaps


def train_command(prediction: Prediction, model, recipe: str | None, cluster: Cluster, shape: TrainShape,
                  overrides: list[str] = ()) -> str:
    """The torchrun line that trains `model` with the predicted layout (a recipe's own
    `overrides` passed on before the layout's)."""
    per_node = min(cluster.gpus_per_node, cluster.n_gpus)
    parts = ["torchrun", f"--nnodes={cluster.nodes}", f"--nproc-per-node={per_node}"]
    if cluster.nodes > 1:
        parts += ["--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR", "--master-port=29500"]
    parts += ["-m", "ember", "train", recipe or "RECIPE.toml", "--data", "DATA_DIR", "--out", "RUN_DIR"]
    for item in overrides if recipe is not None else ():  # a preset's are in its model.* settings
        parts += ["--set", item]
    settings = dict(prediction.layout.settings(shape.global_batch))
    # A GPU without bf16 tensor cores multiplies 2-byte operands in fp16, at the same rate.
    settings["train.precision"] = "fp16" if shape.precision == "bf16" and not cluster.gpu.bf16 else shape.precision
    settings["parallel.grad_dtype"] = cluster.stack.grad_dtype  # the gradient reduction it priced
    if prediction.layout.pp > 1 and prediction.layout.schedule in ZERO_BUBBLE:
        settings["train.compile"] = "false"  # priced eager: PyTorch cannot compile these stages
    if recipe is None:
        for key in MODEL_KEYS:
            value = getattr(model, key)
            settings[f"model.{key}"] = str(value).lower() if isinstance(value, bool) else value
        settings["model.max_seq_len"] = max(model.max_seq_len, shape.seq_len)
    elif shape.seq_len > model.max_seq_len:
        settings["model.max_seq_len"] = shape.seq_len
    for key, value in settings.items():
        parts += ["--set", f"{key}={value}"]
    return " ".join(p if p.startswith("$") or "=$" in p else shlex.quote(p) for p in parts)


def command_notes(model, recipe: str | None, layout: Layout | None = None,
                  shape: TrainShape | None = None, command: bool = True) -> list[str]:
    """Notes under a printed train command (`command`: whether one is printed)."""
    notes = []
    if layout is not None and shape is not None:
        # What only ember's trainer refuses (other frameworks run it, and the planner prices it).
        elsewhere = set(problems(layout, model, shape.global_batch, ember=False))
        notes += [f"ember's trainer refuses this layout: {reason}." for reason in
                  problems(layout, model, shape.global_batch, ember=True) if reason not in elsewhere]
    if model.positions == "alibi":
        notes.append(f"{model.name} uses ALiBi positions, which ember's model does not implement yet.")
    if recipe is None and command:
        notes.append("RECIPE.toml stands for any recipe: the --set model.* overrides give the preset's shape.")
    return notes


def parameter_count(n: int) -> str:
    """A model's size as people quote it: 7.25 B, 124.4 M; a tiny model's whole count
    (0.00 B would say nothing)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,.0f}"


def header(model, cluster: Cluster, shape: TrainShape) -> str:
    return (f"{model.name}: {parameter_count(total_params(model))} parameters, {model.layers} layers x {model.hidden} "
            f"hidden, {model.heads} heads" + (f" ({model.kv_heads} kv)" if model.kv_heads != model.heads else "")
            + f"\n{cluster.describe()}\nsequence {shape.seq_len}, global batch {shape.global_batch} sequences "
            f"({shape.tokens:,} tokens), {shape.precision}; {cluster.stack.attention} attention, "
            f"{cluster.stack.grad_dtype} gradients; profile: {cluster.source}"
            + _measured(cluster))


def _measured(cluster: Cluster) -> str:
    gpu = cluster.gpu
    counts = [f"{len(table)} {kind} shapes" for kind, table in (("matmul", gpu.matmul_times),
                                                                  ("attention", gpu.attention_times)) if table]
    notes = [f"{' and '.join(counts)} measured"] if counts else []
    if cluster.stack.elementwise_scale != 1.0:
        notes.append(f"the blocks' elementwise work at {cluster.stack.elementwise_scale:.2f}x its model, as measured")
    return f" ({'; '.join(notes)})" if notes else ""


def table(predictions: list[Prediction]) -> Table:
    out = Table(header_style="bold")
    with_cp = any(p.layout.cp > 1 for p in predictions)  # a column only where it says something
    for name in ("#", "tp", "sp") + (("cp",) if with_cp else ()) + (
            "pp", "vpp", "dp", "zero", "mbs", "recompute", "step s", "tok/s/GPU",
            "TFLOP/s", "MFU", "MFU range", "GiB", "states+act+other", "comm", "bubble"):
        out.add_column(name, justify="left" if name in ("recompute",) else "right", no_wrap=True)
    for i, p in enumerate(predictions, 1):
        lo, mem = p.layout, p.memory
        states = (mem.weights + mem.grads + mem.optimizer) / GIB
        acts = (mem.activations + mem.logits) / GIB
        other = (mem.buffers + mem.runtime + mem.fragmentation - mem.shared) / GIB
        comm = p.shares["tp_comm"] + p.shares["pp_comm"] + p.shares["dp_comm"]
        size = f"{mem.total / GIB:.1f}" if p.fits else f"[red]{mem.total / GIB:.1f}[/red]"
        dp = str(lo.dp) if lo.dp_replicate == 1 or lo.zero == 0 else f"{lo.dp_replicate}x{lo.dp_shard}"
        pp = str(lo.pp) + ("" if lo.pp == 1 or lo.schedule == "1f1b" else f" {lo.schedule}")
        recompute = lo.recompute + (f" every {lo.recompute_every}" if lo.recompute_every > 1 else "")
        out.add_row(str(i), str(lo.tp), "y" if lo.sp else "", *([str(lo.cp)] if with_cp else []), pp,
                    str(lo.vpp) if lo.vpp > 1 else "", dp,
                    str(lo.zero), str(lo.micro_batch), recompute, f"{p.step_time_s:.3g}",
                    f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.tflops_per_gpu:.0f}", f"{100 * p.mfu:.1f}%", _range(p), size,
                    f"{states:.1f}+{acts:.1f}+{other:.1f}", f"{100 * comm:.1f}%", f"{100 * p.shares['bubble']:.1f}%")
    return out


def _range(p: Prediction) -> str:
    if not p.interval:
        return ""
    lo, hi = p.interval["mfu"]
    return f"{100 * lo:.0f}-{100 * hi:.0f}%" + ("!" if p.interval["above_published"] else "")


def ties(ranked: list[Prediction]) -> int:
    """How many layouts, the best included, lie within each other's interval with the best:
    the planner cannot order them, a measurement can."""
    if not ranked or not ranked[0].interval:
        return len(ranked[:1])
    return 1 + sum(p.fits and overlaps(ranked[0].interval, p.interval) for p in ranked[1:])


def interval_notes(ranked: list[Prediction]) -> list[str]:
    """What the intervals say about the ranking: near ties, and predictions beyond what
    published runs reached."""
    notes = []
    if not ranked or not ranked[0].interval:
        return notes
    best = ranked[0]
    lo, hi = best.interval["mfu"]
    if best.interval.get("note"):
        notes.append(best.interval["note"] + f"; expect {100 * lo:.0f}-{100 * hi:.0f}% MFU ('!' in the table).")
    if best.interval.get("kind") == "crossover":
        notes.append("the best layout's kernel launches take about as long as its GPU work, where measured steps "
                     "spread widest (an eager host cost priced as a soft maximum); a larger micro-batch, CUDA "
                     "graphs or torch.compile move a run off it.")
    if best.layout.pp > 1 and best.layout.schedule in ZERO_BUBBLE:
        notes.append("no published run used a zero-bubble schedule: the best layout's interval is the error of the "
                     "other pipeline schedules, and its time (PyTorch's action order, simulated) has been measured "
                     "on CPUs only; confirm it against interleaved and 1f1b with `ember tune`.")
    close = ties(ranked)
    if close > 1:
        notes.append(f"{close} layouts are within the best's interval ({100 * lo:.0f}-{100 * hi:.0f}% MFU, the "
                     "10th-90th percentile of the planner's error on published runs of its kind): the ranking "
                     "cannot tell them apart; measure the top few with `ember tune`.")
    return notes


def _seconds(p: Prediction) -> dict[str, float]:
    parts = {k: v * p.step_time_s for k, v in p.shares.items()}
    parts["recompute"] = p.detail["recompute_s"]
    parts["compute"] -= parts["recompute"]
    parts["imbalance"] = p.detail["stage_imbalance"] * p.step_time_s
    parts["compute"] -= parts["imbalance"] if p.layout.pp > 1 else 0.0
    return parts


_WHAT = {"compute": "compute (matmul shapes, attention, elementwise)", "recompute": "recomputation",
         "tp_comm": "tensor-parallel communication", "pp_comm": "pipeline sends",
         "dp_comm": "data-parallel/ZeRO communication", "bubble": "pipeline fill and drain",
         "imbalance": "waiting on the slowest stage (embedding/output layer)", "optimizer": "optimizer step"}


def explain(best: Prediction, others: list[Prediction], too_big: Prediction | None = None) -> str:
    """Why `best` beats each of `others`: the per-step seconds that differ most, largest first."""
    lines = [f"Best: {best.layout.text()}: {best.step_time_s:.3g} s/step, {100 * best.mfu:.1f}% MFU, "
             f"{best.memory.total / GIB:.1f} of {best.memory.capacity / GIB:.0f} GiB."]
    mine = _seconds(best)
    for other in others:
        theirs = _seconds(other)
        gap = other.step_time_s / best.step_time_s - 1
        pace = f"{100 * gap:.1f}% slower" if gap >= 0 else f"{-100 * gap:.1f}% faster"
        room = "" if other.fits else f" of {other.memory.capacity / GIB:.0f}: does not fit"
        lines.append(f"vs {other.layout.text()} ({pace}, {other.memory.total / GIB:.1f} GiB{room}):")
        deltas = sorted(((theirs[k] - mine[k], k) for k in mine), key=lambda d: -abs(d[0]))
        if abs(deltas[0][0]) < 0.002 * best.step_time_s:
            saved = (other.memory.total - best.memory.total) / GIB
            lines.append(f"  every part of the step is within 0.2% of the best's: a near tie "
                         f"({abs(saved):.1f} GiB {'more' if saved > 0 else 'less'} memory).")
        for delta, key in deltas[:3]:
            if abs(delta) < 0.002 * best.step_time_s:
                break
            sign = "more" if delta > 0 else "less"
            lines.append(f"  {abs(delta):.3g} s {sign} {_WHAT[key]} "
                         f"({100 * theirs[key] / other.step_time_s:.1f}% of its step "
                         f"vs {100 * mine[key] / best.step_time_s:.1f}%)")
    if too_big is not None and too_big.step_time_s < best.step_time_s:
        lines.append(f"Faster but too big: {too_big.layout.text()} would take {too_big.step_time_s:.3g} s/step but "
                     f"needs {too_big.memory.total / GIB:.1f} GiB of {too_big.memory.capacity / GIB:.0f}.")
    return "\n".join(lines)


def memory_line(p: Prediction) -> str:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in p.memory.parts_gib().items() if abs(v) >= 0.05)
    return (f"memory on pipeline stage {p.memory.stage}: {p.memory.total / GIB:.1f} GiB of "
            f"{p.memory.capacity / GIB:.1f} ({parts})" + ("" if p.fits else "  DOES NOT FIT"))


def print_text(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)
