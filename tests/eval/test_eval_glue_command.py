"""`ember eval glue` from the command line: results.json, medians, the average, mistakes."""

import json
import shutil
import statistics

import pytest
from eval_helpers import trained_run, write_glue

from ember.cli import main
from ember.eval.glue import aggregate, column_scores
from ember.eval.glue_tasks import COLUMNS


@pytest.fixture(scope="module")
def run(dataset, tmp_path_factory):
    return trained_run("causal", dataset, tmp_path_factory)


def test_full_command_writes_results(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--seeds", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "MNLI-mm" in out and "average" in out
    results = json.loads((run / "eval" / "glue" / "results.json").read_text())
    assert list(results["columns"]) == list(COLUMNS) and results["complete"]
    assert set(results["tasks"]) == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte"}
    assert results["average"] == pytest.approx(statistics.mean(results["columns"].values()))
    assert results["protocol"]["lr"] == 4e-5 and results["protocol"]["max_len"] == 64  # the model's limit
    assert results["pooling"] == "last token" and results["seeds"] == [0, 1, 2]
    expected = {"cola": {"CoLA": {"matthews"}}, "mrpc": {"MRPC": {"f1", "accuracy"}},
                "stsb": {"STS-B": {"pearson", "spearman"}}, "mnli": {"MNLI-m": {"accuracy"}, "MNLI-mm": {"accuracy"}}}
    for key, columns in expected.items():
        task = results["tasks"][key]
        assert {c: set(m) for c, m in task["metrics"].items()} == columns
        assert len(task["per_seed"]) == 3
        for column, metrics in task["metrics"].items():
            for name, value in metrics.items():
                assert value == statistics.median(s[column][name] for s in task["per_seed"])
    mrpc = results["tasks"]["mrpc"]["metrics"]["MRPC"]
    assert results["columns"]["MRPC"] == pytest.approx((mrpc["f1"] + mrpc["accuracy"]) / 2)


def test_median_over_seeds_and_the_average():
    per_seed = [{"MRPC": {"f1": f, "accuracy": a}} for f, a in ((0.9, 0.1), (0.1, 0.5), (0.5, 0.9), (0.7, 0.3))]
    assert aggregate(per_seed) == {"MRPC": {"f1": pytest.approx(0.6), "accuracy": pytest.approx(0.4)}}
    assert aggregate(per_seed[:3]) == {"MRPC": {"f1": 0.5, "accuracy": 0.5}}
    tasks = {"mrpc": {"metrics": {"MRPC": {"f1": 0.8, "accuracy": 0.6}}},
             "mnli": {"metrics": {"MNLI-m": {"accuracy": 0.5}, "MNLI-mm": {"accuracy": 0.3}}}}
    assert column_scores(tasks) == {"MNLI-m": 0.5, "MNLI-mm": 0.3, "MRPC": pytest.approx(0.7)}


def test_out_path_and_a_subset_of_tasks(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("CoLA", "STS-B"))
    out = tmp_path / "elsewhere" / "glue.json"
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "cola,sts-b",
                 "--seeds", "1", "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    assert list(results["columns"]) == ["CoLA", "STS-B"] and not results["complete"]
    assert "average of 2 columns" in capsys.readouterr().out


@pytest.mark.parametrize("break_it, words", [
    (lambda glue: shutil.rmtree(glue / "RTE"), "has no RTE folder"),
    (lambda glue: (glue / "MRPC" / "dev.tsv").write_text("Quality\t#1 String\n1\tx\n"), "lacks the column '#2 String'"),
    (lambda glue: (glue / "CoLA" / "train.tsv").write_text("src\t1\tonly three columns\n"), "line 1 has 3 columns"),
])
def test_broken_glue_folders_exit_2_with_one_sentence(run, tmp_path, capsys, break_it, words):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("CoLA", "MRPC", "RTE"))
    break_it(glue)
    out = tmp_path / "r.json"
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "cola,mrpc,rte",
                 "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err
    assert not out.exists()  # refused before any fine-tuning


def test_not_a_run_and_the_wrong_tokenizer(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    assert main(["eval", "glue", "--checkpoint", str(tmp_path), "--glue-dir", str(glue)]) == 2
    assert "not an ember run directory" in capsys.readouterr().err
    other = tmp_path / "tokenizer.json"
    other.write_text((run / "tokenizer.json").read_text().replace('"<|pad|>"', '"<|pad2|>"'))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tokenizer", str(other)]) == 2
    assert "not the one the run was trained with" in capsys.readouterr().err


def test_progress_is_a_line_per_epoch_when_output_is_not_a_terminal(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--seeds", "2",
                 "--tasks", "rte,sst2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("glue ")]
    # pytest's captured stderr is not a terminal: 2 tasks x 2 seeds x 5 epochs, in order.
    assert len(lines) == 2 * 2 * 5
    assert lines[0].startswith("glue rte seed 1/2 epoch 1/5: ") and "examples/s" in lines[0]
    assert lines[-1].startswith("glue sst2 seed 2/2 epoch 5/5: ") and "0.0 min left" in lines[-1]
