"""Sizing a run: the predicted GPU and host memory per rank, whether it fits, which limit binds, the longest
sequence that fits, what would fit instead, and the predicted step time; from the model's shape alone.

One `Job` (what is fixed for a run: shape, parameters, ranks, DeepSpeed offload, kernel policy) answers every
question by one arithmetic, the memory model's (memory_model.py) that the planner chooses with:
  job.plan(seq_len, limits)     the plan memory.plan_memory chooses within these limits
  job.predict(seq_len, plan)    StepMemory: GPU peak (ZeRO-3 state + its gathered weights + activations) and host
  job.fit(seq_len, limits)      Fit: the plan, its prediction, what is over and by how much, which limit binds
  job.longest(limits)           the longest sequence whose plan fits (0: none)
  job.step_seconds(seq_len, plan)  from the model FLOPs (metrics.py) at kernel rates measured on an H200, and the
                                gated DeltaNet layers' torch path at its measured cost per token (deltanet_time.py)
The dry run (train/dry_run.py) and the run's start-up check (train/estimate.py) print these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import deltanet_time, memory_model
from .memory import (DEEPSPEED_SUB_GROUP_SIZE, PARAM_BYTES, MemoryPlan, _sub_group_size, attention_policy, plan_bytes,
                     plan_memory, zero3_state_bytes)
from .metrics import model_flops_per_step
from ..mixers.kernels import resolve_kernel
from ..mixers.window_attention import rate_vs_causal, resolve_how
from ..shape import ModelShape, window_pairs

GB = 1e9


@dataclass(frozen=True)
class Limits:
    """Memory per rank: `gpu_bytes` of device memory (what the GPU has) and `host_bytes` of host memory (the node's
    share of one rank)."""

    gpu_bytes: float
    host_bytes: float


@dataclass(frozen=True)
class StepMemory:
    """Predicted bytes per rank of one step. gpu is the peak the allocator hands out (torch.cuda.max_memory_allocated);
    gpu_needed adds the allocator's slack and the CUDA context, which the GPU must also hold."""

    state_gpu: int  # ZeRO-3 partitions on the device (memory.zero3_state_bytes)
    gathered: int  # ZeRO-3's gathered bf16 weights during the step (memory_model.zero3_working_bytes)
    act_gpu: int  # activations at the step's peak (memory.plan_bytes)
    state_host: int  # offloaded ZeRO-3 partitions
    act_host: int  # pinned offloaded activations
    process_host: int  # the host process itself (memory_model.HOST_PROCESS_BYTES)
    node_host_share: int = 0  # the node's memory outside the ranks' processes counted per rank (Job.node_share)
    ranks_per_node: int = 1
    slack_share: float = memory_model.ALLOCATOR_SLACK  # the allocator's slack (memory_model.allocator_slack)

    @property
    def gpu(self) -> int:
        return self.state_gpu + self.gathered + self.act_gpu

    @property
    def slack(self) -> int:
        return int(self.slack_share * (self.act_gpu + self.gathered))

    @property
    def gpu_needed(self) -> int:
        return self.gpu + self.slack + memory_model.CONTEXT_BYTES

    @property
    def host(self) -> int:
        """Per rank: its process, offloaded state and activations, and its share of the node's launcher."""
        return self.process_host + self.state_host + self.act_host + self.node_host_share

    @property
    def node_host(self) -> int:
        """The job's host memory on one node: its ranks and its launcher."""
        return self.host * self.ranks_per_node


