"""Where the step time goes: the interval arithmetic on made-up timelines, the names of
gloo's and NCCL's work, and `ember bench` on real processes."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY, ember_cmd
from ember.train.breakdown import kind_of, minus, split_time, union

MS = 1_000_000  # nanoseconds


def test_union_and_minus():
    assert union([(5, 9), (0, 2), (1, 3), (9, 10), (4, 4)]) == [(0, 3), (5, 10)]
    assert minus([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert minus([(0, 10)], []) == [(0, 10)]
    assert minus([(0, 10)], [(-5, 15)]) == []


def test_names_of_communication():
    assert kind_of("gloo:all_reduce", False) == "collective"
    assert kind_of("gloo:reduce_scatter", False) == "collective"
    assert kind_of("gloo:send", False) == kind_of("gloo:recv", False) == "p2p"
    assert kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True) == "collective"
    assert kind_of("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", True) == "p2p"
    assert kind_of("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", True) == "compute"
    assert kind_of("aten::mm", False) == "compute"
    assert kind_of("Optimizer.step#AdamW.step", False) is None  # a span around work, not work


def test_overlapped_communication_is_not_exposed():
    # Main thread computes 0-10 ms and 15-20 ms; a gloo thread all-reduces 5-15 ms:
    # 5 ms of it hide under compute, 5 ms (10-15) are exposed.
    events = [("compute", "main", 0, 10 * MS), ("compute", "main", 15 * MS, 20 * MS),
              ("collective", "gloo", 5 * MS, 15 * MS)]
    out = split_time(events)
    assert out == pytest.approx({"compute_s": 0.015, "comm_s": 0.010, "exposed_comm_s": 0.005, "bubble_s": 0.0})


def test_a_thread_blocked_in_a_call_is_not_computing():
    # An aten op that encloses a blocking receive on the same thread: only its edges compute.
    events = [("compute", "main", 0, 10 * MS), ("p2p", "main", 2 * MS, 9 * MS),
              ("collective", "gloo", 8 * MS, 12 * MS)]
    out = split_time(events)
    assert out["compute_s"] == pytest.approx(0.003)
    assert out["exposed_comm_s"] == pytest.approx(0.003)  # 8-9 and 10-12 ms: nothing computes then
    assert out["bubble_s"] == pytest.approx(0.006)  # 2-8 ms waiting; 8-9 is the collective's


def test_a_thread_working_while_its_send_is_in_flight_is_computing():
    # Interleaved and zero-bubble schedules issue a send, compute, and wait for it at the end
    # of the step: gloo records the send from its issue (1 ms) to its wait's return (20 ms).
    # The thread computes 2-8 and 9-15 ms inside it; 15-20 ms it waits (for the send and,
    # 16-19 ms, a receive issued and waited at once).
    events = [("p2p", "main", 1 * MS, 20 * MS), ("compute", "main", 2 * MS, 8 * MS),
              ("compute", "main", 9 * MS, 15 * MS), ("p2p", "main", 16 * MS, 19 * MS)]
    out = split_time(events)
    assert out["compute_s"] == pytest.approx(0.012)
    assert out["bubble_s"] == out["comm_s"] == pytest.approx(0.006)  # 1-2 and 15-20 ms: blocked in a call
    # An op that encloses a wait of a call issued inside it computes only outside the wait.
    events = [("p2p", "main", 1 * MS, 20 * MS), ("compute", "main", 2 * MS, 30 * MS),
              ("compute", "main", 3 * MS, 10 * MS)]
    assert split_time(events)["compute_s"] == pytest.approx(0.018)  # 2-30 ms less 10-20 ms


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))


def _bench(dataset, nproc, *sets, profile=None):
    args = ["bench", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset), "--steps", "2",
            "--warmup", "1", "--json", *[x for s in TINY + ["train.device=cpu", *sets] for x in ("--set", s)],
            *(["--profile", str(profile)] if profile else [])]
    cmd = ember_cmd(*args) if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "ember", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def test_bench_of_one_process_sees_no_communication(dataset):
    result = _bench(dataset, 1)
    (rank,) = result["ranks"]
    assert result["world"] == 1 and result["tokens_per_s"] > 0
    assert result["predicted"] is None  # a CPU and no profile: nothing to predict from
    assert rank["forward_s"] > 0 and rank["backward_s"] > 0 and rank["optimizer_s"] > 0
    assert rank["compute_s"] > 0 and rank["comm_s"] == rank["exposed_comm_s"] == rank["bubble_s"] == 0
    assert rank["compute_s"] + rank["other_s"] == pytest.approx(rank["profiled_step_s"], rel=1e-6)


def _profile(tmp_path):
    """A CPU profile in the form `ember plan calibrate` writes (numbers of this order)."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({
        "format": "ember-plan-profile/1", "source": "calibrated (test)",
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": 8, "sms": 2,
                "hbm_gbps": 20.0, "matmul_eff": 1.0, "hbm_eff": 1.0, "intra_gbps": 0.7, "inter_gbps": 0.7},
        "links": {"gpus_per_node": 2, "intra_gbps": 0.7, "inter_gbps": 0.7, "intra_eff": 1.0,
                  "intra_latency_s": 1e-3},
        # A measured matmul (`ember plan calibrate --model`) of a shape this model never runs.
        "matmuls": {"times": [[3, 5, 7, 1, 1.0]]}}))
    return path


