"""`ember plan`: predict memory and step time for every parallel layout and rank them, or
for the layouts given (`--layout`, repeatable; one with `--json` is the form other tools read)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from rich.console import Console

from ember.config import ConfigError

EPILOG = """examples:
  ember plan --model gpt3-175b --gpu A100-80GB --gpus 1024 --seq-len 2048 --global-batch 1536 --explain
  ember plan --model configs/gpt2-small.toml --gpu RTX 4090 --gpus 8 --global-batch 512
  ember plan --model llama3-8b --gpu A800 --gpus 8 --seq-len 8192 --global-batch 512 \\
      --layout tp=1,pp=2,dp=4,zero=1,mbs=1,recompute=selective --json
  ember plan calibrate --out profile.json                       # measure this machine (or under torchrun)
  ember plan calibrate --out profile.json --model llama3-8b --seq-len 8192 --global-batch 512   # and its matmuls"""


def register_plan(verbs, measure_host_blocks=None, block_step=None) -> None:
    """`measure_host_blocks(device, iters) -> dict`: what eager tensor parallelism and FSDP2
    cost the host per block; `block_step(model, micro_batch, seq, device, dtype)`: one of the
    model's blocks to time (both ember.tune.host_cost), given by the caller: measuring
    ember's own block is above this package, which prices layouts from numbers alone."""
    plan = verbs.add_parser("plan", help="predict memory and step time of parallel layouts and rank them",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--model", help="a recipe .toml or a preset (gpt3-175b, llama3-8b, ...)")
    plan.add_argument("--gpu", nargs="+",
                      help="GPU type: V100, T4, A100-40GB, A100-80GB, A800, H100, H800, H200, L4, RTX 4090, "
                           "RTX 2080 Ti, A6000, ...")
    plan.add_argument("--gpus", type=int, help="number of GPUs")
    plan.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8, or the profile's)")
    plan.add_argument("--intra-bw", type=float, metavar="GB/s", help="per-GPU link inside a node, one direction")
    plan.add_argument("--inter-bw", type=float, metavar="GB/s", help="per-GPU network between nodes, one direction")
    plan.add_argument("--profile", help="cluster profile JSON (see docs/planner.md)")
    plan.add_argument("--save-profile", metavar="FILE", help="write the resolved cluster profile as JSON")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    plan.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    plan.add_argument("--precision",
                      help="bf16, fp16, fp8 (the weight matmuls in FP8 as Transformer Engine or torchao run "
                           "them; other stacks than ember's, on GPUs with FP8 tensor cores) or fp32 (no autocast); "
                           "default: what the recipe trains in on the profile's device (a calibrated CPU: fp32 "
                           "unless the recipe asks for bf16), else bf16")
    plan.add_argument("--grad-dtype", help="bf16 (16 bytes/param) or fp32 main gradients (Megatron-style); "
                                          "default: a recipe's parallel.grad_dtype, else the stack's")
    plan.add_argument("--attention", help="flash (default) or unfused")
    plan.add_argument("--stack", help="the training software: ember (default), megatron, nemo, megatron-2021, "
                                      "deepspeed, megatron-deepspeed, fsdp, fsdp-eager or llm-foundry (what each "
                                      "does: docs/planner.md)")
    plan.add_argument("--layout", action="append",
                      help="predict this layout instead of searching, e.g. "
                           "tp=8,pp=12,dp=4,zero=1,mbs=1,recompute=full; repeat it to rank candidates side by side")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a recipe value, or a preset's shape (model.layers=48, model.hidden=8192, ...)")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan.add_argument("--explain", action="store_true", help="say why the best layout beats the runners-up")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.set_defaults(func=run_plan)
    calibrate = plan.add_subparsers(dest="plan_verb", metavar="calibrate").add_parser(
        "calibrate", help="measure this machine and write a profile file",
        description="Measure matmul and attention throughput, memory bandwidth and (under torchrun) collective "
                    "bandwidth, and write a profile for `ember plan --profile` and `ember tune` (docs/tuning.md).")
    calibrate.add_argument("--out", required=True, help="profile file to write (JSON)")
    calibrate.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                           help="matmul precision (default: what training uses here: bf16 on GPUs that have it, "
                                "fp16 on older ones, fp32 on CPUs)")
    calibrate.add_argument("--quick", action="store_true", help="fewer shapes and sizes, shorter timings")
    calibrate.add_argument("--model", help="also time the matmuls of this model's layouts (a recipe .toml or a "
                                           "preset), which `ember plan` then takes instead of its matmul model")
    calibrate.add_argument("--gpus", type=int, help="with --model: the GPUs the layouts are for (default: this node)")
    calibrate.add_argument("--seq-len", type=int, help="with --model: tokens per sequence (default: the model's)")
    calibrate.add_argument("--global-batch", type=int, help="with --model: sequences per optimizer step")
    calibrate.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                           help="with --model: override a recipe value, or a preset's shape (model.vocab_size=32000)")
    calibrate.set_defaults(func=run_calibrate, measure_host_blocks=measure_host_blocks, block_step=block_step)


