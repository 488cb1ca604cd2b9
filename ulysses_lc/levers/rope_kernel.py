"""RoPE's Triton kernel, forward and backward: one pass over q or k, each token's cos and sin read once for its heads.

Legend (shape.py); here x is q or k [b, h, s, d] (any strides with the head dim's 1; one program a token), cos and
sin [b_c, s, d] (the Llama form) or [b_c, s, d / 2] (gpt-oss's) with b_c 1 or b. Imported only where the kernel runs
(rope.py): it needs Triton.

transformers' rotary forms (rope.py) with x1, x2 the halves of a head and c1, c2, s1, s2 those of cos and sin
(gpt-oss's: c2 = c1 and s2 = s1, one half-width cos and sin):  y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2.  Its
transpose, the backward from dy:  dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1.  Both computed in fp32 and rounded
once to x's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _rope_rows(x_ptr, y_ptr, cos_ptr, sin_ptr, seq, x_sb, x_ss, x_sh, y_sb, y_ss, y_sh, cos_sb, cos_ss, cos_second,
               heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    # One program: one token, BLOCK_H of its heads. x, y and cos address (batch, position, head) through their
    # strides (_sb, _ss, _sh; the head dim's stride is 1), in int64: past 2^31 elements at long sequences (Qwen3-4B's
    # q at 512k tokens is 2^31). cos_second: where c2 and s2 start in a row of cos and sin (HALF, or 0 for a
    # half-width cos whose one half serves both).
    token = tl.program_id(0).to(tl.int64)
    b = token // seq
    i = token % seq
    cs = b * cos_sb + i * cos_ss
    j = tl.arange(0, HALF_PAD)
    in_half = j < HALF
    c1 = tl.load(cos_ptr + cs + j, mask=in_half, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + cos_second + j, mask=in_half, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs + j, mask=in_half, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + cos_second + j, mask=in_half, other=0.0).to(tl.float32)[None, :]
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask = (h < heads)[:, None] & in_half[None, :]
    x_at = b * x_sb + i * x_ss + (h * x_sh)[:, None] + j[None, :]
    y_at = b * y_sb + i * y_ss + (h * y_sh)[:, None] + j[None, :]
    x1 = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_ptr + y_at, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_at + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


rope_rows = triton.jit(_rope_rows)


def interpreted_rope_rows():
    """The same kernel in Triton's interpreter, which runs it on CPU tensors (the tests, on machines without a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_rope_rows)
