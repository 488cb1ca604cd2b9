"""Activation checkpointing per decoder layer, with the checkpointed inputs held in host memory.

Legend: shape.py (hidden_bse is a layer input on this rank: batch, s_local, hidden size).

With non-reentrant checkpointing each decoder layer keeps only its input hidden_bse for backward (the recompute
rebuilds the rest). At long sequence those inputs, one per layer, are the largest thing left on the device, and
nothing reads them until backward reaches their layer. So we copy them to (pinned) host memory as the forward saves
them and bring them back just before the backward recomputes their layer.

How the tensors are found: we wrap each layer's `torch.utils.checkpoint.checkpoint` call in `saved_tensors_hooks`.
Non-reentrant checkpoint saves its positional tensor arguments (the layer input) under our hooks, and everything the
layer computes inside under its own, inner hooks, so our pack hook sees only the layer input. Keyword tensors such as
the rotary cos/sin and the attention mask are captured by the layer's closure and shared across layers; they never
reach the hook. Parameters and tensors below `min_offload_bytes` stay where they are.

Overlap (CUDA): forward copies device -> pinned host on a side stream (host_pool.HostRoundTrip), overlapping the next
layers' compute. Backward walks layers last to first. When layer i's attention block has finished its backward (a hook
on the block's input gradient; the block is where one layer's working set peaks), we queue the host -> device copy of
layer i-1's tensors on the side stream, so it runs under the rest of layer i's backward and adds nothing to the peak;
layer i-1's unpack then only makes the compute stream wait for that copy's event. (Layers without a `self_attn` block
get the copy queued when layer i's recompute starts.) The last `keep_on_gpu` layers, needed first in backward, are not
offloaded at all.

Host memory: exact-size buffers page-locked with cudaHostRegister, reused from step to step (host_pool.py); torch's
pinned allocator would round each up to a power of two.

Kept attention outputs (`cache_attention_layers`): each layer call runs inside a `LayerRun` entered in the
`RecomputeContext` this handle was given (recompute.py). The attention function (attention.py), handed the same
context, finds the run of its layer there, keeps the kernel's output and log-sum-exp with `run.stash` during the
forward (the same pack path as the layer input, so offloaded layers keep them in host memory) and takes them back with
`run.unstash` in the recompute instead of running the kernel.

Without CUDA the same hooks run: the pack copies into a separate CPU buffer and the stream and event operations are
skipped, so CPU tests exercise the code path. Copies are exact, so gradients are bitwise equal to checkpointing
without offload.
"""

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..handle import Handle
from .cached_memory import CachedMemoryRelease
from .host_pool import HostRoundTrip, wait_unread
from ..layers import checkpointable_layers
from ..recompute import LayerRun, RecomputeContext
from ..shape import ModelShape

_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 18  # real layer inputs are GBs; tiny runs still exercise the hooks


def checkpointed_input_bytes_per_token(shape: ModelShape) -> int:
    """What a checkpointed layer keeps per token until its recompute: its bf16 input (2 x hidden)."""
    return 2 * shape.hidden


class _LayerSaved(LayerRun):
    """A LayerRun that also records what the layer call saved under our hooks, and where it is now."""

    def __init__(self, handle: "CheckpointHandle", index: int, keep: bool, prev: "_LayerSaved | None",
                 keep_attention: bool):
        super().__init__(index, keep_attention)
        self._handle = handle
        self.keep = keep  # a keep_on_gpu layer: nothing moves
        self.prev = prev  # the layer before this one in the same forward pass
        self.signals_prefetch = False  # the forward hooked its attention block's input (see _attention_input)
        self.host: list[torch.Tensor] = []  # host copies, one per offloaded tensor
        self.buffers: list[tuple[torch.Tensor, bool]] = []  # (pool buffer, pinned) behind `host`
        self.devices: list[torch.device] = []
        self.on_device: list[torch.Tensor | None] = []  # prefetched device copies
        self.prefetched = False
        self.h2d_events: list = []  # per prefetched tensor, the event its copy back records (None on CPU)

    def stash(self, tensor: torch.Tensor):
        """Host memory when the layer is offloaded (the pack path of its input); the token is (slot, tensor),
        not the run itself: the run holds the token, and a reference cycle would keep it (and its host
        buffers) alive past its graph."""
        if not self._handle.offload:
            return tensor
        return self._handle._pack(self, tensor)[1:]

    def unstash(self, token) -> torch.Tensor:
        if not self._handle.offload:
            return token
        return self._handle._fetch((self, *token))