def _stack(args, base):
    from ember.plan.cluster import STACK_CHOICES

    changes = {}
    for key, value in (("grad_dtype", args.grad_dtype), ("attention", args.attention)):
        choices = STACK_CHOICES[key]
        if value is not None:
            if value.lower() not in choices:
                raise ConfigError(f"--{key.replace('_', '-')} must be one of {', '.join(choices)}, not {value!r}.")
            changes[key] = value.lower()
    return replace(base, **changes)


def _check_overrides(overrides: list[str]) -> None:
    """`--set` of what the plan itself decides would be overridden by the layout it prints."""
    from ember.layout import layout_keys

    chosen = layout_keys()
    flags = {"train.global_batch": "--global-batch", "train.precision": "--precision"}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in flags:
            raise ConfigError(f"--set {item}: give it to ember plan as {flags[key]}.")
        if key in chosen:
            raise ConfigError(f"--set {item}: ember plan chooses {key} itself; leave it out, or price a layout "
                              "of your own with --layout.")


def _setup(args):
    from ember.plan.cluster import check_profile_out, make_cluster, write_profile
    from ember.plan.layout import PRECISIONS, TrainShape
    from ember.plan.models import resolve_model
    from ember.plan.predict import check_precision

    if args.save_profile:
        check_profile_out(args.save_profile, "--save-profile")
    if args.gpus is None:
        if args.save_profile and args.model is None:
            args.gpus = 8
        else:
            raise ConfigError("say how many GPUs to plan for with --gpus.")
    gpu = " ".join(args.gpu) if args.gpu else None
    cluster = make_cluster(gpu, args.gpus, args.gpus_per_node, args.intra_bw, args.inter_bw, args.profile)
    from ember.plan.stacks import STACKS

    if cluster.stack.name not in STACKS:  # a profile's; a named --stack is checked by stack() below
        raise ConfigError(f"profile file {args.profile}: stack.name must be one of {', '.join(STACKS)}, "
                          f"not {cluster.stack.name!r}.")
    if args.stack is not None:
        from ember.plan.stacks import stack

        cluster = replace(cluster, stack=stack(args.stack.lower()))
    cluster = replace(cluster, stack=_stack(args, cluster.stack))
    if args.model is None:
        if args.save_profile:
            write_profile(cluster, args.save_profile, args.profile)
            return None
        raise ConfigError("say which model to plan with --model (a recipe .toml or a preset such as llama3-8b).")
    _check_overrides(args.set)
    model, recipe = resolve_model(args.model, args.set)
    device_type = "cuda" if cluster.stack.host_overlaps else "cpu"  # a calibrated CPU's stack says so
    config = None
    if recipe is not None:
        from ember.config import load_config

        config = load_config(recipe, args.set)
    if recipe is not None and args.grad_dtype is None:  # the gradients `ember train` would reduce
        from ember.plan.stacks import run_stack

        cluster = replace(cluster, stack=run_stack(cluster.stack, config, device_type))
    if args.precision is None:  # what `ember train` would compute in there
        asked = config.train.precision if config is not None else "auto"
        auto = "fp32" if device_type == "cpu" else "bf16" if cluster.gpu.bf16 else "fp16"
        args.precision = asked if asked != "auto" else auto
    args.precision = args.precision.lower()
    if args.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {args.precision!r}.")
    if args.precision == "fp8" and cluster.stack.name == "ember":
        raise ConfigError("ember's trainer trains in bf16; --precision fp8 prices other software: "
                          "add --stack megatron, nemo, deepspeed or fsdp.")
    if args.precision == "fp32" and cluster.stack.name != "ember":
        raise ConfigError(f"--stack {cluster.stack.name} trains in mixed precision; --precision fp32 prices "
                          "ember's trainer without autocast.")
    if args.precision == "bf16" and device_type == "cuda" and not cluster.gpu.bf16:  # as `ember train` refuses it
        raise ConfigError(f"{cluster.gpu.name} has no bf16 tensor cores (Ampere and later have); "
                          "use --precision fp16, which ember trains in there.")
    check_precision(cluster.gpu, args.precision)  # before any search
    seq = args.seq_len if args.seq_len is not None else model.max_seq_len
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top must be at least 1, not {args.top}.")
    if args.global_batch is None and config is not None:  # the batch the recipe trains with
        args.global_batch = config.train.global_batch
    if args.global_batch is None:
        raise ConfigError("give the global batch in sequences with --global-batch.")
    if seq < 1 or args.global_batch < 1:
        raise ConfigError("--seq-len and --global-batch must be at least 1.")
    if args.save_profile:  # only once every input is known good: a refused command leaves the file alone
        write_profile(cluster, args.save_profile, args.profile)
    return model, recipe, cluster, TrainShape(seq, args.global_batch, args.precision)


