"""`ember tune` from the command line: plan, run the top layouts, show predicted against
measured, write the winner."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ember.config import ConfigError

EPILOG = """examples:
  ember plan calibrate --out cpu.json --quick
  ember tune configs/tiny-gpt.toml --data data/tiny --nproc 1 --profile cpu.json --top 2 --steps 5 --out tune-cpu
  ember tune configs/gpt2-small.toml --data data/owt --nproc 8 --top 4 --steps 30 --out tune-8xh100
  ember tune configs/gpt2-small.toml --data data/owt --nproc 8 --out tune-mine \\
      --layout dp=8,zero=1,mbs=16 --layout tp=2,sp=1,dp=4,zero=1,mbs=16"""


def register_tune(verbs) -> None:
    tune = verbs.add_parser("tune", help="run the planner's best layouts for a few steps and keep the fastest",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("config", help="TOML recipe")
    tune.add_argument("--data", required=True, help="folder written by `ember data prepare`")
    tune.add_argument("--nproc", type=int, required=True, help="processes (GPUs) on this machine")
    tune.add_argument("--profile", help="profile file of this machine (`ember plan calibrate`); "
                                        "default: the GPU table's row for the local GPU")
    tune.add_argument("--top", type=int, default=3, help="layouts to try (default 3)")
    tune.add_argument("--layout", action="append",
                      help="try this layout (as `ember plan --layout` writes it) instead of the planner's top; "
                           "repeat it for each candidate")
    tune.add_argument("--steps", type=int, default=10, help="training steps per trial (default 10)")
    tune.add_argument("--warmup", type=int, default=2, help="logged steps skipped before measuring (default 2)")
    tune.add_argument("--timeout", type=float, default=900.0, help="seconds a trial may take (default 900)")
    tune.add_argument("--out", default="tune", help="folder for the trials, best.toml and tune.json")
    tune.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one recipe value, for planning and every trial")
    tune.add_argument("--dry-run", action="store_true", help="print the trials' commands, run nothing")
    tune.set_defaults(func=run_tune)


def _check_args(args) -> None:
    for name in ("nproc", "top", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, not {getattr(args, name)}.")
    if args.warmup < 0 or not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ConfigError("--warmup must be 0 or more and --timeout a positive, finite number of seconds.")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never a folder with anything in it
        raise ConfigError(f"--out {out} already exists and is not an empty folder; choose a new one.")
    if args.warmup >= args.steps:  # the warm-up steps are part of a trial's --steps and not measured
        raise ConfigError(f"--warmup ({args.warmup}) must be less than --steps ({args.steps}): a trial measures "
                          "the steps after its warm-up.")


def plan_trials(args):
    """Everything before running: the recipe, data, cluster, ranked layouts and the trials."""
    import torch

    from ember.config import load_config
    from ember.data import load_manifest
    from ember.plan.search import search
    from ember.plan.stacks import run_stack
    from ember.tune.trials import Trial, local_cluster, plan_inputs, select, trial_command

    from ember.layout import layout_keys, run_problems
    from ember.plan.report import ties
    from ember.train.setup import check_data_fits, resolve

    _check_args(args)
    for item in args.set:
        key = item.partition("=")[0].strip()
        if key in layout_keys():
            raise ConfigError(f"--set {item}: ember tune chooses {key} for each trial; leave it out, or give it "
                              "inside the layouts to measure (--layout tp=2,mbs=4,...).")
    # Each trial sets its own train.micro_batch, and run_problems holds that one against the
    # global batch; the recipe's would refuse a global batch the trials can train.
    config = load_config(args.config, args.set + ["train.micro_batch=1"])
    manifest = load_manifest(Path(args.data))
    check_data_fits(config, manifest)  # what every trial would refuse, refused once, before any runs
    config = resolve(config, manifest)
    cluster = local_cluster(args.nproc, args.profile)
    if cluster.stack.name != "ember":  # the trials run ember's trainer, so its predictions must price it
        raise ConfigError(f"--profile {args.profile} prices --stack {cluster.stack.name}; ember tune measures "
                          "ember's trainer, so give it a profile whose stack.name is ember.")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cluster = replace(cluster, stack=run_stack(cluster.stack, config, device_type))  # as the trials will run
    model, shape = plan_inputs(config, manifest, Path(args.config).stem)
    result = search(model, cluster, shape)
    if not result.ranked:
        leanest = min(result.too_big, key=lambda p: p.memory.total)
        raise ConfigError(f"no layout of {model.name} fits in {cluster.gpu.memory_gib:g} GiB per process on "
                          f"{args.nproc}; the leanest ({leanest.layout.text()}) needs "
                          f"{leanest.memory.total / 2**30:.1f} GiB.")
    # The layouts --top can reach: those the recipe can train here, in the planner's order.
    trainable = [p for p in result.ranked if not run_problems(p.layout, config, args.nproc, shape.seq_len, device_type)]
    close = ties(trainable)
    if args.layout:
        chosen, passed = _given(args.layout, model, cluster, shape, config, args.nproc, device_type), 0
    else:
        chosen, passed = select(result.ranked, args.top, config, args.nproc, shape.seq_len, device_type)
    if not chosen:
        raise ConfigError(f"none of the {len(result.ranked)} layouts that fit can train this recipe "
                          f"(e.g. {result.ranked[0].layout.text()}); check its [parallel]-related settings.")
    out = Path(args.out)
    trials = []
    planner_rank = {p.layout: i for i, p in enumerate(result.ranked, 1)}  # a given layout is predicted anew
    for i, prediction in enumerate(chosen, 1):
        run_dir = out / f"trial-{i}"
        settings = prediction.layout.settings(shape.global_batch)
        command = trial_command(args.config, args.data, run_dir, args.nproc, args.steps, settings, args.set)
        trials.append(Trial(i, prediction, command, run_dir, settings,
                            planner_rank=planner_rank.get(prediction.layout)))
    return config, cluster, model, shape, result, trials, passed, close


def _given(texts: list[str], model, cluster, shape, config, nproc: int, device_type: str):
    """The layouts a user named, each one the recipe can train here, predicted and in the
    planner's order; the first that cannot is refused before anything runs."""
    from ember.layout import run_problems
    from ember.plan.layout import parse_layout
    from ember.plan.search import rank

    layouts = list(dict.fromkeys(parse_layout(text, nproc) for text in texts))  # each measured once
    for layout in layouts:
        found = run_problems(layout, config, nproc, shape.seq_len, device_type)
        if found:
            raise ConfigError(f"layout {layout.text()} cannot train this recipe on {nproc} processes: {found[0]}.")
    return rank(model, cluster, shape, layouts)


