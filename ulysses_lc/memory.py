"""The memory plan: which decoder layers skip the recompute, keep their input on the device, or keep their
attention output, for one step of `seq_len` tokens in the memory there is.

It sits above the levers: each lever states its own bytes next to its own constants
(`checkpointing.checkpointed_input_bytes_per_token`, `attention.kept_output_bytes_per_token`,
`kernels.attention_backward_block_bytes`, `chunked_loss.loss_head_bytes`); this module adds what a decoder
layer's activations cost and chooses. One shape (`shape.ModelShape`), one function (`plan_memory`), one
named result (`MemoryPlan`), which `SequenceParallelCausalLM` takes (`plan=` or `use_plan`). Every driver
(main job, Trainer path, benchmarks) gets its plan from `SequenceParallelCausalLM.plan_step`, which calls
`plan_step_memory`: free device and host memory measured on every rank once ZeRO-3 has allocated its
partitions (before that it can only be guessed). The dry run plans from the config alone with the same
policy (`attention_policy`) and the same per-parameter state bytes (`zero3_state_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .checkpointing import checkpointed_input_bytes_per_token
from .attention import kept_output_bytes_per_token
from .chunked_loss import loss_head_bytes
from .explicit_attention import attention_backward_block_bytes, attention_head_groups, keeps_attention_outputs
from .layout import ParallelLayout
from .shape import ModelShape


@dataclass(frozen=True)
class MemoryPlan:
    """Per decoder layer, what it keeps for backward (CheckpointHandle.configure's settings).

    recompute_layers: the first this-many layers are checkpointed (recomputed in backward); later ones keep
        all their activations.
    keep_on_gpu: of the checkpointed layers, the last this-many keep their input on the device; the others
        offload it to host memory.
    cache_attention_layers: of the checkpointed layers, the last this-many keep their attention output, so
        their recompute skips the attention kernel.
    """

    recompute_layers: int
    keep_on_gpu: int
    cache_attention_layers: int

    @classmethod
    def everything_checkpointed(cls, layers: int, keep_attention: bool = False) -> "MemoryPlan":
        """Every layer checkpointed and offloaded: the least device memory (the default without a plan)."""
        return cls(layers, 0, layers if keep_attention else 0)

    @property
    def counts(self) -> tuple[int, int, int]:
        return self.recompute_layers, self.keep_on_gpu, self.cache_attention_layers

    def with_overrides(self, recompute_layers: int | None = None, keep_on_gpu: int | None = None,
                       cache_attention_layers: int | None = None) -> "MemoryPlan":
        """The user's settings win over the plan's; the others follow a smaller recompute count down."""
        recompute = self.recompute_layers if recompute_layers is None else recompute_layers
        keep = min(self.keep_on_gpu, recompute) if keep_on_gpu is None else keep_on_gpu
        cache = self.cache_attention_layers if cache_attention_layers is None else cache_attention_layers
        return replace(self, recompute_layers=recompute, keep_on_gpu=keep, cache_attention_layers=min(cache, recompute))

    def describe(self, layers: int, offload: bool = True) -> str:
        """One line for a log: what each layer keeps."""
        plain = layers - self.recompute_layers
        offloaded = self.recompute_layers - self.keep_on_gpu if offload else 0
        return (f"{plain} of {layers} layers keep all activations, {self.recompute_layers} checkpointed "
                f"({offloaded} inputs offloaded to host memory, {self.recompute_layers - offloaded} kept on the "
                f"device), {self.cache_attention_layers} keep their attention output")


# Decoder-layer activations under the levers, bf16 bytes per local token, with q = h x d and kv = h_kv x d:
#   a layer that keeps everything (no recompute): the inputs of the norms and projections, q/k/v and the
#   attention output, 2 (4e + 3q + 3kv) (26.6 KB on the Qwen3-0.6B shape; the main job at 128k measured ~26),
#   which the planner counts x PLAIN_LAYER_MARGIN;
#   one layer's recompute-and-backward working set: 2 (8e + 6q + 6kv), plus the attention backward's own block
#   (explicit_attention.py) over its head groups. On the Qwen3-0.6B shape at 256k: 57 KB/token by this formula, 45
#   KB/token measured (BENCHMARKS.md G).
PLAIN_LAYER_MARGIN = 1.25  # the planner's allowance for what the formula misses: a plain layer too many OOMs


def plain_layer_bytes_per_token(shape: ModelShape) -> int:
    return 2 * (4 * shape.hidden + 3 * shape.q_width + 3 * shape.kv_width)


def working_set_bytes_per_token(shape: ModelShape) -> int:
    return 2 * (8 * shape.hidden + 6 * shape.q_width + 6 * shape.kv_width)


def plan_memory(
    shape: ModelShape, seq_len: int, device_free_bytes: float, *, sp_size: int = 1,
    host_free_bytes: float | None = None, offload: bool = True, keep_attention: bool = True,
    head_groups: int | str = "auto", headroom: float = 0.8,
) -> MemoryPlan:
    """The fastest plan for a step of `seq_len` tokens (split over `sp_size` ranks) allowed
    `device_free_bytes` more device memory and `host_free_bytes` of host memory (None: not the limit).

    What each choice buys, per layer, at long context where attention is most of the step:
      - keeping its attention output: the recompute skips the attention forward (~0.22 of the layer's
        attention time: a causal forward is 1 of the 4.5 passes fwd + recompute + 2.5x bwd) for
        kept_output_bytes_per_token, in host memory when the layer is offloaded;
      - no recompute at all (plain): also skips the rest of the recompute, for all its activations.
    So: every checkpointed layer keeps its attention output when there is room for it (host memory for
    offloaded layers, the last layers first), then as many last layers as fit skip the recompute, then as
    many checkpointed inputs (with their outputs) as fit stay on the device; the rest are offloaded.
    Reserved first: one layer's working set, the loss head, and the previous layer's input and attention
    output, prefetched while a layer's backward runs. head_groups: the attention kernel's groups ("auto":
    kernels.attention_head_groups; 1 where the kernel is not ours to call). Only `headroom` of the free
    memory (device and host) is planned for (fragmentation, collectives' buffers, the rest of the process).
    """
    layers = shape.layers
    working, plain, kept, cached = _layer_bytes(shape, seq_len, sp_size, head_groups, keep_attention, offload)
    plain *= PLAIN_LAYER_MARGIN
    avail = device_free_bytes * headroom - working
    if not offload:
        # Every checkpointed input stays on the device. Attention outputs first (a tenth of a plain
        # layer's bytes for most of its time saved), then plain layers with what is left.
        per_ckpt = kept + cached
        if avail < layers * per_ckpt:
            n_cache = min(layers, int(max(avail - layers * kept, 0) // cached)) if cached else 0
            return MemoryPlan(layers, layers, n_cache)
        n_plain = min(layers, int((avail - layers * per_ckpt) // (plain - per_ckpt)))
        recompute = layers - n_plain
        return MemoryPlan(recompute, recompute, recompute if cached else 0)
    if avail <= 0:
        host = float("inf") if host_free_bytes is None else host_free_bytes * headroom - layers * kept
        n_cache = (layers if host == float("inf") else min(layers, int(max(host, 0) // cached))) if cached else 0
        return MemoryPlan(layers, 0, n_cache)
    n_plain = min(layers, int(avail // plain))
    avail -= n_plain * plain
    recompute = layers - n_plain
    keep = min(recompute, int(avail // (kept + cached)))
    n_cache = keep if cached else 0
    if cached:
        offloaded = recompute - keep
        if host_free_bytes is None:
            n_cache += offloaded
        else:
            # The offloaded inputs go to the host first: they are not optional.
            host = host_free_bytes * headroom - offloaded * kept
            n_cache += min(offloaded, int(max(host, 0) // cached))
    return MemoryPlan(recompute, keep, n_cache)


def _layer_bytes(shape: ModelShape, seq_len: int, sp_size: int, head_groups, keep_attention: bool, offload: bool):
    """Per rank: (one layer's working set with the loss head and the prefetched layer, a layer that keeps all
    its activations, a checkpointed input, a kept attention output)."""
    seq_local = -(-seq_len // sp_size)
    s_pad = seq_local * sp_size
    heads_local, kv_local = shape.local_heads(sp_size), shape.local_kv_heads(sp_size)
    groups = head_groups if head_groups != "auto" else attention_head_groups(s_pad, heads_local, kv_local,
                                                                             shape.head_dim)
    block = attention_backward_block_bytes(s_pad, heads_local, kv_local, shape.head_dim) / groups
    kept = seq_local * checkpointed_input_bytes_per_token(shape)
    cached = seq_local * kept_output_bytes_per_token(shape) if keep_attention else 0
    working = (seq_local * working_set_bytes_per_token(shape) + block + loss_head_bytes(shape, seq_local)
               + (kept + cached if offload else 0))
    return working, seq_local * plain_layer_bytes_per_token(shape), kept, cached


def plan_bytes(shape: ModelShape, seq_len: int, plan: MemoryPlan, *, sp_size: int = 1, head_groups: int | str = "auto",
               offload: bool = True) -> tuple[int, int]:
    """(device, host) bytes per rank of one step's activations under `plan`, by plan_memory's own terms without
    its margins (headroom, PLAIN_LAYER_MARGIN): what --dry-run predicts."""
    working, plain, kept, cached = _layer_bytes(shape, seq_len, sp_size, head_groups,
                                                plan.cache_attention_layers > 0, offload)
    on_device = plan.keep_on_gpu if offload else plan.recompute_layers
    cached_on_device = min(plan.cache_attention_layers, on_device)
    device = (working + (shape.layers - plan.recompute_layers) * plain + on_device * kept
              + cached_on_device * cached)
    host = (plan.recompute_layers - on_device) * kept + (plan.cache_attention_layers - cached_on_device) * cached
    return int(device), int(host)


# ZeRO-3's state per parameter: bf16 param (2) + fp32 master (4) + fp32 grad (4) + AdamW's two fp32 moments (8).
PARAM_BYTES, MASTER_AND_GRAD_BYTES, ADAM_MOMENT_BYTES = 2, 8, 8


def zero3_state_bytes(num_params: int, world_size: int, ds_config: dict,
                      trainable_params: int | None = None) -> tuple[int, int]:
    """(device, host) bytes per rank of ZeRO-3's partitioned state, all of it partitioned over `world_size`;
    offload_optimizer moves the fp32 master, grads and moments to the host, offload_param the bf16 params too.

    trainable_params: of the num_params, those that train (None: all). Frozen weights (a LoRA run's base) keep
    only their bf16 copy: ZeRO-3 gives parameters outside the optimizer no fp32 master, gradient or moments.
    """
    zero = ds_config.get("zero_optimization", {})
    per_rank = -(-num_params // world_size)
    trainable_per_rank = per_rank if trainable_params is None else -(-trainable_params // world_size)
    off_opt = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    off_param = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
    param, optim = PARAM_BYTES * per_rank, (MASTER_AND_GRAD_BYTES + ADAM_MOMENT_BYTES) * trainable_per_rank
    return (0 if off_param else param) + (0 if off_opt else optim), (param if off_param else 0) + (optim if off_opt else 0)


def optimizer_reserved_bytes(trainable_params: int, world_size: int) -> int:
    """What AdamW's moments will take per rank at the first step, not yet allocated when a run plans before it:
    8 bytes per trainable parameter, partitioned over all ranks."""
    return ADAM_MOMENT_BYTES * trainable_params // world_size


def attention_policy(shape: ModelShape, kernel: str, head_groups: int | str = "auto",
                     packed: bool = False) -> tuple[bool, int | str]:
    """(whether checkpointed layers may keep their attention output, the head groups the plan counts on): the
    one rule the plan, the dry run and the start-up estimate share.

    Kept outputs and head groups need a kernel we call ourselves (an SDPA one) and no dropout. Packed documents
    run their attention per document (kernels.document_attention): no kept outputs, so none are planned (their
    memory goes to layers that skip the recompute), and no head groups, so the kernel's backward block is
    reserved whole (the per-document and variable-length kernels hold at most that)."""
    ours = can_keep_attention(shape, kernel)
    return ours and not packed, head_groups if ours and not packed else 1


def can_keep_attention(shape: ModelShape, kernel: str) -> bool:
    """Kept attention outputs and head groups need a kernel we call ourselves (an SDPA one) and no dropout."""
    return keeps_attention_outputs(kernel) and shape.attention_dropout == 0.0


def measure_free_memory(device: torch.device, layout: ParallelLayout) -> tuple[int, int]:
    """(free device bytes, host bytes available to this rank), the smallest over all ranks: ranks that plan
    differently would deadlock in the recompute's collectives. Host memory is shared by the ranks of a node;
    each counts its share. Collective: every rank calls it."""
    import psutil

    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    # What the caching allocator holds but does not use is free for the step too (after a warm-up step,
    # most of it).
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free = torch.tensor([torch.cuda.mem_get_info(device)[0] + cached, psutil.virtual_memory().available // local_ranks],
                        dtype=torch.int64, device=device)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN, group=layout.world_group)
    return int(free[0]), int(free[1])


def plan_step_memory(
    shape: ModelShape, seq_len: int, layout: ParallelLayout, device: torch.device, *, kernel: str = "auto",
    head_groups: int | str = "auto", offload: bool = True, reserved_bytes: int = 0, packed: bool = False,
) -> MemoryPlan:
    """The plan for the next step from the memory free now on every rank, less `reserved_bytes` still to be
    allocated (`optimizer_reserved_bytes` before the first step). Collective on CUDA. Without CUDA: every layer
    checkpointed and offloaded, attention outputs kept where the kernel allows (on a CPU that only exercises
    the paths). packed: the steps train packed documents (`attention_policy`). Drivers call it through
    `SequenceParallelCausalLM.plan_step`, which passes the wrapper's own kernel, head groups and offload."""
    keep_attention, groups = attention_policy(shape, kernel, head_groups, packed)
    if device.type != "cuda":
        return MemoryPlan.everything_checkpointed(shape.layers, keep_attention)
    device_free, host_free = measure_free_memory(device, layout)
    return plan_memory(
        shape, seq_len, device_free - reserved_bytes, sp_size=layout.sp_size, host_free_bytes=host_free,
        offload=offload, keep_attention=keep_attention, head_groups=groups,
    )


__all__ = ["MemoryPlan", "attention_policy", "can_keep_attention", "measure_free_memory", "optimizer_reserved_bytes",
           "plan_bytes", "plan_memory", "plan_step_memory", "zero3_state_bytes"]
