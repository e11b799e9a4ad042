"""`ember plan` on layouts a user names, and what it writes: a layout is priced as the
trainer would run it, a train command only for what the trainer runs, and a profile only
once the command's inputs are known good."""

import json

import pytest

from conftest import REPO
from ember.cli import main
from ember.plan.comm import Group, Links, p2p_s

LLAMA = ["plan", "--model", "llama3-8b", "--gpu", "A100-80GB", "--gpus", "8", "--global-batch", "64",
         "--seq-len", "4096"]


def plan_json(capsys, args) -> dict:
    assert main(args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_layout_that_does_not_fit_says_so(capsys):
    out = plan_json(capsys, LLAMA + ["--layout", "dp=8"])
    assert out["fits"] is False and out["command"] is None
    assert any(note.startswith("the layout does not fit in the") for note in out["notes"]), out["notes"]


def test_no_train_command_for_a_layout_embers_trainer_refuses(capsys):
    out = plan_json(capsys, ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64",
                             "--seq-len", "8192", "--layout", "cp=2,dp=4,zero=1"])
    assert out["fits"] and out["command"] is None
    assert any("ember's trainer refuses this layout" in note for note in out["notes"])


def test_what_embers_trainer_refuses_is_said_also_for_a_layout_that_does_not_fit(capsys):
    out = plan_json(capsys, ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64",
                             "--seq-len", "8192", "--layout", "cp=2,dp=4"])
    assert not out["fits"] and out["command"] is None
    assert any("ember's trainer refuses this layout" in note for note in out["notes"]), out["notes"]


