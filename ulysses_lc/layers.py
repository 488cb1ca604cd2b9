"""Where a transformers decoder keeps its layers and its text config: lookups the levers share."""

import torch.nn as nn


def decoder_layers(model: nn.Module, lever: str) -> nn.ModuleList:
    """`model.model.layers` of a Llama/Qwen3-style *ForCausalLM (or `model.layers` of its base model).

    lever: the caller's name, for the error message.
    """
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` ModuleList; {lever} supports decoder-only "
            "transformers models laid out like Llama/Qwen3 (model.model.layers[i])."
        )
    return layers


def text_config(config):
    """The language model's config: multimodal configs nest it, text-only ones are it."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
