"""The machine a plan is for: a GPU, how many, how they are linked, and what the training
software does. Built from the GPU table and command-line overrides, or read from a profile
file.

Profile file (JSON). `ember plan --save-profile FILE` writes the resolved profile; edit it,
or let a calibration run write measured values, and pass it back with `--profile FILE`:

    {"format": "ember-plan-profile/1",
     "source": "datasheet",                 # or e.g. "calibrated 2026-11-22 on node17"
     "gpu":   {"name": "H100 SXM", "peak_bf16_flops": 9.89e14, "memory_gib": 80,
               "hbm_gbps": 3350, "sms": 132, "matmul_eff": 0.8, "attn_eff": 0.35, "hbm_eff": 0.8},
     "links": {"gpus_per_node": 8, "intra_gbps": 450, "inter_gbps": 50, "intra_eff": 0.8,
               "inter_eff": 0.9, "intra_latency_s": 1e-05, "inter_latency_s": 2e-05},
     "stack": {"attention": "flash", "grad_dtype": "bf16", "overlap_grad_reduce": true,
               "overlap_param_gather": true}}

Every field but `gpu.name` may be left out: a known GPU starts from its table entry, links
from the GPU's typical node, the stack from the defaults below. The number of GPUs is not
part of a profile: one profile describes every size of the same cluster. `ember plan
calibrate` (plan/calibrate.py) adds a "measured" section with the raw measurements (matmul
rates by shape, bus bandwidth by message size), which the planner does not read; with
`--model` it adds "matmuls" and "attention" (that model's shapes, timed) and the stack's
`eager_elementwise_scale` (from one of its blocks; plan/kernels.py), which it does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ember.atomic import write_text
from ember.config import ConfigError
from ember.fields import checked_table
from ember.hardware import GPU, GPUS, ShapeTimes, gpu_by_name
from ember.plan.comm import Links
from ember.plan.timing import LOSS_BWD_BYTES, LOSS_FWD_BYTES

PROFILE_FORMAT = "ember-plan-profile/1"
PROFILE_SECTIONS = {"format", "source", "gpu", "links", "stack", "matmuls", "attention", "measured"}
# GPU fields read from profile sections of measured kernel times (`ember plan calibrate
# --model`, plan/kernels.py): section, and the sizes of each row before its seconds.
TIMED = {"matmul_times": ("matmuls", ("m", "n", "k", "batch")),
         "attention_times": ("attention", ("batch", "heads", "seq", "head_dim", "causal"))}

STACK_CHOICES = {"attention": ("flash", "unfused"), "grad_dtype": ("bf16", "fp32"),
                 "selective": ("elementwise", "attention", "half-matmul")}


@dataclass(frozen=True)
class Stack:
    """What the training software does, where it changes cost.

    `attention`: "flash" (fused kernel, no s×s matrix in memory; ember uses PyTorch SDPA)
    or "unfused" (softmax materialised, as Megatron-LM did before FlashAttention).
    `grad_dtype`: "bf16" gradients (16 bytes/param with Adam), or "fp32" main gradients
    (Megatron-LM's default with bf16: 18 bytes/param, gradients reduced in fp32). An FSDP
    stack (`per_block_grads`) keeps fp32 gradients either way except where they accumulate
    whole over micro-batches (plan/memory.py); its bf16 only halves the bytes on the wire.
    `overlap_grad_reduce`: data-parallel gradient reduction runs during the backward pass of
    the last micro-batch (DDP/FSDP buckets); `overlap_param_gather`: ZeRO-1/2 parameter
    gathers after the optimizer step and ZeRO-3 gathers run ahead of the compute that needs
    them (prefetch). `selective`: what selective recomputation reruns: "elementwise"
    (ember: matmuls, the attention kernel and collectives are kept, norms and activations
    rerun), "attention" (Megatron-LM, Korthikanti et al.: the attention core is rerun) or
    "half-matmul" (torchtitan's op-level policy: the attention kernel's output and every
    other matmul's are kept, the rest reruns). Named stacks (`--stack`, plan/stacks.py) set
    all of these at once."""

    attention: str = "flash"
    grad_dtype: str = "bf16"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    selective: str = "elementwise"
    name: str = "ember"
    # How many collectives ZeRO-3 issues per layer and pass: FSDP gathers a block as one
    # flat unit (1); DeepSpeed fetches each parameter-holding sub-module (4 weights, 2 norms).
    zero3_collectives_per_layer: int = 1
    # Whether ZeRO-3 gathers a layer's weights again for the forward that full recomputation
    # reruns inside the backward pass (DeepSpeed: its sub-module pre-forward hooks fire on the
    # rerun, which releases them after; FSDP gathers once for both, in its pre-backward hook).
    zero3_regathers_for_recompute: bool = False
    # Seconds a ZeRO-3 all-gather costs per rank of its group beyond the collective: an
    # all-gather into a list of per-rank tensors (torch.distributed.all_gather, as DeepSpeed's
    # ZeRO-3 of 2021 called it) gathers into one flat buffer and then copies each rank's
    # chunk out with its own copy, one launch each. 0 for an all-gather into one tensor.
    gather_s_per_rank: float = 0.0
    # Host time the framework spends per kernel it launches in eager mode (Python, autograd,
    # hooks). The GPU waits when a pass's kernels are too small to outlast it.
    host_s_per_kernel: float = 10e-6
    # Host time tensor parallelism adds to one layer's forward and backward beyond its
    # kernels and collectives (eager DTensor dispatch; tune/host_cost.py measures it when
    # `ember plan calibrate` runs under torchrun). 0 where unmeasured.
    tp_host_s_per_layer: float = 0.0
    # Host time ZeRO's FSDP2 adds to one sharded unit's forward and backward beyond its
    # collectives (its hooks, the copies into and out of the flat buffers, the sharded
    # tensors' bookkeeping; tune/host_cost.py measures both when `ember plan calibrate` runs
    # under torchrun): weights kept after forward (ZeRO-1/2) and resharded (ZeRO-3). Compiled
    # blocks pay it too: the hooks run outside the graph. 0 where unmeasured.
    shard_host_s_per_layer: float = 0.0
    reshard_host_s_per_layer: float = 0.0
    # Whether ember's trainer compiles the blocks (plan/stacks.py: run_stack, from a recipe's
    # train.compile), which traces DTensor's dispatch away: no tp_host_s_per_layer then.
    compiled: bool = False
    # Host time every micro-batch costs each stage outside its kernels, with the GPU idle:
    # a framework that syncs with the device once per micro-batch (Megatron-LM's get_batch
    # copies the batch's sizes to the host) loses the host's lead there, and the GPU waits
    # while Python fetches the batch, builds masks and does the engine's bookkeeping. 0 for
    # ember, whose loop has no per-micro-batch sync.
    host_s_per_micro_batch: float = 0.0
    # Whether the host issues work while the device computes (a GPU), or shares its cores
    # with the compute so that their times add (a CPU; a calibrated CPU profile says so).
    host_overlaps: bool = True
    # An uncompiled ember block's work outside matmuls and attention over its price (plan/kernels.py).
    eager_elementwise_scale: float = 1.0
    # Share of the GPU table's matmul and attention rates this stack's kernels reach
    # (1.0 for ember, whose rates `ember plan calibrate` measures; fitted for the others).
    kernel_eff: float = 1.0
    # Share of the GPU table's FlashAttention rate this stack's attention kernel reaches
    # (a fused kernel only; unfused attention runs as matmuls at `kernel_eff`).
    attention_eff: float = 1.0
    # ember's loss: fused with the output layer over chunks of tokens (model/loss.py) where
    # the vocabulary is not split over tensor-parallel ranks, so the micro-batch's fp32
    # logits never exist; where it is split, PyTorch's cross-entropy under loss_parallel.
    # False: Megatron-LM's fused vocabulary-parallel cross-entropy, which works in place.
    fused_loss: bool = True
    # Bytes the cross-entropy moves per logit, forward and backward (plan/timing.py:
    # head_times): by default a loss over fp32 logits (Megatron-LM's vocabulary-parallel one,
    # PyTorch's on `logits.float()`); 2 and 4 for one that reads the bf16 logits in a single
    # kernel and writes their gradient in another (flash-attn's Triton cross-entropy).
    loss_fwd_bytes: float = LOSS_FWD_BYTES
    loss_bwd_bytes: float = LOSS_BWD_BYTES
    # Whether gradients are freed after every optimizer step (zero_grad(set_to_none=True))
    # and made again in backward, in the room freed activations leave, rather than kept in
    # a persistent buffer (Megatron-LM's and DeepSpeed's contiguous gradient buffers).
    frees_grads: bool = True
    # Whether ZeRO runs as FSDP2 (ember, torchtitan), which copies every gathered weight out
    # of its flat buffer and every gradient into one on the compute stream (plan/predict.py:
    # fsdp_copy_bytes), where FSDP1 (Composer) gathers into its flat parameter in place.
    fsdp2_copies: bool = True
    # Whether sequence parallelism keeps the all-gathered inputs of the column-parallel
    # projections for backward (DTensor: ember, torchtitan) or gathers again (Megatron-LM).
    sp_keeps_gathered: bool = True
    # Whether ZeRO-1/2 gradients are reduce-scattered block by block as backward makes them
    # (FSDP: ember's ZeRO-1 and 2 are fully_shard without resharding, ZeRO-1 syncing only on
    # the step's last micro-batch): two blocks' unsharded gradients are in flight, and with
    # one micro-batch ZeRO-1 keeps only shards. False: a persistent full gradient buffer,
    # reduced by buckets (Megatron-LM's distributed optimizer, DeepSpeed).
    per_block_grads: bool = True
    # Whether each tensor-parallel rank sends only its 1/tp slice across a pipeline boundary
    # (Megatron-LM's scatter/gather optimisation; ember's sequence-parallel stages) or the
    # whole activation (DeepSpeed's pipeline engine, which does not know about tensor
    # parallelism: every rank sends the full tensor over its own link).
    p2p_slices: bool = True
    # Whether the pipeline runs in DeepSpeed's lockstep (its engine's TrainSchedule): even
    # and odd stages alternate a forward and a backward in 2(m + p - 1) steps, with blocking
    # sends and receives between neighbours at every step, so every step lasts as long as
    # the slowest pass in it (plan/predict.py: lockstep_s). False: Megatron-LM's and
    # PyTorch's 1F1B, where a stage starts its next pass as soon as its input is there.
    pipeline_lockstep: bool = False
    # Whether sequence parallelism's all-gathers and reduce-scatters run beside the matmuls that
    # consume or produce them, chunk by chunk (Megatron-Core's --tp-comm-overlap with Transformer
    # Engine's userbuffers; torchtitan's async TP). False: collectives and matmuls take turns.
    overlap_tp_comm: bool = False
    # Whether RMSNorm, rotary and the gated activation each run as one kernel (torch.compile,
    # Megatron-Core's and Transformer Engine's; LayerNorm and GELU are one even eager). False:
    # eager PyTorch's composites, fp32 intermediates through memory (plan/eager.py).
    fused_elementwise: bool = True

    @property
    def eager_blocks(self) -> bool:
        """Whether the blocks run eager PyTorch's composites: a stack without fused kernels, or ember
        uncompiled on a CPU (whose time `eager_elementwise_scale` holds: only memory adds them)."""
        return not self.fused_elementwise or (self.name == "ember" and not (self.compiled or self.host_overlaps))

    def refusal(self, layout) -> str | None:
        """Why this software cannot run `layout`, or None. DeepSpeed's pipeline engine (priced
        as `pipeline_lockstep`) has only its own schedule (TrainSchedule, filed under 1f1b)
        and asserts that ZeRO stays below stage 2 beside it."""
        if not self.pipeline_lockstep or layout.pp == 1:
            return None
        if layout.schedule != "1f1b":
            return f"--stack {self.name} runs only its own pipeline schedule; give schedule=1f1b for it"
        if layout.zero >= 2:
            return (f"--stack {self.name}'s pipeline engine refuses ZeRO-2 and 3 beside pipeline stages; "
                    "give zero=0 or 1 with pp > 1")
        return None

    @property
    def elementwise_scale(self) -> float:
        """The blocks' elementwise work over its price: measured where ember runs them uncompiled."""
        return self.eager_elementwise_scale if self.name == "ember" and not self.compiled else 1.0

    def recompute_policy(self, recompute: str) -> str:
        """The cost model's name for `recompute` under this stack."""
        if recompute != "selective" or self.selective == "elementwise":
            return recompute
        return {"attention": "selective-attention", "half-matmul": "selective-half-matmul"}[self.selective]

    @property
    def grad_bytes(self) -> int:
        return 4 if self.grad_dtype == "fp32" else 2


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    n_gpus: int
    links: Links
    stack: Stack = field(default_factory=Stack)
    source: str = "datasheet"

    @property
    def gpus_per_node(self) -> int:
        """GPUs of the job on one node; the profile's node size stays in `links`, so a profile
        saved for a few GPUs still describes the whole node."""
        return min(self.links.gpus_per_node, self.n_gpus)

    @property
    def nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)

    def describe(self) -> str:
        link = f"{self.links.intra_gbps:g} GB/s in a node"
        if self.n_gpus > self.gpus_per_node:
            link += f", {self.links.inter_gbps:g} GB/s per GPU between nodes"
        return f"{self.n_gpus} x {self.gpu.name} ({self.gpus_per_node} per node; {link})"

    def profile(self) -> dict:
        gpu = dataclasses.asdict(dataclasses.replace(self.gpu, matmul_times=None, attention_times=None))
        for name in ("pattern", *TIMED):
            gpu.pop(name)
        out = {"format": PROFILE_FORMAT, "source": self.source, "gpu": gpu,
               "links": dataclasses.asdict(self.links), "stack": dataclasses.asdict(self.stack)}
        for name, (section, _) in TIMED.items():
            if getattr(self.gpu, name) is not None:
                out[section] = {"times": getattr(self.gpu, name).rows()}
        return out


