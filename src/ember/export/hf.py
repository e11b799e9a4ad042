"""`ember export hf`: a run as a Hugging Face transformers folder (config.json,
model.safetensors, tokenizer files) that `from_pretrained` loads offline.

Only exact mappings are written; a model that would compute something else in
transformers is refused with the differences named:
- causal, RMSNorm, SwiGLU, rotary -> `LlamaForCausalLM` (biases map onto attention_bias
  and mlp_bias, model.kv_heads onto num_key_value_heads; tied or untied output per the
  run's config);
- causal, LayerNorm, GELU, learned positions -> `GPT2LMHeadModel` (Conv1D stores weights
  [in, out], so they are transposed, and q, k, v are fused into c_attn; a run without
  biases gets zero biases, which computes the same; no grouped-query attention);
- masked LMs -> ember's own code (`hf_remote.py`, copied next to the weights as
  `modeling_ember.py`), loaded with `trust_remote_code=True` by `AutoModelForMaskedLM` and
  `AutoModelForSequenceClassification`. ModernBERT, the only pre-norm GeGLU encoder in
  transformers, computes something else: it normalises the embeddings before the first
  block (which has no input norm), its masked-LM head adds a dense + GELU + LayerNorm
  layer, and it alternates sliding-window and global attention with two rotary bases.
The vocabulary is exported padded (ember pads the embedding to model.vocab_multiple):
the logits then equal ember's everywhere, and the tokenizer never emits the extra ids.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch

from ember.atomic import publish_dir
from ember.config import ConfigError, ModelConfig
from ember.eval.run import open_run
from ember.export.hf_tokenizer import write_tokenizer
from ember.model import Transformer

REQUIRES = {
    "LlamaForCausalLM": {"objective": "causal", "norm": "rmsnorm", "activation": "swiglu", "positions": "rotary"},
    "GPT2LMHeadModel": {"objective": "causal", "norm": "layernorm", "activation": "gelu", "positions": "learned"},
}

REMOTE_CODE = Path(__file__).with_name("hf_remote.py")  # imports torch and transformers only


def choose_architecture(m: ModelConfig) -> str:
    """The transformers class that computes exactly what this model computes, or ConfigError."""
    if m.objective == "mlm":
        return "EmberForMaskedLM"  # remote code: no built-in class matches
    misses = {name: [f"model.{k}={v} (this run has {getattr(m, k)})" for k, v in need.items() if getattr(m, k) != v]
              for name, need in REQUIRES.items()}
    if m.kv_heads not in (0, m.heads):  # GPT-2 has one key/value head per query head
        misses["GPT2LMHeadModel"].append(f"model.kv_heads=0 (this run has {m.kv_heads})")
    fits = [name for name, miss in misses.items() if not miss]
    if fits:
        return fits[0]
    reasons = "; ".join(f"{name} needs {' and '.join(miss)}" for name, miss in misses.items())
    raise ConfigError(f"this model does not map exactly onto a transformers architecture: {reasons}.")


def _special_ids(special: dict) -> dict:
    return {"bos_token_id": special["sep"], "eos_token_id": special["sep"], "pad_token_id": special["pad"]}


def llama(model: Transformer, special: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    m = model.cfg
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.padded_vocab,
        "hidden_size": m.hidden, "intermediate_size": m.mlp_hidden, "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads or m.heads, "head_dim": m.hidden // m.heads,
        "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        # Older transformers read rope_theta, newer ones rope_parameters: write both.
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_scaling": None, "attention_bias": m.bias, "mlp_bias": m.bias,
        # Llama has attention dropout only; ember's residual and embedding dropout have no slot.
        "attention_dropout": m.dropout, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "torch_dtype": "float32", "use_cache": True, **_special_ids(special),
    }
    state = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not m.tie_embeddings:
        state["lm_head.weight"] = model.head.weight
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i, block in enumerate(model.blocks.values()):
        p = f"model.layers.{i}."
        for ours, theirs in names.items():
            layer = getattr(block.attn if ours.endswith("proj") else block.mlp, ours)
            state[p + theirs + ".weight"] = layer.weight
            if layer.bias is not None:
                state[p + theirs + ".bias"] = layer.bias
        state[p + "input_layernorm.weight"] = block.attn_norm.weight
        state[p + "post_attention_layernorm.weight"] = block.mlp_norm.weight
    return config, state


def gpt2(model: Transformer, special: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    m = model.cfg
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.padded_vocab,
        "n_positions": m.max_seq_len, "n_embd": m.hidden, "n_layer": m.layers, "n_head": m.heads,
        "n_inner": m.mlp_hidden, "activation_function": "gelu",  # exact erf GELU, as ember's (not gelu_new)
        "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout, "initializer_range": m.init_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": m.tie_embeddings, "torch_dtype": "float32", "use_cache": True,
        **_special_ids(special),
    }

    def bias(layer) -> torch.Tensor:  # GPT-2 always has biases; zeros compute what none would
        return layer.bias if layer.bias is not None else torch.zeros(layer.weight.shape[0])

    state = {"transformer.wte.weight": model.embed.weight, "transformer.wpe.weight": model.pos_embed.weight,
             "transformer.ln_f.weight": model.norm.weight, "transformer.ln_f.bias": bias(model.norm)}
    if not m.tie_embeddings:
        state["lm_head.weight"] = model.head.weight
    for i, block in enumerate(model.blocks.values()):
        p, attn, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        state[p + "attn.c_attn.weight"] = torch.cat([x.weight for x in qkv]).T
        state[p + "attn.c_attn.bias"] = torch.cat([bias(x) for x in qkv])
        for name, layer in (("attn.c_proj", attn.o_proj), ("mlp.c_fc", mlp.up), ("mlp.c_proj", mlp.down)):
            state[p + name + ".weight"], state[p + name + ".bias"] = layer.weight.T, bias(layer)
        for name, norm in (("ln_1", block.attn_norm), ("ln_2", block.mlp_norm)):
            state[p + name + ".weight"], state[p + name + ".bias"] = norm.weight, bias(norm)
    return config, state


def ember_remote(model: Transformer, special: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """ember's own parameter names under `model.`, the output layer as its own tensor."""
    m = model.cfg
    fields = ("hidden", "layers", "heads", "kv_heads", "mlp_hidden", "max_seq_len", "objective", "activation", "norm",
              "positions", "bias", "norm_eps", "rope_theta")
    config = {
        "architectures": ["EmberForMaskedLM"], "model_type": "ember", "vocab_size": m.padded_vocab,
        **{k: getattr(m, k) for k in fields}, "dropout": 0.0, "initializer_range": m.init_std,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "auto_map": {"AutoConfig": "modeling_ember.EmberConfig", "AutoModel": "modeling_ember.EmberModel",
                     "AutoModelForMaskedLM": "modeling_ember.EmberForMaskedLM",
                     "AutoModelForSequenceClassification": "modeling_ember.EmberForSequenceClassification"},
        **_special_ids(special),
    }
    state = {f"model.{k}": v for k, v in model.state_dict().items() if not k.startswith("head.")}
    state["head.weight"] = model.head.weight
    return config, state


