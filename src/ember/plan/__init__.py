"""The cost model (FLOPs per token) and hardware profiles: one source of truth for the
trainer's MFU and, later, the planner's predictions."""

from ember.plan.cost import forward_flops_per_token, matmul_params, model_flops_per_token
from ember.plan.hardware import GPU, GPUS, find_gpu, peak_flops

__all__ = ["GPU", "GPUS", "find_gpu", "forward_flops_per_token", "matmul_params",
           "model_flops_per_token", "peak_flops"]
