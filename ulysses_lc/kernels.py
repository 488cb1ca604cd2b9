"""Causal attention kernels over a whole sequence in global order, on one rank's heads.

Legend: shape.py. Every function here takes q [b, h_local, s, d] and k, v [b, h_kv_local, s, d] after the
Ulysses exchange (exchange.py) and communicates nothing.
  causal_attention       F.scaled_dot_product_attention (cuDNN-first on Hopper) or flash-attn
  explicit_attention     SDPA's own cuDNN / FLASH / CPU-flash forward and backward ops called directly, so the
                         forward's output can be kept for a checkpoint recompute (attention.py) and the kernel
                         can run over groups of heads (its backward block, one group at a time)
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

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


# Packed documents. One kernel call per run of equal-length documents (the run batched) computes the block
# diagonal's FLOPs only, each call the kernel's own causal case (cuDNN first on Hopper). Measured on an H200 at 256k
# tokens, fwd+bwd, rate against one 256k call on the FLOPs needed (BENCHMARKS.md I): equal lengths 0.96-1.05 from
# 4k to 32k per document (one batched call); mixed lengths, one call each, 0.99 / 0.82 / 0.49 / 0.18 / 0.01 at
# 32k / 16k / 8k / 4k / 1k, where one variable-length flash call (torch.nn.attention.varlen) over them all holds
# 0.62 / 0.60 / 0.55 / 0.48 / 0.26. So on CUDA the calls the loop would make decide: fewer than
# DOCUMENT_VARLEN_TOKENS tokens per call on average and varlen takes the sequence.
DOCUMENT_VARLEN_TOKENS = 12288
DOCUMENT_KERNELS = ("auto", "loop", "varlen")


def document_attention(q_bhsd, k_bhsd, v_bhsd, bounds, scaling, kernel: str = "sdpa", dropout: float = 0.0,
                       how: str = "auto"):
    """Causal attention inside each document of a packed sequence: documents [bounds[i], bounds[i+1]) of the
    whole sequence (bounds start at 0 and end at s); returns [b, h, s, d]. Exact on any kernel.

    how: "loop" (one call per run of equal-length documents, `causal_attention`), "varlen" (one
    variable-length call, CUDA, SDPA kernels), "auto" (varlen where it is available and the loop's calls would
    average fewer than DOCUMENT_VARLEN_TOKENS tokens, else loop). Kept outputs and head groups are not used
    here: a document's backward block is its own length's."""
    if how not in DOCUMENT_KERNELS:
        raise ValueError(f"how={how!r}: pick one of {DOCUMENT_KERNELS}.")
    runs = _equal_runs(bounds)
    short = (bounds[-1] - bounds[0]) / len(runs) < DOCUMENT_VARLEN_TOKENS
    varlen_ok = q_bhsd.is_cuda and not dropout and kernel in _KEPT_BACKENDS and _varlen_attn() is not None
    if how == "varlen" or (how == "auto" and short and varlen_ok and len(runs) > 1):
        if not varlen_ok:
            raise ValueError("how='varlen' needs CUDA, an SDPA kernel, no attention dropout and "
                             "torch.nn.attention.varlen; use how='loop'.")
        return _varlen_documents(q_bhsd, k_bhsd, v_bhsd, bounds, scaling)
    outs = []
    for a, b, n in runs:
        if n == 1:
            outs.append(causal_attention(q_bhsd[:, :, a:b], k_bhsd[:, :, a:b], v_bhsd[:, :, a:b], scaling, kernel, dropout))
        else:  # n documents of one length: one call with them along the batch dim
            outs.append(_batched_documents(q_bhsd[:, :, a:b], k_bhsd[:, :, a:b], v_bhsd[:, :, a:b], n, scaling, kernel,
                                           dropout))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _equal_runs(bounds):
    """(start, end, count) of maximal runs of consecutive documents of one length."""
    runs, i = [], 0
    while i < len(bounds) - 1:
        length, j = bounds[i + 1] - bounds[i], i + 1
        while j < len(bounds) - 1 and bounds[j + 1] - bounds[j] == length:
            j += 1
        runs.append((bounds[i], bounds[j], j - i))
        i = j
    return runs


def _batched_documents(q_bhsd, k_bhsd, v_bhsd, n, scaling, kernel, dropout):
    """n equal-length documents laid end to end along s: [b, h, n*L, d] -> n sequences of L along the batch."""
    def split(x):
        b, h, s, d = x.shape
        return x.unflatten(2, (n, s // n)).permute(0, 2, 1, 3, 4).flatten(0, 1)  # [b*n, h, L, d]

    out = causal_attention(split(q_bhsd), split(k_bhsd), split(v_bhsd), scaling, kernel, dropout)
    b = q_bhsd.shape[0]
    return out.unflatten(0, (b, n)).permute(0, 2, 1, 3, 4).flatten(2, 3)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_documents(q_bhsd, k_bhsd, v_bhsd, bounds, scaling):
    """One torch.nn.attention.varlen call over every document of a batch-1 sequence. Its signature changed
    across torch releases (is_causal; then window_size, scale, enable_gqa): both are handled here."""
    import inspect

    varlen_attn = _varlen_attn()
    if q_bhsd.shape[0] != 1:
        raise ValueError("packed documents train one sequence per step (batch 1).")
    params = inspect.signature(varlen_attn).parameters
    h, hkv, d = q_bhsd.shape[1], k_bhsd.shape[1], q_bhsd.shape[-1]
    q_thd = q_bhsd[0].transpose(0, 1)
    k_thd, v_thd = k_bhsd[0].transpose(0, 1), v_bhsd[0].transpose(0, 1)
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    scale = scaling if scaling is not None else d ** -0.5
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != d ** -0.5:
        q_thd = q_thd * (scale * d ** 0.5)
    if h != hkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k_thd, v_thd = k_thd.repeat_interleave(h // hkv, 1), v_thd.repeat_interleave(h // hkv, 1)
    cu = torch.tensor(bounds, dtype=torch.int32, device=q_bhsd.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    out_thd = varlen_attn(q_thd.contiguous(), k_thd.contiguous(), v_thd.contiguous(), cu, cu, longest, longest,
                          **kwargs)
    out_thd = out_thd[0] if isinstance(out_thd, tuple) else out_thd
    return out_thd.transpose(0, 1).unsqueeze(0)


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


__all__ = [
    "KERNELS", "attention_backward_block_bytes", "attention_head_groups", "causal_attention", "document_attention",
    "explicit_attention",
    "keeps_attention_outputs", "resolve_kernel", "valid_head_groups",
]
