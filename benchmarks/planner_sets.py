"""The public measured runs the planner is checked against, read into one form.

Three sets, each reported on its own (benchmarks/planner_accuracy.py):
- `published_runs`: Megatron-LM 2021 (GPT 1.7B-1T on up to 3,072 A100s) and the FlagPerf
  Llama 3 8B sweep on one A800 node.
- `published_runs_more`: llm-foundry (FSDP, A100/H100, 8-512 GPUs), torchtitan (FSDP2,
  tensor parallelism), Megatron-Core (3D on up to 6,144 H100s) and NeMo, in bf16 and FP8
  (tensor-wise scales), with context parallelism where they used it. Rows with row-wise
  FP8 scales, which the planner does not price, are skipped and every skipped row is
  counted with its reason.
- `vtrain`: 1,440 single-node Megatron-DeepSpeed runs (0.2-1.3 B, 2-8 A100s, full
  recomputation, unfused attention).

Each run becomes a `Run`: the model, cluster and shape it was measured on, its layout (or,
where the source does not say the micro-batch or schedule, the fields the planner's search
may choose, as the authors tuned theirs), the measured tokens/s per GPU, and a group key:
runs in one group differ only in layout, so their order is what a user acts on.

Held out. Whole groups are held out, so a held-out ranking is never seen while fitting:
a group is held out when crc32 of its key is divisible by 3 (about a third of them).
The constants of the overlap model (plan/overlap.py) are fitted on the other groups only.

Any other file with the columns of published_runs_more.csv, or of vTrain's measured data
(vtrain_runs.py: its other files, on several nodes of 8 GPUs), can be checked the same way
(`planner_accuracy.py --csv FILE`): its rows are all unseen, none was used to fit. Rows of
a source this module does not know are read by what the row says (`_any_source`): the
stack from the source's name or a `stack=` note, the layout from the columns, and the
fields left empty (micro-batch, recomputation, schedule) searched; an empty dp is what
tp x pp x cp leave of the GPU count. A row that cannot be read or priced is skipped and
reported with its line and reason; only a missing column (REQUIRED_COLUMNS) refuses a file.

The data live in shared/planner beside the repository (or $EMBER_PLANNER_DATA); they are
not copied into the repository, and the checks that need them skip without them.
"""

from __future__ import annotations

import csv
import os
import re
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.cost import model_flops_per_token, recompute_flops_per_token
from ember.errors import ConfigError
from ember.hardware import find_gpu, gpu_by_name
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
NEMO = stack("nemo")  # NeMo's performance recipes: overlap on, gradients reduced in bf16
# Megatron-LM's own weak-scaling table: "overlap of DP/TP/PP comm on", with Megatron-LM's
# default fp32 gradient accumulation for bf16 training.
MEGATRON_CORE_OVERLAP = stack("nemo", grad_dtype="fp32")
FOUNDRY_AMP = stack("llm-foundry")  # Composer's DEFAULT mixed precision reduces in fp32
FOUNDRY_PURE = stack("llm-foundry", grad_dtype="bf16")
# torchtitan (mixed_precision_reduce defaults to float32), and without torch.compile.
TORCHTITAN, TORCHTITAN_EAGER = stack("fsdp"), stack("fsdp-eager")
# What a file of runs must have (published_runs_more.csv's other columns are optional).
REQUIRED_COLUMNS = ("source", "model", "layers", "hidden", "heads", "seq", "vocab", "gpu", "n_gpus", "tp", "pp", "dp",
                    "global_bs")
# A row whose model or notes say it routes tokens to experts: the planner prices dense
# blocks only, and a mixture of experts priced as dense would be wrong by its sparsity.
MIXTURE_OF_EXPERTS = re.compile(r"\b(moe|mixtral|dbrx|grok|arctic|olmoe|jamba|deepseek[- ]?v[23])\b"
                                r"|\b(num_)?experts?=|\bep=|-a\d+(\.\d+)?b\b")


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
    unseen: bool = False  # from a file given with --csv: never fitted, so held out whole

    @property
    def held_out(self) -> bool:
        return self.unseen or zlib.crc32(repr(self.group).encode()) % 3 == 0


def _int(text: str) -> int:
    """A whole number as tables write one ("1?", "~8", "6,144"); a range or a fraction is not."""
    digits = re.fullmatch(r"[~≈]?\s*(\d{1,3}(?:,\d{3})+|\d+)\s*\??", text.strip())
    if not digits:
        raise ValueError(f"{text!r} is not a whole number")
    return int(digits.group(1).replace(",", ""))


def _note(row: dict, key: str) -> str | None:
    found = re.search(rf"(?:^|;)\s*{key}=([^;]+)", row.get("notes", ""))
    return found.group(1).strip() if found else None


