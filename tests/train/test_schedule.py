import json

import pytest

from conftest import REPO, TINY
from ember.budget import parse_budget
from ember.config import ScheduleConfig, load_config
from ember.train.schedule import Progress, batch_size, lr_factor
from ember.train.trainer import Trainer


def test_triangle_is_crammings():
    s = ScheduleConfig(lr="triangle", triangle_start=0.25, triangle_peak=0.75)
    assert lr_factor(0.0, s) == pytest.approx(0.25)
    assert lr_factor(0.375, s) == pytest.approx(0.625)
    assert lr_factor(0.75, s) == pytest.approx(1.0)
    assert lr_factor(0.875, s) == pytest.approx(0.5)
    assert lr_factor(1.0, s) == 0.0  # a run stopped by its budget ends annealed


def test_cosine_warms_up_then_decays_to_floor():
    s = ScheduleConfig(lr="cosine", warmup=0.1, min_lr_ratio=0.1)
    assert lr_factor(0.0, s) == 0.0
    assert lr_factor(0.05, s) == pytest.approx(0.5)
    assert lr_factor(0.1, s) == pytest.approx(1.0)
    assert lr_factor(0.55, s) == pytest.approx(0.55)
    assert lr_factor(1.0, s) == pytest.approx(0.1)


def test_warmup_stable_decay_and_constant():
    s = ScheduleConfig(lr="wsd", warmup=0.1, decay=0.2, min_lr_ratio=0.0)
    assert lr_factor(0.5, s) == 1.0
    assert lr_factor(0.9, s) == pytest.approx(0.5)
    assert lr_factor(1.0, s) == pytest.approx(0.0)
    assert lr_factor(0.7, ScheduleConfig(lr="constant", warmup=0.0)) == 1.0
    floor = ScheduleConfig(lr="wsd", warmup=0.1, decay=0.2, min_lr_ratio=0.1)
    assert lr_factor(0.8, floor) == pytest.approx(1.0)
    assert lr_factor(0.9, floor) == pytest.approx(0.55)  # halfway down to the floor
    assert lr_factor(1.0, floor) == pytest.approx(0.1)


def test_batch_ramp_in_whole_batch_starts():
    s = ScheduleConfig(batch_start=64, batch_ramp=0.6)
    sizes = [batch_size(f / 100, s, global_batch=1000) for f in range(101)]
    assert sizes[0] == 64 and sizes[60] == 1000 and sizes[-1] == 1000
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert all(n % 64 == 0 for n in sizes[:60]) and len(set(sizes[:60])) == 15  # 64, 128, ..., 960
    assert batch_size(0.3, ScheduleConfig(), 1024) == 1024  # no ramp configured


def test_progress_fraction_follows_the_budget_kind():
    p = Progress(step=50, tokens=2000, elapsed_s=30.0)
    assert p.fraction(parse_budget("100steps")) == 0.5
    assert p.fraction(parse_budget("8000tok")) == 0.25
    assert p.fraction(parse_budget("1m")) == 0.5
    assert p.fraction(parse_budget("10steps")) == 1.0


def test_a_time_budget_ends_when_the_next_steps_middle_would_fall_past_it():
    budget = parse_budget("1m")
    assert not Progress(elapsed_s=57.0, step_s=4.0).done(budget)  # its middle, 59 s, trains at lr > 0
    assert Progress(elapsed_s=58.0, step_s=4.0).done(budget)  # its middle is the budget's end
    assert not Progress(elapsed_s=59.9).done(budget)  # no step timed yet (a resumed run's first)
    assert Progress(elapsed_s=60.0).done(budget)
    assert not Progress(step=9, step_s=100.0).done(parse_budget("10steps"))  # counted budgets end by count


def test_a_step_reads_the_schedule_at_its_middle():
    """Read at the step's start, the first step of a warmup trains at lr 0: its gradient is
    thrown away, and the warmup gives less than the area under its ramp."""
    budget = parse_budget("40steps")
    s = ScheduleConfig(lr="cosine", warmup=0.1, min_lr_ratio=0.1)
    lrs = [lr_factor(Progress(step=k).step_fraction(budget, 0, 0.0), s) for k in range(40)]
    assert lrs[0] == pytest.approx(0.125)
    assert sum(lrs[:4]) == pytest.approx(2.0)  # as nanoGPT's (k + 1) / (warmup + 1) for 4 steps
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] > 0.1
    last = Progress(step=39).step_fraction(budget, 0, 0.0)
    assert lr_factor(last, ScheduleConfig(lr="triangle")) > 0  # the triangle's last step trains too
    assert Progress(step=9, tokens=1000).step_fraction(parse_budget("4000tok"), 1000, 0.0) == 0.375
    assert Progress(elapsed_s=30.0).step_fraction(parse_budget("1m"), 0, 6.0) == 0.55
    assert Progress(step=99).step_fraction(parse_budget("10steps"), 0, 0.0) == 1.0


def test_the_first_step_of_a_warmup_trains(dataset, tmp_path):
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["schedule.warmup=0.5", "train.eval_every=1000steps"])
    Trainer(cfg, dataset, tmp_path / "run", budget="4steps", progress=False).run()
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert len(lrs) == 4
    assert lrs[:2] == pytest.approx([0.25 * cfg.optim.lr, 0.75 * cfg.optim.lr])
