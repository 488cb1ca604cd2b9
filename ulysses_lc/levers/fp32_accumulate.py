"""acc += a @ b into an fp32 accumulator from bf16 / fp16 factors, as one cuBLAS GEMM on CUDA.

Why: the chunked loss head adds each chunk's weight gradient [v, e] into an fp32 accumulator. Written as
`acc += (a @ b).float()`, the product is rounded to bf16, written, read back and cast into a new fp32 block, then added:
on the Qwen3-4B shape at 128k (74 chunks of [151936, 2560]) about 7.8 GB of traffic a chunk besides the GEMM, some
0.15-0.2 s of the step at an H100's or H200's bandwidth (not yet measured). torch's addmm with out_dtype
(torch >= 2.8, CUDA: cuBLAS with an fp32 C) adds the fp32 product into the accumulator inside the GEMM: no bf16
rounding of the chunk's sum, no temporary. Elsewhere (the CPU, fp32 or fp64 factors, a torch without the overload) the
eager form.
"""

from __future__ import annotations

import functools

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _fp32_out_gemm() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CUDA")


def takes_fp32_gemm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether add_product_ runs one GEMM into `acc`: CUDA, acc fp32, a and b both bf16 or both fp16."""
    return (acc.is_cuda and acc.dtype == torch.float32 and a.dtype in _HALF and b.dtype == a.dtype
            and _fp32_out_gemm())


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b, in place; returns acc."""
    if takes_fp32_gemm(acc, a, b):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    acc += (a @ b).to(acc.dtype)
    return acc


__all__ = ["add_product_", "takes_fp32_gemm"]
