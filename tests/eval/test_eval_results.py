"""Where `ember eval` writes: never over a run's own files or a user's, never half a setup's
GLUE results mixed with another's, and every refusal before the first fine-tuning step."""

import dataclasses
import json
import os
import shutil

import pytest
from eval_helpers import trained_run, write_glue

import ember.eval.glue as glue_module
from ember.cli import main
from ember.eval.finetune import Protocol
from ember.eval.glue import run_glue
from ember.config import ConfigError


@pytest.fixture
def run(dataset, tmp_path_factory, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained_run("causal", dataset, tmp_path_factory), copy, ignore=shutil.ignore_patterns("eval"))
    return copy


@pytest.fixture
def no_compute(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fine-tuning started")
    monkeypatch.setattr(glue_module, "fit_and_score", refuse)


def refused(capsys, code: int, words: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_results_never_replace_the_runs_files(run, dataset, tmp_path, capsys, no_compute):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    before = {name: (run / name).read_bytes() for name in ("model.safetensors", "summary.json")}
    for out in (run / "model.safetensors", run / "summary.json", run / "notes.json"):
        code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--out", str(out)])
        refused(capsys, code, "outside its eval/ folder")
        code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                     "--out", str(out), "--quiet"])
        refused(capsys, code, "outside its eval/ folder")
    assert {name: (run / name).read_bytes() for name in before} == before
    assert not (run / "notes.json").exists()


def test_a_users_file_is_never_replaced(run, dataset, tmp_path, capsys, no_compute):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "numbers"}')
    code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--out", str(mine)])
    refused(capsys, code, "is not a results file of `ember eval lm`")
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                 "--out", str(mine), "--quiet"])
    refused(capsys, code, "is not a results file of `ember eval glue`")
    assert mine.read_text() == '{"my": "numbers"}'


def test_an_existing_file_without_json_suffix_is_the_file_out_names(run, tmp_path, capsys, no_compute):
    """--out FOLDER means a folder: an existing file of another name is judged as the results
    file it names, never taken for a folder to write results.json into."""
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                 "--out", str(readme), "--quiet"])
    refused(capsys, code, f"--out {readme} exists and is not a results file of `ember eval glue`")
    assert readme.read_text() == "# my notes\n"


def test_an_unwritable_out_is_refused_before_fine_tuning(run, tmp_path, capsys, no_compute):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    (tmp_path / "afile").write_text("x")
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte",
                 "--out", str(tmp_path / "afile" / "r.json"), "--quiet"])
    refused(capsys, code, "cannot write the results to")
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "", "--quiet"])
    refused(capsys, code, "--tasks is empty")


def test_glue_results_gain_tasks_and_refuse_another_setup(run, tmp_path, capsys):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE", "CoLA"))
    first = run_glue(run, glue, tasks="rte", seeds=1, progress=False)
    second = run_glue(run, glue, tasks="cola", seeds=1, progress=False)
    assert first["path"] == second["path"]
    kept = json.loads((run / "eval" / "glue" / "results.json").read_text())
    assert list(kept["tasks"]) == ["cola", "rte"] and list(kept["columns"]) == ["CoLA", "RTE"]
    assert kept["tasks"]["rte"] == first["tasks"]["rte"]
    with pytest.raises(ConfigError, match="its protocol differ"):
        run_glue(run, glue, tasks="rte", seeds=1, progress=False, protocol=Protocol(lr=1e-4))
    with pytest.raises(ConfigError, match="its seeds differ"):
        run_glue(run, glue, tasks="rte", seeds=2, progress=False)
    assert json.loads((run / "eval" / "glue" / "results.json").read_text()) == kept
    (run / "eval" / "glue" / "results.json").write_text(json.dumps(kept | {"tasks": {"rte": {"metrics": [1]}}}))
    with pytest.raises(ConfigError, match="is damaged"):
        run_glue(run, glue, tasks="cola", seeds=1, progress=False)


def test_glue_results_of_weights_trained_further_get_no_new_tasks(run, tmp_path, capsys):
    # `ember train --resume` with a longer budget writes new weights at the same path.
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE", "CoLA"))
    run_glue(run, glue, tasks="rte", seeds=1, progress=False)
    kept = (run / "eval" / "glue" / "results.json").read_text()
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: the same path, newer weights
    later = weights.stat().st_mtime_ns + 10**9  # a filesystem's clock may tick coarser than the test
    os.utime(weights, ns=(later, later))
    with pytest.raises(ConfigError, match="earlier weights"):
        run_glue(run, glue, tasks="cola", seeds=1, progress=False)
    assert (run / "eval" / "glue" / "results.json").read_text() == kept
    run_glue(run, glue, tasks="cola", seeds=1, progress=False, out=tmp_path / "new.json")