def run_tune(args) -> int:
    import torch

    from ember.plan.cluster import read_profile
    from ember.plan.report import print_text
    from ember.atomic import write_text
    from ember.process import sigterm_unwinds
    from ember.tune.trials import best_recipe, run_trial

    config, cluster, model, shape, result, trials, passed, close = plan_trials(args)
    out = Path(args.out)
    console = Console() if Console().is_terminal else Console(width=140)
    skipped = f" ({passed} better-ranked cannot train this recipe and were passed over)" if passed else ""
    trying = f"trying the {len(trials)} given" if args.layout else f"trying the top {len(trials)}{skipped}"
    print_text(console, f"{model.name} on {cluster.describe()}; profile: {cluster.source}\n"
                        f"{len(result.ranked):,} of {result.considered:,} layouts fit; {trying}")
    measured_with = read_profile(args.profile)[1].gpus_per_node if args.profile else args.nproc
    if measured_with != args.nproc and cluster.gpu.name.startswith("cpu"):
        # A CPU's processes share its cores and memory: what one measured alone, two do not get each.
        print_text(console, f"note: {args.profile} was measured with {measured_with} process"
                            f"{'es' * (measured_with > 1)} on this machine, not {args.nproc}; for predictions of "
                            f"these trials calibrate under `torchrun --nproc-per-node {args.nproc}`.")
    if close > len(trials) and not args.layout:  # on the public runs, the measured best was always among these
        print_text(console, f"note: {close} layouts lie within the best's predicted interval, so the planner "
                            f"cannot order them; --top {close} measures them all.")
    if args.dry_run:
        for t in trials:
            print_text(console, f"trial {t.index}: {t.prediction.layout.text()}\n  " + shlex.join(t.command))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    stopped = None
    # SIGTERM (a scheduler's cancel) unwinds like Ctrl-C: the running trial is ended and
    # what the finished ones measured is written.
    try:
        with sigterm_unwinds():
            for t in trials:
                print_text(console, f"trial {t.index}/{len(trials)}: {t.prediction.layout.text()} ...")
                run_trial(t, args.timeout, args.warmup, host_memory=not torch.cuda.is_available())
                done = (f"{t.tokens_per_s:,.0f} tokens/s" if t.status == "finished" else f"failed: {t.reason}")
                print_text(console, f"  {done} ({t.seconds:.0f} s; log {t.run_dir.name}.log)")
    except (KeyboardInterrupt, SystemExit) as stop:
        stopped = stop.code if isinstance(stop, SystemExit) else 128 + signal.SIGINT
        for t in trials:
            if t.status == "pending":
                t.status, t.reason = "not run", "the tuning was stopped"
    finished = sorted((t for t in trials if t.status == "finished"), key=lambda t: -t.tokens_per_s)
    console.print(table(trials, finished, cluster.n_gpus))
    report = {"model": model.to_dict(), "cluster": cluster.profile() | {"n_gpus": cluster.n_gpus},
              "shape": {"seq_len": shape.seq_len, "global_batch": shape.global_batch},
              "steps": args.steps, "warmup": args.warmup, "layouts_fitting": len(result.ranked),
              "passed_over": passed, "within_interval_of_best": close,
              "trials": [t.to_dict(cluster.n_gpus) for t in trials], "best": None}
    if finished:
        best = finished[0]
        write_text(out / "best.toml", f"# ember tune: {best.prediction.layout.text()}, "
                     f"{best.tokens_per_s:,.0f} tokens/s measured on {cluster.describe()}\n"
                     + best_recipe(args.config, args.set, best.settings))
        report["best"] = {"trial": best.index, "layout": best.prediction.layout.text(),
                          "recipe": str(out / "best.toml")}
    write_text(out / "tune.json", json.dumps(report, indent=2) + "\n")
    if stopped is not None:
        print_text(console, f"stopped; what the finished trials measured is in {out / 'tune.json'}")
        return stopped
    if not finished:
        print_text(console, f"no trial finished; see the logs in {out} (wrote {out / 'tune.json'})")
        return 1
    print_text(console, f"best: trial {best.index} ({best.prediction.layout.text()}); wrote {out / 'best.toml'} "
                        f"and {out / 'tune.json'}\ntrain with it: torchrun --standalone --nproc-per-node "
                        f"{args.nproc} -m ember train {out / 'best.toml'} --data {args.data} --out RUN_DIR")
    return 0


