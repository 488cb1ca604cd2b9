"""What the gated DeltaNet layers add to a step's time on the kernel path the run takes (sizing.Job.step_seconds),
and which path that is when nothing can be probed (the dry run has no GPU).

  deltanet_path(kernel)   (path, why) by DELTANET_RULE, from what this machine can tell without a GPU
  torch_path_seconds      the torch path's seconds in one step: its measured cost per token, forward and backward

fla's Triton kernels (`chunk_gated_delta_rule`) are priced as every other kernel, by their FLOPs
(shape.recurrence_flops) at the attention kernel's rate. Measured on an H200 with Triton 3.7.1 (below it fla's
gated backward refuses Hopper, flash-linear-attention issue #640): one layer at 256k tokens, fwd+bwd, 0.125 s;
whole 24-layer Qwen3.5-0.8B steps within 5% of the step model at 256k and 1M tokens, where attention's wide heads
take most of the step (sizing.ATTENTION_FLOPS_PER_S_WIDE_HEADS). transformers' torch path, which trains there,
is not FLOPs-bound: its chunked rule runs each 1,024-token segment (linear_attention.TORCH_SEGMENT_TOKENS) as a
few hundred small kernels (a 63-step loop building the chunks' in-chunk matrix, then one step per 64-token chunk),
each, by its tensors' sizes at 16 value heads of 128 (not profiled), less work than its launch. So its time is a
cost per token of the whole sequence and per layer, taken as the same for any head count while the kernels stay
that small; under Ulysses each rank runs the whole sequence for its heads (linear_attention.py), so sp is taken not
to divide it (measured at sp 1 only).
"""

from __future__ import annotations

from importlib import metadata, util

from ..mixers.linear_attention import FLA_FIX, FLA_TORCH

DELTANET_RULE = "fla where fla-core is installed and its backward runs on the GPU, else the torch path"
DELTANET_PATHS = ("auto", "fla", "torch")
# fla refuses its gated backward on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1, where it computes wrong gradients
# (fla-core 0.6.0, fla/ops/common/chunk_o.py, issue #640). The step time prices an H200 (sizing.py's rates): Hopper.
FLA_REFUSED_TRITON = ("3.4.0", "3.7.1")

# Seconds per token of the whole sequence, per gated DeltaNet layer and rank, on the torch path, beyond what the
# FLOPs model prices (the layer's projections as matmuls, its norms as memory-bound work). Fitted to four whole steps
# of the Qwen3.5-0.8B shape (6 DeltaNet layers of 8, or 18 of 24; 16 value heads of 128) on one H200 with the image's
# Triton 3.6.0, fla-core not installed, measured on one machine on 2026-12-04 (issue 43 item 3; records in
# benchmarks/results/2026-12-04/torch_path/, BENCHMARKS.md "the torch path refitted"): 8 layers at 32,768 tokens
# (plan 0/0/0: forward + backward once) 3.52 s, at 131,072 (3/3/3) 16.98 s, at 262,144 (6/6/6, five DeltaNet
# layers recomputed) 39.77 s; 24 layers at 131,072 (19/19/19, 15 recomputed) 56.16 s. Least squares on the steps'
# relative error: forward 5.3 us, backward 10.7 us; each step within 1.5% of it, and each one held out of a fit on
# the other three within 5.2%. The constants before (5.3 / 25.0 us, fitted to the 8-layer steps of 2026-12-01)
# put these steps at 1.58-1.79x: the same steps run faster on today's code (3.52 s against 6.28 s at 32k), the cause
# not isolated. Its backward (autograd through those small kernels, several per forward op) is most of it.
TORCH_FORWARD_S_PER_TOKEN = 5.3e-6
TORCH_BACKWARD_S_PER_TOKEN = 10.7e-6


def _triton_version() -> str | None:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def deltanet_path(kernel: str = "auto") -> tuple[str, str]:
    """("fla" or "torch", why) for the gated DeltaNet layers by DELTANET_RULE, read from this machine's packages
    without importing them or touching a GPU (linear_attention.resolve_deltanet_kernel probes the GPU at run time):
    fla where fla-core is installed and Triton is outside the range whose gated backward fla refuses on Hopper."""
    if kernel not in DELTANET_PATHS:
        raise ValueError(f"deltanet path {kernel!r}: pick one of {DELTANET_PATHS}.")
    if kernel != "auto":
        return kernel, "asked for"
    if util.find_spec("fla") is None:
        return "torch", "fla-core not installed here"
    triton = _triton_version()
    if triton is None:
        return "torch", "fla-core without Triton here"
    from packaging.version import Version

    low, high = FLA_REFUSED_TRITON
    if Version(low) <= Version(triton) < Version(high):
        return "torch", f"fla refuses its gated backward on Hopper with Triton {triton}; {FLA_FIX}"
    return "fla", f"fla-core, Triton {triton}"


def torch_path_seconds(shape, seq_len: int, sp_size: int, recompute_layers: int) -> float:
    """Seconds the gated DeltaNet layers of `shape` (a shape.ModelShape) take one rank in a step on the torch path:
    each layer's forward and backward over the whole (padded) sequence, and the forward again in each of the first
    `recompute_layers` layers that is one of them (checkpointed: a DeltaNet layer keeps no output to skip it)."""
    linear = shape.linear_layers
    if not linear:
        return 0.0
    tokens = -(-seq_len // sp_size) * sp_size
    recomputed = sum(linear[:recompute_layers])
    return tokens * (sum(linear) * (TORCH_FORWARD_S_PER_TOKEN + TORCH_BACKWARD_S_PER_TOKEN)
                     + recomputed * TORCH_FORWARD_S_PER_TOKEN)


def pricing_line(shape, kernel: str = "auto") -> str | None:
    """How the step time priced the gated DeltaNet layers, for the start-up block (None: the model has none)."""
    count = sum(shape.linear_layers)
    if not count:
        return None
    path, why = deltanet_path(kernel)
    layers = f"{count} gated DeltaNet layer{'s' if count > 1 else ''}"
    if path == "fla":
        return f"{layers} on fla ({why}): their FLOPs at the attention rate"
    return (f"{layers} on the torch path ({why}): {TORCH_FORWARD_S_PER_TOKEN * 1e6:.1f} us "
            f"forward, {TORCH_BACKWARD_S_PER_TOKEN * 1e6:.1f} us backward per token and layer on each rank, measured")


__all__ = ["DELTANET_PATHS", "DELTANET_RULE", "FLA_FIX", "FLA_TORCH", "deltanet_path", "pricing_line", "torch_path_seconds"]
