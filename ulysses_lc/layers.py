"""Where a transformers decoder keeps its layers: the one lookup the per-layer levers share."""

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
