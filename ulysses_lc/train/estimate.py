"""Sizing for the main job: the run's `sizing.Job`, the memory limits per rank, the predicted memory and step time,
and the refusal of a plan that does not fit (the dry run's and the run's alike).

  job_for        sizing.Job from the checked config (shape, parameters, ranks, DeepSpeed offload, kernel policy)
  limits_for     sizing.Limits: --gpu-memory-gb (default: this GPU's where this machine has the job's GPUs, else an
                 H200's) and --host-memory-gb (default: HOST_HEADROOM of this node's memory over its local ranks, or
                 a GPU node's share, said, where the dry run sizes GPUs this machine does not have)
  estimate_memory  the plan's prediction and, against limits, whether it fits (DoesNotFit when not: what is
                 over, by how much, and what would fit)
  run_limits, plan_reservations  the run's limits (all ranks alike) and what its plan_step reserves
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.distributed import local_world_size
from ..plan.memory import optimizer_reserved_bytes
from ..plan.first_step import first_step_extra_seconds
from ..plan.memory_model import HOST_HEADROOM
from ..shape import ModelShape
from ..plan.sizing import GB, Fit, Job, Limits, StepMemory
from .config import CheckFailed

DEFAULT_GPU_GB = 149.0  # an H200: 139.8 GiB usable as torch reports it (BENCHMARKS.md), what the benchmarks ran on
GPUS_PER_NODE = 8  # a dry run's local ranks when no launcher says (an 8-GPU node)
# Host memory per rank of a GPU node a dry run sizes from elsewhere: 9/10 of a DGX H200's 2 TB over its 8 GPUs
# (NVIDIA's DGX H200 datasheet: 2 TB system memory); this machine's own memory says nothing about that node.
GPU_NODE_HOST_GB = 225.0


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
    first_extra_s: float = 0.0  # what the first step adds: kernels not in the kernel cache (plan/first_step.py)

    def check(self) -> None:
        """DoesNotFit unless the plan fits its limits (nothing to check without them): what is over, by how much,
        and what would fit."""
        if self.fit is None or self.fit.fits:
            return
        raise DoesNotFit(self.fit.verdict(), self.job.alternatives(self.fit.seq_len, self.fit.limits))


def count_params(model_config) -> int:
    """Parameters of the model `model_config` builds, counted on the meta device (no memory, no weights)."""
    from ..composite import meta_model

    return sum(p.numel() for p in meta_model(model_config).parameters())


def job_for(run, checked, num_params: int, ranks_per_node: int = 1) -> Job:
    """The run's sizing.Job (run: settings.RunSettings): its shape, parameter count, ranks (ranks_per_node: those
    sharing one node's host memory and launcher), DeepSpeed offload and attention policy, and for DPO the reference
    copy's parameters (the model without its adapters; 0 for the adapters-off reference)."""
    reference = 0
    if run.objective.reference == "copy":
        reference = num_params - (checked.trainable_params or 0 if checked.peft_config is not None else 0)
    return Job.from_ds_config(ModelShape.from_config(checked.model_config), num_params, checked.world_size,
                              checked.sp_size, checked.ds_config, kernel=run.model.kernel,
                              head_groups=run.model.attention_head_groups, packed=run.stream.packed_documents,
                              trainable_params=checked.trainable_params, ranks_per_node=ranks_per_node,
                              reference_params=reference, preference=run.objective.dpo,
                              long_documents=run.stream.long_documents)


def sized_params(checked) -> int:
    """The parameters the plan is priced for, the dry run's and the run's alike: the model config's count (meta
    device), plus LoRA's adapters beside the frozen base."""
    num_params = count_params(checked.model_config)
    return num_params + (checked.trainable_params if checked.peft_config is not None else 0)


