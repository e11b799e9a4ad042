"""How well `ember plan` predicts measured training runs, each public set on its own.

    python benchmarks/planner_accuracy.py [--no-write] [--csv FILE ...]

`--csv FILE` (repeatable) also checks a file of runs no fit has seen, in the columns of
published_runs_more.csv or of vTrain's measured data (read as `--stack megatron-deepspeed`
on nodes of 8 A100s), with a line for each of its groups.

For each set (published_runs, published_runs_more, vtrain; benchmarks/planner_sets.py) and
for its fitted and held-out rows separately: the number of rows, the median and maximum
|error| of tokens/s per GPU, the bias (signed median error; positive = optimistic), the
Spearman rank correlation of layouts within each (model, cluster, batch) group of at least
three layouts (median over groups, and the share at 0.8 or better), and in how many groups
of at least two layouts the measured best is in the planner's top three, and in how many it
is among the layouts whose interval overlaps the predicted best's (the set `ember plan`
says it cannot order and `ember tune` should measure), with that set's median share of
its group. Held out: whole
groups with crc32(group) % 3 == 0, never used by benchmarks/planner_fit.py. Also the
interval table (plan/uncertainty.py), the share of rows inside their interval, and the
GPT-3 175B ZeRO-3 scaling check. Writes benchmarks/results/<date>-planner-accuracy.txt.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_sets

from ember.config import ConfigError
from ember.eval.metrics import spearman  # ties share ranks; no spread in either gives 0, not a pass
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS
from ember.plan.report import overlaps
from ember.plan.search import search
from ember.plan.stacks import stack

REPO = Path(__file__).resolve().parents[1]
# Narayanan et al. 2021 (arXiv 2104.04473), table 2: GPT-3 175B at global batch 1,536 with
# DeepSpeed ZeRO-3 without model parallelism, and with Megatron-LM's 3D layout (tp 8 x pp
# 12), TFLOP/s per GPU in the paper's convention, which counts the recomputed forward pass
# (its training-time column, 90/74/74 and 84/43/23 days for 300B tokens, gives the same
# tokens/s).
ZERO3_175B = {384: 144.0, 768: 88.0, 1536: 44.0}
PTDP_175B = {384: 153.0, 768: 149.0, 1536: 141.0}


def evaluate_set(name: str, csv_path: Path | None = None) -> dict:
    """One public set, or (csv_path) a file of published_runs_more's columns whose rows
    are all unseen."""
    if csv_path is None:
        return evaluate_runs(name, *planner_sets.load(name))
    return evaluate_runs(name, *planner_sets.published_runs_more(csv_path, name=name, unseen=True), unseen=True)


def evaluate_runs(name: str, runs: list, skipped: dict, unseen: bool = False) -> dict:
    records, skipped = [], dict(skipped)
    for run in runs:
        try:
            p = planner_sets.predict(run)
        except ConfigError as e:  # a layout ember cannot run (heads that tp does not divide, ...)
            reason = f"{run.label} ({run.source}): {e}"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        except Exception as e:  # a file's row the planner fails on is reported, not the end of the check
            reason = f"{run.label} ({run.source}): planner failed, {type(e).__name__}: {e}"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        error = (p.tokens_per_s_per_gpu - run.measured) / run.measured if run.measured else None
        lo, hi = p.interval["tokens_per_s_per_gpu"]
        inside = lo <= run.measured <= hi if error is not None else None
        records.append({"run": run, "prediction": p, "error": error, "inside": inside})
    return {"name": name, "records": records, "skipped": skipped, "unseen": unseen,
            "fitted": summarise([r for r in records if not r["run"].held_out]),
            "held_out": summarise([r for r in records if r["run"].held_out])}


def summarise(records: list[dict]) -> dict:
    errors = [r["error"] for r in records if r["error"] is not None]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["error"] is not None:
            groups.setdefault(r["run"].group, []).append(r)
    rhos, top3, ranked_groups, in_ties, tie_shares = [], 0, 0, 0, []
    for members in groups.values():
        # Distinct layouts only: the same layout measured twice (compile on/off) is one point.
        distinct = {r["prediction"].layout: r for r in sorted(members, key=lambda r: r["run"].measured)}
        if len(distinct) < 2:
            continue
        ranked_groups += 1
        members = list(distinct.values())
        order = sorted(members, key=lambda r: -r["prediction"].tokens_per_s_per_gpu)
        best = max(members, key=lambda r: r["run"].measured)
        top3 += best in order[:3]
        lead = order[0]["prediction"].interval
        ties = [r for r in order if r is order[0] or overlaps(lead, r["prediction"].interval)]
        in_ties += best in ties
        tie_shares.append(len(ties) / len(members))
        if len(members) >= 3:
            rhos.append(spearman([r["run"].measured for r in members],
                                 [r["prediction"].tokens_per_s_per_gpu for r in members]))
    if not errors:
        return {"rows": 0}
    return {"rows": len(errors), "median": statistics.median(abs(e) for e in errors),
            "max": max(abs(e) for e in errors), "bias": statistics.median(errors),
            "rho_groups": len(rhos), "rho_median": statistics.median(rhos) if rhos else None,
            "rho_min": min(rhos) if rhos else None, "rho_ok": sum(r >= 0.8 for r in rhos),
            "top3": top3, "ranked_groups": ranked_groups, "in_ties": in_ties,
            "tie_share": statistics.median(tie_shares) if tie_shares else None,
            "inside": sum(bool(r["inside"]) for r in records if r["error"] is not None)}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def interval_table(results: list[dict]) -> dict[str, tuple[float, float, int, float, float]]:
    """Per interval kind: p10, p90, rows, median |error| and the share inside the interval."""
    by_kind: dict[str, list[dict]] = {}
    for res in results:
        for r in res["records"] if not res["unseen"] else ():
            if r["error"] is not None:
                by_kind.setdefault(r["prediction"].interval["kind"], []).append(r)
    table = {}
    for k, rows in sorted(by_kind.items()):
        errors = [r["error"] for r in rows]
        table[k] = (percentile(errors, 0.1), percentile(errors, 0.9), len(rows),
                    statistics.median(abs(e) for e in errors), sum(bool(r["inside"]) for r in rows) / len(rows))
    return table


@functools.cache  # 13 searches whose answer depends on nothing the caller passes
def zero3_scaling() -> tuple[str, ...]:
    """Both of the paper's layouts predicted with the software that ran them, in its units
    (hardware TFLOP/s); and where ember's own stack ranks its best 3D and ZeRO-3 layouts."""
    gpt, shape = PRESETS["gpt3-175b"], TrainShape(2048, 1536)
    lines = ["GPT-3 175B, global batch 1536, seq 2048, A100-80GB (Narayanan et al. 2021, table 2), TFLOP/s per GPU "
             "counting recomputation:",
             f"{'GPUs':>6}{'ZeRO-3 measured':>17}{'--stack deepspeed':>19}{'3D measured':>13}"
             f"{'--stack megatron-2021':>23}{'ember: best 3D':>16}{'best ZeRO-3, pp 1':>19}"]
    searched = []
    for gpus, measured in ZERO3_175B.items():
        ds = make_cluster("A100-80GB", gpus, 8, stack=stack("deepspeed"))
        zero3 = search(gpt, ds, shape, fixed={"tp": 1, "pp": 1, "zero": 3}, ember_only=False).best
        m21 = make_cluster("A100-80GB", gpus, 8, stack=stack("megatron-2021"))
        ptdp = search(gpt, m21, shape, fixed={"tp": 8, "pp": 12, "zero": 0, "sp": False, "recompute": "full",
                                              "recompute_every": 1}, ember_only=False).best
        result = search(gpt, make_cluster("A100-80GB", gpus, 8), shape)
        ranked = result.ranked
        searched.append(f"{gpus} GPUs: {result.considered:,} layouts in {result.seconds:.1f} s")
        best3d = next(p for p in ranked if p.layout.tp > 1 and p.layout.pp > 1)
        # ZeRO-3 as the alternative to 3D: no pipeline (under one, ZeRO-3 costs what ZeRO-1 does).
        best_z3 = next((p for p in ranked if p.layout.zero == 3 and p.layout.pp == 1), None)
        z3_text = f"{best_z3.hw_tflops_per_gpu:.0f} (#{ranked.index(best_z3) + 1})" if best_z3 else "-"
        z3, td = zero3.hw_tflops_per_gpu, ptdp.hw_tflops_per_gpu
        lines.append(f"{gpus:>6}{measured:>17.0f}{z3:>12.0f} ({z3 / measured - 1:+.0%}){PTDP_175B[gpus]:>13.0f}"
                     f"{td:>16.0f} ({td / PTDP_175B[gpus] - 1:+.0%}){best3d.hw_tflops_per_gpu:>11.0f} "
                     f"(#{ranked.index(best3d) + 1}){z3_text:>19}")
    return tuple(lines + ["ember's own search (default stack): " + "; ".join(searched)])


