"""Batches: seeded order, epochs, resume, and ranks."""

from pathlib import Path

import numpy as np
import pytest
import torch

from ember.data import Batches, DataError
from ember.data.packing import save_shard

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
    assert len(b) == 23 and all(isinstance(s, np.memmap) for s in b.shards)
    first, second = _ids(b.next(23)), _ids(b.next(23))
    assert sorted(first) == sorted(second) == list(range(23))
    assert first != second and first != list(range(23))
    assert b.epoch == 2
    assert first == np.random.default_rng((5, 0)).permutation(23).tolist()


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
    assert state == {"position": 24, "seed": 3}
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
