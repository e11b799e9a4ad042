"""The public measured runs the planner is checked against, read into one form.

Three sets, each reported on its own (benchmarks/planner_accuracy.py):
- `published_runs`: Megatron-LM 2021 (GPT 1.7B-1T on up to 3,072 A100s) and the FlagPerf
  Llama 3 8B sweep on one A800 node (benchmarks/data/published_runs.csv).
- `published_runs_more`: llm-foundry (FSDP, A100/H100, 8-512 GPUs), torchtitan (FSDP2,
  tensor parallelism), Megatron-Core (3D on up to 6,144 H100s). Only the bf16 rows without
  context parallelism are predicted: the planner prices neither FP8 matmuls nor context
  parallelism, and every skipped row is counted with its reason.
- `vtrain`: 1,440 single-node Megatron-DeepSpeed runs (0.2-1.3 B, 2-8 A100s, full
  recomputation, unfused attention).

Each run becomes a `Run`: the model, cluster and shape it was measured on, its layout (or,
where the source does not say the micro-batch or schedule, the fields the planner's search
may choose, as the authors tuned theirs), the measured tokens/s per GPU, and a group key:
runs in one group differ only in layout, so their order is what a user acts on.

Held out. Whole groups are held out, so a held-out ranking is never seen while fitting:
a group is held out when crc32 of its key is divisible by 3 (about a third of them).
The constants of the overlap model (plan/overlap.py) are fitted on the other groups only.

The data live in shared/planner beside the repository (or $EMBER_PLANNER_DATA); the
first set's csv is also in benchmarks/data.
"""

from __future__ import annotations

import csv
import os
import re
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.cost import model_flops_per_token
from ember.layout import Layout
from ember.plan.cluster import Cluster, make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS, ModelSpec
from ember.plan.stacks import stack

REPO = Path(__file__).resolve().parents[1]
def _shared() -> Path:
    """The public planner data: $EMBER_PLANNER_DATA, else a `shared/planner` folder beside
    the repository or its parent's (where this workplace keeps it)."""
    if os.environ.get("EMBER_PLANNER_DATA"):
        return Path(os.environ["EMBER_PLANNER_DATA"])
    for candidate in (REPO.parent / "shared" / "planner", Path("/work/shared/planner")):
        if candidate.is_dir():
            return candidate
    return REPO.parent / "shared" / "planner"


SHARED = _shared()
SETS = ("published_runs", "published_runs_more", "vtrain")

# What each source ran (named stacks, plan/stacks.py; see docs/planner.md "Stacks").
MEGATRON_2021 = stack("megatron-2021")
MEGATRON_CORE = stack("megatron")
MEGATRON_CORE_OVERLAP = stack("megatron", overlap_grad_reduce=True, overlap_param_gather=True)
MEGATRON_DEEPSPEED = stack("deepspeed")
FSDP_AMP = stack("fsdp")  # Composer's DEFAULT mixed precision reduces in fp32
FSDP_PURE = stack("fsdp", grad_dtype="bf16")


@dataclass
class Run:
    set: str
    source: str
    group: tuple
    model: ModelSpec
    cluster: Cluster
    shape: TrainShape
    measured: float  # tokens/s per GPU
    layout: Layout | None = None
    fixed: dict | None = None  # fields pinned for a search when the layout is not fully known
    memory_gib: float | None = None
    oom: bool = False
    label: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def held_out(self) -> bool:
        return zlib.crc32(repr(self.group).encode()) % 3 == 0


def _int(text: str) -> int:
    return int(re.sub(r"[^0-9]", "", text))


def _note(row: dict, key: str) -> str | None:
    found = re.search(rf"(?:^|;)\s*{key}=([^;]+)", row.get("notes", ""))
    return found.group(1).strip() if found else None


def _gpu(text: str) -> str:
    name = text.split(";")[0].strip()
    for pattern, gpu in (("A800", "A800"), ("A100-40GB", "A100-40GB"), ("A100", "A100-80GB"),
                         ("H200", "H200"), ("H100", "H100")):
        if name.startswith(pattern):
            return gpu
    return name


