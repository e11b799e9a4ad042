"""`ember tune`: which layouts it tries, the commands it runs, how it reads a trial, the
recipe it writes, its mistakes, and real trials of a tiny model under torchrun on CPU."""

import json
import re
import sys

import pytest

from conftest import REPO
from ember.cli import main
from ember.config import load_config
from ember.layout import Layout
from ember.plan.layout import TrainShape
from ember.plan.search import search
from ember.tune.trials import (best_recipe, failure_reason, local_cluster, measured_throughput, plan_inputs,
                             read_trial, run_process, select, trial_command)

SHAPE = TrainShape(64, 8)
TINY_RECIPE = """[model]
objective = "causal"
hidden = 32
layers = 2
heads = 2
mlp_hidden = 64
max_seq_len = 64

[train]
micro_batch = 4
global_batch = 8
budget = "2h"
"""


def _profile(tmp_path, memory_gib=8.0):
    """A CPU profile as `ember plan calibrate` writes one (numbers of this order)."""
    path = tmp_path / f"cpu-{memory_gib:g}.json"
    path.write_text(json.dumps({
        "format": "ember-plan-profile/1", "source": "calibrated (test)",
        "gpu": {"name": "cpu (calibrated)", "peak_bf16_flops": 1e11, "memory_gib": memory_gib, "sms": 2,
                "hbm_gbps": 20.0, "matmul_eff": 1.0, "hbm_eff": 1.0, "intra_gbps": 0.7, "inter_gbps": 0.7},
        "links": {"gpus_per_node": 2, "intra_gbps": 0.7, "inter_gbps": 0.7, "intra_eff": 1.0,
                  "intra_latency_s": 1e-3}}))
    return path


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_RECIPE)
    return path


def _ranked(recipe, profile, nproc):
    config = load_config(recipe)
    model, shape = plan_inputs(config, {"vocab_size": 512, "seq_len": 64}, "tiny")
    return search(model, local_cluster(nproc, profile), shape).ranked, shape


def test_plan_inputs_take_vocabulary_and_sequence_from_the_data(recipe):
    model, shape = plan_inputs(load_config(recipe), {"vocab_size": 300, "seq_len": 48}, "tiny")
    assert model.vocab_size == 300 and shape.seq_len == 48 and shape.global_batch == 8


def test_tune_passes_over_layouts_the_recipe_cannot_train(recipe, tmp_path):
    ranked, shape = _ranked(recipe, _profile(tmp_path), 2)
    assert any(p.layout.pp > 1 for p in ranked)  # the planner does consider pipelines
    everything, passed = select(ranked, len(ranked), load_config(recipe), 2, shape.seq_len)
    assert everything == ranked and passed == 0
    # Compiled stages cannot run the zero-bubble schedules, and a document mask no pipeline:
    # the trainer's own rules decide, with the recipe's settings.
    masked = load_config(recipe, ["data.document_mask=true"])
    chosen, passed = select(ranked, len(ranked), masked, 2, shape.seq_len)
    assert chosen and all(p.layout.pp == 1 for p in chosen)
    assert passed == sum(p.layout.pp > 1 for p in ranked)
    positions = [ranked.index(p) for p in chosen]
    assert positions == sorted(positions)  # the planner's order is kept


def test_trial_settings_are_what_the_trainer_reads_back(recipe):

    for layout in (Layout(micro_batch=2), Layout(dp_shard=2, zero=3, recompute="full"), Layout(pp=2, micro_batch=2)):
        settings = layout.settings(SHAPE.global_batch)
        config = load_config(recipe, [f"{k}={v}" for k, v in settings.items()])
        assert Layout.from_config(config, layout.gpus) == layout


def test_trial_command_runs_torchrun_with_the_layout_after_the_users_overrides(tmp_path):
    cmd = trial_command("r.toml", "data", tmp_path / "trial-1", 4, 7, {"parallel.tp": 2, "train.micro_batch": 2},
                        ["train.micro_batch=8", "optim.lr=1e-3"])
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:10] == ["-m", "ember", "train", "r.toml", "--data"]
    assert cmd[cmd.index("--budget") + 1] == "7steps" and cmd[cmd.index("--out") + 1] == str(tmp_path / "trial-1")
    sets = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--set"]
    assert sets.index("train.micro_batch=8") < sets.index("train.micro_batch=2")  # the layout wins
    assert "parallel.tp=2" in sets and "optim.lr=1e-3" in sets and "train.log_every=1" in sets