def test_a_layout_given_twice_is_ranked_once_and_top_cuts_the_table(capsys):
    args = LLAMA + ["--layout", "tp=2,dp=4,zero=1", "--layout", "tp=2,dp=4,zero=1", "--layout", "tp=4,dp=2,zero=1",
                    "--layout", "tp=8,zero=0"]
    assert len(plan_json(capsys, args)["ranked"]) == 3
    assert main(args + ["--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 layouts given" in out and "tp=2" in out and "tp=8" not in out.split("train with")[0].split("given")[1]


def test_another_stacks_layouts_get_no_note_about_a_command_they_do_not_have(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64", "--stack",
            "megatron", "--layout", "tp=2,dp=4,zero=1,recompute=full", "--layout", "tp=4,dp=2,zero=1,recompute=full"]
    out = plan_json(capsys, base)
    assert out["best"]["command"] is None
    assert not any("RECIPE.toml" in note for note in out["notes"]), out["notes"]
    ember = plan_json(capsys, base[:-6] + base[-4:])  # the same two layouts for ember's trainer
    assert ember["best"]["command"] and any("RECIPE.toml" in note for note in ember["notes"])


def test_gpipe_without_stages_holds_one_micro_batch(capsys):
    """With one stage the trainer accumulates one micro-batch at a time whatever the schedule."""
    plain = plan_json(capsys, LLAMA + ["--layout", "dp=8,zero=1"])
    gpipe = plan_json(capsys, LLAMA + ["--layout", "dp=8,zero=1,schedule=gpipe"])
    assert gpipe["memory_gib_per_gpu"] == plain["memory_gib_per_gpu"] and gpipe["fits"]


def test_a_pipeline_over_nodes_is_paced_by_its_slowest_boundary():
    over_nodes, in_a_node = Group(4, 1), Group(4, 4)
    slow_inside = Links(2, intra_gbps=0.5, inter_gbps=25)
    assert p2p_s(1e8, over_nodes, slow_inside) == pytest.approx(p2p_s(1e8, in_a_node, slow_inside))
    fast_inside = Links(2, intra_gbps=300, inter_gbps=25)
    assert p2p_s(1e8, over_nodes, fast_inside) > 5 * p2p_s(1e8, in_a_node, fast_inside)


def test_near_ties_and_order_count_only_layouts_that_fit(capsys):
    layouts = ["dp=8", "dp=8,zero=3", "tp=8,sp=1,mbs=2", "pp=2,dp=4,zero=1,stage_layers=30/2"]
    args = LLAMA + [x for lo in layouts for x in ("--layout", lo)]
    out = plan_json(capsys, args + ["--explain"])
    fitting = [r for r in out["ranked"] if r["fits"]]
    assert [r["fits"] for r in out["ranked"]] == [True] * len(fitting) + [False] * (4 - len(fitting))
    def overlaps(a, b):
        return a["interval"]["tokens_per_s_per_gpu"][0] <= b["interval"]["tokens_per_s_per_gpu"][1] and \
            b["interval"]["tokens_per_s_per_gpu"][0] <= a["interval"]["tokens_per_s_per_gpu"][1]

    best, others = out["ranked"][0], out["ranked"][1:]
    assert any(not r["fits"] and overlaps(best, r) for r in others)  # one the old count took in
    assert out["within_interval_of_best"] == 1 + sum(r["fits"] and overlaps(best, r) for r in others)
    assert "does not fit" in out["explain"]
    assert main(args) == 0
    assert f"fastest first, then the {4 - len(fitting)} that do not fit" in capsys.readouterr().out


def test_a_refused_command_leaves_the_profile_file_alone(tmp_path, capsys):
    mine = tmp_path / "keep.json"
    mine.write_text('{"mine": true}')
    base = ["plan", "--gpu", "H100", "--gpus", "8", "--save-profile", str(mine)]
    for mistake in (["--model", "llama3-8bb", "--global-batch", "64"], ["--model", "llama3-8b", "--global-batch", "0"],
                    ["--model", "llama3-8b", "--global-batch", "64", "--precision", "fp4"]):
        assert main(base + mistake) == 2
    assert mine.read_text() == '{"mine": true}'
    capsys.readouterr()


def test_a_saved_profile_keeps_the_node_size_and_the_measurements(tmp_path, capsys):
    two = tmp_path / "two.json"
    assert main(["plan", "--gpu", "H100", "--gpus", "2", "--model", "llama2-7b", "--global-batch", "8",
                 "--precision", "BF16", "--save-profile", str(two)]) == 0
    assert json.loads(two.read_text())["links"]["gpus_per_node"] == 8
    capsys.readouterr()
    assert main(["plan", "--profile", str(two), "--gpus", "16", "--model", "llama2-7b", "--global-batch", "64",
                 "--top", "1"]) == 0
    assert "16 x H100 SXM (8 per node" in capsys.readouterr().out
    measured = json.loads(two.read_text()) | {"measured": {"dtype": "bf16", "note": "kept"}}
    two.write_text(json.dumps(measured))
    again = tmp_path / "again.json"
    assert main(["plan", "--profile", str(two), "--save-profile", str(again)]) == 0
    assert json.loads(again.read_text())["measured"] == {"dtype": "bf16", "note": "kept"}


def test_calibrate_refuses_a_model_plan_before_measuring(tmp_path, capsys, monkeypatch):
    import ember.plan.calibrate as calibrate

    def measured(*args, **kwargs):
        raise AssertionError("measured before the plan was checked")

    monkeypatch.setattr(calibrate, "measure_matmuls", measured)
    out = tmp_path / "c.json"
    base = ["plan", "calibrate", "--out", str(out), "--quick", "--model", "bert-base"]
    assert main(base + ["--global-batch", "3", "--gpus", "13"]) == 2
    assert "divides evenly" in capsys.readouterr().err
    assert main(base + ["--global-batch", "8", "--seq-len", "0"]) == 2
    assert "--seq-len must be at least 1" in capsys.readouterr().err
    # A recipe that takes its vocabulary from the data is given one with --set.
    recipe = ["plan", "calibrate", "--out", str(out), "--quick", "--model", str(REPO / "configs/tiny-gpt.toml"),
              "--global-batch", "8", "--gpus", "13"]
    assert main(recipe) == 2
    assert "--set model.vocab_size=N" in capsys.readouterr().err
    assert main(recipe + ["--set", "model.vocab_size=512"]) == 2  # past the vocabulary, to the layout's check
    assert "divides evenly" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--out", str(out), "--set", "model.layers=2"]) == 2
    assert "give the model with --model" in capsys.readouterr().err
    assert not out.exists()


def test_a_zero_bubble_layout_is_priced_and_trained_uncompiled(capsys):
    """PyTorch cannot compile a zero-bubble schedule's stages: the command says so, so that a
    recipe with train.compile=true still runs the layout the planner priced."""
    out = plan_json(capsys, ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--global-batch", "64",
                             "--seq-len", "4096", "--layout", "tp=2,sp=1,pp=4,schedule=zbv,dp=1,mbs=1,recompute=none"])
    assert out["layout"] == "tp=2,sp=1,pp=4,schedule=zbv,vpp=2,dp=1,mbs=1,recompute=none"
    assert out["fits"] and "--set parallel.schedule=zbv" in out["command"]
    assert "--set train.compile=false" in out["command"]
    interleaved = plan_json(capsys, ["plan", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--global-batch",
                                     "64", "--seq-len", "4096", "--layout",
                                     "tp=2,sp=1,pp=4,schedule=interleaved,vpp=2,dp=1,mbs=1,recompute=full"])
    assert "train.compile" not in interleaved["command"]


def test_zbv_without_a_pipeline_names_the_schedule_not_a_vpp_never_given(capsys):
    assert main(LLAMA + ["--layout", "schedule=zbv"]) == 2
    err = capsys.readouterr().err
    assert "parallel.schedule='zbv' splits each pipeline rank into 2 stages, so it needs parallel.pp > 1" in err
