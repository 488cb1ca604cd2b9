"""The loss head's softmax cross-entropy over one chunk's rows as ce_kernel.py's Triton kernel: when chunked_loss.py's
chunk_step takes it, and the launch.

Legend (chunked_loss.py): c rows in the chunk, v vocabulary.

Why: the eager chunk makes about a dozen passes over [c, v] in fp32 (the upcast, logsumexp's max / exp / sum, sub_,
exp_, the bf16 cast); on the Qwen3-4B shape at 128k its kernels were about 0.5 s of the step in bench_step.py's profile
of 2026-12-05. The kernel makes two over the matmul's own bf16 logits, computes in fp32 and writes the gradient over
them in place, so no [c, v] fp32 block exists. The same numbers up to fp32 summation order (its running log-sum-exp),
rounded once to the logits' dtype as the eager path rounds its fp32 gradient; a bias's gradient is summed from that
rounded gradient (the eager path sums the fp32 one).

FUSED_ROWS: the default of a head's `fused_rows` setting (None), on since its CUDA tests passed and the step ran with it
(2026-12-07, one H100: tests/test_chunked_loss.py's CUDA tests; the Qwen3-4B shape at 128k, BENCHMARKS.md); the CPU
never takes the kernel outside the tests' interpreter. A head's True or False (ChunkedLossHead, chunked_cross_entropy,
SequenceParallelCausalLM's fused_ce_rows) overrides it; a bench_step.py variant's `fused_ce_rows=False` is the A/B.
INTERPRET_ON_CPU: run the kernel in Triton's interpreter on CPU tensors (the tests' switch, on machines without a GPU;
slow); the CPU never takes it otherwise.
"""

from __future__ import annotations

import functools

import torch

from .triton_support import kernel_runs_on, launch_device

FUSED_ROWS = True
INTERPRET_ON_CPU = False
_ROWS_BLOCK = 4096  # vocabulary columns a program reads at a time


def wanted(setting: bool | None) -> bool:
    """A head's fused_rows setting: True / False as given; None (the default) FUSED_ROWS."""
    return FUSED_ROWS if setting is None else bool(setting)


def takes(logits_cv: torch.Tensor, softcap, acc_dtype, setting: bool | None = None) -> bool:
    """Whether chunk_step runs this chunk's [c, v] logits (the matmul's output) through the kernel: switched on
    (`wanted(setting)`), no soft-capping, fp32 accumulation, bf16 / fp16 contiguous logits, Triton, and CUDA (or the
    interpreter on the CPU)."""
    if not wanted(setting) or softcap is not None or acc_dtype != torch.float32:
        return False
    if logits_cv.dtype not in (torch.bfloat16, torch.float16) or not logits_cv.is_contiguous():
        return False
    return kernel_runs_on(logits_cv.device, INTERPRET_ON_CPU)


@functools.cache
def _interpreted():
    from . import ce_kernel

    return ce_kernel.interpreted_ce_rows()


def fused_rows(logits_cv, safe_labels_c, valid_c, grad: bool) -> torch.Tensor:
    """Each row's loss [c] in fp32 (0 for ignored rows) by the kernel; with `grad`, logits_cv becomes d loss / d
    logits in place (ce_kernel.py)."""
    from . import ce_kernel

    loss_c = torch.empty(logits_cv.shape[0], dtype=torch.float32, device=logits_cv.device)
    if loss_c.numel():
        kernel = ce_kernel.ce_rows if logits_cv.is_cuda else _interpreted()
        with launch_device(logits_cv.device):
            kernel[(logits_cv.shape[0],)](logits_cv, safe_labels_c.contiguous(), valid_c.to(torch.int8).contiguous(),
                                          loss_c, logits_cv.shape[1], logits_cv.stride(0), GRAD=grad,
                                          BLOCK=_ROWS_BLOCK)
    return loss_c


__all__ = ["FUSED_ROWS", "INTERPRET_ON_CPU", "fused_rows", "takes", "wanted"]
