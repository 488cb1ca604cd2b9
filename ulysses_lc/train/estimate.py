"""Sizing for the main job: the run's `sizing.Job`, the memory limits per rank, the predicted memory and step time,
and the refusal of a plan that does not fit (the dry run's and the run's alike).

  job_for        sizing.Job from the checked config (shape, parameters, ranks, DeepSpeed offload, kernel policy)
  limits_for     sizing.Limits: --gpu-memory-gb (dry run; the run: this GPU's) and --host-memory-gb (default:
                 HOST_SHARE of the node's memory over its local ranks)
  estimate_memory  the plan's prediction and, against limits, whether it fits (DoesNotFit when not: what is
                 over, by how much, and what would fit)
  run_limits, plan_reservations  the run's limits (all ranks alike) and what its plan_step reserves
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed import local_world_size
from ..memory import optimizer_reserved_bytes
from ..memory_model import HOST_HEADROOM
from ..shape import ModelShape
from ..sizing import GB, Fit, Job, Limits, StepMemory
from .preference_step import reference_kind
from .preflight import CheckFailed

DEFAULT_GPU_GB = 149.0  # an H200: 139.8 GiB usable as torch reports it (BENCHMARKS.md), what the benchmarks ran on
GPUS_PER_NODE = 8  # a dry run's local ranks when no launcher says (an 8-GPU node)


class DoesNotFit(CheckFailed):
    """The plan's predicted memory exceeds a limit; the message says which, by how much, and what would fit.
    report: what the dry run would have printed (its plan and prediction), or "" where it was printed already."""

    def __init__(self, verdict: str, would: list[str], report: str = ""):
        super().__init__(f"{verdict}. What would fit:" + "".join(f"\n  {w}" for w in would) if would
                         else f"{verdict}; nothing found that would fit.")
        self.report = report


@dataclass(frozen=True)
class MemoryEstimate:
    """The plan's predicted memory per rank and step time; `fit` against the limits where they are known."""

    memory: StepMemory
    step_s: float
    fit: Fit | None = None
    job: Job | None = None

    def check(self) -> None:
        """DoesNotFit unless the plan fits its limits (nothing to check without them): what is over, by how much,
        and what would fit."""
        if self.fit is None or self.fit.fits:
            return
        raise DoesNotFit(self.fit.verdict(), self.job.alternatives(self.fit.seq_len, self.fit.limits))


def count_params(model_config) -> int:
    """Parameters of the model `model_config` builds, counted on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


def job_for(cfg, checked, num_params: int) -> Job:
    """The run's sizing.Job: its shape, parameter count, ranks, DeepSpeed offload and attention policy, and for DPO
    the reference copy's parameters (the model without its adapters; 0 for the adapters-off reference)."""
    reference = 0
    if cfg.method == "dpo" and reference_kind(cfg) == "copy":
        reference = num_params - (checked.trainable_params or 0 if checked.peft_config is not None else 0)
    return Job.from_ds_config(ModelShape.from_config(checked.model_config), num_params, checked.world_size,
                              checked.sp_size, checked.ds_config, kernel=cfg.kernel,
                              head_groups=cfg.attention_head_groups, packed=cfg.packed_documents,
                              trainable_params=checked.trainable_params, reference_params=reference,
                              preference=cfg.method == "dpo")


def local_ranks(world_size: int, gpus_per_node: int | None = None) -> int:
    """Ranks sharing one node's host memory: gpus_per_node (the dry run's --gpus-per-node; the run's count of
    ranks on its node), else the launcher's count (torchrun LOCAL_WORLD_SIZE, deepspeed LOCAL_SIZE, an srun
    step's), else a dry run's world size up to one 8-GPU node."""
    if gpus_per_node:
        return min(gpus_per_node, world_size)
    launched = local_world_size()
    return launched if launched else min(world_size, GPUS_PER_NODE)


def limits_for(cfg, world_size: int, gpu_bytes: float | None = None, ranks_here: int | None = None) -> tuple[Limits, str]:
    """(Limits per rank, a line saying where they come from). gpu_bytes: the GPU's total (the run); the dry run's
    comes from --gpu-memory-gb. Host: --host-memory-gb, else HOST_HEADROOM of this node's memory over its ranks
    (ranks_here: the run's count on this node; the dry run's from --gpus-per-node or the launcher)."""
    import psutil

    gpu = gpu_bytes if gpu_bytes is not None else (cfg.gpu_memory_gb or DEFAULT_GPU_GB) * GB
    gpu_src = "this GPU" if gpu_bytes is not None else "--gpu-memory-gb"
    if cfg.host_memory_gb:
        host, host_src = cfg.host_memory_gb * GB, "--host-memory-gb"
    else:
        ranks = ranks_here or local_ranks(world_size, cfg.gpus_per_node)
        total = psutil.virtual_memory().total
        host = HOST_HEADROOM * total / ranks
        host_src = (f"{HOST_HEADROOM:.0%} of this machine's {total / GB:.0f} GB over {ranks} local rank"
                    f"{'s' if ranks > 1 else ''}; --host-memory-gb")
    return Limits(gpu, host), (f"{gpu / GB:.0f} GB per GPU ({gpu_src}), {host / GB:.0f} GB host per rank "
                               f"({host_src})")


def estimate_memory(cfg, checked, plan, num_params: int, limits: Limits | None = None) -> MemoryEstimate:
    """The plan's predicted memory per rank and step time, and against `limits` (when given) whether it fits."""
    job = job_for(cfg, checked, num_params)
    memory = job.predict(cfg.seq_len, plan)
    fit = Fit(cfg.seq_len, plan, memory, limits) if limits is not None else None
    return MemoryEstimate(memory, job.step_seconds(cfg.seq_len, plan), fit, job)


def plan_reservations(job: Job, limits: Limits) -> dict:
    """The run's SequenceParallelCausalLM.plan_step keywords: AdamW's moments, due at the first step (on the device
    unless the optimizer is offloaded), and the dry run's budget for these limits, so the run plans no larger."""
    trainable = job.num_params if job.trainable_params is None else job.trainable_params
    moments = 0 if job.offload_optimizer else optimizer_reserved_bytes(trainable, job.world_size)
    return {"reserved_bytes": moments, "budget": job.budget(limits)}


def run_limits(cfg, checked, device, layout) -> tuple[Limits, str] | None:
    """The run's limits per rank (this GPU's memory, --host-memory-gb or the node's share), the smallest over all
    ranks so that every rank judges alike; None without CUDA. Collective on CUDA."""
    import torch

    if device.type != "cuda":
        return None
    limits, line = limits_for(cfg, checked.world_size, gpu_bytes=torch.cuda.mem_get_info(device)[1],
                              ranks_here=layout.ranks_on_node())
    both = torch.tensor([limits.gpu_bytes, limits.host_bytes], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN, group=layout.world_group)
    return Limits(float(both[0]), float(both[1])), line


__all__ = ["DEFAULT_GPU_GB", "DoesNotFit", "MemoryEstimate", "count_params", "estimate_memory", "job_for",
           "limits_for", "local_ranks", "plan_reservations", "run_limits"]
