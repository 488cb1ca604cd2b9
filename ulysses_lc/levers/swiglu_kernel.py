"""SwiGLU's Triton kernels, forward and backward: one pass over a tile's gate and up projections each way.

Legend: g, u the gate and up projections of one MLP tile [c, i] (any shape, contiguous, flattened here), s = sigmoid(g).
Forward  p = g s u.  Backward from dp:  du = dp g s,  dg = dp u s (1 + g (1 - s)).  Computed in fp32 and rounded once to
the inputs' dtype. Imported only where the kernel runs (swiglu.py): it needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _swiglu_fwd(g_ptr, u_ptr, p_ptr, n, BLOCK: tl.constexpr):
    # int64 offsets: a tile's [c, i] passes 2^31 elements at long sequences (16k rows x Llama-3.1-8B's 14336 is 2^27.8,
    # a hand-set tile count can go far past it).
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    p = g / (1.0 + tl.exp(-g)) * u  # g sigmoid(g) u (tl.sigmoid is a jit function Triton's interpreter cannot call)
    tl.store(p_ptr + at, p.to(p_ptr.dtype.element_ty), mask=mask)


def _swiglu_bwd(dp_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    dp = tl.load(dp_ptr + at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    du = dp * g * s
    dg = dp * u * s * (1.0 + g * (1.0 - s))
    tl.store(dg_ptr + at, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty), mask=mask)


swiglu_fwd = triton.jit(_swiglu_fwd)
swiglu_bwd = triton.jit(_swiglu_bwd)


def interpreted():
    """(forward, backward) in Triton's interpreter, which runs them on CPU tensors (the tests, without a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_swiglu_fwd), InterpretedFunction(_swiglu_bwd)