def _number(text: str) -> float:
    """The number a note starts with ("29.21 (1920 x 2048 / 60.1 s / 2240)" -> 29.21)."""
    found = re.match(r"\s*([0-9]+(?:\.[0-9]*)?)", text)
    if not found:
        raise ValueError(f"{text!r} does not start with a number")
    return float(found.group(1))


def _gpu(text: str) -> str:
    name = text.split(";")[0].strip()
    if "pcie" in name.lower():  # the GPU table tells the PCIe parts apart
        return name
    if name.startswith("A100") and re.search(r"40\s*GB", name, re.I):
        return "A100-40GB"
    if name.startswith("H100") and "hbm2e" in name.lower():  # torchtitan's Grand Teton part
        return "H100 SXM HBM2e"
    for pattern, gpu in (("A800", "A800"), ("A100", "A100-80GB"),
                         ("H200", "H200"), ("H100", "H100")):
        if name.startswith(pattern):
            return gpu
    found = gpu_by_name(name) or find_gpu(name)  # a short name ("V100"), or as a device reports it ("DGX-B200")
    return found.name if found else name


def published_runs(csv_path: Path | None = None) -> tuple[list[Run], dict[str, int]]:
    path = csv_path or SHARED / "published_runs.csv"
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
            fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": 0, "sp": False, "recompute": "full", "recompute_every": 1}
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
    """The architecture: an `arch=` note (gpt: learned positions, biases, tied embeddings,
    as GPT-3 and MPT; gpt-rotary: Megatron-Core's GPT; llama), else by the source and name."""
    layers, hidden, heads = _int(row["layers"]), _int(row["hidden"]), _int(row["heads"])
    seq, vocab, name = _int(row["seq"]), _int(row["vocab"]), row["model"]
    ffn = _int(row["ffn_hidden"]) if row.get("ffn_hidden") else 4 * hidden
    kv = _int(row["kv_heads"]) if row.get("kv_heads") else heads
    arch = _note(row, "arch") or ("gpt" if row["source"] == "llm-foundry" else "llama" if "llama" in name.lower()
                                  else "gpt-rotary" if row["source"] == "megatron-core" else "gpt")
    if arch == "llama":
        return ModelSpec(name, layers, hidden, heads, ffn, vocab, kv_heads=kv, activation="swiglu",
                         tie_embeddings=False, positions="rotary", norm="rmsnorm", max_seq_len=seq)
    if arch == "gpt-rotary":
        return ModelSpec(name, layers, hidden, heads, ffn, vocab, kv_heads=kv, tie_embeddings=False,
                         positions="rotary", max_seq_len=seq, dropout=False)
    positions = "alibi" if "bloom" in name.lower() else "learned"
    return ModelSpec(name, layers, hidden, heads, ffn, vocab, kv_heads=kv, bias=True, positions=positions,
                     max_seq_len=seq)


def published_runs_more(csv_path: Path | None = None, name: str = "published_runs_more",
                        unseen: bool = False) -> tuple[list[Run], dict[str, int]]:
    path = csv_path or SHARED / "published_runs_more.csv"
    runs, skipped = [], {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    reader = csv.DictReader(path.open())
    missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"no column {', '.join(missing)}")
    for line, row in enumerate(reader, start=2):
        row = {k: (v or "").strip() for k, v in row.items() if k}
        try:
            run = _more_run(row, name, skip)
        except (KeyError, ValueError, ConfigError) as e:  # one row a reader cannot use, not the file
            skip(f"line {line}: {e}")
            continue
        if run is not None:
            run.unseen = unseen
            runs.append(run)
    return runs, skipped


