"""Fused RoPE: transformers' rotary embedding as one Triton kernel each way instead of five eager passes, on CUDA.

Legend (shape.py). transformers applies RoPE in each attention forward as `q * cos + rotate_half(q) * sin` (and the
same for k; gpt-oss's form the same rotation from cos and sin of half the head's width) in the model's dtype: a
broadcast multiply, a negated half, a cat, a second multiply and an add, each a pass over q and k, in the forward,
again in the checkpoint recompute, and about as many in the backward. On the Qwen3-4B shape at 128k tokens those
kernels (bf16 broadcast multiplies, neg, cat, adds) are about 1 s of a 39.7 s step by bench_step.py's profile of
2026-12-04 (BENCHMARKS.md, "Where the FA4 step's time goes"); the kernel (rope_kernel.py) reads q and k once and
writes them once each way. It computes in fp32 and rounds once where transformers rounds three times: within one
rounding of the model's dtype of transformers', and closer to fp32.

`install_fused_rope(model)` switches the function `apply_rotary_pos_emb` of the modeling module of each attention
class in `model` that calls it, where that function computes one of the two forms (FORMS; compared on a small
tensor at install, as rmsnorm.py compares its forms; 124 of transformers 5.25's modeling modules have the Llama
form). A module's function is one per process: every model of that family in the process takes the fused path
until the last handle's undo gives the module its own function back. The fused path takes CUDA tensors with cos and
sin of the form's width ([b or 1, s, d], gpt-oss's [b or 1, s, d / 2]; unsqueeze_dim 1) in q's dtype; any other
call (partial rotary, the CPU, cos with a gradient) runs the module's own function.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..handle import Handle
from .triton_support import kernel_runs_on, launch_device, wanted_where_cuda

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of q or k one program handles (its heads of one token): Qwen3-4B's 32 heads of 128 in one program.
_PROGRAM_ELEMENTS = 4096
# The rotary forms the kernel computes, by the width of their cos and sin in halves of the head dim: the Llama form's
# cover the whole head (each half its own), gpt-oss's one half (the same for both halves).
FORMS = {"llama": 2, "half": 1}
# Run the kernel in Triton's interpreter on CPU tensors (the tests' switch, on machines without a GPU; slow).
INTERPRET_ON_CPU = False


def _kernel(device: torch.device):
    from . import rope_kernel

    return rope_kernel.rope_rows if device.type == "cuda" else _interpreted()


@functools.cache
def _interpreted():
    from . import rope_kernel

    return rope_kernel.interpreted_rope_rows()


def _runs_on(device: torch.device) -> bool:
    return kernel_runs_on(device, INTERPRET_ON_CPU)


def takes(q_bhsd, k_bhsd, cos_bsd, sin_bsd, unsqueeze_dim=1, form: str = "llama") -> bool:
    """Whether the fused path computes this call of `form`: q [b, h, s, d], k [b, h_kv, s, d], cos and sin
    [b or 1, s, d] (the Llama form) or [b or 1, s, d / 2] (gpt-oss's) without a gradient, all in one dtype on one
    device where the kernel runs."""
    tensors = (q_bhsd, k_bhsd, cos_bsd, sin_bsd)
    if unsqueeze_dim != 1 or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if q_bhsd.dim() != 4 or k_bhsd.dim() != 4 or cos_bsd.dim() != 3 or sin_bsd.shape != cos_bsd.shape:
        return False
    b, _, s, d = q_bhsd.shape
    if d % 2 or k_bhsd.shape[0] != b or tuple(k_bhsd.shape[2:]) != (s, d):
        return False
    if tuple(cos_bsd.shape[1:]) != (s, d // 2 * FORMS[form]) or cos_bsd.shape[0] not in (1, b):
        return False
    if len({t.dtype for t in tensors}) != 1 or q_bhsd.dtype not in _DTYPES:
        return False
    if cos_bsd.requires_grad or sin_bsd.requires_grad or len({t.device for t in tensors}) != 1:
        return False
    return _runs_on(q_bhsd.device)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rope_bhsd(x_bhsd: torch.Tensor, cos_bsd: torch.Tensor, sin_bsd: torch.Tensor, backward: bool = False):
    """The rotary form of x [b, h, s, d] that cos's width names (d: the Llama form, d / 2: gpt-oss's; backward=True:
    its transpose, for a gradient) by the kernel, in a new tensor laid out as transformers' own result is: the Llama
    form's elementwise ops keep x's strides (q and k are [b, s, h, d] projections seen as [b, h, s, d]), gpt-oss's
    cat makes it contiguous; a gradient keeps the incoming one's strides."""
    if x_bhsd.stride(-1) != 1:
        x_bhsd = x_bhsd.contiguous()
    b, h, s, d = x_bhsd.shape
    half = d // 2
    assert cos_bsd.shape[-1] in (d, half), (cos_bsd.shape, d)
    full = cos_bsd.shape[-1] == d
    y_bhsd = torch.empty_like(x_bhsd) if full or backward else torch.empty(x_bhsd.shape, dtype=x_bhsd.dtype,
                                                                             device=x_bhsd.device)
    if y_bhsd.numel() == 0:
        return y_bhsd
    cos_bsd, sin_bsd = cos_bsd.contiguous(), sin_bsd.contiguous()
    half_pad = _next_power_of_2(half)
    block_h = min(_next_power_of_2(h), max(1, _PROGRAM_ELEMENTS // (2 * half_pad)))
    grid = (b * s, -(-h // block_h))
    cos_sb = cos_bsd.stride(0) if cos_bsd.shape[0] > 1 else 0
    x_strides = (x_bhsd.stride(0), x_bhsd.stride(2), x_bhsd.stride(1))  # batch, position, head
    y_strides = (y_bhsd.stride(0), y_bhsd.stride(2), y_bhsd.stride(1))
    with launch_device(x_bhsd.device):
        _kernel(x_bhsd.device)[grid](x_bhsd, y_bhsd, cos_bsd, sin_bsd, s, *x_strides, *y_strides, cos_sb,
                                     cos_bsd.stride(1), half if full else 0, h, HALF=half, HALF_PAD=half_pad,
                                     BLOCK_H=block_h, BACKWARD=backward)
    return y_bhsd


class FusedRoPE(torch.autograd.Function):
    """(q_embed, k_embed): the rotary form of q [b, h, s, d] and k [b, h_kv, s, d] with cos, sin [b or 1, s, d] (the
    Llama form) or [b or 1, s, d / 2] (gpt-oss's), one kernel per tensor each way (rope_kernel.py). Saves cos and sin
    (on the device, as transformers' own multiplies save them); sends nothing. Its backward is a kernel too: a second
    derivative through it (create_graph=True) is refused, not computed wrong."""

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
    """The rotary form in fp32 (what the kernel computes before its one rounding): x cos + rotate_half(x) sin, with a
    half-width cos and sin (gpt-oss's) serving both halves."""
    x, cos, sin = x_bhsd.float(), cos_bsd.float().unsqueeze(1), sin_bsd.float().unsqueeze(1)
    half = x.shape[-1] // 2
    if cos.shape[-1] == half:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


_PARAMETERS = {"q", "k", "cos", "sin", "unsqueeze_dim"}


def _signature(function) -> inspect.Signature:
    """The parameters of a modeling module's function; with the `kernels` package installed (transformers 5.25
    requires it) transformers makes it a module whose `forward` is the function."""
    target = function.forward if isinstance(function, nn.Module) else function
    return inspect.signature(inspect.unwrap(target))


def _fused_form(original, form: str):
    signature = _signature(original)

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args, **kwargs):
        # The module's own signature decides what each argument is (some take k=None, or position_ids before
        # unsqueeze_dim): the kernel takes a call binding q, k, cos, sin and unsqueeze_dim, nothing else.
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if set(given) == _PARAMETERS and takes(given["q"], given["k"], given["cos"], given["sin"],
                                                given["unsqueeze_dim"], form):
            return FusedRoPE.apply(given["q"], given["k"], given["cos"], given["sin"])
        return original(*args, **kwargs)

    apply_rotary_pos_emb.ulysses_lc_original = original
    apply_rotary_pos_emb.ulysses_lc_form = form
    return apply_rotary_pos_emb


def _form_differs(function, form: str) -> str | None:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 5, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator)
    width = 4 * FORMS[form]
    cos, sin = torch.rand(1, 5, width, generator=generator), torch.rand(1, 5, width, generator=generator)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [t.to(dtype) for t in (q, k, cos, sin)]
        try:
            with torch.no_grad():
                got = function(*args)
        except Exception as e:  # another signature, or cos of another width than this form's
            return f"{type(e).__name__}: {e}"
        for name, x, y in (("q", args[0], got[0]), ("k", args[1], got[1])):
            want = reference_rope(x, args[2], args[3])
            if y.dtype != dtype or y.shape != want.shape or not torch.allclose(y.float(), want, rtol=tol, atol=tol):
                return f"{dtype}: {name} differs from the {form} form"
    return None


def rotary_form(function) -> tuple[str | None, str]:
    """(the form in FORMS that `function(q, k, cos, sin)` computes, or None; what differs otherwise): compared with
    reference_rope on small random tensors in fp32 and bf16, cos and sin unlike each other's halves."""
    whys = []
    for form in FORMS:
        why = _form_differs(function, form)
        if why is None:
            return form, ""
        whys.append(why)
    return None, "; ".join(whys)


# module name -> [the module's own apply_rotary_pos_emb, installs holding the switch]
_SWITCHED: dict[str, list] = {}


def rope_modules(model: nn.Module) -> list:
    """The modeling modules whose apply_rotary_pos_emb the attention classes in `model` call, in model order."""
    found = {}
    for module in model.modules():
        forward = inspect.unwrap(type(module).forward)
        code = getattr(forward, "__code__", None)
        if code is not None and "apply_rotary_pos_emb" in code.co_names:
            # the module whose globals the forward reads the name from (a subclass may live elsewhere)
            python_module = sys.modules.get(forward.__globals__.get("__name__", ""))
            if python_module is not None and hasattr(python_module, "apply_rotary_pos_emb"):
                found[python_module.__name__] = python_module
    return list(found.values())


def wanted(setting: bool | None) -> bool:
    """SequenceParallelCausalLM's `fused_rope`: True / False as given; None (its default) where CUDA is available,
    the only device the kernel runs on (on the CPU the switched function would run the module's own anyway)."""
    return wanted_where_cuda(setting)


def install_fused_rope(model: nn.Module) -> Handle:
    """Switch the apply_rotary_pos_emb of `model`'s attention classes, where it computes a form of FORMS, to the
    fused kernel (FusedRoPE, CUDA; see the module docstring); the Handle's undo() gives each module its own function
    back once no other install holds it. `.switched`: the modules switched; `.left`: {module: why} for those left
    alone."""
    switched, left = [], {}
    for python_module in rope_modules(model):
        name = python_module.__name__
        if name in _SWITCHED:
            if getattr(python_module.apply_rotary_pos_emb, "ulysses_lc_original", None) is not _SWITCHED[name][0]:
                left[name] = "apply_rotary_pos_emb was replaced since an earlier install switched it"
                continue
            _SWITCHED[name][1] += 1
            switched.append(python_module)
            continue
        own = python_module.apply_rotary_pos_emb
        form, why = rotary_form(own)
        if form is None:
            left[name] = why
            logger.info("fused RoPE: %s.apply_rotary_pos_emb computes no form of FORMS (%s); it keeps its own", name,
                        why)
            continue
        _SWITCHED[name] = [own, 1]
        python_module.apply_rotary_pos_emb = _fused_form(own, form)
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


__all__ = ["FORMS", "FusedRoPE", "install_fused_rope", "reference_rope", "rope_bhsd", "rotary_form", "takes", "wanted"]
