"""FP8 training and overlapped tensor-parallel communication, as the planner prices other
stacks' runs: what gets faster, by how much at most, and what does not change."""

import dataclasses
import json

import pytest

from ember.cli import main
from ember.hardware import gpu_by_name
from ember.layout import Layout
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.memory import memory
from ember.plan.models import PRESETS
from ember.plan.predict import predict
from ember.plan.stacks import stack
from ember.plan.timing import layer_times, matmul_s

H100 = gpu_by_name("H100")
LLAMA = PRESETS["llama3-70b"]


def test_fp8_matmuls_are_at_most_twice_as_fast_and_near_it_only_when_large():
    big = matmul_s(8192, 8192, 8192, H100) / matmul_s(8192, 8192, 8192, H100, fp8=True)
    assert 1.8 < big < 2.0  # the fixed prologue and epilogue of every tile do not get faster
    small = matmul_s(1024, 1024, 256, H100) / matmul_s(1024, 1024, 256, H100, fp8=True)
    assert 1.0 < small < big


def test_fp8_speeds_up_the_weight_matmuls_and_pays_for_its_casts():
    cluster = make_cluster("H100", 8, 8, stack=stack("megatron"))
    args = (LLAMA, H100, cluster.links, 8192, 1, 8, True, "none", "flash")
    bf16, fp8 = layer_times(*args), layer_times(*args, 1, True)
    assert fp8.forward.matmul < 0.6 * bf16.forward.matmul
    assert fp8.forward.attention == bf16.forward.attention  # attention stays bf16
    assert fp8.forward.elementwise > bf16.forward.elementwise  # the casts
    assert fp8.forward.launch > bf16.forward.launch
    # End to end a large model gains well under 2x: attention, norms, communication and the
    # output layer stay as they were.
    lo = Layout(tp=8, sp=True, pp=1, dp_shard=1, zero=1, micro_batch=1, recompute="none")
    gain = (predict(LLAMA, cluster, TrainShape(8192, 64, "fp8"), lo).tokens_per_s_per_gpu
            / predict(LLAMA, cluster, TrainShape(8192, 64), lo).tokens_per_s_per_gpu)
    assert 1.15 < gain < 1.8


def test_fp8_keeps_the_matmul_inputs_in_one_byte():
    lo = Layout(tp=8, sp=True, pp=1, dp_shard=1, zero=1, micro_batch=1, recompute="none")
    bf16 = memory(LLAMA, lo, TrainShape(8192, 8), H100, 4, "flash", stack("megatron"))
    fp8 = memory(LLAMA, lo, TrainShape(8192, 8, "fp8"), H100, 4, "flash", stack("megatron"))
    assert fp8.activations < bf16.activations and fp8.weights == bf16.weights
    full = dataclasses.replace(lo, recompute="full")  # only the layer input is kept, not cast
    assert (memory(LLAMA, full, TrainShape(8192, 8, "fp8"), H100, 4, "flash", stack("megatron")).activations
            == memory(LLAMA, full, TrainShape(8192, 8), H100, 4, "flash", stack("megatron")).activations)


def test_overlapped_tensor_parallel_communication_hides_behind_the_matmuls():
    plain, overlapped = stack("megatron"), stack("nemo")
    assert overlapped.overlap_tp_comm and not plain.overlap_tp_comm
    links = make_cluster("H100", 8, 8).links
    args = (LLAMA, H100, links, 8192, 1, 8)
    hidden = layer_times(*args, True, "none", "flash", 1, False, True)
    exposed = layer_times(*args, True, "none", "flash", 1, False, False)
    assert hidden.forward.tp_comm < 0.5 * exposed.forward.tp_comm
    assert hidden.forward.matmul == exposed.forward.matmul
    # Without sequence parallelism (all-reduces) nothing overlaps.
    assert (layer_times(*args, False, "none", "flash", 1, False, True).forward.tp_comm
            == layer_times(*args, False, "none", "flash", 1, False, False).forward.tp_comm)


def test_nemo_keeps_and_reduces_gradients_in_bf16_where_megatron_lm_accumulates_fp32():
    """NeMo's performance recipes set grad_reduce_in_fp32 false; Megatron-LM accumulates a
    bf16 run's gradients in fp32 unless told otherwise: half the gradient buffer, half the
    bytes reduced."""
    assert stack("nemo").grad_bytes == 2 and stack("megatron").grad_bytes == 4
    shape, lo = TrainShape(8192, 8), Layout(tp=1, dp_shard=8, zero=1, micro_batch=1, recompute="full")
    nemo, megatron = (predict(LLAMA, make_cluster("H100", 8, 8, stack=stack(name)), shape, lo)
                      for name in ("nemo", "megatron"))
    assert nemo.memory.grads == pytest.approx(megatron.memory.grads / 2)


