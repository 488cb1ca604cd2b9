"""YaRN position rescaling so a model can train on sequences longer than it was trained on.

A RoPE model only knows the positions it was trained on; YaRN (https://arxiv.org/abs/2309.00071)
interpolates the low-frequency rotary dimensions by `factor` (and leaves the high-frequency
ones alone), so positions up to trained_length * factor land back in the known range. We only
write the transformers v5 config for it; transformers' own `_compute_yarn_parameters` computes
the inverse frequencies and the attention factor, so they are identical to a config written by
hand the documented way:

    rope_parameters = {"rope_type": "yarn", "rope_theta": <model's theta>, "factor": f,
                       "original_max_position_embeddings": <trained length>}

Trained length: `max_position_embeddings` for an unscaled model; for a config that already
carries scaling (yarn, llama3, longrope, ...), its `original_max_position_embeddings`, since
max_position_embeddings is then already the scaled length.

Per-layer-type RoPE (Gemma 3: a local base for its sliding-window layers, a global one for its full layers):
only the full-attention layers' entry is rescaled. A sliding layer only ever sees keys within its window, so its
relative positions stay inside what it was trained on at any length. A global entry that is already "linear"
(Gemma 3's own long-context recipe) keeps that form with its factor raised to cover the target, as the family was
stretched, rather than being replaced by YaRN.

max_position_embeddings becomes the target length. transformers checks that
max_position_embeddings / original_max_position_embeddings equals `factor` and warns
otherwise, so with an explicit factor we raise it to trained * factor when that is larger.
"""

import functools
import logging
import math

logger = logging.getLogger(__name__)

# Keys of an existing YaRN recipe that describe the model, not the length, so they carry over.
# `attention_factor` is derived from `factor` and is dropped so transformers recomputes it.
_YARN_RECIPE_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
# from_pretrained arguments that also locate the config.
_CONFIG_KWARGS = ("revision", "trust_remote_code", "cache_dir", "token", "local_files_only", "subfolder")


@functools.lru_cache(maxsize=None)
def _log_once(level: int, message: str) -> None:
    logger.log(level, message)


def _per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in params.values())


def _rope_parameters(config) -> dict:
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


def trained_length(config) -> int:
    """The sequence length the model was trained on, before any RoPE scaling in its config."""
    params = _rope_parameters(config)
    if params.get("rope_type", "default") != "default":
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if original:
            return int(original)
    return int(config.max_position_embeddings)


def _plan(config, target_length: int, factor: float | None) -> tuple[dict, int] | None:
    if not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length must be a positive int (tokens), got {target_length!r}.")
    params = _rope_parameters(config)
    trained = trained_length(config)
    needed = target_length / trained
    if factor is None:
        if target_length <= trained:
            _log_once(
                logging.INFO,
                f"target length {target_length} is within the trained length {trained}; no RoPE scaling applied.",
            )
            return None
        factor = needed
    else:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1 (the length multiple over {trained} tokens), got {factor}.")
        if factor < needed:
            _log_once(
                logging.WARNING,
                f"factor={factor} covers {int(trained * factor)} tokens but the target is {target_length}; "
                f"positions past that are extrapolated. factor={needed:g} would cover the target.",
            )
    factor = float(factor)
    if _per_layer_type(config) and params.get("rope_type") == "linear":
        linear = {**params, "factor": params.get("factor", 1.0) * factor}
        return linear, max(target_length, math.ceil(trained * factor))
    yarn = {
        "rope_type": "yarn",
        "rope_theta": params["rope_theta"],
        "factor": factor,
        "original_max_position_embeddings": trained,
    }
    if "partial_rotary_factor" in params:
        yarn["partial_rotary_factor"] = params["partial_rotary_factor"]
    if params.get("rope_type") == "yarn":
        yarn.update({key: params[key] for key in _YARN_RECIPE_KEYS if key in params})
    max_positions = max(target_length, math.ceil(trained * factor))
    return yarn, max_positions


def yarn_rope_parameters(config, target_length: int, factor: float | None = None) -> dict | None:
    """The v5 `rope_parameters` dict for YaRN up to `target_length`, or None when no scaling is needed.

    factor: overrides target_length / trained_length (which is not rounded, so it always covers the target).
    """
    plan = _plan(config, target_length, factor)
    return None if plan is None else plan[0]


def apply_yarn(config, target_length: int, factor: float | None = None):
    """Set YaRN `rope_parameters` and `max_position_embeddings` on `config` (in place) and return it; with
    per-layer-type parameters, those of the full-attention layers (module docstring)."""
    plan = _plan(config, target_length, factor)
    if plan is not None:
        params, config.max_position_embeddings = plan
        if _per_layer_type(config):
            params = {**config.rope_parameters, "full_attention": params}
        config.rope_parameters = params
    return config


def describe_rope_scaling(config) -> str:
    """One phrase for a log: the config's RoPE scaling (the full-attention layers' where it is per layer type)."""
    params, where = getattr(config, "rope_parameters", None) or {}, ""
    if _per_layer_type(config):
        params, where = params.get("full_attention") or {}, " on the full-attention layers"
    if params.get("rope_type") == "yarn":
        return f"YaRN factor {params['factor']:g}{where}"
    if params.get("rope_type") == "linear":
        return f"linear RoPE factor {params['factor']:g}{where}"
    return "no YaRN (within the trained length)"


def load_model_for_length(name_or_path: str, target_length: int, factor: float | None = None, **from_pretrained_kwargs):
    """`AutoModelForCausalLM.from_pretrained` with YaRN configured for `target_length` tokens.

    Extra keyword arguments go to from_pretrained (those that locate files also to AutoConfig);
    a `config=` argument is used as the base config instead of loading one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = from_pretrained_kwargs.pop("config", None)
    if config is None:
        config_kwargs = {k: from_pretrained_kwargs[k] for k in _CONFIG_KWARGS if k in from_pretrained_kwargs}
        config = AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    apply_yarn(config, target_length, factor)
    return AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)


__all__ = ["apply_yarn", "describe_rope_scaling", "load_model_for_length", "trained_length", "yarn_rope_parameters"]
