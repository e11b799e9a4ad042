"""`ember export hf`: the exported folder loads with transformers' from_pretrained and
computes ember's logits; architectures that do not map exactly are refused."""

import json

import pytest
import torch
from safetensors.torch import save_model

from ember.cli import main
from ember.config import load_config, to_toml
from ember.data import train_tokenizer
from ember.model import Transformer

SHAPE = ["model.hidden=64", "model.layers=2", "model.heads=4", "model.mlp_hidden=96", "model.max_seq_len=32"]
LLAMA = ["model.objective=causal", "model.norm=rmsnorm", "model.activation=swiglu", "model.positions=rotary"]
GPT2 = ["model.objective=causal", "model.norm=layernorm", "model.activation=gelu", "model.positions=learned"]
DOCS = ["Return the number of items in a sequence.", "Open the file and read its lines.",
        "Raise ValueError when the argument is negative."] * 10


def make_run(folder, overrides):
    """A run directory as the trainer leaves it, with random non-trivial weights."""
    tok = train_tokenizer("bpe", DOCS, 300)
    vocab = tok.get_vocab_size()
    config = load_config(None, SHAPE + overrides + [f"model.vocab_size={vocab}"])
    torch.manual_seed(0)
    model = Transformer(config.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial, so that their placement is tested
                param.add_(0.1 * torch.randn_like(param))
            else:  # activations of order 1, where GELU's tanh approximation would show
                param.mul_(10.0)
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(config))
    save_model(model, str(folder / "model.safetensors"))
    tok.save(str(folder / "tokenizer.json"))
    return model.eval(), tok


@pytest.mark.parametrize("overrides, architecture", [
    (LLAMA + ["model.tie_embeddings=false", "model.rope_theta=500", "model.norm_eps=1e-6"], "LlamaForCausalLM"),
    (LLAMA + ["model.bias=true"], "LlamaForCausalLM"),
    (LLAMA + ["model.kv_heads=2", "model.tie_embeddings=false"], "LlamaForCausalLM"),  # grouped-query attention
    (GPT2 + ["model.bias=true"], "GPT2LMHeadModel"),
    (GPT2 + ["model.bias=false", "model.tie_embeddings=false"], "GPT2LMHeadModel"),
])
def test_exported_model_computes_embers_logits(tmp_path, overrides, architecture, capsys):
    transformers = pytest.importorskip("transformers")
    ours, tok = make_run(tmp_path / "run", overrides)
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert architecture in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == architecture
    assert hf.config.vocab_size == ours.cfg.padded_vocab  # exported padded
    if architecture == "LlamaForCausalLM":
        assert hf.config.num_key_value_heads == (ours.cfg.kv_heads or ours.cfg.heads)
    ids = torch.randint(0, tok.get_vocab_size(), (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "Read the number of lines."
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids  # no special tokens added, as in training
    assert (hf_tok.eos_token, hf_tok.pad_token, hf_tok.mask_token) == ("<|endoftext|>", "<|pad|>", "<|mask|>")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tok.token_to_id("<|endoftext|>")


def test_unmappable_causal_models_are_refused(tmp_path, capsys):
    make_run(tmp_path / "run", LLAMA + ["model.norm=layernorm"])
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM needs model.norm=rmsnorm (this run has layernorm)" in err and err.count("\n") == 1
    make_run(tmp_path / "gqa", GPT2 + ["model.kv_heads=2"])
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "gqa"), "--out", str(tmp_path / "hf")]) == 2
    assert "GPT2LMHeadModel needs model.kv_heads=0 (this run has 2)" in capsys.readouterr().err


def test_an_existing_folder_is_never_overwritten(tmp_path, capsys):
    make_run(tmp_path / "run", LLAMA)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


def test_export_keeps_a_users_folders_and_refuses_a_damaged_run(tmp_path, capsys):
    make_run(tmp_path / "run", LLAMA)
    (tmp_path / "hf.tmp").mkdir()  # a name an exporter might have used for its own temporary folder
    (tmp_path / "hf.tmp" / "keep.txt").write_text("mine")
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf.tmp" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp", "run"]  # nothing left behind
    capsys.readouterr()
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "run" / "hf")]) == 2
    assert "lies inside the run" in capsys.readouterr().err and not (tmp_path / "run" / "hf").exists()
    weights = tmp_path / "run" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "does not hold weights for the model" in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf2").exists()


