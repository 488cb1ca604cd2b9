"""Predicted memory per rank, from the model config alone: ZeRO-3 state plus the activation plan.

Two separate parts so either can be re-pointed when the memory-plan module lands:
  zero3_state_bytes   bf16 params, fp32 master, fp32 grads and Adam's two moments, partitioned over all
                      ranks (device or host as the DeepSpeed config offloads them);
  activation_bytes    the terms of offload.plan_activation_memory (its docstring has the formulas),
                      counted for the plan it chose.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import text_config
from ..offload import MemoryPlan
from .plan_glue import plan_head_groups


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


def zero3_state_bytes(num_params: int, world_size: int, ds_config: dict) -> tuple[int, int]:
    """(device, host) bytes per rank of ZeRO-3's partitioned state: 2 (bf16 param) + 4 (fp32 master)
    + 4 (fp32 grad) + 8 (Adam moments) per parameter over `world_size`; offload_optimizer moves the fp32
    master, grads and moments to the host, offload_param the bf16 params too."""
    zero = ds_config.get("zero_optimization", {})
    per_rank = -(-num_params // world_size)
    off_opt = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    off_param = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
    param, optim = 2 * per_rank, 16 * per_rank
    return (0 if off_param else param) + (0 if off_opt else optim), (param if off_param else 0) + (optim if off_opt else 0)


def activation_bytes(model_config, seq_local: int, plan: MemoryPlan, *, sp_size: int, head_groups, cache_attention: bool
                     ) -> tuple[int, int]:
    """(device, host) bytes per rank of one step's activations under `plan` (plan_activation_memory's terms)."""
    from ..attention import attention_backward_block_bytes, attention_head_groups

    cfg = text_config(model_config)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    q, kv, layers = heads * head_dim, kv_heads * head_dim, cfg.num_hidden_layers
    heads_local, kv_local = heads // sp_size, max(kv_heads, sp_size) // sp_size
    groups = head_groups if head_groups != "auto" else attention_head_groups(seq_local * sp_size, heads_local, kv_local, head_dim)
    block = attention_backward_block_bytes(seq_local * sp_size, heads_local, kv_local, head_dim) / groups
    kept = seq_local * 2 * h
    cached = seq_local * (2 * q + 4 * heads) if cache_attention else 0
    loss = cfg.vocab_size * h * 4 + seq_local * 2 * h + (1 << 30)
    working = seq_local * 2 * (8 * h + 6 * q + 6 * kv) + block + loss + kept + cached
    plain = seq_local * 2 * (4 * h + 3 * q + 3 * kv) * 1.25
    n_plain = layers - plan.recompute_layers
    offloaded = plan.recompute_layers - plan.keep_on_gpu
    cached_on_gpu = min(plan.cache_attention_layers, plan.keep_on_gpu)
    gpu = working + n_plain * plain + plan.keep_on_gpu * kept + cached_on_gpu * cached
    host = offloaded * kept + (plan.cache_attention_layers - cached_on_gpu) * cached
    return int(gpu), int(host)


def estimate_memory(cfg, checked, plan, num_params: int) -> MemoryEstimate:
    """Predicted bytes per rank for this run and plan (estimate.py)."""
    state_gpu, state_host = zero3_state_bytes(num_params, checked.world_size, checked.ds_config)
    act_gpu, act_host = activation_bytes(
        checked.model_config, -(-cfg.seq_len // checked.sp_size), plan, sp_size=checked.sp_size,
        head_groups=plan_head_groups(cfg, checked.model_config), cache_attention=plan.cache_attention_layers > 0)
    return MemoryEstimate(state_gpu, state_host, act_gpu, act_host)
