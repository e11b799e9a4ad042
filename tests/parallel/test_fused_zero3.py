"""Fused projections under ZeRO-3 (FSDP2, 2 real processes, gloo): the same loss and
gradients as one nn.Linear per projection, and no weight, gathered or concatenated, kept
alive from forward to backward: the fused function saves the parameters FSDP frees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("fused_zero3_worker.py")


def test_fused_projections_keep_no_weight_between_forward_and_backward_under_zero3(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fused, unfused = (json.loads(out.read_text())[k] for k in ("fused", "unfused"))
    assert fused["kept"] == [] and unfused["kept"] == []
    assert abs(fused["loss"] - unfused["loss"]) <= 1e-6 * abs(unfused["loss"])
    assert fused["grads"].keys() == unfused["grads"].keys()
    for name in fused["grads"]:
        torch.testing.assert_close(torch.tensor(fused["grads"][name]), torch.tensor(unfused["grads"][name]),
                                   rtol=1e-5, atol=1e-7, msg=name)
