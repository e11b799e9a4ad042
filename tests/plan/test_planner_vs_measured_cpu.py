"""benchmarks/planner_vs_measured_cpu.py without running it: every layout is one the trainer
accepts, the set covers what the issue asks for, and the summary picks the right winner."""

import importlib.util

from conftest import REPO

from ember.config import load_config
from ember.layout import Layout, run_problems


def _bench():
    spec = importlib.util.spec_from_file_location("pvm", REPO / "benchmarks" / "planner_vs_measured_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layout_is_accepted_by_the_trainer():
    bench = _bench()
    assert len(bench.LAYOUTS) >= 10
    seen = set()
    for name, (nproc, sets) in bench.LAYOUTS.items():
        assert 1 <= nproc <= 4
        cfg = load_config(bench.RECIPE, bench.MODEL + sets + ["model.vocab_size=2048"])
        assert run_problems(Layout.from_config(cfg, nproc), cfg, nproc) == [], name
        p = cfg.parallel
        seen |= {f"zero{p.zero}" if nproc > 1 and p.tp == 1 and p.pp == 1 else "", f"tp{p.tp}", f"pp{p.pp}-{p.schedule}",
                 p.recompute}
    assert {"zero0", "zero1", "zero2", "zero3", "tp2", "pp2-1f1b", "pp2-gpipe", "full"} <= seen


def test_dry_run_prints_calibration_and_one_bench_per_layout(capsys):
    bench = _bench()
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "plan calibrate" in lines[0] and "--nproc-per-node=2" in lines[0]
    assert len(lines) == 1 + len(bench.LAYOUTS) and all(" bench " in line and "--profile" in line for line in lines[1:])


def test_summary_finds_the_measured_fastest_in_the_planners_order():
    bench = _bench()
    rows = [{"layout": "a", "measured_step_s": 1.0, "predicted_step_s": 1.1, "modelled_step_s": 2.5},
            {"layout": "b", "measured_step_s": 2.0, "predicted_step_s": 1.0, "modelled_step_s": 1.0},
            {"layout": "c", "measured_step_s": 3.0, "predicted_step_s": 3.3, "modelled_step_s": 1.5}]
    s = bench.summarise(rows)
    assert s["measured_fastest"] == "a" and s["planner_top2"] == ["b", "a"] and s["fastest_in_top2"]
    assert abs(s["median_abs_error"] - 0.1) < 1e-9
    # The same measurements against the planner's matmul model alone (no measured shapes).
    m = s["modelled"]
    assert m["planner_top2"] == ["b", "c"] and not m["fastest_in_top2"] and abs(m["median_abs_error"] - 0.5) < 1e-9
