"""One rank of the pipeline tests: every case trains the same tiny Transformer for a few
steps through the pipeline engine and, in the same process, on one device; the rank
records every mismatch (loss, grad norm, parameters, evaluation loss)."""

from __future__ import annotations

import copy
import gc
import json
import math
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.device_mesh import init_device_mesh

from ember.config import ModelConfig
from ember.model import Transformer
from ember.layout import Layout, available_schedules
from ember.parallel.pipeline import PipelineEngine
from ember.process import end_process_group, leave

ROWS_PER_STEP = [8, 4, 8]  # sequences per step: the 4 exercises a second micro-batch count
MICRO_BATCH, SEQ, VOCAB, LR, CLIP, TOL = 2, 16, 61, 1e-2, 0.5, 1e-5


def cases() -> list[dict]:
    out = []
    for schedule, vpp in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2), ("zbv", 2)]:
        if schedule not in available_schedules():
            continue
        for objective in ("mlm", "causal"):
            for tied in (True, False):
                out.append({"schedule": schedule, "vpp": vpp, "objective": objective, "tied": tied})
    # Uneven stages: 5 layers over pp2 (balanced: 3 + 2) and pp2 x vpp2 (1 + 1 + 1 + 2 as given).
    out.append({"schedule": "1f1b", "vpp": 1, "objective": "causal", "tied": False, "layers": 5})
    out.append({"schedule": "interleaved", "vpp": 2, "objective": "mlm", "tied": True, "layers": 5,
                "stage_layers": (1, 1, 1, 2)})
    return out


def layout(case: dict, mesh) -> Layout:
    return Layout(pp=mesh["pp"].size(), vpp=case["vpp"], schedule=case["schedule"], micro_batch=MICRO_BATCH,
                  stage_layers=case.get("stage_layers", ()))


def model_config(objective: str, tied: bool, layers: int = 4) -> ModelConfig:
    # Sinusoidal positions (a buffer on the first stage) for the MLM, learned for causal.
    return ModelConfig(objective=objective, vocab_size=VOCAB, vocab_multiple=8, hidden=32, layers=layers, heads=4,
                       mlp_hidden=64, max_seq_len=SEQ, tie_embeddings=tied, dropout=0.0,
                       positions="sinusoidal" if objective == "mlm" else "learned", sparse_prediction=True)


def batch(objective: str, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    if objective == "causal":
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    ids = ids[:, :-1].contiguous()
    masked = torch.rand(rows, SEQ, generator=g) < 0.25
    masked[:, 0] = True  # every row predicts something
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, VOCAB - 1), ids)
    return inputs, labels


def adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)


def close(a: float, b: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= TOL * max(abs(b), 1e-12)


def run_case(case: dict, mesh, errors: list[str]) -> None:
    name = (f"{case['schedule']}/vpp{case['vpp']}/{case['objective']}/{'tied' if case['tied'] else 'untied'}"
            f"/{case.get('layers', 4)} layers")
    torch.manual_seed(0)
    ref = Transformer(model_config(case["objective"], case["tied"], case.get("layers", 4)))
    model = copy.deepcopy(ref)
    ref_opt = adamw(ref)
    engine = PipelineEngine(model, mesh, layout(case, mesh), torch.device("cpu"), wrap=lambda m: m,
                            make_optimizer=adamw)
    for step, rows in enumerate(ROWS_PER_STEP):
        inputs, labels = batch(case["objective"], rows, seed=100 * step + 7)
        count = int((labels != -100).sum())
        # One device: accumulation over the same micro-batches, normalised by the step's targets.
        ref_loss = 0.0
        for start in range(0, rows, MICRO_BATCH):
            part = ref(inputs[start:start + MICRO_BATCH], labels[start:start + MICRO_BATCH], reduction="sum")
            (part / count).backward()
            ref_loss += float(part.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        loss = engine.forward_backward(inputs, labels, 1.0 / count)
        dist.all_reduce(loss, group=mesh["pp"].get_group())  # 0 on ranks without the last stage
        norm = float(engine.clip_grad_norm(CLIP))
        for opt in engine.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if not close(float(loss), ref_loss):
            errors.append(f"{name} step {step}: loss {float(loss)} != {ref_loss}")
        if not close(norm, ref_norm):
            errors.append(f"{name} step {step}: grad norm {norm} != {ref_norm}")
    # Three steps of two micro-batch counts: the stages of the schedule not in use are gone
    # (a batch-size ramp must not keep a set of stage buffers per size).
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, pipelining.PipelineStage)
             and any(o.submod is part for part in engine.parts)]
    if len(alive) != len(engine.parts):
        errors.append(f"{name}: {len(alive)} pipeline stages alive for {len(engine.parts)} stage modules")

    reference = ref.state_dict()
    names = []
    for part in engine.parts:
        for key, value in part.state_dict().items():
            names.append(key)
            diff = (value - reference[key]).abs().max().item()
            # AdamW divides by sqrt(v), so weights with near-zero gradients (keys: softmax
            # ignores a shift shared by all keys) turn rounding noise into updates of up
            # to lr; a real gradient error moves weights by about lr.
            if diff > TOL * reference[key].abs().max().item() + 1e-3 * LR:
                errors.append(f"{name}: parameter {key} differs by {diff} after the steps")
    every = [None] * mesh["pp"].size()
    dist.all_gather_object(every, names, group=mesh["pp"].get_group())
    if sorted(k for ks in every for k in ks) != sorted(reference):
        errors.append(f"{name}: stages hold {sorted(k for ks in every for k in ks)}, model has {sorted(reference)}")

    inputs, labels = batch(case["objective"], 6, seed=999)
    with torch.no_grad():
        ref_eval = sum(float(ref(inputs[s:s + MICRO_BATCH], labels[s:s + MICRO_BATCH], reduction="sum"))
                       for s in range(0, 6, MICRO_BATCH))
    val = engine.loss_sum(inputs, labels)
    dist.all_reduce(val, group=mesh["pp"].get_group())
    if not close(float(val), ref_eval):
        errors.append(f"{name}: evaluation loss {float(val)} != {ref_eval}")


