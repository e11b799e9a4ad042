"""The GLUE metrics against values worked out by hand."""

import math

import pytest

from ember.eval.metrics import accuracy, compute, f1, matthews, pearson, ranks, spearman

# tp = 2 (positions 0, 4), tn = 2 (2, 5), fp = 1 (1), fn = 1 (3)
PRED, GOLD = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]


def test_classification_metrics_by_hand():
    assert accuracy(PRED, GOLD) == pytest.approx(4 / 6)
    assert f1(PRED, GOLD) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert matthews(PRED, GOLD) == pytest.approx((2 * 2 - 1 * 1) / math.sqrt(3 * 3 * 3 * 3))
    assert matthews(GOLD, GOLD) == pytest.approx(1.0) and f1(GOLD, GOLD) == pytest.approx(1.0)
    assert matthews([1 - g for g in GOLD], GOLD) == pytest.approx(-1.0)


def test_degenerate_cases_are_zero_not_nan():
    assert matthews([1] * 6, GOLD) == 0.0  # a constant prediction carries no information
    assert f1([0] * 6, GOLD) == 0.0
    assert pearson([3.0] * 4, [1.0, 2.0, 3.0, 4.0]) == 0.0


def test_pearson_by_hand():
    # dx = (-1.5, -.5, .5, 1.5), dy = (-3, -1, 0, 4): sum dx dy = 11, sum dx^2 = 5, sum dy^2 = 26
    assert pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / math.sqrt(5 * 26))
    assert pearson([1, 2, 3], [6, 4, 2]) == pytest.approx(-1.0)


def test_spearman_shares_ranks_between_ties():
    assert ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    # ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4): covariance 4.5, variances 4.5 and 5
    assert spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    # monotone but not linear: Spearman 1, Pearson below 1
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [1, 8, 27, 64]) < 0.99


def test_compute_names_each_metric():
    assert compute(("f1", "accuracy"), PRED, GOLD) == {"f1": f1(PRED, GOLD), "accuracy": accuracy(PRED, GOLD)}