def layer_sweep(records: list[dict]) -> list[str]:
    """What vTrain's layer sweep says about the structure of the step: each layout was run
    at 12, 16, 20 and 24 layers, so step time = per-step + per-micro-batch + per-layer parts
    separates. From the 12- and 24-layer runs, the time per added layer and the rest (the
    intercept), measured and predicted; the intercept's part that grows with the number of
    micro-batches m (a line through the layouts that differ only in global batch) is the
    cost per micro-batch outside the layers. Medians over layouts, by tensor-parallel size."""
    runs: dict[tuple, dict[int, dict]] = {}
    for r in records:
        run, lo = r["run"], r["prediction"].layout
        key = (run.cluster.n_gpus, run.shape.global_batch, lo.micro_batch, lo.tp, lo.dp_replicate, lo.pp,
               run.model.hidden)
        runs.setdefault(key, {})[run.model.layers] = r
    lines: dict[tuple, list[tuple[int, float, float]]] = {}
    slopes: dict[int, list[float]] = {}
    passes: dict[tuple, list[list[float]]] = {}
    for key, by_layers in runs.items():
        if 12 not in by_layers or 24 not in by_layers:
            continue
        (a, b), m = (by_layers[12], by_layers[24]), by_layers[12]["prediction"].detail["micro_batches"]
        step = [[x["run"].shape.tokens / (x["run"].measured * x["run"].cluster.n_gpus), x["prediction"].step_time_s]
                for x in (a, b)]
        slope = [(step[1][i] - step[0][i]) / 12 for i in (0, 1)]
        intercept = [step[0][i] - 12 * slope[i] for i in (0, 1)]
        slopes.setdefault(key[3], []).append(slope[0] / slope[1])
        # One layer's forward, recomputation and backward for one micro-batch on its stage.
        passes.setdefault((key[6], key[3], key[2]), []).append([x * key[5] / m for x in slope])
        lines.setdefault(key[2:], []).append((m, intercept[0] - intercept[1]))
    per_mb: dict[int, list[float]] = {}
    for key, points in lines.items():
        if len({m for m, _ in points}) < 2:
            continue
        mx, my = statistics.fmean(m for m, _ in points), statistics.fmean(d for _, d in points)
        b = sum((m - mx) * (d - my) for m, d in points) / sum((m - mx) ** 2 for m, _ in points)
        per_mb.setdefault(key[1], []).append(b)
    out = ["vTrain layer sweep (12 vs 24 layers), medians over layouts:",
           f"{'tp':>4}{'per layer, measured/predicted':>31}{'per micro-batch, measured - predicted':>39}"]
    for tp in sorted(slopes):
        extra = f"{1e3 * statistics.median(per_mb[tp]):+.1f} ms" if tp in per_mb else "-"
        out.append(f"{tp:>4}{statistics.median(slopes[tp]):>31.3f}{extra:>39}")
    # Where host and GPU time cross, the measured pass is not smooth in the micro-batch.
    out.append("one layer pass (forward, recompute, backward) per micro-batch, ms, medians over layouts:")
    out.append(f"{'h':>6}{'tp':>4}{'mbs':>5}{'measured':>10}{'predicted':>11}")
    for (h, tp, mbs), cells in sorted(passes.items()):
        out.append(f"{h:>6}{tp:>4}{mbs:>5}{1e3 * statistics.median(c[0] for c in cells):>10.2f}"
                   f"{1e3 * statistics.median(c[1] for c in cells):>11.2f}")
    return out