def _more_run(row: dict, name: str, skip) -> Run | None:
    """One row of published_runs_more's columns as a Run, or None (counted by `skip`)."""
    notes = row.get("notes", "").lower()
    precision = "fp8" if "fp8" in notes else "bf16"
    table_gpu = gpu_by_name(_gpu(row.get("gpu", "")))
    if table_gpu is None:
        skip("GPU not in ember's table")
        return None
    if "fp4" in notes:
        skip("FP4 (not priced)")
        return None
    if MIXTURE_OF_EXPERTS.search(f"{row['model']} {notes}".lower()):
        skip("mixture of experts (not priced)")
        return None
    if precision == "fp8" and "rowwise" in notes:
        skip("FP8 with row-wise scales (not priced)")
        return None
    if precision == "fp8" and not table_gpu.fp8:
        skip("FP8 on a GPU without FP8 tensor cores")
        return None
    if row["source"] == "torchtitan-H100" and not (_note(row, "precision") or "").startswith(("bf16", "fp8")):
        skip("precision not stated")
        return None
    if not row.get("tp") or not row.get("pp"):
        skip("layout not stated")
        return None
    model, seq, gpus = _more_model(row), _int(row["seq"]), _int(row["n_gpus"])
    tp, pp, cp = _int(row["tp"]), _int(row["pp"]), _int(_note(row, "cp") or "1")
    if not row["dp"]:  # what the other degrees leave
        row["dp"] = str(gpus // (tp * pp * cp))
    dp = _int(row["dp"])
    if tp * pp * dp * cp != gpus:
        skip("tp x pp x dp x cp is not the GPU count")
        return None
    shape = TrainShape(seq, _int(row["global_bs"]), precision)
    tokens = _number(_note(row, "tok_s_gpu") or "0")
    if not tokens and row.get("tflops_per_gpu"):
        flops = model_flops_per_token(model, seq)  # the whole s x s square, as NeMo's older tables
        if _note(row, "tflops") == "hardware" and row.get("recompute") == "full":
            flops += recompute_flops_per_token(model, seq, "full")  # the figure counts the rerun too
        tokens = float(row["tflops_per_gpu"]) * 1e12 / flops
    if not tokens and row.get("mfu"):
        mfu = _number(row["mfu"])
        tokens = (mfu / 100 if mfu > 1 else mfu) * table_gpu.peak_bf16_flops / model_flops_per_token(model, seq)
    if not tokens:
        skip("no throughput")
        return None
    gpu, source = _gpu(row["gpu"]), row["source"]
    mem = _note(row, "mem_GiB")
    # The held-out split was drawn while the Grand Teton part was read as an H100 SXM; its
    # groups keep that name, so reading the GPU better does not redraw the split.
    group = (source, row["model"], "H100" if gpu == "H100 SXM HBM2e" else gpu, gpus, seq) + (
        (precision,) if precision != "bf16" else ())
    label = row["model"]
    if source == "llm-foundry":
        stack = FOUNDRY_PURE if _note(row, "fsdp_mp") == "PURE" else FOUNDRY_AMP
        cluster = make_cluster(gpu, gpus, 8, inter_gbps=25.0 if gpu.startswith("A100") else None, stack=stack)
        layout = Layout(dp_shard=dp, zero=_int(row["zero"]), micro_batch=_int(row["micro_bs"]),
                        recompute=row["recompute"])
        run = Run(name, source, group, model, cluster, shape, tokens, layout=layout, label=label)
    elif source == "torchtitan-H100":
        # Grand Teton H100s (95 GB HBM2e, lower power): the table's "H100 SXM HBM2e" (_gpu).
        async_tp = (_note(row, "asyncTP") or "").startswith("yes")
        eager = (_note(row, "compile") or "").startswith("no")
        base = TORCHTITAN_EAGER if eager else TORCHTITAN
        cluster = make_cluster(gpu, gpus, 8, stack=replace(base, overlap_tp_comm=async_tp))
        recompute = "selective" if row["recompute"].startswith("sel") else row["recompute"]
        # Interleaved 1F1B: torchtitan's default of two stages per rank.
        vpp = 2 if "interleaved" in (_note(row, "pp_schedule") or "").lower() else 1
        layout = Layout(tp=tp, pp=pp, dp_shard=dp, zero=3, sp=tp > 1, micro_batch=_int(row["micro_bs"]),
                        recompute=recompute, schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp, cp=cp)
        group = group + (_note(row, "compile") or "", _note(row, "asyncTP") or "")
        run = Run(name, source, group, model, cluster, shape, tokens, layout=layout,
                  memory_gib=_number(mem) if mem else None, label=label)
    elif source == "megatron-core":
        # Micro-batch, recomputation and schedule are not stated: searched, as N21. Its FP8
        # rows follow NeMo's performance recipes.
        cluster = make_cluster(gpu, gpus, 8, stack=NEMO if precision == "fp8" else MEGATRON_CORE_OVERLAP)
        fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": 1, "dp_shard": dp, "sp": tp > 1, "cp": cp}
        vp = _note(row, "vp") or ""
        if vp.isdigit() and int(vp) > 1:
            fixed.update(schedule="interleaved", vpp=int(vp))
        key = ("megatron-core", "weak scaling", row["model"]) + ((precision,) if precision != "bf16" else ())
        run = Run(name, source, key, model, cluster, shape, tokens, fixed=fixed, label=label)
    elif source.lower() == "nemo":
        # NeMo's performance recipes: Megatron-Core with the distributed optimizer, its
        # gradient reduction and parameter gathers overlapped; recomputation not stated.
        cluster = make_cluster(gpu, gpus, 8, stack=NEMO)
        zero = 3 if "megatron-fsdp" in notes else 1
        fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "dp_shard": dp, "sp": tp > 1, "cp": cp}
        if row.get("micro_bs"):
            fixed["micro_batch"] = _int(row["micro_bs"])
        vp = _note(row, "vp") or ""
        if vp.isdigit() and int(vp) > 1:
            fixed.update(schedule="interleaved", vpp=int(vp))
        group = group + (_note(row, "container") or "",)
        run = Run(name, source, group, model, cluster, shape, tokens, fixed=fixed, label=label)
    else:
        run = _any_source(row, name, model, shape, tokens, group)
    return run


