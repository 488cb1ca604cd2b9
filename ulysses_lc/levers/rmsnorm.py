"""RMSNorm that keeps its bf16 input for backward instead of fp32 copies: a quarter of a layer's saved bytes.

Legend (shape.py): t rows (tokens, or tokens x heads for the q/k norms), w the normalised width.

transformers' Qwen3/Llama RMSNorm upcasts to fp32 and lets autograd save what each op needs: the fp32
input (4 bytes per element) for the variance, and the normalised bf16 values (2 bytes) for the weight's
gradient. A decoder layer runs four of them (input, post-attention, q and k norms); at 1M tokens on the
Qwen3-0.6B shape that is about 20 KB per token, some 20 GB held through one layer's recompute and
backward. This Function computes the same forward, bit for bit, and saves only the input as it came in
(usually bf16, and often saved by its neighbour anyway) plus one fp32 rstd per row; backward recomputes
the normalised values from them. On CUDA it runs torch's fused RMSNorm kernels for the Llama and gpt-oss
forms (FUSED_CUDA): the same saved tensors, one pass each way, the forward within one rounding of the
input's dtype of transformers' (the weight applied in fp32 before the rounding); with rmsnorm_rows.TRITON_ROWS (on
by default since 2026-12-07), rmsnorm_rows.py's Triton kernels in their place (the same formula, a block of rows a
program).
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..handle import Handle
from . import rmsnorm_rows

logger = logging.getLogger(__name__)


# fp32 bytes of one row chunk's temporaries. Forward and backward walk rows in chunks of this size: the fp32
# upcasts (x, x_hat, the gradient terms) exist one chunk at a time. Unchunked, the per-head q norm of one
# 256k-token layer (Qwen3-0.6B: 4M rows of 128) held 9.5 GiB of them at once in backward: the peak of the
# whole step once the attention kernel ran over head groups (BENCHMARKS.md F). Rows are independent, so
# the chunks compute the same numbers; only the weight gradient's sum over rows is split into chunk sums.
_CHUNK_BYTES = 256 << 20


def _rows_per_chunk(width: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * width))


# On CUDA, torch's fused RMSNorm kernels (aten::_fused_rms_norm and _fused_rms_norm_backward, CUDA only): one pass
# over the rows forward and one backward, no fp32 temporaries, and the same saved tensors as the chunks (the input
# and an fp32 rstd per row). The chunks' eager fp32 ops cost about 40 bytes of memory traffic per element forward and
# 100 backward; on the Qwen3-4B shape at 128k tokens that is some 2.6 s of a 39.7 s step (bench_step.py's profile,
# 2026-12-04: 57 mean reductions per layer among the step's 3.6 s of elementwise work). The fused kernel applies the
# weight in fp32 and rounds once, where Llama's form first rounds the normalised row to the input's dtype: on CUDA
# the forward is within one rounding of the input's dtype of transformers' (gpt-oss's form rounds once too: the
# same formula). Taken for the Llama and gpt-oss forms with the weight in the input's dtype; Gemma's (1 + weight)
# keeps the chunks. FUSED_CUDA = False keeps the chunks on CUDA too (an A/B switch for benchmarks).
FUSED_CUDA = True
# Elements per fused call: long sequences pass 2^31 in one q norm (Qwen3-4B's 32 heads of 128 at 512k tokens), past
# what a kernel indexing in 32 bits can be trusted with. Up to FUSED_MAX_ELEMENTS the rows go in one call; beyond,
# in calls of FUSED_PART_ELEMENTS each copied into the whole output (one part at a time: 256 MiB of bf16 held beside
# it, as the chunks' fp32 temporaries were).
FUSED_MAX_ELEMENTS = 2**30
FUSED_PART_ELEMENTS = 2**27


def _fused_parts(rows: int, width: int) -> list[slice]:
    step = rows if rows * width <= FUSED_MAX_ELEMENTS else max(1, FUSED_PART_ELEMENTS // width)
    return [slice(i, i + step) for i in range(0, rows, step)]


@functools.cache
def _fused_kernels_exist() -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has("aten::_fused_rms_norm", "CUDA") and has("aten::_fused_rms_norm_backward", "CUDA")


def _takes_fused(x: torch.Tensor, weight_w: torch.Tensor, gemma: bool) -> bool:
    return FUSED_CUDA and x.is_cuda and not gemma and weight_w.dtype == x.dtype and _fused_kernels_exist()


def _fused_forward(x_tw, weight_w, eps):
    """(y [t, w] in x's dtype, rstd): torch's fused kernel over the rows of a contiguous x_tw."""
    return torch.ops.aten._fused_rms_norm(x_tw, [x_tw.shape[-1]], weight_w, eps)


def _fused_backward(grad_y_tw, x_tw, rstd, weight_w, need_x: bool, need_weight: bool):
    """(grad x or None, grad weight or None) of `_fused_forward`."""
    return torch.ops.aten._fused_rms_norm_backward(grad_y_tw, x_tw, [x_tw.shape[-1]], rstd, weight_w,
                                                   [need_x, need_weight])


class RMSNormFunction(torch.autograd.Function):
    """Forward: weight * (x * rsqrt(mean(x^2) + eps)) with the normalisation in fp32, cast back to x's dtype
    before the weight (transformers' Llama order). gemma=True: Gemma's form, x_hat * (1 + weight) in fp32 and
    cast after it; cast_after=True: gpt-oss's, weight * x_hat in fp32, cast after it. Saves x (its own dtype),
    weight and rstd [t, 1] fp32; sends nothing. Backward recomputes x_hat from x and rstd. Both walk rows in
    chunks of `chunk_rows` (None: ~256 MiB of fp32 per temporary); the weight gradient is summed per chunk in
    fp32. On CUDA, the Llama and gpt-oss forms run torch's fused kernels instead (FUSED_CUDA: one pass, the same
    saved tensors, the weight applied before the one rounding)."""

    @staticmethod
    def forward(ctx, x, weight_w, eps, chunk_rows=None, gemma=False, cast_after=False):
        width = x.shape[-1]
        # rmsnorm_rows.py's kernels (TRITON_ROWS), where torch's fused ones would be taken: the same formula
        ctx.rows_kernel = (not gemma and weight_w.dtype == x.dtype and weight_w.is_contiguous()
                           and rmsnorm_rows.takes(x))
        ctx.fused = not ctx.rows_kernel and _takes_fused(x, weight_w, gemma)
        if ctx.rows_kernel:
            y_tw, rstd = rmsnorm_rows.forward(x.reshape(-1, width).contiguous(), weight_w, eps)
            ctx.save_for_backward(x, weight_w, rstd)
            return y_tw.view(x.shape)
        if ctx.fused:  # torch's fused kernel on CUDA (FUSED_CUDA): one pass, no temporaries
            x_tw = x.reshape(-1, width).contiguous()
            parts = _fused_parts(x_tw.shape[0], width)
            if len(parts) == 1:
                y_tw, rstd = _fused_forward(x_tw, weight_w, eps)
            else:
                y_tw, rstds = torch.empty_like(x_tw), []
                for rows in parts:
                    y_part, rstd_part = _fused_forward(x_tw[rows], weight_w, eps)
                    y_tw[rows] = y_part
                    rstds.append(rstd_part)
                    del y_part
                rstd = torch.cat(rstds)
            ctx.save_for_backward(x, weight_w, rstd)
            return y_tw.view(x.shape)
        x_tw = x.reshape(-1, width)
        rows = x_tw.shape[0]
        chunk = chunk_rows or _rows_per_chunk(width)
        cast_after = cast_after or gemma
        dtype = x.dtype if cast_after else torch.promote_types(weight_w.dtype, x.dtype)
        y_tw = torch.empty(x_tw.shape, dtype=dtype, device=x.device)
        rstd_t1 = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        scale_w = (1.0 + weight_w.float()) if gemma else weight_w.float()
        for start in range(0, rows, chunk):
            x_f = x_tw[start:start + chunk].to(torch.float32)
            rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
            rstd_t1[start:start + chunk] = rstd
            if cast_after:
                y_tw[start:start + chunk] = (x_f * rstd) * scale_w if gemma else scale_w * (x_f * rstd)
            else:
                torch.mul(weight_w, (x_f * rstd).to(x.dtype), out=y_tw[start:start + chunk])
            del x_f
        ctx.save_for_backward(x, weight_w, rstd_t1)
        ctx.chunk, ctx.gemma, ctx.cast_after = chunk, gemma, cast_after
        return y_tw.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward works in place on its temporaries: no double backward through it
    def backward(ctx, grad_y):
        x, weight_w, rstd_t1 = ctx.saved_tensors
        width = x.shape[-1]
        if ctx.rows_kernel:
            need_x, need_weight = ctx.needs_input_grad[:2]
            grad_x, grad_weight = rmsnorm_rows.backward(grad_y.reshape(-1, width).contiguous(),
                                                        x.reshape(-1, width).contiguous(), rstd_t1, weight_w, need_x,
                                                        need_weight)
            return (grad_x.view(x.shape) if need_x else None), grad_weight, None, None, None, None
        if ctx.fused:
            need_x, need_weight = ctx.needs_input_grad[:2]
            x_tw, grad_y_tw = x.reshape(-1, width).contiguous(), grad_y.reshape(-1, width).contiguous()
            parts = _fused_parts(x_tw.shape[0], width)
            if len(parts) == 1:
                grad_x, grad_weight = _fused_backward(grad_y_tw, x_tw, rstd_t1, weight_w, need_x, need_weight)
            else:
                grad_x, grad_weight = (torch.empty_like(x_tw) if need_x else None), None
                for rows in parts:
                    gx, gw = _fused_backward(grad_y_tw[rows], x_tw[rows], rstd_t1[rows], weight_w, need_x,
                                             need_weight)
                    if need_x:
                        grad_x[rows] = gx
                    if need_weight:  # the parts' sums added in fp32
                        grad_weight = gw.float() if grad_weight is None else grad_weight + gw.float()
                    del gx, gw
                grad_weight = grad_weight.to(weight_w.dtype) if need_weight else None
            grad_x = grad_x.view(x.shape) if need_x else None
            return grad_x, (grad_weight if need_weight else None), None, None, None, None
        x_tw = x.reshape(-1, width)
        grad_y_tw = grad_y.reshape(-1, width)
        need_weight = ctx.needs_input_grad[1]
        grad_x_tw = torch.empty_like(x_tw) if ctx.needs_input_grad[0] else None
        grad_weight_f = torch.zeros(width, dtype=torch.float32, device=x.device) if need_weight else None
        scale_w = (1.0 + weight_w.float()) if ctx.gemma else weight_w.float()
        for start in range(0, x_tw.shape[0], ctx.chunk):
            end = start + ctx.chunk
            rstd = rstd_t1[start:end]
            grad_y_c = grad_y_tw[start:end]
            x_hat = x_tw[start:end].to(torch.float32) * rstd
            if need_weight:
                if ctx.cast_after:
                    grad_weight_f += (grad_y_c.float() * x_hat).sum(0)
                else:
                    grad_weight_f += (grad_y_c * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if grad_x_tw is not None:
                if ctx.cast_after:
                    grad_x_hat = grad_y_c.float() * scale_w
                else:
                    grad_x_hat = (grad_y_c * weight_w).to(torch.float32)
                proj = (grad_x_hat * x_hat).mean(-1, keepdim=True)
                grad_x_hat.sub_(x_hat.mul_(proj)).mul_(rstd)
                grad_x_tw[start:end] = grad_x_hat
            del x_hat
        grad_x = None if grad_x_tw is None else grad_x_tw.view(x.shape)
        grad_weight = None if grad_weight_f is None else grad_weight_f.to(weight_w.dtype)
        return grad_x, grad_weight, None, None, None, None


class GatedRMSNormFunction(torch.autograd.Function):
    """The gated DeltaNet's output norm (Qwen3.5, Qwen3-Next `RMSNormGated`): (weight * x_hat.to(x dtype)) *
    silu(gate in fp32), cast to x's dtype, per row of one head. Autograd would keep x and the gate in fp32, the
    normalised row, the weighted row and silu(gate): 16 bytes an element in bf16; this saves x, the gate (their own
    dtypes), weight and rstd [t, 1] fp32, and backward recomputes the rest, in row chunks as RMSNormFunction.
    Sends nothing."""

    @staticmethod
    def forward(ctx, x, gate, weight_w, eps, chunk_rows=None):
        width = x.shape[-1]
        x_tw, gate_tw = x.reshape(-1, width), gate.reshape(-1, width)
        chunk = chunk_rows or _rows_per_chunk(width)
        y_tw = torch.empty_like(x_tw)
        rstd_t1 = torch.empty(x_tw.shape[0], 1, dtype=torch.float32, device=x.device)
        for start in range(0, x_tw.shape[0], chunk):
            rows = slice(start, start + chunk)
            x_f = x_tw[rows].to(torch.float32)
            rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
            rstd_t1[rows] = rstd
            y_tw[rows] = (weight_w * (x_f * rstd).to(x.dtype)) * F.silu(gate_tw[rows].to(torch.float32))
        ctx.save_for_backward(x, gate, weight_w, rstd_t1)
        ctx.chunk = chunk
        return y_tw.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, gate, weight_w, rstd_t1 = ctx.saved_tensors
        width = x.shape[-1]
        x_tw, gate_tw, grad_tw = x.reshape(-1, width), gate.reshape(-1, width), grad_y.reshape(-1, width)
        grad_x, grad_gate = torch.empty_like(x_tw), torch.empty_like(gate_tw)
        grad_weight_f = torch.zeros(width, dtype=torch.float32, device=x.device)
        for start in range(0, x_tw.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            rstd, dy = rstd_t1[rows], grad_tw[rows].to(torch.float32)
            x_hat = x_tw[rows].to(torch.float32) * rstd
            normed = x_hat.to(x.dtype)
            weighted = weight_w * normed
            g = gate_tw[rows].to(torch.float32)
            sig = torch.sigmoid(g)
            grad_gate[rows] = dy * weighted.to(torch.float32) * sig * (1 + g * (1 - sig))
            grad_weighted = (dy * g * sig).to(weighted.dtype)
            grad_weight_f += (grad_weighted * normed).sum(0, dtype=torch.float32)
            grad_x_hat = (grad_weighted * weight_w).to(torch.float32)
            proj = (grad_x_hat * x_hat).mean(-1, keepdim=True)
            grad_x[rows] = (grad_x_hat - x_hat * proj) * rstd
        return grad_x.view(x.shape), grad_gate.view(gate.shape), grad_weight_f.to(weight_w.dtype), None, None


def _gated_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return GatedRMSNormFunction.apply(hidden_states, gate, self.weight, self.variance_epsilon)


def _efficient_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _gemma_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.eps, None, True)


def _cast_after_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, None, False, True)


# Each family's RMSNorm class by its form, each checked against transformers 5.17 and 5.24: Llama's
# "weight * normalised.to(input dtype)"; Gemma 3's "(normalised * (1 + weight)).to(input dtype)", with `eps`;
# gpt-oss's "(weight * normalised).to(input dtype)". Others that look alike differ (Olmo2/3's order, Gemma 1/2's
# eps placement) and are left alone.
_RMSNORM_FORMS = {
    **dict.fromkeys(("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
                     "Qwen3RMSNorm", "Qwen3MoeRMSNorm"), _efficient_forward),
    # Qwen3.5 (dense and MoE) and Qwen3-Next: Gemma 3's "1 + weight" form; their gated DeltaNet's output norm.
    **dict.fromkeys(("Gemma3RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"), _gemma_forward),
    **dict.fromkeys(("Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated"), _gated_forward),
    "GptOssRMSNorm": _cast_after_forward,
}


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__ in _RMSNORM_FORMS and isinstance(getattr(module, "weight", None), nn.Parameter)


def _matches_upstream(module: nn.Module, form) -> str | None:
    """None when `form` computes what `module`'s own class computes, on a small tensor in fp32 and bf16; else
    what differs. A stand-in of the class with a fresh weight is compared, so ZeRO-3's empty weight stubs are no
    obstacle: the forms are hard-coded per class, and a formula changed upstream must not change the numbers."""
    cls = type(module)
    width = getattr(module.weight, "ds_shape", module.weight.shape)[-1]
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    stand_in.__dict__.update({k: v for k, v in module.__dict__.items()
                              if k not in ("_parameters", "_buffers", "_modules", "forward")})
    generator = torch.Generator().manual_seed(0)
    stand_in.weight = nn.Parameter(0.5 + torch.rand(width, generator=generator))
    inputs = [3 * torch.randn(4, width, generator=generator)]
    if form is _gated_forward:  # the gated norm's second input, the gate z
        inputs.append(torch.randn(4, width, generator=generator))
    with torch.no_grad():
        for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            stand_in.weight.data = stand_in.weight.data.to(dtype)
            args = [x.to(dtype) for x in inputs]
            ours, theirs = form(stand_in, *args), cls.forward(stand_in, *args)
            if ours.dtype != theirs.dtype or not torch.allclose(ours.float(), theirs.float(), rtol=rtol, atol=rtol):
                return (f"{dtype}: ours {ours.dtype} vs {cls.__name__} {theirs.dtype}, max difference "
                        f"{(ours.float() - theirs.float()).abs().max().item():.3g}")
    return None


def install_efficient_rmsnorm(model: nn.Module) -> Handle:
    """Switch every RMSNorm of a known form in `model` to RMSNormFunction; the Handle's undo() switches them back.

    Each class is first compared with its own forward on a small tensor (`_matches_upstream`); a class whose
    formula no longer matches ours (a transformers release that changed it) keeps its own forward, with a warning."""
    patched, checked = [], {}
    for module in model.modules():
        if not _is_rmsnorm(module):
            continue
        name = type(module).__name__
        if name not in checked:
            checked[name] = _matches_upstream(module, _RMSNORM_FORMS[name])
            if checked[name] is not None:
                logger.warning("bf16-saving RMSNorm: %s no longer computes the form ulysses_lc has for it (%s); it "
                               "keeps transformers' own forward (more activation memory, the same numbers)", name,
                               checked[name])
        if checked[name] is None:
            module.forward = types.MethodType(_RMSNORM_FORMS[name], module)
            patched.append(module)

    def undo():
        for module in patched:
            module.__dict__.pop("forward", None)

    handle = Handle(undo, "bf16-saving RMSNorm")
    handle.mismatched = sorted(name for name, why in checked.items() if why is not None)
    return handle


__all__ = ["GatedRMSNormFunction", "RMSNormFunction", "install_efficient_rmsnorm"]
