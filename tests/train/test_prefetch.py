"""Batches made one step ahead on a thread are the batches made when asked: same rows,
masks and positions, through a batch-size change, a checkpoint and a rollback."""

import torch

from conftest import REPO, TINY
from ember.config import load_config
from ember.data import Batches, load_manifest
from ember.train.inputs import Inputs, Prefetcher

SIZES = [8, 8, 16, 16, 8, 24]  # a ramp that also goes down: a batch made ahead is put back


def _prefetcher(dataset, ahead: bool, rank: int = 0, world: int = 1) -> Prefetcher:
    cfg = load_config(REPO / "configs/tiny-gpt.toml", TINY + ["model.objective=mlm", "train.micro_batch=4"])
    manifest = load_manifest(dataset)
    batches = Batches(dataset, manifest, "train", seed=3, rank=rank, world=world)
    return Prefetcher(batches, Inputs(cfg, manifest, torch.device("cpu")), seed=3, dp_rank=rank, dp_size=world,
                      ahead=ahead)


def _same(a, b) -> None:
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and a.count == b.count
    assert len(a.positions) == len(b.positions) == len(a.inputs) // 4
    assert all(torch.equal(x, y) for x, y in zip(a.positions, b.positions))


def test_ahead_and_on_demand_give_the_same_batches(dataset):
    for rank in (0, 1):
        ahead, now = _prefetcher(dataset, True, rank, 2), _prefetcher(dataset, False, rank, 2)
        for n in SIZES:
            _same(ahead.next(n), now.next(n))
            assert ahead.state_dict() == now.state_dict()
        ahead.close()


def test_a_checkpoint_records_the_rows_handed_out_not_those_made_ahead(dataset):
    ahead = _prefetcher(dataset, True)
    ahead.next(8)
    ahead.next(8)
    state = ahead.state_dict()
    assert state["position"] == 16
    expected = ahead.next(16)
    resumed = _prefetcher(dataset, True)
    resumed.load_state_dict(state)
    _same(resumed.next(16), expected)
    # A rollback moves the position past a window; the batch made ahead is dropped.
    ahead.position = 64
    assert ahead.state_dict()["position"] == 64
    fresh = _prefetcher(dataset, False)
    fresh.position = 64
    _same(ahead.next(8), fresh.next(8))
    ahead.close()
    resumed.close()
