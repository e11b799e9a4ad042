"""benchmarks/cpu_step_parts.py splits a real pass with the profiler and sets each part beside
the planner's price for it: the parts add up to the pass, matmuls are most of it, and a
profile with timed attention shapes replaces the curve's attention price for them."""

import json
import re
import subprocess
import sys

from conftest import REPO


def test_the_parts_of_a_pass_are_measured_and_priced(tmp_path):
    profile = tmp_path / "cpu.json"
    # A made-up CPU whose attention at micro-batch 4 takes exactly 1 ms a call (4 layers,
    # forward and backward: 4 ms a pass, 16 ms a step of four passes).
    profile.write_text(json.dumps({
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": 16, "hbm_gbps": 20},
        "links": {"gpus_per_node": 1},
        "stack": {"overlap_grad_reduce": False, "overlap_param_gather": False, "host_overlaps": False},
        "attention": {"times": [[4, 4, 128, 64, 1, 1e-3]]}}))
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_step_parts.py"), "--profile", str(profile),
                           "--no-write"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(int(m), part): [float(v) for v in rest.split()]
            for m, part, rest in re.findall(r"^\s+(\d+)\s+(matmul|attention|rest|total)\s+(.+)$", done.stdout, re.M)}
    assert len(rows) == 8
    for mbs in (16, 4):
        measured = [rows[(mbs, part)][0] for part in ("matmul", "attention", "rest")]
        assert abs(sum(measured) - rows[(mbs, "total")][0]) < 2e-3  # one thread: the parts are the pass
        assert measured[0] > 0.5 * sum(measured) and all(v > 0 for v in measured)
    assert abs(rows[(4, "attention")][1] - 0.016) < 1e-9  # the timed shape, four passes a step
    assert rows[(4, "attention")][3] != rows[(4, "attention")][1]  # without it: the curve's price
    assert rows[(16, "attention")][1] == rows[(16, "attention")][3]  # no timed shape at micro-batch 16
