"""GPU names users type, the planner's fields of the GPU table, and cluster profiles."""

import json

import pytest

from ember.cli import main
from ember.config import ConfigError
from ember.plan.cluster import make_cluster, read_profile
from ember.hardware import GPUS, find_gpu, gpu_by_name


@pytest.mark.parametrize("typed,name", [
    ("A100-40GB", "A100 SXM4 40GB"), ("A100-80GB", "A100 SXM4 80GB"), ("a100", "A100 SXM4 80GB"),
    ("A800", "A800 SXM4 80GB"), ("H100", "H100 SXM"), ("h800", "H800 SXM"), ("H200", "H200 SXM"),
    ("L4", "L4"), ("RTX 4090", "RTX 4090"), ("rtx-2080-ti", "RTX 2080 Ti"), ("H100 PCIe", "H100 PCIe"),
    ("V100", "V100 SXM2 32GB"), ("V100-16GB", "V100 SXM2 16GB"), ("A6000", "RTX A6000"),
    ("rtx a4000", "RTX A4000"), ("T4", "T4"), ("A40", "A40"),
])
def test_short_names(typed, name):
    assert gpu_by_name(typed).name == name


@pytest.mark.parametrize("typed", ["B300", "", "H20", "4080"])
def test_unknown_names(typed):
    assert gpu_by_name(typed) is None


@pytest.mark.parametrize("reported,name", [
    ("NVIDIA RTX A6000", "RTX A6000"), ("NVIDIA RTX A4000", "RTX A4000"), ("NVIDIA A40", "A40"),
    ("Tesla T4", "T4"), ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB"), ("Tesla V100-SXM2-16GB", "V100 SXM2 16GB"),
])
def test_names_devices_report(reported, name):
    """What torch.cuda.get_device_name says: the trainer's MFU and the calibration read it."""
    assert find_gpu(reported).name == name


def test_only_pre_ampere_cards_lack_bf16():
    assert {gpu.name for gpu in GPUS if not gpu.bf16} == {"T4", "RTX 2080 Ti", "V100S PCIe 32GB", "V100 SXM2 32GB",
                                                          "V100 SXM2 16GB", "V100 PCIe 32GB", "V100 PCIe 16GB"}


def test_planner_fields_are_sane():
    for gpu in GPUS:
        assert 100 <= gpu.hbm_gbps <= 8000 and 40 <= gpu.sms <= 160
        assert 0.5 <= gpu.matmul_eff <= 0.9 and 0.3 <= gpu.attn_eff <= 0.7
        assert 1 <= gpu.inter_gbps <= gpu.intra_gbps <= 900  # NVLink 5: 1.8 TB/s both ways
    a800, a100 = gpu_by_name("A800"), gpu_by_name("A100-80GB")
    assert a800.intra_gbps < a100.intra_gbps and a800.peak_bf16_flops == a100.peak_bf16_flops


def test_overrides_and_whole_nodes():
    cluster = make_cluster("H100", 32, gpus_per_node=4, intra_gbps=300, inter_gbps=25)
    assert (cluster.nodes, cluster.links.intra_gbps, cluster.links.inter_gbps) == (8, 300, 25)
    assert make_cluster("H100", 4).gpus_per_node == 4  # a part of one node
    with pytest.raises(ConfigError, match="whole nodes"):
        make_cluster("H100", 12)
    with pytest.raises(ConfigError, match="positive"):
        make_cluster("H100", 8, intra_gbps=0)


def test_profile_of_an_unlisted_gpu(tmp_path):
    path = tmp_path / "mi.json"
    path.write_text(json.dumps({"gpu": {"name": "MI300X", "peak_bf16_flops": 1.3e15, "memory_gib": 192,
                                        "hbm_gbps": 5300, "matmul_eff": 0.6},
                                "links": {"gpus_per_node": 8, "intra_gbps": 64}}))
    gpu, links, stack, source = read_profile(path)
    assert (gpu.name, gpu.memory_gib, gpu.matmul_eff) == ("MI300X", 192, 0.6)
    assert (links.intra_gbps, links.inter_gbps, stack.attention) == (64, 1.5625, "flash")
    path.write_text(json.dumps({"gpu": {"name": "MI300X"}}))
    with pytest.raises(ConfigError, match="must be given"):
        read_profile(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_profile(path)


@pytest.mark.parametrize("key", ["all_gather_ratio", "reduce_scatter_ratio"])
def test_a_collective_ratio_of_zero_in_a_profile_is_refused(tmp_path, capsys, key):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"gpu": {"name": "H100"}, "links": {key: 0}}))
    assert main(["plan", "--profile", str(path), "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert f"links {key} = 0 must be a finite number above 0" in err and "Traceback" not in err
