"""The memory model: what one training step holds per rank, on the device and on the host, in terms fitted to
peaks measured on an H200. The planner (memory.plan_memory) chooses with it and the dry run predicts with it,
so a plan spends exactly the memory the prediction says is free.

The terms come from the levers' own byte counts (memory.step_terms builds them from the shape); this module
holds the fitted coefficients, the one rule for where a step peaks, and the host side. The measured points are
in tests/data/h200_peaks.json (date, machine, command, plan); benchmarks/fit_memory_model.py prints each point's
predicted / measured from these constants, and tests/test_memory_prediction.py holds every point to within 10%
and never below.

Where a step peaks (per rank, s_local tokens; "stored" is what the forward leaves for backward on the device:
the plain layers' activations, the checkpointed inputs kept on the device and their kept attention outputs):
  loss       stored + the loss head's gradients (its fp32 weight gradient, the hidden-state gradient, computed
             in forward and held until backward) + one chunk's logits;
  backward   stored + the loss head's gradients + the first plain layer's backward (its attention backward:
             dq, dk, dv and the kernel's block of one head group);
  recompute  the checkpointed inputs and outputs still on the device + the loss head's gradients + one
             checkpointed layer recomputed and back-propagated (the previous layer's input comes back from the
             host after this layer's attention block, past the peak: BENCHMARKS.md E).
The peak is the largest of the three: the plain layers' activations are gone before the first recompute, so
adding the recompute's working set to them (as the first planner did) over-counts by up to 35%.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- Fitted to tests/data/h200_peaks.json (benchmarks/fit_memory_model.py --fit: every point's predicted GPU peak
# within 0.5-4% above its measurement) ---------------------------------------------------------------------------
# A plain layer's activations against the formula 2 (4e + 3q + 3kv) bytes a token (memory.plain_layer_bytes_per_token):
# 27.7 KB a token on the Qwen3-0.6B shape (26.6 by the formula), from the plans' plain layers at 128k-512k.
PLAIN_FIT = 1.04
# Under sequence parallelism a plain layer keeps ~1.1 attention outputs (2q + 4h bytes a token) more: 4.6 KB a token
# on the 0.6B shape at sp 2 (23 plain layers at 256k); the 8B shape's point at sp 2 is bounded with it.
SP_PLAIN_FIT = 1.10
# Packed documents: the per-document kernels keep another ~0.6 attention output per plain layer (2.4 KB a token,
# 0.6B shape, 32 documents of 8k at 256k, torch varlen_attn: the one packed point measured).
PACKED_PLAIN_FIT = 0.57
# The first plain layer's backward, beside the kernel's block and the loss head: 0.18 of a plain layer's formula.
BACKWARD_FIT = 0.18
# One checkpointed layer's recompute and backward against the formula 2 (8e + 6q + 6kv) (memory.working_set_bytes_per_
# token), beside the kernel's block: 36.7 KB a token on one 0.6B layer at 256k and at 2M (53.2 by the formula).
RECOMPUTE_FIT = 1.0
# Its MLP backward against the formula 2 (6e + 2q + 2kv) + 12 i / tiles (memory.mlp_moment_bytes_per_token), the peak
# where e and i are wide: the Llama-3.1-8B shape cut to one layer (zero3_offload_all, one H200) measured 115.4 GB at
# 1,572,864 tokens where the formula priced 129.5 (the loss head's hidden-state gradient, 2e, is spent before the
# layers' backward: a candidate for the difference, not yet taken apart). Fitted there, 0.885 (the attention backward
# then binds at 1.073 of it); checked on the point at 1,721,344 tokens: 135.1 against 125.8, 1.074
# (benchmarks/results/2026-12-03/longest_refit.sh, BENCHMARKS.md).
MLP_BACKWARD_FIT = 0.885

# Device memory the allocator holds beyond what is allocated (expandable segments), as a share of the step's
# activations and ZeRO-3's gathered weights; the plan leaves this much free. Under sequence parallelism up to 16.9%
# measured (8B shape at sp 2: 131.7 GB reserved for 122.6 allocated, 67.6 of them state; 4.4% on the 0.6B shape): 17%.
ALLOCATOR_SLACK = 0.17
# On one GPU, shapes whose decoder layers are all one dense layer: 0.7-4.7% over the 13 such points measured (Qwen3-0.6B
# and -4B, Mistral-7B; 12-116 GB of activations, max_memory_reserved less max_memory_allocated): 5%. Other shapes keep
# ALLOCATOR_SLACK: MoE measured 9.4% (gpt-oss-20b) and 42% of Qwen3-30B-A3B's small activations (4.8 GB, its 128
# experts' tensors), hybrids were not measured.
DENSE_ONE_GPU_SLACK = 0.05


# The same shapes with ZeRO-3's parameters offloaded (zero3_offload_all), where the run gives the allocator's cached
# memory back at each checkpointed layer's recompute and before its attention backward (sizing.Job.
# release_cached_memory, CheckpointHandle.configure): the Llama-3.1-8B shape cut to one layer on one H200 reserved
# 9.1% over a plain step (1,146,880 tokens: 108.3 GB for 99.4 allocated) and 9.9% over a checkpointed one (1,637,376:
# 131.8 for 119.9; 14.8-15.0% without giving the memory back, 137.6 for 119.9, 132.5 for 115.4 at 1,572,864 and 144.2
# for 125.8 at 1,721,344): 10%.
OFFLOADED_PARAMS_SLACK = 0.10


def allocator_slack(shape, sp_size: int, offload_params: bool = False) -> float:
    """The allocator's slack the plan leaves for a step of `shape` (plan.ModelShape) over `sp_size` ranks, as a share
    of its activations and gathered weights (the constants above); offload_params: ZeRO-3's parameters on the host."""
    uniform_dense = shape.layer_params * shape.layers == shape.layer_matmul_params
    if sp_size == 1 and uniform_dense:
        return OFFLOADED_PARAMS_SLACK if offload_params else DENSE_ONE_GPU_SLACK
    return ALLOCATOR_SLACK


