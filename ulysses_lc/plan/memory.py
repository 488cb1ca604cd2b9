"""The memory plan: which decoder layers skip the recompute, keep their input on the device, or keep their
attention output, for one step of `seq_len` tokens in the memory there is.

It sits above the levers: each lever states its own bytes next to its own constants
(`checkpointing.checkpointed_input_bytes_per_token`, `attention.kept_output_bytes_per_token`,
`explicit_attention.head_group_block_bytes`, `chunked_loss.loss_head_bytes`); this module adds what a decoder
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

from ..levers.checkpointing import checkpointed_input_bytes_per_token
from ..mixers.attention import kept_output_bytes_per_token
from ..levers.chunked_loss import auto_chunk_rows, loss_head_bytes
from ..levers.tiled_mlp import auto_num_tiles
from ..mixers.explicit_attention import attention_head_groups, head_group_block_bytes, keeps_attention_outputs
from ..parallel.layout import ParallelLayout
from ..mixers.linear_attention import recurrence_block_bytes
from .memory_model import CONTEXT_BYTES, HOST_HEADROOM, StepTerms, allocator_slack, zero3_working_bytes
from ..shape import ModelShape
from ..mixers.window_attention import band_bytes_per_token


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


# Decoder-layer activations under the levers, bf16 bytes per local token, with q = h x d, kv = h_kv x d and kv' the
# keys' width after the exchange (h_kv_local x sp x d: kv, or more where sp > h_kv replicates them): the formulas
# the memory model (memory_model.py) scales by coefficients fitted to measured peaks.
#   A layer that keeps everything (no recompute): the inputs of the norms and projections, q/k/v and the attention
#   output, 2 (4e + 3q + 3kv) (26.6 KB on the Qwen3-0.6B shape; 27.7 KB measured).
#   One checkpointed layer's recompute and backward peaks at one of two moments, counted tensor by tensor:
#   - its attention backward: the layer input and its norm (x, nx: 2e), q, k, v and out after the exchange (2q + 2kv'),
#     the residual's gradient (e), dout, dq, dk, dv (2q + 2kv'), where the model norms q and k per head their inputs
#     (q + kv), and the kernel's own block (explicit_attention.py): 2 (3e + 4q + 4kv' [+ q + kv]);
#   - its MLP backward: x, nx, q, k, v, out, under SP the output projection's input (out exchanged back: at sp 1 the
#     kernel writes out in q's seq-major layout, and the projection's input is a view of it, as SP_PLAIN_FIT's extra
#     output under SP says), the MLP block's input and its norm (2e), the layer output's and the MLP input's
#     gradients (2e), and one tile's intermediates (six [c, i]: tiled_mlp.py):
#     2 (6e + 2q [+ q under SP] + 2kv' [+ q + kv]) + 12 i / tiles.
#   The first (18 units of 1024 on the Qwen3-0.6B shape, 36.9 KB) is the 36.7 KB a token measured beside the
#   block on one 0.6B layer at 256k and at 2M (BENCHMARKS.md G); the second binds where e and i are wide.


def plain_layer_bytes_per_token(shape: ModelShape) -> int:
    return 2 * (4 * shape.hidden + 3 * shape.q_width + 3 * shape.kv_width)


def _exchanged_kv_width(shape: ModelShape, sp_size: int) -> int:
    return shape.local_kv_heads(sp_size) * sp_size * shape.head_dim


def _qk_norm_width(shape: ModelShape) -> int:
    return shape.q_width + shape.kv_width if shape.qk_norm else 0


def working_set_bytes_per_token(shape: ModelShape, sp_size: int = 1) -> int:
    """One checkpointed layer's attention backward, beside the kernel's block (the note above)."""
    kv = _exchanged_kv_width(shape, sp_size)
    return 2 * (3 * shape.hidden + 4 * shape.q_width + 4 * kv + _qk_norm_width(shape))


def mlp_moment_bytes_per_token(shape: ModelShape, seq_local: int, sp_size: int = 1) -> float:
    """One checkpointed layer's MLP backward with its tiles at `seq_local` tokens (the note above)."""
    kv = _exchanged_kv_width(shape, sp_size)
    tiles = auto_num_tiles(seq_local, shape.hidden, shape.intermediate)
    q = (3 if sp_size > 1 else 2) * shape.q_width
    return 2 * (6 * shape.hidden + q + 2 * kv + _qk_norm_width(shape)) + 12 * shape.intermediate / tiles


