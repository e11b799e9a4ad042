import pytest

from ember.budget import parse_budget
from ember.config import Config, ConfigError, load_config, to_toml


def test_recipe_then_overrides(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nhidden = 128\nheads = 4\n[optim]\nbetas = [0.9, 0.98]\n')
    cfg = load_config(recipe, ["model.layers=3", "optim.lr=1e-3", "model.bias=true"])
    assert (cfg.model.hidden, cfg.model.layers, cfg.model.bias) == (128, 3, True)
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.9, 0.98]


@pytest.mark.parametrize("override, words", [
    ("model.hiden=3", "unknown config key"),
    ("modle.hidden=3", "unknown config section"),
    ("model.layers=two", "must be a whole number"),
    ("model.activation=relu", "must be one of"),
    ("model.heads=5", "divisible"),
    ("model.kv_heads=5", r"model.kv_heads must be 0 \(one per query head\) or a divisor of model.heads \(12\), not 5"),
    ("model.kv_heads=24", "or a divisor of model.heads"),
    ("model.kv_heads=-4", "or a divisor of model.heads"),
    ("train.global_batch=10", "multiple of"),
    ("train.budget=forever", "not understood"),
    ("train.eval_every=1e6tok", "steps"),
    ("layers=3", "unknown config section"),
])
def test_mistakes_are_one_clear_sentence(override, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    (["schedule.lr=wsd", "schedule.warmup=0.5", "schedule.decay=0.8"],
     r"schedule.warmup \(0.5\) \+ schedule.decay \(0.8\) must be at most 1"),
    (["schedule.lr=triangle", "schedule.triangle_peak=1.0"], "triangle_peak must be below 1"),
])
def test_schedules_that_would_not_end_annealed_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)
    load_config(None, overrides[:1] + [o.replace("0.8", "0.2").replace("1.0", "0.9") for o in overrides[1:]])


def test_kv_heads_divide_the_query_heads():
    assert load_config(None, ["model.kv_heads=4"]).model.kv_heads == 4
    assert load_config(None, ["model.kv_heads=12"]).model.kv_heads == 12
    assert load_config(None).model.kv_heads == 0  # one per query head


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhidden=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize("text, kind, amount", [
    ("90s", "seconds", 90), ("10m", "seconds", 600), ("2h", "seconds", 7200),
    ("1e8tok", "tokens", 1e8), ("500steps", "steps", 500), ("1.5h", "seconds", 5400),
])
def test_budgets(text, kind, amount):
    budget = parse_budget(text)
    assert (budget.kind, budget.amount) == (kind, amount)


@pytest.mark.parametrize("text, words", [
    ("", "not understood"), ("10", "not understood"), ("ten minutes", "not understood"),
    ("5 parsecs", "not understood"), ("0steps", "must be a positive"), ("-5m", "must be a positive"),
    ("1e400tok", "must be a positive"),
])
def test_bad_budgets(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_budget(text)


@pytest.mark.parametrize("value", ['["tensorboard", "wandb"]', "[tensorboard, wandb]", "tensorboard,wandb",
                                   "['tensorboard', 'wandb']"])
def test_a_list_setting_from_the_command_line(value):
    assert load_config(None, [f"train.trackers={value}"]).train.trackers == ["tensorboard", "wandb"]
    assert load_config(None, ["train.trackers=[]"]).train.trackers == []


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["model.objective=mlm", "optim.eps=1e-12", "train.budget=2h"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    assert load_config(path) != Config()


def test_every_recipe_loads():
    from pathlib import Path

    recipes = sorted(Path(__file__).parents[1].glob("configs/*.toml"))
    assert len(recipes) >= 5
    for recipe in recipes:
        load_config(recipe)


def test_an_interval_never_suggests_tokens():
    from ember.budget import parse_interval

    with pytest.raises(ConfigError) as err:
        parse_interval("abc", "train.checkpoint_every")
    assert "100steps" in str(err.value) and "tok" not in str(err.value)
    with pytest.raises(ConfigError, match="must be a number of steps"):
        parse_interval("5tok", "train.checkpoint_every")


def test_a_batch_ramp_outside_the_batch_sizes_names_all_three():
    # A cram recipe (batch_start 128) shrunk to a smaller global batch hits this first.
    with pytest.raises(ConfigError, match=r"batch_start \(128\) .*micro_batch \(16\) .*global_batch \(32\)"):
        load_config(overrides=["schedule.batch_start=128", "train.micro_batch=16", "train.global_batch=32"])


def test_an_override_without_a_name_is_refused():
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(overrides=["=1"])