# CUDA context, NCCL buffers and cuDNN workspaces outside the caching allocator (0.67 GiB seen at one GPU).
CONTEXT_BYTES = 2 * 10**9
# The host process itself (Python, torch, CUDA and NCCL libraries, DeepSpeed): RSS less the pinned offload buffers,
# 1.8-2.9 GB measured over the main job, the Trainer path and the benchmarks on the 0.6B and 8B shapes (2.9 GB:
# the peak RSS of the memory ladder's 0.6B run at 64k, one H200, 2026-12-01).
HOST_PROCESS_BYTES = int(3.0e9)
# The launcher's processes on each node, shared by its ranks: DeepSpeed's runner and its per-node launch.py, 0.25 GB
# RSS each, torchrun's agent 0.23 GB (measured on a CPU machine, 2026-12-01: they import torch but no CUDA), rounded
# up to 1 GB per node.
LAUNCHER_BYTES = 10**9
# What the node's kernel and GPU driver hold for pinned pages, outside any process's RSS, as a share of them: one H200
# node, 2026-12-01, 123.3 GB pinned by one rank (Qwen3-8B + LoRA at 256k): node used 129.3 GB at its peak against
# 125.9 GB rank RSS + 0.4 GB in use before the job, 3.0 GB beyond them and the launcher's 0.25 (BENCHMARKS.md). One
# point: counted as a share of the pinned bytes, which covers a constant of that size at this point and grows with
# more pinned memory; 2.5%.
PINNED_NODE_SHARE = 0.025
# A pinned buffer is rounded up to whole pages (host_pool.py).
PAGE_BYTES = 4096
# The planner leaves a tenth of the host memory it is given to the rest of the node (page cache, the OS).
HOST_HEADROOM = 0.9


