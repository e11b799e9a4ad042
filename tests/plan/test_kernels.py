"""Measured matmul and attention times (`ember plan calibrate --model`, plan/kernels.py): the
planner takes them for exactly the shapes it prices, keeps them through a profile file, and a
calibration times every shape the planner would look up for the model it is given."""

import json
from dataclasses import replace

import pytest

from ember.cli import main
from ember.config import ConfigError
from ember.hardware import ShapeTimes, gpu_by_name
from ember.plan.cluster import make_cluster, read_profile, write_profile
from ember.plan.kernels import MAX_TIMED_ATTENTION_S, MAX_TIMED_S, priced_shapes
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS, resolve_model
from ember.plan.predict import predict
from ember.plan.search import search
from ember.plan.flash import flash_s
from ember.plan.timing import matmul_s


def _tiny_recipe(tmp_path):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text('[model]\nvocab_size = 512\nhidden = 64\nlayers = 2\nheads = 4\nmlp_hidden = 128\n'
                      'max_seq_len = 64\n')
    return recipe


def test_a_measured_time_replaces_the_model_for_its_shape_only():
    gpu = gpu_by_name("A100-80GB")
    timed = replace(gpu, matmul_times=ShapeTimes([[4096, 4096, 4096, 1, 0.5]]))
    assert matmul_s(4096, 4096, 4096, timed) == 0.5
    assert matmul_s(4096.0, 4096, 4096.0, timed) == 0.5  # token counts arrive as floats
    assert matmul_s(4096, 4096, 2048, timed) == matmul_s(4096, 4096, 2048, gpu)
    assert matmul_s(4096, 4096, 4096, timed, batch=2) == matmul_s(4096, 4096, 4096, gpu, batch=2)
    assert matmul_s(4096, 4096, 4096, timed, fp8=True) == matmul_s(4096, 4096, 4096, gpu, fp8=True)


@pytest.mark.parametrize("name, seq", [("gpt2-small", 1024), ("bert-base", 512)])  # BERT: 15% of tokens predicted
def test_the_recorded_shapes_are_every_matmul_a_prediction_prices(name, seq):
    # Each recorded shape timed at twice its modelled time: if recording missed a shape, or
    # the lookup keyed one differently, the layout's matmul time would not double (BERT's fractional
    # token counts are timed at the nearest whole count: a few parts in ten thousand).
    model, cluster, shape = PRESETS[name], make_cluster("H100", 8), TrainShape(seq, 64)
    shapes = priced_shapes(model, cluster, shape)[0]
    assert priced_shapes(model, cluster, shape)[0] == shapes  # priced afresh, not answered from a cache
    assert len(shapes) > 20 and all(matmul_s(*s[:3], cluster.gpu, s[3]) <= MAX_TIMED_S for s in shapes)
    table = ShapeTimes([[*s, 2 * matmul_s(*s[:3], cluster.gpu, s[3])] for s in shapes])
    timed = replace(cluster, gpu=replace(cluster.gpu, matmul_times=table))
    firsts = {}  # the fastest layout of each (micro-batch, tp): every token count and width
    for p in search(model, cluster, shape).ranked:
        firsts.setdefault((p.layout.micro_batch, p.layout.tp), p)
    assert len(firsts) >= 8
    for p in firsts.values():
        with_table = predict(model, timed, shape, p.layout)
        assert with_table.detail["matmul_s"] == pytest.approx(2 * p.detail["matmul_s"], rel=2e-3), p.layout
        assert with_table.step_time_s > p.step_time_s