@dataclass(frozen=True)
class Fit:
    """A plan, its prediction and the limits it was priced against."""

    seq_len: int
    plan: MemoryPlan
    memory: StepMemory
    limits: Limits

    @property
    def gpu_over(self) -> float:
        return self.memory.gpu_needed - self.limits.gpu_bytes

    @property
    def host_over(self) -> float:
        return self.memory.host - self.limits.host_bytes

    @property
    def fits(self) -> bool:
        return self.gpu_over <= 0 and self.host_over <= 0

    @property
    def binds(self) -> str:
        """The limit nearer to (or further past) its end, as a share of it: "gpu" or "host"."""
        return "gpu" if self.gpu_over / self.limits.gpu_bytes >= self.host_over / self.limits.host_bytes else "host"

    def verdict(self) -> str:
        """One line: fits (with the room left on the binding limit) or what is over and by how much."""
        m, lim = self.memory, self.limits
        gpu = (f"gpu {m.gpu_needed / GB:.1f} GB ({m.gpu / GB:.1f} peak + {m.slack / GB:.1f} allocator slack + "
               f"{memory_model.CONTEXT_BYTES / GB:.0f} CUDA context) of {lim.gpu_bytes / GB:.0f}")
        host = f"host {m.host / GB:.1f} GB of {lim.host_bytes / GB:.0f}"
        if self.fits:
            left = -self.gpu_over if self.binds == "gpu" else -self.host_over
            return f"fits: {gpu}, {host} per rank; {self.binds} memory binds ({left / GB:.1f} GB left)"
        over = [f"{name} over by {value / GB:.1f} GB" for name, value in (("gpu", self.gpu_over),
                                                                           ("host", self.host_over)) if value > 0]
        return f"does not fit: {gpu}, {host} per rank: {', '.join(over)}"