MAPPINGS = {"LlamaForCausalLM": llama, "GPT2LMHeadModel": gpt2, "EmberForMaskedLM": ember_remote}


def export_hf(checkpoint: str | Path, out: str | Path, tokenizer: str | Path | None = None) -> dict:
    """Write the run as a transformers folder at `out`; return what was written."""
    run = open_run(checkpoint, tokenizer)
    architecture = choose_architecture(run.config.model)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder; choose another or delete it.")
    if out.resolve().is_relative_to(run.run_dir.resolve()):
        # A folder the run does not know would make `ember train --resume` refuse the run.
        raise ConfigError(f"--out {out} lies inside the run {run.run_dir}; export to a folder outside it.")
    model = run.build_model(dropout=0.0)
    config, state = MAPPINGS[architecture](model, run.special_tokens)
    config["ember"] = {"run_dir": str(run.run_dir), "weights": str(run.weights),
                       "tokenizer_vocab_size": run.tokenizer.get_vocab_size()}
    # Written beside the target under a fresh name (never a folder of the user's), flushed
    # and renamed, so a folder at `out` is always complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.mkdir()  # fails rather than reuse a folder that exists
    except OSError as err:  # named after --out: the temporary folder is ours, not the user's
        raise OSError(err.errno, err.strerror, str(out)) from None
    try:
        tensors = _write(tmp, architecture, config, state, run)
        publish_dir(tmp, out)  # flushed, then renamed over the empty folder checked above
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"architecture": architecture, "out": str(out), "parameters": sum(t.numel() for t in tensors.values()),
            "vocab_size": run.config.model.padded_vocab, "tokenizer_vocab_size": run.tokenizer.get_vocab_size()}


def _write(tmp: Path, architecture: str, config: dict, state: dict, run) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=2) + "\n")
    write_tokenizer(tmp, run.tokenizer_path, run.tokenizer, run.special_tokens, run.config.model.max_seq_len,
                    masked=architecture == "EmberForMaskedLM")
    if architecture == "EmberForMaskedLM":
        shutil.copyfile(REMOTE_CODE, tmp / "modeling_ember.py")
    return tensors