def test_throughput_skips_warm_up_and_weighs_steps_by_their_time():
    records = [{"step": 1, "tokens": 100, "tokens_per_s": 10.0},  # 10 s of warm-up
               {"step": 2, "tokens": 200, "tokens_per_s": 100.0},  # 1 s
               {"step": 2, "tokens": 200, "val_loss": 3.0},
               {"step": 3, "tokens": 300, "tokens_per_s": 50.0},  # 2 s
               {"step": 4, "tokens": 400, "tokens_per_s": 25.0}]  # 4 s
    assert measured_throughput(records, 1) == (pytest.approx(300 / 7), 3)
    assert measured_throughput(records, 2) == (pytest.approx(200 / 6), 2)
    assert measured_throughput(records, 0) == (pytest.approx(400 / 17), 4)
    assert measured_throughput(records[:1], 2) == (pytest.approx(10.0), 1)  # too short: keep what there is
    assert measured_throughput([], 2) == (None, 0)


def test_read_trial_takes_peak_memory_from_the_summary(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tokens": 64, "tokens_per_s": 640.0}\n'
                                            '{"step": 2, "tokens": 128, "tokens_per_s": 320.0}\n')
    assert read_trial(tmp_path, 1)["peak_memory_gib"] is None
    (tmp_path / "summary.json").write_text('{"status": "finished", "peak_memory_gib": 3.5}')
    result = read_trial(tmp_path, 1)
    assert result == {"tokens_per_s": 320.0, "measured_steps": 1, "peak_memory_gib": 3.5, "status": "finished"}
    # A GPU run's summary also has the allocator's peak reservation: what the planner predicts.
    (tmp_path / "summary.json").write_text('{"status": "finished", "peak_memory_gib": 3.5, "peak_reserved_gib": 3.9}')
    assert read_trial(tmp_path, 1)["peak_memory_gib"] == 3.9


def test_failure_reasons():
    assert failure_reason(None, "", True, 30) == "timed out after 30 s"
    assert failure_reason(1, "torch.OutOfMemoryError: CUDA out of memory. Tried", False, 30) == "out of memory"
    assert failure_reason(1, "worker: Signal 9 (SIGKILL) received by PID 12", False, 30) == "out of memory"
    log = "Traceback (most recent call last):\n  File x\nValueError: bad shape\nE1122 torchrun failed\n"
    assert failure_reason(1, log, False, 30) == "exit status 1: ValueError: bad shape"
    assert failure_reason(2, "ember: error: parallel.tp must divide the heads.", False, 30) == \
        "exit status 2: ember: error: parallel.tp must divide the heads."


