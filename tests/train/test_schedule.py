import pytest

from ember.config import ScheduleConfig, parse_budget
from ember.train.schedule import Progress, batch_size, lr_factor


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


def test_batch_ramp_in_whole_micro_batches():
    s = ScheduleConfig(batch_start=64, batch_ramp=0.6)
    sizes = [batch_size(f / 100, s, global_batch=1024, micro_batch=32) for f in range(101)]
    assert sizes[0] == 64 and sizes[60] == 1024 and sizes[-1] == 1024
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert all(n % 32 == 0 for n in sizes)
    assert batch_size(0.3, ScheduleConfig(), 1024, 32) == 1024  # no ramp configured


def test_progress_fraction_follows_the_budget_kind():
    p = Progress(step=50, tokens=2000, elapsed_s=30.0)
    assert p.fraction(parse_budget("100steps")) == 0.5
    assert p.fraction(parse_budget("8000tok")) == 0.25
    assert p.fraction(parse_budget("1m")) == 0.5
    assert p.fraction(parse_budget("10steps")) == 1.0
