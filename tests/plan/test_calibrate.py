"""`ember plan calibrate`: a profile measured on this machine, alone and under torchrun with
gloo, that `ember plan --profile` accepts; and how measurements become planner numbers."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import REPO
from ember.cli import main
from ember.plan import comm
from ember.plan.calibrate import BUS_FACTOR, attention_efficiency, build_profile
from ember.plan.cluster import make_cluster
from ember.hardware import gpu_by_name
from ember.plan.flash import flash_efficiency


def _tiny_recipe(tmp_path):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text('[model]\nvocab_size = 512\nhidden = 32\nlayers = 2\nheads = 2\nmlp_hidden = 64\n'
                      'max_seq_len = 64\n')
    return recipe


def test_alone_measures_matmuls_and_plan_accepts_the_profile(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "cpu.json"
    assert main(["plan", "calibrate", "--out", str(out), "--quick"]) == 0
    assert "best matmul" in capsys.readouterr().out
    profile = json.loads(out.read_text())
    measured = profile["measured"]
    assert profile["format"] == "ember-plan-profile/1" and profile["source"].startswith("calibrated")
    assert profile["gpu"]["name"] == "cpu (calibrated)" and profile["gpu"]["memory_gib"] > 0.5
    rates = [row["tflops"] for row in measured["matmul"]]
    assert len(rates) >= 3 and min(rates) > 0
    # The best shape is the peak the planner's efficiencies apply to.
    assert profile["gpu"]["peak_bf16_flops"] == pytest.approx(max(rates) * 1e12)
    assert measured["copy_gbps"] > 0 and "intra" not in measured  # one process: no collectives
    assert measured["attention"]["tflops"] > 0 and profile["gpu"]["attn_eff"] > 0
    assert not list(tmp_path.glob("*.tmp"))

    assert main(["plan", "--profile", str(out), "--model", str(_tiny_recipe(tmp_path)), "--gpus", "1",
                 "--global-batch", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cluster"]["gpu"]["name"] == "cpu (calibrated)" and plan["layouts_fitting"] > 0


def test_under_torchrun_with_gloo_measures_collectives(tmp_path):
    out = tmp_path / "cpu2.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "ember", "plan", "calibrate", "--out", str(out), "--quick"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("wrote") == 1  # rank 0 alone reports and writes
    assert "host time per block pass" in run.stdout and "reshard" in run.stdout  # the host figures, printed
    assert "deprecated" not in run.stderr  # PyTorch's collectives called by their current names
    profile = json.loads(out.read_text())
    intra = profile["measured"]["intra"]
    assert set(intra) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        sizes = [row["bytes"] for row in intra[kind]]
        assert sizes == sorted(sizes) and len(sizes) >= 4
        for row in intra[kind]:  # nccl-tests' convention, n = 2
            assert row["busbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9 * BUS_FACTOR[kind](2))
    best = max(row["busbw_gbps"] for row in intra["all_reduce"])
    assert profile["links"]["gpus_per_node"] == 2
    assert profile["links"]["intra_gbps"] == pytest.approx(best, rel=1e-3)
    assert profile["links"]["intra_latency_s"] == intra["all_reduce"][0]["time_s"]
    # The planner prices a 2-rank ring on the measured bus bandwidth.
    cluster = make_cluster(None, 2, profile=out)
    assert comm.bus_bandwidth(comm.Group(2, 2), cluster.links) == pytest.approx(best * 1e9, rel=1e-3)
    # ... and an all-gather or a reduce-scatter on its own measured rate (gloo runs them as
    # other algorithms than its all-reduce); ZeRO's gathers and reductions are priced so.
    for kind in ("all_gather", "reduce_scatter"):
        own = max(row["busbw_gbps"] for row in intra[kind])
        assert profile["links"][f"{kind}_ratio"] == pytest.approx(own / best, rel=1e-3)
        assert comm.bus_bandwidth(comm.Group(2, 2), cluster.links, kind) == pytest.approx(own * 1e9, rel=2e-3)
    assert comm.all_gather_s(2**24, comm.Group(2, 2), cluster.links) == pytest.approx(
        comm.ring_latency_s(1, comm.Group(2, 2), cluster.links) + 2**23 / (cluster.links.intra_gbps * 1e9
                                                                           * cluster.links.all_gather_ratio))
    # Eager tensor parallelism's host cost: the split block issues the four all-reduces the
    # planner prices, and what it costs beyond them reaches the profile's stack.
    block = profile["measured"]["host_blocks"]["tp"]
    assert block["collectives"] == 4 and block["split_s"] > block["plain_s"] > 0
    assert cluster.stack.tp_host_s_per_layer == block["tp_host_s_per_layer"] >= 0
    # FSDP2's: kept after forward, one gather and one reduce-scatter a pass; resharded
    # (ZeRO-3), gathered again for backward; what each adds beyond them reaches the stack.
    sharded = profile["measured"]["host_blocks"]["sharded"]
    assert sharded["shard_collectives"] == ["all_gather", "reduce_scatter"]
    assert sharded["reshard_collectives"] == ["all_gather", "all_gather", "reduce_scatter"]
    assert sharded["reshard_s"] > sharded["plain_s"] > 0 and sharded["shard_s"] > sharded["plain_s"]
    assert cluster.stack.shard_host_s_per_layer == sharded["shard_host_s_per_layer"] >= 0
    assert cluster.stack.reshard_host_s_per_layer == sharded["reshard_host_s_per_layer"] >= 0
    assert cluster.stack.host_overlaps is False  # a CPU: dispatch and compute share the cores


def _rows(busbw_gbps, latency_s):
    return [{"bytes": 1024, "time_s": latency_s, "busbw_gbps": 0.01},
            {"bytes": 2**30, "time_s": 1.0, "busbw_gbps": busbw_gbps}]


def test_a_table_gpu_keeps_its_datasheet_and_gets_measured_efficiencies(tmp_path):
    h100 = gpu_by_name("H100")
    matmuls = [{"m": 4096, "n": 4096, "k": 4096, "tflops": 600.0}, {"m": 8192, "n": 8192, "k": 8192, "tflops": 700.0}]
    collectives = {"intra": {"all_reduce": _rows(360.0, 30e-6)}, "inter": {"all_reduce": _rows(320.0, 60e-6)}}
    profile = build_profile(h100, {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6, "sms": 132}, "bf16",
                            matmuls, 2680.0, collectives, world=16, local_world=8)
    gpu, links = profile["gpu"], profile["links"]
    assert gpu["name"] == "H100 SXM" and "peak_bf16_flops" not in gpu  # the MFU convention stays
    assert gpu["matmul_eff"] == pytest.approx(700e12 / h100.peak_bf16_flops, abs=1e-4)
    assert gpu["hbm_eff"] == pytest.approx(2680 / h100.hbm_gbps, abs=1e-4)
    assert links["intra_eff"] == pytest.approx(360 / 450, abs=1e-4) and links["intra_latency_s"] == 30e-6
    # A ring over 2 nodes of 8 drives 8 NICs: each GPU's share is busbw / 8.
    assert links["inter_eff"] == pytest.approx(320 / 8 / 50, abs=1e-4) and links["inter_latency_s"] == 60e-6
    path_profile = make_cluster(None, 16, profile=_write(profile, tmp_path))
    assert path_profile.gpu.matmul_eff == gpu["matmul_eff"] and path_profile.nodes == 2
    assert comm.bus_bandwidth(comm.Group(16, 8), path_profile.links) == pytest.approx(320e9, rel=1e-3)


def _write(profile, folder):
    path = folder / "profile.json"
    path.write_text(json.dumps(profile))
    return path


def test_attention_efficiency_reproduces_the_measured_rate_in_the_planner():
    h100 = gpu_by_name("H100")
    measured = {"batch": 8, "heads": 16, "seq": 4096, "head_dim": 128, "tflops": 380.0}
    eff = attention_efficiency(measured, h100)
    planner = replace(h100, attn_eff=eff)
    assert h100.peak_bf16_flops * flash_efficiency(4096, 128, planner) == pytest.approx(380e12, rel=1e-3)
    profile = build_profile(h100, {"name": "H100", "memory_gib": 80, "sms": 132}, "bf16",
                            [{"m": 8192, "n": 8192, "k": 8192, "tflops": 700.0}], 2680.0, {}, 1, 8, measured)
    assert profile["gpu"]["attn_eff"] == eff and profile["measured"]["attention"] == measured


def test_an_unknown_device_takes_the_measured_rates(tmp_path):
    matmuls = [{"m": 512, "n": 512, "k": 512, "tflops": 0.05}, {"m": 1024, "n": 1024, "k": 1024, "tflops": 0.08}]
    profile = build_profile(None, {"name": "cpu (calibrated)", "memory_gib": 12.0, "sms": 2}, "fp32", matmuls,
                            20.0, {"intra": {"all_reduce": _rows(0.7, 1e-3)}}, world=2, local_world=2)
    gpu, links = profile["gpu"], profile["links"]
    assert gpu["peak_bf16_flops"] == pytest.approx(0.08e12) and gpu["matmul_eff"] == 1.0
    assert gpu["hbm_gbps"] == 20.0 and gpu["memory_gib"] == 12.0
    assert links["intra_gbps"] == 0.7 and links["intra_eff"] == 1.0 and links["gpus_per_node"] == 2
    cluster = make_cluster(None, 2, profile=_write(profile, tmp_path))
    assert cluster.gpu.peak_bf16_flops == pytest.approx(0.08e12)


def test_out_must_be_a_file(tmp_path, capsys):
    assert main(["plan", "calibrate", "--out", str(tmp_path), "--quick"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_two_nodes_of_two_measure_intra_and_inter(tmp_path):
    # Four ranks as two "nodes" of two (LOCAL_WORLD_SIZE < WORLD_SIZE), started by hand
    # the way torchrun would on two machines.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "2x2.json"
    procs = []
    for rank in range(4):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "ember", "plan", "calibrate", "--out", str(out),
                                       "--quick"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], logs
    profile = json.loads(out.read_text())
    measured, links = profile["measured"], profile["links"]
    assert set(measured["intra"]) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert set(measured["inter"]) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for row in measured["inter"]["all_reduce"]:  # a 4-rank ring
        assert row["busbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9 * 1.5)
    inter = max(row["busbw_gbps"] for row in measured["inter"]["all_reduce"])
    assert links["gpus_per_node"] == 2 and links["inter_gbps"] == pytest.approx(inter / 2, rel=1e-3)
    cluster = make_cluster(None, 4, profile=out)
    assert cluster.nodes == 2
    # The planner's 2-node ring (2 ranks per node, one NIC each) is priced at the measured busbw.
    expected = min(links["intra_gbps"], inter) * 1e9
    assert comm.bus_bandwidth(comm.Group(4, 2), cluster.links) == pytest.approx(expected, rel=1e-3)


def test_a_measurement_keeps_its_fastest_burst():
    """Another process slowing one burst down must not set the machine's rate: a call that
    is slow only while the first burst runs is timed at its later, fast speed."""
    import time

    import torch

    from ember.plan.calibrate import _timed

    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.02 if len(calls) <= 6 else 0.002)

    seconds = _timed(fn, torch.device("cpu"), min_time=0.05)
    assert len(calls) > 7  # it went on past the slow spell
    assert seconds < 0.005


def test_a_part_faster_than_its_table_entry_raises_the_peak(tmp_path):
    """A profile's efficiencies are shares of a peak and at most 1 (the profile reader refuses
    more): a measured rate above the datasheet's becomes the peak."""
    h100 = gpu_by_name("H100")
    profile = build_profile(h100, {"name": "H100", "memory_gib": 80, "sms": 132}, "bf16",
                            [{"m": 8192, "n": 8192, "k": 8192, "tflops": 1050.0}], 3500.0, {}, 1, 8)
    gpu = profile["gpu"]
    assert gpu["matmul_eff"] == 1.0 and gpu["peak_bf16_flops"] == pytest.approx(1050e12)
    assert gpu["hbm_eff"] == 1.0 and gpu["hbm_gbps"] == 3500.0
    assert make_cluster(None, 8, profile=_write(profile, tmp_path)).gpu.peak_bf16_flops == pytest.approx(1050e12)
