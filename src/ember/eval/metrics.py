"""The official GLUE metrics, written out so that the dependency list stays short.

Conventions where a metric is undefined (a constant prediction or gold column): Matthews
correlation is 0 (as scikit-learn returns), and Pearson and Spearman are 0 too (scipy
returns NaN, which would poison the average: a constant predictor has no correlation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def accuracy(pred: Sequence[int], gold: Sequence[int]) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else 0.0


def _confusion(pred: Sequence[int], gold: Sequence[int]) -> tuple[int, int, int, int]:
    """(tp, tn, fp, fn) with 1 the positive class."""
    pred, gold = np.asarray(pred) == 1, np.asarray(gold) == 1
    return (int((pred & gold).sum()), int((~pred & ~gold).sum()),
            int((pred & ~gold).sum()), int((~pred & gold).sum()))


def f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """F1 of the positive class (label 1: paraphrase, duplicate), as GLUE reports it."""
    tp, _, fp, fn = _confusion(pred, gold)
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Matthews correlation of two binary labelings (CoLA)."""
    tp, tn, fp, fn = _confusion(pred, gold)
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denominator if denominator else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / denominator if denominator else 0.0


def ranks(x: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties sharing the mean of the ranks they span (as Spearman needs)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    out = np.empty(len(x), dtype=np.float64)
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        out[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(ranks(x), ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def compute(names: Sequence[str], pred: Sequence[float], gold: Sequence[float]) -> dict[str, float]:
    return {name: METRICS[name](pred, gold) for name in names}
