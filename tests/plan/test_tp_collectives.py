"""The planner prices a tensor-parallel block (no sequence parallelism) as two all-reduces
forward and two backward (plan/timing.py, plan/predict.py: tp_collectives). ember's own
split block must issue exactly that: benchmarks/tp_host_overhead.py counts them at the
dispatcher in two real processes."""

import re
import subprocess
import sys

from conftest import REPO

from ember.layout import Layout
from ember.plan.predict import tp_collectives


def test_a_split_block_issues_the_collectives_the_planner_prices():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tp_host_overhead.py"), "--iters", "3",
                           "--no-write"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counted = int(re.search(r"collectives in it\s+(\d+)", done.stdout).group(1))
    assert counted == 2 * tp_collectives(Layout(tp=2))  # forward and backward
    assert "host time the split adds" in done.stdout
