"""Reading the official GLUE layouts, encoding pairs, and batching without padding surprises."""

import numpy as np
import pytest
from eval_helpers import HEADERS, MNLI_DEV, MNLI_TRAIN, write_glue

from ember.data import DataError, special_token_ids, train_tokenizer
from ember.eval.encode import encode_split, equal_length_batches, steps_per_epoch, train_batches, truncate_pair
from ember.eval.glue_tasks import TASKS, Split, load_task, parse_tasks, read_split


def test_every_task_reads_in_its_official_layout(tmp_path):
    glue = write_glue(tmp_path, sizes=(12, 6))
    for task in TASKS.values():
        data = load_task(glue, task)
        assert len(data.train) == 12 and all(len(s) == 6 for s in data.dev.values()), task.key
        assert (data.train.text_b is None) == (task.key in ("cola", "sst2"))
        assert [c for c, _ in task.dev] == list(data.dev)
    mnli = load_task(glue, TASKS["mnli"])
    assert list(mnli.dev) == ["MNLI-m", "MNLI-mm"]
    assert mnli.train.labels[:3] == [0, 1, 2]  # contradiction, entailment, neutral
    assert load_task(glue, TASKS["stsb"]).train.labels[:2] == [0.0, 5.0]
    cola = load_task(glue, TASKS["cola"]).train  # no header: the first line is an example
    assert cola.labels[:2] == [0, 1] and cola.text_a[0].endswith("red")


def test_labels_come_from_the_right_columns(tmp_path):
    # MNLI: label1 is one annotator; the label is gold_label, the last column.
    rows = [MNLI_DEV, ["0", "1", "1e", "fiction", "(a)", "(b)", "(a)", "(b)", "A man.", "A dog.",
                       "neutral", "entailment", "entailment", "neutral", "entailment", "entailment"]]
    path = tmp_path / "dev_matched.tsv"
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    split = read_split(TASKS["mnli"], path)
    assert split.labels == [1] and (split.text_a, split.text_b) == (["A man."], ["A dog."])
    # MRPC: the label is the first column, the strings the last two.
    path = tmp_path / "mrpc.tsv"
    path.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\tIt rains.\tIt is raining.\n")
    split = read_split(TASKS["mrpc"], path)
    assert split.labels == [1] and (split.text_a, split.text_b) == (["It rains."], ["It is raining."])
    assert MNLI_TRAIN[-1] == "gold_label"
    # Rows end at newlines (and CRLF) only: a line separator inside a sentence is text.
    path.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\r\n1\t7\t8\tIt\u2028rains.\tIt is\x85raining.\r\n",
                    newline="")
    split = read_split(TASKS["mrpc"], path)
    assert split.labels == [1] and (split.text_a, split.text_b) == (["It\u2028rains."], ["It is\x85raining."])


