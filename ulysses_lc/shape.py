"""The model's shape, read once from its config, and the one shape legend of the package.

Legend (every module uses these letters; a tensor name ends in its layout, e.g. `q_bhsd`, `hidden_bse`):
    b        batch
    s        whole sequence length (all ranks of an SP group together); s_pad rounded up to a multiple of sp
    s_local  this rank's slice of the sequence (s_pad / sp)
    t        tokens as rows (batch and sequence flattened)
    c        rows of one chunk or tokens of one tile (loss, RMSNorm, MLP)
    e        hidden size (the residual stream's width)
    i        MLP intermediate width per token (MoE: experts per token x expert width)
    v        vocabulary
    h        query heads; h_kv key/value heads; h_local the heads one rank runs during attention
    d        head dim
    w        width of a normalised row (e, or d for the per-head q/k norms)
    g        head groups the attention kernel runs one after another
    w        a sliding window: the keys a query sees (window_attention.py)
"axis" is a process-group axis (sp, dp); "dim" is a tensor dimension.

`ModelShape` is what the levers, the memory plan and the FLOP count need to know of a model; each reads
it from here instead of from the config (multimodal configs nest the text model's, head_dim may be
implicit, MoE layers have their own width).
"""

from __future__ import annotations

from dataclasses import dataclass