MLM_CASES = [
    ["model.objective=mlm", "model.activation=geglu", "model.positions=sinusoidal", "model.norm=layernorm",
     "model.bias=false", "model.tie_embeddings=true"],  # Cramming's BERT
    ["model.objective=mlm", "model.activation=gelu", "model.positions=learned", "model.bias=true",
     "model.tie_embeddings=false"],
    ["model.objective=mlm", "model.activation=swiglu", "model.positions=rotary", "model.norm=rmsnorm"],
    ["model.objective=mlm", "model.activation=swiglu", "model.positions=rotary", "model.norm=rmsnorm",
     "model.kv_heads=2", "model.bias=true"],
]


@pytest.mark.parametrize("overrides", MLM_CASES, ids=["cramming", "learned-gelu-bias", "rotary-swiglu", "gqa"])
def test_exported_masked_lm_computes_embers_logits_and_fine_tunes(tmp_path, overrides, capsys):
    transformers = pytest.importorskip("transformers")
    ours, tok = make_run(tmp_path / "run", overrides)
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "EmberForMaskedLM" in capsys.readouterr().out
    assert "import ember" not in (out / "modeling_ember.py").read_text()  # loads where ember is not installed
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, local_files_only=True).eval()
    # A pair laid out as `ember eval glue` lays it out, so the classifier's first position is its [CLS].
    from dataclasses import replace

    from ember.data import special_token_ids
    from ember.eval.encode import encode_split
    from ember.eval.glue_tasks import Split

    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    pair = Split(["Open the file.", "Return the items."], ["Read its lines.", "Raise ValueError."], [0, 1], 0)
    assert hf_tok(pair.text_a, pair.text_b)["input_ids"] == encode_split(pair, tok, special_token_ids(tok), "mlm", 32)
    assert hf_tok(pair.text_a)["input_ids"] == encode_split(replace(pair, text_b=None), tok, special_token_ids(tok),
                                                            "mlm", 32)
    ids = torch.randint(0, tok.get_vocab_size(), (3, 24))
    lengths = torch.tensor([24, 17, 9])
    mask = torch.arange(24)[None, :] < lengths[:, None]  # a right-padded batch
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
        want = ours.head(ours.norm(ours.trunk(ids, key_padding_mask=mask)))
        got = hf(input_ids=ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)

    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, trust_remote_code=True, local_files_only=True, num_labels=2)
    torch.testing.assert_close(classifier.model.embed.weight, hf.model.embed.weight)  # the encoder is the same
    torch.manual_seed(0)
    x = torch.randint(5, tok.get_vocab_size(), (16, 12))
    y = (x[:, 1] % 2).long()  # a task the encoder can learn from one token
    opt = torch.optim.AdamW(classifier.parameters(), lr=1e-3)
    classifier.train()
    losses = []
    for _ in range(30):
        loss = classifier(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_terminated_export_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """A scheduler's cancel (SIGTERM) in the middle of writing the weights unwinds as Ctrl-C
    does: no folder at --out and no hidden temporary folder beside it."""
    import os
    import signal

    import safetensors.torch

    make_run(tmp_path / "run", LLAMA)
    real = safetensors.torch.save_file

    def cancelled_half_way(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", cancelled_half_way)
    (tmp_path / "exports").mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "exports" / "hf")])
    assert stop.value.code == 128 + signal.SIGTERM
    assert "terminated; nothing half-written was left" in capsys.readouterr().err
    assert list((tmp_path / "exports").iterdir()) == []


def test_a_damaged_checkpoint_is_named_without_resume_advice(tmp_path, capsys):
    from ember.train.checkpoint import save

    model, _ = make_run(tmp_path / "run", LLAMA)
    folder = save(tmp_path / "run", 5, [model], [torch.optim.AdamW(model.parameters())], {"progress": {"step": 5}})
    (folder / "state.json").write_text("garbage")
    folder = folder.rename(folder.with_name(folder.name + ".damaged"))
    assert main(["export", "hf", "--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'state.json'} is missing or does not match its checksum" in err, err
    assert "--resume" not in err and "rename" not in err and ".damaged.damaged" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()
