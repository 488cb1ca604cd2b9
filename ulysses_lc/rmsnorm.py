"""RMSNorm that keeps its bf16 input for backward instead of fp32 copies: a quarter of a layer's saved bytes.

Legend (shape.py): t rows (tokens, or tokens x heads for the q/k norms), w the normalised width.

transformers' Qwen3/Llama RMSNorm upcasts to fp32 and lets autograd save what each op needs: the fp32
input (4 bytes per element) for the variance, and the normalised bf16 values (2 bytes) for the weight's
gradient. A decoder layer runs four of them (input, post-attention, q and k norms); at 1M tokens on the
Qwen3-0.6B shape that is about 20 KB per token, some 20 GB held through one layer's recompute and
backward. This Function computes the same forward, bit for bit, and saves only the input as it came in
(usually bf16, and often saved by its neighbour anyway) plus one fp32 rstd per row; backward recomputes
the normalised values from them.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .handle import Handle


# fp32 bytes of one row chunk's temporaries. Forward and backward walk rows in chunks of this size: the fp32
# upcasts (x, x_hat, the gradient terms) exist one chunk at a time. Unchunked, the per-head q norm of one
# 256k-token layer (Qwen3-0.6B: 4M rows of 128) held 9.5 GiB of them at once in backward: the peak of the
# whole step once the attention kernel ran over head groups (BENCHMARKS.md F). Rows are independent, so
# the chunks compute the same numbers; only the weight gradient's sum over rows is split into chunk sums.
_CHUNK_BYTES = 256 << 20


def _rows_per_chunk(width: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * width))


class RMSNormFunction(torch.autograd.Function):
    """Forward: weight * (x * rsqrt(mean(x^2) + eps)) with the normalisation in fp32, cast back to x's dtype
    before the weight (transformers' order). Saves x (its own dtype), weight and rstd [t, 1] fp32; sends
    nothing. Backward recomputes x_hat from x and rstd. Both walk rows in chunks of `chunk_rows` (None:
    ~256 MiB of fp32 per temporary); the weight gradient is summed per chunk in fp32."""

    @staticmethod
    def forward(ctx, x, weight_w, eps, chunk_rows=None):
        width = x.shape[-1]
        x_tw = x.reshape(-1, width)
        rows = x_tw.shape[0]
        chunk = chunk_rows or _rows_per_chunk(width)
        y_tw = torch.empty(x_tw.shape, dtype=torch.promote_types(weight_w.dtype, x.dtype), device=x.device)
        rstd_t1 = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        for start in range(0, rows, chunk):
            x_f = x_tw[start:start + chunk].to(torch.float32)
            rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
            rstd_t1[start:start + chunk] = rstd
            torch.mul(weight_w, (x_f * rstd).to(x.dtype), out=y_tw[start:start + chunk])
            del x_f
        ctx.save_for_backward(x, weight_w, rstd_t1)
        ctx.chunk = chunk
        return y_tw.view(x.shape)

    @staticmethod
    @once_differentiable  # the backward works in place on its temporaries: no double backward through it
    def backward(ctx, grad_y):
        x, weight_w, rstd_t1 = ctx.saved_tensors
        width = x.shape[-1]
        x_tw = x.reshape(-1, width)
        grad_y_tw = grad_y.reshape(-1, width)
        need_weight = ctx.needs_input_grad[1]
        grad_x_tw = torch.empty_like(x_tw) if ctx.needs_input_grad[0] else None
        grad_weight_f = torch.zeros(width, dtype=torch.float32, device=x.device) if need_weight else None
        for start in range(0, x_tw.shape[0], ctx.chunk):
            end = start + ctx.chunk
            rstd = rstd_t1[start:end]
            grad_y_c = grad_y_tw[start:end]
            x_hat = x_tw[start:end].to(torch.float32) * rstd
            if need_weight:
                grad_weight_f += (grad_y_c * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if grad_x_tw is not None:
                grad_x_hat = (grad_y_c * weight_w).to(torch.float32)
                proj = (grad_x_hat * x_hat).mean(-1, keepdim=True)
                grad_x_hat.sub_(x_hat.mul_(proj)).mul_(rstd)
                grad_x_tw[start:end] = grad_x_hat
            del x_hat
        grad_x = None if grad_x_tw is None else grad_x_tw.view(x.shape)
        grad_weight = None if grad_weight_f is None else grad_weight_f.to(weight_w.dtype)
        return grad_x, grad_weight, None, None


def _efficient_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


# Classes whose forward is exactly "weight * normalised.to(input dtype)" (checked against transformers 5.17
# and 5.24). Others look alike but differ: Gemma's (1 + weight), Olmo2/3 and gpt-oss cast after the weight.
_LLAMA_ORDER_RMSNORMS = {
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3RMSNorm", "Qwen3MoeRMSNorm",
}


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__ in _LLAMA_ORDER_RMSNORMS and isinstance(getattr(module, "weight", None), nn.Parameter)


def install_efficient_rmsnorm(model: nn.Module) -> Handle:
    """Switch every Llama-style RMSNorm in `model` to RMSNormFunction; the Handle's undo() switches them back."""
    patched = [m for m in model.modules() if _is_rmsnorm(m)]
    for module in patched:
        module.forward = types.MethodType(_efficient_forward, module)

    def undo():
        for module in patched:
            module.__dict__.pop("forward", None)

    return Handle(undo, "bf16-saving RMSNorm")


__all__ = ["RMSNormFunction", "install_efficient_rmsnorm"]