def test_held_out_scores_are_replaced_only_for_the_same_data(run, dataset, tmp_path, capsys):
    scores = run / "eval" / "lm.json"
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "1"]) == 0
    one = json.loads(scores.read_text())["sequences"]
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "2"]) == 0
    assert json.loads(scores.read_text())["sequences"] == 2 * one
    capsys.readouterr()
    code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "1"])
    refused(capsys, code, f"holds the scores of {2 * one:,} held-out sequences and this scores {one:,}")
    assert json.loads(scores.read_text())["sequences"] == 2 * one  # fewer never replace more
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    capsys.readouterr()
    code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(other), "--batches", "1"])
    refused(capsys, code, "pass --out another file to keep both")
    assert json.loads(scores.read_text())["data"] == str(dataset)


def test_a_diverged_fine_tuning_is_not_a_score(run, tmp_path):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    with pytest.raises(ConfigError, match="rte \\(seed 0\\) diverged"):
        run_glue(run, glue, tasks="rte", seeds=1, progress=False, out=tmp_path / "r.json",
                 protocol=Protocol(lr=1e30))
    assert not (tmp_path / "r.json").exists()


def test_a_diverged_task_keeps_the_scores_of_the_others(run, tmp_path, monkeypatch):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE", "CoLA"))
    real = glue_module.fit_and_score

    def rte_diverges(unit, *args, **kwargs):
        if unit.task == "rte":
            unit = dataclasses.replace(unit, protocol=Protocol(lr=1e30))
        return real(unit, *args, **kwargs)

    monkeypatch.setattr(glue_module, "fit_and_score", rte_diverges)
    out = tmp_path / "r.json"
    with pytest.raises(ConfigError, match=r"rte \(seed 0\) diverged.*the scores of cola are in"):
        run_glue(run, glue, tasks="cola,rte", seeds=2, progress=False, out=out)
    kept = json.loads(out.read_text())
    assert list(kept["tasks"]) == ["cola"] and len(kept["tasks"]["cola"]["per_seed"]) == 2


def test_an_interruption_keeps_the_tasks_already_scored(run, tmp_path, monkeypatch):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE", "CoLA"))
    real = glue_module.fit_and_score

    def interrupted_at_rte(unit, *args, **kwargs):
        if unit.task == "rte":
            raise KeyboardInterrupt
        return real(unit, *args, **kwargs)

    monkeypatch.setattr(glue_module, "fit_and_score", interrupted_at_rte)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        run_glue(run, glue, tasks="cola,rte", seeds=2, progress=False, out=out)
    kept = json.loads(out.read_text())
    assert list(kept["tasks"]) == ["cola"] and len(kept["tasks"]["cola"]["per_seed"]) == 2


def test_held_out_scoring_names_a_bad_data_folder_before_the_results_file(run, dataset, tmp_path, capsys):
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "1"]) == 0
    capsys.readouterr()
    code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(tmp_path / "nodata"), "--batches", "1"])
    refused(capsys, code, "manifest")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_results_file_that_cannot_be_made_is_refused_before_any_compute(run, tmp_path, capsys, no_compute):
    glue = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("RTE",))
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(glue), "--tasks", "rte", "--seeds", "1",
                 "--out", "/proc/ember-glue.json", "--quiet"])
    refused(capsys, code, "cannot write the results to /proc/ember-glue.json")


def test_a_zero_batch_count_is_named_before_the_results_file(run, dataset, capsys):
    assert main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "1"]) == 0
    capsys.readouterr()
    code = main(["eval", "lm", "--checkpoint", str(run), "--data", str(dataset), "--batches", "0"])
    refused(capsys, code, "--batches and --batch-size must be at least 1")


def test_tasks_of_another_glue_folder_are_not_averaged_in(run, tmp_path, capsys):
    first = write_glue(tmp_path / "glue", sizes=(16, 8), folders=("CoLA",))
    other = write_glue(tmp_path / "glue-small", sizes=(12, 6), folders=("RTE",))
    out = tmp_path / "r.json"
    assert main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(first), "--tasks", "cola",
                 "--seeds", "1", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    code = main(["eval", "glue", "--checkpoint", str(run), "--glue-dir", str(other), "--tasks", "rte",
                 "--seeds", "1", "--out", str(out), "--quiet"])
    refused(capsys, code, "its glue_dir differ")
    assert list(json.loads(out.read_text())["tasks"]) == ["cola"]
