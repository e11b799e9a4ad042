import json

import pytest
import torch

from ember.config import ConfigError
from ember.train.checkpoint import latest, list_checkpoints, load, save


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _model_and_optimizer(0)
    torch.manual_seed(123)
    save(tmp_path, 7, [model], [opt], {"progress": {"step": 7}})
    expected_draw = torch.rand(3)

    other, other_opt = _model_and_optimizer(1)
    torch.manual_seed(999)
    state = load(latest(tmp_path), [other], [other_opt])
    assert state == {"progress": {"step": 7}}
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw)


def test_half_written_checkpoint_is_ignored_and_old_ones_pruned(tmp_path):
    model, opt = _model_and_optimizer(0)
    for step in (1, 2, 3):
        save(tmp_path, step, [model], [opt], {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir()  # a save killed midway
    assert latest(tmp_path).name == "step_00000003"


def test_a_step_saved_again_keeps_the_published_checkpoint(tmp_path):
    """Never removed before a replacement is in place: a kill in between would leave none."""
    model, opt = _model_and_optimizer(0)
    first = save(tmp_path, 4, [model], [opt], {"progress": {"step": 4}})
    (first / "marker").write_text("the published one")
    assert save(tmp_path, 4, [model], [opt], {"progress": {"step": 4}}) == first
    assert (first / "marker").read_text() == "the published one"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000004"]  # no leftover


def test_tied_weights_survive(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save(tmp_path, 1, [model], [opt], {})
    fresh = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    fresh[1].weight = fresh[0].weight
    load(latest(tmp_path), [fresh])
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh[1].weight is fresh[0].weight


def test_a_flipped_byte_in_a_shard_is_named_before_loading(tmp_path):
    model, opt = _model_and_optimizer(0)
    folder = save(tmp_path, 3, [model], [opt], {"progress": {"step": 3}})
    listed = json.loads((folder / "checksums.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.distcp"))
    assert shards and set(shards) <= set(listed) and "rng/rank_00000.pt" in listed and ".metadata" in listed
    shard = folder / shards[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # a stored number: the tensor format itself cannot notice
    shard.write_bytes(bytes(data))
    other, other_opt = _model_and_optimizer(1)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ConfigError, match=f"{shards[0]} is missing or does not match its checksum"):
        load(folder, [other], [other_opt])
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing was loaded
    (folder / "checksums.json").write_text("[not a list")
    with pytest.raises(ConfigError, match="checksums.json is missing or does not match"):
        load(folder, [other], [other_opt])


def test_a_listed_file_that_is_missing_is_named(tmp_path):
    """A checkpoint whose checksums.json lists a file that is gone is damaged: the check
    names the file rather than failing to open it."""
    from ember.train.checksums import first_damaged, write

    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "b.bin").write_bytes(b"b")
    write(tmp_path)
    assert first_damaged(tmp_path) is None
    (tmp_path / "b.bin").unlink()
    assert first_damaged(tmp_path) == "b.bin"


def test_a_checkpoint_that_lost_its_checksums_is_damaged(tmp_path):
    """Its files could hold anything: it is refused as a mismatch is, not loaded unchecked."""
    model, opt = _model_and_optimizer(0)
    folder = save(tmp_path, 3, [model], [opt], {"progress": {"step": 3}})
    (folder / "checksums.json").unlink()
    other, other_opt = _model_and_optimizer(1)
    with pytest.raises(ConfigError, match=r"checksums.json is missing or does not match .* the checkpoint is damaged"):
        load(folder, [other], [other_opt])


def test_a_checkpoint_from_before_checksums_still_loads(tmp_path):
    """Written before checkpoints listed their sha256s (no list, and no record of one)."""
    model, opt = _model_and_optimizer(0)
    folder = save(tmp_path, 3, [model], [opt], {"progress": {"step": 3}})
    (folder / "checksums.json").unlink()
    layout = json.loads((folder / "sharded.json").read_text())
    layout.pop("checksummed", None)
    (folder / "sharded.json").write_text(json.dumps(layout))
    other, other_opt = _model_and_optimizer(1)
    assert load(folder, [other], [other_opt]) == {"progress": {"step": 3}}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
