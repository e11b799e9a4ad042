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


def test_lr_and_mean_pooling_from_the_command_line(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    out = tmp_path / "r.json"
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte", "--seeds", "1",
                 "--lr", "1e-4", "--pooling", "mean", "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    assert results["protocol"]["lr"] == 1e-4 and results["protocol"]["pooling"] == "mean"
    assert results["pooling"] == "mean"
    capsys.readouterr()
    for bad in ("0", "nan", "inf"):
        assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--lr", bad,
                     "--out", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert "--lr must be positive" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad.json").exists()


def test_not_a_run_and_the_wrong_tokenizer(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    assert main(["eval", "glue", "--checkpoint", str(tmp_path), "--glue-dir", str(glue)]) == 2
    assert "not an ember run directory" in capsys.readouterr().err
    other = tmp_path / "tokenizer.json"
    other.write_text((run / "tokenizer.json").read_text().replace('"<|pad|>"', '"<|pad2|>"'))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tokenizer", str(other)]) == 2
    assert "not the one the run was trained with" in capsys.readouterr().err


def test_jobs_give_the_results_of_one_process(run, tmp_path):
    """Each (task, seed) is seeded on its own, so where it runs changes nothing; the one-process
    run uses the thread count each of the two workers gets, so even the float sums agree."""
    import torch

    from ember.eval.glue import run_glue
    from ember.eval.glue_jobs import cpu_cores

    glue = write_glue(tmp_path / "glue", sizes=(24, 10), folders=("CoLA", "STS-B"))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cpu_cores() // 2))
    try:
        alone = run_glue(run, glue, tasks="cola,stsb", seeds=2, out=tmp_path / "one.json", progress=False)
    finally:
        torch.set_num_threads(threads)
    together = run_glue(run, glue, tasks="cola,stsb", seeds=2, out=tmp_path / "two.json", progress=False, jobs=2)
    assert together["jobs"] == 2
    for key in ("cola", "stsb"):
        assert together["tasks"][key]["per_seed"] == alone["tasks"][key]["per_seed"]
    assert together["average"] == alone["average"]


def test_progress_lines_when_stderr_is_not_a_terminal(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(40, 8), folders=("RTE",))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                 "--seeds", "2", "--out", str(tmp_path / "r.json")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("glue ")]
    assert len(lines) == 2 * 5  # a line per epoch of each seed
    assert lines[0].startswith("glue rte seed 1/2 epoch 1/5: ") and lines[-1].startswith("glue rte seed 2/2 epoch 5/5")
    assert all("examples/s" in line and "min left" in line and "loss" in line for line in lines)


def test_jobs_below_one_is_refused(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                 "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--jobs must be at least 1" in err and err.count("\n") == 1