@pytest.mark.parametrize("content, words", [
    ("Quality\t#1 ID\t#2 ID\t#1 String\n1\t7\t8\tIt rains.\n", "lacks the column '#2 String'"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\nyes\t7\t8\ta\tb\n", "line 2 has the label 'yes'"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\n", "line 2 has 3 columns"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n", "holds no examples"),
])
def test_malformed_files_get_one_sentence(tmp_path, content, words):
    path = tmp_path / "train.tsv"
    path.write_text(content)
    with pytest.raises(DataError, match=words) as err:
        read_split(TASKS["mrpc"], path)
    assert "official GLUE" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("score", ["nan", "inf", "-0.5", "5.2", "high"])
def test_an_sts_b_score_off_its_scale_is_refused(tmp_path, score):
    header = "\t".join(HEADERS["STS-B"])
    row = "\t".join(["0", "main", "f", "2012", "0", "none", "none", "A cat.", "A dog.", "{}"])
    path = tmp_path / "dev.tsv"
    path.write_text(f"{header}\n{row.format('3.2')}\n")
    assert read_split(TASKS["stsb"], path).labels == [3.2]
    path.write_text(f"{header}\n{row.format(score)}\n")
    with pytest.raises(DataError, match=f"line 2 has the score '{score}', not a number from 0 to 5"):
        read_split(TASKS["stsb"], path)


def test_a_rare_broken_row_is_skipped_and_counted(tmp_path):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    rows = [f"{i}\t1\t2\tWhy {i}?\tHow {i}?\t{i % 2}\n" for i in range(2000)]
    path = tmp_path / "train.tsv"
    path.write_text(header + "".join(rows) + "2000\t1\t2\tbroken\n")
    split = read_split(TASKS["qqp"], path)
    assert len(split) == 2000 and split.skipped == 1
    path.write_text(header + "".join(rows[:200]) + "2000\t1\t2\tbroken\n")  # 1 in 200 is a broken file
    with pytest.raises(DataError, match="line 202 has 4 columns"):
        read_split(TASKS["qqp"], path)


def test_missing_folders_and_files(tmp_path):
    glue = write_glue(tmp_path, folders=("MNLI", "SST-2"))
    with pytest.raises(DataError, match="has no RTE folder"):
        load_task(glue, TASKS["rte"])
    (glue / "MNLI" / "dev_mismatched.tsv").unlink()
    with pytest.raises(DataError, match="dev_mismatched.tsv is missing"):
        load_task(glue, TASKS["mnli"])
    (glue / "SST-2").rename(glue / "sst2")  # folder names are matched loosely
    assert len(load_task(glue, TASKS["sst2"]).train) == 24


def test_task_names():
    assert [t.key for t in parse_tasks("CoLA, sst-2,STS_B,cola")] == ["cola", "sst2", "stsb"]
    assert len(parse_tasks(None)) == 8 and "wnli" not in TASKS
    with pytest.raises(DataError, match="not a GLUE task"):
        parse_tasks("wnli")


def _longest_first(len_a, len_b, budget):
    """The reference: drop one token at a time from the longer side, b on ties."""
    while len_a + len_b > budget:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


def test_truncation_matches_longest_first():
    for len_a in range(0, 30):
        for len_b in range(0, 30):
            for budget in (1, 7, 20, 40):
                assert truncate_pair(len_a, len_b, budget) == _longest_first(len_a, len_b, budget)


def test_pair_layouts():
    docs = ["the cat sat on the mat", "dogs ran past the old trees"] * 20
    pair = Split(["the cat sat"], ["dogs ran " * 40], [0], 0)
    wordpiece = train_tokenizer("wordpiece", docs, 120)
    sp = special_token_ids(wordpiece)
    (ids,) = encode_split(pair, wordpiece, sp, "mlm", max_len=16)
    a = wordpiece.encode("the cat sat", add_special_tokens=False).ids
    assert ids[:len(a) + 2] == [sp["cls"], *a, sp["sep"]] and ids[-1] == sp["sep"] and len(ids) == 16
    bpe = train_tokenizer("bpe", docs, 300)
    sp = special_token_ids(bpe)
    a = bpe.encode("the cat sat", add_special_tokens=False).ids
    (causal,) = encode_split(pair, bpe, sp, "causal", max_len=16)
    assert causal[:len(a) + 1] == [*a, sp["sep"]] and causal[-1] == sp["sep"] and len(causal) == 16
    (mlm,) = encode_split(pair, bpe, sp, "mlm", max_len=16)
    assert mlm[:len(a) + 2] == [sp["sep"], *a, sp["sep"]] and mlm[-1] == sp["sep"] and len(mlm) == 16
    single = Split(["the cat sat"], None, [0], 0)
    assert encode_split(single, bpe, sp, "causal", 16) == [[*a, sp["sep"]]]


def test_training_batches_cover_each_example_once_with_little_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 128, size=2000).tolist()
    batches = train_batches(lengths, 16, np.random.default_rng(1))
    assert sorted(np.concatenate(batches).tolist()) == list(range(2000))
    assert len(batches) == steps_per_epoch(2000, 16) == 125
    padded = sum(16 * max(lengths[i] for i in b) for b in batches) / sum(lengths)
    shuffled = np.random.default_rng(1).permutation(2000)
    random_padded = sum(16 * max(lengths[i] for i in shuffled[s:s + 16]) for s in range(0, 2000, 16)) / sum(lengths)
    assert padded < 1.1 < random_padded
    again = train_batches(lengths, 16, np.random.default_rng(2))
    assert [b.tolist() for b in again] != [b.tolist() for b in batches]  # still shuffled


def test_evaluation_batches_need_no_padding():
    lengths = [5, 7, 5, 9, 7, 5, 5]
    batches = list(equal_length_batches(lengths, 2))
    assert sorted(np.concatenate(batches).tolist()) == list(range(7))
    assert all(len({lengths[i] for i in b}) == 1 and len(b) <= 2 for b in batches)
