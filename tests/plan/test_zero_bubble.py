"""The zero-bubble schedules as the planner prices them, against the action orders PyTorch
builds for them (the orders ember's trainer runs), simulated action by action.

Each rank runs its actions in order; an action starts when its rank is free and what it
needs is done: a forward after the previous stage's forward of that micro-batch, an input
gradient after the next stage's and its own forward, a weight gradient after its input
gradient. The step ends with the last action (the ranks then clip and step together)."""

import itertools

import pytest
import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import _ComputationType as Op

from ember.layout import Layout
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape, candidates, parse_layout
from ember.plan.held import awaiting_weight_grads, in_flight, output_in_flight, weight_grad_inputs
from ember.plan.models import PRESETS
from ember.plan.predict import predict
from ember.plan.schedule import idle_share, pipeline_s
from ember.plan.stacks import stack

CLASSES = {"zero_bubble": S.ScheduleInterleavedZeroBubble, "zbv": S.ScheduleZBVZeroBubble,
           "interleaved": S.ScheduleInterleaved1F1B}


def orders(schedule: str, pp: int, vpp: int, micro_batches: int) -> dict:
    """rank -> its actions, as the schedule's constructor computes them (without stages)."""
    sched = object.__new__(CLASSES[schedule])
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, vpp, micro_batches
    sched.num_stages = sched._num_stages = pp * vpp
    sched.number_of_rounds = max(1, micro_batches // pp)
    sched.microbatches_per_round = micro_batches // sched.number_of_rounds
    sched.pipeline_order = {rank: sched._calculate_single_rank_operations(rank) for rank in range(pp)}
    if schedule == "zero_bubble":
        sched.pipeline_order = sched._add_bubbles_to_actions(pp * vpp)
    kinds = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.FULL_BACKWARD)
    return {rank: [a for a in acts if a is not None and a.computation_type in kinds]
            for rank, acts in sched.pipeline_order.items()}


def simulate(order: dict, stages: int, f: float, i: float, w: float) -> float:
    done, free, next_action = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    moved = True
    while moved:
        moved = False
        for rank, acts in order.items():
            while next_action[rank] < len(acts):
                a = acts[next_action[rank]]
                s, op, mb = a.stage_index, a.computation_type, a.microbatch_index
                if op == Op.FORWARD:
                    key, needs, took = "F", [(s - 1, "F", mb)] if s else [], f
                elif op == Op.BACKWARD_WEIGHT:
                    key, needs, took = "W", [(s, "I", mb)], w
                else:
                    key, needs, took = "I", [(s, "F", mb)] + ([(s + 1, "I", mb)] if s < stages - 1 else []), i
                    took += w if op == Op.FULL_BACKWARD else 0.0
                if any(n not in done for n in needs):
                    break
                free[rank] = done[(s, key, mb)] = max([free[rank]] + [done[n] for n in needs]) + took
                next_action[rank] += 1
                moved = True
    assert all(next_action[r] == len(acts) for r, acts in order.items()), "the order deadlocked"
    return max(free.values())


# Per-chunk (forward, input gradient, weight gradient): a transformer block's I >= F >= W.
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (1.0, 3.0, 0.8), (0.7, 2.4, 0.3), (1.0, 1.1, 0.9)]


@pytest.mark.parametrize("schedule,vpp", [("zero_bubble", 2), ("zero_bubble", 3), ("zbv", 2), ("interleaved", 2)])
def test_the_priced_pipeline_time_is_the_simulated_one(schedule, vpp):
    for pp, rounds, (f, i, w) in itertools.product((2, 3, 4, 8), (1, 2, 3), TIMES):
        m = rounds * pp  # the multi-stage schedules take a multiple of pp
        simulated = simulate(orders(schedule, pp, vpp, m), pp * vpp, f, i, w)
        stage = vpp * (f + i + w)  # a rank's time per micro-batch over its vpp chunks
        share = idle_share(schedule, vpp * f, vpp * i, vpp * w, m, pp)
        priced, bubble = pipeline_s([stage] * pp, m, vpp, [share] * pp)
        assert priced == pytest.approx(simulated), (pp, m, f, i, w)
        if schedule == "zero_bubble":  # the weight gradients fill what 1F1B's fill and drain leave
            assert bubble == pytest.approx((pp - 1) * (f + i - w))


