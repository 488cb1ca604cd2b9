"""AdamW's parameter groups: weight decay as Hugging Face's Trainer applies it (`Trainer.get_decay_parameter_names`).

No decay on biases and normalisation weights: a parameter is exempt when its name, lowercased, holds "bias",
"layernorm" or "rmsnorm" or a module called `norm` or `*_norm` (transformers 5.24's patterns), or when it sits in a
torch LayerNorm. Everything else that trains decays: embeddings, projections, and LoRA's A and B matrices, as under
the Trainer with a peft model (peft sets no groups of its own; an adapter's bias, a saved norm copy, are exempt by the
same names). The names are the paths under the module given; ulysses_lc's levers keep the norms' names (the bf16-saving
RMSNorm patches only the forward, the tiled MLP adds `.mlp.` to the MLP's), so the rule finds the plain model's norms.

The exempt group is marked (`NO_DECAY`) so that a resume with another --weight-decay changes the decayed group only.
"""

from __future__ import annotations

import torch.nn as nn

# transformers 5.24's Trainer.get_decay_parameter_names; tests/test_weight_decay.py holds the two equal.
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
NO_DECAY = "no_weight_decay"  # the key marking the exempt group


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names (as `model.named_parameters()` gives them) of the parameters weight decay applies to."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [nn.LayerNorm], list(NO_DECAY_PATTERNS)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups of `model`'s trainable parameters: the decayed ones at `weight_decay`, then the exempt ones at 0
    (marked NO_DECAY); an empty group is left out. Built before deepspeed.initialize, which hands the groups to the
    optimizer (a client torch AdamW, or the config's, DeepSpeed's CPU Adam under optimizer offload)."""
    decayed = decay_parameter_names(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if name in decayed], "weight_decay": weight_decay},
              {"params": [p for name, p in trainable if name not in decayed], "weight_decay": 0.0, NO_DECAY: True}]
    return [group for group in groups if group["params"]]


def set_weight_decay(optimizer, weight_decay: float) -> None:
    """`weight_decay` on every group of `optimizer` but the exempt ones (a resume's new --weight-decay)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0 if group.get(NO_DECAY) else weight_decay


__all__ = ["NO_DECAY", "NO_DECAY_PATTERNS", "decay_parameter_names", "param_groups", "set_weight_decay"]
