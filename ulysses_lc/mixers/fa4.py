"""FlashAttention-4's forward and backward ops (flash-attn-4: CuTe DSL kernels for Hopper and Blackwell), CUDA only.

Legend: shape.py; t = b s, the tokens of a packed call. Same inputs as kernels.py (q [b, h_local, s, d], k, v
[b, h_kv_local, s, d] after the Ulysses exchange); communicates nothing. FA4 reads [b, s, h, d] (or [t, h, d] with
cu_seqlens) through its strides, so the transposes here are views.

One call per layer: causal, over a sliding window (window_size = (w - 1, 0): the query at i sees i - w < j <= i, as
window_attention.py), packed documents as its cu_seqlens, GQA in the kernel, and gpt-oss's sinks in its softmax
(`learnable_sink`: one logit per head in natural-log units, in the denominator and the log-sum-exp, with no value;
its backward returns d sink). The forward and backward are called apart (`fa4_forward`, `fa4_backward`): the
forward's output and log-sum-exp can be kept for a checkpoint recompute and the kernel run over head groups, as with
SDPA's ops (explicit_attention.py). Those two are flash-attn-4's internal `_flash_attn_fwd` / `_flash_attn_bwd`
(its public `flash_attn_func` is one autograd Function), so the `fa4` extra pins the release they were read from.

Measured on one H200 (benchmarks/bench_fa4.py, 2026-12-04): see BENCHMARKS.md "FlashAttention-4 on Hopper".
"""

from __future__ import annotations

import functools

import torch

FA4_VERSION = "4.0.0b40"  # the release whose internal ops this module calls (pyproject's fa4 extra)
FA4_INSTALL = (f"pip install 'ulysses_lc[fa4]' (flash-attn-4=={FA4_VERSION} over nvidia-cutlass-dsl[cu13]; "
               "README: the wheel set for a machine without network)")
FA4_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _interface():
    from flash_attn.cute import interface

    return interface


def fa4_interface():
    """flash-attn-4's interface module, or a ValueError saying how to install it."""
    try:
        return _interface()
    except ImportError as e:
        raise ValueError(f"kernel='fa4' needs flash-attn-4, which is not importable here ({e}): {FA4_INSTALL}; "
                         "or use kernel='auto'.") from e


def check_fa4(device: torch.device | None = None) -> None:
    """Raise ValueError unless FA4 can run here: flash-attn-4 importable and a CUDA GPU of compute capability 9.0
    (Hopper) or newer, which its kernels are built for."""
    if not torch.cuda.is_available():
        raise ValueError("kernel='fa4' runs FlashAttention-4's CUDA kernels and this machine has no CUDA GPU; "
                         "use kernel='auto' (the CPU flash kernel here).")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"kernel='fa4' needs a Hopper or newer GPU (compute capability 9.0+); this one is "
                         f"{major}.{minor}: use kernel='auto' (cuDNN or FLASH SDPA).")
    fa4_interface()


def check_fa4_inputs(q_bhsd: torch.Tensor) -> None:
    if not q_bhsd.is_cuda or q_bhsd.dtype not in FA4_DTYPES:
        raise ValueError(f"kernel='fa4' takes bf16 or fp16 CUDA tensors, got {q_bhsd.dtype} on {q_bhsd.device}: "
                         "load the model in bf16 (--dtype bf16), or use kernel='auto'.")


def _bshd(x):  # [b, h, s, d] -> [b, s, h, d], a view
    return x.transpose(1, 2)


def _thd(x):  # [b, h, s, d] -> [b s, h, d], a view for b = 1
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _cu_seqlens(b: int, s: int, bounds, device):
    """(cu_seqlens int32 over the b sequences' documents laid end to end, the longest document)."""
    cu = [i * s + x for i in range(b) for x in bounds[:-1]] + [b * s]
    longest = max(y - x for x, y in zip(bounds[:-1], bounds[1:]))
    return torch.tensor(cu, dtype=torch.int32, device=device), longest


def _window(window: int | None):
    return (None, None) if window is None else (window - 1, 0)


def fa4_forward(q, k, v, scale: float, window: int | None = None, bounds=None, sinks_h=None):
    """(out [b, h, s, d], lse [b, h, s] fp32 with the sinks in it, aux) of one FA4 causal call: over the last
    `window` keys (None: all), inside documents [bounds[i], bounds[i+1]) (None: one), with per-head sink logits."""
    fa4 = fa4_interface()
    check_fa4_inputs(q)
    b, h, s, d = q.shape
    left, right = _window(window)
    sink = None if sinks_h is None else sinks_h.detach()
    if bounds is None:
        out, lse, *_ = fa4._flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=True,
                                           window_size_left=left, window_size_right=right, learnable_sink=sink,
                                           return_lse=True)
        return _bshd(out), lse, (None, None, window)
    cu, longest = _cu_seqlens(b, s, bounds, q.device)
    out, lse, *_ = fa4._flash_attn_fwd(_thd(q), _thd(k), _thd(v), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scale, causal=True,
                                       window_size_left=left, window_size_right=right, learnable_sink=sink,
                                       return_lse=True)
    return out.view(b, s, h, d).transpose(1, 2), lse.view(h, b, s).transpose(0, 1), (cu, longest, window)


def fa4_backward(dout, q, k, v, out, lse, aux, scale: float, sinks_h=None):
    """(dq, dk, dv, d sinks or None) of `fa4_forward`'s call, from its (or a merged) output and log-sum-exp."""
    fa4 = fa4_interface()
    cu, longest, window = aux
    left, right = _window(window)
    b, h, s, d = q.shape
    sink = None if sinks_h is None else sinks_h.detach()
    kw = dict(softmax_scale=scale, causal=True, window_size_left=left, window_size_right=right, learnable_sink=sink)
    if cu is None:
        grads = fa4._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse.contiguous(), **kw)
        dq, dk, dv = (_bshd(g) for g in grads[:3])
    else:
        lse_ht = lse.transpose(0, 1).reshape(h, b * s).contiguous()
        grads = fa4._flash_attn_bwd(_thd(q), _thd(k), _thd(v), _thd(out), _thd(dout), lse_ht, cu_seqlens_q=cu,
                                    cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, **kw)
        dq, dk, dv = (g.view(b, s, g.shape[1], d).transpose(1, 2) for g in grads[:3])
    return dq, dk, dv, (grads[3] if sinks_h is not None else None)


# explicit_attention's backend signature: forward(q, k, v, scale) -> (out, lse, aux), backward(dout, q, k, v, out,
# lse, aux, scale) -> (dq, dk, dv), full causal attention.

def causal_forward(q, k, v, scale):
    return fa4_forward(q, k, v, scale)


def causal_backward(dout, q, k, v, out, lse, aux, scale):
    return fa4_backward(dout, q, k, v, out, lse, aux, scale)[:3]


def backward_block_bytes(seq: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Bytes FA4's backward holds besides out, dq, dk, dv (its _flash_attn_bwd, SM90): the fp32 dq accumulator, the
    fp32 rowsum(dout out) and log2 log-sum-exp per query head, and for GQA fp32 dk, dv accumulators per kv head
    (head dims rounded up to 32, sequences to the tile: left out)."""
    return 4 * heads * seq * head_dim + 8 * heads * seq + (8 * kv_heads * seq * head_dim if kv_heads != heads else 0)


__all__ = ["FA4_INSTALL", "FA4_VERSION", "backward_block_bytes", "check_fa4", "fa4_backward", "fa4_forward",
           "fa4_interface"]
