"""The loss head's softmax cross-entropy over one chunk's rows as one Triton kernel (chunked_loss.py's fused rows).

Legend (chunked_loss.py): c rows in the chunk, v vocabulary; x a row of the chunk's logits [c, v] in the model's dtype
(the matmul's own output), y its label, m its validity. One program a row, in fp32: pass 1 reads the row once for its
log-sum-exp (a running max and sum per lane, merged at the end), loss = m (lse - x_y); pass 2 (GRAD) reads it again and
writes d loss / d x = m (softmax(x) - onehot(y)) over it, in place, rounded once to the row's dtype. Imported only where
the kernel runs (chunked_loss.py): it needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _ce_rows(x_ptr, labels_ptr, valid_ptr, loss_ptr, v, row_stride, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m_l = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running max and sum of exp(x - max)
    s_l = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, v, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_l, x)
        # A lane that has seen no column yet stays (-inf, 0): shifting it by 0 keeps exp(-inf - 0) = 0, no NaN.
        shift_l = tl.where(m_new > float("-inf"), m_new, 0.0)
        s_l = s_l * tl.exp(m_l - shift_l) + tl.exp(x - shift_l)
        m_l = m_new
    # tl.reduce with tl.max's and tl.sum's own combine functions: the same reductions, and Triton's interpreter (the
    # tests) runs them, where it cannot call tl.max / tl.sum themselves (jit functions) outside TRITON_INTERPRET=1.
    m = tl.reduce(m_l, 0, tl.standard._elementwise_max)
    lse = m + tl.log(tl.reduce(s_l * tl.exp(m_l - m), 0, tl.standard._sum_combine))
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = tl.load(valid_ptr + row) != 0
    target = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if GRAD:
        # Ignored rows subtract +inf: exp gives exact zeros, and their one-hot is 0 (chunked_loss.py's note).
        shift = tl.where(valid, lse, float("inf"))
        onehot = tl.where(valid, 1.0, 0.0)
        for start in range(0, v, BLOCK):
            cols = start + lanes
            inside = cols < v
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - shift) - tl.where(cols == label, onehot, 0.0)
            tl.store(base + cols, g.to(x_ptr.dtype.element_ty), mask=inside)


ce_rows = triton.jit(_ce_rows)


def interpreted_ce_rows():
    """The same kernel in Triton's interpreter, which runs it on CPU tensors (the tests, without a GPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_ce_rows)