def plan_memory(
    shape: ModelShape, seq_len: int, device_free_bytes: float, *, sp_size: int = 1,
    host_free_bytes: float | None = None, offload: bool = True, keep_attention: bool = True,
    head_groups: int | str = "auto", headroom: float | None = None, packed: bool = False,
    long_documents: bool = False, deltanet: str = "torch",
) -> MemoryPlan:
    """The fastest plan for a step of `seq_len` tokens (split over `sp_size` ranks) whose activations the memory
    model (memory_model.py) prices within `device_free_bytes` more device memory and `host_free_bytes` of host
    memory for offloaded tensors (None: not the limit).

    What each choice buys, per layer, at long context where attention is most of the step:
      - keeping its attention output: the recompute skips the attention forward (~0.22 of the layer's
        attention time: a causal forward is 1 of the 4.5 passes fwd + recompute + 2.5x bwd) for
        kept_output_bytes_per_token, in host memory when the layer is offloaded;
      - no recompute at all (plain): also skips the rest of the recompute, for all its activations.
    So: as many last layers as fit skip the recompute; of the checkpointed ones, as many inputs (with their
    outputs) as fit stay on the device, at least as many as the host cannot take; the offloaded ones keep their
    outputs in host memory where it has room. Without offload every checkpointed input stays on the device and
    the outputs come before plain layers (a tenth of a plain layer's bytes for most of its time saved).
    headroom: the share of `device_free_bytes` planned for (default: what the allocator's slack leaves,
    memory_model.allocator_slack). When nothing fits, the plan that needs the least device memory (sizing.Job.fit
    says by how much it is over).
    """
    terms = step_terms(shape, seq_len, sp_size=sp_size, head_groups=head_groups, keep_attention=keep_attention,
                       offload=offload, packed=packed, long_documents=long_documents, deltanet=deltanet)
    device = device_free_bytes * (1 / (1 + allocator_slack(shape, sp_size)) if headroom is None else headroom)
    return _choose(terms, device, float("inf") if host_free_bytes is None else host_free_bytes)


def _choose(terms: StepTerms, device: float, host: float) -> MemoryPlan:
    layers, cache_all = terms.layers, terms.cached > 0
    if not terms.offload:
        for plain in range(layers, -1, -1):
            recompute = layers - plain
            if terms.device_peak(recompute, recompute, recompute) <= device:
                return MemoryPlan(recompute, recompute, recompute if cache_all else 0)
        n_cache = max((c for c in range(layers + 1) if terms.device_peak(layers, layers, c) <= device), default=0)
        return MemoryPlan(layers, layers, n_cache if cache_all else 0)
    for plain in range(layers, -1, -1):
        recompute = layers - plain
        # The inputs the host cannot take stay on the device: they are not optional.
        keep_min = next((k for k in range(recompute + 1) if (recompute - k) * terms.kept <= host), None)
        if keep_min is None or terms.device_peak(recompute, keep_min, 0) > device:
            continue
        keep = max((k for k in range(keep_min, recompute + 1)
                    if terms.device_peak(recompute, k, k) <= device), default=None)
        if keep is None:  # the kept inputs fit, not all their outputs: outputs for as many as fit, none on the host
            cache = max(c for c in range(keep_min + 1) if terms.device_peak(recompute, keep_min, c) <= device)
            return MemoryPlan(recompute, keep_min, cache if cache_all else 0)
        cache = keep
        while cache_all and cache < recompute and terms.host_pinned(recompute, keep, cache + 1) <= host:
            cache += 1
        return MemoryPlan(recompute, keep, cache if cache_all else 0)
    # Nothing fits: the least device memory, with outputs kept where the host has room for them.
    keep = next((k for k in range(layers + 1) if (layers - k) * terms.kept <= host), layers)
    cache = keep
    while cache_all and cache < layers and terms.host_pinned(layers, keep, cache + 1) <= host:
        cache += 1
    return MemoryPlan(layers, keep, cache if cache_all and cache > keep else 0)


