"""PEFT models (LoRA and its variants, through the optional `peft` package) under every lever.

A `PeftModel` wraps the transformers model: `PeftModelForCausalLM.base_model` (a LoraModel, LoKrModel, ...) holds
the *ForCausalLM as `.model`, whose Linear layers peft replaced in place by adapter layers (each keeping the original
as `base_layer`). Every lever acts on that inner model (its decoder layers, MLPs, norms and LM head), found by
`causal_lm`; the PeftModel stays the model the wrapper holds, so its own `save_pretrained`, `disable_adapter` and
`merge_and_unload` keep working and its parameter names are the ones peft saves and loads.

Why this is exact: an adapter layer is a function of its own input, token by token, as the Linear it wraps is, so
tiling the MLP over the sequence, checkpointing a layer and splitting the sequence over SP ranks compute the same
numbers. The tiled MLP's backward replays the forward's RNG state (tiled_mlp.py), so an adapter's dropout draws the
same mask in the recompute as in the forward, as torch's checkpoint does for whole layers. Frozen weights take no
gradient, so ZeRO-3 gives them no fp32 master, gradient or optimizer moments (`memory.zero3_state_bytes`'s
`trainable_params`).

On a multimodal model (composite.py) the adapters go on its language model's modules only (`apply_peft`): its vision
tower has projections of the same names, which would train nothing and decay.

Refused, with the fix (`check_peft_model`): prompt-learning methods (prefix and prompt tuning, p-tuning) and
adaption prompts, which prepend virtual tokens or attention of their own that the sequence's slices do not hold;
and an adapter or a trainable copy on the LM head under the chunked loss, which multiplies the hidden states by the
head's weight directly, so the adapter would silently not be trained.
"""

from __future__ import annotations

import copy
import re

import torch.nn as nn

from .composite import is_composite, language_model, meta_model, model_class

# The projections of a decoder layer that `--lora-targets all` adapts: attention and MLP (Llama, Qwen3, ...), and the
# gated DeltaNet layer's own (Qwen3.5: in_proj_qkv / _z / _b / _a; Qwen3-Next: in_proj_qkvz / _ba; both: out_proj),
# which linear_attention.py calls as modules, so their adapters run. A model has only some of them.
ALL_LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                      "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")

_NEEDS_PEFT = "this needs the peft package: pip install 'ulysses_lc[peft]'"


