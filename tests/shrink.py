"""Published configs shrunk to a CPU test's size, keeping what makes each family what it is.

`shrink(config_dict)` keeps the layer types (one layer of each kind, in the published order: a sliding and a full
layer, a DeltaNet and a full one, a dense and an MoE layer), the RoPE type and its recipe (llama3, longrope, yarn,
partial rotary, multimodal sections), the ratio of query to key/value heads, the MoE layout (experts per token below
the expert count, shared experts) and the composite layout (a vision tower beside the language model); it divides the
widths down (hidden 32, heads of 8, a handful of experts), cuts to 2 layers and a vocabulary of VOCAB, and drops what
cannot build on a CPU without weights (quantization configs).
"""

import copy

VOCAB = 97
WINDOW = 5  # keys a sliding layer sees: fewer than a shard of the test's 48-token sequence at sp 2
HEAD_DIM, INTERMEDIATE, EXPERT_WIDTH = 8, 64, 16
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _pick_layer_types(types: list) -> list:
    """One layer of each kind, in the order the published model first has them (two alike where it has one kind)."""
    kinds = list(dict.fromkeys(types))
    return (kinds * 2)[:2]


def _shrink_rope(rope: dict | None, rotary_dim: int) -> dict | None:
    if not rope:
        return rope
    rope = dict(rope)
    pairs = rotary_dim // 2
    for key in ("long_factor", "short_factor"):  # longrope: one factor per rotary frequency
        if key in rope:
            rope[key] = rope[key][:: max(1, len(rope[key]) // pairs)][:pairs]
    if "mrope_section" in rope:  # the multimodal sections share the rotary frequencies out, in the same proportions
        total, sections = sum(rope["mrope_section"]), rope["mrope_section"]
        shrunk = [s * pairs // total for s in sections]
        shrunk[0] += pairs - sum(shrunk)
        rope["mrope_section"] = shrunk
    return rope


def _shrink_text(text: dict, layer_types: list) -> dict:
    text = {k: v for k, v in text.items() if k not in ("quantization_config", "auto_map", "_name_or_path")}
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads") or text["num_attention_heads"]
    kv_small = min(kv_heads, 2)
    heads_small = kv_small * (heads // kv_heads)
    # hidden = heads x head_dim: some families (Phi-3, Llama without head_dim) derive the head dim from it
    text.update(num_hidden_layers=2, hidden_size=heads_small * HEAD_DIM, num_attention_heads=heads_small,
                num_key_value_heads=kv_small, head_dim=HEAD_DIM, vocab_size=VOCAB)
    text.update({key: None for key in _TOKEN_IDS if key in text})
    if layer_types:
        text["layer_types"] = layer_types
    if "intermediate_size" in text:
        text["intermediate_size"] = INTERMEDIATE
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if text.get(key):
            text[key] = EXPERT_WIDTH
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if text.get(key):
            text[key] = 4
    if text.get("num_experts_per_tok"):
        text["num_experts_per_tok"] = 2
    if text.get("experts_per_token"):
        text["experts_per_token"] = 2
    if "n_group" in text:  # DeepSeek's grouped routing: 2 groups of 2 experts, the best group kept
        text.update(n_group=2, topk_group=1)
    if "first_k_dense_replace" in text:  # one dense layer, then MoE, as published
        text["first_k_dense_replace"] = 1
    if "kv_lora_rank" in text:  # MLA: low-rank query and key/value, the rotary part of each head apart
        text.update(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=HEAD_DIM,
                    v_head_dim=HEAD_DIM)
    if "linear_num_key_heads" in text:  # gated DeltaNet: value heads per key head kept
        ratio = text["linear_num_value_heads"] // text["linear_num_key_heads"]
        text.update(linear_num_key_heads=2, linear_num_value_heads=2 * ratio, linear_key_head_dim=HEAD_DIM,
                    linear_value_head_dim=HEAD_DIM)
    if text.get("sliding_window") is not None:
        text["sliding_window"] = WINDOW
    if "sliding_window_pattern" in text:
        text["sliding_window_pattern"] = 2
    rope_key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
    partial = (text.get(rope_key) or {}).get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    rotary_dim = int(HEAD_DIM * partial) if "kv_lora_rank" not in text else HEAD_DIM
    text[rope_key] = _shrink_rope(text.get(rope_key), rotary_dim)
    return text


def shrink(config: dict, layer_types: list | None = None) -> dict:
    """`config` (a config.json's dict) shrunk as the module docstring says; layer_types: the published model's, as
    its config class resolves them (from sliding_window_pattern or full_attention_interval where the file has none)."""
    config = copy.deepcopy(config)
    picked = _pick_layer_types(layer_types) if layer_types else None
    if "text_config" not in config:
        return _shrink_text(config, picked)
    config = {k: v for k, v in config.items() if k not in ("quantization_config",)}
    config["text_config"] = _shrink_text(config["text_config"], picked)
    vision = config.get("vision_config") or {}
    if "depth" in vision:  # Qwen3.5's vision tower
        vision.update(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=config["text_config"]["hidden_size"], patch_size=4,
                      num_position_embeddings=16, deepstack_visual_indexes=[])
    else:  # SigLIP (Gemma 3)
        vision.update(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)
        config["mm_tokens_per_image"] = 4
    config["vision_config"] = vision
    config.update({key: None for key in _TOKEN_IDS if key in config})
    return config
