"""Sliding-window causal attention and attention sinks over a whole sequence in global order, on one rank's heads.

Legend: shape.py; w the window: the query at position i sees the keys i - w < j <= i (transformers' sliding-window
mask, `masking_utils.sliding_window_overlay`); n chunks of c = min(w, s) positions, the sequence padded to n * c.
Same inputs as kernels.py (q [b, h_local, s, d], k, v [b, h_kv_local, s, d] after the Ulysses exchange); communicates
nothing. After the exchange a rank holds the whole sequence for its heads, so a window and a sink, both per head and
along the sequence, are computed here locally and exactly, whatever sp is (ring attention cannot: its ranks never
hold a query's whole window in one place).

The band as two causal calls. Query chunk m sees key chunk m up to itself (a causal block) and the keys of chunk
m - 1 after its own offset (j' > i': the strictly upper triangle). Reversing both chunks turns that triangle into a
causal block too (j'' < i'', rows c - 1 and keys 0 dropped), so the band is two batched calls of a causal kernel,
each over n chunks of c: the FLOPs the window needs, through the explicit forward and backward ops of
explicit_attention.py (cuDNN first on Hopper, the CPU flash kernel on CPU). The two outputs merge by their log-sum-
exps. The backward runs each call's backward op with the *merged* output and log-sum-exp: its dS = P (dP - delta)
then uses the whole row's softmax P and delta = rowsum(dout * out), which is the exact gradient of the whole.

Sinks (gpt-oss's `module.sinks`): one learned logit per head in every row's softmax denominator, with no value:
out = O exp(L - L'), L' = logaddexp(L, sink). The backward above with L' in place of L is exact for q, k, v (the
sink is one more column of P, with value 0), and d sink = -sum_i exp(sink - L'_i) delta_i.

`how="flash_window"`: one call of torch's FLASH kernel with its own window (aten._flash_attention_forward,
window_size_left = w - 1; documents as its cu_seqlens), the same merge-free sink and backward; CUDA only.

`how="flex"`: one compiled call of torch's flex attention over the band's block mask (flex_window.py), sinks
through its log-sum-exp, documents in the mask; CUDA only, no kept output (its backward is flex's own).

`how="fa4"`: one FlashAttention-4 call (fa4.py: window, sinks, documents as cu_seqlens), what kernel="fa4" runs.

Which on CUDA (`resolve_how`), measured on an H200 at 256k tokens (benchmarks/bench_window.py, 2026-12-02, torch
2.11; fwd+bwd TF/s on the FLOPs the window needs over full causal cuDNN's on the same heads; WINDOW_RATES):
flex 0.19 / 0.57 / 0.71 (with sinks 0.18 / 0.55 / 0.70; torch's own flex call in the same run 0.19 / 0.57 / 0.71),
flash_window 0.14 / 0.41 / 0.55 (0.08 / 0.31 / 0.50) and
the band over cuDNN 0.06 / 0.28 / 0.66 (0.04 / 0.23 / 0.59) at windows of 128 (gpt-oss-20b heads, 64 x 64) / 1024
(Gemma 3 27B, 32 x 128) / 4096 (Mistral 7B, 32 x 128). `resolve_how` takes the highest
measured rate at a window, linear in log(window) between the points (WINDOW_RATES): flex where it runs (it is
the highest at every window), else flash_window up to 2,162 and the band beyond; a layer that keeps its output
takes the explicit kernels, and sink layers without a window the band (one cuDNN causal call). Each falls back to
the next where its kernel refuses the shape.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from . import fallbacks
from .explicit_attention import causal_ops, explicit_backends
from .fa4 import fa4_backward, fa4_forward
from .flex_window import flex_available, flex_window_attention

logger = logging.getLogger(__name__)

WINDOW_HOWS = ("auto", "band", "flash_window", "flex", "fa4")
# (window, fwd+bwd rate over causal cuDNN's, no sinks) per implementation, the module docstring's H200 measurement:
# resolve_how picks the highest at a window, and the step estimate (sizing.py) prices window layers with it.
WINDOW_RATES = {"flash_window": ((128, 0.141), (1024, 0.404), (4096, 0.542)),
                "band": ((128, 0.058), (1024, 0.280), (4096, 0.648)),
                "flex": ((128, 0.195), (1024, 0.569), (4096, 0.705)),
                "fa4": ((128, 0.232), (1024, 0.759), (4096, 1.054))}  # bench_fa4.py, 2026-12-04: kernel 'fa4' only
_MERGE_BYTES = 256 << 20  # fp32 temporaries of the merge and of the sink's row sums, one slice at a time


def band_bytes_per_token(shape) -> int:
    """Device bytes per local token the band holds besides the causal kernel's own, in one layer's forward or
    backward: the reversed copies of q, k, v (and of out, dout in backward) for the second call, and its output
    and gradients before they are added in (bf16: 2 (3 q + 3 kv)); a `shape.ModelShape`'s widths."""
    return 2 * (3 * shape.q_width + 3 * shape.kv_width)


