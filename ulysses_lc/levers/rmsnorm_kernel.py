"""RMSNorm's Triton kernels over a block of rows at a time (rmsnorm_rows.py launches them; rmsnorm.py takes them).

Legend (rmsnorm.py): t rows, w the normalised width, r the rows of one program (BLOCK_R), W the width padded to a power
of two (BLOCK_W). Forward, per row: rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd weight, in fp32 and rounded once to y's
dtype (torch's fused kernel's formula). Backward from dy, per row: x_hat = x rstd, g = dy weight, dx = rstd (g - x_hat
mean(g x_hat)); d weight = sum over rows of dy x_hat, each program's rows summed in fp32 into its own row of `dw_part`
(the launcher adds those). Imported only where the kernel runs (rmsnorm_rows.py): it needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _rms_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, width, eps, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    # int64 row offsets: the per-head q norm of a long sequence passes 2^31 elements (Qwen3-4B at 512k tokens).
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_W)
    in_rows, in_cols = r < rows, c < width
    at = r[:, None] * width + c[None, :]
    inside = in_rows[:, None] & in_cols[None, :]
    x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    # tl.reduce with tl.sum's combine function: Triton's interpreter (the tests) cannot call tl.sum (a jit function).
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, tl.standard._sum_combine) / width + eps)
    weight = tl.load(w_ptr + c, mask=in_cols, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * weight[None, :]
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + r, rstd, mask=in_rows)


def _rms_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, rows, width, blocks_per_program,
             NEED_X: tl.constexpr, NEED_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    program = tl.program_id(0)
    c = tl.arange(0, BLOCK_W)
    in_cols = c < width
    weight = tl.load(w_ptr + c, mask=in_cols, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_R, BLOCK_W], 0.0, tl.float32)  # this program's rows' dy x_hat, summed over rows at the end
    for i in range(0, blocks_per_program):  # consecutive row blocks, so that d weight is summed in few partials
        r = (program * blocks_per_program + i).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = r < rows
        at = r[:, None] * width + c[None, :]
        inside = in_rows[:, None] & in_cols[None, :]
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=in_rows, other=0.0)
        x_hat = x * rstd[:, None]
        if NEED_W:
            dw += dy * x_hat
        if NEED_X:
            g = dy * weight[None, :]
            proj = tl.reduce(g * x_hat, 1, tl.standard._sum_combine) / width
            dx = (g - x_hat * proj[:, None]) * rstd[:, None]
            tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    if NEED_W:
        tl.store(dw_part_ptr + program.to(tl.int64) * width + c, tl.reduce(dw, 0, tl.standard._sum_combine),
                 mask=in_cols)


rms_fwd = triton.jit(_rms_fwd)
rms_bwd = triton.jit(_rms_bwd)


def interpreted():
    """(forward, backward) in Triton's interpreter, which runs them on CPU tensors (the tests, without a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_rms_fwd), InterpretedFunction(_rms_bwd)
