"""benchmarks/gpu_step.py is run on GPUs this project has none of: its CPU dry run keeps
it from rotting (both implementations of all three models build, step and report)."""

import json
import math
import subprocess
import sys

from conftest import REPO


def test_gpu_step_dry_run(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_step.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["model"], r["impl"]) for r in rows) == sorted(
        (m, i) for m in ("gpt2", "bert", "llama") for i in ("ember", "transformers"))
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) and r["mfu"] is None for r in rows)