def is_peft_model(model) -> bool:
    """Whether `model` is a peft PeftModel (checked without importing peft when it is not installed)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model: `model` itself, or the one under a PeftModel."""
    return model.get_base_model() if is_peft_model(model) else model


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM the levers act on: `model` itself, the one under a PeftModel, or the language
    model of a multimodal model (composite.language_model)."""
    return language_model(base_model(model))


def check_peft_model(model: nn.Module, chunked_loss: bool = True) -> None:
    """Raise ValueError, with the fix, for a PeftModel ulysses_lc cannot train exactly; a plain model passes."""
    if not is_peft_model(model):
        return
    for name, config in model.peft_config.items():
        kind = str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1]
        if getattr(config, "is_prompt_learning", False) or kind == "ADAPTION_PROMPT":
            raise ValueError(
                f"adapter {name!r} is {kind}, which prepends virtual tokens (or attention of its own) to the sequence; "
                "under sequence parallelism each rank holds a slice of the sequence, not its start. Use LoRA or a "
                "variant that adapts the layers' weights (LoRA, DoRA, LoHa, LoKr, IA3, ...).")
    head = causal_lm(model).get_output_embeddings()
    if chunked_loss and not isinstance(head, nn.Linear):
        raise ValueError(
            f"the LM head is a {type(head).__name__} (an adapter in target_modules, or lm_head in modules_to_save): "
            "the chunked loss multiplies the hidden states by the head's weight directly, so the adapter would not be "
            "trained. Leave 'lm_head' out of target_modules and modules_to_save, or pass chunked_loss=False.")


def lora_config(r: int, alpha: float | None = None, targets: str | list[str] = "all", dropout: float = 0.0):
    """A peft LoraConfig for a causal LM: rank `r`, scale alpha / r (alpha defaults to 2 r), adapters on `targets`
    (module names, comma-separated or a list; "all" = every attention and MLP projection)."""
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise ValueError(f"LoRA: {_NEEDS_PEFT} ({e}).") from e
    if isinstance(targets, str):
        targets = list(ALL_LINEAR_TARGETS) if targets == "all" else [t.strip() for t in targets.split(",") if t.strip()]
    if "lm_head" in targets:
        raise ValueError("--lora-targets lm_head: the chunked loss uses the head's weight directly, so an adapter there "
                         "would not be trained; leave lm_head out.")
    return LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=targets,
                      lora_dropout=dropout, bias="none", task_type="CAUSAL_LM")


def apply_peft(model: nn.Module, config) -> nn.Module:
    """`peft.get_peft_model(model, config)` with the adapters in the base model's dtype.

    ZeRO-3 gathers a module's parameters in one buffer of one dtype, so fp32 adapters beside bf16 weights fail at the
    first step (DeepSpeed issue 8072, TRL issue 6089); its fp32 master copy keeps the optimizer's precision anyway.
    Call it on every rank with the same seed (the adapters' initial values are drawn here), and under ZeRO-3 while
    transformers' HfDeepSpeedConfig is alive, so that peft gathers partitioned weights where an init reads them (DoRA).
    """
    try:
        from peft import get_peft_model
    except ImportError as e:
        raise ValueError(f"a peft config was given: {_NEEDS_PEFT} ({e}).") from e
    targets = getattr(config, "target_modules", None)
    if is_composite(model.config) and isinstance(targets, (list, set, tuple)):
        # A vision tower has q_proj / out_proj too (SigLIP): only the language model's modules get adapters.
        decoder = language_model(model).model
        prefix = next(name for name, module in model.named_modules() if module is decoder)
        config = copy.deepcopy(config)
        config.target_modules = rf"{re.escape(prefix)}\.(?:.*\.)?(?:{'|'.join(map(re.escape, sorted(targets)))})"
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def count_trainable_parameters(model_config, peft_config) -> tuple[int, int]:
    """(all, trainable) parameters of the model `model_config` builds with `peft_config` applied, counted on the meta
    device (no memory, no weights): what the dry run sizes ZeRO-3's state with."""
    import torch

    base = meta_model(model_config)
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)})
    targets = getattr(peft_config, "target_modules", None)
    named = isinstance(targets, (list, set, tuple)) and set(targets) != set(ALL_LINEAR_TARGETS)  # "all": those it has
    missing = sorted(set(targets) - set(linear)) if named else []
    if missing:
        raise ValueError(f"LoRA targets {missing} are not modules of {type(base).__name__}; its linear modules are "
                         f"{linear} (--lora-targets takes them comma-separated, or all).")
    with torch.device("meta"):
        model = apply_peft(base, peft_config)
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def merged_model(peft_model: nn.Module, state: dict) -> nn.Module:
    """A plain transformers model with the adapters of `state` (the PeftModel's own state-dict keys, full tensors on the
    host) merged into its weights: a fresh copy of the base on the host, the state loaded, `merge_and_unload`."""
    import torch

    dtype = next(iter(state.values())).dtype
    config = copy.deepcopy(base_model(peft_model).config)
    with torch.device("meta"):
        fresh = model_class(config).from_config(config, dtype=dtype)
    # Every weight comes from `state`; the non-persistent buffers (rotary frequencies) are not saved either way.
    adapted = apply_peft(fresh.to_empty(device="cpu"), copy.deepcopy(peft_model.peft_config["default"]))
    missing, unexpected = adapted.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"merging the adapters: the state does not match the model (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    return adapted.merge_and_unload()


__all__ = ["ALL_LINEAR_TARGETS", "apply_peft", "base_model", "causal_lm", "check_peft_model", "count_trainable_parameters",
           "is_peft_model", "lora_config", "merged_model"]