def test_bench_of_a_pipeline_sees_its_bubble(dataset, tmp_path):
    result = _bench(dataset, 2, "parallel.pp=2", "parallel.schedule=gpipe", profile=_profile(tmp_path))
    assert result["world"] == 2 and len(result["ranks"]) == 2
    # The planner's prediction for the same layout comes beside the measurement.
    predicted = result["predicted"]
    assert predicted["step_s"] > 0 and predicted["memory_gib"] > 0 and predicted["bubble_share"] > 0
    # On a CPU the measured peak is the resident set, runtime included: the whole prediction.
    assert predicted["memory_gib"] == predicted["memory_total_gib"]
    # With measured kernel shapes in the profile, the model's own figure comes too.
    assert predicted["modelled_kernels_step_s"] == predicted["step_s"]
    for rank in result["ranks"]:
        # GPipe on two stages: each stage waits for the other for part of every step.
        assert rank["bubble_s"] > 0 and rank["compute_s"] > 0
        assert rank["peak_reserved_gib"] == rank["peak_memory_gib"] > 0
        assert rank["bubble_s"] + rank["compute_s"] <= rank["profiled_step_s"]
        assert "forward_backward_s" in rank and "forward_s" not in rank


def test_bench_refuses_a_profile_that_is_not_one(dataset, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run(ember_cmd("bench", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset),
                                    "--profile", str(bad), *[x for s in TINY for x in ("--set", s)]),
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("ember: error:") and len(done.stderr.strip().splitlines()) == 1


def test_bench_refuses_a_layout_that_cannot_run(dataset):
    done = subprocess.run(ember_cmd("bench", str(REPO / "configs/tiny-gpt.toml"), "--data", str(dataset),
                                    *[x for s in TINY + ["parallel.tp=2"] for x in ("--set", s)]),
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("ember: error:") and len(done.stderr.strip().splitlines()) == 1


def test_a_profiler_that_cannot_start_leaves_training_running(monkeypatch):
    import torch

    from ember.train import breakdown

    class Refused:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("CUPTI is in use by another profiler")

    monkeypatch.setattr("torch.profiler.profile", Refused)
    profiler = breakdown.StepProfiler(torch.device("cpu"))
    profiler.enabled = True
    ran = []
    with pytest.warns(UserWarning, match="breakdown is off"):
        with profiler.step():
            ran.append(1)
    with profiler.step():  # later steps are not profiled, and say so with the same keys
        ran.append(2)
    assert ran == [1, 2]
    out = profiler.read()
    assert sorted(out) == sorted(breakdown.FIELDS) and all(v != v for v in out.values())  # NaN
    assert profiler.read() == {}


def test_auto_profiles_one_logged_step_in_ten_under_torchrun_only():
    from ember.train.breakdown import AUTO_EVERY, profiled

    assert [i for i in range(1, 32) if profiled("auto", 4, i)] == [1, 1 + AUTO_EVERY, 1 + 2 * AUTO_EVERY, 31]
    assert not any(profiled("auto", 1, i) for i in range(1, 32))
    assert all(profiled("on", 1, i) for i in range(1, 32)) and not any(profiled("off", 8, i) for i in range(1, 32))


def test_bench_of_an_interleaved_pipeline_sees_its_compute(dataset):
    # Interleaved and zero-bubble schedules wait for their sends at the end of the step; the
    # work done while the sends are in flight is compute, not time blocked in a send. The
    # same model computes about as much under each schedule (zero bubble only splits the
    # backward in two), so measured compute is compared with GPipe's.
    model = ["model.layers=4", "train.global_batch=16", "parallel.pp=2"]

    def compute(result):
        return sum(rank["compute_s"] for rank in result["ranks"]) / len(result["ranks"])

    gpipe = compute(_bench(dataset, 2, *model, "parallel.schedule=gpipe"))
    for schedule in ("zbv", "interleaved"):
        result = _bench(dataset, 2, *model, "parallel.vpp=2", f"parallel.schedule={schedule}")
        assert compute(result) > gpipe / 2, (schedule, gpipe, result["ranks"])
        for rank in result["ranks"]:
            assert rank["forward_backward_s"] / 8 < rank["compute_s"] <= rank["profiled_step_s"], (schedule, rank)
            assert rank["bubble_s"] + rank["compute_s"] <= rank["profiled_step_s"]
