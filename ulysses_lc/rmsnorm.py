"""RMSNorm that keeps its bf16 input for backward instead of fp32 copies: a quarter of a layer's saved bytes.

Legend: t rows (tokens, or tokens x heads for the q/k norms), h the normalised width.

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


class RMSNormFunction(torch.autograd.Function):
    """Forward: weight * (x * rsqrt(mean(x^2) + eps)) with the normalisation in fp32, cast back to x's dtype
    before the weight (transformers' order). Saves x (its own dtype), weight and rstd [t, 1] fp32; sends
    nothing. Backward recomputes x_hat from x and rstd."""

    @staticmethod
    def forward(ctx, x_th, weight_h, eps):
        x_f = x_th.to(torch.float32)
        rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
        y = weight_h * (x_f * rstd).to(x_th.dtype)
        ctx.save_for_backward(x_th, weight_h, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_th, weight_h, rstd = ctx.saved_tensors
        x_hat = x_th.to(torch.float32) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = x_hat.to(x_th.dtype)
            grad_weight = (grad_y * normed).flatten(0, -2).sum(0, dtype=torch.float32).to(weight_h.dtype)
        grad_x_hat = (grad_y * weight_h).to(torch.float32)
        grad_x = rstd * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x_th.dtype), grad_weight, None


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


def install_memory_efficient_rmsnorm(model: nn.Module):
    """Switch every Llama-style RMSNorm in `model` to RMSNormFunction; returns a callable that undoes it."""
    patched = [m for m in model.modules() if _is_rmsnorm(m)]
    for module in patched:
        module.forward = types.MethodType(_efficient_forward, module)

    def undo():
        for module in patched:
            module.__dict__.pop("forward", None)

    return undo


__all__ = ["RMSNormFunction", "install_memory_efficient_rmsnorm"]
