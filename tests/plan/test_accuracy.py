"""The planner against measured public runs (benchmarks/planner_accuracy.py). The bounds are
what was reached when this was written (benchmarks/results/2026-11-26-planner-accuracy.txt),
so a regression fails here; the issue's targets (median 10%, bias within 5%, Spearman 0.8
in every group, the measured best in the top three of every group) are stated in
docs/planner.md with how far each set is from them."""

import importlib.util
import re
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def _module(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def accuracy():
    return _module("planner_accuracy")


@pytest.fixture(scope="module")
def published(accuracy):
    _needs("published_runs")
    return accuracy.evaluate_set("published_runs")


def test_published_runs(published):
    for part, median, bias in (("fitted", 0.03, 0.03), ("held_out", 0.05, 0.05)):
        s = published[part]
        assert s["rows"] >= 5
        # The largest, +10.5%: FlagPerf's held-out Llama 3 8B on H100 (tp 2 with SP), +9.2%
        # before megatron's rates were refitted with NeMo's bf16 gradients.
        assert s["median"] <= median and abs(s["bias"]) <= bias and s["max"] <= 0.11
    # The interval is the 10th-90th percentile of the errors: about four rows in five inside.
    inside = published["fitted"]["inside"] + published["held_out"]["inside"]
    assert inside >= 0.75 * (published["fitted"]["rows"] + published["held_out"]["rows"])
    sweep = published["fitted"]
    assert sweep["rho_groups"] == 1 and sweep["rho_min"] >= 0.95 and sweep["top3"] == sweep["ranked_groups"]


def test_out_of_memory_layout_is_predicted_not_to_fit(published):
    oom = [r for r in published["records"] if r["run"].oom]
    assert oom and all(not r["prediction"].fits for r in oom)
    best = max((r for r in published["records"] if r["run"].source == "FlagPerf" and r["run"].measured),
               key=lambda r: r["run"].measured)
    assert best["prediction"].fits  # measured at 76 of 80 GiB: the margin must not reject it


def _needs(name):
    import planner_sets

    if not planner_sets.available(name):
        pytest.skip(f"{name} is not in {planner_sets.SHARED}: set EMBER_PLANNER_DATA to the shared planner data")


def test_published_runs_more(accuracy):
    _needs("published_runs_more")
    result = accuracy.evaluate_set("published_runs_more")
    for part in ("fitted", "held_out"):
        s = result[part]
        assert s["rows"] >= 50
        # The targets: median within 10%, bias within 5%. The largest error is
        # MPT-70b on 64 A100s at micro-batch 2 (+32%: see docs/planner.md).
        assert s["median"] <= 0.08 and abs(s["bias"]) <= 0.05 and s["max"] <= 0.33


def test_vtrain_rankings(accuracy):
    _needs("vtrain")
    result = accuracy.evaluate_set("vtrain")
    for part in ("fitted", "held_out"):
        s = result[part]
        # tp=8 at micro-batch 1 (Megatron's fused softmax does not take 2 score matrices)
        # was +36-50% before the fallback was priced; the largest errors are now 22%.
        assert s["median"] <= 0.05 and abs(s["bias"]) <= 0.03 and s["max"] <= 0.25
        # The groups below 0.8 have 3 or 5 layouts, the swapped ones measured within 10%.
        assert s["rho_median"] >= 0.95 and s["rho_ok"] >= 0.95 * s["rho_groups"]
        assert s["top3"] >= 0.93 * s["ranked_groups"]
        # Where the top three miss it, the measured best is still among the layouts the
        # planner says it cannot order (its interval overlaps the best's): `ember tune` finds it.
        assert s["in_ties"] == s["ranked_groups"] and s["tie_share"] <= 0.6


HEADER = ("source,model,params_B,layers,hidden,heads,seq,vocab,gpu,n_gpus,tp,pp,dp,zero,micro_bs,global_bs,"
          "recompute,tflops_per_gpu,mfu,notes,kv_heads,ffn_hidden\n")


def test_a_file_of_runs_from_any_source_is_checked_as_unseen(accuracy, tmp_path):
    """`planner_accuracy.py --csv FILE`: rows of sources the loader has no rule for are read
    from what they say (stack from the source's name, the layout from the columns, the
    rest searched) and reported as unseen; FP8 rows are priced as FP8 where the GPU has it,
    and what is not priced is skipped with its reason."""
    import planner_sets

    path = tmp_path / "runs.csv"
    path.write_text(HEADER
                    + "Lab X (Megatron-DeepSpeed),GPT 6.7B,6.7,32,4096,32,2048,50257,A100-80GB,64,2,4,8,1,2,512,"
                      "full,,,tok_s_gpu=1500; inter_gbps=12.5; sp=0,32,16384\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,2,1,8,,,64,,400,,,8,14336\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,2,1,8,,,64,,600,,precision=fp8,8,14336\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,A100 SXM4,16,2,1,8,,,64,,300,,precision=fp8,8,14336\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,2,1,8,,,64,,500,,fp8 rowwise,8,14336\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,DGX-B200,16,2,1,8,,,64,,900,,precision=nvfp4,8,14336\n"
                    + "Lab Y,Llama 8B,8,32,4096,32,8192,128256,B300 SXM6,16,2,1,8,,,64,,900,,,8,14336\n"
                    + "Lab Y,Mixtral 8x7B,47,32,4096,32,4096,32000,H100 SXM,64,2,1,32,,,256,,400,,,8,14336\n"
                    + "Lab Y,Qwen3-30B-A3B,30,48,2048,32,4096,151936,H100 SXM,64,1,1,64,,,256,,300,,,4,768\n"
                    + "Lab Y,Model X,30,48,2048,32,4096,151936,H100 SXM,64,1,1,64,,,256,,300,,"
                    + "experts=128; ep=8,4,768\n")
    runs, skipped = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert skipped == {"FP8 on a GPU without FP8 tensor cores": 1, "FP8 with row-wise scales (not priced)": 1,
                       "FP4 (not priced)": 1, "GPU not in ember's table": 1, "mixture of experts (not priced)": 3}
    assert len(runs) == 3 and all(r.held_out for r in runs)
    ds, llama, fp8 = runs
    assert [r.shape.precision for r in runs] == ["bf16", "bf16", "fp8"] and fp8.group != llama.group
    assert ds.cluster.stack.name == "deepspeed" and ds.cluster.stack.pipeline_lockstep
    assert ds.cluster.links.inter_gbps == 12.5 and ds.model.bias and ds.model.positions == "learned"
    assert ds.fixed == {"tp": 2, "pp": 4, "dp": 8, "zero": 1, "dp_shard": 8, "sp": False, "micro_batch": 2,
                        "recompute": "full", "recompute_every": 1}
    assert llama.cluster.stack.name == "megatron" and llama.model.activation == "swiglu"
    assert llama.fixed == {"tp": 2, "pp": 1, "dp": 8, "zero": 1, "dp_shard": 8}  # the rest searched
    result = accuracy.evaluate_set("runs", path)
    assert result["unseen"] and result["held_out"]["rows"] == 3 and result["fitted"] == {"rows": 0}
    text = accuracy.report([result], 0.0)
    assert "unseen       3 rows" in text and "of which FP8: held out     1 rows" in text


def test_a_file_in_vtrains_columns_is_checked_as_unseen_on_nodes_of_eight(accuracy, tmp_path):
    """vTrain's measured files (a BOM, CRLF lines) are recognised by their columns, on as many
    nodes of 8 A100s as the GPU count needs; every group is unseen."""
    import planner_sets

    head = ("# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
            "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)")
    rows = ["16,32,2,2048,16,24,1024,8,1,2,900.0", "16,32,2,2048,16,24,1024,4,2,2,700.0",
            "16,32,1,2048,16,24,1024,2,4,2,650.0", "8,32,4,1024,16,12,1024,2,2,2,300.0"]
    path = tmp_path / "multi.csv"
    path.write_bytes(("\ufeff" + "\r\n".join([head] + rows) + "\r\n").encode())
    runs, skipped = planner_sets.runs_in_file(path, "multi")
    assert not skipped and len(runs) == 4 and all(r.held_out and r.set == "multi" for r in runs)
    assert [r.cluster.n_gpus for r in runs] == [16, 16, 16, 8] and runs[0].cluster.links.gpus_per_node == 8
    assert runs[0].cluster.links.inter_gbps == 12.5  # vTrain's configs: 800 Gb/s per node of 8
    # Megatron-LM's schedule, as the single-node sweep's timing says: 1F1B, and sends of 1/tp.
    assert runs[0].cluster.stack.p2p_slices and not runs[0].cluster.stack.pipeline_lockstep
    assert runs[1].layout.tp == 4 and runs[1].layout.dp_replicate == 2 and runs[1].layout.pp == 2
    assert runs[0].measured == pytest.approx(32 * 1024 / 0.9 / 16)
    assert len({r.group for r in runs}) == 2
    result = accuracy.evaluate_runs("multi", runs, skipped, unseen=True)
    assert result["held_out"]["rows"] == 4 and result["held_out"]["ranked_groups"] == 1
    text = accuracy.report([result], 0.0)
    assert "unseen       4 rows" in text and "h2048 L24" not in text.split("rows of every set but vtrain:")[1]
    # Its one group of several layouts gets a line of its own: the measured best (tp 2, dp 4,
    # pp 2 at 650 ms) and where the planner ranked it.
    line = next(x for x in text.splitlines() if x.startswith("  h2048 L24 on 16 x A100"))
    assert "global batch 32: 3 layouts" in line and "measured best tp=2,pp=2,schedule=1f1b,dp=4" in line
    assert re.search(r"predicted #[123]\b", line)


def test_a_group_measured_without_spread_is_not_counted_as_ranked_right(accuracy, tmp_path):
    """Three layouts measured at the same time carry no order: their rank correlation is 0,
    not a pass."""
    import planner_sets

    head = ("global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
            "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)")
    rows = ["32,2,2048,16,24,1024,8,1,2,700.0", "32,2,2048,16,24,1024,4,2,2,700.0", "32,1,2048,16,24,1024,2,4,2,700.0"]
    path = tmp_path / "flat.csv"
    path.write_text("\n".join([head] + rows) + "\n")
    runs, skipped = planner_sets.runs_in_file(path, "flat")
    held_out = accuracy.evaluate_runs("flat", runs, skipped, unseen=True)["held_out"]
    assert held_out["rho_groups"] == 1 and held_out["rho_ok"] == 0 and held_out["rho_median"] == 0.0


def test_a_vtrain_file_may_split_tensors_across_nodes(accuracy, tmp_path):
    """vTrain's multi-node runs include tensor parallelism over 16 GPUs, two nodes: priced,
    not refused, with its collectives on the network between the nodes."""
    import dataclasses

    import planner_sets

    from ember.plan.cluster import make_cluster

    head = ("# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
            "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)")
    path = tmp_path / "tp16.csv"
    path.write_text("\n".join([head, "32,64,2,2048,16,24,1024,16,2,1,900.0"]))
    (run,), _ = planner_sets.runs_in_file(path, "tp16")
    nvlink_between = dataclasses.replace(run, cluster=make_cluster("A100-80GB", 32, 8, inter_gbps=300.0,
                                                                   stack=run.cluster.stack))
    slow, fast = planner_sets.predict(run), planner_sets.predict(nvlink_between)
    assert slow.step_time_s * slow.shares["tp_comm"] > 1.25 * fast.step_time_s * fast.shares["tp_comm"]


def test_hardware_tflops_of_a_runs_file_count_the_recomputed_forward(tmp_path):
    import planner_sets
    from ember.cost import model_flops_per_token, recompute_flops_per_token

    path = tmp_path / "runs.csv"
    row = "Lab Q,GPT 6.7B,6.7,32,4096,32,2048,50257,A100-80GB,64,2,4,8,1,2,512,full,150,,{},32,16384\n"
    path.write_text(HEADER + row.format("tflops=hardware") + row.format(""))
    (hardware, model_only), _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    spec = model_only.model
    assert model_only.measured == pytest.approx(150e12 / model_flops_per_token(spec, 2048))
    assert hardware.measured == pytest.approx(
        150e12 / (model_flops_per_token(spec, 2048) + recompute_flops_per_token(spec, 2048, "full")))


def test_a_runs_file_row_with_only_mfu_is_read_against_the_bf16_peak(tmp_path):
    import planner_sets
    from ember.cost import model_flops_per_token

    path = tmp_path / "runs.csv"
    row = "Lab Q,GPT 6.7B,6.7,32,4096,32,2048,50257,A100-80GB,64,2,4,8,1,2,512,full,,{},,32,16384\n"
    path.write_text(HEADER + row.format("0.45") + row.format("45"))
    (fraction, percent), _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    expected = 0.45 * 312e12 / model_flops_per_token(fraction.model, 2048)
    assert fraction.measured == pytest.approx(expected) and percent.measured == pytest.approx(expected)


def test_a_missing_or_malformed_runs_file_is_refused_before_any_work(accuracy, tmp_path, capsys):
    assert accuracy.main(["--no-write", "--csv", str(tmp_path / "nope.csv")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("model,gpu\nGPT,A100\n")
    assert accuracy.main(["--no-write", "--csv", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not a file of runs in published_runs_more.csv's columns or vTrain's" in err and "Traceback" not in err
    columns = tmp_path / "columns.csv"
    columns.write_text(HEADER.replace(",dp,", ",") + "Lab Z,GPT,1,24,2048,16,2048,50257,A100-80GB,8,1,1,,,64\n")
    assert accuracy.main(["--no-write", "--csv", str(columns)]) == 2
    assert "no column dp" in capsys.readouterr().err


def test_a_runs_file_row_that_cannot_be_used_is_skipped_with_its_line(accuracy, tmp_path):
    """One bad row does not stop a file: it is skipped with its line and the reason, and the
    rest are priced. An empty dp is what the other degrees leave of the GPU count."""
    import planner_sets

    path = tmp_path / "runs.csv"
    row = "Lab Z,GPT 1.3B,1.3,24,2048,16,2048,50257,A100-80GB,{},,,64,,,,tok_s_gpu=9000{},,\n"
    path.write_text(HEADER + row.format("8,1,1,", "")  # dp left empty: 8 / (1 x 1)
                    + row.format("8,1,1,8", "; stack=jax")  # line 3: a stack ember does not know
                    + row.format("8,2,1,8", "")  # 2 x 1 x 8 is not 8 GPUs
                    + row.format("8,1,1,8", "").replace("2048,16,", "2048,sixteen,")  # line 5
                    + row.format("6,3,1,", "")  # dp 2, but tp 3 does not divide 16 heads: nothing to search
                    + row.format("8,1,1,8", "").replace(",,,64,", ",,1-2,64,"))  # line 7: a range of micro-batches
    runs, skipped = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert [r.fixed["dp"] for r in runs] == [8, 2]
    assert skipped["tp x pp x dp x cp is not the GPU count"] == 1
    assert any(k.startswith("line 3: unknown --stack 'jax'") for k in skipped)
    assert any(k.startswith("line 5: ") for k in skipped) and len(skipped) == 4
    assert "line 7: '1-2' is not a whole number" in skipped
    result = accuracy.evaluate_runs("runs", runs, skipped, unseen=True)
    assert result["held_out"]["rows"] == 1
    assert any("with tp=3" in k and "divide the 16 heads" in k for k in result["skipped"])


def test_large_runs_never_fitted(accuracy):
    """benchmarks/data/large_runs.csv (MT-NLG, BLOOM, Llama 3 405B, Nemotron-4 340B from
    their papers): DeepSpeed's lockstep pipeline took MT-NLG from +39..+46% to -6..0%, and
    recomputing every second layer Llama 3 405B from -14/-15% to -2/-4%."""
    result = accuracy.evaluate_set("large_runs", REPO / "benchmarks" / "data" / "large_runs.csv")
    s = result["held_out"]
    assert s["rows"] == 7 and s["median"] <= 0.05 and abs(s["bias"]) <= 0.05 and s["max"] <= 0.13
    errors = {(r["run"].label, r["run"].cluster.n_gpus): r["error"] for r in result["records"]}
    assert all(abs(errors["MT-NLG 530B", n]) <= 0.07 for n in (2240, 2800, 3360))
    assert all(abs(errors["Llama 3 405B", n]) <= 0.05 for n in (8192, 16384))


def test_the_fit_moves_a_constant_only_when_the_rows_ask_for_it():
    fit = _module("planner_fit")
    costs = {0.1: 0.50, 0.2: 0.40, 0.3: 0.40 + fit.TIE / 2}
    assert fit.choose(list(costs), 0.3, costs.get) == 0.3  # within TIE of the best: stays
    assert fit.choose(list(costs), 0.1, costs.get) == 0.2  # beaten by more than TIE: moves
    assert fit.choose([0.1, 0.2], 0.25, lambda v: {0.1: 0.5, 0.2: 0.4, 0.25: 0.3}[v]) == 0.25


def test_a_runs_file_names_its_stack_by_whole_words(accuracy, tmp_path):
    import planner_sets

    row = "{},Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,2,1,{},1,1,64,,,,tok_s_gpu=5000; cp={},8,14336\n"
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + row.format("NeMo 25.11 (Megatron-Bridge)", 8, 1)
                    + row.format("Nemotron-4 (Megatron-Core)", 8, 1) + row.format("Lab Z (Megatron-FSDP)", 8, 1)
                    + row.format("Lab Z (torchtitan)", 4, 2))
    runs, _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert [r.cluster.stack.name for r in runs] == ["nemo", "megatron", "nemo", "fsdp"]
    assert runs[3].fixed["cp"] == 2 and "cp" not in runs[0].fixed
    # Context-parallel rows are also reported apart.
    text = accuracy.report([accuracy.evaluate_set("runs", path)], 0.0)
    assert "of which context-parallel: held out     1 rows" in text


def test_nemo_rows_reduce_gradients_in_bf16_and_megatron_lms_own_in_fp32(tmp_path):
    import planner_sets

    row = "{},Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,2,1,8,1,1,64,,,,tok_s_gpu=5000{},8,14336\n"
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + row.format("nemo", "; precision=fp8") + row.format("megatron-core", "")
                    + row.format("megatron-core", "; precision=fp8"))
    runs, _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert [r.cluster.stack.grad_dtype for r in runs] == ["bf16", "fp32", "bf16"]
    assert all(r.cluster.stack.overlap_tp_comm for r in runs)


def test_torchtitan_rows_reduce_gradients_in_fp32_compiled_or_not(tmp_path):
    """torchtitan's mixed_precision_reduce defaults to float32, which also sets the dtype a
    pipeline stage accumulates its unreduced gradients in."""
    import planner_sets

    row = "torchtitan-H100,Llama 8B,8,32,4096,32,8192,128256,H100 SXM,16,1,2,8,3,2,64,full,,,tok_s_gpu=5000{},8,14336\n"
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + row.format("; compile=yes; precision=bf16") + row.format("; compile=no; precision=bf16"))
    runs, _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert [(r.cluster.stack.name, r.cluster.stack.grad_dtype) for r in runs] == [("fsdp", "fp32"),
                                                                                 ("fsdp-eager", "fp32")]
    assert runs[0].layout.pp == 2 and runs[0].layout.zero == 3


def test_torchtitan_grand_teton_rows_are_priced_on_that_part(tmp_path):
    """torchtitan's H100s (HBM2e, lower power) are slower than the SXM part the row's name
    starts with; their held-out groups keep the name the split was drawn with."""
    import planner_sets

    from ember.plan.predict import predict

    row = ("torchtitan-H100,Llama 8B,8,32,4096,32,8192,128256,{},8,1,1,8,3,2,16,selective,,,"
           "tok_s_gpu=5000; compile=yes; precision=bf16,8,14336\n")
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + row.format("H100-96GB HBM2e 500W;8/node NVLink") + row.format("H100 SXM"))
    teton, sxm = planner_sets.published_runs_more(path, name="runs", unseen=True)[0]
    assert (teton.cluster.gpu.name, sxm.cluster.gpu.name) == ("H100 SXM HBM2e", "H100 SXM")
    assert teton.cluster.gpu.hbm_gbps < sxm.cluster.gpu.hbm_gbps
    assert teton.group == sxm.group
    fast, slow = (predict(r.model, r.cluster, r.shape, r.layout).tokens_per_s_per_gpu for r in (sxm, teton))
    assert 0.85 < slow / fast < 0.95


def test_memory_is_reported_against_the_published_peaks(accuracy):
    from types import SimpleNamespace as NS

    def record(measured_gib, predicted_gib, oom=False, fits=True):
        memory = NS(total=predicted_gib * 2**30)
        return {"run": NS(memory_gib=measured_gib, oom=oom), "prediction": NS(memory=memory, fits=fits)}

    line = accuracy.memory_line([record(80.0, 72.0), record(50.0, 55.0), record(None, 0.0),
                                 record(None, 120.0, oom=True, fits=False)])
    assert "2 rows with a measured peak, median |err| 10.0%, max 10.0%, bias +0.0%" in line
    assert "ran out of memory: 1/1 predicted not to fit" in line
    assert accuracy.memory_line([record(None, 1.0)]) is None


def test_a_runs_file_row_from_llm_foundry_or_composer_is_priced_with_its_fused_loss(tmp_path):
    import planner_sets

    path = tmp_path / "runs.csv"
    row = "{},MPT 1B,1.3,24,2048,16,2048,50368,A100-80GB,8,1,1,8,3,,64,,,,tok_s_gpu=9000,,\n"
    path.write_text(HEADER + row.format("MosaicML llm-foundry") + row.format("Composer (FSDP)")
                    + row.format("Lab (FSDP)"))
    runs, _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    assert [r.cluster.stack.name for r in runs] == ["llm-foundry", "llm-foundry", "fsdp"]
    assert (runs[0].cluster.stack.loss_fwd_bytes, runs[0].cluster.stack.loss_bwd_bytes) == (2, 4)
    assert (runs[2].cluster.stack.loss_fwd_bytes, runs[2].cluster.stack.loss_bwd_bytes) == (38, 14)


def test_a_vtrain_file_row_that_cannot_be_used_is_skipped_and_its_header_may_vary(tmp_path):
    """vTrain's columns matched without case or spaces, the GPU count left to tp x dp x pp,
    the time in seconds; a row with a value that is not a number, or a GPU count that is not
    the product, is skipped with its line and the rest are read."""
    import planner_sets

    path = tmp_path / "vtrain.csv"
    path.write_text(" Global Batch ,micro batch,hidden size,attention heads,# layers,sequence length,"
                    "tensor parallelism,data parallelism,pipeline parallelism,Iteration time (s)\n"
                    "32,2,1024,16,12,1024,2,2,2,0.3\n"
                    "32,x,1024,16,12,1024,2,2,2,0.3\n"
                    "32,2,1024,16,12,1024,2,2,2,\n")
    runs, skipped = planner_sets.runs_in_file(path, "vtrain")
    assert len(runs) == 1 and runs[0].cluster.n_gpus == 8 and runs[0].measured == pytest.approx(32 * 1024 / 0.3 / 8)
    assert skipped == {"line 3: 'x' is not a whole number": 1, "line 4: no iteration time": 1}
    mismatch = tmp_path / "gpus.csv"
    mismatch.write_text("# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
                        "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
                        "16,32,2,1024,16,12,1024,2,2,2,300\n")
    runs, skipped = planner_sets.runs_in_file(mismatch, "gpus")
    assert not runs and skipped == {"line 2: 16 GPUs is not tp x dp x pp = 8": 1}


def test_a_searched_run_the_planner_thinks_too_big_is_priced_at_its_leanest_layout(tmp_path):
    """A published run did fit; where the planner's search fits no layout of its pinned
    degrees, the check prices the leanest rather than stopping."""
    import planner_sets

    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "Lab Q,Llama 405B on 8,405,126,16384,128,8192,128256,H100,8,1,1,8,1,1,64,,,0.4,"
                    "tok_s_gpu=100,8,53248\n")
    (run,), _ = planner_sets.published_runs_more(path, name="runs", unseen=True)
    p = planner_sets.predict(run)
    assert not p.fits and p.layout.tp == 1 and p.layout.dp == 8


def test_a_run_the_planner_fails_on_is_reported_as_skipped_not_the_end_of_the_check(accuracy, tmp_path,
                                                                                     monkeypatch):
    import planner_sets

    path = tmp_path / "runs.csv"
    row = "Lab Q,GPT 1.3B,1.3,24,2048,16,2048,50257,A100-80GB,8,1,1,8,1,{},64,full,,0.4,tok_s_gpu=9000,16,8192\n"
    path.write_text(HEADER + row.format(1) + row.format(2))
    runs, skipped = planner_sets.published_runs_more(path, name="runs", unseen=True)
    real = planner_sets.predict

    def flaky(run):
        if run.fixed["micro_batch"] == 2:
            raise ZeroDivisionError("division by zero")
        return real(run)

    monkeypatch.setattr(planner_sets, "predict", flaky)
    result = accuracy.evaluate_runs("runs", runs, skipped, unseen=True)
    assert result["held_out"]["rows"] == 1
    assert result["skipped"] == {"GPT 1.3B (Lab Q): planner failed, ZeroDivisionError: division by zero": 1}