def memory_line(records: list[dict]) -> str | None:
    """Predicted against measured peak memory per GPU, where a source published it (a peak
    the allocator reserved, a little above what is live), and whether the layouts that ran
    out of memory are predicted not to fit."""
    errors = [(r["prediction"].memory.total / 2**30 - r["run"].memory_gib) / r["run"].memory_gib
              for r in records if r["run"].memory_gib]
    ooms = [r for r in records if r["run"].oom]
    if not errors and not ooms:
        return None
    text = (f"  memory: {len(errors)} rows with a measured peak, median |err| "
            f"{100 * statistics.median(abs(e) for e in errors):.1f}%, max {100 * max(abs(e) for e in errors):.1f}%, "
            f"bias {100 * statistics.median(errors):+.1f}%" if errors else "  memory: no measured peak")
    if ooms:
        text += f"; ran out of memory: {sum(not r['prediction'].fits for r in ooms)}/{len(ooms)} predicted not to fit"
    return text


def by_source(records: list[dict]) -> list[str]:
    """Median signed error by source, GPU and recomputation: where a software's rows lean."""
    parts: dict[tuple, list[float]] = {}
    for r in records:
        if r["error"] is not None:
            run = r["run"]
            key = (run.source, run.cluster.gpu.name, r["prediction"].layout.recompute)
            parts.setdefault(key, []).append(r["error"])
    return [f"  {s:<16}{g:<16}{rc:<11}{len(e):>5} rows  median {100 * statistics.median(e):+6.1f}%"
            for (s, g, rc), e in sorted(parts.items())]


