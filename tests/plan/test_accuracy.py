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
    # Reached: median 9.3%, max 13.2% over 18 rows, every row still optimistic (docs/planner.md).
    assert len([r for r in summary["records"] if r["error"] is not None]) == 18
    assert summary["median_error"] <= 0.10  # the target
    assert summary["max_error"] <= 0.14


def test_flagperf_sweep_ranking(summary):
    # Reached 0.964: one swap, tp2pp4 against tp4pp2, which were measured 1.2% apart. Target 0.8.
    assert summary["spearman"] >= 0.95
    assert summary["top1"]


def test_out_of_memory_layout_is_predicted_not_to_fit(summary):
    assert summary["oom_rows"] and summary["oom_predicted_not_fit"]
    best = max((r for r in summary["records"] if r["row"]["source"].startswith("FlagPerf") and r["measured"]),
               key=lambda r: r["measured"])
    assert best["prediction"].fits  # measured at 76 of 80 GiB: the margin must not reject it