def resolve_how(how: str, device: torch.device, window: int | None = None, kept: bool = False) -> str:
    """The implementation for `how` on `device`: "auto" is the band on CPU; on CUDA the one of highest measured rate
    at this window (WINDOW_RATES: flash_window up to 2,162, the band beyond), flex among them
    where it runs and the layer does not keep its output (`kept`): flex's backward cannot take a kept output, so
    "flex" with `kept` is auto's pick too."""
    if how not in WINDOW_HOWS:
        raise ValueError(f"how={how!r}: pick one of {WINDOW_HOWS}.")
    if how in ("flash_window", "flex", "fa4") and device.type != "cuda":
        kind = {"flash_window": "torch's CUDA FLASH kernel", "flex": "flex attention, whose backward is CUDA-only",
                "fa4": "FlashAttention-4's CUDA kernels"}[how]
        raise ValueError(f"how={how!r} runs {kind}; use how='band' on CPU.")
    if how == "flex" and kept:
        how = "auto"
    if how == "auto":
        if device.type != "cuda" or window is None:
            return "band"  # sinks without a window: one cuDNN causal call
        hows = ["flash_window", "band"] + (["flex"] if not kept and flex_available(device) else [])
        return max(hows, key=lambda h: rate_vs_causal(h, window))  # the first of equals
    return how


def rate_vs_causal(how: str, window: int) -> float:
    """WINDOW_RATES[how] at `window`: linear in log(window) between the measured points, flat beyond them."""
    points = WINDOW_RATES[how]
    if window <= points[0][0]:
        return points[0][1]
    for (w0, r0), (w1, r1) in zip(points, points[1:]):
        if window <= w1:
            return r0 + (r1 - r0) * math.log(window / w0) / math.log(w1 / w0)
    return points[-1][1]


def describe_how(window: int | None, sinks: bool, on_gpu: bool = True) -> str:
    """What computes a window or sink layer under how="auto" on a GPU (on_gpu) or here on the CPU: the start-up
    block's words."""
    if not on_gpu:
        return "the band over the CPU flash kernel"
    how = resolve_how("auto", torch.device("cuda"), window)
    if how == "flex":
        return "flex attention (torch.compile)" + (", its sinks through the log-sum-exp" if sinks else "")
    if how == "flash_window":
        return "flash_window: torch's FLASH kernel with its window" + (", sinks merged after it" if sinks else "")
    return "the band over cuDNN" + (" with its sinks" if sinks else "")


# ---- layouts of the band: [b, H, n c, d] <-> n chunks along the batch ----

def _pad(x: torch.Tensor, s_pad: int, dim: int = 2) -> torch.Tensor:
    if x.shape[dim] == s_pad:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, s_pad - x.shape[dim]]
    return F.pad(x, pad)


def _chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """[b, H, n c, ...] -> [b, n, H, c, ...] (a view)."""
    return x.unflatten(2, (n, -1)).transpose(1, 2)


