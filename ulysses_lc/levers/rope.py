"""Fused RoPE: transformers' rotary embedding as one Triton kernel each way instead of five eager passes, on CUDA.

Legend (shape.py). transformers applies RoPE in each attention forward as `q * cos + rotate_half(q) * sin` (and
the same for k) in the model's dtype: a broadcast multiply, a negated half, a cat, a second multiply and an add,
each a pass over q and k, in the forward, again in the checkpoint recompute, and about as many in the backward.
On the Qwen3-4B shape at 128k tokens those kernels (bf16 broadcast multiplies, neg, cat, adds) are about 1 s of a
39.7 s step by bench_step.py's profile of 2026-12-04 (BENCHMARKS.md, "Where the FA4 step's time goes"); the
kernel (rope_kernel.py) reads q and k once and writes them once each way. It computes in fp32 and rounds once where
transformers rounds three times: within one rounding of the model's dtype of transformers', and closer to fp32.

`install_fused_rope(model)` switches the function `apply_rotary_pos_emb` of the modeling module of each attention
class in `model` that calls it, where that function computes the Llama form (compared on a small tensor at
install, as rmsnorm.py compares its forms; 124 of transformers 5.25's modeling modules have it). A module's
function is one per process: every model of that family in the process takes the fused path until the last
handle's undo gives the module its own function back. The fused path takes CUDA tensors with cos and sin over the
whole head dim ([b or 1, s, d], unsqueeze_dim 1) in q's dtype; any other call (partial rotary, the CPU, cos with a
gradient) runs the module's own function.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..handle import Handle

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of q or k one program handles (its heads of one token): Qwen3-4B's 32 heads of 128 in one program.
_PROGRAM_ELEMENTS = 4096
# Run the kernel in Triton's interpreter on CPU tensors (the tests' switch, on machines without a GPU; slow).
INTERPRET_ON_CPU = False


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel(device: torch.device):
    from . import rope_kernel

    return rope_kernel.rope_rows if device.type == "cuda" else _interpreted()


@functools.cache
def _interpreted():
    from . import rope_kernel

    return rope_kernel.interpreted_rope_rows()


def _runs_on(device: torch.device) -> bool:
    if not _triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET_ON_CPU)


def takes(q_bhsd, k_bhsd, cos_bsd, sin_bsd, unsqueeze_dim=1) -> bool:
    """Whether the fused path computes this call of the Llama form: q [b, h, s, d], k [b, h_kv, s, d], cos and sin
    [b or 1, s, d] (the whole head dim) without a gradient, all in one dtype on one device where the kernel runs."""
    tensors = (q_bhsd, k_bhsd, cos_bsd, sin_bsd)
    if unsqueeze_dim != 1 or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if q_bhsd.dim() != 4 or k_bhsd.dim() != 4 or cos_bsd.dim() != 3 or sin_bsd.shape != cos_bsd.shape:
        return False
    b, _, s, d = q_bhsd.shape
    if k_bhsd.shape[0] != b or tuple(k_bhsd.shape[2:]) != (s, d) or tuple(cos_bsd.shape[1:]) != (s, d):
        return False
    if cos_bsd.shape[0] not in (1, b) or d % 2:
        return False
    if len({t.dtype for t in tensors}) != 1 or q_bhsd.dtype not in _DTYPES:
        return False
    if cos_bsd.requires_grad or sin_bsd.requires_grad or len({t.device for t in tensors}) != 1:
        return False
    return _runs_on(q_bhsd.device)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rope_bhsd(x_bhsd: torch.Tensor, cos_bsd: torch.Tensor, sin_bsd: torch.Tensor, backward: bool = False):
    """The Llama form of x [b, h, s, d] (backward=True: its transpose, for a gradient) by the kernel, returned as
    [b, h, s, d] over a [b, s, h, d] tensor: the layout transformers' own (elementwise) result has for q and k
    transposed from their projections."""
    x_bshd = x_bhsd.transpose(1, 2)
    if not x_bshd.is_contiguous():
        x_bshd = x_bshd.contiguous()
    b, s, h, d = x_bshd.shape
    y_bshd = torch.empty_like(x_bshd)
    if y_bshd.numel() == 0:
        return y_bshd.transpose(1, 2)
    cos_bsd, sin_bsd = cos_bsd.contiguous(), sin_bsd.contiguous()
    half = d // 2
    half_pad = _next_power_of_2(half)
    block_h = min(_next_power_of_2(h), max(1, _PROGRAM_ELEMENTS // (2 * half_pad)))
    grid = (b * s, -(-h // block_h))
    cos_batch_stride = cos_bsd.stride(0) if cos_bsd.shape[0] > 1 else 0
    _kernel(x_bshd.device)[grid](x_bshd, y_bshd, cos_bsd, sin_bsd, s, cos_batch_stride, cos_bsd.stride(1), h,
                                 HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, BACKWARD=backward)
    return y_bshd.transpose(1, 2)


class FusedRoPE(torch.autograd.Function):
    """(q_embed, k_embed): the Llama form of q [b, h, s, d] and k [b, h_kv, s, d] with cos, sin [b or 1, s, d], one
    kernel per tensor each way (rope_kernel.py). Saves cos and sin (on the device, as transformers' own multiplies
    save them); sends nothing."""

    @staticmethod
    def forward(ctx, q_bhsd, k_bhsd, cos_bsd, sin_bsd):
        ctx.save_for_backward(cos_bsd, sin_bsd)
        return rope_bhsd(q_bhsd, cos_bsd, sin_bsd), rope_bhsd(k_bhsd, cos_bsd, sin_bsd)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos_bsd, sin_bsd = ctx.saved_tensors
        dq = rope_bhsd(grad_q, cos_bsd, sin_bsd, backward=True) if ctx.needs_input_grad[0] else None
        dk = rope_bhsd(grad_k, cos_bsd, sin_bsd, backward=True) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


def reference_rope(x_bhsd: torch.Tensor, cos_bsd: torch.Tensor, sin_bsd: torch.Tensor) -> torch.Tensor:
    """The Llama form in fp32 (what the kernel computes before its one rounding): x cos + rotate_half(x) sin."""
    x, cos, sin = x_bhsd.float(), cos_bsd.float().unsqueeze(1), sin_bsd.float().unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _fused_form(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if len(args) + len(kwargs) <= 1 and set(kwargs) <= {"unsqueeze_dim"} and takes(q, k, cos, sin, unsqueeze_dim):
            return FusedRoPE.apply(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.ulysses_lc_original = original
    return apply_rotary_pos_emb


def form_differs(function) -> str | None:
    """None when `function(q, k, cos, sin)` computes the Llama form (reference_rope) on small random tensors in fp32
    and bf16, with cos and sin unlike each other's halves; else what differs."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 5, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator)
    cos, sin = torch.rand(1, 5, 8, generator=generator), torch.rand(1, 5, 8, generator=generator)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [t.to(dtype) for t in (q, k, cos, sin)]
        try:
            with torch.no_grad():
                got = function(*args)
        except Exception as e:  # another signature or another layout of cos (gpt-oss's half-width one)
            return f"{type(e).__name__}: {e}"
        for name, x, y in (("q", args[0], got[0]), ("k", args[1], got[1])):
            want = reference_rope(x, args[2], args[3])
            if y.dtype != dtype or y.shape != want.shape or not torch.allclose(y.float(), want, rtol=tol, atol=tol):
                return f"{dtype}: {name} differs from the Llama form"
    return None


