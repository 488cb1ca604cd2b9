"""Activation checkpointing per decoder layer, with the checkpointed inputs held in host memory.

Shape legend:
    b  batch
    s  sequence (local to this rank under sequence parallelism)
    h  hidden size

With non-reentrant checkpointing each decoder layer keeps only its input hidden_states_bsh
for backward (the recompute rebuilds the rest). At long sequence those inputs, one per
layer, are the largest thing left on the device, and nothing reads them until backward
reaches their layer. So we copy them to (pinned) host memory as the forward saves them and
bring them back just before the backward recomputes their layer.

How the tensors are found: we wrap each layer's `torch.utils.checkpoint.checkpoint` call in
`saved_tensors_hooks`. Non-reentrant checkpoint saves its positional tensor arguments (the
layer input) under our hooks, and everything the layer computes inside under its own, inner
hooks, so our pack hook sees only the layer input. Keyword tensors such as the rotary cos/sin
and the attention mask are captured by the layer's closure and shared across layers; they
never reach the hook. Parameters and tensors below `min_offload_bytes` stay where they are.

Overlap (CUDA): forward copies device -> pinned host on a side stream, after waiting for
the compute stream up to the save, so the copy overlaps the next layers' compute; the
device tensor is `record_stream`-ed on the side stream so its memory is not reused before
the copy is done. Backward walks layers last to first: when layer i's input is unpacked
(its recompute is about to start) we queue the host -> device copy of layer i-1's input on
the side stream, so it runs under layer i's recompute and backward; layer i-1's unpack then
only makes the compute stream wait for that copy's event. The last `keep_on_gpu` layers,
needed first in backward, are not offloaded at all: with keep_on_gpu >= 1 even the first
backward layer has no copy to wait for.

Without CUDA the same hooks run: the pack copies into a separate CPU buffer and the stream
and event operations are skipped, so CPU tests exercise the code path. Copies are exact, so
gradients are bitwise equal to checkpointing without offload.
"""

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .layers import decoder_layers, text_config

_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 18  # real layer inputs are GBs; tiny runs still exercise the hooks


class _LayerSaved:
    """What one checkpointed layer call saved under our hooks, and where it is now."""

    def __init__(self, index: int, keep: bool, prev: "_LayerSaved | None"):
        self.index = index
        self.keep = keep  # a keep_on_gpu layer: nothing moves
        self.prev = prev  # the layer before this one in the same forward pass
        self.host: list[torch.Tensor] = []  # host copies, one per offloaded tensor
        self.devices: list[torch.device] = []
        self.on_device: list[torch.Tensor | None] = []  # prefetched device copies
        self.h2d_event = None