def table(trials, finished, n_gpus: int) -> Table:
    """Predicted against measured: tokens/s for all processes together, memory per process,
    and the rank each gives (the planner's order is the trials' order)."""
    measured_rank = {t.index: i for i, t in enumerate(finished, 1)}
    out = Table(header_style="bold")
    for name in ("#", "layout", "pred tok/s", "meas tok/s", "meas/pred", "pred GiB", "meas GiB", "pred rank",
                 "meas rank", "status"):
        out.add_column(name, justify="left" if name in ("layout", "status") else "right")
    for t in trials:
        p = t.prediction
        predicted = p.tokens_per_s_per_gpu * n_gpus
        measured = f"{t.tokens_per_s:,.0f}" if t.tokens_per_s is not None else "-"
        ratio = f"{t.tokens_per_s / predicted:.2f}" if t.tokens_per_s is not None else "-"
        memory = "-" if t.peak_memory_gib is None else (f"{t.peak_memory_gib:.2f}"
                                                        + (" rss" if t.memory_source == "rss" else ""))
        status = {"finished": "ok", "not run": "not run"}.get(t.status, f"failed: {t.reason}")
        out.add_row(str(t.index), p.layout.text(), f"{predicted:,.0f}", measured, ratio,
                    f"{t.predicted_memory_gib:.2f}", memory, str(t.planner_rank or "-"),
                    str(measured_rank.get(t.index, "-")), status)
    return out
