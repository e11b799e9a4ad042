"""Run under torchrun (2 ranks, gloo): fused and unfused projections under FSDP2 with
ZeRO-3's reshard after forward. Rank 0 writes, for each, the loss, the gradients and the
element counts of the weight-sized tensors autograd still holds alive between forward and
backward (ZeRO-3 frees every gathered parameter after forward, so there should be none).

Usage: torchrun --nproc-per-node 2 fused_zero3_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ember.config import ModelConfig
from ember.model import Transformer
from ember.process import end_process_group, leave

HIDDEN, MLP_HIDDEN = 32, 48
# Weight and concatenated-weight sizes; no activation of a [2, 12] batch has these counts.
WEIGHT_SIZES = {HIDDEN * HIDDEN, MLP_HIDDEN * HIDDEN, 3 * HIDDEN * HIDDEN, 2 * MLP_HIDDEN * HIDDEN}


def run(fused: bool, mesh) -> dict:
    cfg = ModelConfig(vocab_size=64, hidden=HIDDEN, layers=2, heads=2, mlp_hidden=MLP_HIDDEN, max_seq_len=16,
                      activation="swiglu", positions="rotary", bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.blocks.values():
        block.attn.fused = block.mlp.fused = fused
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(ids, ids)
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size() for t in saved}
    kept = sorted(n for n in alive.values() if n in WEIGHT_SIZES)
    saved.clear()
    loss.backward()
    grads = {name: p.grad.full_tensor().tolist() for name, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "kept": kept, "grads": grads}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    records = {"fused": run(True, mesh), "unfused": run(False, mesh)}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    leave(0)