def step_terms(shape: ModelShape, seq_len: int, *, sp_size: int = 1, head_groups: int | str = "auto",
               keep_attention: bool = True, offload: bool = True, packed: bool = False,
               long_documents: bool = False, deltanet: str = "torch") -> StepTerms:
    """Per rank, the terms of one step the memory model prices, from the levers' own bytes (memory_model.py).
    long_documents: packed documents of at least kernels.DOCUMENT_VARLEN_TOKENS each (DPO's pairs), which run one
    kernel call per run of documents and keep no more than an unpacked layer: no varlen extra (PACKED_PLAIN_FIT).
    deltanet: the gated DeltaNet layers' resolved path, "torch" or "fla" (their recurrence's bytes differ)."""
    seq_local = -(-seq_len // sp_size)
    s_pad = seq_local * sp_size
    heads_local, kv_local = shape.local_heads(sp_size), shape.local_kv_heads(sp_size)
    groups = head_groups if head_groups != "auto" else attention_head_groups(s_pad, heads_local, kv_local,
                                                                             shape.head_dim)
    block = head_group_block_bytes(s_pad, heads_local, kv_local, shape.head_dim, groups)
    # A gated DeltaNet's recurrence: what a plain one stores from its forward is its whole block (its backward works
    # within it); a recomputed one builds it again, and on fla holds more at its peak (recurrence_recompute). The
    # model counts the block on the plain layers that are DeltaNets.
    recurrence = recurrence_block_bytes(shape, seq_len, sp_size, deltanet)
    recurrence_recompute = recurrence_block_bytes(shape, seq_len, sp_size, deltanet, recompute=True)
    output = seq_local * kept_output_bytes_per_token(shape)
    chunk = auto_chunk_rows(shape.vocab) * shape.vocab * 4  # one chunk's fp32 logits, inside loss_head_bytes
    return StepTerms.fitted(
        layers=shape.layers, plain_formula=seq_local * plain_layer_bytes_per_token(shape),
        recurrence=recurrence, recurrence_recompute=recurrence_recompute, linear_layers=shape.linear_layers,
        # Window / sink layers: the band's own copies (window_attention.py) join the working set.
        working_formula=seq_local * (working_set_bytes_per_token(shape, sp_size)
                                     + (band_bytes_per_token(shape) if shape.layer_windows or shape.sinks else 0)),
        mlp_formula=seq_local * mlp_moment_bytes_per_token(shape, seq_local, sp_size),
        block=block,
        kept=seq_local * checkpointed_input_bytes_per_token(shape),
        # One full-attention layer's output: a hybrid's DeltaNet layers keep none (StepTerms counts them by type).
        cached=output if keep_attention and not packed else 0, attention_output=output,
        loss=loss_head_bytes(shape, seq_local) - chunk, loss_chunk=chunk, sp_size=sp_size,
        packed=packed and not long_documents,
        offload=offload)


def plan_bytes(shape: ModelShape, seq_len: int, plan: MemoryPlan, *, sp_size: int = 1, head_groups: int | str = "auto",
               offload: bool = True, packed: bool = False, long_documents: bool = False,
               deltanet: str = "torch") -> tuple[int, int]:
    """(device, host) bytes per rank of one step's activations under `plan`, by the memory model the planner chooses
    with (memory_model.py): the device's peak and the pinned host buffers. What --dry-run predicts, with the state."""
    terms = step_terms(shape, seq_len, sp_size=sp_size, head_groups=head_groups,
                       keep_attention=plan.cache_attention_layers > 0, offload=offload, packed=packed,
                       long_documents=long_documents, deltanet=deltanet)
    return int(terms.device_peak(*plan.counts)), int(terms.host_pinned(*plan.counts))


# ZeRO-3's state per parameter: bf16 param (2) + fp32 master (4) + fp32 grad (4) + AdamW's two fp32 moments (8).
PARAM_BYTES, MASTER_AND_GRAD_BYTES, ADAM_MOMENT_BYTES = 2, 8, 8
# Offloaded, DeepSpeed's ZeRO-3 (deepspeed/runtime/zero/stage3.py, 0.19.8) holds two fp32 gradient copies on the host:
# the flat partition buffer the reduce-scatter writes (grad_partitions_flat_buffer) and each optimizer sub-group's
# own (.grad of its fp32 partition), beside the fp32 master and AdamW's moments; offload_param keeps the bf16
# partitions in one flat buffer per parameter group. With pin_memory (the shipped configs) the gradient and bf16
# buffers are pinned through torch's caching host allocator, which rounds each block up to a power of two
# (aten/src/ATen/core/CachingHostAllocator.h, PowerOf2Ceil; github.com/pytorch/pytorch/pull/171662). For 1.27 B
# parameters on one rank that is 34.5 GB where 18 bytes a parameter said 22.8: the Llama-3.1-8B shape cut to one
# layer held 37.4 GB of RSS before its step on one H200, 38.6 predicted with the process's 3.0
# (benchmarks/results/2026-12-03/longest_refit, BENCHMARKS.md), fitted on nothing: DeepSpeed's buffers as written.
OFFLOAD_GRAD_COPIES = 2
DEEPSPEED_SUB_GROUP_SIZE = 10**9  # zero_optimization.sub_group_size's default (elements)


def pinned_block_bytes(nbytes: int, pinned: bool = True) -> int:
    """Host bytes a buffer of `nbytes` holds: pinned through torch's caching host allocator, the next power of two."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 1 else nbytes


def zero3_offload_host_bytes(trainable_per_rank: int, frozen_per_rank: int, off_opt: bool, off_param: bool,
                             pin_opt: bool = True, pin_param: bool = True,
                             sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE) -> int:
    """Host bytes per rank of ZeRO-3's offloaded buffers (above): the optimizer's fp32 master and moments, its two
    gradient copies (the flat one whole, the sub-groups' of at most sub_group_size elements each), pinned and rounded
    where pin_opt; the bf16 partitions with offload_param, the trained ones one flat buffer (rounded where
    pin_param), the frozen ones (a LoRA base) at their size."""
    host = 0
    if off_opt and trainable_per_rank:
        fp32 = 4
        host += (MASTER_AND_GRAD_BYTES - fp32 + ADAM_MOMENT_BYTES) * trainable_per_rank  # master + moments
        host += pinned_block_bytes(fp32 * trainable_per_rank, pin_opt)  # the flat gradient buffer
        full, rest = divmod(trainable_per_rank, max(1, int(sub_group_size)))
        host += full * pinned_block_bytes(fp32 * int(sub_group_size), pin_opt) + pinned_block_bytes(fp32 * rest, pin_opt)
    if off_param:
        host += pinned_block_bytes(PARAM_BYTES * trainable_per_rank, pin_param) + PARAM_BYTES * frozen_per_rank
    return host


def _sub_group_size(zero: dict) -> int:
    """zero_optimization.sub_group_size as DeepSpeed takes it (1e9 in JSON is a float; "auto" is not DeepSpeed's)."""
    value = zero.get("sub_group_size", DEEPSPEED_SUB_GROUP_SIZE)
    return int(value) if isinstance(value, (int, float)) and value >= 1 else DEEPSPEED_SUB_GROUP_SIZE


def zero3_state_bytes(num_params: int, world_size: int, ds_config: dict,
                      trainable_params: int | None = None) -> tuple[int, int]:
    """(device, host) bytes per rank of ZeRO-3's partitioned state, all of it partitioned over `world_size`;
    offload_optimizer moves the fp32 master, grads and moments to the host, offload_param the bf16 params too, in
    DeepSpeed's buffers (zero3_offload_host_bytes: two gradient copies, pinned blocks rounded up).

    trainable_params: of the num_params, those that train (None: all). Frozen weights (a LoRA run's base) keep
    only their bf16 copy: ZeRO-3 gives parameters outside the optimizer no fp32 master, gradient or moments.
    """
    zero = ds_config.get("zero_optimization", {})
    per_rank = -(-num_params // world_size)
    trainable_per_rank = per_rank if trainable_params is None else -(-trainable_params // world_size)
    opt_cfg, param_cfg = zero.get("offload_optimizer", {}), zero.get("offload_param", {})
    off_opt = opt_cfg.get("device", "none") in ("cpu", "nvme")
    off_param = param_cfg.get("device", "none") in ("cpu", "nvme")
    param, optim = PARAM_BYTES * per_rank, (MASTER_AND_GRAD_BYTES + ADAM_MOMENT_BYTES) * trainable_per_rank
    host = zero3_offload_host_bytes(trainable_per_rank, per_rank - trainable_per_rank, off_opt, off_param,
                                    pin_opt=bool(opt_cfg.get("pin_memory", False)),
                                    pin_param=bool(param_cfg.get("pin_memory", False)),
                                    sub_group_size=_sub_group_size(zero))
    return (0 if off_param else param) + (0 if off_opt else optim), host


def optimizer_reserved_bytes(trainable_params: int, world_size: int) -> int:
    """What AdamW's moments will take per rank at the first step, not yet allocated when a run plans before it:
    8 bytes per trainable parameter, partitioned over all ranks."""
    return ADAM_MOMENT_BYTES * trainable_params // world_size


def attention_policy(shape: ModelShape, kernel: str, head_groups: int | str = "auto",
                     packed: bool = False, explicit_ok: bool = True) -> tuple[bool, int | str]:
    """(whether checkpointed layers may keep their attention output, the head groups the plan counts on): the
    one rule the plan, the dry run and the start-up estimate share.

    Kept outputs and head groups need a kernel we call ourselves (an SDPA one) and no dropout. Packed documents
    run their attention per document (kernels.document_attention): no kept outputs, so none are planned (their
    memory goes to layers that skip the recompute), and no head groups, so the kernel's backward block is
    reserved whole (the per-document and variable-length kernels hold at most that). explicit_ok: False where no
    explicit kernel took this model's call on this device (`SequenceParallelCausalLM.probe_attention`): the plan
    is made for the kernel actually used."""
    ours = can_keep_attention(shape, kernel) and explicit_ok
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


def measure_foreign_bytes(device: torch.device, layout: ParallelLayout) -> int:
    """Device bytes in use that no term of the plan's budget counts, the largest over all ranks: what the GPU has in
    use beyond this process's caching allocator and the CUDA context in use so far (memory_model.CONTEXT_BYTES less
    LATER_CONTEXT_BYTES, still to come). Another process on the GPU shows here. Collective: every rank calls it."""
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    foreign = torch.tensor([max(outside - (CONTEXT_BYTES - LATER_CONTEXT_BYTES), 0)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(foreign, op=torch.distributed.ReduceOp.MAX, group=layout.world_group)
    return int(foreign)


def plan_step_memory(
    shape: ModelShape, seq_len: int, layout: ParallelLayout, device: torch.device, *, kernel: str = "auto",
    head_groups: int | str = "auto", offload: bool = True, reserved_bytes: int = 0, packed: bool = False,
    budget: tuple[float, float] | None = None, long_documents: bool = False, explicit_ok: bool = True,
    deltanet: str = "torch",
) -> MemoryPlan:
    """The plan for the next step from the memory free now on every rank, less `reserved_bytes` still to be
    allocated (`optimizer_reserved_bytes` before the first step), ZeRO-3's gathered weights during the step and
    NCCL's and cuDNN's memory still to come. Collective on CUDA. packed: the steps train packed documents
    (`attention_policy`).

    budget: (device, host) bytes the plan may use by the dry run's arithmetic for the run's limits (sizing.Job.budget:
    --gpu-memory-gb, --host-memory-gb): the plan is the dry run's, `plan_memory` within it, less only the device
    memory held outside this process's allocator beyond the CUDA context the budget allows for so far
    (`measure_foreign_bytes`: another process on the GPU). Host memory is the budget's (the limit per rank is the
    node's share, the node's launcher counted), not what is free at this moment. Without CUDA the budget plans as
    on a GPU of that size; without budget and CUDA every layer is checkpointed and offloaded, attention outputs kept
    where the kernel allows (on a CPU that only exercises the paths). Drivers call it through
    `SequenceParallelCausalLM.plan_step`, which passes the wrapper's own kernel, head groups and offload, and
    whether its start-up probe found an explicit kernel (`attention_policy`'s explicit_ok)."""
    keep_attention, groups = attention_policy(shape, kernel, head_groups, packed, explicit_ok)
    if device.type != "cuda" and budget is None:
        return MemoryPlan.everything_checkpointed(shape.layers, keep_attention)
    if budget is not None:
        # The budget counts this job's own device memory by the memory model's terms (ZeRO-3 state, CUDA context);
        # what is free now, by its own accounting, is no second opinion on them (on one H200 it read less than the
        # budget and the run planned one layer fewer on the GPU than its dry run, whose prediction of the step
        # it did plan was 4% above the measured peak: BENCHMARKS.md). Only memory no term counts takes from it.
        device_free = budget[0] - (measure_foreign_bytes(device, layout) if device.type == "cuda" else 0)
        host_free = budget[1]
    else:
        device_free, host_free = measure_free_memory(device, layout)
        device_free -= (reserved_bytes + LATER_CONTEXT_BYTES
                        + zero3_working_bytes(shape.largest_module_params) * (1 + allocator_slack(shape, layout.sp_size)))
        host_free *= HOST_HEADROOM
    return plan_memory(
        shape, seq_len, device_free, sp_size=layout.sp_size, host_free_bytes=max(host_free, 0),
        offload=offload, keep_attention=keep_attention, head_groups=groups, packed=packed,
        long_documents=long_documents, deltanet=deltanet,
    )


# Device memory taken outside the caching allocator after the plan: the SP group's NCCL communicator (created at
# the first exchange) and cuDNN's plans; the dry run counts all of memory_model.CONTEXT_BYTES.
LATER_CONTEXT_BYTES = 10**9


__all__ = ["MemoryPlan", "attention_policy", "can_keep_attention", "measure_foreign_bytes", "measure_free_memory",
           "optimizer_reserved_bytes",
           "plan_bytes", "plan_memory", "plan_step_memory", "pinned_block_bytes", "step_terms",
           "zero3_offload_host_bytes", "zero3_state_bytes"]
