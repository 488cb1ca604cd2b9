"""Tiny models of each supported family, built from configs in code (no downloads), fp32."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

VOCAB = 97


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
    raise ValueError(family)


def build(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    return model.train()
