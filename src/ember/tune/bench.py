"""`ember bench`: where the step time of one layout goes, as a table.

It builds the run exactly as `ember train` would (same recipe, data, --set overrides,
same torchrun launch), trains a few warm-up steps, then times steps twice: plainly, for
the step time and its phases (forward, backward, optimizer), and under the profiler, for
the split into compute, exposed communication and pipeline bubble (train/breakdown.py).
The profiler slows small operators down, so its parts are shown as shares of the
profiled step and the absolute step time comes from the plain steps.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from ember.config import ConfigError

PHASES = [("forward_s", "forward"), ("backward_s", "backward"),
          ("forward_backward_s", "forward + backward"), ("optimizer_s", "optimizer")]
PARTS = [("compute_s", "compute"), ("exposed_comm_s", "exposed communication"),
         ("bubble_s", "pipeline bubble"), ("other_s", "other (host, launches, idle)"),
         ("comm_s", "communication, hidden or not")]


def measure(trainer, steps: int, warmup: int) -> dict:
    """This rank's seconds per step: the plain step, its phases, and the profiled parts."""
    from ember.device import synchronize

    n, lr = trainer.cfg.train.global_batch, trainer.cfg.optim.lr
    for _ in range(warmup):
        trainer.train_step(n, lr)
    synchronize(trainer.device)
    trainer.timer.enabled = True
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(n, lr)
        synchronize(trainer.device)
        plain.append(time.perf_counter() - start)
    phases = trainer.timer.read()
    # Read before profiling: the profiler's own host memory (its event buffers) is not the run's.
    peak_gib, reserved_gib = trainer.peak_memory_gib(), trainer.peak_reserved_gib()
    trainer.timer.enabled, trainer.profiler.enabled = False, True
    profiled = []
    for _ in range(steps):
        start = time.perf_counter()
        with trainer.profiler.step():
            trainer.train_step(n, lr)
        profiled.append(time.perf_counter() - start)
    parts = trainer.profiler.read()
    # The headline is the median step; the phases are totals over the same steps, so their
    # shares are of the mean step (one slow step moves both alike).
    out = {"step_s": statistics.median(plain), "mean_step_s": statistics.mean(plain),
           "profiled_step_s": statistics.mean(profiled)}
    out |= {name: value / steps for name, value in phases.items()}
    out |= {name: value / steps for name, value in parts.items()}
    out["other_s"] = max(0.0, out["profiled_step_s"] - out["compute_s"] - out["exposed_comm_s"] - out["bubble_s"])
    out["peak_memory_gib"] = peak_gib
    out["peak_reserved_gib"] = reserved_gib  # what the prediction's memory_gib compares with
    return out


def predicted(cfg, manifest: dict, world: int, device, profile: str | None) -> dict | None:
    """`ember plan`'s prediction for this very run: with a profile (`ember plan calibrate`),
    or on a GPU the planner's table knows; None otherwise."""
    import os

    from ember.hardware import find_gpu
    from ember.layout import Layout
    from ember.plan.cluster import make_cluster
    from ember.plan.memory import GIB
    from ember.plan.predict import predict
    from ember.plan.stacks import run_stack
    from ember.tune.trials import plan_inputs
    from ember.device import device_name

    gpu = None
    if profile is None:
        known = find_gpu(device_name(device)) if device.type == "cuda" else None
        if known is None:
            return None
        gpu = known.name
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = make_cluster(gpu, world, gpus_per_node=per_node, profile=profile)
    cluster = dataclasses.replace(cluster, stack=run_stack(cluster.stack, cfg, device.type))
    model, shape = plan_inputs(cfg, manifest, "run", device)
    p = predict(model, cluster, shape, Layout.from_config(cfg, world))
    comm = sum(p.shares[k] for k in ("tp_comm", "pp_comm", "dp_comm"))
    out = {"source": profile or gpu, "step_s": p.step_time_s, "tokens_per_s": p.tokens_per_s_per_gpu * world,
           "memory_gib": p.memory.measured_as(device.type) / GIB, "memory_total_gib": p.memory.total / GIB,
           "exposed_comm_share": comm, "bubble_share": p.shares["bubble"]}
    if cluster.gpu.matmul_times is not None or cluster.gpu.attention_times is not None:
        # the profile's measured kernel shapes: also the model's own figure, without them
        plain = dataclasses.replace(cluster.gpu, matmul_times=None, attention_times=None)
        modelled = dataclasses.replace(cluster, gpu=plain)
        out["modelled_kernels_step_s"] = predict(model, modelled, shape, Layout.from_config(cfg, world)).step_time_s
    return out


