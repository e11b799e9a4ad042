"""No rank allocates the whole model: under ZeRO-3 x2 each rank's resident memory rises by
about half the model's bytes while building it (measured by the kernel's high-water mark
in real torchrun processes), where one process rises by the whole."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY

# ~100M parameters (400 MB in fp32): far above what a process group or the data loader costs.
MODEL = ["model.hidden=512", "model.layers=24", "model.heads=8", "model.mlp_hidden=2048", "model.dropout=0",
         "train.precision=fp32", "train.device=cpu", "train.compile=false"]
WORKER = REPO / "tests/parallel/build_memory_worker.py"


def build(nproc, sets, dataset, out) -> list[dict]:
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"),
                                                                            os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           str(dataset), str(out), str(REPO / "configs/tiny-gpt.toml"), *TINY, *MODEL, *sets]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        first = max(done.stderr.find("Traceback"), 0)
        pytest.fail(done.stderr[first:first + 5000], pytrace=False)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_zero3_builds_half_the_model_per_rank(dataset, tmp_path):
    [one] = build(1, [], dataset, tmp_path / "one")
    whole = one["whole"]
    assert whole > 350e6
    # The measurement sees a whole model when one is built: one process rises by all of it.
    assert one["rise"] >= 0.9 * whole, one
    ranks = build(2, ["parallel.zero=3", "parallel.dp_shard=2"], dataset, tmp_path / "zero3")
    for rank in ranks:
        assert rank["held"] <= 0.51 * whole, rank  # the parameters it keeps: half
        assert rank["rise"] <= 0.6 * whole, (rank, whole)  # and nothing more on the way there