def test_a_measured_attention_replaces_the_model_for_its_shape_only():
    gpu = gpu_by_name("H100")
    timed = replace(gpu, attention_times=ShapeTimes([[2, 32, 4096, 128, 1, 0.25]]))
    assert flash_s(2, 32, 4096, 128, True, timed) == 0.25
    assert flash_s(2, 32, 4096, 128, False, timed) == flash_s(2, 32, 4096, 128, False, gpu)  # not causal: another shape
    assert flash_s(2, 32, 2048, 128, True, timed) == flash_s(2, 32, 2048, 128, True, gpu)
    model, cluster, shape = PRESETS["llama3-8b"], make_cluster("H100", 8), TrainShape(4096, 64)
    layout = search(model, cluster, shape).ranked[0].layout
    b, heads = layout.micro_batch, model.heads // layout.tp
    modelled = flash_s(b, heads, 4096, model.head_dim, True, cluster.gpu)
    table = ShapeTimes([[b, heads, 4096, model.head_dim, 1, 3 * modelled]])
    before = predict(model, cluster, shape, layout)
    after = predict(model, replace(cluster, gpu=replace(cluster.gpu, attention_times=table)), shape, layout)
    assert after.detail["attention_s"] == pytest.approx(3 * before.detail["attention_s"], rel=1e-9)


def test_the_recorded_attention_is_every_attention_a_prediction_prices():
    model, cluster, shape = PRESETS["gpt2-small"], make_cluster("H100", 8), TrainShape(1024, 64)
    shapes = priced_shapes(model, cluster, shape)[1]
    assert len(shapes) >= 4 and all(s[2:] == (1024, model.head_dim, 1) for s in shapes)
    table = ShapeTimes([[*s, 2 * flash_s(*s, cluster.gpu)] for s in shapes])
    timed = replace(cluster, gpu=replace(cluster.gpu, attention_times=table))
    for p in search(model, cluster, shape).ranked[:40]:
        with_table = predict(model, timed, shape, p.layout)
        assert with_table.detail["attention_s"] == pytest.approx(2 * p.detail["attention_s"], rel=1e-9), p.layout


def test_attention_is_timed_up_to_its_own_longer_cap():
    model, cluster, shape = PRESETS["llama3-8b"], make_cluster("H100", 8), TrainShape(8192, 512)
    modelled = [flash_s(*s, cluster.gpu) for s in priced_shapes(model, cluster, shape)[1]]
    assert max(modelled) <= MAX_TIMED_ATTENTION_S and any(t > MAX_TIMED_S for t in modelled)


def test_a_profile_keeps_its_matmul_times(tmp_path):
    cluster = make_cluster("H100", 8)
    table = ShapeTimes([[1024, 4096, 1024, 1, 1e-4], [2048, 128, 2048, 12, 3e-5]])
    out = tmp_path / "profile.json"
    write_profile(replace(cluster, gpu=replace(cluster.gpu, matmul_times=table)), out)
    assert json.loads(out.read_text())["matmuls"]["times"] == table.rows()
    gpu, _, _, _ = read_profile(out)
    assert gpu.matmul_times == table and gpu.name == "H100 SXM"
    attention = ShapeTimes([[4, 32, 2048, 128, 1, 2e-3]])
    write_profile(replace(cluster, gpu=replace(cluster.gpu, attention_times=attention)), out)
    assert json.loads(out.read_text())["attention"]["times"] == attention.rows()
    assert read_profile(out)[0].attention_times == attention
    write_profile(cluster, out)  # none measured: no section
    written = json.loads(out.read_text())
    assert "matmuls" not in written and "attention" not in written and read_profile(out)[0].matmul_times is None


@pytest.mark.parametrize("times", [[[1024, 4096, 1024, 1]], [[1024, 4096, 0, 1, 1e-4]], [[1024, 4096, 1024, 1, -1]],
                                   [[1024.5, 4096, 1024, 1, 1e-4]], "fast"])