def run_bench(recipe: str, data: Path, settings: list[str], steps: int, warmup: int,
              profile: str | None = None) -> dict | None:
    """Measure on every rank; rank 0 gets {layout, world, tokens_per_s, ranks: [...],
    predicted}, the other ranks None."""
    from ember.config import load_config
    from ember.train.trainer import Trainer

    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be at least 1 and --warmup at least 0 (got {steps} and {warmup}).")
    cfg = load_config(recipe, settings)
    if profile is not None:
        from ember.plan.cluster import read_profile

        read_profile(profile)  # a bad profile is refused before anything is measured
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as scratch:
        trainer = Trainer(cfg, data, Path(scratch) / "run", progress=False)
        trainer.build()
        mine = measure(trainer, steps, warmup)
        trainer.release()
    ranks = [mine]
    if trainer.world > 1:
        import torch.distributed as dist

        from ember.process import end_process_group

        ranks = [None] * trainer.world
        dist.all_gather_object(ranks, mine)
        end_process_group()
    if trainer.rank != 0:
        return None
    step = max(r["step_s"] for r in ranks)  # the step ends when the slowest rank does
    tokens = cfg.train.global_batch * trainer.seq_len
    # The layout as it ran (dp_shard = -1 resolved to the ranks it took), and the gradient dtype.
    layout = {k: v for k, v in dataclasses.asdict(trainer.parallel).items() if v != ()}
    layout["grad_dtype"] = cfg.parallel.grad_dtype
    return {"recipe": recipe, "layout": layout, "world": trainer.world, "device": str(trainer.device),
            "steps": steps, "warmup": warmup, "step_s": step, "tokens_per_s": tokens / step, "ranks": ranks,
            "predicted": predicted(cfg, trainer.manifest, trainer.world, trainer.device, profile)}


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ranks = result["ranks"]
    layout = " ".join(f"{k}={v}" for k, v in result["layout"].items())
    console = Console()
    console.print(f"{result['recipe']}  {layout}")
    console.print(f"{result['world']} process(es) on {result['device']}: {result['step_s']:.4f} s/step, "
                  f"{result['tokens_per_s']:,.0f} tokens/s, peak memory "
                  f"{max(r['peak_memory_gib'] for r in ranks):.2f} GiB per rank (median of {result['steps']} "
                  f"steps after {result['warmup']} warm-up)")
    table = Table(title="where the step time goes (mean over ranks; min and max rank)")
    for column, justify in [("", "left"), ("s/step", "right"), ("share", "right"),
                            ("min rank", "right"), ("max rank", "right")]:
        table.add_column(column, justify=justify)

    def add(key: str, label: str, whole: str) -> None:
        values = [r[key] for r in ranks if key in r]
        if not values:
            return
        mean = sum(values) / len(values)
        share = mean / (sum(r[whole] for r in ranks) / len(ranks))
        table.add_row(label, f"{mean:.4f}", f"{100 * share:.1f}%", f"{min(values):.4f}", f"{max(values):.4f}")

    for key, label in PHASES:
        add(key, label, "mean_step_s" if all("mean_step_s" in r for r in ranks) else "step_s")
    table.add_section()
    profiled = sum(r["profiled_step_s"] for r in ranks) / len(ranks)
    table.add_row(f"[dim]profiled step ({profiled:.4f} s): shares of it[/dim]", "", "", "", "")
    for key, label in PARTS:
        add(key, label, "profiled_step_s")
    console.print(table)
    if result.get("predicted"):
        render_prediction(result, console)


def render_prediction(result: dict, console) -> None:
    """The planner's prediction for this layout beside what was measured."""
    from rich.table import Table

    p, ranks = result["predicted"], result["ranks"]

    def share(key: str) -> float:
        return sum(r[key] / r["profiled_step_s"] for r in ranks) / len(ranks)

    table = Table(title=f"ember plan's prediction for this layout ({p['source']})")
    for column in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(column, justify="left" if not column else "right")
    rows = [("step time (s)", p["step_s"], result["step_s"]),
            ("tokens/s", p["tokens_per_s"], result["tokens_per_s"]),
            ("memory per rank (GiB)", p["memory_gib"], max(r["peak_reserved_gib"] for r in ranks)),
            ("exposed communication (share)", p["exposed_comm_share"], share("exposed_comm_s")),
            ("pipeline bubble (share)", p["bubble_share"], share("bubble_s"))]
    for label, want, got in rows:
        ratio = f"{got / want:.2f}" if want > 0 else "-"
        table.add_row(label, _number(want), _number(got), ratio)
    console.print(table)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _cmd_bench(args) -> int:
    result = run_bench(args.config, Path(args.data), args.set or [], args.steps, args.warmup, args.profile)
    if result is None:
        return 0
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render(result)
    return 0


def register_bench(verbs) -> None:
    bench = verbs.add_parser("bench", help="where one layout's step time goes (run under torchrun for many GPUs)")
    bench.add_argument("config", help="TOML recipe, e.g. configs/gpt2-small.toml")
    bench.add_argument("--data", required=True, help="folder written by `ember data prepare`")
    bench.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config value")
    bench.add_argument("--steps", type=int, default=10, help="steps measured, plainly and profiled (default 10)")
    bench.add_argument("--warmup", type=int, default=3, help="steps run first and not measured (default 3)")
    bench.add_argument("--profile", help="a machine profile from `ember plan calibrate`: also print the planner's "
                       "prediction for this layout (on a GPU the planner knows, it is printed without one)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bench.set_defaults(func=_cmd_bench)
