"""RoPE for the target length: the model's own scaling kept as pretrained, or YaRN where it has none.

A RoPE model only knows the positions it was trained on. What `plan_rope` does, by the config's `rope_type` (of
the full-attention layers where RoPE is per layer type):

| rope_type | within the length it covers | beyond it |
|---|---|---|
| default (no scaling) | nothing | YaRN over the trained length |
| yarn | kept | its factor raised to cover the target (its recipe keys kept) |
| linear | kept | its factor raised to cover the target |
| llama3, longrope, dynamic | kept | refused, naming the choices: a shorter --seq-len, or `rope_scaling="yarn"` |

A pretrained long-context scaling (Llama 3.x's llama3, Phi-3's longrope) is never replaced by a fresh YaRN over
its pre-scaling length unless asked for with `rope_scaling="yarn"`: the model would train with a RoPE it was never
pretrained with. Covered length: yarn and linear `original_max_position_embeddings x factor`; the others
`max_position_embeddings` (llama3's factor is no length multiple: Llama 3.1 covers 131,072 with factor 8 over 8,192).

YaRN (https://arxiv.org/abs/2309.00071) interpolates the low-frequency rotary dimensions by `factor` and leaves
the high-frequency ones alone, so positions up to trained_length * factor land back in the known range. We only
write the transformers v5 config for it; transformers' own `_compute_yarn_parameters` computes the inverse
frequencies and the attention factor, so they are identical to a config written by hand the documented way:

    rope_parameters = {"rope_type": "yarn", "rope_theta": <model's theta>, "factor": f,
                       "original_max_position_embeddings": <trained length>}

Per-layer-type RoPE (Gemma 3: a local base for its sliding-window layers, a global one for its full layers): only
the full-attention layers' entry is planned. A sliding layer only ever sees keys within its window, so its
relative positions stay inside what it was trained on at any length.

Under sequence parallelism each rank computes RoPE from its own slice of positions. longrope and dynamic pick
their frequencies from the largest position a forward sees, so past their original length the ranks of one
sequence would rotate with different frequencies: `plan_rope(..., sp_size=)` refuses that.

max_position_embeddings is only ever raised (to the target, or to trained * factor when that is larger, since
transformers warns when max_position_embeddings / original_max_position_embeddings differs from `factor`).
"""

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

from ..shape import text_config

logger = logging.getLogger(__name__)

# Keys of an existing YaRN recipe that describe the model, not the length, so they carry over.
# `attention_factor` is derived from `factor` and is dropped so transformers recomputes it.
_YARN_RECIPE_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
# from_pretrained arguments that also locate the config.
_CONFIG_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only", "subfolder")
# Pretrained scalings with no well-defined longer form: kept within their range, refused beyond it.
_FIXED_TYPES = ("llama3", "longrope", "dynamic")
# Scalings whose frequencies depend on the largest position a forward sees (transformers' dynamic_rope_update).
_POSITION_DEPENDENT = ("longrope", "dynamic")
ROPE_SCALING_CHOICES = ("pretrained", "yarn")


@functools.lru_cache(maxsize=None)
def _log_once(level: int, message: str) -> None:
    logger.log(level, message)


