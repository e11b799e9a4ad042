"""The same weights in ember and in Hugging Face's reference implementations give the same
logits: Llama (RMSNorm, SwiGLU, rotary, untied) and GPT-2 (LayerNorm with biases, GELU,
learned positions, tied). This pins the rotary layout, norms, MLP and attention scaling."""

import pytest
import torch

from ember.config import ModelConfig
from ember.model import Transformer

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=100, hidden=64, layers=2, heads=4, mlp_hidden=96, max_seq_len=32)


def _load(hf_model: torch.nn.Module, state: dict) -> None:
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    params = dict(hf_model.named_parameters())
    assert not unexpected and not [k for k in missing if k in params], (missing, unexpected)


def _compare(ours: Transformer, hf_model: torch.nn.Module) -> None:
    ids = torch.randint(0, 100, (2, 24))
    ours.eval(), hf_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(input_ids=ids).logits, atol=2e-5, rtol=1e-4)


def test_llama_style_matches_transformers_llama():
    torch.manual_seed(0)
    cfg = ModelConfig(objective="causal", activation="swiglu", norm="rmsnorm", positions="rotary",
                      bias=False, tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6, **SHAPE)
    ours = Transformer(cfg)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.padded_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_theta=500.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attn_implementation="eager"))
    state = {"model.embed_tokens.weight": ours.embed.weight, "model.norm.weight": ours.norm.weight,
             "lm_head.weight": ours.head.weight}
    for i, block in enumerate(ours.blocks.values()):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{name}.weight"] = getattr(block.attn, name).weight
        state[p + "mlp.gate_proj.weight"] = block.mlp.gate.weight
        state[p + "mlp.up_proj.weight"] = block.mlp.up.weight
        state[p + "mlp.down_proj.weight"] = block.mlp.down.weight
        state[p + "input_layernorm.weight"] = block.attn_norm.weight
        state[p + "post_attention_layernorm.weight"] = block.mlp_norm.weight
    _load(hf, {k: v.detach().clone() for k, v in state.items()})
    _compare(ours, hf)


def test_gpt2_style_matches_transformers_gpt2():
    torch.manual_seed(0)
    cfg = ModelConfig(objective="causal", activation="gelu", norm="layernorm", positions="learned",
                      bias=True, tie_embeddings=True, **SHAPE)
    ours = Transformer(cfg)
    with torch.no_grad():  # non-zero biases and gains, so that their placement is tested too
        for name, param in ours.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=cfg.padded_vocab, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=96,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=cfg.norm_eps, attn_implementation="eager"))
    state = {"transformer.wte.weight": ours.embed.weight, "transformer.wpe.weight": ours.pos_embed.weight,
             "transformer.ln_f.weight": ours.norm.weight, "transformer.ln_f.bias": ours.norm.bias}
    for i, block in enumerate(ours.blocks.values()):
        p, attn, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        # GPT-2's Conv1D stores weights as [in, out]; its c_attn fuses q, k, v.
        state[p + "attn.c_attn.weight"] = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).T
        state[p + "attn.c_attn.bias"] = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        state[p + "attn.c_proj.weight"], state[p + "attn.c_proj.bias"] = attn.o_proj.weight.T, attn.o_proj.bias
        state[p + "mlp.c_fc.weight"], state[p + "mlp.c_fc.bias"] = mlp.up.weight.T, mlp.up.bias
        state[p + "mlp.c_proj.weight"], state[p + "mlp.c_proj.bias"] = mlp.down.weight.T, mlp.down.bias
        state[p + "ln_1.weight"], state[p + "ln_1.bias"] = block.attn_norm.weight, block.attn_norm.bias
        state[p + "ln_2.weight"], state[p + "ln_2.bias"] = block.mlp_norm.weight, block.mlp_norm.bias
    _load(hf, {k: v.detach().clone().contiguous() for k, v in state.items()})
    _compare(ours, hf)
