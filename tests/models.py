"""Tiny models of each supported family, built from configs in code (no downloads), fp32."""

import torch
from transformers import (
    AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 97
# Sliding-window families (window_attention.py), all with a default window of WINDOW tokens: smaller than a shard
# of the tests' sequences at sp 2, overridable with sliding_window=...
WINDOW_FAMILIES = ("mistral", "gemma3", "gpt_oss")
WINDOW = 5
# Gated DeltaNet hybrids (linear_attention.py): a linear-attention layer, then a gated full-attention one.
LINEAR_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


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
    if family == "mixtral":  # Mixtral-style MoE without a window
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if family in LINEAR_FAMILIES:
        return linear_config(family, common)
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


def linear_config(family, common):
    """Two key heads (fewer than sp 4) for four value heads, a conv of width 4; partial rotary on the full layers.
    Imported here, not at the top: transformers 5.17 (the GPU image) may lack a family (see linear_attention)."""
    import transformers

    common = dict(dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4), **common)
    common.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    name = {"qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig", "qwen3_next": "Qwen3NextConfig"}
    config_class = getattr(transformers, name[family], None)
    if config_class is None:
        raise ValueError(f"transformers {transformers.__version__} has no {name[family]}; the {family} family needs "
                         "transformers 5.17 or later.")
    if family == "qwen3_5":
        return config_class(**common)
    if family == "qwen3_5_moe":
        common.pop("intermediate_size")
        return config_class(**moe, **common)
    return config_class(decoder_sparse_step=1, mlp_only_layers=[], **moe, **common)


def build(family: str, seed: int = 0, yarn_to: int | None = None, **overrides):
    """The tiny model of `family`, fp32, in train mode; yarn_to: its RoPE planned for that many tokens (yarn.py)."""
    config = tiny_config(family, **overrides)
    if yarn_to is not None:
        from ulysses_lc import apply_yarn

        apply_yarn(config, yarn_to)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in LINEAR_FAMILIES:
        # transformers draws the decay rates A from U(0.01, 16): a head with A ~ 16 forgets within a token, and its
        # A_log / dt_bias gradients (~1e-8) are fp32 rounding (2.6e-4 off float64's in the plain model itself).
        # Rates of 0.1 - 1 keep every head's state alive over the tiny sequences, so those gradients mean something.
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    a_log = layer.linear_attn.A_log
                    a_log.copy_(torch.linspace(0.1, 1.0, a_log.numel()).log())
    return model.train()


# Multimodal checkpoints as published (composite.py): a vision tower, a projector and a language model, the text
# settings under text_config. A few hundred weights of vision, so that "kept as loaded" is checked on real tensors.
COMPOSITE_FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma3")


def composite_config(family: str, vocab_size: int = VOCAB, **text_overrides):
    """The tiny *ForConditionalGeneration config of `family`: its text model tiny_config's (Gemma 3's sliding and
    global layers, Qwen3.5's DeltaNet and gated full layers with their multimodal RoPE sections)."""
    import transformers

    text = tiny_config("gemma3" if family == "gemma3" else family, vocab_size=vocab_size, **text_overrides)
    text = {k: v for k, v in text.to_dict().items() if k not in ("architectures", "transformers_version")}
    if family == "gemma3":
        # As published (Gemma 3 caps no logits): Gemma3ForConditionalGeneration's forward ignores the cap anyway.
        text["final_logit_softcapping"] = None
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         attn_implementation="sdpa")
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, num_position_embeddings=16)
    name = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig"}[family]
    return getattr(transformers, name)(text_config=text, vision_config=vision, attn_implementation="sdpa")


def build_composite(family: str, seed: int = 0, **text_overrides):
    """The tiny multimodal model of `family`, fp32, in train mode (its own *ForConditionalGeneration class)."""
    from transformers import AutoModelForImageTextToText

    config = composite_config(family, **text_overrides)
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).train()
