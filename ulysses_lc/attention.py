"""Ulysses attention: all-to-all from "slice of the sequence, all heads" to "whole sequence, some heads".

Legend: b batch, s full sequence length, s_local = s / sp (this rank's slice), h query heads,
h_kv key/value heads, h_local = h / sp (this rank's heads during attention), d head dim.

Transformers calls an attention function with q [b, h, s_local, d] and k, v [b, h_kv, s_local, d]
(rotary already applied with *global* position ids, see `sharding.py`) and expects [b, s_local, h, d]
back. Around the kernel we exchange q, k, v to [b, h_local, s, d], run causal attention over the whole
sequence, and exchange the output back. Ranks of an SP group hold contiguous slices in rank order, so
after the gather the sequence is in global order and the causal kernel's `is_causal` mask is exactly
"key position <= query position": causality comes from global positions, never from a dense mask.
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layers import text_config
from .layout import ParallelLayout, check_heads
from .offload import active_checkpointed_layer

logger = logging.getLogger(__name__)
_instance_ids = itertools.count()

_MASK_REFUSED = (
    "Ulysses attention computes causality from global positions and cannot apply an attention_mask "
    "(padding or packed documents would be silently attended to by the causal kernel). Pass "
    "attention_mask=None, pad at the end and mark padded labels with IGNORE_INDEX (see shard_batch)."
)

KERNELS = ("auto", "sdpa", "cudnn", "flash_attention_2", "flash_attention_3")

# SDPA backends in order of preference. On Hopper cuDNN ran causal attention at ~1.7x the FLASH_ATTENTION
# backend (ANCHORS.md: 524 vs 322 TF/s fwd+bwd at 256k); torch's default order prefers FLASH. The order is
# applied with set_priority around every call of the kernel, which covers the checkpoint recompute too (it
# calls this function again), so forward, recompute and backward use one backend. Backends that refuse a
# shape fall through to the next.
_SDPA_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _sdpa_backends(kernel: str):
    from torch.nn.attention import SDPBackend

    names = _SDPA_PRIORITY if kernel in ("auto", "cudnn") else _SDPA_PRIORITY[1:]
    return [getattr(SDPBackend, n) for n in names]


def resolve_kernel(kernel: str) -> str:
    """'auto' -> 'cudnn' priority SDPA on Hopper or newer, plain 'sdpa' order elsewhere."""
    if kernel != "auto":
        return kernel
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        return "cudnn"
    return "sdpa"


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


def _flash_attn_func(kernel: str):
    try:
        if kernel == "flash_attention_3":
            from flash_attn_interface import flash_attn_func
        else:
            from flash_attn import flash_attn_func
    except ImportError as e:
        raise ValueError(
            f"kernel={kernel!r} needs flash-attn, which is not installed: `pip install ulysses_lc[flash]` "
            "(or flash-attn 3 from source), or use kernel='sdpa'."
        ) from e
    return flash_attn_func


def causal_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel: str = "sdpa", dropout: float = 0.0):
    """Causal attention over a whole sequence in global order; returns [b, h, s, d]."""
    if kernel in ("sdpa", "cudnn", "auto"):
        from torch.nn.attention import sdpa_kernel

        gqa = q_bhsd.shape[1] != k_bhsd.shape[1]
        with sdpa_kernel(_sdpa_backends(kernel), set_priority=True):
            return F.scaled_dot_product_attention(
                q_bhsd, k_bhsd, v_bhsd, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
            )
    flash_attn_func = _flash_attn_func(kernel)
    out_bshd = flash_attn_func(
        q_bhsd.transpose(1, 2), k_bhsd.transpose(1, 2), v_bhsd.transpose(1, 2),
        dropout_p=dropout, softmax_scale=scaling, causal=True,
    )
    out_bshd = out_bshd[0] if isinstance(out_bshd, tuple) else out_bshd
    return out_bshd.transpose(1, 2)


# ---- attention whose output the forward keeps, so the checkpoint recompute skips the kernel ----
#
# Inside a checkpointed layer (offload.py) the recompute runs the layer forward again, attention kernel
# included, only to rebuild what the attention backward reads: q, k, v (cheap: projections and RoPE), the
# output and the softmax log-sum-exp (the whole kernel). With `cache_attention_layers` the forward keeps
# the output and log-sum-exp (2q + 4 x heads bytes per token, offloaded with the layer input) and the
# recompute hands them back instead of running the kernel. This needs the kernel's forward and backward
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
}
_REFUSED: set = set()  # (backend, dtype, head_dim, gqa) that raised once: not tried again
_LOGGED: set = set()


# CUDA backends for the kept-output path per `kernel`, in the order F.scaled_dot_product_attention would try
# them under our priority; flash-attn kernels have no separate forward/backward ops to call.
_KEPT_BACKENDS = {"cudnn": ("cudnn", "flash"), "auto": ("cudnn", "flash"), "sdpa": ("flash",)}


def keeps_attention_outputs(kernel: str) -> bool:
    """Whether checkpointed layers can keep their attention output with this `kernel` (see the note above)."""
    return kernel in _KEPT_BACKENDS


def _explicit_backends(q: torch.Tensor, kernel: str) -> tuple[str, ...]:
    """Backends for the kept-output path on q's device."""
    if not keeps_attention_outputs(kernel):
        return ()
    if q.device.type == "cpu":
        return ("cpu",)
    return _KEPT_BACKENDS[kernel] if q.device.type == "cuda" else ()


