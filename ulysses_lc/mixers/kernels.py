"""Causal attention kernels over a whole sequence in global order, on one rank's heads.

Legend: shape.py. Every function here takes q [b, h_local, s, d] and k, v [b, h_kv_local, s, d] after the
Ulysses exchange (exchange.py) and communicates nothing.
  causal_attention       F.scaled_dot_product_attention (cuDNN-first on Hopper), flash-attn, or FlashAttention-4
                         (fa4.py)
  document_attention     the same inside each document of a packed sequence (batched runs, or one varlen call),
                         also over a sliding window and with sinks (window_attention.py), which restart per document
The kernels whose forward and backward we call ourselves (kept outputs, head groups) are in explicit_attention.py.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from .explicit_attention import ExplicitAttention
from .fa4 import check_fa4_inputs, fa4_interface
from .window_attention import resolve_how, window_attention

logger = logging.getLogger(__name__)

KERNELS = ("auto", "sdpa", "cudnn", "flash_attention_2", "flash_attention_3", "fa4")

# SDPA backends in order of preference. On Hopper cuDNN ran causal attention at ~1.6x the FLASH_ATTENTION
# backend (one H200, 2026-11-29, Qwen3-0.6B heads at 256k, fwd+bwd: 529 vs 324 TF/s; benchmarks/bench_step.py
# --suite speed, benchmarks/reports/2026-11-29_speed.md); torch's default order prefers FLASH. The order is
# applied with set_priority around every call of the kernel, which covers the checkpoint recompute too (it
# calls this function again), so forward, recompute and backward use one backend. Backends that refuse a
# shape fall through to the next.
_SDPA_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _sdpa_backends(kernel: str):
    from torch.nn.attention import SDPBackend

    names = _SDPA_PRIORITY if kernel in ("auto", "cudnn") else _SDPA_PRIORITY[1:]
    return [getattr(SDPBackend, n) for n in names]


# FlashAttention-4 against cuDNN on one H200 (benchmarks/bench_fa4.py, 2026-12-04, 262,144 tokens, fwd+bwd): 626 vs
# 524 TF/s on Qwen3-0.6B's 16 / 8 heads of 128 (1.19x), 538 vs 426 on gpt-oss-20b's 64 / 8 of 64 (1.26x), and ahead of
# flex at windows 128 / 1024 / 4096 and of torch's varlen on packed documents (BENCHMARKS.md "FlashAttention-4 on
# Hopper"). So "auto" takes it on Hopper where flash-attn-4 is installed, for head dims up to 128, and no attention
# dropout (it has none). At 256 (Qwen3.5's full layers, 8 / 2 heads) it ran 439 against cuDNN's 408 TF/s (1.08x; later
# the same day); tests/test_fa4.py's head-dim-256 case against fp32 passed on an H100 on 2026-12-05, so "auto" takes
# it there too.
FA4_AUTO_MAX_HEAD_DIM = 256


def fa4_auto(head_dim: int | None, dropout: float = 0.0) -> bool:
    """Whether "auto" runs FlashAttention-4 for heads of `head_dim` (None: not known, no) on this machine."""
    if head_dim is None or head_dim > FA4_AUTO_MAX_HEAD_DIM or dropout:
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        fa4_interface()
    except ValueError:
        return False
    return True


def resolve_kernel(kernel: str, head_dim: int | None = None, dropout: float = 0.0) -> str:
    """'auto' -> 'fa4' where `fa4_auto` says so (the model's head dim and attention dropout given), else 'cudnn'
    priority SDPA on Hopper or newer, plain 'sdpa' order elsewhere."""
    if kernel != "auto":
        return kernel
    if fa4_auto(head_dim, dropout):
        return "fa4"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        return "cudnn"
    return "sdpa"


def flash_attn_func(kernel: str):
    """flash-attn's (2, or 3 for kernel='flash_attention_3') flash_attn_func, or a ValueError saying how to install it."""
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
    if kernel == "fa4":
        if dropout:
            raise ValueError(f"attention dropout {dropout} with kernel='fa4': FlashAttention-4 has no dropout; set "
                             "config.attention_dropout=0 or use kernel='auto'.")
        check_fa4_inputs(q_bhsd)
        scale = scaling if scaling is not None else q_bhsd.shape[-1] ** -0.5
        return ExplicitAttention.apply(q_bhsd, k_bhsd, v_bhsd, scale, "fa4", 1, None, [])
    if kernel in ("sdpa", "cudnn", "auto"):
        from torch.nn.attention import sdpa_kernel

        gqa = q_bhsd.shape[1] != k_bhsd.shape[1]
        with sdpa_kernel(_sdpa_backends(kernel), set_priority=True):
            return F.scaled_dot_product_attention(
                q_bhsd, k_bhsd, v_bhsd, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
            )
    out_bshd = flash_attn_func(kernel)(
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
                       how: str = "auto", window: int | None = None, sinks_h=None):
    """Causal attention inside each document of a packed sequence: documents [bounds[i], bounds[i+1]) of the
    whole sequence (bounds start at 0 and end at s); returns [b, h, s, d]. Exact on any kernel.

    how: "loop" (one call per run of equal-length documents, `causal_attention`), "varlen" (one
    variable-length call, CUDA, SDPA kernels), "auto" (varlen where it is available and the loop's calls would
    average fewer than DOCUMENT_VARLEN_TOKENS tokens, else loop). Kept outputs and head groups are not used
    here: a document's backward block is its own length's.

    window, sinks_h: a sliding window and per-head sink logits (window_attention.py), restarting at each
    document's start: one call where window_attention picks "flex" or "flash_window" (CUDA; the documents in its
    mask or as its cu_seqlens), else the band per run of equal-length documents.

    kernel="fa4": one FlashAttention-4 call, the documents as its cu_seqlens (window and sinks included) whatever
    `how` is."""
    if how not in DOCUMENT_KERNELS:
        raise ValueError(f"how={how!r}: pick one of {DOCUMENT_KERNELS}.")
    if kernel == "fa4":
        if dropout:
            raise ValueError(f"attention dropout {dropout} with kernel='fa4': FlashAttention-4 has no dropout; set "
                             "config.attention_dropout=0 or use kernel='auto'.")
        return window_attention(q_bhsd, k_bhsd, v_bhsd, scaling, window, sinks_h, kernel, how="fa4",
                                bounds=tuple(bounds))
    if window is not None or sinks_h is not None:
        one_call = resolve_how("auto", q_bhsd.device, window)
        if one_call in ("flash_window", "flex") and how != "loop":
            try:
                return window_attention(q_bhsd, k_bhsd, v_bhsd, scaling, window, sinks_h, kernel, how=one_call,
                                        bounds=tuple(bounds))
            except ValueError:  # its kernel refused the shape (logged): the band per document
                pass
        attend = functools.partial(window_attention, scaling=scaling, window=window, sinks_h=sinks_h, kernel=kernel)
        return _loop_documents(q_bhsd, k_bhsd, v_bhsd, _equal_runs(bounds), attend)
    runs = _equal_runs(bounds)
    short = (bounds[-1] - bounds[0]) / len(runs) < DOCUMENT_VARLEN_TOKENS
    varlen_ok = (q_bhsd.is_cuda and not dropout and kernel in ("auto", "cudnn", "sdpa")
                 and _varlen_attn() is not None)
    if how == "varlen" or (how == "auto" and short and varlen_ok and len(runs) > 1):
        if not varlen_ok:
            raise ValueError("how='varlen' needs CUDA, an SDPA kernel, no attention dropout and "
                             "torch.nn.attention.varlen; use how='loop'.")
        return _varlen_documents(q_bhsd, k_bhsd, v_bhsd, bounds, scaling)
    attend = functools.partial(causal_attention, scaling=scaling, kernel=kernel, dropout=dropout)
    return _loop_documents(q_bhsd, k_bhsd, v_bhsd, runs, attend)


def _loop_documents(q_bhsd, k_bhsd, v_bhsd, runs, attend):
    """attend(q, k, v) per run of equal-length documents, the run's documents along the batch dim."""
    outs = []
    for a, b, n in runs:
        q, k, v = q_bhsd[:, :, a:b], k_bhsd[:, :, a:b], v_bhsd[:, :, a:b]
        outs.append(attend(q, k, v) if n == 1 else _batched_documents(q, k, v, n, attend))
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


def _batched_documents(q_bhsd, k_bhsd, v_bhsd, n, attend):
    """n equal-length documents laid end to end along s: [b, h, n*L, d] -> n sequences of L along the batch."""
    def split(x):
        b, h, s, d = x.shape
        return x.unflatten(2, (n, s // n)).permute(0, 2, 1, 3, 4).flatten(0, 1)  # [b*n, h, L, d]

    out = attend(split(q_bhsd), split(k_bhsd), split(v_bhsd))
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


__all__ = ["DOCUMENT_KERNELS", "FA4_AUTO_MAX_HEAD_DIM", "KERNELS", "causal_attention", "document_attention", "fa4_auto",
           "flash_attn_func", "resolve_kernel"]
