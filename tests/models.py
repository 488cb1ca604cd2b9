"""Tiny models of each supported family, built from configs in code (no downloads), fp32."""

import torch
from transformers import (
    AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config, Qwen3MoeConfig,
)

VOCAB = 97
# Sliding-window families (window_attention.py), all with a default window of WINDOW tokens: smaller than a shard
# of the tests' sequences at sp 2, overridable with sliding_window=...
WINDOW_FAMILIES = ("mistral", "gemma3", "gpt_oss")
WINDOW = 5


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    common.update(overrides)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
            mlp_only_layers=[], **common,
        )
    window = dict(sliding_window=common.pop("sliding_window", WINDOW))
    if family == "qwen3_sliding":  # use_sliding_window: layer 0 full, layer 1 windowed (max_window_layers)
        return Qwen3Config(use_sliding_window=True, max_window_layers=1, **window, **common)
    if family == "mistral":
        return MistralConfig(**window, **common)
    if family == "gemma3":  # mixed local / global layers, final logit soft-capping, Gemma's own scalings
        common.setdefault("layer_types", ["sliding_attention", "full_attention"])
        return Gemma3TextConfig(final_logit_softcapping=3.0, query_pre_attn_scalar=8, **window, **common)
    if family == "gpt_oss":  # sinks, sliding / full layers, MoE; transformers runs its sinks in eager only
        common.update(attn_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **window, **common)
    raise ValueError(family)


def build(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    return model.train()