# ---- pp2 x dp2: each stage sharded with FSDP2 over "dp" (DTensor gradients) ----------------

# zero 3 (parameters resharded after forward) and zero 2 (kept gathered until backward)
DP_CASES = [{"schedule": "1f1b", "vpp": 1, "objective": "mlm", "tied": True, "reshard": True},
            {"schedule": "interleaved", "vpp": 2, "objective": "causal", "tied": True, "reshard": False}]
DP_ROWS_PER_STEP = [8, 16, 8]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_dp_case(case: dict, mesh, errors: list[str]) -> None:
    from torch.distributed.fsdp import fully_shard

    name = f"pp2xdp2 {case['schedule']}/{case['objective']}/{'tied' if case['tied'] else 'untied'}"
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = Transformer(model_config(case["objective"], case["tied"]))
    model = copy.deepcopy(ref)
    ref_opt = adamw(ref)

    def wrap(stage):
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=case["reshard"])
        return stage

    engine = PipelineEngine(model, mesh, layout(case, mesh), torch.device("cpu"), wrap=wrap, make_optimizer=adamw)
    for step, rows in enumerate(DP_ROWS_PER_STEP):
        inputs, labels = batch(case["objective"], rows, seed=100 * step + 7)
        count = int((labels != -100).sum())
        ref_loss = 0.0
        for start in range(0, rows, MICRO_BATCH):
            part = ref(inputs[start:start + MICRO_BATCH], labels[start:start + MICRO_BATCH], reduction="sum")
            (part / count).backward()
            ref_loss += float(part.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        mine = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)  # this dp rank's rows
        # FSDP averages gradients over dp (a divide factor of 1 needs PREMUL_SUM, which gloo
        # lacks), so the scale carries dp to make the result the sum over the global batch.
        loss = engine.forward_backward(inputs[mine], labels[mine], dp / count)
        dist.all_reduce(loss)  # sum over data-parallel ranks; 0 off the last stage
        norm = float(engine.clip_grad_norm(CLIP))
        for opt in engine.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if not close(float(loss), ref_loss):
            errors.append(f"{name} step {step}: loss {float(loss)} != {ref_loss}")
        if not close(norm, ref_norm):
            errors.append(f"{name} step {step}: grad norm {norm} != {ref_norm}")

    reference = ref.state_dict()
    for part in engine.parts:
        for key, value in part.state_dict().items():
            diff = (full(value) - reference[key]).abs().max().item()
            if diff > TOL * reference[key].abs().max().item() + 1e-3 * LR:
                errors.append(f"{name}: parameter {key} differs by {diff} after the steps")

    inputs, labels = batch(case["objective"], 8, seed=999)
    with torch.no_grad():
        ref_eval = float(ref(inputs, labels, reduction="sum"))
    mine = slice(dp_rank * 4, (dp_rank + 1) * 4)
    val = engine.loss_sum(inputs[mine], labels[mine])
    dist.all_reduce(val)
    if not close(float(val), ref_eval):
        errors.append(f"{name}: evaluation loss {float(val)} != {ref_eval}")


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    """4 ranks as pp2 x dp2. The pp2 cases are shared out between the two pipelines
    (mesh["pp"] of each dp column), each on the whole batch; then the FSDP cases use both dims."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    errors: list[str] = []
    done: list[str] = []
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        column, columns = mesh["dp"].get_local_rank(), mesh["dp"].size()
        pp_cases = [case for i, case in enumerate(cases()) if i % columns == column]
        for run, case_list in ((run_case, pp_cases), (run_dp_case, DP_CASES)):
            for case in case_list:
                start = time.perf_counter()
                run(case, mesh, errors)
                done.append(f"{run.__name__} {case} {time.perf_counter() - start:.2f}s")
    except Exception:
        errors.append(traceback.format_exc())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"errors": errors, "done": done}, f)
    end_process_group()
    leave(0)  # before interpreter finalization, where gloo's threads can abort the process


# ---- precision: stages under the trainer's bf16 autocast (CPU autocast supports bf16) ------

def run_precision_case(amp_dtype, mesh, errors: list[str]) -> None:
    """Train two steps of pp2 1F1B with `amp_dtype` autocast; every Linear of this rank's
    stages must compute in that dtype (fp32 without autocast), in the schedule's forwards
    and in evaluation, while parameters and gradients stay fp32 and the loss stays close
    to the fp32 one-device loss."""
    name = f"precision {amp_dtype}"
    want = amp_dtype or torch.float32
    torch.manual_seed(0)
    ref = Transformer(model_config("causal", tied=False))
    model = copy.deepcopy(ref)
    engine = PipelineEngine(model, mesh, Layout(pp=mesh["pp"].size(), micro_batch=MICRO_BATCH), torch.device("cpu"),
                            wrap=lambda m: m, make_optimizer=adamw, amp_dtype=amp_dtype)
    seen: set[torch.dtype] = set()
    for part in engine.parts:
        for module in part.modules():
            if isinstance(module, torch.nn.Linear):
                # The output layer called with labels returns the (fp32) loss; the dtype it
                # computes in is checked in tests/model/test_loss.py.
                module.register_forward_hook(lambda mod, args, out: seen.add(out.dtype) if out.dim() else None)
    for step in range(2):
        inputs, labels = batch("causal", 8, seed=100 * step + 7)
        count = int((labels != -100).sum())
        with torch.no_grad():
            ref_loss = float(ref(inputs, labels, reduction="sum"))
        loss = engine.forward_backward(inputs, labels, 1.0 / count)
        dist.all_reduce(loss, group=mesh["pp"].get_group())
        if loss.dtype != torch.float32 or not abs(float(loss) - ref_loss) <= 0.03 * abs(ref_loss):
            errors.append(f"{name} step {step}: loss {float(loss)} ({loss.dtype}) far from fp32 {ref_loss}")
        grads = [p.grad for part in engine.parts for p in part.parameters()]
        if any(g is None or g.dtype != torch.float32 or not torch.isfinite(g).all() for g in grads):
            errors.append(f"{name} step {step}: a gradient is missing, not fp32 or not finite")
        for opt in engine.optimizers:
            opt.zero_grad(set_to_none=True)  # no update: the next step compares with the same ref
        if seen != {want}:
            errors.append(f"{name} step {step}: Linear outputs were {sorted(map(str, seen))}, not {want}")
        seen.clear()
    engine.loss_sum(*batch("causal", 4, seed=999))
    if seen != {want}:
        errors.append(f"{name} evaluation: Linear outputs were {sorted(map(str, seen))}, not {want}")


def precision_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """2 ranks as pp2: the stages in bf16 autocast, then in fp32 as the control."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    errors: list[str] = []
    done: list[str] = []
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        for amp_dtype in (torch.bfloat16, None):
            run_precision_case(amp_dtype, mesh, errors)
            done.append(str(amp_dtype))
    except Exception:
        errors.append(traceback.format_exc())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"errors": errors, "done": done}, f)
    end_process_group()
    leave(0)  # before interpreter finalization, where gloo's threads can abort the process
