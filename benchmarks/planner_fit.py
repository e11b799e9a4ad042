"""Fit the overlap model's and the named stacks' few constants on the fitted public rows.

    python benchmarks/planner_fit.py

Held-out groups (planner_sets.Run.held_out) never enter. Per stack, `kernel_eff` and
`attention_eff` (stacks with a fused attention kernel) together, then `host_s_per_kernel`,
are chosen on a grid to minimise the median |log(predicted/measured)| of that stack's
fitted rows (for the stacks in PER_MICRO_BATCH, `host_s_per_kernel` together with
`host_s_per_micro_batch`: only their rows sweep the layer count at a fixed layout, which
separates a cost per micro-batch from one per layer); COMM_SLOWDOWN (plan/overlap.py) is
shared by all stacks and chosen the same way over all fitted rows, each set weighted
equally. Coordinate descent, until a round changes nothing (at most eight), once for every
HOST_OVERLAP_POWER (plan/predict.py) on its grid; the power with the best score wins
(`--power P` fits at one power only, about a fifth of the time). A constant moves only when
another grid value beats its current one by more than TIE: rows that do not determine a
constant leave it where it was. Stacks that run the same
kernels share their figures (FAMILY: `nemo` is Megatron-Core with its overlap options on,
`fsdp-eager` FSDP without torch.compile, `llm-foundry` FSDP with a fused cross-entropy).
Prints the values; they are copied by hand into plan/stacks.py, plan/overlap.py and
plan/predict.py, with the output committed under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_sets

from ember.plan import overlap, predict

KERNEL_EFF = [round(0.55 + 0.025 * i, 3) for i in range(21)]
ATTENTION_EFF = [round(0.3 + 0.05 * i, 2) for i in range(17)]
HOST_S = [2e-6, 5e-6, 10e-6, 15e-6, 20e-6, 30e-6, 40e-6, 45e-6, 50e-6, 55e-6, 60e-6, 65e-6, 70e-6, 80e-6, 100e-6]
MICRO_BATCH_S = [0.0, 0.5e-3, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3, 5e-3]
PER_MICRO_BATCH = ("deepspeed",)  # vTrain: 4 layer counts per layout
HOST_POWER = [1.5, 2.0, 3.0, 4.0, 8.0]
SLOWDOWN = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3]  # the 10-30% GEMMs lose beside NCCL (plan/overlap.py)
TIE = 1e-4  # score differences below this are not a reason to move a constant
# Fitted together: the same software, other options.
FAMILY = {"nemo": "megatron", "megatron-deepspeed": "deepspeed", "fsdp-eager": "fsdp", "llm-foundry": "fsdp"}


def family(run) -> str:
    return FAMILY.get(run.cluster.stack.name, run.cluster.stack.name)


def fitted_runs() -> list:
    runs = []
    for name in planner_sets.SETS:
        if planner_sets.available(name):
            runs += [r for r in planner_sets.load(name)[0] if not r.held_out and r.measured]
    return runs


def with_stack(run, **changes):
    cluster = dataclasses.replace(run.cluster, stack=dataclasses.replace(run.cluster.stack, **changes))
    return dataclasses.replace(run, cluster=cluster)


def score(runs: list) -> float:
    by_set: dict[str, list[float]] = {}
    for run in runs:
        p = planner_sets.predict(run)
        by_set.setdefault(run.set, []).append(abs(math.log(p.tokens_per_s_per_gpu / run.measured)))
    return statistics.fmean(statistics.median(v) for v in by_set.values())


def describe(values: dict) -> str:
    return "; ".join(f"{n}: kernel_eff {v['kernel_eff']}, attention_eff {v['attention_eff']}, "
                     f"host_s_per_kernel {v['host_s_per_kernel'] * 1e6:g} us, "
                     f"host_s_per_micro_batch {v['host_s_per_micro_batch'] * 1e3:g} ms" for n, v in values.items())


def choose(options: list, current, cost) -> object:
    """The option of lowest cost; the current value unless another beats it by more than
    TIE, so that a constant the rows do not determine stays where it was."""
    costs = {option: cost(option) for option in options}
    costs.setdefault(current, cost(current))
    best = min(costs, key=costs.get)
    return current if costs[current] - costs[best] <= TIE else best


def accept(runs: list, values: dict, name: str, proposal: dict) -> None:
    """Move `name`'s constants to `proposal` (chosen on its own rows) only if the score of
    every fitted row improves by more than TIE: a median over a stack's own rows can jump
    between the modes of a two-humped error distribution (A100 rows under, H100 rows over)
    while the whole fit does not change."""
    if all(values[name][k] == v for k, v in proposal.items()):
        return
    now = score([with_stack(r, **values[family(r)]) for r in runs])
    moved = dict(values, **{name: values[name] | proposal})
    if score([with_stack(r, **moved[family(r)]) for r in runs]) < now - TIE:
        values[name] |= proposal


def fit_stacks(runs: list, names: list, first: dict, values: dict) -> float:
    """Coordinate descent over the stacks' constants and COMM_SLOWDOWN at the current
    HOST_OVERLAP_POWER, until a round changes nothing (at most eight). Each stack is chosen
    on its own rows, so a round can worsen the shared score: `values` and COMM_SLOWDOWN are
    left at the best round's, and its score returned."""
    best, kept = math.inf, None
    for round_ in range(8):
        before = (repr(values), overlap.COMM_SLOWDOWN)
        for name in names:
            mine = [r for r in runs if family(r) == name]
            # The kernel rates together (a stack's rows rarely separate matmul from attention
            # time on their own), then the host time.
            fused = first[name].attention == "flash"  # unfused attention runs as matmuls: kernel_eff
            pairs = [(k, a) for k in KERNEL_EFF for a in (ATTENTION_EFF if fused else [1.0])]
            k, a = choose(pairs, (values[name]["kernel_eff"], values[name]["attention_eff"]),
                          lambda ka: score([with_stack(r, **(values[name] | {"kernel_eff": ka[0],
                                                                             "attention_eff": ka[1]}))
                                            for r in mine]))
            accept(runs, values, name, {"kernel_eff": k, "attention_eff": a})
            hosts = [(v, c) for v in HOST_S for c in (MICRO_BATCH_S if name in PER_MICRO_BATCH else [0.0])]
            v, c = choose(hosts, (values[name]["host_s_per_kernel"], values[name]["host_s_per_micro_batch"]),
                          lambda vc: score([with_stack(r, **(values[name] | {"host_s_per_kernel": vc[0],
                                                                             "host_s_per_micro_batch": vc[1]}))
                                            for r in mine]))
            accept(runs, values, name, {"host_s_per_kernel": v, "host_s_per_micro_batch": c})
        current = [with_stack(r, **values[family(r)]) for r in runs]
        def at_slowdown(v: float) -> float:
            overlap.COMM_SLOWDOWN = v
            return score(current)

        overlap.COMM_SLOWDOWN = choose(SLOWDOWN, overlap.COMM_SLOWDOWN, at_slowdown)
        round_score = score(current)
        print(f"  p {predict.HOST_OVERLAP_POWER} round {round_ + 1}: COMM_SLOWDOWN {overlap.COMM_SLOWDOWN}; "
              f"{describe(values)}; score {round_score:.4f}", flush=True)
        if round_score < best:
            best, kept = round_score, ({n: dict(v) for n, v in values.items()}, overlap.COMM_SLOWDOWN)
        if (repr(values), overlap.COMM_SLOWDOWN) == before:
            break
    for name, v in kept[0].items():
        values[name] = v
    overlap.COMM_SLOWDOWN = kept[1]
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--power", type=float, help="fit at this HOST_OVERLAP_POWER only")
    args = parser.parse_args()
    runs = fitted_runs()
    names = sorted({family(r) for r in runs})
    print(f"fitting on {len(runs)} fitted rows; stacks {', '.join(names)}")
    first = {n: next(r for r in runs if family(r) == n).cluster.stack for n in names}
    start = {n: {"kernel_eff": s.kernel_eff, "attention_eff": s.attention_eff,
                 "host_s_per_kernel": s.host_s_per_kernel, "host_s_per_micro_batch": s.host_s_per_micro_batch}
             for n, s in first.items()}
    # HOST_OVERLAP_POWER trades against every stack's host time, so each power gets its own
    # refit of everything else (descending one coordinate at a time from one power stays
    # near it), and the best score wins.
    results = []
    for power in [args.power] if args.power else HOST_POWER:
        predict.HOST_OVERLAP_POWER = power
        values = {n: dict(v) for n, v in start.items()}
        results.append((fit_stacks(runs, names, first, values), power, values, overlap.COMM_SLOWDOWN))
    best, power, values, slowdown = min(results, key=lambda r: r[0])
    print(f"best: HOST_OVERLAP_POWER {power}; COMM_SLOWDOWN {slowdown}; {describe(values)}; score {best:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