def local_ranks(world_size: int, gpus_per_node: int | None = None) -> int:
    """Ranks sharing one node's host memory: gpus_per_node (the dry run's --gpus-per-node; the run's count of
    ranks on its node), else the launcher's count (torchrun LOCAL_WORLD_SIZE, deepspeed LOCAL_SIZE, an srun
    step's), else a dry run's world size up to one 8-GPU node."""
    if gpus_per_node:
        return min(gpus_per_node, world_size)
    launched = local_world_size()
    return launched if launched else min(world_size, GPUS_PER_NODE)


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def limits_for(plan, world_size: int, gpu_bytes: float | None = None, ranks_here: int | None = None) -> tuple[Limits, str]:
    """(Limits per rank, a line saying where they come from), the dry run's and the run's alike (plan:
    settings.PlanSettings).

    GPU: --gpu-memory-gb, else `gpu_bytes` (the run's GPU total), else this machine's GPU where it has the node's
    GPUs, else an H200's. Host: --host-memory-gb, else HOST_HEADROOM of this node's memory over its ranks
    (ranks_here: the run's count on this node) where this machine is the node, else GPU_NODE_HOST_GB per rank, said:
    a dry run sizing GPUs this machine does not have (none, or fewer than a node's ranks) knows nothing of that
    node's memory."""
    import psutil

    ranks = ranks_here or local_ranks(world_size, plan.gpus_per_node)
    gpus_here = _gpus_here() >= ranks  # this machine has the node's GPUs
    here = ranks_here is not None or gpus_here  # this machine is the node
    if plan.gpu_memory_gb:
        gpu, gpu_src = plan.gpu_memory_gb * GB, "--gpu-memory-gb"
    elif gpu_bytes is not None or gpus_here:
        import torch

        gpu = gpu_bytes if gpu_bytes is not None else torch.cuda.get_device_properties(0).total_memory
        gpu_src = "this GPU; --gpu-memory-gb"
    else:
        gpu, gpu_src = DEFAULT_GPU_GB * GB, "an H200's; --gpu-memory-gb"
    if plan.host_memory_gb:
        host, host_src = plan.host_memory_gb * GB, "--host-memory-gb"
    elif here:
        total = psutil.virtual_memory().total
        host = HOST_HEADROOM * total / ranks
        host_src = (f"{HOST_HEADROOM:.0%} of this machine's {total / GB:.0f} GB over {ranks} local rank"
                    f"{'s' if ranks > 1 else ''}; --host-memory-gb")
    else:
        host = GPU_NODE_HOST_GB * GB
        gpus = _gpus_here()
        host_src = (f"a GPU node's default, 9/10 of 2 TB over 8 GPUs: this machine has {gpus or 'no'} GPU"
                    f"{'s' if gpus != 1 else ''} for {ranks} ranks per node, so its own memory says nothing of that "
                    "node's; --host-memory-gb sets the node's share per rank")
    return Limits(gpu, host), (f"{gpu / GB:.0f} GB per GPU ({gpu_src}), {host / GB:.0f} GB host per rank "
                               f"({host_src})")


def estimate_memory(run, checked, plan, num_params: int, limits: Limits | None = None,
                    ranks_per_node: int = 1, uncached: tuple[str, ...] = ()) -> MemoryEstimate:
    """The plan's predicted memory per rank and step time, and against `limits` (when given) whether it fits.
    uncached: the kinds of kernel the first step tunes or compiles for want of them in the kernel cache."""
    job = job_for(run, checked, num_params, ranks_per_node)
    seq_len = run.stream.seq_len
    memory = job.predict(seq_len, plan)
    fit = Fit(seq_len, plan, memory, limits) if limits is not None else None
    return MemoryEstimate(memory, job.step_seconds(seq_len, plan), fit, job, first_step_extra_seconds(uncached))


def node_beside_bytes() -> int:
    """Host bytes this node holds beside the job (the OS, other users), at the job's start: the node's used memory less
    the launcher's process tree (its ranks included), which the plan counts itself."""
    import psutil

    me = psutil.Process()
    launcher = me.parent() or me
    job = 0
    for proc in [launcher, *launcher.children(recursive=True)]:
        try:
            job += proc.memory_info().rss
        except psutil.Error:  # a process may exit between listing and reading
            pass
    return max(psutil.virtual_memory().used - job, 0)