# ---- the kernel over groups of heads: its own working memory, one group at a time ----
#
# At long sequence the peak of a step is one layer's backward, and the attention backward is its largest
# part. Besides out, dq, dk and dv, cuDNN's backward holds one block of its own: an fp32 dq accumulator and,
# for GQA, dk and dv at all query heads before they are summed to the kv heads, (4 + 4 * gqa) * h * s * d
# bytes: 4 GiB at 256k tokens for Qwen3-0.6B's 16 x 128 heads, 32 GiB at 2M (measured: BENCHMARKS.md F;
# torch's FLASH backend holds more). Heads are independent, so the kernel can run over groups of whole kv
# heads (each with its query heads) one after another: that block shrinks by the group count. Outputs and
# gradients are written into full-size tensors; each group's own (1/G of them) is transient. The numbers are
# the kernel's own per head: bitwise equal to one call over all heads on CPU (tests); cuDNN's backward is
# not deterministic run to run (atomic dq accumulation), and the groups stay within that spread (GPU test).
# Groups of whole kv heads keep every kv head's gradient inside one call: splitting the query heads that
# share a kv head would add partial dk, dv sums in another order. Under Ulysses a rank holds h_kv / sp kv
# heads (at least one), so the groups are divisors of that.

# The per-group block we aim for: the size of the loss head's chunk, far below one layer's activations at
# the lengths where it matters.
_ATTENTION_BLOCK_TARGET_BYTES = 1 << 30


