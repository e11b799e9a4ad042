"""fp16 with loss scaling under data, tensor and pipeline parallelism: each layout trains
the steps one process trains in fp16 (to fp16's rounding, which differs with the split),
and a gradient that overflows on one rank only makes every rank skip the step."""

import pytest

from test_layouts_match_one_process import COMMON, REPO, launch, reference

FP16 = [s for s in COMMON if not s.startswith("train.precision=")] + ["train.precision=fp16"]
LAYOUTS = [
    {"name": "dp2", "set": {"parallel.zero": 0}},
    {"name": "tp2", "set": {"parallel.tp": 2}},
    {"name": "pp2-1f1b", "set": {"parallel.pp": 2, "parallel.schedule": "1f1b"}},
    {"name": "zero2x2", "set": {"parallel.zero": 2}},  # last: its gradients are shards, so ranks can disagree
]


def test_fp16_layouts_train_as_one_process_and_skip_together(dataset, tmp_path, monkeypatch):
    import test_layouts_match_one_process as base

    monkeypatch.setattr(base, "COMMON", FP16)
    one = reference(dataset, tmp_path, "causal")[0]
    results = launch(2, LAYOUTS, dataset, tmp_path / "launch", common=FP16,
                     worker=REPO / "tests/parallel/fp16_worker.py", objectives=("causal",))
    assert [r["name"] for r in results] == [lay["name"] for lay in LAYOUTS]
    for r in results:
        assert r["loss"] == pytest.approx(one, rel=5e-3), r["name"]
    every = results[-1]["overflow_step"]
    # With the fused AdamW of CUDA runs: the skip is decided on the device, on DTensor shards.
    assert every == [{"unchanged": True, "fused": True, "scale_ratio": 0.5, "skipped": 1}] * 2
