"""The search: legal and ranked, also for the largest cases (its speed is measured by
benchmarks/planner_accuracy.py, not here)."""

from ember.plan.cluster import make_cluster
from ember.layout import problems
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS
from ember.plan.search import runners_up, search


def test_gpt3_175b_on_1024_gpus_is_searched_and_ranked():
    result = search(PRESETS["gpt3-175b"], make_cluster("A100-80GB", 1024), TrainShape(2048, 1536))
    assert result.considered > 4000 and result.ranked
    assert all(p.fits for p in result.ranked) and not any(p.fits for p in result.too_big)
    times = [p.step_time_s for p in result.ranked]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:]))
    best = result.best.layout
    assert problems(best, PRESETS["gpt3-175b"], 1536, 1024) == [] and best.tp <= 8
    assert len({(p.layout.tp, p.layout.pp, p.layout.dp) for p in runners_up(result)}) >= 2


def test_small_model_prefers_plain_data_parallelism():
    result = search(PRESETS["gpt2-small"], make_cluster("A100-80GB", 8), TrainShape(1024, 256))
    best = result.best.layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8)


def test_interleaved_schedules_are_searched_when_stages_do_not_divide_the_layers():
    """Llama 3 405B's 126 layers divide by no power-of-two pipeline but 2, yet the layout that
    trains it (tp 8, pp 16, interleaved) is the kind that wins: without uneven virtual stages
    the search could only offer 1F1B, whose bubble at pp >= 16 is near half the step."""
    model = PRESETS["llama3-405b"]
    result = search(model, make_cluster("H100", 16384), TrainShape(8192, 2048), fixed={"tp": 8, "pp": 16})
    interleaved = [p for p in result.ranked if p.layout.schedule == "interleaved"]
    assert interleaved and all(model.layers % p.layout.stages for p in interleaved)
    assert result.best.layout.schedule == "interleaved"
    best_1f1b = min(p.step_time_s for p in result.ranked if p.layout.schedule == "1f1b")
    assert result.best.step_time_s < 0.85 * best_1f1b


def test_a_pipeline_searches_zero1_once_not_zero2_and_3_beside_it():
    """Under a pipeline FSDP's ZeRO-2 and 3 are ZeRO-1's run (one reduction a step, the
    weights gathered over it): the table lists it once, unless zero is pinned."""
    model, cluster, shape = PRESETS["llama3-8b"], make_cluster("H100", 16), TrainShape(4096, 64)
    piped = [p.layout for p in search(model, cluster, shape, fixed={"pp": 2}).ranked]
    assert piped and {lo.zero for lo in piped} <= {0, 1}
    flat = [p.layout for p in search(model, cluster, shape, fixed={"pp": 1}).ranked]
    assert {1, 2, 3} <= {lo.zero for lo in flat}
    pinned = search(model, cluster, shape, fixed={"pp": 2, "zero": 3}).ranked
    assert pinned and all(p.layout.zero == 3 for p in pinned)


def test_a_layout_with_no_micro_batch_per_step_is_refused_not_priced_as_free():
    import pytest

    from ember.config import ConfigError
    from ember.layout import Layout
    from ember.plan.search import rank

    model, cluster, shape = PRESETS["gpt2-small"], make_cluster("A100-80GB", 8), TrainShape(1024, 16)
    assert rank(model, cluster, shape, [Layout(dp_replicate=8, micro_batch=2)])[0].step_time_s > 0
    with pytest.raises(ConfigError, match="at least dp x mbs = 32"):
        rank(model, cluster, shape, [Layout(dp_replicate=8, micro_batch=4)])