def run_plan(args) -> int:
    from ember.layout import problems
    from ember.plan import report
    from ember.plan.layout import parse_layout
    from ember.plan.search import rank, runners_up, search

    setup = _setup(args)
    if setup is None:
        print(f"wrote {args.save_profile}")
        return 0
    model, recipe, cluster, shape = setup
    console = Console()
    if not console.is_terminal:  # piped into a file or a pager: do not squeeze the table to 80 columns
        console = Console(width=160)
    if args.layout:
        layouts = list(dict.fromkeys(parse_layout(text, cluster.n_gpus) for text in args.layout))  # once each
        for layout in layouts:  # every one checked before any is priced
            found = problems(layout, model, shape.global_batch, cluster.n_gpus, ember=False)
            if found:
                raise ConfigError(f"layout {layout.text()} cannot run: {found[0]}.")
            refusal = cluster.stack.refusal(layout)
            if refusal:
                raise ConfigError(f"layout {layout.text()} cannot run: {refusal}.")
        ranked = rank(model, cluster, shape, layouts)
        p = ranked[0]  # the fastest that fits, if any does
        # A train command only for what ember's trainer runs; the notes say why there is none.
        trainable = p.fits and not problems(p.layout, model, shape.global_batch, cluster.n_gpus, ember=True)
        command = _command(p, model, recipe, cluster, shape, args.set) if trainable else None
        # What ember's trainer refuses is said whether or not the layout fits: a user who
        # makes it fit by other settings would learn it only then.
        notes = report.command_notes(model, recipe, p.layout, shape, command is not None and p.fits)
        if not p.fits:
            which = "the layout does not fit" if len(layouts) == 1 else "none of the layouts fits"
            notes.append(f"{which} in the {p.memory.capacity / 2**30:.1f} GiB a GPU has for training, "
                         "so no train command is given.")
        notes += report.interval_notes(ranked) + _profile_notes(cluster)
        if args.json:
            one = {**p.to_dict(), "model": model.name, "gpu": cluster.gpu.name, "gpus": cluster.n_gpus,
                   "command": command, "notes": notes}
            many = {"model": model.name, "gpu": cluster.gpu.name, "gpus": cluster.n_gpus,
                    "best": p.to_dict() | {"command": command}, "ranked": [q.to_dict() for q in ranked],
                    "within_interval_of_best": report.ties(ranked), "notes": notes}
            if args.explain:
                many["explain"] = report.explain(p, ranked[1:])
            print(json.dumps(one if len(layouts) == 1 else many, indent=2))
            return 0
        report.print_text(console, report.header(model, cluster, shape))
        if len(layouts) > 1:
            unfit = sum(not q.fits for q in ranked)
            report.print_text(console, f"{len(layouts)} layouts given; fastest first" + (
                f", then the {unfit} that do not fit" if 0 < unfit < len(ranked) else ""))
        console.print(report.table(ranked[: args.top]))
        lead = "\n" if len(layouts) == 1 else "\ntrain with the fastest of them:\n"
        report.print_text(console, report.memory_line(p) + (lead + command if command else ""))
        for note in notes:
            report.print_text(console, "note: " + note)
        if args.explain and len(layouts) > 1:
            report.print_text(console, "\n" + report.explain(p, ranked[1:]))
        return 0

    # Other software's search space is its own: layouts ember's trainer refuses count there.
    result = search(model, cluster, shape, ember_only=cluster.stack.name == "ember")
    if not result.ranked:
        smallest = min(result.too_big, key=lambda p: p.memory.total)
        raise ConfigError(f"no layout of {model.name} fits in {cluster.gpu.memory_gib:g} GiB per GPU on "
                          f"{cluster.n_gpus} GPUs; the leanest ({smallest.layout.text()}) needs "
                          f"{smallest.memory.total / 2**30:.0f} GiB, so add GPUs or shorten the batch or sequence.")
    best, others = result.best, runners_up(result)
    command = _command(best, model, recipe, cluster, shape, args.set)
    fastest_too_big = result.too_big[0] if result.too_big else None
    if args.json:
        out = {"model": model.to_dict(), "cluster": cluster.profile() | {"n_gpus": cluster.n_gpus},
               "shape": {"seq_len": shape.seq_len, "global_batch": shape.global_batch, "precision": shape.precision},
               "search_seconds": result.seconds, "layouts_considered": result.considered,
               "layouts_fitting": len(result.ranked), "best": best.to_dict() | {"command": command},
               "ranked": [p.to_dict() for p in result.ranked[: args.top]],
               "within_interval_of_best": report.ties(result.ranked),
               "notes": (report.interval_notes(result.ranked) + _profile_notes(cluster)
                         + report.command_notes(model, recipe, command=command is not None))}
        if args.explain:
            out["explain"] = report.explain(best, others, fastest_too_big)
        print(json.dumps(out, indent=2))
        return 0
    report.print_text(console, report.header(model, cluster, shape))
    title = (f"{len(result.ranked):,} of {result.considered:,} layouts fit; searched in {result.seconds:.2f} s; "
             f"fastest first")
    report.print_text(console, title)
    console.print(report.table(result.ranked[: args.top]))
    report.print_text(console, report.memory_line(best))
    for note in report.interval_notes(result.ranked) + _profile_notes(cluster):
        report.print_text(console, "note: " + note)
    if args.explain:
        report.print_text(console, "\n" + report.explain(best, others, fastest_too_big))
    if command is None:
        report.print_text(console, f"\nbest layout for --stack {cluster.stack.name}: {best.layout.text()}")
        return 0
    report.print_text(console, "\ntrain with the best layout:\n" + command)
    for note in report.command_notes(model, recipe):
        report.print_text(console, "note: " + note)
    return 0


