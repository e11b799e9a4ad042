"""The rules of a layout (ember/layout.py): each refusal is one sentence, raised before
anything is built, and the trainer and the planner obey the same rules."""

import pytest

from conftest import REPO
from ember.config import ConfigError, load_config
from ember.layout import Layout, check_run, problems, run_problems
from ember.plan.layout import TrainShape, candidates
from ember.plan.models import PRESETS, from_config

RECIPE = REPO / "configs/tiny-gpt.toml"
BASE = ["model.vocab_size=512", "train.micro_batch=2", "train.global_batch=8"]


def layout(world, *sets):
    return check_run(load_config(RECIPE, BASE + list(sets)), world).sizes


def test_default_layout_is_data_parallel_over_the_world():
    assert layout(1) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert layout(4) == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert layout(4, "parallel.dp_replicate=2", "parallel.zero=2")["dp_shard"] == 2
    assert layout(8, "parallel.tp=2", "parallel.pp=2", "parallel.zero=1") == {
        "pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}


@pytest.mark.parametrize("world,sets,words", [
    (4, ["parallel.dp_shard=3"], "must equal the world size 4"),
    (4, ["parallel.pp=3"], "does not divide the world size 4"),
    (1, ["parallel.dp_shard=2"], "must equal the world size 1"),
    (4, ["train.global_batch=6"], "multiple of data-parallel ranks x train.micro_batch"),
    (2, ["parallel.zero=2", "parallel.dp_replicate=2"], "would save nothing"),
    (1, ["parallel.zero=1"], "would save nothing"),
    (4, ["schedule.batch_start=4", "schedule.batch_ramp=0.5"], "schedule.batch_start (4)"),
    # Above one step of the layout but not a whole number of them: the ramp would round by layout.
    (2, ["train.micro_batch=4", "train.global_batch=32", "schedule.batch_start=12", "schedule.batch_ramp=0.5"],
     "schedule.batch_start (12) must be a multiple of data-parallel ranks x train.micro_batch (2 x 4 = 8)"),
    # Following the advice must not lead to the zero-without-dp_shard refusal.
    (4, ["parallel.tp=2", "parallel.dp_replicate=2"], "with those 2 ranks in parallel.dp_shard (dp_replicate=1)"),
])
def test_bad_layouts_are_refused_in_one_sentence(world, sets, words):
    with pytest.raises(ConfigError) as err:
        layout(world, *sets)
    message = str(err.value)
    assert words in message
    assert message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize("world,sets,words", [
    (2, ["parallel.sp=true"], "needs parallel.tp > 1"),
    (4, ["parallel.vpp=2", "parallel.pp=2", "parallel.zero=1"], "needs parallel.schedule=interleaved"),
    (1, ["parallel.vpp=2", "parallel.schedule=interleaved"], "needs parallel.pp > 1"),
    (1, ["parallel.schedule=zigzag"], "parallel.schedule='zigzag' is not one of"),
    (1, ["parallel.recompute=some"], "parallel.recompute must be one of"),
    (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble", "parallel.recompute=full"],
     "reruns a recomputed block's forward"),
    (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv", "parallel.recompute=selective"],
     "set parallel.recompute=none or use schedule 'interleaved'"),
])
def test_values_that_do_not_fit_each_other_are_refused_when_the_run_starts(world, sets, words):
    load_config(RECIPE, BASE + sets)  # each value alone is in range
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("+", r"\+")):
        layout(world, *sets)


