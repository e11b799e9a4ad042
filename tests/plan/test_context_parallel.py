"""Context parallelism as the planner prices other frameworks' runs: the layout rules, the
memory and work it divides, and the ring of key/value blocks it adds."""

import json

import pytest

from ember.cli import main
from ember.layout import Layout, problems
from ember.plan.cluster import make_cluster
from ember.plan.layout import TrainShape, candidates, parse_layout
from ember.plan.models import PRESETS
from ember.plan.predict import predict
from ember.plan.stacks import stack
from ember.plan.timing import layer_times

LLAMA = PRESETS["llama3-8b"]
LONG = TrainShape(65536, 16)


def test_layout_rules_and_text():
    lo = parse_layout("tp=2,cp=4,pp=1,zero=1,mbs=1", 64)
    assert (lo.cp, lo.dp, lo.gpus, lo.shard_ranks) == (4, 8, 64, 32)
    assert lo.text() == "tp=2,cp=4,pp=1,dp=8,zero=1,mbs=1,recompute=none"
    assert parse_layout(lo.text(), 64) == lo
    assert "parallel.cp" not in lo.settings(64)  # not a key of ember's recipes
    assert any("not something ember's trainer runs" in p for p in problems(lo, LLAMA, 64, 64))
    assert not problems(lo, LLAMA, 64, 64, seq_len=65536, ember=False)
    assert any("divisible by 8" in p for p in problems(lo, LLAMA, 64, 64, seq_len=65540, ember=False))
    # ZeRO may shard over the cp ranks alone: they hold the same weights.
    alone = Layout(cp=8, zero=3, micro_batch=1)
    assert alone.shard_ranks == 8 and not problems(alone, LLAMA, 8, 8, seq_len=65536, ember=False)


def test_a_stated_cp_is_the_only_one_priced():
    shape, cluster = TrainShape(65536, 8), make_cluster("H100", 8, 8, stack=stack("nemo"))
    assert all(lo.cp == 1 for lo in candidates(LLAMA, 8, 8, shape))
    pinned = candidates(LLAMA, 8, 8, shape, fixed={"cp": 4}, ember_only=False)
    assert pinned and all(lo.cp == 4 and lo.gpus == 8 for lo in pinned)
    assert all(predict(LLAMA, cluster, shape, lo).step_time_s > 0 for lo in pinned[:5])


def test_cp_divides_activations_and_work_and_adds_a_ring():
    cluster = make_cluster("H100", 16, 8, stack=stack("nemo"))
    one = Layout(tp=1, cp=1, dp_shard=16, zero=1, micro_batch=1, recompute="full")
    four = Layout(tp=1, cp=4, dp_shard=4, zero=1, micro_batch=1, recompute="full")
    a, b = predict(LLAMA, cluster, LONG, one), predict(LLAMA, cluster, LONG, four)
    assert b.memory.activations == pytest.approx(a.memory.activations / 4, rel=0.01)
    # The same tokens per GPU, at nearly the same rate: the ring hides behind attention.
    assert 0.85 < b.tokens_per_s_per_gpu / a.tokens_per_s_per_gpu < 1.0
    links = cluster.links
    plain = layer_times(LLAMA, cluster.gpu, links, 65536, 1, 1, False, "none", "flash")
    split = layer_times(LLAMA, cluster.gpu, links, 65536, 1, 1, False, "none", "flash", 1, False, False, 4)
    assert split.forward.attention == pytest.approx(plain.forward.attention / 4)
    assert split.forward.matmul < plain.forward.matmul / 3.5
    assert split.forward.tp_comm > 0 and plain.forward.tp_comm == 0
    # Across nodes (tp 8 leaves the cp ranks on other nodes) the ring costs more.
    near = layer_times(LLAMA, cluster.gpu, links, 65536, 1, 2, False, "none", "flash", 1, False, False, 4)
    far = layer_times(LLAMA, cluster.gpu, links, 65536, 1, 8, False, "none", "flash", 1, False, False, 4)
    assert far.backward.tp_comm / far.backward.attention > near.backward.tp_comm / near.backward.attention


def test_cp_from_the_command_line(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "16", "--seq-len", "65536",
            "--global-batch", "16", "--layout", "tp=1,cp=4,pp=1,dp=4,zero=1,mbs=1,recompute=full", "--json"]
    assert main(base + ["--stack", "nemo"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"].startswith("tp=1,cp=4,") and out["fits"]
    assert main(base) == 0  # ember's own stack prices it, and says its trainer cannot run it
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("ember's trainer refuses this layout: context parallelism" in n for n in notes)


def test_other_software_searches_cp_for_long_sequences_only():
    long, short = TrainShape(131072, 16), TrainShape(8192, 16)
    assert {lo.cp for lo in candidates(LLAMA, 16, 8, long, ember_only=False)} == {1, 2, 4, 8, 16}
    assert {lo.cp for lo in candidates(LLAMA, 16, 8, long)} == {1}  # ember's trainer: no cp
    assert {lo.cp for lo in candidates(LLAMA, 16, 8, short, ember_only=False)} == {1}
    # At 128k tokens on one node of H100s, what fits needs the sequence split.
    from ember.plan.search import search

    best = search(LLAMA, make_cluster("H100", 16, 8, stack=stack("nemo")), long, ember_only=False).best
    assert best.layout.cp > 1 and best.fits


def test_the_table_shows_cp_where_a_layout_has_it(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "16", "--seq-len", "131072",
            "--global-batch", "16", "--stack", "nemo", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "┃ cp ┃" in out and "best layout for --stack nemo: " in out and ",cp=" in out
