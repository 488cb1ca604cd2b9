"""The one channel between activation checkpointing and attention: which checkpointed layer is running.

A checkpointed decoder layer runs twice: its forward, then, during backward, its recompute. Attention can
skip the kernel in the recompute if the forward kept the kernel's output (`attention.kept_output_attention`),
which needs to know which layer is running, whether this is its forward or its recompute, and where to keep
tensors so the checkpoint's offload (host memory) applies to them too. Checkpointing (checkpointing.py) owns
that knowledge; it hands it to attention through a `RecomputeContext` both were given:

    context = RecomputeContext()
    install_checkpointing(model, context=context, ...)      # enters a LayerRun around each layer call
    UlyssesAttention(layout, recompute=context).install(model)   # asks context.running(layer_idx)

Keyed by layer index, not by thread: autograd runs the recompute on its own device thread, while a layer's
forward and its recompute never overlap in time.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class LayerRun:
    """One checkpointed layer call, forward then recompute; what its forward keeps for the recompute.

    index: the decoder layer's index (transformers' `layer_idx` of its attention module).
    keep_attention: its forward keeps the attention output, so the recompute skips the kernel.
    kept_attention: what attention put there during the forward (opaque to checkpointing).
    stash / unstash: keep a tensor of the forward for the recompute. Here it stays where it is; the
    checkpointing of an offloaded layer overrides both to hold it in host memory.
    """

    def __init__(self, index: int, keep_attention: bool):
        self.index = index
        self.keep_attention = keep_attention
        self.calls = 0  # 1 during the forward, 2 during the recompute
        self.kept_attention = None

    @property
    def is_recompute(self) -> bool:
        return self.calls > 1

    def stash(self, tensor: torch.Tensor):
        """Keep `tensor` for the recompute; returns a token for `unstash`."""
        return tensor

    def unstash(self, token) -> torch.Tensor:
        return token


class RecomputeContext:
    """Which checkpointed layer's forward or recompute is running: set by checkpointing, read by attention."""

    def __init__(self):
        self._running: dict[int, LayerRun] = {}

    def running(self, layer_index: int | None) -> LayerRun | None:
        """The run of layer `layer_index` in progress, or None (not checkpointed, or not running)."""
        return None if layer_index is None else self._running.get(layer_index)

    @contextmanager
    def enter(self, run: LayerRun):
        """Around one call of a checkpointed layer's function: the forward, then again the recompute."""
        run.calls += 1
        outer = self._running.get(run.index)
        self._running[run.index] = run
        try:
            yield run
        finally:
            if outer is None:
                self._running.pop(run.index, None)
            else:
                self._running[run.index] = outer


__all__ = ["LayerRun", "RecomputeContext"]
