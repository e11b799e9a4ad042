"""The cost model and the planner (`ember plan`): one source of truth for the trainer's MFU
and the planner's predictions.

cost.py (FLOPs), hardware.py (GPU table), models.py (model shapes and presets),
cluster.py (cluster and profile files), layout.py (layouts, legality, search space),
memory.py, comm.py and timing.py (bytes, links and seconds), predict.py (one layout),
search.py (all layouts), report.py and command.py (what the user sees)."""

from ember.plan.cost import forward_flops_per_token, matmul_params, model_flops_per_token
from ember.plan.hardware import GPU, GPUS, find_gpu, peak_flops

__all__ = ["GPU", "GPUS", "find_gpu", "forward_flops_per_token", "matmul_params",
           "model_flops_per_token", "peak_flops"]
