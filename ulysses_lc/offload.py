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
the copy is done. Backward walks layers last to first. When layer i's attention block has
finished its backward (a hook on the block's input gradient; the block is where one layer's
working set peaks), we queue the host -> device copy of layer i-1's tensors on the side
stream, so it runs under the rest of layer i's backward and adds nothing to the peak; layer
i-1's unpack then only makes the compute stream wait for that copy's event. (Layers without
a `self_attn` block get the copy queued when layer i's recompute starts.) The last
`keep_on_gpu` layers, needed first in backward, are not offloaded at all.

Host memory: exact-size buffers page-locked with cudaHostRegister, reused from step to step
(`_HostPool`); torch's pinned allocator would round each up to a power of two.

Kept attention outputs (`cache_attention_layers`): the attention function (attention.py)
stores the kernel's output and log-sum-exp in the layer's record during the forward, through
the same pack path (so offloaded layers keep them in host memory), and the recompute takes
them back instead of running the kernel. `active_checkpointed_layer()` tells it which record
is running.

Without CUDA the same hooks run: the pack copies into a separate CPU buffer and the stream
and event operations are skipped, so CPU tests exercise the code path. Copies are exact, so
gradients are bitwise equal to checkpointing without offload.
"""

import functools
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .layers import decoder_layers, text_config

_DEFAULT_MIN_OFFLOAD_BYTES = 1 << 18  # real layer inputs are GBs; tiny runs still exercise the hooks

# The checkpointed layer whose forward (or recompute) is running on this thread: (handle, record).
# Set by CheckpointHandle around the layer function; read by the attention function (kept attention
# outputs, the prefetch signal). Thread-local: autograd may recompute on its own device threads.
_ACTIVE = threading.local()


def active_checkpointed_layer():
    """(CheckpointHandle, record) of the checkpointed decoder layer running on this thread, or None."""
    return getattr(_ACTIVE, "layer", None)


class _LayerSaved:
    """What one checkpointed layer call saved under our hooks, and where it is now."""

    def __init__(self, index: int, keep: bool, prev: "_LayerSaved | None", cache_attention: bool):
        self.index = index
        self.keep = keep  # a keep_on_gpu layer: nothing moves
        self.prev = prev  # the layer before this one in the same forward pass
        self.cache_attention = cache_attention  # keep the attention output: the recompute skips the kernel
        self.calls = 0  # 1 during the forward, 2 during the recompute
        self.signals_prefetch = False  # the forward hooked its attention block's input (see _attention_input)
        self.attention = None  # what the forward kept of the attention (see attention.kept_output_attention)
        self.host: list[torch.Tensor] = []  # host copies, one per offloaded tensor
        self.buffers: list[tuple[torch.Tensor, bool]] = []  # (pool buffer, pinned) behind `host`
        self.devices: list[torch.device] = []
        self.on_device: list[torch.Tensor | None] = []  # prefetched device copies
        self.prefetched = False
        self.h2d_event = None


_PAGE = 4096


def _unregister_all(registered: dict) -> None:
    """Finalizer of a _HostPool: unpin what is still registered before the memory can be freed."""
    if registered and torch.cuda.is_available():
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for ptr in list(registered):
            cudart.cudaHostUnregister(ptr)
    registered.clear()


class _HostPool:
    """Exact-size host buffers, page-locked with cudaHostRegister, reused from step to step.

    `torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every
    block up to a power of two: a 2.5 GiB layer input (Qwen3-4B shape, 512k tokens) takes 4 GiB of pinned
    memory, and 36 of them do not fit a node's RAM. Here each buffer is a plain host allocation rounded up
    to whole pages and page-aligned (so no two buffers share a page, which registration would refuse),
    registered once and kept for the next step (registration costs ~0.1-0.3 s per GB, so only the first
    step pays it). Without CUDA the buffers are ordinary memory (CPU tests).
    """

    def __init__(self):
        self._free: dict[tuple[int, bool], list[tuple[torch.Tensor, int]]] = {}  # -> [(buffer, pass returned in)]
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> the registered page-aligned region
        self._closed = False
        self.bytes = 0  # everything this pool holds, in use or free
        self.passes = 0  # forward passes started
        weakref.finalize(self, _unregister_all, self._registered)

    def take(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
        free = self._free.get((nbytes, pin))
        if free:
            return free.pop()[0], pin
        if not pin:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        else:
            size = -(-nbytes // _PAGE) * _PAGE
            raw = torch.empty(size + _PAGE, dtype=torch.uint8)
            offset = (-raw.data_ptr()) % _PAGE
            region = raw[offset:offset + size]
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(region.data_ptr(), size, 0)
            if err != cudart.cudaError.success:
                raise RuntimeError(
                    f"cudaHostRegister of {size / 2**30:.2f} GiB for activation offload failed ({err}); the "
                    "usual cause is a locked-memory limit (raise `ulimit -l`, or the container's memlock limit) "
                    "or host RAM: keep more layers on the GPU (keep_on_gpu) or offload fewer."
                )
            self._registered[region.data_ptr()] = region
            buf = region[:nbytes]
        self.bytes += nbytes
        return buf, pin

    def give(self, buffers: list[tuple[torch.Tensor, bool]]) -> None:
        """Return (buffer, pinned) pairs for reuse, emptying the list. Safe as soon as their copy back is
        queued: the next copy into one is queued later on the same side stream."""
        while buffers:
            buf, pin = buffers.pop()
            if self._closed:
                self._drop(buf)
            else:
                self._free.setdefault((buf.numel(), pin), []).append((buf, self.passes))

    def new_pass(self) -> None:
        """A forward pass starts: drop free buffers no pass has used since the one before the last (left
        over from a warm-up at another length, or from a plan that offloaded more layers)."""
        self.passes += 1
        stale = [(key, item) for key, items in self._free.items() for item in items if item[1] < self.passes - 2]
        if not stale:
            return
        if torch.cuda.is_available() and self._registered:
            torch.cuda.synchronize()  # only when something is dropped: copies out of it must be done
        for key, item in stale:
            self._free[key].remove(item)
            self._drop(item[0])

    def _drop(self, buf: torch.Tensor) -> None:
        self.bytes -= buf.numel()
        if self._registered.pop(buf.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def release(self) -> None:
        """Unregister and drop the free buffers (buffers in use come back to the pool for reuse)."""
        if torch.cuda.is_available() and self._registered:
            torch.cuda.synchronize()
        for items in self._free.values():
            for buf, _ in items:
                self._drop(buf)
        self._free = {}

    def close(self) -> None:
        """release(), and buffers still in use are dropped when they come back."""
        self.release()
        self._closed = True


def _host_like(buf: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """View the uint8 buffer as `tensor` (same strides when its layout is dense, else contiguous)."""
    flat = buf.view(tensor.dtype)
    if tensor.is_contiguous():
        return flat.view(tensor.shape)
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
    if span == tensor.numel() and all(st >= 0 for st in tensor.stride()):
        return flat.as_strided(tensor.shape, tensor.stride())
    return flat.view(tensor.shape)


class CheckpointHandle:
    """Returned by `enable_checkpointing`: the memory plan, host memory used, and undo.

    `host_bytes` counts the bytes copied to host in the latest forward pass; `pinned` says whether they
    are page-locked (CUDA only); `host_pool_bytes` is what the reusable host buffers hold.
    """

    def __init__(self, model, layers, offload, keep_on_gpu, min_offload_bytes, checkpoint_kwargs):
        self.model = model
        self.layers = list(layers)
        self.offload = offload
        self.keep_on_gpu = keep_on_gpu
        self.recompute_layers = len(self.layers)
        self.cache_attention_layers = 0
        self.min_offload_bytes = min_offload_bytes
        self.checkpoint_kwargs = checkpoint_kwargs
        self.host_bytes = 0
        self.pinned = False
        self.prefetched_copies = 0  # layers whose offloaded tensors came back ahead of need (latest pass)
        self.waited_copies = 0  # layers whose recompute had to wait for the copy (the first in backward)
        self._pool = _HostPool()
        self._last_saved = None  # weakref: holding the record would hold every layer's host copy
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._restore: list[tuple[nn.Module, dict]] = []
        self._hooks: list = []

    @property
    def host_pool_bytes(self) -> int:
        return self._pool.bytes

    # ---- checkpoint function installed on each layer ----

    def _checkpoint_layer(self, index: int, function: Callable, *args):
        last = self._last_saved() if self._last_saved is not None else None
        if last is None or index <= last.index:
            # A new forward pass: earlier records belong to a graph backward already consumed
            # (or will consume separately), so start a fresh chain and a fresh byte count.
            last = None
            self.host_bytes = 0
            self.prefetched_copies = self.waited_copies = 0
            self._pool.new_pass()
        keep = not self.offload or index >= self.recompute_layers - self.keep_on_gpu
        cache = index >= self.recompute_layers - self.cache_attention_layers
        saved = _LayerSaved(index, keep, last, cache)
        self._last_saved = weakref.ref(saved)
        # Host buffers of a record whose backward never runs (graph dropped) go back to the pool.
        weakref.finalize(saved, self._pool.give, saved.buffers)

        def run(*inner):
            # The checkpoint calls this twice: forward, then recompute during backward.
            saved.calls += 1
            outer = getattr(_ACTIVE, "layer", None)
            _ACTIVE.layer = (self, saved)
            try:
                return function(*inner)
            finally:
                _ACTIVE.layer = outer

        if not self.offload:
            return checkpoint(run, *args, **self.checkpoint_kwargs)
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, saved), self._unpack):
            return checkpoint(run, *args, **self.checkpoint_kwargs)

    # ---- saved-tensor hooks ----

    def _pack(self, saved: _LayerSaved, tensor: torch.Tensor):
        """Forward: keep a layer input (or a kept attention output) in host memory; the device tensor is
        then free to go once the layer's graph no longer needs it. Keeps kept-layer, parameter and small
        tensors on their device as they are."""
        nbytes = tensor.numel() * tensor.element_size()
        # Empty tensors: torch's checkpoint (2.11) saves a 0-element CPU dummy next to the inputs.
        if saved.keep or nbytes == 0 or isinstance(tensor, nn.Parameter) or nbytes < self.min_offload_bytes:
            return saved, None, tensor
        on_cuda = tensor.is_cuda
        buf, pinned = self._pool.take(nbytes, pin=on_cuda)
        saved.buffers.append((buf, pinned))
        host = _host_like(buf, tensor)
        if on_cuda:
            side = self._side_stream(tensor.device)
            # The copy must see the finished tensor: wait for everything queued so far.
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)
            self.pinned = self.pinned or pinned
        else:
            host.copy_(tensor)
        saved.host.append(host)
        saved.devices.append(tensor.device)
        saved.on_device.append(None)
        self.host_bytes += nbytes
        return saved, len(saved.host) - 1, None

    def _unpack(self, packed):
        """Backward: hand the recompute its input back on the device. Unless the layer signals a later
        moment (`_attention_block_backward_done`), start bringing the previous layer's tensors back now,
        under this layer's recompute and backward."""
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
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).wait_event(saved.h2d_event)
        # Drop our reference: the recompute owns the tensor now and frees it after use.
        saved.on_device[slot] = None
        return tensor

    def _prefetch(self, saved: "_LayerSaved | None") -> None:
        if saved is not None and saved.host and not saved.prefetched:
            self.prefetched_copies += 1
            self._copy_to_device(saved)

    def _copy_to_device(self, saved: _LayerSaved) -> None:
        """Queue host -> device copies of all of `saved`'s offloaded tensors, then give their host buffers
        back to the pool. A second backward through the same graph (retain_graph=True) is refused."""
        if saved.prefetched and not saved.host:
            raise RuntimeError(
                "offloaded activations were already brought back for one backward; a second backward through "
                "the same graph (retain_graph=True) is not supported with offload=True."
            )
        on_device = []
        for host, device in zip(saved.host, saved.devices):
            if device.type != "cuda":
                # CPU: a copy, so nothing of the graph aliases a pool buffer once it is reused.
                on_device.append(host.clone())
                continue
            compute = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            # Allocated on the compute stream, which is where it is used and freed; the side
            # stream waits so it does not write into memory the compute stream still uses.
            dst = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            side.wait_stream(compute)
            # The device -> host copy was queued earlier on this same stream, so it is done first.
            with torch.cuda.stream(side):
                dst.copy_(host, non_blocking=True)
                saved.h2d_event = torch.cuda.Event()
                saved.h2d_event.record(side)
            on_device.append(dst)
        saved.on_device = on_device
        saved.prefetched = True
        # The host copies are done with: their buffers go back to the pool now, not when the record dies
        # with its graph (a training loop holds the last loss, and with it the graph, into the next
        # forward, which would then find no free buffer and pin a second set). The next copy into a buffer
        # queues behind this one on the same side stream.
        saved.host = []
        self._pool.give(saved.buffers)

    def _side_stream(self, device: torch.device):
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]

    # ---- called by the attention function (attention.py) inside a checkpointed layer ----

    def _stash(self, saved: _LayerSaved, tensor: torch.Tensor):
        """Keep a tensor of the forward for the recompute (host memory when the layer is offloaded);
        returns (slot, tensor) for `_unstash`. Not the record itself: the record holds what this returns,
        and a reference cycle would keep it (and its host buffers) alive past its graph."""
        if not self.offload:
            return None, tensor
        return self._pack(saved, tensor)[1:]

    def _unstash(self, saved: _LayerSaved, stashed) -> torch.Tensor:
        return self._fetch((saved, *stashed))

    def _attention_input(self, module, args, kwargs):
        """Forward pre-hook on each layer's attention block: hook its input (the normed hidden states), whose
        gradient exists once the block's whole backward (attention, q/k/v norms and RoPE, the projections)
        is done. Registered on the forward's tensors: non-reentrant checkpoint runs the backward of the
        forward's graph, with saved tensors from the recompute; the recompute's own graph never runs
        backward."""
        active = active_checkpointed_layer()
        if active is None or active[0] is not self or not torch.is_grad_enabled():
            return None
        saved = active[1]
        x = kwargs.get("hidden_states", args[0] if args else None)
        if saved.calls == 1 and isinstance(x, torch.Tensor) and x.requires_grad:
            saved.signals_prefetch = True
            x.register_hook(functools.partial(self._attention_block_backward_done, saved))
        return None

    def _attention_block_backward_done(self, saved: _LayerSaved, grad):
        """Bring the previous layer's tensors back now. A layer's backward peaks in its attention block
        (the attention backward with its fp32 accumulator, then the q/k norm and RoPE backward in fp32);
        what is left (the input norm's backward) is small, so the prefetched copy adds nothing to the peak.
        The copy then overlaps little compute: ~2 bytes x hidden per token at ~25 GB/s, against a layer
        recompute of ~0.2 s at 64k tokens and far more beyond (attention is quadratic, the copy linear)."""
        self._prefetch(saved.prev)
        saved.prev = None  # the chain is not needed past this point; let finished records go
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
        }

    def configure(
        self, recompute_layers: int | None = None, keep_on_gpu: int | None = None,
        cache_attention_layers: int | None = None,
    ) -> None:
        """Change the memory plan between steps (e.g. once the optimizer state is allocated).

        recompute_layers: the first this-many layers are checkpointed; the later ones keep all their
            activations and skip the recompute (faster, needed first in backward, so they free first).
        keep_on_gpu: of the checkpointed layers, the last this-many keep their input on the device.
        cache_attention_layers: of the checkpointed layers, the last this-many keep their attention output
            (and its softmax statistics) from the forward, so their recompute skips the attention kernel,
            most of a layer's forward at long context. The output goes where the layer's input goes (host
            memory when offloaded). Needs ulysses_lc's attention (UlyssesAttention, on at any sp_size in
            SequenceParallelCausalLM) and the cuDNN or FLASH SDPA backend (the CPU kernel on CPU);
            elsewhere those layers recompute attention as usual.
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
        self.host_bytes = 0  # counts the next forward pass, under the new plan
        self._pool.release()  # free buffers sized for the old plan; those in use come back for reuse
        for index, layer in enumerate(self.layers):
            layer.gradient_checkpointing = index < recompute

    def release_host_memory(self) -> None:
        """Give the reusable host buffers back to the system (they are made again at the next step)."""
        self._pool.release()

    def undo(self) -> None:
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
    cache_attention_layers: int = 0,
) -> CheckpointHandle:
    """Turn on non-reentrant activation checkpointing for every decoder layer, optionally offloaded.

    offload: keep each layer's checkpointed input in host memory between forward and backward.
    keep_on_gpu: the last this-many checkpointed layers (needed first in backward) are not offloaded.
    recompute_layers: checkpoint only the first this-many layers (default all); see CheckpointHandle.configure.
    cache_attention_layers: the last this-many checkpointed layers keep their attention output, so their
        recompute skips the attention kernel; see CheckpointHandle.configure.
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
        handle.configure(recompute_layers, keep_on_gpu, cache_attention_layers)
    except ValueError:
        handle.undo()
        raise
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(handle._checkpoint_layer, index)
        block = getattr(layer, "self_attn", None)
        if isinstance(block, nn.Module):
            handle._hooks.append(block.register_forward_pre_hook(handle._attention_input, with_kwargs=True))
    return handle


class MemoryPlan(NamedTuple):
    """Arguments for CheckpointHandle.configure."""

    recompute_layers: int
    keep_on_gpu: int
    cache_attention_layers: int


def plan_activation_memory(
    config, seq_local: int, free_bytes: int, headroom: float = 0.8, *, host_free_bytes: float | None = None,
    offload: bool = True, cache_attention: bool = True, sp_size: int = 1, head_groups: int | str = "auto",
) -> MemoryPlan:
    """The fastest plan for a step allowed `free_bytes` more device memory (and `host_free_bytes` of RAM).

    What each choice buys, per layer, at long context where attention is most of the step:
      - keeping its attention output (cache): the recompute skips the attention forward (~0.22 of the
        layer's attention time: a causal forward is 1 of the 4.5 passes fwd + recompute + 2.5x bwd) for
        2q + 4 x heads bytes per token, in host memory when the layer is offloaded;
      - no recompute at all (plain): also skips the rest of the recompute, for all its activations.
    So: every checkpointed layer keeps its attention output when there is room for it (host memory for
    offloaded layers, the last layers first), then as many last layers as fit skip the recompute, then as
    many checkpointed inputs (with their outputs) as fit stay on the device; the rest are offloaded.
    Bytes per local token from the layer shape (h hidden, q = heads x head_dim, kv likewise), bf16:
      plain layer    2 (4h + 3q + 3kv) x 1.25  (inputs of the norms and projections, q/k/v, attention output)
      working set    2 (8h + 6q + 6kv) + (4 + 4 gqa) q / G   (+ the attention backward's own block: an
                     fp32 dq accumulator and, for GQA, dk and dv at all query heads, over G head groups,
                     attention.attention_head_groups at `sp_size`, or `head_groups`); on the Qwen3-0.6B
                     shape at 256k: 57 KB/token by this formula, 45 KB/token measured (BENCHMARKS.md G)
      kept input     2h, and with a kept attention output 2q + 4 x heads more
    plus the chunked loss: its fp32 weight gradient (vocab x h x 4 bytes), the hidden-state gradient it
    computes in forward (2h per token) and ~1 GiB of logits per chunk; and the previous layer's input and
    attention output, prefetched while a layer's backward runs.
    Only `headroom` of the free memory (device and host) is planned for (fragmentation, collectives'
    buffers, the rest of the process). host_free_bytes None: host memory is not the limit.
    """
    cfg = text_config(config)
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    q = heads * head_dim
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    kv = kv_heads * head_dim
    layers = cfg.num_hidden_layers
    from .attention import attention_backward_block_bytes, attention_head_groups  # attention imports us

    heads_local, kv_local = heads // sp_size, max(kv_heads, sp_size) // sp_size
    groups = head_groups if head_groups != "auto" else attention_head_groups(
        seq_local * sp_size, heads_local, kv_local, head_dim)
    block = attention_backward_block_bytes(seq_local * sp_size, heads_local, kv_local, head_dim) / groups
    kept = seq_local * 2 * h
    cached = seq_local * (2 * q + 4 * heads) if cache_attention else 0
    loss = getattr(cfg, "vocab_size", 0) * h * 4 + seq_local * 2 * h + (1 << 30)
    working = seq_local * 2 * (8 * h + 6 * q + 6 * kv) + block + loss + (kept + cached if offload else 0)
    plain = seq_local * 2 * (4 * h + 3 * q + 3 * kv) * 1.25
    avail = free_bytes * headroom - working
    if not offload:
        # Every checkpointed input stays on the device. Attention outputs first (a tenth of a plain
        # layer's bytes for most of its time saved), then plain layers with what is left.
        per_ckpt = kept + cached
        if avail < layers * per_ckpt:
            n_cache = min(layers, int(max(avail - layers * kept, 0) // cached)) if cached else 0
            return MemoryPlan(layers, layers, n_cache)
        n_plain = min(layers, int((avail - layers * per_ckpt) // (plain - per_ckpt)))
        recompute = layers - n_plain
        return MemoryPlan(recompute, recompute, recompute if cached else 0)
    if avail <= 0:
        host = float("inf") if host_free_bytes is None else host_free_bytes * headroom - layers * kept
        n_cache = (layers if host == float("inf") else min(layers, int(max(host, 0) // cached))) if cached else 0
        return MemoryPlan(layers, 0, n_cache)
    n_plain = min(layers, int(avail // plain))
    avail -= n_plain * plain
    recompute = layers - n_plain
    keep = min(recompute, int(avail // (kept + cached)))
    n_cache = keep if cached else 0
    if cached:
        offloaded = recompute - keep
        if host_free_bytes is None:
            n_cache += offloaded
        else:
            # The offloaded inputs go to the host first: they are not optional.
            host = host_free_bytes * headroom - offloaded * kept
            n_cache += min(offloaded, int(max(host, 0) // cached))
    return MemoryPlan(recompute, keep, n_cache)


__all__ = ["CheckpointHandle", "MemoryPlan", "active_checkpointed_layer", "enable_checkpointing", "plan_activation_memory"]
