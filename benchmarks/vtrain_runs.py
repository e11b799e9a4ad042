"""vTrain's measured runs (Megatron-DeepSpeed on A100s, 8 to a node) read into `Run`s.

Its single-node sweep (shared/planner/vtrain) is one of the public sets; any other file in
its columns (VTRAIN_COLUMNS: the other measured files in its repository's `data/`) is read
the same way by `planner_sets.runs_in_file`, every group unseen.
"""

from __future__ import annotations

import csv
from pathlib import Path

from planner_sets import SHARED, Run, _int

from ember.layout import Layout
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import ModelSpec
from ember.plan.stacks import stack

# vTrain's pipelined rows keep 1F1B's timing (their median error by pp and tp is within 4%,
# where DeepSpeed's lockstep engine would make them 1.5x as long): they ran Megatron-LM's own
# schedule and pipeline sends, the `megatron-deepspeed` stack.
MEGATRON_DEEPSPEED = stack("megatron-deepspeed")
# vTrain's measured-data columns (its data/ground_truth_*.csv): a file with them is read as
# vTrain's. Names are matched without case or surrounding spaces; "# GPUs" may be left out
# (tp x dp x pp), and the time may be given in seconds, "iteration time (s)".
VTRAIN_COLUMNS = ("global batch", "micro batch", "hidden size", "attention heads", "# layers",
                  "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism")
TIME_COLUMNS = {"iteration time (ms)": 1e-3, "iteration time (s)": 1.0}


def _column(name: str) -> str:
    return name.strip().lstrip("\ufeff").strip().lower()


def is_vtrain(header: list[str]) -> bool:
    names = {_column(c) for c in header}
    return all(c in names for c in VTRAIN_COLUMNS) and any(t in names for t in TIME_COLUMNS)


# vTrain's published configs (config/validation/*/*.json) give its cluster 800 Gb/s between
# nodes of 8 A100s (four 200 Gb/s HDR ports, two GPUs to a port): 12.5 GB/s per GPU, half a
# DGX A100's. Only runs that span nodes see it.
VTRAIN_INTER_GBPS = 800 / 8 / 8


def vtrain(csv_path: Path | None = None, name: str = "vtrain",
           unseen: bool = False) -> tuple[list[Run], dict[str, int]]:
    """Megatron-DeepSpeed runs on A100s, 8 to a node, timed by vTrain's authors."""
    path = csv_path or SHARED / "vtrain" / "ground_truth_single.csv"
    runs, skipped = [], {}
    with path.open(encoding="utf-8-sig") as f:
        for line, raw in enumerate(csv.DictReader(f), start=2):
            row = {_column(k): (v or "").strip() for k, v in raw.items() if k}
            try:  # one row a reader cannot use is skipped with its line, not the file
                runs.append(_run(row, name, unseen))
            except (KeyError, ValueError) as e:
                reason = f"line {line}: {e}"
                skipped[reason] = skipped.get(reason, 0) + 1
    return runs, skipped


def _run(row: dict, name: str, unseen: bool) -> Run:
    gb, mbs = _int(row["global batch"]), _int(row["micro batch"])
    h, heads, layers, seq = (_int(row[k]) for k in ("hidden size", "attention heads", "# layers", "sequence length"))
    tp, dp, pp = (_int(row[k]) for k in ("tensor parallelism", "data parallelism", "pipeline parallelism"))
    gpus = _int(row["# gpus"]) if row.get("# gpus") else tp * dp * pp
    if gpus != tp * dp * pp:
        raise ValueError(f"{gpus} GPUs is not tp x dp x pp = {tp * dp * pp}")
    column = next((c for c in TIME_COLUMNS if row.get(c)), None)
    if column is None:
        raise ValueError("no iteration time")
    seconds = float(row[column]) * TIME_COLUMNS[column]
    if not seconds > 0:
        raise ValueError(f"an iteration time of {seconds} s")
    model = ModelSpec(f"GPT h{h} L{layers}", layers, h, heads, 4 * h, 50257, bias=True, dropout=True,
                      max_seq_len=seq)
    cluster = make_cluster("A100-80GB", gpus, 8, inter_gbps=VTRAIN_INTER_GBPS, stack=MEGATRON_DEEPSPEED)
    layout = Layout(tp=tp, pp=pp, dp_replicate=dp, zero=0, micro_batch=mbs, recompute="full")
    tokens = gb * seq / seconds / gpus
    return Run(name, "vTrain", (name, h, layers, gpus, gb), model, cluster, TrainShape(seq, gb),
               tokens, layout=layout, label=f"h{h} L{layers}", unseen=unseen)
