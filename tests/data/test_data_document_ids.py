"""Batches with documents=True: per-row document ids from the shards' *.docs.npz starts."""

import json

import numpy as np
import pytest
import torch

from ember.data import Batches, DataError
from ember.data.packing import SplitWriter

SEQ, SEP = 8, 0


def _write(tmp_path, lengths, shard_sequences=3) -> dict:
    """Documents of the given lengths (token i of document d is 1 + d) packed with
    boundaries; returns the manifest."""
    writer = SplitWriter(tmp_path, "train", SEQ, "uint16", SEP, shard_sequences, boundaries=True)
    writer.add([[1 + d] * n for d, n in enumerate(lengths)])
    return {"seq_len": SEQ, "splits": {"train": writer.finish(), "val": {"sequences": 0, "shards": []}}}


def _expected(rows: torch.Tensor) -> torch.Tensor:
    """A new document begins after each separator; the row's first one is numbered 0."""
    begins = torch.zeros_like(rows)
    begins[:, 1:] = (rows[:, :-1] == SEP).long()
    return begins.cumsum(1)


LENGTHS = [3, 12, 1, 5, 2, 9, 4, 6, 2, 7]  # 51 tokens + 10 separators -> 7 rows of 8


def test_ids_follow_the_separators_in_every_order(tmp_path):
    m = _write(tmp_path, LENGTHS)
    plain = Batches(tmp_path, m, seed=3)
    docs = Batches(tmp_path, m, seed=3, documents=True)
    assert len(docs) == 7
    for n in (4, 4, 7, 3):  # crosses shards and an epoch
        rows, ids = docs.next(n)
        assert torch.equal(rows, plain.next(n).ids)  # the same rows and position as without ids
        assert ids.shape == rows.shape and not ids.is_floating_point()
        assert torch.equal(ids.long(), _expected(rows))
    assert docs.state_dict() == plain.state_dict()
    rows, ids = docs.fixed(7)
    assert torch.equal(rows, plain.fixed(7).ids)
    # In file order: the first row holds documents 0 (3 + sep) and 1 (its first 4 tokens).
    assert ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ids[1].tolist() == [0] * 8  # document 1 continues from the previous row
    assert ids[2].tolist() == [0, 1, 1, 2, 2, 2, 2, 2]  # its separator, document 2, then 3


def test_ranks_get_their_slice_of_the_ids(tmp_path):
    m = _write(tmp_path, LENGTHS)
    single = Batches(tmp_path, m, seed=5, documents=True)
    ranks = [Batches(tmp_path, m, seed=5, rank=r, world=2, documents=True) for r in range(2)]
    for _ in range(3):
        rows, ids = single.next(4)
        parts = [r.next(4) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), rows)
        assert torch.equal(torch.cat([p[1] for p in parts]), ids)


def test_missing_or_damaged_boundaries_are_refused(tmp_path):
    m = _write(tmp_path, LENGTHS)
    shard = m["splits"]["train"]["shards"][0]
    path = tmp_path / shard["doc_boundaries"]["file"]
    np.savez(path, starts=np.array([0, 3], dtype=np.uint32), indptr=np.array([0, 2], dtype=np.int64))
    with pytest.raises(DataError, match="does not match the rows"):  # read with the shard's rows
        Batches(tmp_path, m, documents=True).fixed(4)
    del shard["doc_boundaries"]
    Batches(tmp_path, json.loads(json.dumps(m)))  # without documents nothing reads them
    with pytest.raises(DataError, match="--doc-boundaries"):
        Batches(tmp_path, m, documents=True)
