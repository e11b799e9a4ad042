"""Fine-tuning: where each objective pools, the schedule, dropout, and that it learns."""

import pytest
import torch
from eval_helpers import trained_run, write_glue

from ember.config import ModelConfig
from ember.eval.finetune import Classifier, Protocol, lr_at
from ember.eval.glue import run_glue
from ember.model import Transformer


def _classifier(objective, pooling="auto"):
    torch.manual_seed(0)
    cfg = ModelConfig(objective=objective, vocab_size=50, hidden=32, layers=2, heads=2, mlp_hidden=64,
                      max_seq_len=32, activation="swiglu", norm="rmsnorm", positions="rotary")
    return Classifier(Transformer(cfg), 3, dropout=0.1, pooling=pooling).eval()


def test_causal_pools_the_last_real_token():
    model = _classifier("causal")
    ids = torch.randint(5, 50, (1, 10))
    with torch.no_grad():
        alone = model(ids, torch.tensor([10]))
        padded = model(torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], 1), torch.tensor([10]))
        other_end = ids.clone()
        other_end[0, -1] = (ids[0, -1] + 1) % 50
        changed = model(other_end, torch.tensor([10]))
        earlier = model(ids[:, :9], torch.tensor([9]))
    torch.testing.assert_close(alone, padded)  # right padding is invisible to a causal model
    assert not torch.allclose(alone, changed)  # ... and the last token is read
    assert not torch.allclose(alone, earlier)


def test_mlm_pools_the_first_token_which_sees_everything():
    model = _classifier("mlm")
    ids = torch.randint(5, 50, (1, 10))
    other_end = ids.clone()
    other_end[0, -1] = (ids[0, -1] + 1) % 50
    with torch.no_grad():
        assert not torch.allclose(model(ids, torch.tensor([10])), model(other_end, torch.tensor([10])))
        # the pooled position is the first, and positions past the length are padding it
        # does not attend to: a right-padded example scores as it does alone
        torch.testing.assert_close(model(ids, torch.tensor([4])), model(ids[:, :4], torch.tensor([4])))


@pytest.mark.parametrize("objective", ["mlm", "causal"])
def test_mean_pooling_averages_the_real_tokens_only(objective):
    model = _classifier(objective, pooling="mean")
    ids = torch.randint(5, 50, (2, 10))
    ids[1, 6:] = 0  # the second example is 6 tokens, right-padded
    with torch.no_grad():
        both = model(ids, torch.tensor([10, 6]))
        alone = model(ids[1:, :6])  # no padding: the plain mean
        h = model.encoder.trunk(ids[:1])
        by_hand = model.out(torch.tanh(model.pooler(model.encoder.norm(h.mean(1)))))
    torch.testing.assert_close(both[1:], alone)  # padding is neither attended to nor averaged
    torch.testing.assert_close(both[:1], by_hand)
    assert not torch.allclose(both[:1], _classifier(objective)(ids[:1], torch.tensor([10])))


def test_unknown_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling must be one of auto, mean"):
        _classifier("mlm", pooling="max")


def test_dropout_is_on_while_fine_tuning():
    model = _classifier("causal").train()
    ids = torch.randint(5, 50, (2, 10))
    assert not torch.allclose(model(ids, torch.tensor([10, 10])), model(ids, torch.tensor([10, 10])))


def test_schedule_warms_up_then_decays_to_zero():
    p = Protocol(lr=1.0)
    lrs = [lr_at(step, 100, p) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and max(lrs) == 1.0
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 1e-3
    assert lrs[54] == pytest.approx(0.5, abs=0.02)  # half-way through the cosine


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_fine_tuning_learns_a_learnable_task(objective, dataset, tmp_path, tmp_path_factory):
    """The label is the last word of the second sentence: chance is 50%. The tiny model
    needs a larger learning rate and more epochs than the protocol's to learn it in seconds."""
    run = trained_run(objective, dataset, tmp_path_factory)
    glue = write_glue(tmp_path / "glue", sizes=(160, 100), folders=("RTE",), seed=1)
    results = run_glue(run, glue, tasks="rte", seeds=1, out=tmp_path / "r.json", progress=False,
                       protocol=Protocol(lr=3e-3, epochs=10))
    assert results["columns"]["RTE"] >= 0.9, results["tasks"]["rte"]


def test_unpadded_batches_need_no_lengths():
    for objective in ("causal", "mlm"):
        model = _classifier(objective)
        ids = torch.randint(5, 50, (3, 10))
        with torch.no_grad():
            torch.testing.assert_close(model(ids), model(ids, torch.tensor([10, 10, 10])))


def test_the_step_path_reads_nothing_back_from_the_device(monkeypatch):
    """No .item(), float() or .tolist() per step: on a GPU each would wait for the step."""
    from ember.eval.finetune import finetune

    model = _classifier("mlm").train()
    rows = [[1] + [5 + (i * j) % 40 for j in range(3 + i % 7)] for i in range(40)]
    labels = [i % 3 for i in range(40)]
    epochs = []

    def forbidden(*args, **kwargs):
        raise AssertionError("a host read in the step path")

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    finetune(model, rows, labels, False, 0, 0, Protocol(epochs=2, batch_size=8), torch.device("cpu"), None,
             on_epoch=lambda epoch, loss_sum, steps: epochs.append((epoch, loss_sum, steps)))
    monkeypatch.undo()
    assert [(e, s) for e, _, s in epochs] == [(0, 5), (1, 5)] and all(float(x) > 0 for _, x, _ in epochs)


def test_fine_tuning_in_fp16_scales_the_loss_and_follows_fp32():
    """fp16 autocast (GPUs without bf16): the backward pass sees the loss times 2^16, so
    small gradients survive fp16, and the losses are fp32's to fp16's rounding."""
    from ember.eval.finetune import finetune

    rows = [[1] + [5 + (i * j) % 40 for j in range(3 + i % 7)] for i in range(40)]
    labels = [i % 3 for i in range(40)]
    losses, first_grads = {}, {}
    for name, dtype in (("fp32", None), ("fp16", torch.float16)):
        model = _classifier("mlm").train()
        start = [p.detach().clone() for p in model.parameters()]
        seen = []  # each gradient as backward leaves it, before the optimizer's step
        model.out.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.norm().item()))
        steps = []
        finetune(model, rows, labels, False, 0, 0, Protocol(epochs=2, batch_size=8), torch.device("cpu"), dtype,
                 on_step=lambda step, loss: steps.append(float(loss)))
        assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
        losses[name], first_grads[name] = steps, seen[0]
    assert first_grads["fp16"] / first_grads["fp32"] == pytest.approx(2.0**16, rel=1e-2)
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["fp16"] != losses["fp32"]
