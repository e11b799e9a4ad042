"""Batches: seeded order, epochs, resume, and ranks."""

from pathlib import Path

import numpy as np
import pytest
import torch

from ember.data import Batches, DataError
from ember.data.packing import save_shard
from ember.data.shuffle import Permutation

SEQ = 6


def _data(tmp_path: Path, sizes=(7, 5, 11)) -> dict:
    """Shards whose row i is filled with the number i, so every row names itself."""
    shards, start = [], 0
    for k, n in enumerate(sizes):
        rows = np.repeat(np.arange(start, start + n, dtype=np.uint16)[:, None], SEQ, axis=1)
        name = f"train_{k:05d}.npy"
        shards.append({"file": name, "sequences": n, "sha256": save_shard(tmp_path / name, rows)})
        start += n
    return {"seq_len": SEQ, "splits": {"train": {"sequences": start, "shards": shards},
                                       "val": {"sequences": 0, "shards": []}}}


def _ids(batch) -> list[int]:
    assert batch.documents is None
    batch = batch.ids
    assert batch.dtype == torch.int64 and batch.shape[1] == SEQ
    assert (batch == batch[:, :1]).all()
    return batch[:, 0].tolist()


def _stream(batches: Batches, sizes) -> list[int]:
    return [i for n in sizes for i in _ids(batches.next(n))]


def test_each_epoch_is_a_full_permutation_drawn_from_seed_and_epoch(tmp_path):
    m = _data(tmp_path)
    b = Batches(tmp_path, m, seed=5)
    assert len(b) == 23
    first, second = _ids(b.next(23)), _ids(b.next(23))
    assert sorted(first) == sorted(second) == list(range(23))
    assert first != second and first != list(range(23))
    assert b.epoch == 2
    assert first == Permutation(23, 5, 0)[np.arange(23)].tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_the_computed_permutation_is_a_bijection_for_any_size(n):
    rows = Permutation(n, seed=3, epoch=1)[np.arange(n)]
    assert sorted(rows.tolist()) == list(range(n))
    assert rows.tolist() == Permutation(n, seed=3, epoch=1)[np.arange(n)].tolist()
    if n >= 64:
        assert rows.tolist() != Permutation(n, seed=3, epoch=2)[np.arange(n)].tolist()
        assert rows.tolist() != list(range(n))


def test_a_permutation_of_billions_of_rows_costs_only_what_is_read():
    """15T tokens in rows of 4,096: a stored index would be 29 GB per rank. Reading a batch
    computes its rows alone; they are distinct and spread over the whole split."""
    n = 3_662_109_375
    order = Permutation(n, seed=0, epoch=0)
    rows = order[np.arange(1_000_000, 1_004_096)]
    assert len(set(rows.tolist())) == 4096 and rows.min() >= 0 and rows.max() < n
    assert rows.max() - rows.min() > n // 2  # not a local window
    assert order[np.array([1_000_000])][0] == rows[0]


def test_shards_are_opened_when_read_and_a_bounded_number_kept(tmp_path, monkeypatch):
    import ember.data.loader as loader

    monkeypatch.setattr(loader, "OPEN_SHARDS", 2)
    m = _data(tmp_path)
    b = Batches(tmp_path, m, seed=1)
    assert b._open == {}  # nothing mapped before a batch asks for it
    assert sorted(_stream(b, [23])) == list(range(23))  # all three shards read, two kept
    assert len(b._open) == 2
    for shard in (0, 1, 0, 2):  # the least recently read goes first
        b._shard(shard)
    assert sorted(b._open) == [0, 2]


def test_same_seed_same_order_other_seed_other_order(tmp_path):
    m = _data(tmp_path)
    a = _stream(Batches(tmp_path, m, seed=1), [8] * 6)
    assert a == _stream(Batches(tmp_path, m, seed=1), [8] * 6)
    assert a != _stream(Batches(tmp_path, m, seed=2), [8] * 6)


def test_epochs_join_seamlessly_whatever_the_batch_size(tmp_path):
    m = _data(tmp_path)
    whole = _stream(Batches(tmp_path, m, seed=0), [23, 23, 23])
    assert _stream(Batches(tmp_path, m, seed=0), [10] * 6 + [9]) == whole
    assert _stream(Batches(tmp_path, m, seed=0), [50, 19]) == whole  # one batch spans three epochs


def test_resume_from_state_dict_continues_identically(tmp_path):
    m = _data(tmp_path)
    a = Batches(tmp_path, m, seed=3)
    _stream(a, [8, 8, 8])
    state = a.state_dict()
    assert state == {"position": 24, "seed": 3, "shuffle": "feistel"}
    b = Batches(tmp_path, m, seed=0)
    b.load_state_dict(state)
    assert _stream(b, [8] * 5) == _stream(a, [8] * 5)


def test_ranks_partition_each_global_batch(tmp_path):
    m = _data(tmp_path)
    single = Batches(tmp_path, m, seed=7)
    ranks = [Batches(tmp_path, m, seed=7, rank=r, world=2) for r in range(2)]
    for _ in range(6):
        parts = [_ids(r.next(8)) for r in ranks]
        assert len(parts[0]) == len(parts[1]) == 4
        assert parts[0] + parts[1] == _ids(single.next(8))
    with pytest.raises(ValueError, match="multiple of world size 2"):
        ranks[0].next(7)


def test_resume_with_another_world_size(tmp_path):
    m = _data(tmp_path)
    reference = Batches(tmp_path, m, seed=4)
    before = Batches(tmp_path, m, seed=4, rank=0, world=1)
    _stream(before, [6, 6, 6])
    _stream(reference, [6, 6, 6])
    ranks = [Batches(tmp_path, m, seed=4, rank=r, world=3) for r in range(3)]
    for r in ranks:
        r.load_state_dict(before.state_dict())
    for _ in range(4):
        assert sum((_ids(r.next(6)) for r in ranks), []) == _ids(reference.next(6))
    assert {r.state_dict()["position"] for r in ranks} == {reference.state_dict()["position"]}


def test_fixed_is_the_first_sequences_in_file_order(tmp_path):
    m = _data(tmp_path)
    b = Batches(tmp_path, m, seed=9)
    b.next(10)
    assert _ids(b.fixed(9)) == list(range(9))  # spans two shards, ignores the position
    assert _ids(b.fixed(100)) == list(range(23))
    empty = Batches(tmp_path, m, split="val")
    assert empty.fixed(4).ids.shape == (0, SEQ)
    with pytest.raises(DataError, match="no sequences"):
        empty.next(4)
    with pytest.raises(DataError, match="no 'test' split"):
        Batches(tmp_path, m, split="test")


def test_a_state_saved_before_computed_orders_goes_on_in_its_own_order(tmp_path):
    """A checkpoint whose data state has no "shuffle" was drawn with numpy's permutation:
    resuming it keeps that order, so the epoch it is in still visits every row once."""
    m = _data(tmp_path)
    b = Batches(tmp_path, m, seed=5)
    b.load_state_dict({"position": 10, "seed": 5})
    assert _ids(b.next(13)) == np.random.default_rng((5, 0)).permutation(23)[10:].tolist()
    assert "shuffle" not in b.state_dict()


def test_a_shard_shorter_than_its_manifest_says_is_named(tmp_path):
    m = _data(tmp_path)
    m["splits"]["train"]["shards"][1]["sequences"] = 6
    m["splits"]["train"]["sequences"] = 24
    with pytest.raises(DataError, match="train_00001.npy holds"):
        _stream(Batches(tmp_path, m, seed=0), [24])