def _diag(x5: torch.Tensor) -> torch.Tensor:
    """The causal call's operand: every chunk, [b n, H, c, ...] (a view for b = 1)."""
    return x5.flatten(0, 1)


def _edge_rows(x5: torch.Tensor) -> torch.Tensor:
    """The second call's query-side operand: rows 0 .. c-2 of chunks 1 .. n-1, reversed (a copy)."""
    return x5[:, 1:, :, :-1].flip(3).flatten(0, 1)


def _edge_keys(x5: torch.Tensor) -> torch.Tensor:
    """The second call's key-side operand: keys 1 .. c-1 of chunks 0 .. n-2, reversed (a copy)."""
    return x5[:, :-1, :, 1:].flip(3).flatten(0, 1)


def _unedge(y: torch.Tensor, b: int) -> torch.Tensor:
    """A second-call result [b (n-1), H, c-1, ...] back in chunk order, [b, n-1, H, c-1, ...] (a view)."""
    return y.unflatten(0, (b, -1)).flip(3)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 rowsum(a * b) over the last dim, [..., d] -> [...], in slices of _MERGE_BYTES."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    acc = torch.promote_types(a.dtype, torch.float32)
    out = torch.empty(a2.shape[0], dtype=acc, device=a.device)
    step = max(1, _MERGE_BYTES // (8 * a.shape[-1]))
    for i in range(0, a2.shape[0], step):
        out[i:i + step] = (a2[i:i + step].to(acc) * b2[i:i + step].to(acc)).sum(-1)
    return out.view(a.shape[:-1])


def _with_sinks(lse_bhs: torch.Tensor, sinks_h: torch.Tensor | None) -> torch.Tensor:
    if sinks_h is None:
        return lse_bhs
    return torch.logaddexp(lse_bhs, sinks_h.detach().to(lse_bhs.dtype).view(1, -1, 1))


def _sink_grad(dout, out, lse_final, sinks_h):
    """d sink_h = -sum over rows of exp(sink_h - L') rowsum(dout * out)."""
    delta = _row_dot(dout, out).to(lse_final.dtype)
    p_sink = torch.exp(sinks_h.detach().to(lse_final.dtype).view(1, -1, 1) - lse_final)
    return -(p_sink * delta).sum((0, 2)).to(sinks_h.dtype)


# ---- the band through an explicit causal backend ----

def _as_layout(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """x with ref's strides (the backward ops read q, out and dout alike)."""
    return x if x.stride() == ref.stride() else torch.empty_like(ref).copy_(x)


def _band_forward(q, k, v, scale, c, backend):
    """(out [b, H, s, d], lse [b, H, s] fp32 before sinks, aux) of windowed causal attention with chunks of c."""
    fwd = causal_ops(backend)[0]
    b, H, s, d = q.shape
    n = -(-s // c)
    if n == 1:  # the window holds the sequence (or no window: a sink layer): one causal call
        out, lse, aux = fwd(q, k, v, scale)
        return out, lse.reshape(b, H, s).to(torch.promote_types(lse.dtype, torch.float32)), ((lse.dim(), lse.dtype),
                                                                                              aux)
    q5, k5, v5 = (_chunks(_pad(x, n * c), n) for x in (q, k, v))
    out_d, lse_d, aux_d = fwd(_diag(q5), _diag(k5), _diag(v5), scale)
    aux = ((lse_d.dim(), lse_d.dtype), aux_d)
    acc = torch.promote_types(lse_d.dtype, torch.float32)
    out = q.new_empty(b, H, n * c, d)
    out5, lse5 = _chunks(out, n), lse_d.reshape(b * n, H, c).unflatten(0, (b, n)).to(acc)
    out5.copy_(out_d.unflatten(0, (b, n)))
    del out_d
    if n > 1 and c > 1:
        out_e, lse_e, aux_e = fwd(_edge_rows(q5), _edge_keys(k5), _edge_keys(v5), scale)
        aux += (aux_e,)
        out_e5, lse_e5 = _unedge(out_e, b), _unedge(lse_e.reshape(b * (n - 1), H, c - 1).to(acc), b)
        step = max(1, _MERGE_BYTES // (8 * H * c * d * b))
        for m in range(0, n - 1, step):  # rows 0 .. c-2 of chunks 1 .. n-1 hold both calls
            rows = (slice(None), slice(1 + m, 1 + m + step), slice(None), slice(None, -1))
            l_d, l_e = lse5[rows], lse_e5[:, m:m + step]
            l_both = torch.logaddexp(l_d, l_e)
            merged = (out5[rows].to(acc) * torch.exp(l_d - l_both).unsqueeze(-1)
                      + out_e5[:, m:m + step].to(acc) * torch.exp(l_e - l_both).unsqueeze(-1))
            out5[rows].copy_(merged)
            lse5[rows] = l_both
        del out_e, out_e5
    lse = lse5.transpose(1, 2).reshape(b, H, n * c)
    return out[:, :, :s], lse[:, :, :s].contiguous(), aux


def _band_backward(dout, q, k, v, out, lse_final, aux, scale, c, backend):
    """(dq, dk, dv) of the band, each call's backward op given the final out and log-sum-exp (module docstring)."""
    bwd = causal_ops(backend)[1]
    b, H, s, d = q.shape
    n = -(-s // c)
    q5, k5, v5, dout5, out5 = (_chunks(_pad(x, n * c), n) for x in (q, k, v, dout, out))
    lse5 = _pad(lse_final, n * c).view(b, H, n, c).transpose(1, 2)  # [b, n, H, c]
    lse_nd, lse_dtype = aux[0]

    def lse_arg(lse):  # the backend's own log-sum-exp: [B, H, L] or (cuDNN) [B, H, L, 1], its dtype
        lse = lse.to(lse_dtype).contiguous()
        return lse.unsqueeze(-1) if lse_nd == 4 else lse

    if n == 1:
        return bwd(_as_layout(dout, q), q, k, v, _as_layout(out, q), lse_arg(lse_final), aux[1], scale)
    q_d = _diag(q5)
    grads = bwd(_as_layout(_diag(dout5), q_d), q_d, _diag(k5), _diag(v5), _as_layout(_diag(out5), q_d),
                lse_arg(_diag(lse5)), aux[1], scale)
    dq, dk, dv = (x.new_empty(b, x.shape[1], n * c, d) for x in (q, k, v))
    for full, g in zip((dq, dk, dv), grads):
        _chunks(full, n).copy_(g.unflatten(0, (b, n)))
    del grads
    if len(aux) > 2:
        edge = bwd(_edge_rows(dout5), _edge_rows(q5), _edge_keys(k5), _edge_keys(v5), _edge_rows(out5),
                   lse_arg(_edge_rows(lse5)), aux[2], scale)
        _chunks(dq, n)[:, 1:, :, :-1] += _unedge(edge[0], b)
        _chunks(dk, n)[:, :-1, :, 1:] += _unedge(edge[1], b)
        _chunks(dv, n)[:, :-1, :, 1:] += _unedge(edge[2], b)
    return dq[:, :, :s], dk[:, :, :s], dv[:, :, :s]


def _apply_sinks(out, lse, lse_final):
    """out *= exp(L - L') in place, in fp32 slices along the sequence."""
    step = max(1, _MERGE_BYTES // (4 * out.shape[0] * out.shape[1] * out.shape[3]))
    for i in range(0, out.shape[2], step):
        scale = torch.exp(lse[:, :, i:i + step] - lse_final[:, :, i:i + step]).unsqueeze(-1)
        out[:, :, i:i + step].copy_(out[:, :, i:i + step].to(scale.dtype) * scale)
    return out


# ---- one call of torch's FLASH kernel with its own window (documents as cu_seqlens) ----

def _flash_cu(b, s, bounds, device):
    starts = bounds if bounds is not None else (0, s)
    cu = [i * s + x for i in range(b) for x in starts[:-1]] + [b * s]
    longest = max(y - x for x, y in zip(starts[:-1], starts[1:]))
    return torch.tensor(cu, dtype=torch.int32, device=device), longest


def _thd(x):  # [b, H, s, d] -> [b s, H, d]
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _flash_window_forward(q, k, v, scale, window, bounds):
    b, H, s, d = q.shape
    cu, longest = _flash_cu(b, s, bounds, q.device)
    left = -1 if window is None else window - 1
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        _thd(q), _thd(k), _thd(v), cu, cu, longest, longest, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=0)
    out_bhsd = out.view(b, s, H, d).transpose(1, 2)
    return out_bhsd, lse.view(H, b, s).transpose(0, 1).float(), (cu, longest, rng, unused, left, lse.dtype)


def _flash_window_backward(dout, q, k, v, out, lse_final, aux, scale):
    b, H, s, d = q.shape
    cu, longest, rng, unused, left, lse_dtype = aux
    lse = lse_final.transpose(0, 1).reshape(H, b * s).to(lse_dtype).contiguous()
    grads = torch.ops.aten._flash_attention_backward(
        _thd(dout).contiguous(), _thd(q), _thd(k), _thd(v), _thd(out), lse, cu, cu, longest, longest, 0.0, True, rng,
        unused, scale=scale, window_size_left=left, window_size_right=0)
    return tuple(g.view(b, s, -1, d).transpose(1, 2) for g in grads)


class WindowAttention(torch.autograd.Function):
    """Windowed causal attention with optional sinks through `how` ("band": an explicit causal `backend`;
    "flash_window"; "fa4", its sinks in the kernel). kept None: run the forward and append (out, lse, aux) to
    `sink_list`; kept = (out, lse, aux): return them without running it (the checkpoint recompute, attention.py).
    Saves q, k, v, out and the final log-sum-exp [b, h, s] fp32; communicates nothing. Backward: the kernels' backward ops (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, window, how, backend, bounds, kept, sink_list):
        s = q.shape[2]
        c = s if window is None else min(window, s)
        if kept is not None:
            out, lse_final, aux = kept
            out = out.detach()
        else:
            if how == "fa4":
                out, lse_final, aux = fa4_forward(q, k, v, scale, window, bounds, sinks)
            else:
                out, lse, aux = (_flash_window_forward(q, k, v, scale, window, bounds) if how == "flash_window"
                                 else _band_forward(q, k, v, scale, c, backend))
                lse_final = _with_sinks(lse, sinks)
                if sinks is not None:
                    out = _apply_sinks(out, lse, lse_final)
            if sink_list is not None:
                sink_list.append((out.detach(), lse_final, aux))
        ctx.save_for_backward(q, k, v, out, lse_final, sinks)
        ctx.scale, ctx.c, ctx.how, ctx.backend, ctx.aux = scale, c, how, backend, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_final, sinks = ctx.saved_tensors
        if ctx.how == "fa4":
            dq, dk, dv, dsinks = fa4_backward(dout, q, k, v, out, lse_final, ctx.aux, ctx.scale, sinks)
            return dq, dk, dv, dsinks if ctx.needs_input_grad[3] else None, None, None, None, None, None, None, None
        if ctx.how == "flash_window":
            dq, dk, dv = _flash_window_backward(dout, q, k, v, out, lse_final, ctx.aux, ctx.scale)
        else:
            dq, dk, dv = _band_backward(dout, q, k, v, out, lse_final, ctx.aux, ctx.scale, ctx.c, ctx.backend)
        dsinks = _sink_grad(dout, out, lse_final, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def _is_compile_error(e: BaseException) -> bool:
    """torch.compile's own failures (dynamo, inductor, a Triton build): no kernel for these inputs here. A CUDA
    error (an AcceleratorError) is none: it propagates."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor", "triton"))


def window_attention(q_bhsd, k_bhsd, v_bhsd, scaling, window: int | None = None, sinks_h=None, kernel: str = "auto",
                     how: str = "auto", bounds=None, sink_list: list | None = None, kept=None):
    """Causal attention over the last `window` keys of each query (None: all of them), with a learned logit per head
    in the softmax denominator when `sinks_h` [h_local] is given; returns [b, h, s, d].

    kernel: the layer's kernel setting; the band runs through the explicit SDPA backends of "auto" unless it
        names one ("cudnn", "sdpa"); "fa4" runs how="fa4" whatever `how` is. how: "band", "flash_window" (CUDA),
        "flex" (CUDA), "fa4" (CUDA), "auto" (resolve_how; on CUDA the next one is tried where the first refuses).
    bounds: packed documents [0, ..., s] (how="flash_window" or "fa4": one varlen call; "flex": in its mask;
        kernels.document_attention runs the band per document). sink_list / kept: the kept-output handshake (attention.kept_output_attention).
    """
    scale = scaling if scaling is not None else q_bhsd.shape[-1] ** -0.5
    how = "fa4" if kernel == "fa4" else how
    if kept is not None:
        how, backend, kept_tensors = kept
        return WindowAttention.apply(q_bhsd, k_bhsd, v_bhsd, sinks_h, scale, window, how, backend, bounds,
                                     kept_tensors, None)
    chosen = resolve_how(how, q_bhsd.device, window, kept=sink_list is not None)
    if chosen == "flex":
        key = fallbacks.call_key("window attention", "flex", q_bhsd, k_bhsd, window)
        if not fallbacks.refused(key):
            try:
                return flex_window_attention(q_bhsd, k_bhsd, v_bhsd, scale, window, sinks_h, bounds)
            except Exception as e:  # noqa: BLE001 - a compile failure is flex refusing these inputs; the rest propagates
                if not (_is_compile_error(e) or isinstance(e, NotImplementedError)):
                    raise
                fallbacks.record(key, e)
        if how == "flex":
            raise ValueError(f"flex attention refused {tuple(q_bhsd.shape)} {q_bhsd.dtype}: "
                             f"{fallbacks.summary()}; use how='auto'.")
        chosen = resolve_how("auto", q_bhsd.device, window, kept=True)  # the best explicit kernel
    if bounds is not None and chosen not in ("flash_window", "fa4"):
        raise ValueError("bounds need how='flash_window', 'flex' or 'fa4'; kernels.document_attention runs the band "
                         "per document.")
    band = [("band", b) for b in explicit_backends(q_bhsd, kernel if kernel in ("cudnn", "sdpa") else "auto")]
    tries = {"flash_window": [("flash_window", "flash")], "fa4": [("fa4", "fa4")]}.get(chosen, band)
    if how in ("auto", "flex") and q_bhsd.is_cuda and bounds is None:
        tries += band if chosen == "flash_window" else [("flash_window", "flash")]
    for impl, backend in tries:
        key = fallbacks.call_key("window attention", f"{impl}/{backend}", q_bhsd, k_bhsd, window)
        if fallbacks.refused(key):
            continue
        got = []
        try:
            out = WindowAttention.apply(q_bhsd, k_bhsd, v_bhsd, sinks_h, scale, window, impl, backend, bounds, None,
                                        got)
        except RuntimeError as e:  # every error that is not a refusal (out of memory too) propagates
            if not fallbacks.is_no_kernel_error(e):
                raise
            fallbacks.record(key, e)
            continue
        if sink_list is not None:
            sink_list.append((impl, backend, got[0]))
        return out
    raise ValueError(f"no kernel takes windowed attention of {tuple(q_bhsd.shape)} {q_bhsd.dtype} on "
                     f"{q_bhsd.device} (how={how!r}); on CUDA use bf16/fp16 and head_dim <= 256.")


__all__ = ["WINDOW_HOWS", "WINDOW_RATES", "WindowAttention", "band_bytes_per_token", "describe_how", "rate_vs_causal",
           "resolve_how", "window_attention"]