def _known_gpu(name: str) -> GPU:
    gpu = gpu_by_name(name)
    if gpu is None:
        names = ("V100, T4, A100-40GB, A100-80GB, A800, H100, H800, H200, B200, GB200, L4, RTX 4090, "
                 "RTX 2080 Ti, A6000")
        raise ConfigError(f"unknown GPU {name!r}; use one of {names} (or any of the {len(GPUS)} table "
                          "names), or describe it in a --profile file.")
    return gpu


# Profile values that are rates or shares of one: zero would price work as never ending.
POSITIVE = {"gpu": ("peak_bf16_flops", "memory_gib", "hbm_gbps", "sms", "intra_gbps", "inter_gbps", "matmul_eff",
                    "attn_eff", "hbm_eff"),
            "links": ("gpus_per_node", "intra_gbps", "inter_gbps", "intra_eff", "inter_eff", "all_gather_ratio",
                      "reduce_scatter_ratio"),
            "stack": ("kernel_eff", "attention_eff", "eager_elementwise_scale")}


def _fields(cls, values, path: Path, section: str) -> dict:
    return checked_table(cls, values, f"profile file {path}: {section}", ConfigError, skip=("pattern", *TIMED),
                         nonnegative=True, positive=POSITIVE[section])


def _shape_times(section, path: Path, name: str, sizes: tuple[str, ...]) -> ShapeTimes:
    """A section of measured seconds by exact shape, {"times": [[*sizes, seconds], ...]}."""
    rows = section.get("times") if isinstance(section, dict) else None
    good = isinstance(rows, list) and all(
        isinstance(r, list) and len(r) == len(sizes) + 1
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
        and all(v in (0, 1) if size == "causal" else float(v).is_integer() and v >= 1 for v, size in zip(r, sizes))
        and math.isfinite(r[-1]) and r[-1] > 0
        for r in rows)
    if not good:
        raise ConfigError(f"profile file {path}: {name}.times must be a list of [{', '.join(sizes)}, seconds] "
                          "with whole positive sizes (causal 0 or 1) and positive seconds.")
    return ShapeTimes(rows)


