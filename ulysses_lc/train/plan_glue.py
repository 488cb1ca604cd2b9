"""Glue between the run and the activation-memory planner (offload.plan_activation_memory).

Kept apart on purpose: the planner is being replaced by one memory-plan module, and this file is the only
place the training path talks to it.
"""

from __future__ import annotations

import os

import torch

from ..attention import keeps_attention_outputs
from ..layers import text_config
from ..layout import ParallelLayout
from ..offload import MemoryPlan, plan_activation_memory


def can_keep_attention(cfg, model_config) -> bool:
    """Kept attention outputs need an SDPA kernel (attention.kept_output_attention) and no attention dropout."""
    dropout = getattr(text_config(model_config), "attention_dropout", 0.0) or 0.0
    return keeps_attention_outputs(cfg.kernel) and dropout == 0.0


def plan_head_groups(cfg, model_config) -> int | str:
    """The head groups the plan may count on: the attention kernel runs over groups only where it is called
    explicitly, the same condition as kept outputs (an SDPA kernel, no attention dropout); else one call,
    whose whole backward block the plan must reserve."""
    return cfg.attention_head_groups if can_keep_attention(cfg, model_config) else 1


def memory_plan(cfg, model_config, seq_local: int, device: torch.device, num_params: int,
                layout: ParallelLayout) -> MemoryPlan:
    """(recompute_layers, keep_on_gpu, cache_attention_layers): flags win; otherwise
    offload.plan_activation_memory on the free device and host memory.

    Called after deepspeed.initialize; AdamW's two fp32 moments (8 bytes per parameter, partitioned over
    all ranks) are allocated at the first step, so they are subtracted here. Host memory is shared by the
    ranks of a node: each plans for its share of what is available. Every rank plans from the smallest
    free memory of any rank: ranks with different plans would deadlock in the recompute's collectives.
    Without CUDA: checkpoint and offload everything, attention outputs included (on a CPU that only
    exercises the paths).
    """
    if device.type != "cuda":
        return plan_from_free(cfg, model_config, seq_local, None, None, layout.sp_size)
    import psutil

    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    free = torch.tensor([torch.cuda.mem_get_info(device)[0], psutil.virtual_memory().available // local_ranks],
                        dtype=torch.int64, device=device)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN, group=layout.world_group)
    return plan_from_free(cfg, model_config, seq_local, int(free[0]) - 8 * num_params // layout.world_size,
                          int(free[1]), layout.sp_size)


def plan_from_free(cfg, model_config, seq_local: int, device_free: int | None, host_free: int | None,
                   sp_size: int) -> MemoryPlan:
    """The plan for `device_free` / `host_free` bytes per rank (None: no GPU, checkpoint and offload
    everything), with the flags' overrides. --dry-run calls this with predicted free memory."""
    layers = model_config.num_hidden_layers
    if device_free is None:
        plan = MemoryPlan(layers, 0, layers if can_keep_attention(cfg, model_config) else 0)
    else:
        plan = plan_activation_memory(model_config, seq_local, device_free, host_free_bytes=host_free,
                                      cache_attention=can_keep_attention(cfg, model_config),
                                      sp_size=sp_size, head_groups=plan_head_groups(cfg, model_config))
    recompute = cfg.recompute_layers if cfg.recompute_layers is not None else plan.recompute_layers
    keep = cfg.keep_on_gpu if cfg.keep_on_gpu is not None else min(plan.keep_on_gpu, recompute)
    cache = cfg.cache_attention_layers if cfg.cache_attention_layers is not None else plan.cache_attention_layers
    return MemoryPlan(recompute, keep, min(cache, recompute))
