"""Giving the CUDA caching allocator's free memory back before a checkpointed layer's peaks.

At a million tokens and more a layer's backward peaks twice: in its recompute and in its attention backward. Between
them the allocator holds pages freed since (the loss head's gradient, the MLP tiles'), and with expandable segments a
new peak maps pages of its own beside those held in holes between live blocks. `torch.cuda.empty_cache()` just before
each peak unmaps them. Measured on the Llama-3.1-8B shape cut to one layer at 1,637,376 tokens (zero3_offload_all, one
H200): 131.8 GB reserved for 119.9 allocated (9.9%) against 137.6 without (14.8%), the step 174.7 s against 179.5
(BENCHMARKS.md, 2026-12-04). memory_model.OFFLOADED_PARAMS_SLACK prices it; the plan turns it on where ZeRO-3's
parameters are offloaded (sizing.Job.release_cached_memory). Off CUDA it does nothing.
"""

import torch


class CachedMemoryRelease:
    """`enabled` turns it on; `released` counts the releases of the latest forward/backward pass."""

    def __init__(self):
        self.enabled = False
        self.released = 0

    def __call__(self, *_) -> None:
        if self.enabled and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            self.released += 1

    def before_backward_of(self, output) -> None:
        """Release just before the backward reaches `output` (a module's output in the recompute)."""
        out = output[0] if isinstance(output, tuple) else output
        if self.enabled and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self)


__all__ = ["CachedMemoryRelease"]