def test_run_process_reports_status_timeout_and_memory(tmp_path):
    status, timed_out, rss = run_process([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"],
                                         tmp_path / "a.log", 60)
    assert (status, timed_out) == (3, False) and (tmp_path / "a.log").read_text().strip() == "hi"
    assert rss is None or 0.001 < rss < 4
    status, timed_out, _ = run_process([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "b.log", 1)
    assert timed_out and status != 0


def test_best_recipe_is_the_recipe_with_the_layout(recipe):
    text = best_recipe(recipe, ["optim.lr=1e-3"], {"train.micro_batch": 2, "train.global_batch": 8})
    path = recipe.with_name("best.toml")
    path.write_text(text)
    config = load_config(path)
    assert config.train.micro_batch == 2 and config.train.budget == "2h" and config.optim.lr == 1e-3
    assert config.model.hidden == 32


@pytest.mark.parametrize("args, words", [
    (["no-such.toml", "--nproc", "1"], "does not exist"),
    (["RECIPE", "--nproc", "0"], "--nproc must be at least 1"),
    (["RECIPE", "--nproc", "1", "--top", "0"], "--top must be at least 1"),
    (["RECIPE", "--nproc", "1", "--profile", "SMALL"], "no layout of tiny fits"),
    (["RECIPE", "--nproc", "3"], "no layout of tiny divides evenly"),
    (["RECIPE", "--nproc", "1", "--set", "parallel.zero=3"], "ember tune chooses parallel.zero for each trial"),
    (["RECIPE", "--nproc", "1", "--set", "train.micro_batch=4"], "ember tune chooses train.micro_batch"),
    # What every trial would refuse is refused once, before any runs.
    (["RECIPE", "--nproc", "1", "--set", "data.document_mask=true"], "needs document boundaries"),
    (["RECIPE", "--nproc", "1", "--timeout", "nan"], "--timeout a positive, finite number"),  # was no timeout
    (["RECIPE", "--nproc", "1", "--profile", "MEGATRON"], "ember tune measures ember's trainer"),
])
def test_mistakes_are_one_sentence_and_exit_2(args, words, recipe, dataset, tmp_path, capsys):
    small = _profile(tmp_path, memory_gib=0.5)  # less than the runtime's own GiB
    megatron = tmp_path / "megatron.json"
    megatron.write_text(json.dumps(json.loads(_profile(tmp_path).read_text()) | {"stack": {"name": "megatron"}}))
    named = {"RECIPE": recipe, "SMALL": small, "MEGATRON": megatron}
    args = [str(named.get(a, a)) for a in args]
    if "--profile" not in args:
        args += ["--profile", str(_profile(tmp_path))]
    assert main(["tune", args[0], "--data", str(dataset), "--out", str(tmp_path / "t")] + args[1:]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_tune_runs_two_trials_and_writes_the_fastest(nproc, recipe, dataset, tmp_path, capsys):
    out = tmp_path / "tune"
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", str(nproc), "--profile",
                 str(_profile(tmp_path)), "--top", "2", "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "meas tok/s" in printed and "best: trial" in printed
    report = json.loads((out / "tune.json").read_text())
    trials = report["trials"]
    assert len(trials) == 2 and [t["status"] for t in trials] == ["finished", "finished"], trials
    assert report["within_interval_of_best"] >= 1  # the best is within its own interval
    for t in trials:
        assert t["measured"]["tokens_per_s"] > 0 and t["measured"]["steps"] == 2
        assert t["measured"]["peak_memory_gib"] > 0 and t["predicted"]["tokens_per_s"] > 0
        assert len((out / f"trial-{t['trial']}" / "metrics.jsonl").read_text().splitlines()) >= 3
    winner = max(trials, key=lambda t: t["measured"]["tokens_per_s"])
    assert report["best"]["trial"] == winner["trial"]
    best = load_config(out / "best.toml")
    assert f"mbs={best.train.micro_batch}," in winner["layout"] and best.train.budget == "2h"
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", str(nproc), "--profile",
                 str(_profile(tmp_path)), "--out", str(out)]) == 2  # never over an earlier run
    assert [t["planner_rank"] for t in trials] == [1, 2]


def test_tune_never_writes_into_a_folder_with_files(recipe, dataset, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "best.toml").write_text("# my own recipe\n")
    args = ["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile", str(_profile(tmp_path)),
            "--top", "1", "--out", str(out)]
    for extra in ([], ["--dry-run"]):  # a dry run says what the real one would
        assert main(args + extra) == 2
        assert "is not an empty folder" in capsys.readouterr().err
    assert (out / "best.toml").read_text() == "# my own recipe\n"


def test_a_stopped_tuning_keeps_what_finished(recipe, dataset, tmp_path, capsys, monkeypatch):
    """Ctrl-C (or SIGTERM, unwound the same way) during the second trial: the first one's
    measurement is written to tune.json, the second is marked not run."""
    import ember.tune.trials as trials_module

    real, calls = trials_module.run_process, []

    def stopped_second(cmd, log_path, timeout):
        calls.append(cmd)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cmd, log_path, timeout)

    monkeypatch.setattr(trials_module, "run_process", stopped_second)
    out = tmp_path / "tune"
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile", str(_profile(tmp_path)),
                 "--top", "2", "--steps", "3", "--warmup", "1", "--out", str(out)]) == 130
    assert "what the finished trials measured" in capsys.readouterr().out
    report = json.loads((out / "tune.json").read_text())
    assert [t["status"] for t in report["trials"]] == ["finished", "not run"]
    assert report["best"]["trial"] == 1 and (out / "best.toml").exists()


def test_failed_trials_are_reported_not_fatal(recipe, dataset, tmp_path, capsys):
    out = tmp_path / "tune"
    code = main(["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile", str(_profile(tmp_path)),
                 "--top", "1", "--steps", "3", "--timeout", "0.5", "--out", str(out)])
    assert code == 1 and "timed out after 0.5 s" in capsys.readouterr().out
    report = json.loads((out / "tune.json").read_text())
    assert report["best"] is None and report["trials"][0]["status"] == "failed"
    assert not (out / "best.toml").exists()


