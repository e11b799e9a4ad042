"""The planner against published runs (benchmarks/planner_accuracy.py): the figures this
test asserts are the ones reached when it was written, so a regression fails here."""

import importlib.util
import pytest

from conftest import REPO

CSV = REPO / "benchmarks" / "data" / "published_runs.csv"


def _benchmark():
    spec = importlib.util.spec_from_file_location("planner_accuracy", REPO / "benchmarks" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def summary():
    return _benchmark().evaluate(CSV.resolve())


def test_throughput_errors(summary):
    # Reached: median 7.9%, max 12.5% over 18 rows, every row still optimistic (docs/planner.md).
    # The target is a median of 10%; these bounds catch a regression from what was reached.
    assert len([r for r in summary["records"] if r["error"] is not None]) == 18
    assert summary["median_error"] <= 0.085
    assert summary["max_error"] <= 0.13


def test_flagperf_sweep_ranking(summary):
    # Reached 1.0 (target 0.8). tp2pp4 and tp4pp2, measured 1.2% apart, are predicted 0.4% apart,
    # so a small change may swap them (0.964); anything worse is a regression.
    assert summary["spearman"] >= 0.95
    assert summary["top1"]


def test_out_of_memory_layout_is_predicted_not_to_fit(summary):
    assert summary["oom_rows"] and summary["oom_predicted_not_fit"]
    best = max((r for r in summary["records"] if r["row"]["source"].startswith("FlagPerf") and r["measured"]),
               key=lambda r: r["measured"])
    assert best["prediction"].fits  # measured at 76 of 80 GiB: the margin must not reject it
