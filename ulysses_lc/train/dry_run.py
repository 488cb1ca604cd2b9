"""--dry-run: every check, the memory plan and the predicted memory per rank, from the model config alone.

Loads no weights, starts no process group and touches no GPU, so a user sizes a 1M-token run on a laptop
before renting the GPUs: `python examples/train_1m.py --dry-run --model Qwen/Qwen3-8B --world-size 8`.
"""

from __future__ import annotations

from ..distributed import world_size
from ..layout import ParallelLayout
from ..memory import attention_policy, plan_memory, zero3_state_bytes
from ..shape import ModelShape
from .config import TrainConfig
from .console import layout_line, startup_block
from .estimate import count_params, estimate_memory
from .preflight import preflight


def dry_run(cfg: TrainConfig) -> str:
    """Every check, the memory plan and the predicted GPU and host memory per rank, as text; loads no
    weights, starts no process group and touches no GPU. World size: cfg.world_size, else this launch's.
    Device memory: cfg.gpu_memory_gb per GPU (default an H200's); host memory is taken as no limit (this
    machine's is not the GPU machine's), so the plan is the one a GPU host with enough RAM gets."""
    checked = preflight(cfg, cfg.world_size or world_size())
    num_params = count_params(checked.model_config)
    if checked.peft_config is not None:
        num_params += checked.trainable_params  # the adapters, beside the frozen base
    gpu_bytes = (cfg.gpu_memory_gb or DEFAULT_GPU_GB) * 1e9
    state_gpu, _ = zero3_state_bytes(num_params, checked.world_size, checked.ds_config,
                                     trainable_params=checked.trainable_params)
    shape = ModelShape.from_config(checked.model_config)
    keep_attention, head_groups = attention_policy(shape, cfg.kernel, cfg.attention_head_groups, cfg.packing)
    plan = plan_memory(shape, cfg.seq_len, gpu_bytes - state_gpu - CONTEXT_BYTES, sp_size=checked.sp_size,
                       keep_attention=keep_attention, head_groups=head_groups)
    plan = plan.with_overrides(cfg.recompute_layers, cfg.keep_on_gpu, cfg.cache_attention_layers)
    layout = ParallelLayout(checked.world_size, checked.sp_size)
    block = startup_block(out=None, cfg=cfg, checked=checked, layout_line=layout_line(layout), num_params=num_params,
                          kernel=cfg.kernel, plan=plan, estimate=estimate_memory(cfg, checked, plan, num_params),
                          device="gpu")
    return (f"{block}\n  assumes   {gpu_bytes / 1e9:.0f} GB per GPU (--gpu-memory-gb), host memory not the limit; "
            "nothing was loaded")


DEFAULT_GPU_GB = 149.0  # an H200: 139 GiB usable as torch reports it (BENCHMARKS.md), what the benchmarks ran on
# CUDA context, NCCL buffers and the allocator's own blocks, which the planner does not see: an allowance.
CONTEXT_BYTES = 2 * 10**9