@pytest.mark.parametrize("sets,words", [
    (["parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3"),
    (["parallel.dp_shard=0"], "parallel.dp_shard must be at least 1"),
    (["parallel.tp=0"], "parallel.tp must be at least 1"),
])
def test_values_out_of_range_are_refused_when_loaded(sets, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("+", r"\+")):
        load_config(RECIPE, BASE + sets)


@pytest.mark.parametrize("sets", [["parallel.tp=2", "model.heads=4"], ["parallel.pp=2"]])
def test_ddp_with_tensor_or_pipeline_parallel_is_refused(sets):
    with pytest.raises(ConfigError, match="goes through FSDP2"):
        layout(4, *sets)


def test_a_layout_reports_every_problem_at_once():
    model = load_config(RECIPE, BASE).model
    found = problems(Layout(tp=3, sp=False, pp=3, vpp=2, schedule="1f1b", micro_batch=3), model, 8, 5)
    assert len(found) >= 4  # world size, batch, heads, virtual stages
    assert all(reason[0].islower() and not reason.endswith(".") for reason in found)


# A sweep of the models users train and the world sizes they train them on: every layout the
# planner proposes is one the trainer runs, read back through the config exactly.
SWEEP_MODELS = ["llama3-8b", "gpt3-175b", "bert-base", "llama2-7b"]
SWEEP_WORLDS = [1, 2, 4, 6, 8, 16, 32, 64]


@pytest.mark.parametrize("preset", SWEEP_MODELS)
def test_the_planner_never_proposes_a_layout_the_trainer_refuses(preset):
    spec = PRESETS[preset]
    checked = 0
    for world in SWEEP_WORLDS:
        shape = TrainShape(2048, 512)
        for lo in candidates(spec, world, 8, shape, max_mbs=4):
            sets = [f"{k}={v}" for k, v in lo.settings(shape.global_batch).items()]
            cfg = load_config(None, sets + [f"model.{k}={getattr(spec, k)}" for k in
                                            ("layers", "hidden", "heads", "mlp_hidden", "vocab_size")])
            assert Layout.from_config(cfg, world) == lo
            assert run_problems(lo, cfg, world, shape.seq_len) == [], (preset, world, lo.text())
            checked += 1
    assert checked > 100


def test_a_recipe_the_planner_reads_obeys_the_same_rules():
    cfg = load_config(RECIPE, BASE + ["model.heads=4"])
    spec = from_config(cfg.model, "tiny", cfg.data.mlm_rate)
    for lo in candidates(spec, 4, 4, TrainShape(64, 8)):
        assert problems(lo, cfg.model, 8, 4) == problems(lo, spec, 8, 4) == []


@pytest.mark.parametrize("preset, text, gpus, split", [
    # BLOOM-176B: 70 layers on 12 stages; Llama 3 405B: 126 layers on 16.
    ("bloom-176b", "tp=4,pp=12,dp=8,zero=1,mbs=2,recompute=full", 384, (6,) * 11 + (4,)),
    ("llama3-405b", "tp=8,pp=16,dp=4,zero=1,mbs=1,recompute=full", 512, (8,) * 14 + (7, 7)),
])
def test_published_uneven_pipelines_are_priced_stage_by_stage(preset, text, gpus, split):
    from ember.plan.cluster import make_cluster
    from ember.plan.layout import parse_layout
    from ember.plan.memory import stage_memory
    from ember.plan.predict import predict

    spec = PRESETS[preset]
    lo = parse_layout(text, gpus)
    shape = TrainShape(2048, 2048)
    assert problems(lo, spec, shape.global_batch, gpus, ember=False) == []
    assert lo.split(spec) == split
    cluster = make_cluster("a100-80gb", gpus)
    p = predict(spec, cluster, shape, lo)
    assert 0 < p.step_time_s < float("inf") and 0 < p.mfu < 1
    # The last rank holds fewer blocks but the output layer: its states are sized from its own layers.
    last = stage_memory(spec, lo, shape, lo.pp - 1, 2, "flash", 1.0)
    middle = stage_memory(spec, lo, shape, 1, 2, "flash", 1.0)
    assert last.weights != middle.weights
    given = parse_layout(text + ",stage_layers=" + "/".join(map(str, split)), gpus)
    assert predict(spec, cluster, shape, given).step_time_s == pytest.approx(p.step_time_s)


def test_compile_auto_means_cuda_except_zero_bubble_schedules():
    from ember.layout import compiles

    def cfg(*sets):
        return load_config(RECIPE, list(sets))

    assert compiles(cfg(), "cuda") and not compiles(cfg(), "cpu")
    assert compiles(cfg("train.compile=true"), "cpu") and not compiles(cfg("train.compile=false"), "cuda")
    assert not compiles(cfg("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv"), "cuda")
    assert compiles(cfg("parallel.pp=2", "parallel.schedule=interleaved"), "cuda")
    with pytest.raises(ConfigError, match="train.compile must be one of auto, true, false"):
        cfg("train.compile=maybe")