class CheckpointHandle:
    """Returned by `enable_checkpointing`: reports host memory used and undoes the change.

    `host_bytes` counts the bytes copied to host in the latest forward pass; `pinned` says
    whether they are page-locked (CUDA only).
    """

    def __init__(self, model, layers, offload, keep_on_gpu, min_offload_bytes, checkpoint_kwargs):
        self.model = model
        self.layers = list(layers)
        self.offload = offload
        self.keep_on_gpu = keep_on_gpu
        self.recompute_layers = len(self.layers)
        self.min_offload_bytes = min_offload_bytes
        self.checkpoint_kwargs = checkpoint_kwargs
        self.host_bytes = 0
        self.pinned = False
        self._last_saved = None  # weakref: holding the record would hold every layer's host copy
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._restore: list[tuple[nn.Module, dict]] = []

    # ---- checkpoint function installed on each layer ----

    def _checkpoint_layer(self, index: int, function: Callable, *args):
        if not self.offload:
            return checkpoint(function, *args, **self.checkpoint_kwargs)
        last = self._last_saved() if self._last_saved is not None else None
        if last is None or index <= last.index:
            # A new forward pass: earlier records belong to a graph backward already consumed
            # (or will consume separately), so start a fresh chain and a fresh byte count.
            last = None
            self.host_bytes = 0
        keep = index >= self.recompute_layers - self.keep_on_gpu
        saved = _LayerSaved(index, keep, last)
        self._last_saved = weakref.ref(saved)
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, saved), self._unpack):
            return checkpoint(function, *args, **self.checkpoint_kwargs)

    # ---- saved-tensor hooks ----

    def _pack(self, saved: _LayerSaved, tensor: torch.Tensor):
        """Forward: keep a layer input in (pinned) host memory; the device tensor is then free
        to go once the layer's graph no longer needs it. Keeps kept-layer, parameter and small
        tensors on their device as they are."""
        nbytes = tensor.numel() * tensor.element_size()
        # Empty tensors: torch's checkpoint (2.11) saves a 0-element CPU dummy next to the inputs.
        if saved.keep or nbytes == 0 or isinstance(tensor, nn.Parameter) or nbytes < self.min_offload_bytes:
            return saved, None, tensor
        on_cuda = tensor.is_cuda
        host = torch.empty_like(tensor, device="cpu", pin_memory=on_cuda)
        if on_cuda:
            side = self._side_stream(tensor.device)
            # The copy must see the finished tensor: wait for everything queued so far.
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)
            self.pinned = True
        else:
            host.copy_(tensor)
        saved.host.append(host)
        saved.devices.append(tensor.device)
        saved.on_device.append(None)
        self.host_bytes += nbytes
        return saved, len(saved.host) - 1, None

    def _unpack(self, packed):
        """Backward: hand the recompute its input back on the device, and start bringing the
        previous layer's input back from the host."""
        saved, slot, kept = packed
        if slot is None:
            tensor = kept
        else:
            if saved.on_device[slot] is None:
                self._copy_to_device(saved)
            tensor = saved.on_device[slot]
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).wait_event(saved.h2d_event)
            # Drop our reference: the recompute owns the tensor now and frees it after use.
            saved.on_device[slot] = None
        # Layer i is about to recompute: bring layer i-1's input back under its compute.
        if saved.prev is not None and saved.prev.host and all(t is None for t in saved.prev.on_device):
            self._copy_to_device(saved.prev)
        return tensor

    def _copy_to_device(self, saved: _LayerSaved) -> None:
        """Queue host -> device copies of all of `saved`'s offloaded tensors."""
        on_device = []
        for host, device in zip(saved.host, saved.devices):
            if device.type != "cuda":
                # CPU: the host copy already is a tensor on the right device.
                on_device.append(host)
                continue
            compute = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            # Allocated on the compute stream, which is where it is used and freed; the side
            # stream waits so it does not write into memory the compute stream still uses.
            dst = torch.empty_like(host, device=device)
            side.wait_stream(compute)
            # The device -> host copy was queued earlier on this same stream, so it is done first.
            with torch.cuda.stream(side):
                dst.copy_(host, non_blocking=True)
                saved.h2d_event = torch.cuda.Event()
                saved.h2d_event.record(side)
            on_device.append(dst)
        saved.on_device = on_device

    def _side_stream(self, device: torch.device):
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]

    # ---- public ----

    def report(self) -> dict:
        """Layers checkpointed and offloaded, and host bytes of the latest forward pass."""
        n = self.recompute_layers
        return {
            "plain_layers": len(self.layers) - n,
            "checkpointed_layers": n,
            "offloaded_layers": n - self.keep_on_gpu if self.offload else 0,
            "kept_on_device_layers": self.keep_on_gpu if self.offload else n,
            "host_bytes": self.host_bytes,
            "pinned": self.pinned,
        }

    def configure(self, recompute_layers: int | None = None, keep_on_gpu: int | None = None) -> None:
        """Change the memory plan between steps (e.g. once the optimizer state is allocated).

        recompute_layers: the first this-many layers are checkpointed; the later ones keep all their
            activations and skip the recompute (faster, needed first in backward, so they free first).
        keep_on_gpu: of the checkpointed layers, the last this-many keep their input on the device.
        None leaves a setting as it is. Every rank of a run must use the same plan: recompute repeats the
        layer's collectives (Ulysses all-to-all, ZeRO-3 gathers), so ranks that differ would deadlock.
        """
        n = len(self.layers)
        recompute = self.recompute_layers if recompute_layers is None else recompute_layers
        keep = self.keep_on_gpu if keep_on_gpu is None else keep_on_gpu
        if not 0 <= recompute <= n:
            raise ValueError(f"recompute_layers={recompute} must be in [0, {n}] (the number of decoder layers).")
        if not 0 <= keep <= recompute:
            raise ValueError(f"keep_on_gpu={keep} must be in [0, recompute_layers={recompute}].")
        self.recompute_layers, self.keep_on_gpu = recompute, keep
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < recompute

    def undo(self) -> None:
        """Restore each layer's checkpointing attributes as they were before."""
        for layer, before in self._restore:
            for name, value in before.items():
                if value is _MISSING:
                    layer.__dict__.pop(name, None)
                else:
                    setattr(layer, name, value)
        self._restore = []


_MISSING = object()