def node_line(estimate: MemoryEstimate, ranks: int, beside: int | None = None) -> str:
    """The job's predicted host memory on one node: its ranks and launcher, and (the run) what the node held beside
    the job at its start; what the step line's "node" figure is measured against."""
    m = estimate.memory
    text = (f"{m.node_host / GB:.1f} GB host predicted per node ({ranks} rank{'s' if ranks > 1 else ''} x "
            f"{m.host / GB:.1f} GB; the launcher and the kernel's share for pinned pages, "
            f"{m.node_host_share * ranks / GB:.1f} GB, counted)")
    if beside is None:
        return text
    return (f"{(m.node_host + beside) / GB:.1f} GB host predicted on this node: {text[:text.index(' GB')]} for the job "
            f"{text[text.index('('):]} + {beside / GB:.1f} GB in use beside it at the start")


def check_node_memory(estimate: MemoryEstimate, ranks: int, beside: int) -> None:
    """ValueError naming --host-memory-gb when the job's predicted host memory on this node and what the node held
    beside it at the start exceed the node's memory."""
    import psutil

    total = psutil.virtual_memory().total
    need = estimate.memory.node_host + beside
    if need <= total:
        return
    share = (total - beside) / ranks
    raise ValueError(f"host memory: this node has {total / GB:.1f} GB, and the plan's {estimate.memory.node_host / GB:.1f} "
                     f"GB for {ranks} rank{'s' if ranks > 1 else ''} and the launcher, with {beside / GB:.1f} GB in use "
                     f"beside the job, need {need / GB:.1f}: pass --host-memory-gb {share / GB:.0f} or less (what this "
                     "node leaves each rank), or free host memory.")


def plan_reservations(job: Job, limits: Limits) -> dict:
    """The run's SequenceParallelCausalLM.plan_step keywords: AdamW's moments, due at the first step (on the device
    unless the optimizer is offloaded), and the dry run's budget for these limits, so the run plans no larger."""
    trainable = job.num_params if job.trainable_params is None else job.trainable_params
    moments = 0 if job.offload_optimizer else optimizer_reserved_bytes(trainable, job.world_size)
    return {"reserved_bytes": moments, "budget": job.budget(limits)}


def run_limits(plan, checked, device, layout) -> tuple[Limits, str] | None:
    """The run's limits per rank, as its dry run would set them on this machine (`limits_for`: --gpu-memory-gb else
    this GPU's total, --host-memory-gb else the node's share), the smallest over all ranks so that every rank
    judges alike. Without CUDA only where --gpu-memory-gb is given (the plan then is a GPU's of that size; else
    None: every layer checkpointed, to exercise the paths). Collective."""
    import torch

    if device.type != "cuda" and not plan.gpu_memory_gb:
        return None
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if total is not None and plan.gpu_memory_gb and plan.gpu_memory_gb * GB > total:
        raise ValueError(f"--gpu-memory-gb {plan.gpu_memory_gb:g} is more than this GPU's {total / GB:.1f} GB; pass "
                         f"--gpu-memory-gb {total / GB:.0f} or less, or leave it out (the GPU's own).")
    limits, line = limits_for(plan, checked.world_size, gpu_bytes=total, ranks_here=layout.ranks_on_node())
    both = torch.tensor([limits.gpu_bytes, limits.host_bytes], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN, group=layout.world_group)
    return Limits(float(both[0]), float(both[1])), line


__all__ = ["DEFAULT_GPU_GB", "DoesNotFit", "MemoryEstimate", "count_params", "estimate_memory", "job_for",
           "limits_for", "local_ranks", "node_beside_bytes", "node_line", "check_node_memory", "plan_reservations",
           "run_limits", "sized_params"]