def published_runs(csv_path: Path | None = None) -> tuple[list[Run], dict[str, int]]:
    path = csv_path or REPO / "benchmarks" / "data" / "published_runs.csv"
    runs = []
    for row in csv.DictReader(path.open()):
        layers, hidden, heads = _int(row["layers"]), _int(row["hidden"]), _int(row["heads"])
        seq, vocab, gpus = _int(row["seq"]), _int(row["vocab"]), _int(row["n_gpus"])
        tp, pp, dp = _int(row["tp"]), _int(row["pp"]), _int(row["dp"])
        shape = TrainShape(seq, _int(row["global_bs"]))
        if row["source"].startswith("N21"):
            model = ModelSpec(f"GPT {row['params_B']}B", layers, hidden, heads, 4 * hidden, vocab, bias=True,
                              dropout=True, max_seq_len=seq)
            cluster = make_cluster(_gpu(row["gpu"]), gpus, 8, stack=MEGATRON_2021)
            # Its TFLOP/s count recomputation: 96·B·s·l·h²·(1 + s/6h + V/16lh) per step.
            flops = 96 * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
            tokens = float(row["tflops_per_gpu"]) * 1e12 / (flops / seq)
            fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": 0, "sp": False, "recompute": "full"}
            # Weak scaling: each size is its own (model, cluster); grouped as one sweep of scale.
            runs.append(Run("published_runs", "N21-T1", ("N21-T1", row["model"], row["params_B"]), model, cluster,
                            shape, tokens, fixed=fixed, label=f"GPT {row['params_B']}B"))
            continue
        model = replace(PRESETS["llama3-8b"], dropout=True)
        cluster = make_cluster(_gpu(row["gpu"]), gpus, 8, stack=MEGATRON_CORE)
        layout = Layout(tp=tp, pp=pp, dp_shard=dp, zero=1, sp=tp > 1, micro_batch=_int(row["micro_bs"]),
                        recompute=row["recompute"].strip("?"))
        found = re.search(r"([0-9.]+)\s*tok/s/GPU", row["notes"])
        mem = re.search(r"(?:mem )?([0-9.]+)(?:/[0-9]+)? GiB", row["notes"])
        runs.append(Run("published_runs", "FlagPerf", ("FlagPerf", _gpu(row["gpu"]), gpus), model, cluster, shape,
                        float(found.group(1)) if found else 0.0, layout=layout,
                        memory_gib=float(mem.group(1)) if mem else None, oom="OOM" in row["notes"],
                        label="Llama 3 8B"))
    return runs, {}


def _more_model(row: dict) -> ModelSpec:
    layers, hidden, heads = _int(row["layers"]), _int(row["hidden"]), _int(row["heads"])
    seq, vocab = _int(row["seq"]), _int(row["vocab"])
    ffn, kv = _int(row["ffn_hidden"]), _int(row["kv_heads"])
    if row["source"] == "llm-foundry":
        return ModelSpec(row["model"], layers, hidden, heads, ffn, vocab, bias=True, max_seq_len=seq)
    if "llama" in row["model"].lower():
        return ModelSpec(row["model"], layers, hidden, heads, ffn, vocab, kv_heads=kv, activation="swiglu",
                         tie_embeddings=False, positions="rotary", norm="rmsnorm", max_seq_len=seq)
    return ModelSpec(row["model"], layers, hidden, heads, ffn, vocab, tie_embeddings=False, positions="rotary",
                     max_seq_len=seq, dropout=False)