def text_config(config):
    """The language model's config: multimodal configs nest it, text-only ones are it."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _is_moe_layer(cfg, layer: int) -> bool:
    # Qwen2/3-MoE rule: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th
    # layer, when the model has experts at all.
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0
    if experts <= 0 or layer in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer + 1) % step == 0


def layer_windows(cfg) -> tuple:
    """Per decoder layer, its sliding window w (keys a query sees) or None (full causal attention): layer_types
    where the config has them (Gemma 3, gpt-oss, Qwen3 with use_sliding_window), else every layer (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * cfg.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def window_pairs(seq: int, window: int | None) -> float:
    """(query, key) pairs one head computes over `seq` tokens: s^2 / 2 causal, s w - w^2 / 2 within a window
    (4 d FLOPs each in the forward: QK^T and PV)."""
    w = seq if window is None else min(window, seq)
    return seq * w - w * w / 2


def _dense_width(cfg) -> int:
    """i of a dense MLP; Qwen3.5-MoE has no dense layer (and no intermediate_size): its expert width."""
    return getattr(cfg, "intermediate_size", None) or cfg.moe_intermediate_size


GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule (fla's and transformers' torch path alike)


def _linear_layers(cfg) -> tuple:
    """Per decoder layer, whether it is a gated DeltaNet (`linear_attention`: Qwen3.5, Qwen3-Next)."""
    types = getattr(cfg, "layer_types", None) or ()
    return tuple(t == "linear_attention" for t in types) if "linear_attention" in types else ()


def _mixer_params(cfg, linear: bool, e: int, heads: int, kv_heads: int, d: int) -> int:
    """Matmul weights of one layer's token mixer. Attention: q and o, k and v (Qwen3.5 / Qwen3-Next's q_proj also
    writes the output gate: 2 h d wide). Gated DeltaNet: q, k, v, z, b, a in and out (its conv weight is no matmul)."""
    if linear:
        key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return e * (2 * key + 2 * value + 2 * cfg.linear_num_value_heads) + value * e
    gate = 1 if _linear_layers(cfg) else 0  # the hybrids' full-attention layers are gated
    return (2 + gate) * e * heads * d + 2 * e * kv_heads * d


def _mlp_params(cfg, layer: int, active: bool = False) -> int:
    """Weights an MLP holds (active: those it multiplies each token by): dense 3 e i (gate, up, down); MoE the
    router and every expert, or only the num_experts_per_tok active ones (+ a shared expert where there is one)."""
    e = cfg.hidden_size
    if not _is_moe_layer(cfg, layer):
        return 3 * e * _dense_width(cfg)
    experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size  # gpt-oss: intermediate_size
    used = cfg.num_experts_per_tok if active else experts
    return e * experts + used * 3 * e * width + 3 * e * shared


# Model types whose attention has no per-head q / k norm (their modeling files in transformers 5).
NO_QK_NORM = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "phi3", "gpt_oss", "gemma", "gemma2",
                        "smollm3"})


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory and FLOPs depend on."""

    layers: int
    hidden: int  # e
    intermediate: int  # i of a dense layer
    heads: int  # h
    kv_heads: int  # h_kv
    head_dim: int  # d
    vocab: int  # v
    tied_head: bool
    layer_matmul_params: int  # weights every token meets in the decoder layers (attention + MLP)
    attention_dropout: float = 0.0
    model_type: str = ""
    layer_params: int = 0  # weights of the largest decoder layer, every expert counted (what ZeRO-3 gathers at once)
    layer_windows: tuple = ()  # per layer: its sliding window or None (full); () for all full
    sinks: bool = False  # attention sinks: a learned logit per head in each softmax (gpt-oss)
    linear_layers: tuple = ()  # per layer: whether it is a gated DeltaNet; () for none
    linear_heads: tuple = (0, 0, 0, 0)  # the DeltaNet's key heads, value heads, key dim, value dim

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        cfg = text_config(config)
        e, heads = cfg.hidden_size, cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        d = getattr(cfg, "head_dim", None) or e // heads
        linear = _linear_layers(cfg)
        mixer = [_mixer_params(cfg, bool(linear and linear[n]), e, heads, kv_heads, d)
                 for n in range(cfg.num_hidden_layers)]
        layer_params = sum(mixer[n] + _mlp_params(cfg, n, active=True) for n in range(cfg.num_hidden_layers))
        largest_layer = max(mixer[n] + _mlp_params(cfg, n) for n in range(cfg.num_hidden_layers))
        return cls(
            layers=cfg.num_hidden_layers, hidden=e, intermediate=_dense_width(cfg), heads=heads,
            kv_heads=kv_heads, head_dim=d, vocab=getattr(cfg, "vocab_size", 0) or 0,
            tied_head=bool(getattr(config, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))),
            layer_matmul_params=layer_params, attention_dropout=getattr(cfg, "attention_dropout", 0.0) or 0.0,
            model_type=getattr(cfg, "model_type", "") or "", layer_params=largest_layer,
            layer_windows=layer_windows(cfg) if any(layer_windows(cfg)) else (),
            sinks=getattr(cfg, "model_type", "") == "gpt_oss", linear_layers=linear,
            linear_heads=(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim) if linear else (0, 0, 0, 0),
        )

    @property
    def q_width(self) -> int:
        """h x d: one token's query (and attention output) width."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """h_kv x d: one token's key (or value) width."""
        return self.kv_heads * self.head_dim

    @property
    def largest_module_params(self) -> int:
        """Weights of the largest module ZeRO-3 gathers whole: the embedding (e x v) or one decoder layer."""
        return max(self.hidden * self.vocab, self.layer_params)

    @property
    def head_matmul_params(self) -> int:
        """The LM head's e x v weights (a matmul on every position, tied or not)."""
        return self.hidden * self.vocab

    def attention_pairs(self, seq: int) -> float:
        """(query, key) pairs of one head summed over the attention layers: a window costs s w, full attention
        s^2 / 2; a gated DeltaNet layer none (recurrence_flops)."""
        windows = self.layer_windows or (None,) * self.layers
        linear = self.linear_layers or (False,) * self.layers
        return sum(window_pairs(seq, w) for w, lin in zip(windows, linear) if not lin)

    def recurrence_flops(self, seq: int) -> float:
        """Forward FLOPs of the gated DeltaNet layers' recurrence over `seq` tokens (the chunked gated delta rule,
        O(s) per value head): per token and value head, reading and writing the dk x dv state (3 products: the
        state's read by q and by the keys' correction, the update) and the chunk's own c x c products (q k^T and
        k k^T over dk, the attention over dv), 2 FLOPs a multiply-add. The conv and the gates are O(s (dk + dv))."""
        _, hv, dk, dv = self.linear_heads
        per_token_head = 2 * (3 * dk * dv + GDN_CHUNK * (2 * dk + dv))
        return float(sum(self.linear_layers)) * seq * hv * per_token_head

    @property
    def qk_norm(self) -> bool:
        """Whether the attention normalises q and k per head before RoPE (Qwen3, Gemma 3, OLMo 2): that RMSNorm keeps
        q and k as they leave their projections for its backward. Families known to have none are listed; any
        other model type is counted with them (the larger working set)."""
        return self.model_type not in NO_QK_NORM

    def local_heads(self, sp_size: int) -> int:
        """h_local: query heads one rank runs during attention."""
        return self.heads // sp_size

    def local_kv_heads(self, sp_size: int) -> int:
        """Key/value heads one rank runs: h_kv / sp, or one replicated head when sp > h_kv."""
        return max(self.kv_heads, sp_size) // sp_size


__all__ = ["ModelShape", "layer_windows", "text_config", "window_pairs"]
