"""Tensor and sequence parallelism: equal to one process (real processes, gloo), and the
sentences that refuse a model that cannot be split."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.config import ModelConfig
from ember.layout import Layout, problems

WORKER = Path(__file__).with_name("tensor_worker.py")
CONFIGS = ["mlm-learned-gelu-tied-bias", "mlm-rotary-swiglu-untied", "mlm-dense-sinusoidal-geglu-tied",
           "causal-rotary-swiglu-tied", "causal-learned-gelu-untied-bias", "causal-gqa-rotary-swiglu-bias",
           "stages-mlm-learned-swiglu"]
COMPILED = "compiled-causal-rotary-swiglu-tied"
RTOL = 1e-5
# After three AdamW steps: Adam divides by sqrt(v), so elements whose gradient is near zero
# turn fp32 rounding noise (another reduction order) into steps of up to lr; a wrong
# gradient moves a weight matrix by about lr / its scale, above 1e-2 relative.
PARAM_RTOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """One torchrun launch of two ranks runs every case."""
    out = tmp_path_factory.mktemp("tp") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


CASES = [f"{config}/{mode}" for config in CONFIGS for mode in ("tp2", "tp2+sp")] + [f"{COMPILED}/tp2+sp"]


def test_every_case_ran(results):
    assert sorted(results["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_training_matches_one_process(results, case):
    r = results["cases"][case]
    assert len(r["losses"]) == len(r["ref_losses"]) == 3
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert _rel(got, want) < RTOL, (r["losses"], r["ref_losses"])
    for got, want in zip(r["norms"], r["ref_norms"]):
        assert _rel(got, want) < RTOL, (r["norms"], r["ref_norms"])
    # Training moved: the losses of the three steps are not all the same.
    assert len(set(r["ref_losses"])) == 3
    assert r["param_names"], "the parallel model's parameter names differ from the plain model's"
    assert r["param_rel"] < PARAM_RTOL, f"{r['worst_param']} differs by {r['param_rel']:.2e} (relative)"
    assert r["tied"], "tying of the head and the embedding changed"
    assert r["unfused"], "a tensor-parallel block still fuses its projections (the plan's hooks are on each)"
    # Sequence parallelism: the norms inside a block see half the sequence per rank.
    assert r["norm_tokens"] == (4 if case.endswith("+sp") else 8)


def test_gradients_come_back_in_their_parameters_layout(results):
    # Sharded like the parameter (the embedding's), reduced (sequence-parallel norms).
    assert results["grad_layouts"] == []


def test_no_rank_makes_a_split_parameters_whole_gradient(results):
    """The embedding looks up its own vocabulary shard, so its gradient is made as that
    shard: no rank holds a vocab x hidden gradient (2.1 GB per rank at 128k x 8,192, bf16)."""
    assert results["arrived_whole"] == []


def _model(**overrides) -> ModelConfig:
    base = dict(vocab_size=1000, vocab_multiple=8, hidden=64, heads=8, mlp_hidden=256)
    return ModelConfig(**{**base, **overrides})


def _problems(model: ModelConfig, tp: int, sp: bool, seq_len: int | None = None) -> list[str]:
    return problems(Layout(tp=tp, sp=sp), model, global_batch=8, world=tp, seq_len=seq_len)


def test_a_splittable_model_passes():
    assert _problems(_model(), tp=4, sp=True, seq_len=64) == []
    assert _problems(_model(vocab_size=0), tp=8, sp=False) == []  # vocabulary not known yet
    assert _problems(_model(heads=3), tp=1, sp=False) == []       # no tensor parallelism: nothing to split


@pytest.mark.parametrize("overrides,tp,sp,words", [
    ({}, 1, True, "parallel.sp (sequence parallel) splits the work of tensor parallelism, so it needs parallel.tp > 1"),
    ({"heads": 6}, 4, False, "model.heads (6) must be divisible by parallel.tp (4)"),
    ({"kv_heads": 2}, 4, False, "model.kv_heads (2) must be divisible by parallel.tp (4)"),
    ({"kv_heads": 4}, 4, False, None),
    ({"hidden": 66, "heads": 4}, 4, False, "model.hidden (66) must be divisible by parallel.tp (4)"),
    ({"hidden": 66, "heads": 2}, 2, False, None),  # divisible: no error
    ({"mlp_hidden": 250}, 4, False, "model.mlp_hidden (250) must be divisible by parallel.tp (4)"),
    ({"vocab_size": 1001, "vocab_multiple": 10}, 4, False, "the padded vocabulary (1010)"),
    ({"vocab_size": 0, "vocab_multiple": 6}, 4, False, "model.vocab_multiple (6) must be a multiple of parallel.tp (4)"),
    ({"vocab_size": 1001, "vocab_multiple": 6}, 4, False, "set model.vocab_multiple (now 6"),
])
def test_validation_sentences(overrides, tp, sp, words):
    found = _problems(_model(**overrides), tp=tp, sp=sp)
    assert found == [] if words is None else (len(found) == 1 and words in found[0])
    assert all(reason.count(". ") == 0 for reason in found)  # one sentence each


def test_a_sequence_that_does_not_split_over_the_ranks_is_refused():
    found = _problems(_model(), tp=2, sp=True, seq_len=7)
    assert found == ["sequence parallelism splits each sequence over the tensor-parallel ranks, so the data's "
                     "sequence length (7) must be divisible by parallel.tp (2)"]
    assert _problems(_model(), tp=2, sp=False, seq_len=7) == []