# A source this module has no rule for: its stack from its name or notes, first match wins
# (GPT-NeoX trains on DeepSpeed, NVIDIA's MLPerf submissions on NeMo, OLMo and metaseq on FSDP).
STACK_WORDS = (("deepspeed", "deepspeed"), ("bloom", "deepspeed"), ("mt-nlg", "deepspeed"), ("gpt-neox", "deepspeed"),
               ("nemo", "nemo"), ("megatron-bridge", "nemo"), ("megatron-fsdp", "nemo"), ("mlperf", "nemo"),
               ("foundry", "llm-foundry"), ("composer", "llm-foundry"), ("torchtitan", "fsdp"), ("fsdp", "fsdp"),
               ("olmo", "fsdp"), ("metaseq", "fsdp"), ("ember", "ember"), ("megatron", "megatron"))


def _any_source(row: dict, name: str, model: ModelSpec, shape: TrainShape, tokens: float, group: tuple) -> Run:
    """A run from a source without its own rule, read from what the row says. The stack is
    a `stack=` note or the first of STACK_WORDS as a word of the source's name and notes (else
    Megatron-LM, which most published 3D runs used); the layout is tp, pp, dp and zero
    from the columns (zero 1, the distributed optimizer, when empty), the micro-batch and
    recomputation when given, interleaving from a `vp=` note, sequence parallelism from an
    `sp=0/1` note (runs before 2022 had none). What is not given is searched, as the authors
    tuned theirs; `inter_gbps=` in the notes sets the network per GPU where it is not the
    GPU's usual one; `cp=` sets context parallelism. ZeRO shards over all data-parallel
    ranks (and the cp ranks among them)."""
    text = f"{row['source']} {row.get('notes', '')}".lower()
    named = _note(row, "stack") or next((s for word, s in STACK_WORDS if re.search(rf"\b{word}\b", text)),
                                        "megatron")
    inter = _note(row, "inter_gbps")
    tp, pp, dp = _int(row["tp"]), _int(row["pp"]), _int(row["dp"])
    cluster = make_cluster(_gpu(row["gpu"]), _int(row["n_gpus"]), 8, inter_gbps=_number(inter) if inter else None,
                           stack=stack(named))
    zero = _int(row["zero"]) if row.get("zero") else 1
    fixed = {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "dp_shard": dp if zero else 1}
    if int(_note(row, "cp") or 1) > 1:
        fixed["cp"] = int(_note(row, "cp"))
    if _note(row, "sp"):
        fixed["sp"] = _note(row, "sp") == "1"
    if row.get("micro_bs"):
        fixed["micro_batch"] = _int(row["micro_bs"])
    if row.get("recompute", "").rstrip("?") in ("none", "selective", "full"):
        fixed.update(recompute=row["recompute"].rstrip("?"), recompute_every=1)
    if _note(row, "vp"):
        fixed.update(schedule="interleaved", vpp=_int(_note(row, "vp")))
    return Run(name, row["source"], group, model, cluster, shape, tokens, fixed=fixed, label=row["model"])


def runs_in_file(path: Path, name: str) -> tuple[list[Run], dict[str, int]]:
    """Every run in a file given with --csv, all unseen: vTrain's columns (any of its measured
    files, one node or several of 8 GPUs) or published_runs_more.csv's."""
    from vtrain_runs import is_vtrain, vtrain

    with path.open(encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    if is_vtrain(header):
        return vtrain(path, name=name, unseen=True)
    return published_runs_more(path, name=name, unseen=True)


def predict(run: Run):
    """The planner's prediction for `run`: its layout, or the best the search finds for the
    fields the source gave."""
    from ember.plan.search import rank, search

    if run.layout is not None:
        return rank(run.model, run.cluster, run.shape, [run.layout])[0]
    result = search(run.model, run.cluster, run.shape, fixed=run.fixed, ember_only=False)
    # The run did fit: where the planner thinks no layout does, the leanest is the one it ran.
    return result.best if result.ranked else min(result.too_big, key=lambda p: p.memory.total)


def load(name: str) -> tuple[list[Run], dict[str, int]]:
    from vtrain_runs import vtrain  # it builds on this module's Run

    return {"published_runs": published_runs, "published_runs_more": published_runs_more, "vtrain": vtrain}[name]()


def available(name: str) -> bool:
    return (SHARED / {"published_runs": "published_runs.csv", "published_runs_more": "published_runs_more.csv",
                      "vtrain": "vtrain/ground_truth_single.csv"}[name]).exists()
