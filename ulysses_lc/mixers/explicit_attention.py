"""Causal attention called as SDPA's forward and backward ops, one backend at a time: kept outputs and head groups.

Legend: shape.py. Same inputs as kernels.py (q [b, h_local, s, d], k, v [b, h_kv_local, s, d] after the
Ulysses exchange); communicates nothing.
  explicit_attention     SDPA's own cuDNN / FLASH / CPU-flash forward and backward ops (or FlashAttention-4's,
                         fa4.py) called directly, so the forward's output can be kept for a checkpoint recompute
                         (attention.py) and the kernel can run over groups of heads (its backward block, one group
                         at a time)
  ExplicitAttention      the autograd Function behind it; attention.kept_output_attention replays a kept output
  attention_head_groups  how many head groups keep that block under a target; the planner reads the same sizes
"""

from __future__ import annotations

import logging

import torch

from . import fa4, fallbacks

logger = logging.getLogger(__name__)


# ---- attention whose output the forward keeps, so the checkpoint recompute skips the kernel ----
#
# Inside a checkpointed layer (checkpointing.py) the recompute runs the layer forward again, attention kernel
# included, only to rebuild what the attention backward reads: q, k, v (cheap: projections and RoPE), the
# output and the softmax log-sum-exp (the whole kernel). With `cache_attention_layers` the forward keeps
# the output and log-sum-exp (2q + 4 x heads bytes per token, offloaded with the layer input) and the
# recompute hands them back (attention.kept_output_attention) instead of running the kernel. This needs the kernel's forward and backward
# as separate calls, so we call SDPA's aten ops directly: the same ops, with the same arguments, that
# F.scaled_dot_product_attention's autograd uses for the cuDNN / FLASH backends (and the CPU flash
# kernel), hence the same numbers, bitwise.