def _profile_notes(cluster) -> list[str]:
    """A CPU profile divides the machine's memory among the processes it was measured with;
    another number of processes on that machine shares it otherwise."""
    if cluster.gpu.name != "cpu (calibrated)" or cluster.n_gpus == cluster.links.gpus_per_node:
        return []
    return [f"the profile was measured with {cluster.links.gpus_per_node} processes on one machine, each given "
            f"its share of the memory; for {cluster.n_gpus} processes there, calibrate under torchrun with "
            f"--nproc-per-node {cluster.n_gpus} so that memory and bandwidth are theirs."]


def _command(p, model, recipe, cluster, shape, overrides=()) -> str | None:
    """The `ember train` line for a layout priced for ember's trainer; None for another
    stack's, which that software runs with its own options."""
    from ember.plan import report

    if cluster.stack.name != "ember":
        return None
    return report.train_command(p, model, recipe, cluster, shape, overrides)


def _model_plan(args) -> tuple | None:
    """(model, GPUs, shape) whose matmuls a calibration times, checked before it measures."""
    given = [f"--{k.replace('_', '-')}" for k in ("gpus", "seq_len", "global_batch", "set") if getattr(args, k)]
    if args.model is None:
        if given:
            raise ConfigError(f"{', '.join(given)} only say which matmuls to time; give the model with --model.")
        return None
    from ember.plan.layout import TrainShape
    from ember.plan.models import resolve_model

    model, recipe = resolve_model(args.model, args.set)
    if args.global_batch is None and recipe is not None:  # the batch the recipe trains with, as `ember plan` takes
        from ember.config import load_config

        args.global_batch = load_config(recipe, args.set).train.global_batch
    if args.global_batch is None:
        raise ConfigError("with a preset --model, say the global batch (sequences per step) with --global-batch.")
    seq = args.seq_len if args.seq_len is not None else model.max_seq_len
    for flag, value in (("--gpus", args.gpus), ("--seq-len", seq), ("--global-batch", args.global_batch)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, not {value}.")
    return model, args.gpus, TrainShape(seq, args.global_batch)


def run_calibrate(args) -> int:
    from pathlib import Path

    from ember.plan.calibrate import calibrate
    from ember.plan.cluster import check_profile_out

    out = Path(args.out)
    check_profile_out(out, "--out")
    profile = calibrate(out, args.dtype, args.quick, getattr(args, "measure_host_blocks", None), _model_plan(args),
                        getattr(args, "block_step", None))
    if profile is not None:  # rank 0
        print("\n".join(summary_lines(profile)) + f"\nwrote {out}")
    return 0



def summary_lines(profile: dict) -> list[str]:
    """What a user reads after a calibration: the best matmul and each link's bus bandwidth."""
    m = profile["measured"]
    lines = [f"{profile['gpu']['name']}: best matmul {m['best_matmul_tflops'] * 1e3:,.1f} GFLOP/s ({m['dtype']}; "
             + ", ".join(f"{r['m']}x{r['n']}x{r['k']} {r['tflops'] * 1e3:,.1f}" for r in m["matmul"])
             + f"), copy {m['copy_gbps']:,.1f} GB/s"]
    if m.get("attention"):
        a = m["attention"]
        lines.append(f"causal attention (batch {a['batch']}, {a['heads']} heads, sequence {a['seq']}, head size "
                     f"{a['head_dim']}) {a['tflops'] * 1e3:,.1f} GFLOP/s forward+backward: "
                     f"attn_eff {profile['gpu']['attn_eff']:.3f}")
    if profile.get("matmuls"):
        mm = profile["matmuls"]
        lines.append(f"{len(mm['times'])} matmul shapes of {mm['model']} (sequence {mm['seq_len']}, global batch "
                     f"{mm['global_batch']}, {mm['gpus']} GPUs) timed: `ember plan` takes these times for them"
                     + ("" if mm["times"] else "; none is short enough to time here (under 20 ms by the matmul "
                        "model), so its matmul model prices them all"))
    if profile.get("attention"):
        lines.append(f"{len(profile['attention']['times'])} attention shapes of the same timed: `ember plan` takes "
                     "these times for them")
    for where in ("intra", "inter"):
        if where in m:
            parts = [f"{kind.replace('_', '-')} {max(r['busbw_gbps'] for r in rows):,.2f}"
                     for kind, rows in m[where].items()]
            lines.append(f"{where}-node busbw (GB/s, best over sizes): " + ", ".join(parts)
                         + f"; small-message latency {m[where]['all_reduce'][0]['time_s'] * 1e6:,.0f} us")
    block = profile["measured"].get("block")
    if block:
        scale = (f"{block['scale']:.2f}x the modelled elementwise time (eager_elementwise_scale)"
                 if block["scale"] is not None else "no more than its modelled launches, so it stays modelled")
        lines.append(f"one block of {block['model']} (micro-batch {block['micro_batch']}) spends "
                     f"{block['rest_s'] * 1e3:,.2f} ms a forward+backward outside its matmuls and attention: {scale}")
    host = {key: value for key, value in profile.get("stack", {}).items() if key.endswith("host_s_per_layer")}
    if host:
        lines.append("host time per block pass beyond its collectives: "
                     + ", ".join(f"{key.removesuffix('_host_s_per_layer')} {value * 1e3:,.2f} ms"
                                 for key, value in host.items()))
    return lines