@pytest.mark.parametrize("schedule,vpp", [("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2), ("interleaved", 2),
                                          ("interleaved", 3)])
def test_activations_held_are_the_orders_peak(schedule, vpp):
    """A micro-batch's activations live from its forward to its weight gradient (PyTorch
    keeps the graph for it), or to its whole backward."""
    for pp, rounds in itertools.product((2, 3, 4, 8), (1, 2, 3)):
        m = rounds * pp
        for rank, acts in orders(schedule, pp, vpp, m).items():
            held = peak = 0
            for a in acts:
                held += 1 if a.computation_type == Op.FORWARD else -(a.computation_type in (
                    Op.BACKWARD_WEIGHT, Op.FULL_BACKWARD))
                peak = max(peak, held)
            lo = Layout(pp=pp, vpp=vpp, schedule=schedule)
            assert in_flight(lo, m, rank) == pytest.approx(peak / vpp), (pp, m, rank)


@pytest.mark.parametrize("schedule,vpp", [("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2), ("interleaved", 2),
                                          ("interleaved", 3)])
def test_what_waits_for_the_weight_gradient_is_the_orders(schedule, vpp):
    """At each rank's activation peak: the chunks whose input gradient ran and whose weight
    gradient did not (the first stage runs no input gradient), and the most micro-batches
    of the last stage between its forward and its weight gradient (the loss's state)."""
    for pp, rounds in itertools.product((2, 3, 4, 8), (1, 2, 3)):
        m, last = rounds * pp, pp * vpp - 1
        lo = Layout(pp=pp, vpp=vpp, schedule=schedule)
        for rank, acts in orders(schedule, pp, vpp, m).items():
            live, awaiting, at_peak, loss_state, most = set(), set(), (0, 0), set(), 0
            for a in acts:
                key = (a.stage_index, a.microbatch_index)
                if a.computation_type == Op.FORWARD:
                    live.add(key)
                    loss_state |= {key} if a.stage_index == last else set()
                elif a.computation_type == Op.BACKWARD_INPUT:
                    awaiting |= {key} if a.stage_index > 0 else set()
                else:
                    for held in (live, awaiting, loss_state):
                        held.discard(key)
                at_peak = max(at_peak, (len(live), len(awaiting)))
                most = max(most, len(loss_state))
            assert awaiting_weight_grads(lo, m, rank) == pytest.approx(at_peak[1] / vpp), (pp, m, rank)
            if most:
                assert output_in_flight(lo, m) == most, (pp, m, rank)


@pytest.mark.parametrize("shape", ["llama", "gpt"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_split_backward_keeps_what_the_planner_counts(shape, autocast):
    """PyTorch's input-gradient pass on one real block records the gradients its weight
    gradient will start from: their bytes are weight_grad_inputs' (unfused projections, as
    ember runs zero-bubble stages; under autocast the residual stream, and so the norms'
    gradients, stay fp32)."""
    from torch.distributed.pipelining._backward import stage_backward_input

    from ember.config import load_config
    from ember.model.layers import Block
    from ember.plan.models import from_config

    extra = {"llama": [], "gpt": ["model.norm=layernorm", "model.activation=gelu", "model.positions=learned"]}[shape]
    cfg = load_config("configs/tiny-gpt.toml", ["model.max_seq_len=64", "model.vocab_size=512", *extra])
    torch.manual_seed(0)
    block = Block(cfg.model)
    for module in block.modules():
        if hasattr(module, "fused"):
            module.fused = False
    x = torch.randn(2, 64, cfg.model.hidden, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = block(x)
    _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], block.parameters())
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for group in groups for grads in group["grads"] for t in grads if t is not None}
    assert len(groups) >= 8  # every weight's op: two norms, q, k, v, out, the MLP's
    counted = weight_grad_inputs(from_config(cfg.model, shape), Layout(), 4, 2 if autocast else 4)
    assert sum(kept.values()) / (2 * 64) == pytest.approx(counted)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_split_backward_cannot_afford_recomputation(mode):
    """Why ember refuses a zero-bubble schedule with recomputation (ember.layout): on one
    real block, the weight-gradient pass reruns a fully recomputed block's forward once per
    weight group, and a selectively recomputed one cannot run backward a second time."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from ember.config import load_config
    from ember.model.layers import Block
    from ember.parallel.recompute import _checkpointed, _selective

    cfg = load_config("configs/tiny-gpt.toml", ["model.max_seq_len=64", "model.vocab_size=512"])
    block, forwards = Block(cfg.model), []
    block.attn_norm.register_forward_pre_hook(lambda *_: forwards.append(1))
    x = torch.randn(2, 64, cfg.model.hidden, requires_grad=True)
    y = (_checkpointed if mode == "full" else _selective)(block.forward, x)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], block.parameters())
    assert len(forwards) == 2  # the forward, and the recomputation for the input gradient
    if mode == "selective":
        with pytest.raises(RuntimeError, match="backward an extra time"):
            stage_backward_weight(block.parameters(), groups)
        return
    stage_backward_weight(block.parameters(), groups)
    assert len(forwards) - 2 == len(groups) > 1


GPT3 = PRESETS["gpt3-175b"]  # LayerNorm and GELU: one kernel each compiled or not
LLAMA = PRESETS["llama3-8b"]  # RMSNorm, rotary, SwiGLU: eager composites when not compiled


def test_the_weight_gradients_shrink_the_bubble_and_not_the_work():
    cluster, shape = make_cluster("A100-80GB", 128), TrainShape(2048, 64)
    base = "tp=8,pp=8,dp=2,zero=1,mbs=1,recompute=none"  # FSDP2 holds the weights in bf16
    runs = {s: predict(GPT3, cluster, shape, parse_layout(f"{base},schedule={s},vpp=2", 128))
            for s in ("interleaved", "zero_bubble")}
    bubble = {s: p.shares["bubble"] * p.step_time_s for s, p in runs.items()}
    work = {s: p.step_time_s - bubble[s] for s, p in runs.items()}
    assert work["zero_bubble"] == pytest.approx(work["interleaved"], rel=1e-6)
    assert 0 < bubble["zero_bubble"] < 0.8 * bubble["interleaved"]
    # Held as 1F1B holds them, below interleaved's extra (p - 1) chunks.
    assert runs["zero_bubble"].memory.activations < runs["interleaved"].memory.activations
    # Without FSDP the trainer autocasts over fp32 weights, and an eager zero-bubble stage
    # keeps every micro-batch's bf16 weight copies until its backward: more than the bubble
    # saves in activations (the compiled interleaved stage reruns the casts instead).
    plain = {s: predict(GPT3, make_cluster("A100-80GB", 64), TrainShape(2048, 32),
                        parse_layout(f"tp=8,pp=8,dp=1,mbs=1,recompute=none,schedule={s},vpp=2", 64))
             for s in ("interleaved", "zero_bubble")}
    assert plain["zero_bubble"].memory.activations > plain["interleaved"].memory.activations


def test_on_a_gpu_zero_bubble_stages_run_eager():
    """ember compiles its blocks on a GPU, but not a zero-bubble schedule's stages: their
    RMSNorm, rotary and SwiGLU run as eager composites. A CPU runs every layout eager."""
    shape, base = TrainShape(4096, 32), "tp=2,sp=1,pp=4,vpp=2,dp=1,mbs=1,recompute=none"

    def work(cluster, model, schedule):
        p = predict(model, cluster, shape, parse_layout(f"{base},schedule={schedule}", 8))
        return p.step_time_s * (1 - p.shares["bubble"])

    gpu = make_cluster("H100-80GB", 8)
    assert work(gpu, LLAMA, "zero_bubble") > 1.02 * work(gpu, LLAMA, "interleaved")
    assert work(gpu, GPT3, "zero_bubble") == pytest.approx(work(gpu, GPT3, "interleaved"), rel=1e-6)
    cpu_like = make_cluster("H100-80GB", 8, stack=stack("ember", host_overlaps=False))
    assert work(cpu_like, LLAMA, "zero_bubble") == pytest.approx(work(cpu_like, LLAMA, "interleaved"), rel=1e-6)


def test_the_search_offers_them_where_the_trainer_runs_them():
    layouts = candidates(LLAMA, 16, 8, TrainShape(4096, 64), fixed={"tp": 2, "pp": 4})
    offered = {(lo.schedule, lo.vpp) for lo in layouts}
    assert {("zero_bubble", 2), ("zero_bubble", 4), ("zbv", 2)} <= offered
    assert not any(lo.schedule == "zbv" and lo.vpp != 2 for lo in layouts)
    others = candidates(LLAMA, 16, 8, TrainShape(4096, 64), fixed={"tp": 2, "pp": 4}, ember_only=False)
    assert not {lo.schedule for lo in others} & {"zero_bubble", "zbv"}  # no published run used them


def test_the_planners_stages_have_a_blocks_proportions(monkeypatch):
    """The forms above hold where I >= F >= W; every stage the planner prices has them."""
    from ember.plan import predict as module
    from ember.plan.search import search

    seen = []
    monkeypatch.setattr(module, "idle_share", lambda *args: seen.append(args[1:4]) or idle_share(*args))
    for model, gpu, gpus, shape in ((LLAMA, "H100-80GB", 16, TrainShape(8192, 64)),
                                    (GPT3, "A100-80GB", 64, TrainShape(2048, 128))):
        search(model, make_cluster(gpu, gpus), shape, fixed={"pp": 4})
    assert len(seen) > 1000
    assert all(i >= f >= w > 0 for f, i, w in seen)


def test_under_zbv_with_few_micro_batches_the_last_rank_holds_the_most():
    from ember.plan.memory import memory

    small_vocab = LLAMA.with_shape(vocab_size=1024)  # so that rank 0's two ends weigh little
    lo = parse_layout("tp=2,sp=1,pp=4,schedule=zbv,dp=1,mbs=1,recompute=none", 8)
    gpu = make_cluster("H100-80GB", 8).gpu
    few = memory(small_vocab, lo, TrainShape(4096, 4), gpu)  # m = pp < 2pp - 1: rank r holds m + 1 + r chunks
    assert few.stage == 3
    many = memory(small_vocab, lo, TrainShape(4096, 16), gpu)  # every rank holds 2pp chunks; rank 0 the ends too
    assert many.stage == 0


def test_a_zero_bubble_best_says_no_published_run_vouches_for_it():
    from ember.plan.report import interval_notes
    from ember.plan.search import rank

    cluster, shape = make_cluster("H100-80GB", 16), TrainShape(4096, 64)
    base = "tp=2,sp=1,pp=8,dp=1,mbs=1,recompute=none"
    layouts = [parse_layout(f"{base},schedule={s}", 16) for s in ("1f1b", "interleaved,vpp=2", "zero_bubble,vpp=2")]
    ranked = rank(LLAMA, cluster, shape, layouts)
    notes = {p.layout.schedule: interval_notes([p]) for p in ranked}
    assert any("zero-bubble" in note for note in notes["zero_bubble"])
    assert not any("zero-bubble" in note for s in ("1f1b", "interleaved") for note in notes[s])