def _cudnn_forward(q, k, v, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset


def _cudnn_backward(dout, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
    )


def _flash_forward(q, k, v, scale):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused


def _flash_backward(dout, q, k, v, out, lse, aux, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


def _cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, aux, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


_EXPLICIT = {
    "cudnn": (_cudnn_forward, _cudnn_backward),
    "flash": (_flash_forward, _flash_backward),
    "cpu": (_cpu_forward, _cpu_backward),
    "fa4": (fa4.causal_forward, fa4.causal_backward),
}
_LOGGED: set = set()


# CUDA backends for the kept-output path per `kernel`, in the order F.scaled_dot_product_attention would try
# them under our priority; flash-attn 2 / 3 have no separate forward/backward ops to call, FlashAttention-4 has.
_KEPT_BACKENDS = {"cudnn": ("cudnn", "flash"), "auto": ("cudnn", "flash"), "sdpa": ("flash",), "fa4": ("fa4",)}
# The only dtypes those CUDA ops take. FLASH refuses others; cuDNN's op is not asked: torch's MHA.cpp has built its
# graph for fp16 whatever the inputs' dtype unless they were bf16, which reads fp32 inputs wrongly instead of refusing.
_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def keeps_attention_outputs(kernel: str) -> bool:
    """Whether checkpointed layers can keep their attention output with this `kernel` (see the note above)."""
    return kernel in _KEPT_BACKENDS


def causal_ops(backend: str):
    """(forward, backward) of one explicit causal backend ("cudnn", "flash", "cpu"): forward(q, k, v, scale) ->
    (out, lse, aux), backward(dout, q, k, v, out, lse, aux, scale) -> (dq, dk, dv). window_attention.py runs
    its band of the sequence through them."""
    return _EXPLICIT[backend]


def explicit_backends(q: torch.Tensor, kernel: str) -> tuple[str, ...]:
    """Backends for the kept-output path on q's device and dtype, in the order they are tried (none for fp32 on CUDA:
    the callers then run F.scaled_dot_product_attention, which has fp32 kernels)."""
    if not keeps_attention_outputs(kernel):
        return ()
    if q.device.type == "cpu":
        return ("cpu",)
    return _KEPT_BACKENDS[kernel] if q.device.type == "cuda" and q.dtype in _CUDA_DTYPES else ()


# ---- the kernel over groups of heads: its own working memory, one group at a time ----
#
# At long sequence the peak of a step is one layer's backward, and the attention backward is its largest
# part. Besides out, dq, dk and dv, cuDNN's backward holds one block of its own: an fp32 dq accumulator and,
# for GQA, dk and dv at all query heads before they are summed to the kv heads, (4 + 4 * gqa) * h * s * d
# bytes: 4 GiB at 256k tokens for Qwen3-0.6B's 16 x 128 heads, 32 GiB at 2M (measured: BENCHMARKS.md F;
# torch's FLASH backend holds more). Heads are independent, so the kernel can run over groups of whole kv
# heads (each with its query heads) one after another: that block shrinks by the group count. Only the backward
# runs in groups: the forward holds nothing beside its out and log-sum-exp, so it runs once over all heads, with no
# per-group output to copy, and its log-sum-exp is regrouped for the backward's calls (FA4's forward at the Qwen3-4B
# layer, 128k: 7% faster in one call than over four groups on an H100, the same on an H200 at its power cap;
# BENCHMARKS.md). The gradients are written into full-size tensors; each group's own (1/G of them) is transient.
# The numbers are the kernel's own per head: bitwise equal to one call over all heads on CPU (tests); cuDNN's
# backward is not deterministic run to run (atomic dq accumulation), and the groups stay within that spread (GPU test).
# Groups of whole kv heads keep every kv head's gradient inside one call: splitting the query heads that
# share a kv head would add partial dk, dv sums in another order. Under Ulysses a rank holds h_kv / sp kv
# heads (at least one), so these groups are divisors of that.
#
# Past one kv head a group (more groups than kv heads: query-head groups, UPipe's headwise chunking, arXiv
# 2602.21196) the calls split the query heads that share a kv head: a call then holds its own query heads' block
# only (no GQA expansion when it runs one query head), and each kv head's dk, dv are the sum of its calls'
# partials, added in fp32 and rounded once, as the kernel's own GQA reduction sums its per-query-head dk, dv.
# At sp 8 on Llama-3.1-8B (4 q / 1 kv heads a rank) the block is 8 x 4 x s x d bytes in one call, 16 GB at 3.9M
# tokens; four calls of one query head hold 4 s d (dq's fp32 accumulator) + 8 s d (dk, dv's fp32 sums) + 6 s d
# (one call's dq, dk, dv) and no bf16 dk, dv until the sums end: 14 s d net, 7 GB.

# The per-group block we aim for: the size of the loss head's chunk, far below one layer's activations at
# the lengths where it matters.
_ATTENTION_BLOCK_TARGET_BYTES = 1 << 30
# False: the forward runs over the head groups too, as before 2026-12-06 (benchmarks/bench_step.py's variant
# `forward_groups` times the two in one call).
_FORWARD_IN_ONE_CALL = True


def attention_backward_block_bytes(seq: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of the block the cuDNN attention backward holds besides out, dq, dk, dv, all heads in one call
    (fp32 dq accumulator; for GQA also bf16 dk and dv at every query head)."""
    return (4 + (4 if kv_heads != heads else 0)) * heads * seq * head_dim


def head_group_block_bytes(seq: int, heads: int, kv_heads: int, head_dim: int, groups: int) -> float:
    """Bytes the grouped backward holds beside out, dq, dk, dv at its peak, over `groups` head groups: one group's
    block, and past one kv head a group (query-head groups) the kv head's fp32 dk, dv sums and one call's dq, dk,
    dv, less the bf16 dk, dv not yet written where the rank runs one kv head (the note above)."""
    if groups <= kv_heads:
        return attention_backward_block_bytes(seq, heads, kv_heads, head_dim) / groups
    per_call = heads // groups
    call = attention_backward_block_bytes(seq, per_call, 1, head_dim)
    sums, outputs = 8 * seq * head_dim, 2 * (per_call + 2) * seq * head_dim
    return call + sums + outputs - (4 * seq * head_dim if kv_heads == 1 else 0)


def splits_heads(heads: int, kv_heads: int, groups: int) -> bool:
    """Whether `groups` groups split `heads` query / `kv_heads` kv heads: whole kv heads (a divisor of kv_heads), or
    whole query heads of one kv head each (a multiple of kv_heads dividing heads)."""
    if groups < 1:
        return False
    return kv_heads % groups == 0 or (groups % kv_heads == 0 and heads % groups == 0)


def attention_head_groups(
    seq: int, heads: int, kv_heads: int, head_dim: int, target_bytes: int = _ATTENTION_BLOCK_TARGET_BYTES
) -> int:
    """How many head groups to run the attention kernel over, one at a time: the fewest whose block
    (`head_group_block_bytes`) is at most `target_bytes`, else the one with the least block (groups of whole kv
    heads first, then of query heads of one kv head). `heads` and `kv_heads` are what one rank runs (after the
    Ulysses exchange)."""
    counts = [g for g in range(1, heads + 1) if splits_heads(heads, kv_heads, g)]
    for groups in counts:
        if head_group_block_bytes(seq, heads, kv_heads, head_dim, groups) <= target_bytes:
            return groups
    return min(counts, key=lambda g: (head_group_block_bytes(seq, heads, kv_heads, head_dim, g), g))


def valid_head_groups(value) -> bool:
    """Whether `value` is a head-group setting: "auto" or an int >= 1 (not a bool)."""
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def check_head_groups(q, k, groups: int) -> None:
    if not splits_heads(q.shape[1], k.shape[1], groups):
        raise ValueError(
            f"head_groups={groups} must divide this rank's kv heads ({k.shape[1]}), or be a multiple of them "
            f"dividing its query heads ({q.shape[1]}); pick a divisor of {k.shape[1]}, a multiple of it dividing "
            f"{q.shape[1]}, or head_groups='auto'."
        )


def _group_slices(heads: int, kv_heads: int, groups: int) -> list[tuple[slice, slice]]:
    """(query heads, kv heads) of each group, in order: groups past one kv head share it with their neighbours."""
    gq = heads // groups
    if groups <= kv_heads:
        gk = kv_heads // groups
        return [(slice(g * gq, (g + 1) * gq), slice(g * gk, (g + 1) * gk)) for g in range(groups)]
    per_kv = heads // kv_heads
    return [(slice(g * gq, (g + 1) * gq), slice(g * gq // per_kv, g * gq // per_kv + 1)) for g in range(groups)]


def _grouped_forward(backend, q, k, v, scale, groups):
    """(out, lse, per-group aux) of the backend's forward for a backward over `groups` head groups: one call over
    all heads (the forward holds no block beside its out and lse, the note above); lse is the kernel's own for one
    group, else regrouped [groups, b, h / groups, s], each group's block contiguous."""
    fwd = _EXPLICIT[backend][0]
    if groups > 1 and not _FORWARD_IN_ONE_CALL:
        return _forward_per_group(fwd, q, k, v, scale, groups)
    out, lse, aux = fwd(q, k, v, scale)
    if groups == 1:
        return out, lse, (aux,)
    # FLASH's backward reads the log-sum-exp as a contiguous [b, h, s] block whatever its strides, so a head slice
    # of one [b, h, s] tensor would hand it another head's values from the second sequence on: group-major instead.
    # The groups' query heads are consecutive blocks of heads / groups (_group_slices), so this is a reshape.
    b, h = lse.shape[:2]
    lse = lse.reshape(b, groups, h // groups, *lse.shape[2:]).transpose(0, 1).contiguous()
    return out, lse, (aux,) * groups


def _forward_per_group(fwd, q, k, v, scale, groups):
    """The forward one head group at a time (before 2026-12-06; kept for the benchmark that times the two)."""
    out = lse = None
    auxes = []
    for g, (sq, sk) in enumerate(_group_slices(q.shape[1], k.shape[1], groups)):
        out_g, lse_g, aux = fwd(q[:, sq], k[:, sk], v[:, sk], scale)
        if out is None:
            out = torch.empty_like(q, dtype=out_g.dtype)  # in q's layout; the backward ops read it through strides
            lse = lse_g.new_empty(groups, *lse_g.shape)
        out[:, sq].copy_(out_g)
        lse[g].copy_(lse_g)
        auxes.append(aux)
        del out_g, lse_g
    return out, lse, tuple(auxes)


def _grouped_backward(backend, dout, q, k, v, out, lse, auxes, scale):
    bwd = _EXPLICIT[backend][1]
    groups = len(auxes)
    if groups == 1:
        return bwd(dout, q, k, v, out, lse, auxes[0], scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    slices = _group_slices(heads, kv_heads, groups)
    dq = torch.empty_like(q)
    # Query-head groups sum each kv head's dk, dv in fp32 over its calls (the note above); with one kv head the sums
    # become dk, dv themselves, so no bf16 copy is held beside them.
    split, one_kv = groups > kv_heads, groups > kv_heads and kv_heads == 1
    dk, dv = (None, None) if one_kv else (torch.empty_like(k), torch.empty_like(v))
    sums = None
    for g, (aux, (sq, sk)) in enumerate(zip(auxes, slices)):
        dq_g, dk_g, dv_g = bwd(dout[:, sq], q[:, sq], k[:, sk], v[:, sk], out[:, sq], lse[g], aux, scale)
        dq[:, sq].copy_(dq_g)
        if not split:
            dk[:, sk].copy_(dk_g)
            dv[:, sk].copy_(dv_g)
        elif sums is None:
            sums = [dk_g.float(), dv_g.float()]
        else:
            sums[0].add_(dk_g)
            sums[1].add_(dv_g)
        del dq_g, dk_g, dv_g
        if split and (g + 1 == groups or slices[g + 1][1] != sk):  # this kv head's last call: round once
            if one_kv:
                dk = sums[0].to(k.dtype)
                sums[0] = None
                dv = sums[1].to(v.dtype)
            else:
                dk[:, sk].copy_(sums[0])
                dv[:, sk].copy_(sums[1])
            sums = None
    return dq, dk, dv


class ExplicitAttention(torch.autograd.Function):
    """Causal attention through one explicit backend, over `groups` head groups. kept None: run the kernel
    forward and put its (out, lse, aux) in `sink`; kept = (out, lse, aux): return them without running it.
    Backward: the backend's backward op from the saved q, k, v, out, lse, group by group."""

    @staticmethod
    def forward(ctx, q, k, v, scale, backend, groups, kept, sink):
        if kept is None:
            out, lse, aux = _grouped_forward(backend, q, k, v, scale, groups)
            sink.append((out.detach(), lse, aux))
        else:
            out, lse, aux = kept
            out = out.detach()  # a fresh tensor object: this node becomes its grad_fn
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.backend, ctx.aux = scale, backend, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _grouped_backward(ctx.backend, dout, q, k, v, out, lse, ctx.aux, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def explicit_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel: str, groups: int = 1, sink: list | None = None):
    """Causal attention through the first explicit backend (cuDNN, FLASH, CPU flash) that takes this shape,
    over `groups` head groups; None when none does (the caller runs `causal_attention`). With a `sink`, the
    backend name and the kernel's (out, lse, aux) are appended to it."""
    check_head_groups(q_bhsd, k_bhsd, groups)
    for backend in explicit_backends(q_bhsd, kernel):
        key = fallbacks.call_key("explicit attention", backend, q_bhsd, k_bhsd)
        if fallbacks.refused(key):
            continue
        got = []
        try:
            out = ExplicitAttention.apply(q_bhsd, k_bhsd, v_bhsd, scaling, backend, groups, None, got)
        except RuntimeError as e:  # every error that is not a refusal (out of memory too) propagates
            if not fallbacks.is_no_kernel_error(e):
                raise
            fallbacks.record(key, e)
            continue
        if sink is not None:
            sink.append((backend, *got[0]))
        if (backend, groups) not in _LOGGED:  # once a process: the start-up probe's shape is not the step's
            _LOGGED.add((backend, groups))
            logger.info("attention: %s kernel called directly, %d head group(s)", backend, groups)
        return out
    return None


__all__ = [
    "ExplicitAttention", "attention_backward_block_bytes", "attention_head_groups", "causal_ops", "check_head_groups",
    "explicit_attention", "explicit_backends", "keeps_attention_outputs", "valid_head_groups",
]
