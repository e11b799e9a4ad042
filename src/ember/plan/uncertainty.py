"""How sure a prediction is: an interval from the planner's own errors on published runs.

Every prediction carries the range that measured throughput fell in for layouts of its
kind on the public sets: with e = (predicted - measured) / measured over those rows, the
10th and 90th percentiles p10 and p90 of e give measured throughput between
predicted / (1 + p90) and predicted / (1 + p10). The percentiles below are printed by
benchmarks/planner_accuracy.py ("interval table") over all rows of the three public sets
and copied here; rerun it after changing the cost model.

Layouts where the host's kernel launches take about as long as the GPU's work are a kind of
their own, whatever their split: there the planner prices the pass as a soft maximum of the
two (plan/predict.py: _as_run), and measured runs pay anything from nothing to about 1.4
times the larger (vTrain's h = 2048 model: tp 4 at micro-batch 2 nothing, tp 2 at micro-batch
2 about 1.4x), so their errors spread wider (the interval table of planner_accuracy.py). A
pass counts as at the crossover when the soft maximum puts it more than CROSSOVER above the
larger term (host and GPU time within about 1.5x of each other).

A prediction whose MFU exceeds the best MFU published for its GPU class is beyond what the
public sets can vouch for: its interval is widened down to that figure, and the ranking
says so. Two layouts whose intervals overlap cannot be told apart by the planner: measure
them (`ember tune`).
"""

from __future__ import annotations

from ember.layout import Layout

# kind -> (p10, p90) of (predicted - measured) / measured on the public sets.
ERROR_PERCENTILES: dict[str, tuple[float, float]] = {
    "data": (-0.073, 0.094),  # 152 rows (2026-11-29-planner-accuracy.txt)
    "pipeline": (-0.066, 0.090),  # 343 rows
    "tensor": (-0.111, 0.081),  # 296 rows
    "zero3": (-0.043, 0.125),  # 211 rows
    "fp8": (-0.079, 0.117),  # 48 rows, whatever their split
    "crossover": (-0.146, 0.110),  # 682 rows, whatever their split but FP8 (nearly all vtrain's)
}

CROSSOVER = 1.05

# Best model-FLOPs utilisation published for dense bf16 training at scale, by GPU class:
# A100: 55.2% (MegaScale, Jiang et al. 2024, 175B on 12,288 GPUs); H100: 49% (the
# Megatron-Core weak-scaling table, published_runs_more.csv).
BEST_PUBLISHED_MFU: dict[str, float] = {"A100": 0.552, "A800": 0.552, "H100": 0.49, "H800": 0.49, "H200": 0.49}
# With FP8 matmuls, still against the bf16 peak (as NeMo and torchtitan report them): 84.6%
# (NeMo 25.11, Llama 3 8B on 8 H100s, published_runs_more.csv; ember's FLOP count).
BEST_PUBLISHED_MFU_FP8: dict[str, float] = {"H100": 0.846, "H800": 0.846, "H200": 0.846}


def kind(layout: Layout, precision: str = "bf16", host_crossover: float = 1.0) -> str:
    """The class of layout whose published errors bound this one's: FP8 runs on their own
    (their matmul rate and casts add their own error), then layouts at the host/GPU
    crossover (`host_crossover`: the slowest stage's pass time over the larger of its host
    and GPU time), the rest by how they split."""
    if precision == "fp8":
        return "fp8"
    if host_crossover > CROSSOVER:
        return "crossover"
    if layout.zero >= 3:
        return "zero3"
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "tensor"
    return "data"


def best_published_mfu(gpu_name: str, precision: str = "bf16") -> float | None:
    table = BEST_PUBLISHED_MFU_FP8 if precision == "fp8" else BEST_PUBLISHED_MFU
    for prefix, mfu in table.items():
        if gpu_name.upper().startswith(prefix):
            return mfu
    return None


def interval(layout: Layout, gpu_name: str, tokens: float, mfu: float, precision: str = "bf16",
             host_crossover: float = 1.0) -> dict:
    """The range measured throughput is expected in (tokens/s per GPU and MFU), and why."""
    of = kind(layout, precision, host_crossover)
    low_err, high_err = ERROR_PERCENTILES[of]
    scale = (1 / (1 + high_err), 1 / (1 + low_err))
    out = {"kind": of, "tokens_per_s_per_gpu": [tokens * s for s in scale],
           "mfu": [mfu * s for s in scale], "above_published": False}
    best = best_published_mfu(gpu_name, precision)
    if best is not None and mfu > best:
        out["above_published"] = True
        out["mfu"][0] = min(out["mfu"][0], best)
        out["tokens_per_s_per_gpu"][0] = min(out["tokens_per_s_per_gpu"][0], tokens * best / mfu)
        out["note"] = (f"predicted {100 * mfu:.0f}% MFU is above the best published for {gpu_name.split()[0]} "
                       f"({100 * best:.0f}%): the public runs cannot vouch for it")
    return out


def overlaps(a: dict, b: dict) -> bool:
    """Whether two predictions' throughput intervals overlap."""
    (a_lo, a_hi), (b_lo, b_hi) = a["tokens_per_s_per_gpu"], b["tokens_per_s_per_gpu"]
    return a_lo <= b_hi and b_lo <= a_hi