@dataclass(frozen=True)
class Job:
    """What is fixed for a run, which sizing needs: shape, parameter count, ranks, DeepSpeed offload, kernel policy.

    offload: checkpointed inputs may go to the host (the wrapper's `offload` lever); offload_optimizer,
    offload_params: the DeepSpeed config's ZeRO-3 offload (`from_ds_config`)."""

    shape: ModelShape
    num_params: int
    world_size: int
    sp_size: int
    offload_optimizer: bool = False
    offload_params: bool = False
    kernel: str = "auto"
    head_groups: int | str = "auto"
    packed: bool = False
    long_documents: bool = False  # packed documents each long enough for its own kernel call (memory.step_terms)
    offload: bool = True
    trainable_params: int | None = None  # of num_params, those that train (None: all; LoRA: the adapters)
    # DPO (preference.py): a frozen reference copy's parameters (0: none, the adapters off or no DPO), whose bf16
    # weights ZeRO-3 partitions like the policy's; and whether the loss head scores two documents per pair.
    reference_params: int = 0
    preference: bool = False
    ranks_per_node: int = 1  # ranks sharing one node's host memory and its launcher
    deltanet: str = "auto"  # the gated DeltaNet layers' path priced: "auto" (deltanet_time.DELTANET_RULE), fla, torch
    # The offload's pin_memory (optimizer, params) and sub_group_size: DeepSpeed's buffers for them
    # (memory.zero3_offload_host_bytes). Pinned by default, as the shipped configs are; from_ds_config reads them.
    offload_pinned: tuple[bool, bool] = (True, True)
    sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE

    def node_share(self, pinned: int = 0) -> int:
        """Host bytes outside the ranks' processes counted per rank: its share of the node's launcher
        (memory_model.LAUNCHER_BYTES over the node's ranks) and what the kernel and driver hold for its `pinned`
        bytes (memory_model.PINNED_NODE_SHARE)."""
        return -(-memory_model.LAUNCHER_BYTES // self.ranks_per_node) + int(memory_model.PINNED_NODE_SHARE * pinned)

    @classmethod
    def from_ds_config(cls, shape: ModelShape, num_params: int, world_size: int, sp_size: int, ds_config: dict,
                       **kwargs) -> "Job":
        optimizer, params = zero3_offload(ds_config)
        zero = ds_config.get("zero_optimization", {})
        pinned = tuple(bool(zero.get(k, {}).get("pin_memory", False)) for k in ("offload_optimizer", "offload_param"))
        kwargs.setdefault("offload_pinned", pinned)
        kwargs.setdefault("sub_group_size", _sub_group_size(zero))
        return cls(shape, num_params, world_size, sp_size, offload_optimizer=optimizer, offload_params=params,
                   **kwargs)

    @property
    def ds_zero(self) -> dict:
        """The ZeRO-3 offload settings as a DeepSpeed config (what memory.zero3_state_bytes reads)."""
        opt, param = ({"device": "cpu", "pin_memory": pin} for pin in self.offload_pinned)
        return {"zero_optimization": {"stage": 3, "sub_group_size": self.sub_group_size,
                                      **({"offload_optimizer": opt} if self.offload_optimizer else {}),
                                      **({"offload_param": param} if self.offload_params else {})}}

    def _policy(self):
        keep_attention, groups = attention_policy(self.shape, self.kernel, self.head_groups, self.packed)
        return keep_attention, groups

    def state_bytes(self) -> tuple[int, int]:
        """(device, host) bytes per rank held for the whole run: ZeRO-3's partitions of the policy, of a DPO reference
        copy (bf16 weights only), and, when DPO trains the LM head, the second document's fp32 head-gradient
        accumulator (preference.ChunkedDocumentLogProbs keeps one per document on the rank's slice)."""
        gpu, host = zero3_state_bytes(self.num_params, self.world_size, self.ds_zero,
                                      trainable_params=self.trainable_params)
        reference = PARAM_BYTES * -(-self.reference_params // self.world_size)
        gpu, host = (gpu, host + reference) if self.offload_params else (gpu + reference, host)
        if self.preference and self.trainable_params is None:
            gpu += self.shape.vocab * self.shape.hidden * 4
        return gpu, host

    def predict(self, seq_len: int, plan: MemoryPlan) -> StepMemory:
        """The step's memory per rank under `plan`."""
        state_gpu, state_host = self.state_bytes()
        _, groups = self._policy()
        act_gpu, act_host = plan_bytes(self.shape, seq_len, plan, sp_size=self.sp_size, head_groups=groups,
                                       offload=self.offload, packed=self.packed, long_documents=self.long_documents,
                                       deltanet=self.deltanet_path)
        gathered = memory_model.zero3_working_bytes(self.shape.largest_module_params)
        return StepMemory(state_gpu, gathered, act_gpu, state_host, act_host, memory_model.HOST_PROCESS_BYTES,
                          self.node_share(act_host), self.ranks_per_node, self.slack())

    def slack(self) -> float:
        """The allocator's slack for this job's steps (memory_model.allocator_slack)."""
        return memory_model.allocator_slack(self.shape, self.sp_size, self.offload_params)

    @property
    def release_cached_memory(self) -> bool:
        """Whether this job's steps give the allocator's cached memory back at each checkpointed layer's recompute
        (CheckpointHandle.configure): where ZeRO-3's parameters are offloaded, which the slack above counts on."""
        return self.offload_params

    def budget(self, limits: Limits) -> tuple[float, float]:
        """(device, host) bytes per rank a step's activations may take within `limits`: what the CUDA context, the
        ZeRO-3 state and its gathered weights (with their allocator slack), the host process and its share of the
        node's launcher leave (on the host: for pinned bytes, each with its node share); what memory.plan_memory and
        the run's plan_step (`budget=`) plan within."""
        state_gpu, state_host = self.state_bytes()
        gathered = memory_model.zero3_working_bytes(self.shape.largest_module_params)
        device = (limits.gpu_bytes - memory_model.CONTEXT_BYTES - state_gpu - gathered * (1 + self.slack()))
        # plan_memory (and the run's plan_step) leave the shape's slack beside the activations; where this job's is
        # larger (ZeRO-3's parameters offloaded), the budget shrinks to leave the difference too.
        device *= (1 + memory_model.allocator_slack(self.shape, self.sp_size)) / (1 + self.slack())
        # The pinned activations also cost the node PINNED_NODE_SHARE of themselves: what is left buys less of them.
        host = limits.host_bytes - memory_model.HOST_PROCESS_BYTES - self.node_share() - state_host
        return device, host / (1 + memory_model.PINNED_NODE_SHARE)

    def plan(self, seq_len: int, limits: Limits) -> MemoryPlan:
        """The plan memory.plan_memory chooses within `budget(limits)`."""
        device, host = self.budget(limits)
        keep_attention, groups = self._policy()
        return plan_memory(self.shape, seq_len, device, sp_size=self.sp_size, host_free_bytes=max(host, 0),
                           offload=self.offload, keep_attention=keep_attention, head_groups=groups, packed=self.packed,
                           long_documents=self.long_documents, deltanet=self.deltanet_path)

    def fit(self, seq_len: int, limits: Limits, plan: MemoryPlan | None = None) -> Fit:
        """`plan` (default: the one `plan` chooses) priced against `limits`."""
        plan = plan if plan is not None else self.plan(seq_len, limits)
        return Fit(seq_len, plan, self.predict(seq_len, plan), limits)

    def longest(self, limits: Limits, multiple: int = 1024) -> int:
        """The longest sequence, a multiple of `multiple` x sp_size tokens, whose plan fits `limits` (0: none). The
        least memory a plan can take grows with the length, so whether one fits is monotone in it."""
        step = multiple * self.sp_size
        if not self.fit(step, limits).fits:
            return 0
        low, high = 1, 2
        while self.fit(high * step, limits).fits and high < 1 << 24:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.fit(mid * step, limits).fits else (low, mid)
        return low * step

    def alternatives(self, seq_len: int, limits: Limits) -> list[str]:
        """What would fit when `seq_len` does not: the host memory per rank the plan needs (where host memory is
        over), more GPUs, a shorter sequence, ZeRO-3 offload."""
        out = []
        if self.fit(seq_len, limits).host_over > 0:
            unbounded = self.fit(seq_len, replace(limits, host_bytes=float("inf")))
            if unbounded.gpu_over <= 0:
                out.append(f"--host-memory-gb {math.ceil(unbounded.memory.host / GB * 10) / 10:g}: the host memory per "
                           f"rank this plan needs, where each rank has that much (the limit was "
                           f"{limits.host_bytes / GB:.1f} GB)")
            else:
                out.append("--host-memory-gb: the host memory per rank, where each rank has more than "
                           f"{limits.host_bytes / GB:.1f} GB")
        for factor in (2, 4, 8, 16, 32, 64):
            sp = self.sp_size * factor
            if self.shape.heads % sp == 0:
                bigger = replace(self, world_size=self.world_size * factor, sp_size=sp)
                if (fit := bigger.fit(seq_len, limits)).fits:
                    out.append(f"--world-size {bigger.world_size} --sp-size {sp}: gpu {fit.memory.gpu_needed / GB:.1f} "
                               f"GB, host {fit.memory.host / GB:.1f} GB per rank")
                    break
        if longest := self.longest(limits):
            out.append(f"--seq-len {longest} (the longest that fits, --max-seq-len)")
        for name, flags in (("zero3_offload_optimizer", dict(offload_optimizer=True)),
                            ("zero3_offload_all", dict(offload_optimizer=True, offload_params=True))):
            offloaded = replace(self, **flags)
            if offloaded != self:
                fit = offloaded.fit(seq_len, limits)
                out.append(f"--ds-config {name}: {'fits' if fit.fits else 'does not fit either'} (gpu "
                           f"{fit.memory.gpu_needed / GB:.1f} GB, host {fit.memory.host / GB:.1f} GB per rank)")
                if fit.fits:
                    break
        return out

    @property
    def deltanet_path(self) -> str:
        """"fla" or "torch": the path `deltanet` resolves to by deltanet_time.deltanet_path."""
        return deltanet_time.deltanet_path(self.deltanet)[0]

    def deltanet_line(self) -> str | None:
        """How step_seconds prices the gated DeltaNet layers, and on which path (None: the model has none)."""
        return deltanet_time.pricing_line(self.shape, self.deltanet)

    @property
    def attention_kernel(self) -> str:
        """The kernel the step time prices attention at: `kernel` as this machine resolves "auto" for the model's heads
        (FlashAttention-4 where installed on Hopper; on a CPU, cuDNN's rates)."""
        return resolve_kernel(self.kernel, self.shape.head_dim, self.shape.attention_dropout)

    def step_seconds(self, seq_len: int, plan: MemoryPlan) -> float:
        """Predicted seconds of one step from its FLOPs (metrics.model_flops_per_step, the plan's recompute) at
        the rates measured on an H200 (below), sliding-window layers at their kernel's measured share of that rate
        (window_attention.rate_vs_causal), the gated DeltaNet layers on the torch path (deltanet_time.py, where the rule
        picks it) at their measured cost per token instead of their FLOPs; packed documents take less (their
        attention is block-diagonal)."""
        shape = self.shape
        torch_path = bool(shape.linear_layers) and self.deltanet_path == "torch"
        if torch_path:  # the recurrence's FLOPs left out: the torch path's measured cost replaces them
            shape = replace(shape, linear_heads=(0, 0, 0, 0))
        flops = model_flops_per_step(shape, seq_len, recompute_layers=plan.recompute_layers,
                                     cached_attention_layers=plan.cache_attention_layers)
        attn_fwd = flops.attention / 3
        recomputed_fwd = attn_fwd * (plan.recompute_layers - plan.cache_attention_layers) / self.shape.layers
        kernel = self.attention_kernel
        attention = (ATTENTION_PASSES * attn_fwd + recomputed_fwd) / attention_flops_per_s(self.shape.head_dim, kernel)
        attention += _window_extra(self.shape, seq_len, plan, kernel)
        dense = (flops.hardware - flops.attention - recomputed_fwd) / MATMUL_FLOPS_PER_S
        tokens = -(-seq_len // self.sp_size)
        rest = ELEMENTWISE_S_PER_TOKEN * tokens * self.shape.layers * self.shape.hidden / 1024
        exchange = 0.0
        if self.sp_size > 1:
            # q, k, v out and the attention output back, bf16, the share that leaves this rank
            per_layer = 2 * tokens * (2 * self.shape.q_width + 2 * self.shape.kv_width) * (1 - 1 / self.sp_size)
            exchange = per_layer * (2 * self.shape.layers + plan.recompute_layers) / EXCHANGE_BYTES_PER_S
        recurrence = (deltanet_time.torch_path_seconds(self.shape, seq_len, self.sp_size, plan.recompute_layers)
                      if torch_path else 0.0)
        return (attention + dense) / self.sp_size + rest + exchange + recurrence


_CUDA = torch.device("cuda")  # the plan prices a GPU's step


def _window_extra(shape: ModelShape, seq_len: int, plan: MemoryPlan, kernel: str = "auto") -> float:
    """Seconds the window layers take beyond their FLOPs at `kernel`'s causal rate: the rate of the kernel
    window_attention picks on a GPU (rate_vs_causal, a share of cuDNN's causal rate; "fa4" for kernel 'fa4'), on the
    forward, backward and the recompute's share of forwards."""
    windows = shape.layer_windows or ()
    linear = shape.linear_layers or (False,) * shape.layers
    recompute_share = (plan.recompute_layers - plan.cache_attention_layers) / shape.layers
    extra = 0.0
    for w, lin in zip(windows, linear):
        if w is None or lin or w >= seq_len:
            continue
        fwd = 4.0 * window_pairs(seq_len, w) * shape.heads * shape.head_dim
        how = "fa4" if kernel == "fa4" else resolve_how("auto", _CUDA, w)
        cudnn, causal = attention_flops_per_s(shape.head_dim), attention_flops_per_s(shape.head_dim, kernel)
        extra += (ATTENTION_PASSES + recompute_share) * fwd * (1 / (rate_vs_causal(how, w) * cudnn) - 1 / causal)
    return extra


def attention_flops_per_s(head_dim: int, kernel: str = "auto") -> float:
    """The causal attention kernel's fwd+bwd rate on an H200 at this head dim (the constants below): cuDNN's, or
    FlashAttention-4's for kernel 'fa4' (above head dim 128: cuDNN's fitted rate there, times FA4's measured 1.08x)."""
    if head_dim > 128:
        return ATTENTION_FLOPS_PER_S_WIDE_HEADS * (FA4_WIDE_HEADS_VS_CUDNN if kernel == "fa4" else 1.0)
    return FA4_FLOPS_PER_S if kernel == "fa4" else ATTENTION_FLOPS_PER_S


def zero3_offload(ds_config: dict) -> tuple[bool, bool]:
    """(optimizer state, parameters) offloaded to the host by a DeepSpeed config's ZeRO-3 settings."""
    zero = ds_config.get("zero_optimization", {})
    return tuple(zero.get(k, {}).get("device", "none") in ("cpu", "nvme")
                 for k in ("offload_optimizer", "offload_param"))


# Rates measured on one H200 (BENCHMARKS.md A/D/H: benchmarks/reports/2026-11-29_speed.md, _memory-plan.md,
# 2026-11-30_sp2-vs-alst.md), the step-time model's assumption; the attention count is FlashAttention's benchmark's
# (github.com/Dao-AILab/flash-attention, benchmarks/benchmark_flash_attention.py: backward 2.5x the forward):
ATTENTION_FLOPS_PER_S = 530e12  # cuDNN causal SDPA, fwd+bwd counted as 3.5 forwards: 529-553 TF/s at 128k-256k
# FlashAttention-4 (kernel 'fa4'), the same count: 626 TF/s on Qwen3-0.6B's heads at 256k where cuDNN ran 524 in the
# same call (benchmarks/bench_fa4.py, 2026-12-04; BENCHMARKS.md "FlashAttention-4 on Hopper"): 1.19x cuDNN's rate.
FA4_FLOPS_PER_S = ATTENTION_FLOPS_PER_S * 626.2 / 524.5
# Head dims above 128 (Qwen3.5, Qwen3-Next: 256) run slower: the rate the 24-layer Qwen3.5-0.8B steps at 256k and
# 1,007,616 tokens imply for their full-attention layers once the rest is priced as above, 364 and 334 TF/s
# (BENCHMARKS.md "Whole steps of a Qwen3.5 shape on fla's kernels", 2026-12-02): fitted, not measured apart.
ATTENTION_FLOPS_PER_S_WIDE_HEADS = 350e12
# FlashAttention-4 over cuDNN at head dim 256 (Qwen3.5-0.8B's 8 / 2 heads, 262,144 tokens, fwd+bwd, one H200, the same
# call; bench_fa4.py 2026-12-04, BENCHMARKS.md "FlashAttention-4 on Hopper"): 439.4 against 407.8 TF/s.
FA4_WIDE_HEADS_VS_CUDNN = 439.4 / 407.8
ATTENTION_PASSES = 3.5  # that count: forward 1, backward 2.5
MATMUL_FLOPS_PER_S = 778e12  # bf16 matmul 8192^3
# Memory-bound work (norms, RoPE, SiLU, copies, loss softmax) per token and layer at hidden 1024: 0.6 us, what is
# left of the measured 0.6B steps at 128k and 256k (15.3 s, 57.9 s) and the 8B one at sp 2 (27.2 s) after the above.
ELEMENTWISE_S_PER_TOKEN = 0.6e-6
EXCHANGE_BYTES_PER_S = 108e9  # the Ulysses all-to-all, 2 H200 over NVLink (BENCHMARKS.md H)


__all__ = ["Fit", "Job", "Limits", "StepMemory", "zero3_offload"]
