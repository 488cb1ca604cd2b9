"""acc += a @ b into an fp32 accumulator from bf16 / fp16 factors, as one cuBLAS GEMM on CUDA.

Why: the chunked loss head adds each chunk's weight gradient [v, e] into an fp32 accumulator. Written as
`acc += (a @ b).float()`, the product is rounded to bf16, written, read back and cast into a new fp32 block, then added:
on the Qwen3-4B shape at 128k (74 chunks of [151936, 2560]) about 7.8 GB of traffic a chunk besides the GEMM, some
0.15-0.2 s of the step at an H100's or H200's bandwidth (not yet measured). torch's addmm with out_dtype
(torch >= 2.8, CUDA: cuBLAS with an fp32 C) adds the fp32 product into the accumulator inside the GEMM: no bf16
rounding of the chunk's sum, no temporary. Some torch releases refuse an fp32 `self` there (they take only bf16 / fp16
C): so the first call on a device tries it on a small product against float64 (`_fp32_out_gemm_works`, one host sync)
and takes it only where it runs and gives that sum. Elsewhere (the CPU, fp32 or fp64 factors, a torch that refuses or
lacks the overload) the eager form.
"""

from __future__ import annotations

import functools

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _fp32_out_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's addmm with out_dtype adds a product of `dtype` factors (the first one transposed, as the
    loss head's) into an fp32 accumulator given as both input and output, on `device`: tried once, against float64."""
    generator = torch.Generator().manual_seed(0)
    a, b, acc = (torch.randn(shape, generator=generator) for shape in ((32, 16), (32, 8), (16, 8)))
    try:  # a torch without the overload raises at the dispatch check itself
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CUDA"):
            return False
        a, b, acc = a.to(device, dtype), b.to(device, dtype), acc.to(device)
        want = acc.double().cpu() + a.double().t().cpu() @ b.double().cpu()  # the factors as rounded to dtype
        torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
        return bool(((acc.double().cpu() - want).abs() <= 1e-4 * (1 + want.abs())).all())
    except (RuntimeError, TypeError):
        return False


def takes_fp32_gemm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether add_product_ runs one GEMM into `acc`: CUDA, acc fp32, a and b both bf16 or both fp16, and this torch
    does it right (`_fp32_out_gemm_works`)."""
    return (acc.is_cuda and acc.dtype == torch.float32 and a.dtype in _HALF and b.dtype == a.dtype
            and _fp32_out_gemm_works(acc.device, a.dtype))


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b, in place; returns acc."""
    if takes_fp32_gemm(acc, a, b):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    acc += (a @ b).to(acc.dtype)
    return acc


__all__ = ["add_product_", "takes_fp32_gemm"]