# module name -> [the module's own apply_rotary_pos_emb, installs holding the switch]
_SWITCHED: dict[str, list] = {}


def rope_modules(model: nn.Module) -> list:
    """The modeling modules whose apply_rotary_pos_emb the attention classes in `model` call, in model order."""
    found = {}
    for module in model.modules():
        forward = inspect.unwrap(type(module).forward)
        code = getattr(forward, "__code__", None)
        if code is not None and "apply_rotary_pos_emb" in code.co_names:
            python_module = sys.modules.get(type(module).__module__)
            if python_module is not None and hasattr(python_module, "apply_rotary_pos_emb"):
                found[python_module.__name__] = python_module
    return list(found.values())


def install_fused_rope(model: nn.Module) -> Handle:
    """Switch the Llama-form apply_rotary_pos_emb of `model`'s attention classes to the fused kernel (FusedRoPE,
    CUDA; see the module docstring); the Handle's undo() gives each module its own function back once no other
    install holds it. `.switched`: the modules switched; `.left`: {module: why} for those left alone."""
    switched, left = [], {}
    for python_module in rope_modules(model):
        name = python_module.__name__
        if name in _SWITCHED:
            _SWITCHED[name][1] += 1
            switched.append(python_module)
            continue
        own = python_module.apply_rotary_pos_emb
        why = form_differs(own)
        if why is not None:
            left[name] = why
            logger.info("fused RoPE: %s.apply_rotary_pos_emb is not the Llama form (%s); it keeps its own", name, why)
            continue
        _SWITCHED[name] = [own, 1]
        python_module.apply_rotary_pos_emb = _fused_form(own)
        switched.append(python_module)

    def undo():
        for python_module in switched:
            entry = _SWITCHED[python_module.__name__]
            entry[1] -= 1
            if entry[1] == 0:
                del _SWITCHED[python_module.__name__]
                if getattr(python_module.apply_rotary_pos_emb, "ulysses_lc_original", None) is entry[0]:
                    python_module.apply_rotary_pos_emb = entry[0]

    handle = Handle(undo, "fused RoPE")
    handle.switched = [m.__name__ for m in switched]
    handle.left = left
    return handle


__all__ = ["FusedRoPE", "install_fused_rope", "reference_rope", "rope_bhsd", "takes"]
