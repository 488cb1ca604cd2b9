"""The Ulysses exchange: who sends what to whom around attention (the math is in kernels.py).

Legend: shape.py. Transformers hands attention q [b, h, s_local, d] and k, v [b, h_kv, s_local, d]; one
all-to-all over the SP group turns them into [b, h_local, s, d] (every rank: the whole sequence, some
heads), and one all-to-all turns the attention output back. Ranks of an SP group hold contiguous slices in
rank order, so after the exchange the sequence is in global order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import ParallelLayout


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, sp: int) -> torch.Tensor:
    """Split x into sp parts along scatter_dim, send part i to SP rank i, concatenate what arrives along gather_dim."""
    parts = x.unflatten(scatter_dim, (sp, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    # received[i] is rank i's part, i.e. the i-th block along gather_dim.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _SeqAllToAll(torch.autograd.Function):
    """Forward: all-to-all scatter_dim -> gather_dim over the SP group. Backward: the inverse all-to-all
    on the gradient (gather_dim -> scatter_dim). Saves nothing for backward."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, sp):
        ctx.dims, ctx.group, ctx.sp = (scatter_dim, gather_dim), group, sp
        return _all_to_all(x, scatter_dim, gather_dim, group, sp)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group, ctx.sp), None, None, None, None


class _QKVSeqToHeads(torch.autograd.Function):
    """q, k, v [b, h_x, s_local, d] -> [b, h_x / sp, s, d] each, in ONE all-to-all (and one back in backward):
    the three are packed along heads into one buffer, which costs the same copy the separate exchanges make
    (each packs its own parts contiguously), and the SP group runs one collective instead of three per
    attention call each way: fewer launches and latencies, and one large message instead of two small ones
    next to a large one."""

    @staticmethod
    def forward(ctx, q, k, v, group, sp):
        heads = [t.shape[1] // sp for t in (q, k, v)]
        ctx.group, ctx.sp, ctx.heads = group, sp, heads
        parts = torch.cat([t.unflatten(1, (sp, -1)).movedim(1, 0) for t in (q, k, v)], dim=2)
        received = torch.empty_like(parts)
        dist.all_to_all_single(received, parts, group=group)
        # received[i]: rank i's sequence slice of this rank's heads -> whole sequence in global order.
        return tuple(r.movedim(0, 2).flatten(2, 3) for r in received.split(heads, dim=2))

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        sp = ctx.sp
        ref = next(g for g in (grad_q, grad_k, grad_v) if g is not None)
        grads = [g if g is not None else ref.new_zeros(ref.shape[0], h, *ref.shape[2:])
                 for g, h in zip((grad_q, grad_k, grad_v), ctx.heads)]
        parts = torch.cat([g.unflatten(2, (sp, -1)).movedim(2, 0) for g in grads], dim=2)
        received = torch.empty_like(parts)
        dist.all_to_all_single(received, parts, group=ctx.group)
        # received[i]: rank i's heads of this rank's sequence slice -> all heads, local slice.
        out = tuple(r.movedim(0, 1).flatten(1, 2) for r in received.split(ctx.heads, dim=2))
        return (*out, None, None)


def _bshd_seq_to_heads(xs, group, sp):
    """[b, s_local, h_x, d_x] each -> [b, s, h_x / sp, d_x] each, packed into one all-to-all."""
    widths = [x.shape[2] // sp * x.shape[3] for x in xs]
    parts = torch.cat([x.reshape(*x.shape[:2], sp, -1).movedim(2, 0) for x in xs], dim=-1)  # [sp, b, s_local, W]
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    # received[i]: rank i's slice of the sequence for this rank's heads -> the whole sequence in global order.
    whole = received.movedim(0, 1).flatten(1, 2)
    return tuple(w.unflatten(-1, (x.shape[2] // sp, x.shape[3])) for w, x in zip(whole.split(widths, -1), xs))


def _bshd_heads_to_seq(xs, group, sp):
    """[b, s, h_local, d_x] each -> [b, s / sp, h_local sp, d_x] each, packed into one all-to-all."""
    widths = [x.shape[2] * x.shape[3] for x in xs]
    parts = torch.cat([x.flatten(2).unflatten(1, (sp, -1)).movedim(1, 0) for x in xs], dim=-1)  # [sp, b, s_local, W]
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)
    # received[i]: rank i's heads of this rank's slice -> all heads, in rank order.
    return tuple(r.movedim(0, 2).reshape(*r.shape[1:3], sp * x.shape[2], x.shape[3])
                 for r, x in zip(received.split(widths, -1), xs))


class _BSHDExchange(torch.autograd.Function):
    """Tensors of one dtype in [b, s, h, d] layout (the gated DeltaNet's, linear_attention.py), exchanged together in
    ONE all-to-all. to_heads: forward sends each rank its heads' slices ([b, s_local, h, d] -> [b, s, h / sp, d]),
    backward sends the gradients back the inverse way; else the reverse. Saves nothing for backward."""

    @staticmethod
    def forward(ctx, to_heads, group, sp, *xs):
        outs = (_bshd_seq_to_heads if to_heads else _bshd_heads_to_seq)(xs, group, sp)
        ctx.to_heads, ctx.group, ctx.sp, ctx.shapes = to_heads, group, sp, [o.shape for o in outs]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        grads = [ref.new_zeros(shape) if g is None else g for g, shape in zip(grads, ctx.shapes)]
        back = (_bshd_heads_to_seq if ctx.to_heads else _bshd_seq_to_heads)(grads, ctx.group, ctx.sp)
        return (None, None, None, *back)


def bshd_seq_to_heads(xs, layout: ParallelLayout) -> tuple:
    """[b, s_local, h_x, d_x] tensors of one dtype -> [b, s, h_x / sp, d_x] each, in one all-to-all (differentiable)."""
    if layout.sp_size == 1:
        return tuple(xs)
    return _BSHDExchange.apply(True, layout.sp_group, layout.sp_size, *xs)


def bshd_heads_to_seq(x_bshd: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """[b, s, h_local, d] -> [b, s_local, h, d] (differentiable)."""
    if layout.sp_size == 1:
        return x_bshd
    return _BSHDExchange.apply(False, layout.sp_group, layout.sp_size, x_bshd)[0]


def qkv_seq_to_heads(q, k, v, layout: ParallelLayout):
    """seq_to_heads of q, k and v together: one all-to-all when their dtype, batch, local length and head
    dim agree (always for Llama/Qwen-style attention), three otherwise."""
    if layout.sp_size == 1:
        return q, k, v
    same = all(t.dtype == q.dtype and t.shape[0] == q.shape[0] and t.shape[2:] == q.shape[2:] for t in (k, v))
    if not same:
        return seq_to_heads(q, layout), seq_to_heads(k, layout), seq_to_heads(v, layout)
    return _QKVSeqToHeads.apply(q, k, v, layout.sp_group, layout.sp_size)


def seq_to_heads(x_bhsd: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h_local, s, d] (differentiable)."""
    if layout.sp_size == 1:
        return x_bhsd
    return _SeqAllToAll.apply(x_bhsd, 1, 2, layout.sp_group, layout.sp_size)


def heads_to_seq(x_bhsd: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """[b, h_local, s, d] -> [b, h, s_local, d] (differentiable)."""
    if layout.sp_size == 1:
        return x_bhsd
    return _SeqAllToAll.apply(x_bhsd, 2, 1, layout.sp_group, layout.sp_size)


def replicate_kv_heads(kv_bhsd: torch.Tensor, sp_size: int) -> torch.Tensor:
    """When sp_size > h_kv, repeat each KV head sp_size / h_kv times so every rank receives one.

    Query head i uses KV head i // (h / h_kv); after repeat_interleave rank r receives KV copy r, i.e.
    original head r // (sp / h_kv), which is the KV head of the query heads rank r holds. Autograd sums
    the copies' gradients back into the original head.
    """
    h_kv = kv_bhsd.shape[1]
    if h_kv % sp_size == 0:
        return kv_bhsd
    return kv_bhsd.repeat_interleave(sp_size // h_kv, dim=1)


__all__ = ["bshd_heads_to_seq", "bshd_seq_to_heads", "heads_to_seq", "qkv_seq_to_heads", "replicate_kv_heads", "seq_to_heads"]