def read_profile(path: str | Path) -> tuple[GPU, Links, Stack, str]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile file {path} does not exist.") from None
    except OSError as err:
        raise ConfigError(f"profile file {path} cannot be read ({err.strerror}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"profile file {path} is not valid JSON ({err}).") from None
    if not isinstance(data, dict) or data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise ConfigError(f"profile file {path} is not an {PROFILE_FORMAT} file.")
    unknown = set(data) - PROFILE_SECTIONS
    if unknown:
        raise ConfigError(f"profile file {path} has unknown section(s) {', '.join(sorted(unknown))}; "
                          f"it takes {', '.join(sorted(PROFILE_SECTIONS))}.")
    gpu_values = dict(_fields(GPU, data.get("gpu"), path, "gpu"))
    if "name" not in gpu_values:
        raise ConfigError(f"profile file {path} must name its GPU (gpu.name).")
    base = gpu_by_name(gpu_values["name"])
    if base is None:
        missing = {"peak_bf16_flops", "memory_gib"} - set(gpu_values)
        if missing:
            raise ConfigError(f"profile file {path}: GPU {gpu_values['name']!r} is not in the table, "
                              f"so gpu.{' and gpu.'.join(sorted(missing))} must be given.")
        base = GPU(gpu_values["name"], gpu_values["peak_bf16_flops"], gpu_values["memory_gib"], "$^")
    try:
        gpu = dataclasses.replace(base, **_fields(GPU, gpu_values, path, "gpu"))
        links_values = {"gpus_per_node": 8, "intra_gbps": gpu.intra_gbps, "inter_gbps": gpu.inter_gbps,
                        **_fields(Links, data.get("links"), path, "links")}
        links = Links(**links_values)
        stack = Stack(**_fields(Stack, data.get("stack"), path, "stack"))
        for name, (section, sizes) in TIMED.items():
            if data.get(section) is not None:
                gpu = dataclasses.replace(gpu, **{name: _shape_times(data[section], path, section, sizes)})
    except TypeError as err:
        raise ConfigError(f"profile file {path} has a malformed value ({err}).") from None
    _check_profile(gpu, links, stack, path)
    return gpu, links, stack, str(data.get("source", f"profile {path.name}"))


def _check_profile(gpu: GPU, links: Links, stack: Stack, path: Path) -> None:
    """What a profile's values must be beyond their kinds: rates that are rates, shares of a
    datasheet figure that a measurement can reach, and names the planner knows."""
    for where, obj in (("gpu", gpu), ("links", links), ("stack", stack)):
        for name in POSITIVE[where]:
            if not getattr(obj, name) > 0:
                raise ConfigError(f"profile file {path}: {where}.{name} must be above 0, not {getattr(obj, name)!r}.")
    for name, peak in (("matmul_eff", "peak_bf16_flops"), ("hbm_eff", "hbm_gbps")):
        if getattr(gpu, name) > 1:  # a share of the datasheet peak, which nothing beats
            raise ConfigError(f"profile file {path}: gpu.{name} is a share of gpu.{peak} and at most 1, not "
                              f"{getattr(gpu, name)!r}; raise gpu.{peak} instead if the datasheet is wrong.")
    for name, choices in STACK_CHOICES.items():
        if getattr(stack, name) not in choices:
            raise ConfigError(f"profile file {path}: stack.{name} must be one of {', '.join(choices)}, "
                              f"not {getattr(stack, name)!r}.")


def make_cluster(gpu: str | None, n_gpus: int, gpus_per_node: int | None = None,
                 intra_gbps: float | None = None, inter_gbps: float | None = None,
                 profile: str | Path | None = None, stack: Stack | None = None) -> Cluster:
    """A cluster from a GPU name (or a profile file) and the overrides a user gave."""
    if profile is not None:
        base_gpu, links, base_stack, source = read_profile(profile)
        if gpu is not None and _known_gpu(gpu).name != base_gpu.name:
            raise ConfigError(f"--gpu {gpu} disagrees with the profile's GPU {base_gpu.name}; give one of them.")
    elif gpu is None:
        raise ConfigError("say which GPU the plan is for with --gpu (or --profile FILE).")
    else:
        base_gpu, source = _known_gpu(gpu), "datasheet"
        links = Links(8, base_gpu.intra_gbps, base_gpu.inter_gbps)
        base_stack = Stack()
    changes = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("intra_gbps", intra_gbps),
                                 ("inter_gbps", inter_gbps)) if v is not None}
    links = dataclasses.replace(links, **changes)
    if n_gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, not {n_gpus}.")
    if links.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, not {links.gpus_per_node}.")
    if not all(math.isfinite(bw) and bw >= 1e-3 for bw in (links.intra_gbps, links.inter_gbps)):
        # 1 MB/s: below it no step finishes (and the time model's sums overflow)
        raise ConfigError(f"link bandwidths must be positive numbers of GB/s, 0.001 or more, not "
                          f"{links.intra_gbps:g} in a node "
                          f"(--intra-bw) and {links.inter_gbps:g} between nodes (--inter-bw).")
    if n_gpus > links.gpus_per_node and n_gpus % links.gpus_per_node:
        raise ConfigError(f"--gpus {n_gpus} does not fill whole nodes of {links.gpus_per_node}; "
                          "use a multiple of --gpus-per-node.")
    return Cluster(base_gpu, n_gpus, links, stack or base_stack, source)


def check_profile_out(path: str | Path, flag: str) -> None:
    """Refuse, before anything is measured or priced, a file to write a profile to that is a
    folder or already holds something other than a profile: a profile replaces only a profile,
    never a run's weights or a data folder's manifest."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name such as profile.json.")
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        old = None
    if not isinstance(old, dict) or old.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"{flag} {path} exists and is not an {PROFILE_FORMAT} file; choose another file name.")


def write_profile(cluster: Cluster, path: str | Path, source: str | Path | None = None) -> None:
    """The cluster as a profile file; the raw measurements of the profile it came from
    (`source`) are carried over, as `ember plan calibrate` wrote them."""
    out = cluster.profile()
    if source is not None:
        measured = json.loads(Path(source).read_text()).get("measured")
        if measured is not None:
            out["measured"] = measured
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as `ember plan calibrate --out` does
        write_text(Path(path), json.dumps(out, indent=2) + "\n")
    except OSError as err:
        raise ConfigError(f"cannot write the profile to {path} ({err.strerror}).") from None