def group_lines(records: list[dict]) -> list[str]:
    """One line per group of an unseen set with 2+ layouts: how its ranking came out (a few
    such groups are what a file of one sweep per model holds, so the summary alone hides them)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["error"] is not None:
            groups.setdefault(r["run"].group, []).append(r)
    out = []
    for members in groups.values():
        if len({r["prediction"].layout for r in members}) < 2:
            continue
        run, s = members[0]["run"], summarise(members)
        order = sorted(members, key=lambda r: -r["prediction"].tokens_per_s_per_gpu)
        best = max(members, key=lambda r: r["run"].measured)
        rho = f"Spearman {s['rho_median']:.2f}" if s["rho_groups"] else "Spearman -"
        out.append(f"  {run.label} on {run.cluster.n_gpus} x {run.cluster.gpu.name}, global batch "
                   f"{run.shape.global_batch}: {len(members)} layouts, median |err| {100 * s['median']:.1f}%, bias "
                   f"{100 * s['bias']:+.1f}%, {rho}; measured best {best['prediction'].layout.text()} predicted "
                   f"#{order.index(best) + 1}" + (" (among the best's ties)" if s["in_ties"] else ""))
    return out


def fmt(s: dict) -> str:
    if not s.get("rows"):
        return "no rows"
    rho = (f"Spearman median {s['rho_median']:.2f} (min {s['rho_min']:.2f}; {s['rho_ok']}/{s['rho_groups']} "
           f"groups >= 0.8)" if s["rho_groups"] else "no group of 3+ layouts")
    return (f"{s['rows']:>5} rows  median |err| {100 * s['median']:5.1f}%  max {100 * s['max']:5.1f}%  "
            f"bias {100 * s['bias']:+5.1f}%  {rho}; best in top 3: {s['top3']}/{s['ranked_groups']} groups"
            + (f", among the best's ties: {s['in_ties']}/{s['ranked_groups']} (median {s['tie_share']:.0%} of a "
               "group)" if s["ranked_groups"] else "")
            + f"; inside interval {s['inside']}/{s['rows']}")


def report(results: list[dict], seconds: float, command: str = "python benchmarks/planner_accuracy.py") -> str:
    lines = [f"# ember plan accuracy against measured runs ({datetime.date.today().isoformat()})",
             f"# command: {command}",
             ("# error = (predicted - measured) / measured, tokens/s per GPU; "
              "held out = whole groups with crc32(group) % 3 == 0"), ""]
    for res in results:
        skipped = ", ".join(f"{v} {k}" for k, v in res["skipped"].items())
        lines.append(f"## {res['name']}" + (f" (skipped: {skipped})" if skipped else ""))
        lines += ([f"  unseen   {fmt(res['held_out'])}"] + group_lines(res["records"]) if res["unseen"] else
                  [f"  fitted   {fmt(res['fitted'])}", f"  held out {fmt(res['held_out'])}"])
        if (memory := memory_line(res["records"])) is not None:
            lines.append(memory)
        # FP8 and context parallelism are priced from first principles: their rows apart too.
        for label, keep in (("FP8", lambda r: r["run"].shape.precision == "fp8"),
                            ("context-parallel", lambda r: r["prediction"].layout.cp > 1)):
            part = [r for r in res["records"] if keep(r)]
            if part:
                lines.append(f"  of which {label}: fitted {fmt(summarise([r for r in part if not r['run'].held_out]))}")
                lines.append(f"  of which {label}: held out {fmt(summarise([r for r in part if r['run'].held_out]))}")
        lines.append("")
    lines.append("interval table (plan/uncertainty.py ERROR_PERCENTILES), all rows of the public sets:")
    for k, (p10, p90, n, median, inside) in interval_table(results).items():
        lines.append(f"  {k:<9} p10 {p10:+.3f}  p90 {p90:+.3f}  ({n} rows; median |err| {100 * median:.1f}%, "
                     f"{100 * inside:.0f}% inside)")
    vtrain = next((res for res in results if res["name"] == "vtrain"), None)
    lines += [""] + list(zero3_scaling()) + ([""] + layer_sweep(vtrain["records"]) if vtrain else [])
    lines += ["", "rows of every set but vtrain:"]
    rows = [r for res in results if not any(x["run"].source == "vTrain" for x in res["records"])
            for r in res["records"]]
    src_w = 1 + max((len(r["run"].source) for r in rows), default=15)
    label_w = 1 + max((len(r["run"].label) for r in rows), default=14)
    for r in rows:
        run, p = r["run"], r["prediction"]
        err = f"{100 * r['error']:+6.1f}%" if r["error"] is not None else "   OOM" if run.oom else "     -"
        text = p.layout.text() + (" fp8" if run.shape.precision == "fp8" else "")
        where = f"{run.source:<{src_w}}{run.label:<{label_w}}{run.cluster.gpu.name[:9]:<10}{run.cluster.n_gpus:>5}"
        lines.append(f"  {where} "
                     f"{text:<72}{run.measured:>9.0f}{p.tokens_per_s_per_gpu:>9.0f} {err}"
                     + ("  held out" if run.held_out else ""))
    more = next((res for res in results if res["name"] == "published_runs_more"), None)
    if more:
        lines += ["", "published_runs_more by source, GPU and recomputation (signed error):"]
        lines += by_source(more["records"])
    lines.append(f"\n({seconds:.1f} s)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results/")
    parser.add_argument("--csv", action="append", default=[], type=Path, metavar="FILE",
                        help="also check the runs in FILE (the columns of published_runs_more.csv, or of vTrain's "
                             "measured data), all unseen")
    args = parser.parse_args(argv)
    extra = []
    for f in args.csv:  # read them all before any prediction is made
        try:
            extra.append((f.stem, *planner_sets.runs_in_file(f, f.stem)))
        except OSError as e:
            print(f"error: cannot read {f}: {e.strerror}.", file=sys.stderr)
            return 2
        except (KeyError, ValueError, ConfigError) as e:
            print(f"error: {f} is not a file of runs in published_runs_more.csv's columns or vTrain's ({e}).",
                  file=sys.stderr)
            return 2
    start = time.perf_counter()
    results = [evaluate_set(name) for name in planner_sets.SETS if planner_sets.available(name)]
    results += [evaluate_runs(name, runs, skipped, unseen=True) for name, runs, skipped in extra]
    command = " ".join(["python benchmarks/planner_accuracy.py"] + [f"--csv {f}" for f in args.csv])
    text = report(results, time.perf_counter() - start, command)
    print(text, end="")
    if not args.no_write:
        out = REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-planner-accuracy.txt"
        out.write_text(text)
        print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