class CheckpointHandle(Handle):
    """Returned by `install_checkpointing`: the layers' plan, host memory used, and undo.

    `host_bytes` counts the bytes copied to host in the latest forward pass; `pinned` says whether they
    are page-locked (CUDA only); `host_pool_bytes` is what the reusable host buffers hold.
    """

    def __init__(self, model, layers, offload, keep_on_gpu, min_offload_bytes, checkpoint_kwargs,
                 context: RecomputeContext):
        super().__init__(name="activation checkpointing")
        self.model = model
        self.context = context
        self.layers = list(layers)
        self.offload = offload
        self.keep_on_gpu = keep_on_gpu
        self.recompute_layers = len(self.layers)
        self.cache_attention_layers = 0
        self._release = CachedMemoryRelease()  # configure(release_cached_memory=...)
        self.min_offload_bytes = min_offload_bytes
        self.checkpoint_kwargs = checkpoint_kwargs
        self.host_bytes = 0
        self.pinned = False
        self.prefetched_copies = 0  # layers whose offloaded tensors came back ahead of need (latest pass)
        self.waited_copies = 0  # layers whose recompute had to wait for the copy (the first in backward)
        self._copies = HostRoundTrip()
        self._pool = self._copies.pool
        self._last_saved = None  # weakref: holding the record would hold every layer's host copy
        self._restore: list[tuple[nn.Module, dict]] = []
        self._hooks: list = []

    @property
    def host_pool_bytes(self) -> int:
        return self._pool.bytes

    # ---- checkpoint function installed on each layer ----

    def _checkpoint_layer(self, index: int, function: Callable, *args):
        last = self._last_saved() if self._last_saved is not None else None
        if last is None or index <= last.index:
            # A new forward pass: earlier records belong to a graph backward already consumed (or will consume
            # separately), so start a fresh chain and a fresh byte count.
            last = None
            self.host_bytes = 0
            self.prefetched_copies = self.waited_copies = self._release.released = 0
            self._pool.new_pass()
        keep = not self.offload or index >= self.recompute_layers - self.keep_on_gpu
        keep_attention = index >= self.recompute_layers - self.cache_attention_layers
        saved = _LayerSaved(self, index, keep, last, keep_attention)
        self._last_saved = weakref.ref(saved)
        # Host buffers of a record whose backward never runs (graph dropped) go back to the pool; device copies it
        # brought back but nothing read (a recompute that raised) wait for their copy before their memory is freed.
        weakref.finalize(saved, self._pool.give, saved.buffers)
        weakref.finalize(saved, wait_unread, saved.on_device, saved.h2d_events)

        def run(*inner):
            # The checkpoint calls this twice: forward, then recompute during backward.
            if saved.calls:
                self._release()  # before the recompute's working set
            with self.context.enter(saved):
                return function(*inner)

        if not self.offload:
            return checkpoint(run, *args, **self.checkpoint_kwargs)
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, saved), self._unpack):
            return checkpoint(run, *args, **self.checkpoint_kwargs)

    # ---- saved-tensor hooks ----

    def _pack(self, saved: _LayerSaved, tensor: torch.Tensor):
        """Forward: keep a layer input (or a kept attention output) in host memory; the device tensor is then free to go
        once the layer's graph no longer needs it. Keeps kept-layer, parameter and small tensors on their device as
        they are."""
        nbytes = tensor.numel() * tensor.element_size()
        # Empty tensors: torch's checkpoint (2.11) saves a 0-element CPU dummy next to the inputs.
        if saved.keep or nbytes == 0 or isinstance(tensor, nn.Parameter) or nbytes < self.min_offload_bytes:
            return saved, None, tensor
        host, buffer = self._copies.to_host(tensor, nbytes)
        saved.buffers.append(buffer)
        self.pinned = self.pinned or (tensor.is_cuda and buffer[1])
        saved.host.append(host)
        saved.devices.append(tensor.device)
        saved.on_device.append(None)
        self.host_bytes += nbytes
        return saved, len(saved.host) - 1, None

    def _unpack(self, packed):
        """Backward: hand the recompute its input back on the device. Unless the layer signals a later moment
        (`_attention_block_backward_done`), start bringing the previous layer's tensors back now, under this layer's
        recompute and backward."""
        saved = packed[0]
        tensor = self._fetch(packed)
        if not saved.signals_prefetch:
            self._prefetch(saved.prev)
        return tensor

    def _fetch(self, packed) -> torch.Tensor:
        saved, slot, kept = packed
        if slot is None:
            return kept
        if saved.on_device[slot] is None:
            self.waited_copies += 1  # not prefetched: the compute stream waits for this copy
            self._copy_to_device(saved)
        tensor = saved.on_device[slot]
        if tensor.is_cuda:  # this tensor's own copy, not the layer's later ones (host_pool.HostRoundTrip.to_device)
            torch.cuda.current_stream(tensor.device).wait_event(saved.h2d_events[slot])
        # Drop our reference: the recompute owns the tensor now and frees it after use.
        saved.on_device[slot] = None
        return tensor

    def _prefetch(self, saved: "_LayerSaved | None") -> None:
        if saved is not None and saved.host and not saved.prefetched:
            self.prefetched_copies += 1
            self._copy_to_device(saved)

    def _copy_to_device(self, saved: _LayerSaved) -> None:
        """Queue host -> device copies of all of `saved`'s offloaded tensors, then give their host buffers back to the
        pool. A second backward through the same graph (retain_graph=True) is refused."""
        if saved.prefetched and not saved.host:
            raise RuntimeError(
                "offloaded activations were already brought back for one backward; a second backward through "
                "the same graph (retain_graph=True) is not supported with offload=True."
            )
        # in place: the record's finalizer holds these lists
        saved.on_device[:], saved.h2d_events[:] = self._copies.to_device(saved.host, saved.devices)
        saved.prefetched = True
        # The host copies are done with: their buffers go back to the pool now, not when the record dies with its
        # graph (a training loop holds the last loss, and with it the graph, into the next forward, which would then
        # find no free buffer and pin a second set). The next copy into a buffer queues behind this one on the same
        # side stream.
        saved.host = []
        self._pool.give(saved.buffers)

    # ---- the prefetch signal: a hook on each layer's attention block ----

    def _attention_input(self, index: int, module, args, kwargs):
        """Forward pre-hook on each layer's attention block: hook its input (the normed hidden states), whose gradient
        exists once the block's whole backward (attention, q/k/v norms and RoPE, the projections) is done. Registered
        on the forward's tensors: non-reentrant checkpoint runs the backward of the forward's graph, with saved
        tensors from the recompute; the recompute's own graph never runs backward."""
        saved = self.context.running(index)
        if not isinstance(saved, _LayerSaved) or saved._handle is not self or not torch.is_grad_enabled():
            return None
        x = kwargs.get("hidden_states", args[0] if args else None)
        if saved.calls == 1 and isinstance(x, torch.Tensor) and x.requires_grad:
            saved.signals_prefetch = True
            x.register_hook(functools.partial(self._attention_block_backward_done, saved))
        return None

    def _attention_block_backward_done(self, saved: _LayerSaved, grad):
        """Bring the previous layer's tensors back now. A layer's backward peaks in its attention block (the attention
        backward with its fp32 accumulator, then the q/k norm and RoPE backward in fp32); what is left (the input
        norm's backward) is small, so the prefetched copy adds nothing to the peak. The copy then overlaps little
        compute: ~2 bytes x hidden per token at ~25 GB/s, against a layer recompute of ~0.2 s at 64k tokens and far
        more beyond (attention is quadratic, the copy linear)."""
        self._prefetch(saved.prev)
        saved.prev = None  # the chain is not needed past this point; let finished records go
        return None

    def _attention_output(self, index: int, module, args, output):
        """Forward hook on the attention block: in a checkpointed layer's recompute, release the cached device memory
        just before its attention backward (cached_memory.py)."""
        saved = self.context.running(index)
        if isinstance(saved, _LayerSaved) and saved._handle is self and saved.calls == 1 and torch.is_grad_enabled():
            self._release.before_backward_of(output)
        return None

    # ---- public ----

    def report(self) -> dict:
        """Layers checkpointed, offloaded, keeping their attention output, and host bytes of the latest forward pass."""
        n = self.recompute_layers
        return {
            "plain_layers": len(self.layers) - n,
            "checkpointed_layers": n,
            "offloaded_layers": n - self.keep_on_gpu if self.offload else 0,
            "kept_on_device_layers": self.keep_on_gpu if self.offload else n,
            "cached_attention_layers": self.cache_attention_layers,
            "host_bytes": self.host_bytes,
            "host_pool_bytes": self.host_pool_bytes,
            "pinned": self.pinned,
            "prefetched_copies": self.prefetched_copies,
            "waited_copies": self.waited_copies,
            "released_cached_memory": self._release.released,
        }

    def configure(
        self, *, recompute_layers: int | None = None, keep_on_gpu: int | None = None,
        cache_attention_layers: int | None = None, release_cached_memory: bool | None = None,
    ) -> None:
        """Change the layers' plan between steps (memory.MemoryPlan's fields; SequenceParallelCausalLM.use_plan).

        recompute_layers: the first this-many layers are checkpointed; the later ones keep all their
            activations and skip the recompute (faster, needed first in backward, so they free first).
        keep_on_gpu: of the checkpointed layers, the last this-many keep their input on the device.
        cache_attention_layers: of the checkpointed layers, the last this-many keep their attention output
            (and its softmax statistics) from the forward, so their recompute skips the attention kernel,
            most of a layer's forward at long context. The output goes where the layer's input goes (host
            memory when offloaded). Needs ulysses_lc's attention handed this handle's `context`
            (UlyssesAttention(recompute=...), as SequenceParallelCausalLM does) and the cuDNN or FLASH SDPA
            backend (the CPU kernel on CPU); elsewhere those layers recompute attention as usual.
        release_cached_memory: torch.cuda.empty_cache() at each checkpointed layer's recompute and before its
            attention backward (slack ~10%, not 15%: memory_model.OFFLOADED_PARAMS_SLACK). No-op off CUDA.
        None leaves a setting as it is. Every rank of a run must use the same plan: recompute repeats the
        layer's collectives (Ulysses all-to-all, ZeRO-3 gathers), so ranks that differ would deadlock.
        """
        n = len(self.layers)
        recompute = self.recompute_layers if recompute_layers is None else recompute_layers
        keep = self.keep_on_gpu if keep_on_gpu is None else keep_on_gpu
        cache = self.cache_attention_layers if cache_attention_layers is None else cache_attention_layers
        if not 0 <= recompute <= n:
            raise ValueError(f"recompute_layers={recompute} must be in [0, {n}] (the number of decoder layers).")
        if not 0 <= keep <= recompute:
            raise ValueError(f"keep_on_gpu={keep} must be in [0, recompute_layers={recompute}].")
        if cache_attention_layers is None:
            cache = min(cache, recompute)
        if not 0 <= cache <= recompute:
            raise ValueError(f"cache_attention_layers={cache} must be in [0, recompute_layers={recompute}].")
        self.recompute_layers, self.keep_on_gpu, self.cache_attention_layers = recompute, keep, cache
        if release_cached_memory is not None:
            self._release.enabled = bool(release_cached_memory)
        self.host_bytes = 0  # counts the next forward pass, under the new plan
        self._pool.release()  # free buffers sized for the old plan; those in use come back for reuse
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < recompute

    def release_host_memory(self) -> None:
        """Give the reusable host buffers back to the system (they are made again at the next step)."""
        self._pool.release()

    def _restore_layers(self) -> None:
        """Restore each layer's checkpointing attributes as they were before; free the host buffers."""
        for layer, before in self._restore:
            for name, value in before.items():
                if value is _MISSING:
                    layer.__dict__.pop(name, None)
                else:
                    setattr(layer, name, value)
        self._restore = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._pool.close()


