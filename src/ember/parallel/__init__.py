"""Parallel layouts applied to the plain model from outside (docs/parallel.md).

(A layout's checks, before anything is built, live in ember/layout.py.)

mesh      the process group and the ("pp", "dp_replicate", "dp_shard", "tp") device mesh
engine    what one step runs on a rank: the Engine interface, LocalEngine, build_engine
data      DDP (ZeRO-0) and FSDP2 (ZeRO-1/2/3, hybrid) over the data-parallel ranks
recompute activation checkpointing and torch.compile per block
tensor    tensor and sequence parallelism through DTensor (vocabulary-parallel embedding and loss)
stages    the plain model cut into pipeline stages that keep its parameter names
pipeline  pipeline schedules (GPipe, 1F1B, interleaved, zero-bubble) behind the Engine interface
"""
