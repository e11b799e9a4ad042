"""Collective and point-to-point communication: how long each takes on the link it crosses.

Rank mapping. Global ranks are laid out with the tensor-parallel index varying fastest,
then the context-parallel index (cp, where a run has it), then the ZeRO shard index, then
the replica index, then the pipeline stage:
    rank = tp_i + tp·(cp_i + cp·(shard_i + dp_shard·(replica_i + dp_replicate·stage_i))),
and node = rank // gpus_per_node. This is Megatron-LM's and DeepSpeed's order (tensor
innermost, pipeline outermost) with the data-parallel axis split the way hybrid sharding
does it (shard inside, replicate outside). So the chattiest group (tensor parallel, every
layer) stays on NVLink, ZeRO-3's per-micro-batch gathers come next, and pipeline stages,
which exchange only one activation tensor per micro-batch, span nodes first.

Bandwidth. A ring collective over a group that stays in one node runs at the NVLink (or
PCIe) bandwidth. A group spanning nodes with g members per node drives g NICs at once (a
rail-optimised cluster gives every GPU its own NIC), so its ring runs at
min(intra, g·inter) per GPU. The "bus" efficiencies are those nccl-tests report against
the link rate: ~0.8 on NVLink (230-240 GB/s all-reduce bus bandwidth on DGX A100's
300 GB/s, ~360 on DGX H100's 450) and ~0.9 on InfiniBand.

Volumes per GPU (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention): a ring
all-reduce moves 2(n-1)/n of the buffer, reduce-scatter and all-gather (n-1)/n each.

Latency. A ring collective runs in steps, each passing a chunk one hop along the ring: 2(n-1)
for an all-reduce, n-1 for a reduce-scatter or all-gather. NCCL's tuning model charges each
step a per-hop latency (5.7 µs on NVLink, 6.6 µs over the network, Simple protocol) on top
of a fixed set-up, so an 8-way all-gather costs ~50 µs however small it is, and large rings
over thousands of GPUs pay milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Links:
    """The node size and per-GPU, one-direction link rates in GB/s, with the share of the
    rate collectives reach and a fixed cost per collective. A calibration run can replace
    the efficiencies and latencies with measured ones (they are part of a profile file)."""

    gpus_per_node: int
    intra_gbps: float
    inter_gbps: float
    intra_eff: float = 0.8
    inter_eff: float = 0.9
    intra_latency_s: float = 10e-6  # per collective or send: launch and set-up (NCCL's base 8.4 µs)
    inter_latency_s: float = 20e-6  # the same across nodes, where InfiniBand adds its own
    intra_step_latency_s: float = 5.7e-6  # per step of a ring inside a node (NCCL: NVLink, Simple)
    inter_step_latency_s: float = 6.6e-6  # per step of a ring spanning nodes (NCCL: network, Simple)
    # Bus bandwidth of an all-gather and of a reduce-scatter over that of an all-reduce on the
    # same ring. NCCL runs all three as the same ring and nccl-tests report about equal bus
    # bandwidths, so 1; gloo's all-gather and reduce-scatter are other algorithms, several
    # times slower per byte on a CPU. A calibration measures both (plan/calibrate.py).
    all_gather_ratio: float = 1.0
    reduce_scatter_ratio: float = 1.0


@dataclass(frozen=True)
class Group:
    """A communication group: `size` ranks, `per_node` of them on each node it spans."""

    size: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.size > self.per_node


def place(size: int, stride: int, gpus_per_node: int) -> Group:
    """Where a group of `size` ranks `stride` apart lands on nodes of `gpus_per_node`."""
    if size <= 1:
        return Group(1, 1)
    if stride * size <= gpus_per_node:
        return Group(size, size)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return Group(size, per_node)


def groups(tp: int, dp_shard: int, dp_replicate: int, pp: int, gpus_per_node: int, cp: int = 1) -> dict[str, Group]:
    """The groups of a layout under the rank mapping above. `dp_shard` is the group ZeRO
    shards over and gradients are reduced in before the replicas: the shard ranks and the
    cp ranks inside them, which hold the same weights."""
    g = gpus_per_node
    return {"tp": place(tp, 1, g), "cp": place(cp, tp, g), "dp_shard": place(dp_shard * cp, tp, g),
            "dp_replicate": place(dp_replicate, tp * cp * dp_shard, g),
            "pp": place(pp, tp * cp * dp_shard * dp_replicate, g)}


def bus_bandwidth(group: Group, links: Links, kind: str = "all_reduce") -> float:
    """Bytes/s a ring collective of `kind` (all_reduce, all_gather, reduce_scatter) over
    `group` sustains per GPU."""
    ratio = {"all_reduce": 1.0, "all_gather": links.all_gather_ratio,
             "reduce_scatter": links.reduce_scatter_ratio}[kind]
    intra = links.intra_gbps * 1e9 * links.intra_eff
    if not group.crosses_nodes:
        return intra * ratio
    return min(intra, group.per_node * links.inter_gbps * 1e9 * links.inter_eff) * ratio


def ring_latency_s(steps: int, group: Group, links: Links) -> float:
    """The fixed cost of a ring collective of `steps` steps: set-up once, then every step
    waits for its chunk to cross one link (NCCL's own tuning model, src/graph/tuning.cc:
    latency = base + steps · per-hop latency, 2(n-1) steps for an all-reduce and n-1 for a
    reduce-scatter or all-gather; a ring that spans nodes pays the network's per step)."""
    if group.crosses_nodes:
        return links.inter_latency_s + steps * links.inter_step_latency_s
    return links.intra_latency_s + steps * links.intra_step_latency_s


def all_reduce_s(nbytes: float, group: Group, links: Links) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ring_latency_s(2 * (n - 1), group, links) + 2 * (n - 1) / n * nbytes / bus_bandwidth(group, links)


def reduce_scatter_s(nbytes: float, group: Group, links: Links, kind: str = "reduce_scatter") -> float:
    """A reduce-scatter of a (full, unsharded) buffer of `nbytes`; with `kind` "all_gather",
    the all-gather that ends with that buffer."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ring_latency_s(n - 1, group, links) + (n - 1) / n * nbytes / bus_bandwidth(group, links, kind)


def all_gather_s(nbytes: float, group: Group, links: Links) -> float:
    return reduce_scatter_s(nbytes, group, links, "all_gather")


def p2p_s(nbytes: float, pp: Group, links: Links) -> float:
    """One send between neighbouring pipeline stages; the slowest boundary sets the pace,
    so if any boundary crosses nodes, all are charged the network (one NIC per GPU)."""
    if pp.size <= 1 or nbytes <= 0:
        return 0.0
    intra = links.intra_latency_s + nbytes / (links.intra_gbps * 1e9 * links.intra_eff)
    if pp.crosses_nodes:  # the other boundaries stay inside a node, and a slow one sets the pace too
        return max(intra, links.inter_latency_s + nbytes / (links.inter_gbps * 1e9 * links.inter_eff))
    return intra