def _checkpointable_layers(model: nn.Module) -> nn.ModuleList:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = decoder_layers(model, "enable_checkpointing")
    if not all(isinstance(m, GradientCheckpointingLayer) for m in layers):
        raise ValueError(
            f"{type(model).__name__}'s layers are not transformers GradientCheckpointingLayer; "
            "enable_checkpointing supports transformers v5 decoder models laid out like Llama/Qwen3."
        )
    return layers


def enable_checkpointing(
    model: nn.Module,
    offload: bool = True,
    keep_on_gpu: int = 0,
    min_offload_bytes: int = _DEFAULT_MIN_OFFLOAD_BYTES,
    checkpoint_kwargs: dict | None = None,
    recompute_layers: int | None = None,
) -> CheckpointHandle:
    """Turn on non-reentrant activation checkpointing for every decoder layer, optionally offloaded.

    offload: keep each layer's checkpointed input in host memory between forward and backward.
    keep_on_gpu: the last this-many checkpointed layers (needed first in backward) are not offloaded.
    recompute_layers: checkpoint only the first this-many layers (default all); see CheckpointHandle.configure.
    min_offload_bytes: saved tensors smaller than this stay on the device.
    checkpoint_kwargs: extra arguments for torch.utils.checkpoint.checkpoint (non-reentrant only).

    We set the layers' `gradient_checkpointing` / `_gradient_checkpointing_func` directly
    rather than through `model.gradient_checkpointing_enable`: that entry point was renamed
    between the transformers versions we support (deprecated for `activation_checkpointing_enable`
    in 5.24), and it also installs an input-embedding hook that only reentrant checkpointing needs.
    """
    layers = _checkpointable_layers(model)
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    if checkpoint_kwargs.pop("use_reentrant", False):
        raise ValueError(
            "use_reentrant=True is not supported: offload hooks and ZeRO-3 rely on non-reentrant checkpointing; "
            "drop use_reentrant from checkpoint_kwargs."
        )
    checkpoint_kwargs["use_reentrant"] = False
    handle = CheckpointHandle(model, layers, offload, keep_on_gpu, min_offload_bytes, checkpoint_kwargs)
    for layer in layers:
        before = {name: layer.__dict__.get(name, _MISSING) for name in ("gradient_checkpointing", "_gradient_checkpointing_func")}
        handle._restore.append((layer, before))
    try:
        handle.configure(recompute_layers, keep_on_gpu)
    except ValueError:
        handle.undo()
        raise
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(handle._checkpoint_layer, index)
    return handle


def plan_activation_memory(config, seq_local: int, free_bytes: int, headroom: float = 0.8) -> tuple[int, int]:
    """(recompute_layers, keep_on_gpu) for a step allowed `free_bytes` more device memory.

    Skipping a layer's recompute saves a layer forward (a fifth to a quarter of the step at long
    context), but that layer then keeps all its activations. The plan first reserves one layer's
    recompute + backward working set and the loss chunk, then turns recompute off for as many (last)
    layers as fit, then keeps as many checkpointed inputs on the device as fit; the rest are offloaded.
    Bytes per local token from the layer shape (h hidden, q = heads x head_dim, kv likewise), bf16:
      plain layer    2 (4h + 3q + 3kv) x 1.25  (inputs of the norms and projections, q/k/v, attention output)
      working set    2 (8h + 6q + 6kv) + 4q    (+ cuDNN's fp32 dq accumulator); measured 54 KB/token on
                     the Qwen3-0.6B shape (H200, BENCHMARKS.md) against 61 KB by this formula
      kept input     2h
    plus the chunked loss: its fp32 weight gradient (vocab x h x 4 bytes), the hidden-state gradient it
    computes in forward (2h per token) and ~1 GiB of logits per chunk.
    Only `headroom` of the free memory is planned for (allocator fragmentation, collectives' buffers).
    """
    cfg = text_config(config)
    h = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    layers = cfg.num_hidden_layers
    loss = getattr(cfg, "vocab_size", 0) * h * 4 + seq_local * 2 * h + (1 << 30)
    working = seq_local * (2 * (8 * h + 6 * q + 6 * kv) + 4 * q) + loss
    plain = seq_local * 2 * (4 * h + 3 * q + 3 * kv) * 1.25
    kept = seq_local * 2 * h
    avail = free_bytes * headroom - working
    if avail <= 0:
        return layers, 0
    n_plain = min(layers, int(avail // plain))
    avail -= n_plain * plain
    recompute = layers - n_plain
    return recompute, min(recompute, int(avail // kept))


__all__ = ["CheckpointHandle", "enable_checkpointing", "plan_activation_memory"]
