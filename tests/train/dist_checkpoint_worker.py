"""One rank of the sharded-checkpoint tests: `python dist_checkpoint_worker.py LAUNCH WORKDIR`
under RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (gloo, CPU).

Launch "dp4" (4 ranks): FSDP x4 trains a step and saves; hybrid sharding 2x2 loads it.
Launch "two" (2 ranks): FSDP x2 and two pipeline-style parts save; tensor parallel x2 and
DDP x2 load the FSDP x2 checkpoint, FSDP x2 loads the dp4 one and a one-process
checkpoint (train/checkpoint.py's format, written by the test before the launches). Each saver writes a reference (the whole model and AdamW
state it held, and the losses of one more step) that the loaders, here and in the
single-process test, must reproduce. Rank 0 records each check's outcome in
`results_<launch>.json` ("ok" or the error) so one failed check does not hide the rest.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from ember.config import ModelConfig, OptimConfig
from ember.process import end_process_group, leave
from ember.model.transformer import Transformer
from ember.train import checkpoint
from ember.train.model_file import save_model
from ember.train.setup import build_optimizer

CFG = ModelConfig(vocab_size=64, vocab_multiple=64, hidden=32, layers=2, heads=4, mlp_hidden=64,
                  max_seq_len=16, tie_embeddings=False)
RTOL = 1e-5


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
            for _ in range(3)]


def plain_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def adamw(module: nn.Module) -> torch.optim.Optimizer:
    """The trainer's AdamW: weight decay on matrices only, so two parameter groups."""
    return build_optimizer(module, OptimConfig(lr=1e-2), torch.device("cpu"))