_MISSING = object()


def install_checkpointing(
    model: nn.Module,
    offload: bool = True,
    keep_on_gpu: int = 0,
    min_offload_bytes: int = _DEFAULT_MIN_OFFLOAD_BYTES,
    checkpoint_kwargs: dict | None = None,
    recompute_layers: int | None = None,
    cache_attention_layers: int = 0,
    context: RecomputeContext | None = None,
) -> CheckpointHandle:
    """Turn on non-reentrant activation checkpointing for every decoder layer, optionally offloaded.

    offload: keep each layer's checkpointed input in host memory between forward and backward.
    keep_on_gpu: the last this-many checkpointed layers (needed first in backward) are not offloaded.
    recompute_layers: checkpoint only the first this-many layers (default all); see CheckpointHandle.configure.
    cache_attention_layers: the last this-many checkpointed layers keep their attention output, so their
        recompute skips the attention kernel; see CheckpointHandle.configure.
    min_offload_bytes: saved tensors smaller than this stay on the device.
    context: the RecomputeContext to enter each layer call in; hand the same one to UlyssesAttention so
        layers can keep their attention output (a new one when None: `handle.context`).
    checkpoint_kwargs: extra arguments for torch.utils.checkpoint.checkpoint (non-reentrant only).

    We set the layers' `gradient_checkpointing` / `_gradient_checkpointing_func` directly, not through
    `model.gradient_checkpointing_enable`: renamed in transformers 5.24 (`activation_checkpointing_enable`), it also
    installs an input-embedding hook that only reentrant checkpointing needs.
    """
    layers = checkpointable_layers(model)
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    if checkpoint_kwargs.pop("use_reentrant", False):
        raise ValueError(
            "use_reentrant=True is not supported: offload hooks and ZeRO-3 rely on non-reentrant checkpointing; "
            "drop use_reentrant from checkpoint_kwargs."
        )
    checkpoint_kwargs["use_reentrant"] = False
    handle = CheckpointHandle(model, layers, offload, keep_on_gpu, min_offload_bytes, checkpoint_kwargs,
                              context if context is not None else RecomputeContext())
    handle._undo_fn = handle._restore_layers
    for layer in layers:
        before = {name: layer.__dict__.get(name, _MISSING) for name in ("gradient_checkpointing", "_gradient_checkpointing_func")}
        handle._restore.append((layer, before))
    try:
        handle.configure(recompute_layers=recompute_layers, keep_on_gpu=keep_on_gpu,
                         cache_attention_layers=cache_attention_layers)
    except ValueError:
        handle.undo()
        raise
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(handle._checkpoint_layer, index)
        block = getattr(layer, "self_attn", None)
        if isinstance(block, nn.Module):
            hook = functools.partial(handle._attention_input, index)
            handle._hooks.append(block.register_forward_pre_hook(hook, with_kwargs=True))
            handle._hooks.append(block.register_forward_hook(functools.partial(handle._attention_output, index)))
    return handle


__all__ = ["CheckpointHandle", "checkpointed_input_bytes_per_token", "install_checkpointing"]
