"""The sentence-length curriculum: keys recorded while packing, and the loader's key order."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from ember.data import Batches, DataError, load_manifest, prepare
from ember.data.packing import SplitWriter, save_shard
from ember.data.prep_config import load_prep_config
from ember.data.work import count_sentences
from test_data_loader import _data as _self_naming_rows

WORDS = "model data token layer value return the a of to in is for with that by this list".split()


def _document(rng: random.Random, words_per_sentence: int, sentences: int) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(words_per_sentence)).capitalize() + "."
                    for _ in range(sentences))


@pytest.fixture(scope="module")
def long_then_short(tmp_path_factory) -> Path:
    """40 documents of long sentences, then 40 of short ones, about as many words each."""
    rng = random.Random(0)
    docs = [_document(rng, 24, 8) for _ in range(40)] + [_document(rng, 3, 64) for _ in range(40)]
    path = tmp_path_factory.mktemp("curriculum") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_sentences_end_at_punctuation_before_space_or_end():
    assert count_sentences("One. Two! Three?") == 3
    assert count_sentences("Version 3.11 is out... Really") == 1  # no space after the first dot
    assert count_sentences("no ending at all") == 1


def test_row_key_is_the_token_weighted_mean_of_its_documents_keys(tmp_path):
    writer = SplitWriter(tmp_path, "train", seq_len=4, dtype="uint16", sep_id=0, shard_sequences=10,
                         curriculum=True)
    # Stream: 1 2 3 S | 4 5 S 6 | S 7 7 7 | 7 S  (S = separator, counted with its document)
    writer.add([[1, 2, 3], [4, 5]], doc_keys=[2.0, 10.0])
    writer.add_flat(np.array([6, 7, 7, 7, 7]), np.array([1, 4]), np.array([4.0, 1.0]))
    entry = writer.finish()
    keys = np.load(tmp_path / entry["curriculum"]["file"])
    assert keys.dtype == np.float32 and entry["sequences"] == 3
    assert keys.tolist() == [2.0, (10 * 3 + 4) / 4, (4 + 1 * 3) / 4]


def test_prepare_records_lower_keys_for_shorter_sentences(long_then_short, tmp_path):
    out = tmp_path / "w0"
    m = prepare([long_then_short], out, tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.0,
                shard_sequences=50, progress=False, curriculum="sentence-length")
    assert m["curriculum"] == "sentence-length"
    entry = m["splits"]["train"]["curriculum"]
    assert entry["file"] == "train_curriculum.npy"
    keys = np.load(out / entry["file"])
    assert keys.shape == (m["splits"]["train"]["sequences"],) and len(m["splits"]["train"]["shards"]) > 1
    third = len(keys) // 3
    assert keys[:third].min() > 2 * keys[-third:].max()  # long sentences first in the file
    load_manifest(out, verify=True)
    # Workers get the setting too, and the keys do not depend on their number.
    same = prepare([long_then_short], tmp_path / "w1", tokenizer=str(out / "tokenizer.json"), seq_len=32,
                   val_fraction=0.0, shard_sequences=50, progress=False, curriculum="sentence-length", workers=1)
    assert same["splits"]["train"]["curriculum"]["sha256"] == entry["sha256"]


def test_damaged_keys_fail_verification(long_then_short, tmp_path):
    out = tmp_path / "d"
    prepare([long_then_short], out, tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.0,
            progress=False, curriculum="sentence-length")
    keys = np.load(out / "train_curriculum.npy")
    keys[0] += 1
    np.save(out / "train_curriculum.npy", keys)
    load_manifest(out)  # present and listed: the quick check passes
    with pytest.raises(DataError, match="curriculum keys .*train_curriculum.npy does not match its checksum"):
        load_manifest(out, verify=True)
    (out / "train_curriculum.npy").unlink()
    with pytest.raises(DataError, match="are missing"):
        load_manifest(out)


def test_unknown_curriculum_and_the_toml_key(tmp_path, long_then_short):
    with pytest.raises(DataError, match="curriculum 'longest' is not known; use sentence-length"):
        prepare([long_then_short], tmp_path / "x", curriculum="longest", progress=False)
    assert not (tmp_path / "x").exists()
    toml = tmp_path / "prep.toml"
    toml.write_text('[prepare]\ncurriculum = "sentence-length"\n')
    assert load_prep_config(toml)["curriculum"] == "sentence-length"


def _data(tmp_path: Path, keys: list[float], sizes=(4, 7)) -> dict:
    """Shards whose row i is filled with i (as in the loader's tests), and the rows' keys."""
    manifest = _self_naming_rows(tmp_path, sizes)
    assert len(keys) == manifest["splits"]["train"]["sequences"]
    sha = save_shard(tmp_path / "train_curriculum.npy", np.array(keys, dtype=np.float32))
    manifest["splits"]["train"]["curriculum"] = {"file": "train_curriculum.npy", "sha256": sha}
    return manifest


KEYS = [5.0, 1.0, 3.0, 1.0, 9.0, 3.0, 0.5, 7.0, 1.0, 2.0, 3.0]  # ties at 1.0 and 3.0
EXPECTED = sorted(range(len(KEYS)), key=lambda i: (KEYS[i], i))  # ascending key, ties in file order


def _ids(batch) -> list[int]:
    return batch.ids[:, 0].tolist()


def test_first_epoch_in_key_order_later_epochs_shuffled(tmp_path):
    m = _data(tmp_path, KEYS)
    b = Batches(tmp_path, m, seed=3, order="curriculum")
    first = _ids(b.next(4)) + _ids(b.next(4)) + _ids(b.next(3))
    assert first == EXPECTED == [6, 1, 3, 8, 9, 2, 5, 10, 0, 7, 4]
    second = _ids(b.next(11))
    assert sorted(second) == list(range(11)) and second != EXPECTED
    assert second == _ids(Batches(tmp_path, m, seed=3).next(22))[11:]  # same as plain shuffling's epoch 1


def test_ranks_partition_each_global_batch_in_key_order(tmp_path):
    m = _data(tmp_path, KEYS)
    single = Batches(tmp_path, m, seed=1, order="curriculum")
    ranks = [Batches(tmp_path, m, seed=1, rank=r, world=2, order="curriculum") for r in range(2)]
    for _ in range(5):  # crosses into the shuffled second epoch
        parts = [_ids(r.next(4)) for r in ranks]
        assert parts[0] + parts[1] == _ids(single.next(4))
    assert single.position == 20


def test_resume_mid_epoch_continues_the_same_order(tmp_path):
    m = _data(tmp_path, KEYS)
    a = Batches(tmp_path, m, seed=2, order="curriculum")
    a.next(3)
    b = Batches(tmp_path, m, seed=2, order="curriculum")
    b.load_state_dict(a.state_dict())
    assert _ids(b.next(4)) + _ids(b.next(4)) == EXPECTED[3:11]


def test_curriculum_order_without_keys_is_one_sentence(tmp_path):
    m = _data(tmp_path, KEYS)
    del m["splits"]["train"]["curriculum"]
    with pytest.raises(DataError, match=r"prepared without a curriculum key; prepare it again with "
                                        r"--curriculum sentence-length or set data.order = \"shuffle\"\.$"):
        Batches(tmp_path, m, order="curriculum")
    assert len(Batches(tmp_path, m).next(11).ids) == 11  # shuffling needs no keys


def test_keys_of_another_length_are_refused(tmp_path):
    m = _data(tmp_path, KEYS)
    np.save(tmp_path / "train_curriculum.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(DataError, match="holds 3 keys for 11 train rows"):
        Batches(tmp_path, m, order="curriculum")


def test_the_trainer_reads_rows_in_key_order(long_then_short, tmp_path):
    from conftest import REPO, TINY
    from ember.config import load_config
    from ember.train.trainer import Trainer

    data = tmp_path / "data"
    prepare([long_then_short], data, tokenizer="bpe", vocab_size=300, seq_len=32, val_fraction=0.1,
            progress=False, curriculum="sentence-length")
    keys = np.load(data / "train_curriculum.npy")
    cfg = load_config(REPO / "configs/tiny-gpt.toml", [*TINY, "data.order=curriculum"])
    trainer = Trainer(cfg, data, tmp_path / "run", progress=False)
    trainer.build()
    rows = trainer.train_data.next(len(keys)).inputs.numpy()  # a causal LM's inputs are the rows themselves
    shards = np.concatenate([np.load(data / s["file"]) for s in load_manifest(data)["splits"]["train"]["shards"]])
    assert (rows == shards[np.argsort(keys, kind="stable")]).all()
    assert not (rows == shards).all()
