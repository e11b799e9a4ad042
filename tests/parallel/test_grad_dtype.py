"""parallel.grad_dtype=bf16: gradients cross the wire in bf16 (DDP's compression hook,
FSDP2's reduce_dtype), the steps stay close to fp32 reduction, and the rules around it
(a fp32 run refuses it; the planner prices what the recipe reduces)."""

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from conftest import REPO, TINY
from ember.config import ConfigError, load_config
from ember.layout import Layout, check_run, problems

RECIPE = str(REPO / "configs/tiny-gpt.toml")
WORKER = REPO / "tests/parallel/grad_dtype_worker.py"
# One micro-batch per rank and step, no clipping: the gradients the optimizer sees are
# exactly what the reduction left. bf16 compute, as the rule below asks of bf16 reduction.
COMMON = TINY + ["model.dropout=0", "train.precision=bf16", "train.device=cpu", "train.global_batch=8",
                 "train.micro_batch=4", "optim.clip=0"]
LAYOUTS = [{"name": f"{name}-{dtype}", "set": {"parallel.zero": zero, "parallel.grad_dtype": dtype}}
           for name, zero in (("dp2", 0), ("zero2x2", 2), ("zero3x2", 3)) for dtype in ("fp32", "bf16")]


def launch(dataset, out):
    spec = {"recipe": RECIPE, "common": COMMON, "lr": 1e-3, "steps": 3, "layouts": LAYOUTS}
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"),
                                                                            os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(WORKER), str(dataset), str(out), str(out / "spec.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        first = max(done.stderr.find("Traceback"), 0)
        pytest.fail(done.stderr[first:first + 5000], pytrace=False)
    return {r["name"]: r for r in json.loads((out / "results.json").read_text())}


def test_bf16_reduction_is_bf16_and_close_to_fp32(dataset, tmp_path):
    results = launch(dataset, tmp_path / "launch")
    for name in ("dp2", "zero2x2", "zero3x2"):
        fp32, bf16 = results[f"{name}-fp32"], results[f"{name}-bf16"]
        assert fp32["reduce_dtype"] == "torch.float32" and bf16["reduce_dtype"] == "torch.bfloat16", name
        # Reduced in bf16, every gradient holds bf16 values; reduced in fp32, not all do.
        assert all(bf16["bf16_valued"]) and len(bf16["bf16_valued"]) == 3, name
        assert not any(fp32["bf16_valued"]), name
        assert bf16["loss"][0] == fp32["loss"][0], name  # the same first forward
        assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2), name
        # Only the wire is bf16: DDP's and ZeRO-2/3's gradients are kept in fp32 either way,
        # as the planner prices them (plan/memory.py).
        assert bf16["kept_dtypes"] == fp32["kept_dtypes"] == ["torch.float32"], name


def _cfg(*overrides):
    return load_config(RECIPE, TINY + list(overrides))


def test_a_fp32_run_refuses_bf16_reduction():
    with pytest.raises(ConfigError, match="parallel.grad_dtype=bf16 reduces gradients in bf16"):
        check_run(_cfg("parallel.grad_dtype=bf16", "train.precision=fp32"), 2)
    with pytest.raises(ConfigError, match="auto on a CPU"):
        check_run(_cfg("parallel.grad_dtype=bf16"), 2, device_type="cpu")
    check_run(_cfg("parallel.grad_dtype=bf16"), 2, device_type="cuda")  # auto = bf16 there
    check_run(_cfg("parallel.grad_dtype=bf16", "train.precision=bf16"), 2, device_type="cpu")
    check_run(_cfg("parallel.grad_dtype=bf16"), 1, device_type="cpu")  # one process reduces nothing
    assert not problems(Layout(dp_shard=2), _cfg().model, 8, 2, fp32=True)  # fp32 reduction: no rule
    with pytest.raises(ConfigError, match="parallel.grad_dtype must be one of fp32, bf16"):
        _cfg("parallel.grad_dtype=fp16")


def _plan_args(model, **changes):
    args = dict(model=model, gpu=["H100"], gpus=8, gpus_per_node=None, intra_bw=None, inter_bw=None, profile=None,
                save_profile=None, seq_len=None, global_batch=64, precision="bf16", grad_dtype=None, attention=None,
                stack=None, layout=None, set=[], top=10, explain=False, json=True)
    return Namespace(**(args | changes))


def test_the_planner_prices_the_recipes_gradient_dtype(tmp_path):
    from ember.plan.command import _setup
    from ember.plan.report import train_command
    from ember.plan.search import rank
    from ember.plan.layout import parse_layout

    sized = str(REPO / "configs/gpt2-small.toml")  # the planner needs a recipe that sets its vocabulary
    recipe = tmp_path / "bf16.toml"
    recipe.write_text(open(sized).read() + "\n[parallel]\ngrad_dtype = \"bf16\"\n")
    for path, want in ((sized, "fp32"), (str(recipe), "bf16")):
        model, name, cluster, shape = _setup(_plan_args(path))
        assert cluster.stack.grad_dtype == want
        prediction = rank(model, cluster, shape, [parse_layout("dp=8,mbs=8", 8)])[0]
        assert f"--set parallel.grad_dtype={want}" in train_command(prediction, model, name, cluster, shape)
    assert _setup(_plan_args(sized, grad_dtype="bf16"))[2].stack.grad_dtype == "bf16"  # the flag wins
    assert _setup(_plan_args(str(recipe), stack="megatron"))[2].stack.grad_dtype == "fp32"  # its own software
    assert _setup(_plan_args("llama3-8b"))[2].stack.grad_dtype == "bf16"  # a preset: the stack's
