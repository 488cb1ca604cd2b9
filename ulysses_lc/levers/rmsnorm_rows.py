"""RMSNorm's rows as Triton kernels that take a block of rows a program (rmsnorm_kernel.py): when rmsnorm.py's
RMSNormFunction takes them, and the launch.

Legend (rmsnorm.py): t rows, w the normalised width.

Why: torch's fused RMSNorm kernels (rmsnorm.py's FUSED_CUDA path) give each row its own thread block. The per-head q
and k norms of Qwen3 and its kin normalise rows of 128 (4M rows of the q norm per layer at 128k tokens on the 4B
shape), where most of such a block idles: in bench_step.py's profile of 2026-12-05 (one H100, the 4B shape at 128k)
the forward averaged 1.23 ms a call and the backward 2.1 ms with its weight's sum, about three times what the bytes
take at the card's bandwidth, 0.63 s of the step in all. These kernels give a program as many rows as make 4,096
elements, so a 128-wide row is one of 32. The same formula and rounding as torch's fused kernels (the weight applied
in fp32, one rounding), so the same forms take them (the Llama and gpt-oss forms, weight in the input's dtype).

TRITON_ROWS: on (CUDA only) since 2026-12-07, when its CUDA tests passed on one H100 and the 4B step at 128k took
35.41 s against 35.62 s on torch's kernels in the same call (benchmarks/results/2026-12-07/session26-h100; False gives
torch's fused kernels back; bench_rmsnorm.py and bench_step.py's lever key `triton_rmsnorm` time it).
INTERPRET_ON_CPU: run the kernels in Triton's interpreter on CPU tensors (the tests' switch; slow). MAX_WIDTH: wider
rows keep torch's kernels (a row must fit one program's block).
"""

from __future__ import annotations

import functools

import torch

from .triton_support import kernel_runs_on, launch_device

TRITON_ROWS = True
INTERPRET_ON_CPU = False
MAX_WIDTH = 16384
_ELEMENTS = 4096  # elements of one program's block of rows (at least one whole row), forward
# Backward: half, as its block holds five [r, W] fp32 values a thread (x, dy, x_hat, g and the weight's sum); at 4,096
# it compiled to 239 registers a thread on sm_90 (Triton 3.9), two blocks an SM.
_BWD_ELEMENTS = 2048
_BWD_PROGRAMS = 1024  # at most this many partial sums of the weight's gradient, added at the end


def takes(x: torch.Tensor) -> bool:
    """Whether RMSNormFunction runs x's rows through these kernels: switched on, a width up to MAX_WIDTH, a float
    dtype, Triton, and CUDA (or the interpreter on the CPU)."""
    if not TRITON_ROWS or x.shape[-1] > MAX_WIDTH or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return kernel_runs_on(x.device, INTERPRET_ON_CPU)


def blocks(width: int, elements: int | None = None) -> tuple[int, int, int]:
    """(rows a program, the width padded to a power of two, warps) for rows of `width`, about `elements` (default
    _ELEMENTS) a program."""
    block_w = 1 << max(0, width - 1).bit_length()
    block_r = max(1, (elements or _ELEMENTS) // block_w)
    return block_r, block_w, min(16, max(4, block_r * block_w // 1024))


@functools.cache
def _interpreted():
    from . import rmsnorm_kernel

    return rmsnorm_kernel.interpreted()


def _kernels(device: torch.device):
    from . import rmsnorm_kernel

    return (rmsnorm_kernel.rms_fwd, rmsnorm_kernel.rms_bwd) if device.type == "cuda" else _interpreted()


def forward(x_tw: torch.Tensor, weight_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [t, w] in x's dtype, rstd [t, 1] fp32) of the contiguous rows x_tw."""
    rows, width = x_tw.shape
    y_tw = torch.empty_like(x_tw)
    rstd_t1 = torch.empty(rows, 1, dtype=torch.float32, device=x_tw.device)
    if rows:
        block_r, block_w, warps = blocks(width)
        with launch_device(x_tw.device):
            _kernels(x_tw.device)[0][(-(-rows // block_r),)](x_tw, weight_w, y_tw, rstd_t1, rows, width, eps,
                                                             BLOCK_R=block_r, BLOCK_W=block_w, num_warps=warps)
    return y_tw, rstd_t1


def backward(grad_y_tw, x_tw, rstd_t1, weight_w, need_x: bool, need_weight: bool):
    """(grad x [t, w] or None, grad weight [w] in its dtype or None) of `forward`, from contiguous grad_y_tw, x_tw."""
    rows, width = x_tw.shape
    grad_x = torch.empty_like(x_tw) if need_x else None
    if not rows:
        return grad_x, (torch.zeros_like(weight_w) if need_weight else None)
    block_r, block_w, warps = blocks(width, _BWD_ELEMENTS)
    row_blocks = -(-rows // block_r)
    per_program = -(-row_blocks // min(row_blocks, _BWD_PROGRAMS))
    programs = -(-row_blocks // per_program)
    dw_part = torch.empty(programs if need_weight else 1, width, dtype=torch.float32, device=x_tw.device)
    with launch_device(x_tw.device):
        _kernels(x_tw.device)[1][(programs,)](
            grad_y_tw, x_tw, weight_w, rstd_t1, grad_x if need_x else grad_y_tw, dw_part, rows, width, per_program,
            NEED_X=need_x, NEED_W=need_weight, BLOCK_R=block_r, BLOCK_W=block_w, num_warps=warps)
    return grad_x, (dw_part.sum(0).to(weight_w.dtype) if need_weight else None)


__all__ = ["INTERPRET_ON_CPU", "MAX_WIDTH", "TRITON_ROWS", "backward", "blocks", "forward", "takes"]
