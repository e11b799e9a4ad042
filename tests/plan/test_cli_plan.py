"""`ember plan` from the command line: the single-layout JSON that other tools read, the
search, profiles, and one sentence with exit status 2 for every mistake."""

import json
import re

import pytest

from conftest import REPO
from ember.cli import main

BASE = ["plan", "--model", "gpt3-175b", "--gpu", "A100-80GB", "--gpus", "1024", "--gpus-per-node", "8",
        "--seq-len", "2048", "--global-batch", "1536"]


def test_single_layout_json(capsys):
    assert main(BASE + ["--layout", "tp=8,pp=16,dp=8,zero=1,mbs=1,recompute=full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gib_per_gpu", "fits"):
        assert key in out, key
    assert out["fits"] is True and 0.1 < out["mfu"] < 0.8 and out["memory_gib_per_gpu"] < 80
    assert out["tokens_per_s_per_gpu"] == pytest.approx(2048 * 1536 / out["step_time_s"] / 1024)
    assert set(out["memory_gib"]) >= {"weights", "grads", "optimizer", "activations"}
    assert "--set parallel.tp=8" in out["command"] and "--nnodes=128" in out["command"]


def test_single_layout_keys_vpp_sp_schedule(capsys):
    assert main(BASE + ["--layout", "tp=8,sp=1,pp=8,vpp=2,schedule=interleaved,dp=16,zero=1,mbs=1,recompute=selective",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "tp=8,sp=1,pp=8,schedule=interleaved,vpp=2,dp=16,zero=1,mbs=1,recompute=selective"
    assert "--set parallel.vpp=2" in out["command"] and "--set parallel.sp=true" in out["command"]


def test_a_schedule_the_named_stack_cannot_run_is_refused(capsys):
    layout = "tp=8,pp=16,schedule=interleaved,vpp=2,dp=8,zero=1,mbs=1,recompute=full"
    assert main(BASE + ["--stack", "deepspeed", "--layout", layout]) == 2
    assert "runs only its own pipeline schedule" in capsys.readouterr().err
    one_f_one_b = layout.replace("interleaved,vpp=2", "1f1b")
    assert main(BASE + ["--stack", "deepspeed", "--layout", one_f_one_b, "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)
    # Megatron-DeepSpeed with DeepSpeed's engine off runs Megatron-LM's schedules: the
    # interleaved one too, and 1F1B without the engine's lockstep.
    assert main(BASE + ["--stack", "megatron-deepspeed", "--layout", layout]) == 0
    capsys.readouterr()
    assert main(BASE + ["--stack", "megatron-deepspeed", "--layout", one_f_one_b, "--json"]) == 0
    megatron_schedule = json.loads(capsys.readouterr().out)
    assert 1.2 < engine["step_time_s"] / megatron_schedule["step_time_s"] < 1.6


def test_a_layout_that_does_not_fit_is_reported_not_refused(capsys):
    assert main(BASE + ["--layout", "tp=2,pp=1,dp=512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["memory_gib_per_gpu"] > 1000


def test_search_text_and_json(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "16", "--seq-len", "8192",
            "--global-batch", "64"]
    assert main(args + ["--explain", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "Best:" in out and "vs " in out and "torchrun --nnodes=2 --nproc-per-node=8" in out
    # The trainer groups the query heads as the planner priced them: no note, and the command says so.
    assert "key/value heads" not in out and "--set model.heads=32 --set model.kv_heads=8 " in out
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ranked = result["ranked"]
    assert result["best"]["layout"] == ranked[0]["layout"] and all(r["fits"] for r in ranked)
    assert [r["step_time_s"] for r in ranked] == sorted(r["step_time_s"] for r in ranked)
    assert not any("key/value heads" in note for note in result["notes"])
    assert "--set model.kv_heads=8 " in result["best"]["command"]


@pytest.mark.parametrize("verb", [["--gpu", "L4", "--save-profile"], ["calibrate", "--quick", "--out"]])
@pytest.mark.parametrize("name, content", [("model.safetensors", b"\x08\x00weights"),
                                           ("manifest.json", b'{"format": "ember-shards/1"}')])
def test_a_profile_never_replaces_a_file_that_is_not_one(tmp_path, capsys, monkeypatch, verb, name, content):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    precious = tmp_path / name
    precious.write_bytes(content)
    assert main(["plan", *verb, str(precious)]) == 2
    err = capsys.readouterr().err
    assert f"{precious} exists and is not an ember-plan-profile/1 file" in err and "Traceback" not in err
    assert precious.read_bytes() == content
    profile = tmp_path / "mine.json"  # a profile is replaced by a profile
    profile.write_text('{"format": "ember-plan-profile/1", "gpu": {"name": "H100"}}')
    assert main(["plan", "--gpu", "L4", "--save-profile", str(profile)]) == 0
    assert json.loads(profile.read_text())["gpu"]["name"] == "L4"


def test_recipe_model_and_profile_round_trip(tmp_path, capsys):
    profile = tmp_path / "l4.json"
    assert main(["plan", "--gpu", "L4", "--gpus-per-node", "4", "--save-profile", str(profile)]) == 0
    capsys.readouterr()
    data = json.loads(profile.read_text())
    assert data["gpu"]["name"] == "L4" and data["links"]["gpus_per_node"] == 4
    data["gpu"]["matmul_eff"] = 0.5  # what a calibration run would write
    profile.write_text(json.dumps(data))
    recipe = str(REPO / "configs/gpt2-small.toml")
    args = ["plan", "--model", recipe, "--gpus", "8", "--global-batch", "64", "--layout", "dp=8", "--json"]
    assert main(args + ["--profile", str(profile)]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert main(args + ["--gpu", "L4", "--gpus-per-node", "4"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert slow["gpu"] == "L4" and slow["step_time_s"] > 1.1 * fast["step_time_s"]
    assert recipe in fast["command"]


@pytest.mark.parametrize("args,words", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--gpu", "B300"], "unknown GPU 'B300'"),
    (["--layout", "tp8"], "is not key=value"),
    (["--layout", "tp=8,pp=two"], "positive whole number"),
    (["--layout", "tp=8,pp=5,dp=4"], "cannot run"),  # 160 GPUs, not 1024
    (["--layout", "tp=8,pp=7,dp=16"], "cannot run"),
    (["--gpus", "1020"], "whole nodes"),
    (["--precision", "fp64"], "--precision must be one of"),
    (["--precision", "fp8", "--stack", "megatron"], "has no FP8 tensor cores"),  # the A100
    (["--precision", "fp8", "--gpu", "H100"], "ember's trainer trains in bf16"),
    (["--precision", "bf16", "--gpu", "V100"], "V100 SXM2 32GB has no bf16 tensor cores"),
    (["--grad-dtype", "fp8"], "--grad-dtype must be one of"),
    (["--profile", "/nonexistent/profile.json"], "does not exist"),
    (["--profile", "/"], "cannot be read"),
    (["--save-profile", "/dev/null/profile.json"], "cannot write the profile"),
    (["--seq-len", "0"], "--seq-len and --global-batch must be at least 1"),
    (["--top", "-1"], "--top must be at least 1"),
    (["--layout", "pp=4,stage_layers=24-24-24-24"], "stage_layers must be layer counts joined by '/'"),
    (["--layout", ""], "--layout is empty"),
    (["--intra-bw", "nan"], "link bandwidths must be positive numbers"),
    (["--inter-bw", "inf"], "link bandwidths must be positive numbers"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
    (["--stack", "deepspeed", "--layout", "tp=8,pp=16,dp=8,zero=2,mbs=1"], "refuses ZeRO-2 and 3 beside pipeline"),
    (["--model", str(REPO / "configs")], "is a folder"),
    (["--layout", "tp=1,sp=1,pp=8,dp=128"], "needs parallel.tp > 1"),  # was dropped without a word
    (["--layout", "zero=-1"], "zero must be 0, 1, 2 or 3"),
    (["--intra-bw", "1e-300"], "0.001 or more"),  # was an OverflowError
])
def test_mistakes_get_one_sentence_and_status_2(args, words, capsys):
    argv = list(BASE)
    for i in range(0, len(args), 2):  # replace or add each option
        if args[i] in argv:
            argv[argv.index(args[i]) + 1] = args[i + 1]
        else:
            argv += args[i:i + 2]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("ember: error:") and err.count("\n") == 1


@pytest.mark.parametrize("profile,words", [
    ({"gpu": {"name": "H100", "flops": 1}}, "has no setting flops"),
    ({"gpu": {"name": "H100"}, "stak": {}}, "unknown section(s) stak"),
    ({"gpu": {"name": "H100", "matmul_eff": 0}}, "gpu matmul_eff = 0 must be a finite number above 0"),
    ({"gpu": {"name": "H100", "matmul_eff": -1}}, "gpu matmul_eff = -1 must be a finite number above 0"),
    ({"gpu": {"name": "H100", "matmul_eff": 5}}, "gpu.matmul_eff is a share of gpu.peak_bf16_flops and at most 1"),
    ({"gpu": {"name": "H100", "hbm_eff": 1.5}}, "gpu.hbm_eff is a share of gpu.hbm_gbps"),
    ({"gpu": {"name": "H100"}, "links": {"gpus_per_node": 0}},
     "links gpus_per_node = 0 must be a whole number above 0"),
    ({"gpu": {"name": "H100"}, "stack": {"attention": "sdpa"}}, "stack.attention must be one of flash, unfused"),
    ({"gpu": {"name": "H100"}, "stack": {"kernel_eff": 0}}, "stack kernel_eff = 0 must be a finite number above 0"),
    ({"gpu": {"name": "H100"}, "stack": {"host_s_per_kernel": -1e-6}},
     "host_s_per_kernel = -1e-06 must be a finite number >= 0"),
    ({"gpu": {"name": "H100"}, "links": []}, "links must be a table of settings"),
    ({"gpu": {"name": "H100"}, "stack": {"name": "Ember"}}, "stack.name must be one of ember, "),
    ({"gpu": {"name": "H100", "peak_bf16_flops": 1e-300}}, "price a step"),  # was a table of nan
])
def test_a_bad_profile_is_one_sentence(profile, words, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(profile))
    assert main(["plan", "--model", "llama3-8b", "--profile", str(bad), "--gpus", "8", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_missing_inputs(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8"]) == 2
    assert "--global-batch" in capsys.readouterr().err


@pytest.mark.parametrize("item,words", [
    ("parallel.tp=2", "ember plan chooses parallel.tp itself"),
    ("train.micro_batch=4", "ember plan chooses train.micro_batch itself"),
    ("train.global_batch=128", "give it to ember plan as --global-batch"),
    ("train.precision=fp16", "give it to ember plan as --precision"),
])
def test_a_recipe_override_of_what_the_plan_chooses_is_refused(item, words, capsys):
    """The printed command would carry both the user's value and the plan's."""
    args = ["plan", "--model", str(REPO / "configs/llama-1b.toml"), "--gpu", "A100-80GB", "--gpus", "8",
            "--global-batch", "64", "--set", item]
    assert main(args) == 2
    assert words in capsys.readouterr().err


def test_deepspeeds_search_keeps_zero_below_2_beside_pipeline_stages(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpu", "A100-80GB", "--gpus", "64", "--global-batch", "512",
            "--stack", "deepspeed", "--json", "--top", "100000"]
    assert main(args) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    pipelined = [r["layout"] for r in ranked if ",pp=1," not in r["layout"]]
    assert pipelined and not any("zero=2" in lo or "zero=3" in lo for lo in pipelined)
    assert any("zero=3" in r["layout"] for r in ranked)  # without stages ZeRO-3 is still searched


def test_layouts_that_do_not_fit_get_no_train_command(capsys):
    args = BASE + ["--layout", "tp=4,pp=1,dp=256", "--layout", "tp=2,pp=1,dp=512"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "none of the layouts fits" in out and "torchrun" not in out
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["command"] is None


def test_a_huge_gpu_count_is_answered(capsys):
    """The search's divisors are found up to the square root (counting to 800 million took minutes)."""
    from ember.plan.layout import divisors

    assert divisors(2**40) == [2**i for i in range(41)]
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))
    assert main(["plan", "--model", "gpt2-small", "--gpu", "A100-80GB", "--gpus", "800000000",
                 "--global-batch", "64"]) == 2
    assert "divides evenly" in capsys.readouterr().err


def test_a_gpu_without_bf16_is_planned_in_fp16_as_the_trainer_runs_there(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpu", "V100", "--gpus", "8", "--seq-len", "2048",
            "--global-batch", "64", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["precision"] == "fp16" and "train.precision=fp16" in out["best"]["command"]
    assert main(args[:-1]) == 0
    assert "fp16; flash attention" in capsys.readouterr().out  # the header names what is priced


def test_a_calibrated_cpu_is_planned_in_the_precision_the_trainer_uses_there(tmp_path, capsys):
    """On a CPU `ember train` computes in fp32 unless the recipe asks for bf16: the plan prices
    that, and its command does not switch the run to bf16."""
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 2e11, "memory_gib": 16},
                                   "links": {"gpus_per_node": 2},
                                   "stack": {"overlap_grad_reduce": False, "overlap_param_gather": False,
                                             "host_overlaps": False}}))
    args = ["plan", "--model", str(REPO / "configs/tiny-gpt.toml"), "--profile", str(profile), "--gpus", "2",
            "--seq-len", "64", "--global-batch", "16", "--set", "model.vocab_size=512", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["precision"] == "fp32" and "train.precision=fp32" in out["best"]["command"]
    assert not any("measured with 2 processes" in note for note in out["notes"])
    assert main([a if a != "2" else "1" for a in args]) == 0  # one process of a profile measured with two
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("measured with 2 processes" in note and "--nproc-per-node 1" in note for note in notes), notes
    assert main(args + ["--set", "train.precision=bf16"]) == 2  # that is --precision's
    capsys.readouterr()
    assert main(args + ["--precision", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"]["precision"] == "bf16"
    assert main(BASE + ["--precision", "fp32", "--stack", "megatron"]) == 2
    assert "trains in mixed precision" in capsys.readouterr().err


def test_the_header_gives_a_small_models_size_readably(capsys):
    args = ["plan", "--model", str(REPO / "configs/tiny-gpt.toml"), "--gpu", "H100", "--gpus", "1",
            "--global-batch", "16", "--set", "model.vocab_size=512"]
    assert main(args) == 0
    assert re.search(r"^tiny-gpt: 1\.\d M parameters,", capsys.readouterr().out)
    assert main(args + ["--set", "model.hidden=32", "--set", "model.mlp_hidden=64"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.search(r": \d{2},\d{3} parameters,", first), first
    assert main(BASE) == 0
    assert re.search(r": 17\d\.\d\d B parameters,", capsys.readouterr().out)


def test_a_recipe_gives_the_global_batch_a_preset_asks_for(capsys):
    """The recipe's train.global_batch (16 in tiny-gpt.toml) is the batch it trains with."""
    args = ["plan", "--model", str(REPO / "configs/tiny-gpt.toml"), "--gpu", "H100", "--gpus", "2",
            "--set", "model.vocab_size=512", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["global_batch"] == 16 and "train.global_batch=16" in out["best"]["command"]
    assert main(args + ["--global-batch", "32"]) == 0  # the flag still decides when given
    assert json.loads(capsys.readouterr().out)["shape"]["global_batch"] == 32
    assert main(["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8"]) == 2
    assert "--global-batch" in capsys.readouterr().err
