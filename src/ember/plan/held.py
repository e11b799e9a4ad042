"""What a pipeline schedule makes a rank hold at once, in micro-batches: activations, the
loss's state, and the gradients a split backward keeps for its deferred weight gradient.

The counts are those of the action orders `torch.distributed.pipelining` builds, which
ember's trainer runs; tests/plan/test_zero_bubble.py walks those orders action by action
and checks each function here against them.

- Activations (`in_flight`) live from a micro-batch's forward to its backward, or under the
  zero-bubble schedules to its weight gradient W (PyTorch retains the graph for it).
- The loss's state (`output_in_flight`): ember's fused loss computes the gradients of the
  hidden states and of the output weight in its forward (model/loss.py) and keeps them until
  backward, an unfused loss its fp32 softmax. 1F1B and interleaved run the last stage's
  backward right after its forward, so one micro-batch's; GPipe runs every forward first;
  the zero-bubble schedule keeps p until their W. For a large vocabulary this is the
  biggest thing the last stage holds: Llama 3's output weight gradient is 2.1 GB in fp32
  (1.05 GB in bf16, as the loss keeps it under FSDP).
- Split backward (`awaiting_weight_grads`): the input-gradient pass I of a zero-bubble
  schedule (`stage_backward_input`) records, for every weight, the gradient of the output
  of the op that uses it (the matmul's output, the norm's), and W starts from those. They
  are held from I to W: on rank r of `zero_bubble` r + 1 chunks at the activation peak, on
  every rank of `zbv` one. The first stage runs no I (its input needs no gradient), so it
  keeps none. (Recomputation would rerun a block's forward per weight group in W, so
  ember's trainer refuses it under these schedules: ember.layout.)
"""

from __future__ import annotations

from ember.cost import layer_matmuls
from ember.layout import ZERO_BUBBLE, Layout


def in_flight(layout: Layout, micro_batches: int, stage: int) -> float:
    """Micro-batches' worth of the stage's layers holding activations at the peak."""
    p, v, m = layout.pp, layout.vpp, micro_batches
    if p == 1:  # no pipeline: accumulation runs one micro-batch at a time whatever the schedule says
        return 1
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved":
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
        return chunks / v
    # The zero-bubble schedules keep a micro-batch's activations until its weight gradient,
    # which they defer: every rank peaks at p of its stages' micro-batches, and under zbv
    # short of 2p - 1 micro-batches rank r at (m + 1 + r) chunks of half its layers.
    if layout.schedule == "zero_bubble":
        return min(m, p)
    if layout.schedule == "zbv":
        return min(2 * p, m + 1 + stage) / 2
    return min(m, p - stage)


def output_in_flight(layout: Layout, micro_batches: int) -> int:
    """Micro-batches whose loss state the output layer's rank holds at once."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return micro_batches
    if layout.schedule == "zero_bubble":
        return min(micro_batches, layout.pp)
    return 1


def awaiting_weight_grads(layout: Layout, micro_batches: int, stage: int) -> float:
    """Micro-batches' worth of the stage's layers whose input gradient has run and whose
    weight gradient has not, at the activation peak."""
    if layout.pp == 1 or layout.schedule not in ZERO_BUBBLE:
        return 0.0
    chunks = 1 if layout.schedule == "zbv" else min(stage + 1, micro_batches * layout.vpp)
    return chunks / layout.vpp


def weight_grad_inputs(model, layout: Layout, norm_bytes: int, out_bytes: int) -> float:
    """Bytes per token one block keeps from I to W: the gradient of each weight's op output.
    The two norms' (h each, split by sequence parallelism) in the residual stream's dtype
    (fp32 where ember autocasts over fp32 weights), the column-parallel projections' (q,
    k, v, gate, up: split by tp) and the row-parallel ones' (attention output and down:
    the whole local partial sum, h) in the matmul's output dtype."""
    widths = {name: out for name, (_, out) in layer_matmuls(model).items()}
    column, row = (widths["qkv"] + widths["up"]) / layout.tp, widths["out"] + widths["down"]
    norms = 2 * model.hidden / (layout.tp if layout.sp else 1)
    return norms * norm_bytes + (column + row) * out_bytes