def test_a_malformed_matmul_table_is_one_sentence(tmp_path, capsys, times):
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"format": "ember-plan-profile/1", "gpu": {"name": "H100"}, "matmuls": {"times": times}}))
    assert main(["plan", "--profile", str(out), "--model", "gpt2-small", "--gpus", "8", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert "matmuls.times must be a list of [m, n, k, batch, seconds]" in err and "Traceback" not in err


@pytest.mark.parametrize("times", [[[4, 32, 2048, 128, 1]], [[4, 32, 2048, 128, 2, 1e-3]],
                                   [[4, 0, 2048, 128, 1, 1e-3]]])
def test_a_malformed_attention_table_is_one_sentence(tmp_path, capsys, times):
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"format": "ember-plan-profile/1", "gpu": {"name": "H100"},
                               "attention": {"times": times}}))
    assert main(["plan", "--profile", str(out), "--model", "gpt2-small", "--gpus", "8", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert "attention.times must be a list of [batch, heads, seq, head_dim, causal, seconds]" in err
    assert "Traceback" not in err


def test_calibrate_with_a_model_times_its_matmuls_and_plan_takes_them(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    recipe, out = _tiny_recipe(tmp_path), tmp_path / "cpu.json"
    assert main(["plan", "calibrate", "--out", str(out), "--quick", "--model", str(recipe),
                 "--gpus", "2", "--global-batch", "8"]) == 0
    assert "matmul shapes of tiny" in capsys.readouterr().out
    profile = json.loads(out.read_text())
    section = profile["matmuls"]
    assert (section["model"], section["gpus"], section["seq_len"], section["global_batch"]) == ("tiny", 2, 64, 8)
    cluster = make_cluster(None, 2, profile=out)
    expected, attention = priced_shapes(resolve_model(str(recipe))[0], replace(
        cluster, gpu=replace(cluster.gpu, matmul_times=None, attention_times=None)), TrainShape(64, 8))
    assert [tuple(row[:4]) for row in section["times"]] == expected
    assert all(row[4] > 0 for row in section["times"])
    assert cluster.gpu.matmul_times is not None and len(cluster.gpu.matmul_times) == len(expected)
    # the tiny model's attention at each micro-batch and tp, causal, every one timed
    assert attention and all(shape[2:] == (64, 16, 1) for shape in attention)
    assert [tuple(row[:5]) for row in profile["attention"]["times"]] == attention
    assert cluster.gpu.attention_times == ShapeTimes(profile["attention"]["times"])
    assert main(["plan", "--profile", str(out), "--model", str(recipe), "--gpus", "2", "--global-batch", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts_fitting"] > 0
    assert main(["plan", "--profile", str(out), "--model", str(recipe), "--gpus", "2", "--global-batch", "8"]) == 0
    assert f"({len(expected)} matmul shapes and {len(attention)} attention shapes measured;" in capsys.readouterr().out


def test_calibrate_takes_a_recipes_global_batch_and_a_preset_must_give_one(tmp_path):
    from types import SimpleNamespace

    from ember.plan.command import _model_plan

    recipe = _tiny_recipe(tmp_path)
    recipe.write_text(recipe.read_text() + "\n[train]\nglobal_batch = 32\n")
    args = SimpleNamespace(model=str(recipe), set=[], gpus=None, seq_len=None, global_batch=None)
    assert _model_plan(args)[2] == TrainShape(64, 32)
    args.global_batch = 8  # the flag wins
    assert _model_plan(args)[2] == TrainShape(64, 8)
    with pytest.raises(ConfigError, match="with a preset --model, say the global batch"):
        _model_plan(SimpleNamespace(model="gpt2-small", set=[], gpus=None, seq_len=None, global_batch=None))


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8"], "give the model with --model"),
    (["--model", "gpt2-small"], "--global-batch"),
    (["--model", "gpt9", "--global-batch", "8"], "unknown model"),
    (["--model", "gpt2-small", "--global-batch", "0"], "--global-batch must be at least 1"),
])
def test_calibrate_refuses_bad_model_flags_before_measuring(tmp_path, capsys, monkeypatch, args, message):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "p.json"
    assert main(["plan", "calibrate", "--out", str(out), "--quick"] + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not out.exists()
