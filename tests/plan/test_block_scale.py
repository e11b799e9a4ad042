"""The measured rest of a block (`ember plan calibrate --model`, plan/kernels.py): the
profiler's time outside matmuls and attention, set beside the planner's price as the stack's
`eager_elementwise_scale`, which scales the blocks' elementwise work of uncompiled ember runs."""

import json
from dataclasses import replace

import pytest
import torch

from ember.cli import main
from ember.plan.cluster import make_cluster
from ember.plan.kernels import block_micro_batch, block_rest_s, elementwise_scale
from ember.plan.layout import TrainShape, parse_layout
from ember.plan.models import PRESETS, ModelSpec, resolve_model
from ember.plan.predict import element_width, predict
from ember.plan.timing import Work, layer_times
from ember.tune.host_cost import model_block_step


def _with_scale(cluster, scale, **stack):
    return replace(cluster, stack=replace(cluster.stack, eager_elementwise_scale=scale, **stack))


@pytest.mark.parametrize("text", ["tp=1,mbs=2", "tp=2,sp=1,mbs=1,recompute=selective"])
def test_the_scale_multiplies_the_blocks_elementwise_work_of_uncompiled_ember_only(text):
    model, shape = PRESETS["gpt2-small"], TrainShape(1024, 64)
    cluster, lo = make_cluster("A100-80GB", 8), parse_layout(text, 8)
    base = predict(model, cluster, shape, lo)
    doubled = predict(model, _with_scale(cluster, 2.0), shape, lo)
    # the blocks' own elementwise work, once more: every pass of every layer on every micro-batch
    layers = layer_times(model, cluster.gpu, cluster.links, 1024, lo.micro_batch, lo.tp, lo.sp,
                         cluster.stack.recompute_policy(lo.recompute), cluster.stack.attention,
                         element_width(shape), False, cluster.stack.overlap_tp_comm, 1, cluster.stack.fused_elementwise)
    per_pass = layers.forward.elementwise + layers.backward.elementwise + layers.recompute.elementwise
    extra = lo.micro_batches(64) * model.layers * per_pass
    assert extra > 0
    assert doubled.detail["elementwise_s"] - base.detail["elementwise_s"] == pytest.approx(extra, rel=1e-6)
    assert doubled.step_time_s > base.step_time_s
    assert doubled.detail["matmul_s"] == base.detail["matmul_s"]
    for other in (_with_scale(cluster, 2.0, compiled=True), _with_scale(cluster, 2.0, name="megatron")):
        assert predict(model, other, shape, lo).detail["elementwise_s"] == pytest.approx(
            predict(model, replace(other, stack=replace(other.stack, eager_elementwise_scale=1.0)), shape,
                    lo).detail["elementwise_s"])


def test_the_scale_is_the_rest_less_what_is_priced_apart():
    priced = Work(matmul=1.0, attention=0.5, elementwise=0.01, launch=0.002)
    assert elementwise_scale(0.032, priced, host_shares_cores=True) == pytest.approx(3.0)
    assert elementwise_scale(0.032, priced, host_shares_cores=False) == pytest.approx(3.2)
    assert elementwise_scale(0.0015, priced, host_shares_cores=True) is None  # nothing left: the model stays
    assert elementwise_scale(0.01, Work(matmul=1.0), host_shares_cores=False) is None


def test_the_rest_is_the_time_outside_matmuls_and_attention():
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = torch.randn(1_000_000)
    q = torch.randn(1, 2, 64, 32)

    def kernels_only():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return a @ b

    def with_elementwise():
        kernels_only()
        for _ in range(4):
            (x * 1.5 + 2.0).exp_()

    device = torch.device("cpu")
    small, large = block_rest_s(kernels_only, device), block_rest_s(with_elementwise, device)
    assert small < 0.5 * large  # the matmul and the attention are not counted; the elementwise ops are
    assert large > 1e-4


def test_model_block_step_builds_the_models_block_where_ember_has_one():
    spec = ModelSpec("small-llama", 2, 64, 4, 160, 512, kv_heads=2, activation="swiglu", positions="rotary",
                     norm="rmsnorm", max_seq_len=32)
    for dtype in (torch.float32, torch.bfloat16):
        step = model_block_step(spec, 2, 32, torch.device("cpu"), dtype)
        step()  # forward and backward of a GQA, rotary, RMSNorm, SwiGLU block
    assert model_block_step(PRESETS["bloom-176b"], 1, 16, torch.device("cpu"), torch.float32) is None  # ALiBi


def test_a_scale_of_zero_in_a_profile_is_refused(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"gpu": {"name": "A100-80GB"}, "stack": {"eager_elementwise_scale": 0}}))
    assert main(["plan", "--profile", str(path), "--model", "gpt2-small", "--gpus", "8", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert "stack eager_elementwise_scale = 0 must be a finite number above 0" in err and "Traceback" not in err


def test_calibrate_with_a_model_measures_its_blocks_rest_and_plan_takes_it(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    recipe, out = tmp_path / "tiny.toml", tmp_path / "cpu.json"
    recipe.write_text('[model]\nvocab_size = 512\nhidden = 64\nlayers = 2\nheads = 4\nmlp_hidden = 128\n'
                      'max_seq_len = 64\nactivation = "swiglu"\nnorm = "rmsnorm"\npositions = "rotary"\n')
    assert main(["plan", "calibrate", "--out", str(out), "--quick", "--dtype", "fp32", "--model", str(recipe),
                 "--gpus", "1", "--global-batch", "8"]) == 0
    assert "outside its matmuls and attention" in capsys.readouterr().out
    profile = json.loads(out.read_text())
    block, cluster = profile["measured"]["block"], make_cluster(None, 1, profile=out)
    model = resolve_model(str(recipe))[0]
    as_searched = replace(cluster, gpu=replace(cluster.gpu, matmul_times=None, attention_times=None),
                          stack=replace(cluster.stack, eager_elementwise_scale=1.0))  # before the kernels were timed
    assert block["micro_batch"] == block_micro_batch(model, as_searched, TrainShape(64, 8))
    assert block["rest_s"] > 0 and block["elementwise_s"] > 0
    # On a CPU the eager block's rest is its elementwise work and every operator's dispatch,
    # which the copy rate and the modelled launches leave out.
    assert block["scale"] > 1
    assert cluster.stack.eager_elementwise_scale == round(block["scale"], 4)
    assert main(["plan", "--profile", str(out), "--model", str(recipe), "--gpus", "1", "--global-batch", "8",
                 "--precision", "fp32"]) == 0
    assert "the blocks' elementwise work at" in capsys.readouterr().out