def train_step(model: nn.Module, optimizers: list[torch.optim.Optimizer], batch) -> float:
    # Every rank sees the whole batch, so data-parallel averaging leaves the gradient of
    # one device unchanged and every layout computes the same step.
    loss = model(*batch)
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def continuation(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[float]:
    """The loss of one more AdamW step, then the loss after it (which sees the AdamW states)."""
    data = batches()
    first = train_step(model, optimizers, data[1])
    with torch.no_grad():
        return [first, float(model(*data[2]))]


class Part(nn.Module):
    """A pipeline-stage-like chunk: some of the Transformer's attributes under their own names."""

    def __init__(self, model: Transformer, layers: list[int], embed: bool = False, head: bool = False):
        super().__init__()
        if embed:
            self.embed, self.pos_embed = model.embed, model.pos_embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        if head:
            self.norm, self.head = model.norm, model.head


def pipeline_parts(model: Transformer) -> list[list[Part]]:
    """Parts per rank: rank 0 one, rank 1 two (as with virtual stages)."""
    return [[Part(model, [0], embed=True)], [Part(model, [1]), Part(model, [], head=True)]]


def full_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """The whole model and AdamW state this rank's parts hold, gathered from shards, on CPU."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    out = {}
    for part, opt in zip(parts, optimizers):
        opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        for key, value in get_model_state_dict(part, options=opts).items():
            out["model." + key] = value.detach().cpu().clone()
        for key, value in get_optimizer_state_dict(part, opt, options=opts).items():
            out["optim." + key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    return out


def assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{key} differs"
        else:
            assert got[key] == value, f"{key}: {got[key]} != {value}"
    assert any(k.endswith(".exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)


def assert_same_losses(got: list[float], want: list[float]) -> None:
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= RTOL * abs(b), f"losses {got} != {want}"


def save_single_process(work: Path) -> None:
    """A checkpoint of one process (no process group) with its config.toml."""
    from ember.config import Config, to_toml

    model = plain_model()
    optimizers = [adamw(model)]
    train_step(model, optimizers, batches()[0])
    run = work / "single"
    checkpoint.save(run, 1, [model], optimizers, {"progress": {"step": 1}, "data": {"position": 17}})
    (run / "config.toml").write_text(to_toml(Config(model=CFG, optim=OptimConfig(lr=1e-2))))
    reference = full_state([model], optimizers)
    torch.save({"state": reference, "losses": continuation(model, optimizers), "rng": []}, work / "ref_single.pt")


# ---- layouts (built here for the tests only) -------------------------------------------

def fsdp(mesh) -> tuple[nn.Module, list]:
    from torch.distributed.fsdp import fully_shard

    model = plain_model()
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model, [adamw(model)]


def ddp() -> tuple[nn.Module, list]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(plain_model())
    return model, [adamw(model)]


def tensor_parallel(mesh) -> tuple[nn.Module, list]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = plain_model()
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, mesh, plan)
    return model, [adamw(model)]


# ---- the launches ------------------------------------------------------------------------

def gather_to_rank0(state: dict) -> dict:
    import torch.distributed as dist

    everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, everything, dst=0)
    return {k: v for part in everything for k, v in part.items()} if everything else {}


def save_model_streaming(parts: list[nn.Module], path: Path) -> None:
    """`save_model`, checked to move one tensor at a time: no object collective (which
    would pickle whole state dicts and pad every rank's buffer to rank 0's, the whole
    model), and no send larger than the model's largest tensor."""
    import torch.distributed as dist

    def refused(*args, **kwargs):
        raise AssertionError("save_model gathered a state dict as one object")

    largest = max(p.numel() for part in parts for p in part.parameters())
    sent: list[int] = []
    send = dist.send

    def counted(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return send(tensor, *args, **kwargs)

    saved = dist.gather_object, dist.all_gather_object, dist.send
    dist.gather_object = dist.all_gather_object = refused
    dist.send = counted
    try:
        save_model(parts, path)
    finally:
        dist.gather_object, dist.all_gather_object, dist.send = saved
    assert max(sent, default=0) <= largest * dist.get_world_size(), (max(sent), largest)


def layout(dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1) -> dict[str, int]:
    """The parallel degrees a checkpoint records, as the trainer's saving.layout_of gives them."""
    return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "vpp": 1}


def save_phase(work: Path, name: str, model: nn.Module, parts: list[nn.Module], optimizers: list,
               degrees: dict) -> None:
    """Train one step, save, write the reference, then go on one step as if never stopped."""
    import torch.distributed as dist

    train_step(model, optimizers, batches()[0])
    checkpoint.save(work / name, 1, parts, optimizers, {"progress": {"step": 1}, "data": {"position": 17}},
                 layout=degrees)
    draws = torch.rand(3)  # what the restored RNG must produce next on this rank
    save_model_streaming(parts, work / f"{name}.safetensors")
    reference = gather_to_rank0(full_state(parts, optimizers))
    rng = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(draws, rng, dst=0)
    losses = continuation(model, optimizers)
    if dist.get_rank() == 0:
        torch.save({"state": reference, "losses": losses, "rng": rng, "layout": degrees}, work / f"ref_{name}.pt")
    dist.barrier()


def load_phase(work: Path, name: str, label: str, model: nn.Module, optimizers: list, degrees: dict) -> None:
    """Load `name`'s checkpoint under the layout `degrees`: the same state, losses and, only
    when the layout is the saver's, the saved RNG streams; otherwise the streams this rank
    had (what a fresh run of its layout starts with)."""
    import torch.distributed as dist

    ref = torch.load(work / f"ref_{name}.pt", weights_only=True)
    newest = max((work / name / "checkpoints").iterdir())
    own = torch.Generator().set_state(torch.get_rng_state())
    state = checkpoint.load(newest, [model], optimizers, layout=degrees)
    draws = torch.rand(3)
    save_model([model], work / f"{label}.safetensors")
    got = gather_to_rank0(full_state([model], optimizers))
    losses = continuation(model, optimizers)
    assert state == {"progress": {"step": 1}, "data": {"position": 17}}, state
    if dist.get_world_size() == len(ref["rng"]) and ref.get("layout") == degrees:
        assert torch.equal(draws, ref["rng"][dist.get_rank()]), "RNG state not restored"
    else:
        assert torch.equal(draws, torch.rand(3, generator=own)), "RNG state of another layout restored"
    if dist.get_rank() == 0:
        assert_same_state(got, ref["state"])
        assert_same_losses(losses, ref["losses"])


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    launch, work = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, str] = {}

    def check(label: str, fn) -> None:
        start = time.perf_counter()
        try:
            fn()
            results[label] = "ok"
        except Exception:  # recorded, so the test names the failing check
            results[label] = traceback.format_exc()
        dist.barrier()
        print(f"{label}: {time.perf_counter() - start:.1f}s", flush=True)

    def save_whole(name: str) -> None:
        model, optimizers = fsdp(mesh)
        save_phase(work, name, model, [model], optimizers, layout(dp_shard=world))

    if launch == "dp4":
        check("save_fsdp4", lambda: save_whole("dp4"))
        hybrid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        check("hsdp2x2_from_dp4", lambda: load_phase(work, "dp4", "hsdp2x2_from_dp4", *fsdp(hybrid),
                                                     layout(dp_replicate=2, dp_shard=2)))
    else:
        check("save_fsdp2", lambda: save_whole("fsdp2"))

        def save_pipeline_parts():
            model = plain_model()
            parts = pipeline_parts(model)
            optimizers = [[adamw(p) for p in rank_parts] for rank_parts in parts]
            mine = dist.get_rank()
            # Every rank trains the whole model (no communication needed), but each saves
            # only the parts a pipeline rank would hold.
            train_step(model, optimizers[0] + optimizers[1], batches()[0])
            checkpoint.save(work / "pp2", 1, parts[mine], optimizers[mine], {"progress": {"step": 1}},
                         layout=layout(pp=2))
            save_model_streaming(parts[mine], work / "pp2.safetensors")
            reference = gather_to_rank0(full_state(parts[mine], optimizers[mine]))
            losses = continuation(model, optimizers[0] + optimizers[1])
            if mine == 0:
                torch.save({"state": reference, "losses": losses}, work / "ref_pp2.pt")

        check("save_pp2", save_pipeline_parts)
        # Same size, another layout: tensor-parallel ranks must not get two data-parallel streams.
        check("tp2_from_fsdp2", lambda: load_phase(work, "fsdp2", "tp2_from_fsdp2", *tensor_parallel(mesh),
                                                   layout(tp=2)))
        # The same degrees (ZeRO-3 and DDP both shard the batch over dp_shard=2): streams restored.
        check("ddp2_from_fsdp2", lambda: load_phase(work, "fsdp2", "ddp2_from_fsdp2", *ddp(), layout(dp_shard=2)))
        check("fsdp2_from_dp4", lambda: load_phase(work, "dp4", "fsdp2_from_dp4", *fsdp(mesh), layout(dp_shard=2)))
        check("fsdp2_from_single", lambda: load_phase(work, "single", "fsdp2_from_single", *fsdp(mesh),
                                                      layout(dp_shard=2)))
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results, every, dst=0)
    if dist.get_rank() == 0:
        merged = {label: "\n".join(f"rank {r}: {res[label]}" for r, res in enumerate(every) if res[label] != "ok")
                  or "ok" for label in results}
        (work / f"results_{launch}.json").write_text(json.dumps(merged, indent=1))
    # gather_object returns on a sender before rank 0 has received: tearing the group down
    # then can abort the send ("terminate called without an active exception").
    end_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave(0)
