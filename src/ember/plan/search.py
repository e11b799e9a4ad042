"""The search: predict every legal layout, keep those that fit, rank them by step time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ember.config import ConfigError
from ember.plan.cluster import Cluster
from ember.layout import Layout
from ember.plan.layout import TrainShape, candidates
from ember.plan.memory import defers_reduction
from ember.plan.predict import Prediction, predict


@dataclass
class SearchResult:
    ranked: list[Prediction]  # layouts that fit, fastest first
    too_big: list[Prediction]  # layouts that do not fit, fastest first
    considered: int
    seconds: float

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def search(model, cluster: Cluster, shape: TrainShape, fixed: dict | None = None,
           max_mbs: int = 256, ember_only: bool = True) -> SearchResult:
    """Rank every layout of `model` on `cluster` at `shape`; `fixed` pins layout fields;
    `ember_only=False` also ranks layouts only other frameworks run (published runs)."""
    start = time.perf_counter()
    layouts = runnable(model, cluster, shape, fixed, max_mbs, ember_only)
    fits, too_big = [], []
    for layout in layouts:
        prediction = predict(model, cluster, shape, layout)
        (fits if prediction.fits else too_big).append(prediction)
    fits.sort(key=_rank_key)
    too_big.sort(key=_rank_key)
    return SearchResult(fits, too_big, len(layouts), time.perf_counter() - start)


def runnable(model, cluster: Cluster, shape: TrainShape, fixed: dict | None = None, max_mbs: int = 256,
             ember_only: bool = True) -> list[Layout]:
    """The layouts a search prices: their degrees divide the GPUs, heads and batch, and the
    stack runs them; none is one sentence saying why. It needs only the cluster's sizes and
    stack, so a calibration checks it before it measures anything."""
    layouts = [lo for lo in candidates(model, cluster.n_gpus, cluster.gpus_per_node, shape, max_mbs=max_mbs,
                                       fixed=fixed, ember_only=ember_only)
               if cluster.stack.refusal(lo) is None and not _runs_as_zero1(lo, cluster.stack, fixed)]
    if not layouts and fixed:
        pinned = ",".join(f"{k}={v}" for k, v in fixed.items())
        raise ConfigError(f"no layout of {model.name} with {pinned} runs on {cluster.n_gpus} GPUs at a global "
                          f"batch of {shape.global_batch}: the degrees must multiply to the GPU count, tp "
                          f"divide the {model.heads} heads and {model.kv_heads} KV heads, and dp x micro-batch "
                          "the global batch.")
    if not layouts:
        raise ConfigError(f"no layout of {model.name} divides evenly over {cluster.n_gpus} GPUs at a global "
                          f"batch of {shape.global_batch}; try a global batch that is a multiple of the GPU count.")
    return layouts


def _runs_as_zero1(lo: Layout, stack, fixed: dict | None) -> bool:
    """ZeRO-2 or 3 on an FSDP stage of a pipeline, which reduces once a step and keeps its
    weights gathered (predict.py): the same run as ZeRO-1, at no less memory. Searched only
    when pinned, so that a table of the fastest layouts does not list each one three times."""
    return lo.zero >= 2 and "zero" not in (fixed or {}) and defers_reduction(lo, stack)


def _rank_key(p: Prediction) -> tuple:
    # Equal times (e.g. ZeRO stages that cost nothing here) go to the simpler, leaner layout.
    lo = p.layout
    return (round(p.step_time_s, 9), p.memory.total, lo.zero, lo.pp * lo.vpp, lo.tp, lo.recompute != "none")


def rank(model, cluster: Cluster, shape: TrainShape, layouts: list[Layout]) -> list[Prediction]:
    """Predictions for given layouts in the planner's order: fitting ones by step time, then
    the ones that do not fit."""
    predictions = [predict(model, cluster, shape, layout) for layout in layouts]
    return sorted(predictions, key=lambda p: (not p.fits, _rank_key(p)))


def runners_up(result: SearchResult, count: int = 3) -> list[Prediction]:
    """Layouts worth comparing with the winner: first the best of each other model-parallel
    shape (tp, pp, schedule), which differ for reasons worth explaining; then, if those run
    out, the best of each other data-parallel arrangement (ZeRO stage, sharding)."""
    out: list[Prediction] = []
    for key in (_model_parallel, _data_parallel):
        seen = {key(p.layout) for p in [result.best] + out}
        for prediction in result.ranked[1:]:
            if len(out) == count:
                return out
            if key(prediction.layout) not in seen and prediction not in out:
                seen.add(key(prediction.layout))
                out.append(prediction)
    return out


def _model_parallel(lo: Layout) -> tuple:
    return (lo.tp, lo.pp, lo.schedule)


def _data_parallel(lo: Layout) -> tuple:
    return (lo.tp, lo.pp, lo.dp_shard, lo.dp_replicate, lo.zero)
