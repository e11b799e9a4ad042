"""Layout checks: each refusal is one sentence, raised before anything is built."""

import pytest

from conftest import REPO
from ember.config import ConfigError, load_config
from ember.parallel.mesh import resolve_sizes
from ember.parallel.validate import check_layout

RECIPE = REPO / "configs/tiny-gpt.toml"
BASE = ["model.vocab_size=512", "train.micro_batch=2", "train.global_batch=8"]


def layout(world, *sets):
    return check_layout(load_config(RECIPE, BASE + list(sets)), world)


def test_default_layout_is_data_parallel_over_the_world():
    assert layout(1) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert layout(4) == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert layout(4, "parallel.dp_replicate=2", "parallel.zero=2")["dp_shard"] == 2


@pytest.mark.parametrize("world,sets,words", [
    (4, ["parallel.dp_shard=3"], "must equal the world size 4"),
    (4, ["parallel.pp=3"], "does not divide the world size 4"),
    (1, ["parallel.dp_shard=2"], "must equal the world size 1"),
    (4, ["train.global_batch=6"], "multiple of data-parallel ranks x train.micro_batch"),
    (2, ["parallel.zero=2", "parallel.dp_replicate=2"], "would save nothing"),
    (1, ["parallel.zero=1"], "would save nothing"),
    (4, ["schedule.batch_start=4", "schedule.batch_ramp=0.5"], "schedule.batch_start (4)"),
])
def test_bad_layouts_are_refused_in_one_sentence(world, sets, words):
    with pytest.raises(ConfigError) as err:
        layout(world, *sets)
    message = str(err.value)
    assert words in message
    assert message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize("sets,words", [
    (["parallel.sp=true"], "needs parallel.tp > 1"),
    (["parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3"),
    (["parallel.vpp=2", "parallel.pp=2"], "needs parallel.schedule=interleaved"),
    (["parallel.vpp=2", "parallel.schedule=interleaved"], "needs parallel.pp > 1"),
    (["parallel.schedule=zigzag"], "parallel.schedule must be one of"),
    (["parallel.recompute=some"], "parallel.recompute must be one of"),
    (["parallel.dp_shard=0"], "parallel.dp_shard must be at least 1"),
    (["parallel.tp=0"], "parallel.tp must be at least 1"),
])
def test_bad_parallel_values_are_refused_when_loaded(sets, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("+", r"\+")):
        load_config(RECIPE, BASE + sets)


def test_unavailable_modules_are_named():
    # Only meaningful where this build lacks them; otherwise their own checks apply.
    from ember.parallel.validate import optional_module

    if optional_module("pipeline") is None:
        with pytest.raises(ConfigError, match="pipeline parallelism is not available"):
            layout(2, "parallel.pp=2")
    if optional_module("tensor") is None:
        with pytest.raises(ConfigError, match="tensor parallelism"):
            layout(2, "parallel.tp=2")


@pytest.mark.parametrize("sets", [["parallel.tp=2", "model.heads=4"], ["parallel.pp=2"]])
def test_ddp_with_tensor_or_pipeline_parallel_is_refused(sets):
    with pytest.raises(ConfigError, match="goes through FSDP2"):
        layout(4, *sets)


def test_resolve_sizes_takes_the_rest_for_dp_shard():
    cfg = load_config(RECIPE, BASE + ["parallel.tp=2", "parallel.pp=2"])
    assert resolve_sizes(cfg.parallel, 8) == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
