"""Predicted memory per rank, from the model config alone: ZeRO-3 state plus the activation plan.

Two parts:
  memory.zero3_state_bytes   bf16 params, fp32 master, fp32 grads and Adam's two moments, partitioned over
                      all ranks (device or host as the DeepSpeed config offloads them); with LoRA the
                      frozen base weights only their bf16 copy;
  memory.plan_bytes   the activations, by the memory plan's own terms, for the plan it chose.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import attention_policy, plan_bytes, zero3_state_bytes
from ..shape import ModelShape


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: ZeRO-3 state and activations, on the device and on the host."""

    state_gpu: int
    state_host: int
    act_gpu: int
    act_host: int

    @property
    def gpu(self) -> int:
        return self.state_gpu + self.act_gpu

    @property
    def host(self) -> int:
        return self.state_host + self.act_host


def count_params(model_config) -> int:
    """Parameters of the model `model_config` builds, counted on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


def estimate_memory(cfg, checked, plan, num_params: int) -> MemoryEstimate:
    """Predicted bytes per rank for this run and plan (estimate.py)."""
    state_gpu, state_host = zero3_state_bytes(num_params, checked.world_size, checked.ds_config,
                                              trainable_params=checked.trainable_params)
    shape = ModelShape.from_config(checked.model_config)
    _, head_groups = attention_policy(shape, cfg.kernel, cfg.attention_head_groups, cfg.packing)
    act_gpu, act_host = plan_bytes(shape, cfg.seq_len, plan, sp_size=checked.sp_size, head_groups=head_groups)
    return MemoryEstimate(state_gpu, state_host, act_gpu, act_host)
