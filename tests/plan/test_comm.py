"""Communication volumes and the link each group crosses under the rank mapping."""

import dataclasses

import pytest

from ember.layout import Layout
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape
from ember.plan.models import PRESETS
from ember.plan.predict import predict

from ember.plan.comm import (Group, Links, all_gather_s, all_reduce_s, bus_bandwidth, groups, p2p_s, place,
                             reduce_scatter_s)

LINKS = Links(gpus_per_node=8, intra_gbps=100, inter_gbps=10, intra_eff=1.0, inter_eff=1.0,
              intra_latency_s=0.0, inter_latency_s=0.0, intra_step_latency_s=0.0, inter_step_latency_s=0.0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_volumes(n):
    nbytes = 1e9
    group = Group(n, n)  # inside one node: 100 GB/s
    assert all_reduce_s(nbytes, group, LINKS) == pytest.approx(2 * (n - 1) / n * nbytes / 100e9)
    assert reduce_scatter_s(nbytes, group, LINKS) == pytest.approx((n - 1) / n * nbytes / 100e9)
    assert all_gather_s(nbytes, group, LINKS) == reduce_scatter_s(nbytes, group, LINKS)
    assert all_reduce_s(nbytes, Group(1, 1), LINKS) == 0.0


def test_rank_mapping_places_tp_innermost_and_pp_outermost():
    g = groups(tp=8, dp_shard=4, dp_replicate=2, pp=4, gpus_per_node=8)
    assert g["tp"] == Group(8, 8) and not g["tp"].crosses_nodes
    assert g["dp_shard"] == Group(4, 1) and g["dp_replicate"] == Group(2, 1) and g["pp"] == Group(4, 1)
    g = groups(tp=2, dp_shard=8, dp_replicate=1, pp=2, gpus_per_node=8)
    assert g["dp_shard"] == Group(8, 4)  # 4 shards share each node, each with its own NIC
    assert place(4, 1, 8) == Group(4, 4) and place(16, 1, 8) == Group(16, 8)


def test_bandwidth_of_groups_that_span_nodes():
    assert bus_bandwidth(Group(8, 8), LINKS) == 100e9
    assert bus_bandwidth(Group(16, 1), LINKS) == 10e9  # one NIC per node in the ring
    assert bus_bandwidth(Group(16, 4), LINKS) == 40e9  # four NICs per node
    assert bus_bandwidth(Group(32, 16), LINKS) == 100e9  # never faster than NVLink
    assert p2p_s(1e9, Group(2, 1), LINKS) == pytest.approx(0.1)
    assert p2p_s(1e9, Group(2, 2), LINKS) == pytest.approx(0.01)


def test_ring_collectives_pay_a_latency_per_step():
    """NCCL's tuning model: set-up plus one per-hop latency per ring step, 2(n-1) steps for an
    all-reduce and n-1 for a reduce-scatter, on the network's latency once a ring spans nodes."""
    links = Links(gpus_per_node=8, intra_gbps=100, inter_gbps=10, intra_latency_s=8e-6, inter_latency_s=9e-6,
                  intra_step_latency_s=5e-6, inter_step_latency_s=7e-6)
    tiny = 1.0  # one byte: latency only
    assert all_reduce_s(tiny, Group(8, 8), links) == pytest.approx(8e-6 + 14 * 5e-6, rel=1e-6)
    assert reduce_scatter_s(tiny, Group(8, 8), links) == pytest.approx(8e-6 + 7 * 5e-6, rel=1e-6)
    assert all_reduce_s(tiny, Group(64, 8), links) == pytest.approx(9e-6 + 126 * 7e-6, rel=1e-6)
    # So an 8-way all-gather of a small buffer costs several times a 2-way one.
    assert all_gather_s(1e3, Group(8, 8), links) > 3 * all_gather_s(1e3, Group(2, 2), links)


def test_zero_prices_its_gathers_and_reductions_at_their_own_measured_rates():
    """Each kind of collective moves its bytes at its own bus bandwidth (a calibration
    measures gloo's all-gather and reduce-scatter several times slower than its all-reduce),
    and a ZeRO step prices its gathers and reductions so, where a DDP step has neither."""
    slow = Links(**{**LINKS.__dict__, "all_gather_ratio": 0.5, "reduce_scatter_ratio": 0.25})
    group = Group(4, 4)
    assert all_reduce_s(1e9, group, slow) == all_reduce_s(1e9, group, LINKS)
    assert all_gather_s(1e9, group, slow) == pytest.approx(2 * all_gather_s(1e9, group, LINKS))
    assert reduce_scatter_s(1e9, group, slow) == pytest.approx(4 * reduce_scatter_s(1e9, group, LINKS))
    across = Group(16, 8)
    assert bus_bandwidth(across, slow, "reduce_scatter") == pytest.approx(0.25 * bus_bandwidth(across, LINKS))

    model, shape = PRESETS["gpt2-small"], TrainShape(1024, 16)
    base = make_cluster("A100-80GB", 8)
    base = dataclasses.replace(base, stack=dataclasses.replace(base.stack, overlap_grad_reduce=False,
                                                               overlap_param_gather=False))

    def step(lo, **ratios):
        cluster = dataclasses.replace(base, links=dataclasses.replace(base.links, **ratios))
        return predict(model, cluster, shape, lo).step_time_s

    ddp, zero2 = Layout(dp_replicate=8, micro_batch=2), Layout(dp_shard=8, zero=2, micro_batch=2)
    assert step(ddp, reduce_scatter_ratio=0.5, all_gather_ratio=0.5) == step(ddp)
    for lo in (zero2, Layout(dp_shard=8, zero=3, micro_batch=2)):
        assert step(lo, reduce_scatter_ratio=0.5) > step(lo)
        assert step(lo, all_gather_ratio=0.5) > step(lo)
