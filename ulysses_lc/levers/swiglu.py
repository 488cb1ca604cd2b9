"""Fused SwiGLU: a tiled MLP tile's silu(gate) * up as one Triton kernel each way instead of eager passes, on CUDA.

Legend: c tokens in one tile, i the MLP's intermediate width; g = gate_proj(x), u = up_proj(x), both [b, c, i].

Why: a gated-SiLU MLP (Qwen3, Llama, Mistral: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`) runs, per tile, SiLU and
a multiply in its forward (a third [c, i] written and read back), the same again in the tiled MLP's recompute, and
two multiplies and SiLU's backward in its backward: 19 passes over [c, i] a tile. On the Qwen3-4B shape at 128k
(36 layers x 16 tiles) those kernels took 0.57 s of the step's GPU time in bench_step.py's profile of 2026-12-05
(BENCHMARKS.md, "Where the FA4 step's time goes"); the kernels here (swiglu_kernel.py) read g and u once and write p
once forward, read dp, g, u and write dg, du once backward: 11 passes. Autograd keeps g and u for the backward (the
eager ops keep g, silu(g) and u). It computes in fp32 and rounds once where the eager ops round twice each way: within
one rounding of the model's dtype of them, and closer to fp32.

Contract: `TiledMLP` (tiled_mlp.py) takes this path for an MLP whose own forward is that form with SiLU
(`gated_silu_form`: its class's forward run on a stand-in with tiny projections, against the formula, at wrap time)
where the kernel runs (CUDA with Triton; on the CPU only with INTERPRET_ON_CPU, the tests' switch). Any other MLP
(GELU's, MoE blocks, a forward with more in it) and any other device run the MLP's own forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .triton_support import kernel_runs_on, launch_device, wanted_where_cuda

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 2048  # elements one program handles
# Run the kernels in Triton's interpreter on CPU tensors (the tests' switch, on machines without a GPU; slow).
INTERPRET_ON_CPU = False


@functools.cache
def _interpreted():
    from . import swiglu_kernel

    return swiglu_kernel.interpreted()


def _kernels(device: torch.device):
    from . import swiglu_kernel

    return (swiglu_kernel.swiglu_fwd, swiglu_kernel.swiglu_bwd) if device.type == "cuda" else _interpreted()


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA with Triton importable, or the CPU under INTERPRET_ON_CPU."""
    return kernel_runs_on(device, INTERPRET_ON_CPU)


def _launch(kernel, device, n, *tensors):
    grid = (-(-n // _BLOCK),)
    with launch_device(device):
        kernel[grid](*tensors, n, BLOCK=_BLOCK)


class FusedSwiGLU(torch.autograd.Function):
    """p = silu(g) * u for g, u of one shape and dtype, one kernel each way (swiglu_kernel.py). Saves g and u (where
    they are, as the eager ops save theirs); sends nothing. A second derivative through it (create_graph=True) is
    refused, not computed wrong."""

    @staticmethod
    def forward(ctx, g, u):
        g, u = g.contiguous(), u.contiguous()
        p = torch.empty_like(g)
        if p.numel():
            _launch(_kernels(g.device)[0], g.device, p.numel(), g, u, p)
        ctx.save_for_backward(g, u)
        return p

    @staticmethod
    @once_differentiable
    def backward(ctx, dp):
        g, u = ctx.saved_tensors
        dp = dp.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        if dg.numel():
            _launch(_kernels(g.device)[1], g.device, dg.numel(), dp, g, u, dg, du)
        return dg, du


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u: the fused kernels where they run on these tensors (one shape, dtype and device), else eager."""
    if (g.shape == u.shape and g.dtype == u.dtype and g.dtype in _DTYPES and g.device == u.device
            and runs_on(g.device)):
        return FusedSwiGLU.apply(g, u)
    return F.silu(g) * u


class _StandIn(nn.Module):
    def __init__(self, act_fn, bias):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(a, b, bias=c) for a, b, c in
                                                        ((4, 6, bias[0]), (4, 6, bias[1]), (6, 4, bias[2])))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.act_fn = act_fn


def gated_silu_form(mlp: nn.Module) -> bool:
    """Whether `mlp`'s own forward is `down_proj(silu(gate_proj(x)) * up_proj(x))`: its act_fn is SiLU on a range of
    values, and its class's forward run on a stand-in (tiny projections with the same biases, its act_fn) gives the
    formula's result. Reads none of `mlp`'s weights (under ZeRO-3 they may be partitioned); False on any error."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act_fn = getattr(mlp, "act_fn", None)
    if not all(isinstance(p, nn.Module) for p in projections) or not callable(act_fn):
        return False
    try:
        with torch.no_grad():
            t = torch.linspace(-12, 12, 97)
            if not torch.equal(act_fn(t), F.silu(t)):
                return False
            bias = [getattr(p, "bias", None) is not None for p in projections]
            stand_in = _StandIn(act_fn, bias)
            x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
            got = type(mlp).forward(stand_in, x)
            want = stand_in.down_proj(F.silu(stand_in.gate_proj(x)) * stand_in.up_proj(x))
            return isinstance(got, torch.Tensor) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    except Exception:  # noqa: BLE001 - a forward that needs more than the stand-in has is not this form
        return False


def fused_product(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate_proj(x)) * up_proj(x) of `mlp` (of `gated_silu_form`) as `swiglu`: its down projection's input."""
    return swiglu(mlp.gate_proj(x), mlp.up_proj(x))


def fused_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp`'s forward (of `gated_silu_form`) with its SiLU and product as `swiglu`."""
    return mlp.down_proj(fused_product(mlp, x))


def wanted(setting: bool | None) -> bool:
    """The `fused_swiglu` setting: None (the default) takes the kernels where CUDA is available."""
    return wanted_where_cuda(setting)


__all__ = ["FusedSwiGLU", "fused_forward", "fused_product", "gated_silu_form", "runs_on", "swiglu", "wanted"]
