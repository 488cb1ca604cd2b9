"""Where a transformers decoder keeps its layers: the lookup the levers share."""

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


def checkpointable_layers(model: nn.Module) -> nn.ModuleList:
    """decoder_layers, each a transformers GradientCheckpointingLayer (what install_checkpointing drives)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = decoder_layers(model, "install_checkpointing")
    if not all(isinstance(m, GradientCheckpointingLayer) for m in layers):
        raise ValueError(
            f"{type(model).__name__}'s layers are not transformers GradientCheckpointingLayer; "
            "install_checkpointing supports transformers v5 decoder models laid out like Llama/Qwen3."
        )
    return layers