def test_dry_run_prints_commands_and_runs_nothing(recipe, dataset, tmp_path, capsys):
    out = tmp_path / "tune"
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile", str(_profile(tmp_path)),
                 "--top", "1", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("torch.distributed.run --standalone --nproc-per-node=1 -m ember train") == 1
    assert not out.exists()
    # More layouts than the one asked for are too close to order: the user is told how many.
    close = int(re.search(r"note: (\d+) layouts lie within the best's predicted interval", printed).group(1))
    assert close > 1 and f"--top {close} measures them all" in printed
    # The profile was calibrated by 2 processes sharing the CPU; one trial process gets it all.
    assert "was measured with 2 processes on this machine, not 1" in printed
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", "2", "--profile", str(_profile(tmp_path)),
                 "--top", "1", "--out", str(out), "--dry-run"]) == 0
    assert "was measured with" not in capsys.readouterr().out


def test_the_near_tie_count_leaves_out_layouts_the_recipe_cannot_train(recipe, dataset, tmp_path, capsys,
                                                                       monkeypatch):
    """--top N reaches only layouts the recipe can train, so only those count as near ties.
    Here the recipe can train one layout: nothing is left for a larger --top to measure."""
    import ember.layout
    import ember.tune.trials

    allowed = []

    def only_one(layout, *args, **kwargs):
        allowed[:] = allowed or [layout]
        return [] if layout == allowed[0] else ["refused for this test"]

    monkeypatch.setattr(ember.layout, "run_problems", only_one)
    monkeypatch.setattr(ember.tune.trials, "run_problems", only_one)
    out = tmp_path / "tune"
    assert main(["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile", str(_profile(tmp_path)),
                 "--top", "1", "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("ember train") == 1 and "lie within the best's predicted interval" not in printed


def test_repo_recipes_plan_with_the_data_vocabulary():
    # configs/tiny-gpt.toml leaves the vocabulary to the data, as most recipes do.
    model, shape = plan_inputs(load_config(REPO / "configs/tiny-gpt.toml"), {"vocab_size": 512, "seq_len": 64},
                               "tiny-gpt")
    assert model.vocab_size == 512 and shape.global_batch == 16


def test_given_layouts_are_tried_instead_of_the_planners_top(recipe, dataset, tmp_path, capsys):
    """`--layout`, repeated: exactly those candidates, in the planner's order, each checked
    against the recipe before anything runs."""
    profile, out = str(_profile(tmp_path)), str(tmp_path / "tune")
    base = ["tune", str(recipe), "--data", str(dataset), "--nproc", "2", "--profile", profile, "--out", out]
    given = ["tp=2,dp=1,mbs=4", "dp=2,zero=1,mbs=2"]
    assert main(base + ["--layout", given[0], "--layout", given[1], "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "trying the 2 given" in printed and printed.count("torch.distributed.run") == 2
    tried = re.findall(r"trial \d: (\S+)", printed)
    assert sorted(tried) == ["tp=1,pp=1,dp=2,zero=1,mbs=2,recompute=none", "tp=2,pp=1,dp=1,mbs=4,recompute=none"]
    assert "--set train.micro_batch=2" in printed and "--set parallel.tp=2" in printed
    assert main(base + ["--layout", "pp=2,dp=1,mbs=4", "--dry-run"]) == 0  # 2 layers, 2 stages
    capsys.readouterr()
    assert main(base + ["--layout", given[0], "--layout", "tp=2,dp=1,mbs=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cannot train this recipe on 2 processes" in err and err.count("\n") == 1


def test_a_given_layouts_rank_is_the_planners_among_every_layout(recipe, dataset, tmp_path):
    from ember.cli import build_parser
    from ember.tune.command import plan_trials

    profile = _profile(tmp_path)
    ranked, _ = _ranked(recipe, profile, 1)
    order = [p.layout.text() for p in ranked]
    late = [ranked[-1].layout, ranked[len(ranked) // 2].layout]
    given = [f"mbs={lo.micro_batch},recompute={lo.recompute},recompute_every={lo.recompute_every}" for lo in late]
    args = build_parser().parse_args(["tune", str(recipe), "--data", str(dataset), "--nproc", "1", "--profile",
                                      str(profile), "--out", str(tmp_path / "t")]
                                     + [x for text in given for x in ("--layout", text)])
    trials = plan_trials(args)[5]
    assert sorted(t.planner_rank for t in trials) == sorted(order.index(lo.text()) + 1 for lo in late)
    assert min(t.planner_rank for t in trials) > 2  # not their places among the two given