@dataclass(frozen=True)
class StepTerms:
    """Bytes per rank of one step's terms, as the model prices them (memory.step_terms builds them).

    plain: a layer that keeps all its activations; kept: a checkpointed layer's input (exact: the offload buffer);
    cached: its kept attention output and log-sum-exp (exact; 0 where none are kept); backward: the first plain
    layer's backward beyond what it stored; recompute: one checkpointed layer recomputed and back-propagated;
    loss: the loss head's gradients, held from forward to backward; loss_chunk: one chunk's logits while the loss
    runs; offload: checkpointed inputs may go to the host.

    A hybrid's layers are priced by their type (linear_layers: per layer, whether it is a gated DeltaNet): a plain
    DeltaNet layer stores `recurrence` beyond `plain`, and `cached` is one full-attention layer's output, which a
    DeltaNet layer does not keep. Which layers a plan's counts name (levers/checkpointing.py): the first
    recompute_layers are checkpointed, the rest plain; of the checkpointed, the last keep_on_gpu keep their input
    on the device and the last cache_attention_layers their attention output. On the Qwen3.5 pattern [3 DeltaNet,
    1 full] x 2 the plan 6 / 6 / 6 leaves layers 6 (DeltaNet) and 7 (full) plain and keeps one output (layer 3):
    priced as the average layer (3/4 of a block each, 6/4 outputs) it was 24.6 GB too high, 1.391 of the peak
    measured (BENCHMARKS.md "Whole steps of a Qwen3.5 shape", the held-out run)."""

    layers: int
    plain: float
    kept: int
    cached: int
    backward: float
    recompute: float
    loss: int
    loss_chunk: int
    offload: bool = True
    linear_layers: tuple = ()
    recurrence: float = 0

    @classmethod
    def fitted(cls, *, layers: int, plain_formula: float, working_formula: float, block: float, kept: int,
               mlp_formula: float,
               cached: int, attention_output: int, loss: int, loss_chunk: int, sp_size: int, packed: bool,
               offload: bool, recurrence: float = 0, linear_layers: tuple = (),
               recurrence_recompute: float = 0) -> "StepTerms":
        """The terms from the levers' formulas (bytes per rank) and the fitted coefficients above.
        block: the attention backward's own block; attention_output: one layer's attention output and log-sum-exp
        (the unit of the SP and packed extras); recurrence: a gated DeltaNet's recurrence block (measured bytes,
        linear_attention.RECURRENCE_BYTES_PER_HEAD_TOKEN: not scaled by the fits), linear_layers: per layer, whether
        it is a gated DeltaNet; recurrence_recompute: what a recomputed one holds at its peak (the block again on the
        torch path, more on fla's: linear_attention.FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN). A plain DeltaNet
        layer stores its whole block from its forward and its backward stays within it (Qwen3.5-0.8B shape, every
        layer plain at 32k on an H200: the backward's peak 1.6 GB under the loss's, BENCHMARKS.md "Whole steps of a
        Qwen3.5 shape"); a recomputed one builds it again."""
        plain = (PLAIN_FIT * plain_formula + (SP_PLAIN_FIT * attention_output if sp_size > 1 else 0)
                 + (PACKED_PLAIN_FIT * attention_output if packed else 0))
        return cls(layers=layers, plain=plain, kept=kept, cached=cached,
                   backward=BACKWARD_FIT * plain_formula + block,
                   recompute=max(RECOMPUTE_FIT * working_formula + max(block, recurrence_recompute),
                                 MLP_BACKWARD_FIT * mlp_formula),
                   loss=loss, loss_chunk=loss_chunk, offload=offload, linear_layers=tuple(linear_layers),
                   recurrence=recurrence if any(linear_layers) else 0)

    def _attention_layers(self, first: int, end: int) -> int:
        """Of layers first .. end - 1, those with an attention output to keep (not gated DeltaNets)."""
        return max(end - first, 0) - sum(self.linear_layers[first:end])

    def device_peak(self, recompute_layers: int, keep_on_gpu: int, cache_attention_layers: int) -> float:
        """Peak device bytes of the step's activations under a plan's three counts (memory.MemoryPlan)."""
        plain_layers = self.layers - recompute_layers
        on_device = keep_on_gpu if self.offload else recompute_layers
        cache = min(cache_attention_layers, on_device)
        cached_on_device = self._attention_layers(recompute_layers - cache, recompute_layers) if self.cached else 0
        held = on_device * self.kept + cached_on_device * self.cached
        stored = plain_layers * self.plain + sum(self.linear_layers[recompute_layers:]) * self.recurrence + held
        peak = stored + self.loss + max(self.loss_chunk, self.backward if plain_layers else 0)
        return max(peak, held + self.loss + self.recompute) if recompute_layers else peak

    def host_pinned(self, recompute_layers: int, keep_on_gpu: int, cache_attention_layers: int) -> int:
        """Pinned host bytes of the offloaded inputs and attention outputs under a plan's counts."""
        if not self.offload:
            return 0
        offloaded = recompute_layers - keep_on_gpu
        first_cached = recompute_layers - min(cache_attention_layers, recompute_layers)
        cached_offloaded = self._attention_layers(first_cached, recompute_layers - keep_on_gpu) if self.cached else 0
        return offloaded * _pages(self.kept) + cached_offloaded * _pages(self.cached)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def zero3_working_bytes(largest_module_params: int) -> int:
    """Device bytes ZeRO-3 holds during the step beyond its partitions: the bf16 weights of the module running and of
    the one prefetched (the largest: the embedding or one decoder layer with all its experts). 0.6 GB fitted at one
    rank on the 0.6B shape (its 156M-parameter embedding, gathered by the loss head and the input embedding)."""
    return 2 * 2 * largest_module_params


__all__ = ["ALLOCATOR_SLACK", "CONTEXT_BYTES", "DENSE_ONE_GPU_SLACK", "OFFLOADED_PARAMS_SLACK", "allocator_slack", "HOST_HEADROOM", "HOST_PROCESS_BYTES", "LAUNCHER_BYTES",
           "PINNED_NODE_SHARE", "StepTerms",
           "zero3_working_bytes"]