def published_runs_more(csv_path: Path | None = None) -> tuple[list[Run], dict[str, int]]:
    path = csv_path or SHARED / "published_runs_more.csv"
    runs, skipped = [], {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for row in csv.DictReader(path.open()):
        notes = row["notes"]
        if "fp8" in notes.lower() or "fp8" in (_note(row, "precision") or ""):
            skip("FP8 (not priced)")
            continue
        if int(_note(row, "cp") or 1) > 1:
            skip("context parallel (not priced)")
            continue
        if row["source"] == "torchtitan-H100" and _note(row, "precision") != "bf16":
            skip("precision not stated")
            continue
        if not row["tp"] or not row["pp"]:
            skip("layout not stated")
            continue
        model, seq, gpus = _more_model(row), _int(row["seq"]), _int(row["n_gpus"])
        tp, pp, dp = _int(row["tp"]), _int(row["pp"]), _int(row["dp"])
        shape = TrainShape(seq, _int(row["global_bs"]))
        tokens = float(_note(row, "tok_s_gpu") or 0)
        if not tokens and row["tflops_per_gpu"]:
            tokens = float(row["tflops_per_gpu"]) * 1e12 / model_flops_per_token(model, seq)
        if not tokens:
            skip("no throughput")
            continue
        gpu, source = _gpu(row["gpu"]), row["source"]
        mem = _note(row, "mem_GiB")
        group = (source, row["model"], gpu, gpus, seq)
        label = row["model"]
        if source == "llm-foundry":
            stack = FSDP_PURE if _note(row, "fsdp_mp") == "PURE" else FSDP_AMP
            cluster = make_cluster(gpu, gpus, 8, inter_gbps=25.0 if gpu.startswith("A100") else None, stack=stack)
            layout = Layout(dp_shard=dp, zero=_int(row["zero"]), micro_batch=_int(row["micro_bs"]),
                            recompute=row["recompute"])
            runs.append(Run("published_runs_more", source, group, model, cluster, shape, tokens, layout=layout,
                            label=label))
        elif source == "torchtitan-H100":
            # Grand Teton H100s: 96 GB HBM2e at 500 W; the planner knows only the SXM part.
            cluster = make_cluster(gpu, gpus, 8, stack=FSDP_PURE)
            recompute = "selective" if row["recompute"].startswith("sel") else row["recompute"]
            layout = Layout(tp=tp, pp=pp, dp_shard=dp, zero=3, sp=tp > 1, micro_batch=_int(row["micro_bs"]),
                            recompute=recompute)
            group = group + (_note(row, "compile") or "", _note(row, "asyncTP") or "")
            runs.append(Run("published_runs_more", source, group, model, cluster, shape, tokens, layout=layout,
                            memory_gib=float(mem) if mem else None, label=label))
        elif source == "megatron-core":
            # Micro-batch, recomputation and schedule are not stated: searched, as N21.
            cluster = make_cluster(gpu, gpus, 8, stack=MEGATRON_CORE_OVERLAP)
            fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": 1, "sp": tp > 1}
            runs.append(Run("published_runs_more", source, ("megatron-core", "weak scaling", row["model"]), model,
                            cluster, shape, tokens, fixed=fixed, label=label))
        else:
            skip(f"{source}: FP8 only")
    return runs, skipped


def vtrain(csv_path: Path | None = None) -> tuple[list[Run], dict[str, int]]:
    path = csv_path or SHARED / "vtrain" / "ground_truth_single.csv"
    runs = []
    with path.open(encoding="utf-8-sig") as f:
        for row in csv.DictReader(f):
            gpus, gb, mbs = _int(row["# GPUs"]), _int(row["global batch"]), _int(row["micro batch"])
            h, heads, layers, seq = (_int(row[k]) for k in ("hidden size", "attention heads", "# layers",
                                                             "sequence length"))
            tp, dp, pp = (_int(row[k]) for k in ("tensor parallelism", "data parallelism", "pipeline parallelism"))
            model = ModelSpec(f"GPT h{h} L{layers}", layers, h, heads, 4 * h, 50257, bias=True, dropout=True,
                              max_seq_len=seq)
            cluster = make_cluster("A100-80GB", gpus, 8, stack=MEGATRON_DEEPSPEED)
            layout = Layout(tp=tp, pp=pp, dp_replicate=dp, zero=0, micro_batch=mbs, recompute="full")
            seconds = float(row["iteration time (ms)"]) / 1000
            tokens = gb * seq / seconds / gpus
            runs.append(Run("vtrain", "vTrain", ("vtrain", h, layers, gpus, gb), model, cluster,
                            TrainShape(seq, gb), tokens, layout=layout, label=f"h{h} L{layers}"))
    return runs, {}


def predict(run: Run):
    """The planner's prediction for `run`: its layout, or the best the search finds for the
    fields the source gave."""
    from ember.plan.search import rank, search

    if run.layout is not None:
        return rank(run.model, run.cluster, run.shape, [run.layout])[0]
    return search(run.model, run.cluster, run.shape, fixed=run.fixed, ember_only=False).best


def load(name: str) -> tuple[list[Run], dict[str, int]]:
    return {"published_runs": published_runs, "published_runs_more": published_runs_more, "vtrain": vtrain}[name]()


def available(name: str) -> bool:
    if name == "published_runs":
        return True
    return (SHARED / ("vtrain/ground_truth_single.csv" if name == "vtrain" else "published_runs_more.csv")).exists()
