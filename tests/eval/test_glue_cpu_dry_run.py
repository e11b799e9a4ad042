"""benchmarks/glue_cpu.py at toy sizes on made-up GLUE files: the whole benchmark
(corpus, pretraining, a not-pretrained twin, five tasks for both, the step comparison)
runs and reports every task, so the committed benchmark cannot rot."""

import json
import math
import subprocess
import sys

from conftest import REPO
from eval_helpers import write_glue

FIVE = ("CoLA", "SST-2", "MRPC", "STS-B", "RTE")


def test_glue_cpu_dry_run(tmp_path):
    glue = write_glue(tmp_path / "glue", sizes=(32, 16), folders=FIVE)
    out, scores = tmp_path / "report.txt", tmp_path / "scores.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/glue_cpu.py"), "--dry-run", "--glue-dir", str(glue),
                           "--out", str(out), "--json", str(scores)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(scores.read_text())
    assert set(result["columns"]) == {"pretrained", "not pretrained"}
    for name, columns in result["columns"].items():
        assert set(columns) == set(FIVE), name
        assert all(math.isfinite(v) for v in columns.values())
        assert len(result["task_minutes"][name]) == 5 and all(m > 0 for m in result["task_minutes"][name].values())
    assert set(result["step_ms"]) == {"foreach AdamW", "fused AdamW"}
    text = out.read_text()
    assert "DRY RUN" in text and "average gain from pretraining" in text


def test_glue_cpu_without_glue_files_says_so(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/glue_cpu.py"), "--glue-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "no GLUE files" in done.stderr and "Traceback" not in done.stderr