def test_fp8_from_the_command_line(capsys):
    base = ["plan", "--model", "llama3-70b", "--gpu", "H100", "--gpus", "64", "--seq-len", "8192",
            "--global-batch", "128", "--stack", "nemo", "--layout",
            "tp=4,sp=1,pp=4,schedule=interleaved,vpp=5,dp=4,zero=1,mbs=1,recompute=none", "--json"]
    assert main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main(base + ["--precision", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["step_time_s"] < 0.85 * bf16["step_time_s"]
    assert fp8["memory_gib_per_gpu"] < bf16["memory_gib_per_gpu"]


@pytest.mark.parametrize("gpu,has", [("H100", True), ("H200", True), ("L40S", True), ("A100-80GB", False),
                                     ("V100 SXM2 32GB", False)])
def test_which_gpus_multiply_in_fp8(gpu, has):
    assert gpu_by_name(gpu).fp8 is has


def test_fp8_predictions_are_held_to_what_fp8_runs_published():
    from ember.plan.uncertainty import interval

    lo = Layout(tp=8, sp=True, dp_shard=8, zero=1, micro_batch=1)
    assert interval(lo, "H100 SXM", 1000.0, 0.7)["above_published"] is True  # beyond any bf16 run
    assert interval(lo, "H100 SXM", 1000.0, 0.7, "fp8")["above_published"] is False
    assert interval(lo, "H100 SXM", 1000.0, 0.9, "fp8")["above_published"] is True
    # FP8 runs carry their own spread (the 48 public FP8 rows), wider than bf16 tensor
    # parallelism's on the optimistic side.
    bf16, fp8 = interval(lo, "H100 SXM", 1000.0, 0.4), interval(lo, "H100 SXM", 1000.0, 0.4, "fp8")
    assert (bf16["kind"], fp8["kind"]) == ("tensor", "fp8")
    assert fp8["tokens_per_s_per_gpu"][0] < bf16["tokens_per_s_per_gpu"][0]


def test_blackwell_is_priced_from_its_datasheet():
    b200, gb200 = gpu_by_name("B200"), gpu_by_name("GB200")
    assert b200.fp8 and gb200.peak_bf16_flops > b200.peak_bf16_flops > 2 * H100.peak_bf16_flops
    lo = Layout(tp=8, sp=True, pp=1, dp_shard=1, zero=1, micro_batch=1, recompute="none")
    shape = TrainShape(8192, 64, "fp8")
    h100 = predict(LLAMA, make_cluster("H100", 8, 8, stack=stack("nemo")), shape, lo)
    blackwell = predict(LLAMA, make_cluster("B200", 8, 8, stack=stack("nemo")), shape, lo)
    assert 1.5 < blackwell.tokens_per_s_per_gpu / h100.tokens_per_s_per_gpu < 2.5


def test_fp32_on_a_gpu_multiplies_at_tf32_or_cuda_core_rates():
    from ember.hardware import at_fp32

    model, shape = PRESETS["llama3-8b"], TrainShape(4096, 64)
    lo = Layout(dp_shard=8, zero=3, recompute="full")
    for gpu, low, high in (("H100", 1.7, 2.0), ("V100", 6.0, 8.0)):  # TF32 at half bf16; fp32 FMA at 1/8 fp16
        cluster = make_cluster(gpu, 8)
        fast = predict(model, cluster, dataclasses.replace(shape, precision="fp16" if gpu == "V100" else "bf16"), lo)
        slow = predict(model, cluster, dataclasses.replace(shape, precision="fp32"), lo)
        assert low < slow.detail["matmul_s"] / fast.detail["matmul_s"] < high, gpu
        assert low < slow.detail["attention_s"] / fast.detail["attention_s"] <= 8.0, gpu
        assert slow.mfu < fast.mfu  # against the same (bf16 datasheet) peak
    cpu = dataclasses.replace(make_cluster("H100", 1).gpu, name="cpu (calibrated)")
    assert at_fp32(cpu) is cpu  # a calibrated CPU's peak is already its fp32 rate