def attention_backward_block_bytes(seq: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of the block the cuDNN attention backward holds besides out, dq, dk, dv, all heads in one call
    (fp32 dq accumulator; for GQA also bf16 dk and dv at every query head)."""
    return (4 + (4 if kv_heads != heads else 0)) * heads * seq * head_dim


def attention_head_groups(
    seq: int, heads: int, kv_heads: int, head_dim: int, target_bytes: int = _ATTENTION_BLOCK_TARGET_BYTES
) -> int:
    """How many groups of whole kv heads to run the attention kernel over, one at a time: the fewest whose
    per-group backward block is at most `target_bytes`, or one per kv head when even that is larger.
    `heads` and `kv_heads` are what one rank runs (after the Ulysses exchange)."""
    block = attention_backward_block_bytes(seq, heads, kv_heads, head_dim)
    for groups in range(1, kv_heads + 1):
        if kv_heads % groups == 0 and block <= target_bytes * groups:
            return groups
    return kv_heads


def valid_head_groups(value) -> bool:
    """Whether `value` is a head-group setting: "auto" or an int >= 1 (not a bool)."""
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _check_groups(q, k, groups: int) -> None:
    if groups < 1 or k.shape[1] % groups or q.shape[1] % groups:
        raise ValueError(
            f"head_groups={groups} must divide this rank's kv heads ({k.shape[1]}) and query heads "
            f"({q.shape[1]}); pick a divisor of {k.shape[1]}, or head_groups='auto'."
        )


def _grouped_forward(backend, q, k, v, scale, groups):
    """(out, lse, per-group aux) of the backend's forward over `groups` head groups; lse is the kernel's own
    for one group, [groups, b, h / groups, s] for more."""
    fwd = _EXPLICIT[backend][0]
    if groups == 1:
        out, lse, aux = fwd(q, k, v, scale)
        return out, lse, (aux,)
    gq, gk = q.shape[1] // groups, k.shape[1] // groups
    out = lse = None
    auxes = []
    for g in range(groups):
        sq, sk = slice(g * gq, (g + 1) * gq), slice(g * gk, (g + 1) * gk)
        out_g, lse_g, aux = fwd(q[:, sq], k[:, sk], v[:, sk], scale)
        if out is None:
            # out in q's layout (empty_like keeps q's strides); the backward ops read out and dout through
            # their strides. lse is kept group-major, [groups, b, h / groups, s]: FLASH's backward reads the
            # log-sum-exp as a contiguous [b, h, s] block whatever its strides, so a head slice of one
            # [b, h, s] tensor would hand it another head's values from the second sequence on.
            out = torch.empty_like(q, dtype=out_g.dtype)
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
    gq, gk = q.shape[1] // groups, k.shape[1] // groups
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for g, aux in enumerate(auxes):
        sq, sk = slice(g * gq, (g + 1) * gq), slice(g * gk, (g + 1) * gk)
        dq_g, dk_g, dv_g = bwd(dout[:, sq], q[:, sq], k[:, sk], v[:, sk], out[:, sq], lse[g], aux, scale)
        dq[:, sq].copy_(dq_g)
        dk[:, sk].copy_(dk_g)
        dv[:, sk].copy_(dv_g)
        del dq_g, dk_g, dv_g
    return dq, dk, dv


class _ExplicitAttention(torch.autograd.Function):
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
    _check_groups(q_bhsd, k_bhsd, groups)
    for backend in _explicit_backends(q_bhsd, kernel):
        key = (backend, q_bhsd.dtype, q_bhsd.shape[-1], q_bhsd.shape[1] != k_bhsd.shape[1])
        if key in _REFUSED:
            continue
        got = []
        try:
            out = _ExplicitAttention.apply(q_bhsd, k_bhsd, v_bhsd, scaling, backend, groups, None, got)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _REFUSED.add(key)
            logger.warning("explicit attention: backend %s refused %s (%s); trying the next one", backend,
                           tuple(q_bhsd.shape), str(e).splitlines()[0][:200])
            continue
        if sink is not None:
            sink.append((backend, *got[0]))
        if (key, groups) not in _LOGGED:
            _LOGGED.add((key, groups))
            logger.info("attention: %s kernel called directly, %d head group(s)", backend, groups)
        return out
    return None


def kept_output_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel: str, handle, saved, groups: int = 1):
    """Causal attention in a checkpointed layer that keeps its output (see the note above), or None when
    no explicit backend takes this shape (the caller then runs `causal_attention`, in the forward and
    again in the recompute)."""
    if saved.calls > 1:  # the recompute
        if saved.attention is None:
            return None
        backend, packed_out, packed_lse, aux = saved.attention
        kept = (handle._unstash(saved, packed_out), handle._unstash(saved, packed_lse), aux)
        # Drop the record's references: the graph (and with it the record) can outlive the backward, e.g.
        # while a loop holds its last loss into the next forward, and a device-kept output would stay.
        saved.attention = None
        return _ExplicitAttention.apply(q_bhsd, k_bhsd, v_bhsd, scaling, backend, len(aux), kept, None)
    sink = []
    out = explicit_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel, groups, sink)
    if out is not None:
        backend, kept_out, lse, aux = sink[0]
        saved.attention = (backend, handle._stash(saved, kept_out), handle._stash(saved, lse), aux)
    return out


class UlyssesAttention:
    """A transformers attention function running Ulysses sequence parallelism over `layout`'s SP group.

    Register it under its own name (`register()`), then point a model at it (`apply(model)`); both are
    undone by `unregister()` / the returned undo callable. Another implementation's entry is never
    overwritten.
    """

    def __init__(
        self, layout: ParallelLayout, kernel: str = "auto", name: str | None = None, head_groups: int | str = "auto"
    ):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; pick one of {KERNELS}.")
        if not valid_head_groups(head_groups):
            raise ValueError(f"head_groups must be 'auto' or an int >= 1, got {head_groups!r}.")
        kernel = resolve_kernel(kernel)
        if kernel.startswith("flash"):
            _flash_attn_func(kernel)  # fail now, not at the first layer
            if head_groups not in ("auto", 1):
                raise ValueError(
                    f"head_groups={head_groups} needs a kernel whose forward and backward we call ourselves "
                    f"(kernel='auto', 'cudnn' or 'sdpa'); {kernel!r} runs over all heads at once."
                )
        self.layout = layout
        self.kernel = kernel
        self.head_groups = head_groups
        # One entry per instance: two models in one process (say, a policy and a reference) may differ.
        self.name = name or f"ulysses_lc_{kernel}_{next(_instance_ids)}"
        logger.info("ulysses_lc attention: kernel %s, sp_size %d", kernel, layout.sp_size)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if attention_mask is not None:
            raise ValueError(_MASK_REFUSED)
        if kwargs.get("sliding_window") is not None:
            raise ValueError(
                f"layer {getattr(module, 'layer_idx', '?')} uses sliding-window attention "
                f"(window {kwargs['sliding_window']}), which Ulysses attention does not express; use a model "
                "whose layers are all full attention, or sp_size=1 with the model's own attention."
            )
        sp = self.layout.sp_size
        key = replicate_kv_heads(key, sp)
        value = replicate_kv_heads(value, sp)
        q, k, v = qkv_seq_to_heads(query, key, value, self.layout)
        dropout = dropout if module.training else 0.0
        groups = self.groups_for(q, k)
        out = None
        active = active_checkpointed_layer()
        if active is not None and torch.is_grad_enabled() and not dropout and active[1].cache_attention:
            out = kept_output_attention(q, k, v, scaling, self.kernel, *active, groups=groups)
        elif groups > 1 and not dropout:
            out = explicit_attention(q, k, v, scaling, self.kernel, groups)
        if out is None:
            out = causal_attention(q, k, v, scaling, self.kernel, dropout)
        out_bshd = heads_to_seq(out, self.layout).transpose(1, 2)
        return out_bshd, None

    def groups_for(self, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor) -> int:
        """Head groups for one call on this rank's [b, h_local, s, d] q and k (see the note above): 1 where the
        kernel is not ours to call or there is no backward (evaluation, inference), `head_groups` when set,
        else `attention_head_groups` from the shapes, per sequence in the batch, on CUDA only (the CPU
        kernel holds no such block)."""
        if not keeps_attention_outputs(self.kernel) or not torch.is_grad_enabled():
            return 1
        if self.head_groups != "auto":
            _check_groups(q_bhsd, k_bhsd, self.head_groups)
            return self.head_groups
        if q_bhsd.device.type != "cuda":
            return 1
        b, h, s, d = q_bhsd.shape
        return attention_head_groups(b * s, h, k_bhsd.shape[1], d)

    # -- registration -------------------------------------------------------------------------
    def register(self) -> "UlyssesAttention":
        from transformers import AttentionInterface

        current = AttentionInterface._global_mapping.get(self.name)
        if current is not None and current is not self:
            raise ValueError(
                f"an attention implementation named {self.name!r} is already registered by someone else; "
                "pass another name=... to UlyssesAttention."
            )
        AttentionInterface.register(self.name, self)
        return self

    def unregister(self) -> None:
        from transformers import AttentionInterface

        if AttentionInterface._global_mapping.get(self.name) is self:
            del AttentionInterface._global_mapping[self.name]

    def apply(self, model):
        """Check the model and switch its attention to this implementation; returns an undo callable."""
        check_model_for_ulysses(model.config, self.layout.sp_size)
        if self.head_groups != "auto":
            cfg = text_config(model.config)
            sp = self.layout.sp_size
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            local_kv = max(kv_heads, sp) // sp
            if local_kv % self.head_groups:
                raise ValueError(
                    f"head_groups={self.head_groups} must divide the kv heads each rank runs: "
                    f"{kv_heads} kv heads over sp_size {sp} = {local_kv}; pick a divisor of "
                    f"{local_kv}, or head_groups='auto'."
                )
        self.register()
        previous = model.config._attn_implementation
        _set_attn(model, self.name)
        check = functools.partial(_check_model_inputs, sp_size=self.layout.sp_size)
        hook = model.base_model.register_forward_pre_hook(check, with_kwargs=True)

        def undo():
            hook.remove()
            _set_attn(model, previous)
            self.unregister()

        return undo


def _check_model_inputs(module, args, kwargs, sp_size):
    # transformers drops a 2D attention_mask on its way to a custom attention function: refuse it here,
    # or padding would silently be attended to.
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None:
        raise ValueError(_MASK_REFUSED)
    # Without position ids every rank would number its slice from 0: wrong rotary phases, silently.
    if sp_size > 1 and kwargs.get("position_ids") is None and len(args) < 3:
        raise ValueError(
            "position_ids are required under sequence parallelism: each rank holds a slice of the sequence and "
            "needs its global positions; build the batch with ulysses_lc.shard_batch()."
        )


def _set_attn(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - transformers without the public setter
        model.config._attn_implementation = name


# Layer types whose attention is not plain full causal attention over the whole sequence.
_LOCAL_LAYER_TYPES = {"sliding_attention", "chunked_attention", "linear_attention"}


def check_model_for_ulysses(config, sp_size: int) -> None:
    """Raise ValueError if this model cannot be trained exactly with Ulysses attention at sp_size."""
    cfg = text_config(config)
    if sp_size > 1 and cfg._attn_implementation == "eager":
        raise ValueError(
            "the model was loaded with attn_implementation='eager', whose dense masks cannot be split across "
            "ranks; load it with attn_implementation='sdpa' (ulysses_lc then switches it to Ulysses attention)."
        )
    layer_types = set(getattr(cfg, "layer_types", None) or [])
    local = sorted(layer_types & _LOCAL_LAYER_TYPES) or sorted(
        t for t in layer_types if t not in ("full_attention", "attention")
    )
    uses_window = getattr(cfg, "use_sliding_window", True) and getattr(cfg, "sliding_window", None)
    if not layer_types and uses_window:
        local = ["sliding_attention"]
    if getattr(cfg, "attention_chunk_size", None):
        local = sorted(set(local) | {"chunked_attention"})
    if local and sp_size > 1:
        raise ValueError(
            f"{cfg.model_type} has layers of type {local}, which Ulysses sequence parallelism would silently "
            "train as full causal attention; use a full-attention model (Qwen3, Qwen3-MoE, Llama) or sp_size=1."
        )
    heads = cfg.num_attention_heads
    check_heads(heads, getattr(cfg, "num_key_value_heads", None) or heads, sp_size)
