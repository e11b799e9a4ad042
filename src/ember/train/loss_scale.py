"""Dynamic loss scaling for fp16 training (GPUs without bf16: V100, T4, RTX 20xx).

fp16 keeps 5 exponent bits, so small gradients flush to zero. The loss is multiplied by a
large scale before the backward pass and every gradient divided by it after; a step whose
gradients overflowed (inf or nan anywhere) is skipped and the scale halved, and after
`growth_interval` clean steps in a row it doubles again (Micikevicius et al. 2018, "Mixed
Precision Training"; the defaults are torch.amp.GradScaler's).

Why not torch.amp.GradScaler: it decides each rank's skip from that rank's gradients
alone. Under ZeRO-2/3, tensor or pipeline parallelism a rank holds only a shard of them,
so one rank can see an overflow that the others do not, skip while they step, and leave
the replicas different. Here the overflow flag is summed over every rank before anyone
steps. The kernels are GradScaler's own (the unscale-and-check and the scale update), so
nothing is read on the host: the fused AdamW skips its update on the device when told
`found_inf` (the optimizers ember builds on CUDA), and only an unfused optimizer makes the
host read the flag.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ember.parallel.dtensor import local_tensor

INIT_SCALE = 2.0**16
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0, 0.5, 2000


class LossScaler:
    """The scale the loss is multiplied by, and the skip-or-step decision after backward.
    Disabled (a factor of 1, every step taken, no work) unless the run computes in fp16."""

    def __init__(self, device: torch.device, enabled: bool, all_ranks: bool = False, init_scale: float = INIT_SCALE,
                 growth_interval: int = GROWTH_INTERVAL):
        """`all_ranks`: the process group's ranks train one model together (the trainer
        under torchrun), so they decide each skip together."""
        self.enabled, self.all_ranks, self.growth_interval = enabled, all_ranks, growth_interval
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.skips = torch.zeros((), dtype=torch.int64, device=device)  # steps skipped in the run so far

    def factor(self) -> torch.Tensor | float:
        """What to multiply the loss by before backward (a device tensor: reading it would wait)."""
        return self.scale if self.enabled else 1.0

    def unscale(self, optimizers: list[Optimizer]) -> None:
        """Divide every gradient the `optimizers` hold by the scale and note whether any is
        inf or nan (with `all_ranks`: any of any rank, the same answer on every rank)."""
        if not self.enabled:
            return
        self.found_inf.zero_()
        inverse = self.scale.double().reciprocal().float()
        grouped: dict[tuple, list[torch.Tensor]] = {}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = local_tensor(p.grad)
                        grouped.setdefault((g.device, g.dtype), []).append(g)
        for grads in grouped.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inverse)
        if self.all_ranks:
            dist.all_reduce(self.found_inf)  # a sum over all ranks: nonzero if any rank overflowed

    def step(self, optimizers: list[Optimizer]) -> None:
        """Each optimizer's step, skipped on every rank if any gradient overflowed; then the
        scale backs off (an overflow) or grows (growth_interval clean steps)."""
        if not self.enabled:
            for optimizer in optimizers:
                optimizer.step()
            return
        found = self.found_inf.clamp(max=1.0)
        for optimizer in optimizers:
            if optimizer.defaults.get("fused"):
                # The fused kernels skip the update (and its step count) where found_inf is set.
                optimizer.grad_scale, optimizer.found_inf = None, found
                try:
                    optimizer.step()
                finally:
                    optimizer.grad_scale = optimizer.found_inf = None
            elif not bool(found):  # an unfused optimizer: the host decides (it waits for the device)
                optimizer.step()
        self.skips += found.long()
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, GROWTH_FACTOR, BACKOFF_FACTOR,
                                 self.growth_interval)

    def log(self) -> dict:
        """For a logged step (one the loop synchronises anyway): the scale, and how many
        steps overflow has skipped so far."""
        if not self.enabled:
            return {}
        return {"loss_scale": float(self.scale), "skipped_steps": int(self.skips)}

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker),
                "skipped_steps": int(self.skips)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:  # a checkpoint of a run that did not scale: start from the initial scale
            return
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.skips.fill_(int(state.get("skipped_steps", 0)))