def _per_layer_type(config) -> bool:
    params = getattr(text_config(config), "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in params.values())


def _rope_parameters(config) -> dict:
    config = text_config(config)
    params = getattr(config, "rope_parameters", None) or {}
    if _per_layer_type(config):
        if not isinstance(params.get("full_attention"), dict):
            raise ValueError(
                f"{type(config).__name__} has per-layer-type RoPE parameters ({sorted(params)}) but none for "
                "'full_attention', the layers YaRN rescales; edit config.rope_parameters by hand."
            )
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(
            f"{type(config).__name__} has no RoPE parameters (rope_parameters / rope_theta), so YaRN cannot "
            "rescale its positions. Use a RoPE model (Llama, Qwen3, ...) or train within its trained length."
        )
    return {**params, "rope_theta": theta}


def _original(config, params: dict) -> int | None:
    original = (params.get("original_max_position_embeddings")
                or getattr(text_config(config), "original_max_position_embeddings", None))
    return int(original) if original else None


def trained_length(config) -> int:
    """The sequence length the model was trained on before any RoPE scaling in its config."""
    params = _rope_parameters(config)
    if params.get("rope_type", "default") != "default":
        original = _original(config, params)
        if original:
            return original
    return int(text_config(config).max_position_embeddings)


def covered_length(config) -> int:
    """The longest sequence the model's RoPE covers as configured (its own scaling included; module docstring)."""
    params = _rope_parameters(config)
    kind, original = params.get("rope_type", "default"), _original(config, params)
    if kind in ("yarn", "linear") and original:
        return int(original * params.get("factor", 1.0))
    return int(text_config(config).max_position_embeddings)


@dataclass(frozen=True)
class RopePlan:
    """What `plan_rope` decided: action is 'none' (no scaling needed), 'kept' (the pretrained scaling covers the
    target), 'extended' (its own factor raised), 'yarn' (YaRN added to an unscaled model) or 'replaced' (a
    pretrained scaling replaced by YaRN, as asked); params / max_positions are what the config gets (None: as is)."""

    action: str
    summary: str  # one phrase for the start-up block
    params: dict | None = None
    max_positions: int | None = None

    def apply(self, config):
        """Write the plan into `config` (in place; a multimodal config's text_config) and return it."""
        if self.params is not None:
            text, params = text_config(config), self.params
            if _per_layer_type(text):
                params = {**text.rope_parameters, "full_attention": params}
            text.rope_parameters = params
            text.max_position_embeddings = max(int(text.max_position_embeddings), self.max_positions)
        return config


def _yarn(params: dict, trained: int, factor: float) -> dict:
    yarn = {"rope_type": "yarn", "rope_theta": params["rope_theta"], "factor": factor,
            "original_max_position_embeddings": trained}
    # The rotary dims (Qwen3.5, Qwen3-Next: a quarter of each head) and Qwen3.5's multimodal sections stay the model's.
    yarn.update({key: params[key] for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
                 if key in params})
    if params.get("rope_type") == "yarn":
        yarn.update({key: params[key] for key in _YARN_RECIPE_KEYS if key in params})
    return yarn


def _check_factor(factor, trained: int, target_length: int) -> None:
    if factor <= 1.0:
        raise ValueError(f"factor must be > 1 (the length multiple over {trained} tokens), got {factor}.")
    if factor * trained < target_length:
        _log_once(logging.WARNING, f"factor={factor} covers {int(trained * factor)} tokens but the target is "
                                   f"{target_length}; positions past that are extrapolated. factor="
                                   f"{target_length / trained:g} would cover the target.")


def plan_rope(config, target_length: int, factor: float | None = None, *, rope_scaling: str = "pretrained",
              sp_size: int = 1) -> RopePlan:
    """Decide the RoPE for `target_length` tokens (module docstring's table); ValueError with the choices where
    the model's own scaling cannot be extended, or would differ between the ranks of an SP group.

    factor: the scaling factor over the pre-scaling length instead of target_length / that length.
    rope_scaling: 'pretrained' keeps or extends the model's own scaling; 'yarn' replaces any with YaRN on purpose.
    """
    plan = _decide(config, target_length, factor, rope_scaling, sp_size)
    if _per_layer_type(config):  # Gemma 3: the sliding layers keep their local RoPE (module docstring)
        plan = dataclasses.replace(plan, summary=plan.summary + " on the full-attention layers")
    _log_once(logging.INFO, f"RoPE for {target_length:,} tokens: {plan.summary}.")
    return plan


def _decide(config, target_length, factor, rope_scaling, sp_size) -> RopePlan:
    if not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length must be a positive int (tokens), got {target_length!r}.")
    if rope_scaling not in ROPE_SCALING_CHOICES:
        raise ValueError(f"rope_scaling must be one of {ROPE_SCALING_CHOICES}, got {rope_scaling!r}.")
    params = _rope_parameters(config)
    kind, trained, covered = params.get("rope_type", "default"), trained_length(config), covered_length(config)
    if rope_scaling == "yarn" and kind != "default":
        factor = float(factor or target_length / trained)
        _check_factor(factor, trained, target_length)
        return RopePlan("replaced", f"YaRN factor {factor:g} over {trained:,} tokens, replacing the pretrained "
                        f"{kind} scaling (rope_scaling='yarn')", _yarn({**params, "rope_type": "default"}, trained,
                        factor), max(target_length, math.ceil(trained * factor)))
    if kind == "default":
        if factor is None and target_length <= trained:
            return RopePlan("none", f"no RoPE scaling (within the trained length {trained:,})")
        factor = float(factor or target_length / trained)
        _check_factor(factor, trained, target_length)
        return RopePlan("yarn", f"YaRN factor {factor:g} over the trained length {trained:,}",
                        _yarn(params, trained, factor), max(target_length, math.ceil(trained * factor)))
    if kind in _FIXED_TYPES:
        if factor is not None:
            raise ValueError(f"A {kind} RoPE has no YaRN factor: --yarn-factor / factor={factor} would replace the "
                             f"model's pretrained scaling. Drop it, or ask for the replacement with --rope-scaling yarn "
                             f"(rope_scaling='yarn').")
        if target_length > covered:
            raise ValueError(
                f"{target_length:,} tokens are beyond the {covered:,} that this model's pretrained {kind} RoPE covers, "
                f"and {kind} has no well-defined longer form. Choices: --seq-len {covered} or less (the model as "
                f"pretrained), or --rope-scaling yarn (rope_scaling='yarn'): YaRN over its pre-scaling "
                f"{trained:,} tokens, a RoPE it was not pretrained with.")
        if kind in _POSITION_DEPENDENT and sp_size > 1 and target_length > trained:
            raise ValueError(
                f"{kind} RoPE picks its frequencies from the largest position each forward sees, so past {trained:,} "
                f"tokens the {sp_size} ranks of one sequence (each with its own slice of positions) would rotate with "
                f"different frequencies. Choices: sp_size 1, --seq-len {trained} or less, or --rope-scaling yarn.")
        return RopePlan("kept", f"the pretrained {kind} RoPE kept (it covers {covered:,} tokens)")
    if kind not in ("yarn", "linear"):
        raise ValueError(f"Unknown rope_type {kind!r}: ulysses_lc keeps default, yarn, linear, llama3, longrope and "
                         f"dynamic RoPE as pretrained. Train within {covered:,} tokens or --rope-scaling yarn.")
    if factor is None and target_length <= covered:
        return RopePlan("kept", f"the pretrained {kind} RoPE kept (factor {params.get('factor', 1.0):g}, it covers "
                        f"{covered:,} tokens)")
    base = _original(config, params) or covered / params.get("factor", 1.0)
    new_factor = float(factor or params.get("factor", 1.0) * target_length / covered)
    _check_factor(new_factor, base, target_length)
    extended = {**params, "factor": new_factor} if kind == "linear" else _yarn(params, trained, new_factor)
    return RopePlan("extended", f"the pretrained {kind} RoPE extended: factor {params.get('factor', 1.0):g} -> "
                    f"{new_factor:g} to cover {target_length:,} tokens", extended,
                    max(target_length, math.ceil(base * new_factor)))


def yarn_rope_parameters(config, target_length: int, factor: float | None = None, *,
                         rope_scaling: str = "pretrained") -> dict | None:
    """The v5 `rope_parameters` dict `apply_yarn` would set for `target_length` (the full-attention layers' where
    RoPE is per layer type), or None when the config stays as it is."""
    return plan_rope(config, target_length, factor, rope_scaling=rope_scaling).params


def apply_yarn(config, target_length: int, factor: float | None = None, *, rope_scaling: str = "pretrained",
               sp_size: int = 1):
    """Plan the RoPE for `target_length` (`plan_rope`) and write it into `config` in place; returns the config."""
    return plan_rope(config, target_length, factor, rope_scaling=rope_scaling, sp_size=sp_size).apply(config)


def describe_rope_scaling(config) -> str:
    """One phrase for a log: the config's RoPE scaling (the full-attention layers' where it is per layer type)."""
    params, where = getattr(text_config(config), "rope_parameters", None) or {}, ""
    if _per_layer_type(config):
        params, where = params.get("full_attention") or {}, " on the full-attention layers"
    kind = params.get("rope_type", "default")
    if kind == "yarn":
        return f"YaRN factor {params['factor']:g}{where}"
    if kind == "default":
        return "no RoPE scaling (within the trained length)"
    return f"{kind} RoPE" + (f" factor {params['factor']:g}" if "factor" in params else "") + where


def load_model_for_length(name_or_path: str, target_length: int, factor: float | None = None, *,
                          rope_scaling: str = "pretrained", **from_pretrained_kwargs):
    """`from_pretrained` with its RoPE planned for `target_length` tokens (`plan_rope`): AutoModelForCausalLM's model,
    or for a multimodal checkpoint (Qwen3.5, Gemma 3 4B+) its own *ForConditionalGeneration, whose language model
    SequenceParallelCausalLM trains and whose `save_pretrained` writes the checkpoint's layout (composite.py).

    Extra keyword arguments go to from_pretrained (those that locate files also to AutoConfig);
    a `config=` argument is used as the base config instead of loading one. use_kernels defaults to False (hub kernels,
    on by default from transformers 5.25, replace layers the levers patch; SequenceParallelCausalLM resets them).
    """
    from transformers import AutoConfig

    from ..composite import model_class

    config = from_pretrained_kwargs.pop("config", None)
    if config is None:
        config_kwargs = {k: from_pretrained_kwargs[k] for k in _CONFIG_KWARGS if k in from_pretrained_kwargs}
        config = AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    apply_yarn(config, target_length, factor, rope_scaling=rope_scaling)
    from_pretrained_kwargs.setdefault("use_kernels", False)
    return model_class(config).from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)


__all__ = ["ROPE_SCALING_CHOICES", "RopePlan", "apply_yarn", "covered_length", "describe_rope_scaling",
           "load_model_for_length", "plan_rope", "trained_length", "yarn_rope_parameters"]
