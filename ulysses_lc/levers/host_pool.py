"""Host memory for offloaded activations: exact-size buffers, page-locked and reused from step to step
(`HostPool`), and the round trip through them on a side stream (`HostRoundTrip`: device -> host as the forward
saves a tensor, host -> device ahead of the backward that needs it). checkpointing.py decides what goes and
when; this module moves the bytes."""

from __future__ import annotations

import weakref

import torch

_PAGE = 4096


def _unregister_all(registered: dict) -> None:
    """Finalizer of a HostPool: unpin what is still registered before the memory can be freed."""
    if registered and torch.cuda.is_available():
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for ptr in list(registered):
            cudart.cudaHostUnregister(ptr)
    registered.clear()


class HostPool:
    """Exact-size host buffers, page-locked with cudaHostRegister, reused from step to step.

    `torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every
    block up to a power of two: a 2.5 GiB layer input (Qwen3-4B shape, 512k tokens) takes 4 GiB of pinned
    memory, and 36 of them do not fit a node's RAM. Here each buffer is a plain host allocation rounded up
    to whole pages and page-aligned (so no two buffers share a page, which registration would refuse),
    registered once and kept for the next step. Making them (allocation, first touch, registration) cost
    0.35-0.68 s per GB on the first step of a plan on an H200 host (BENCHMARKS.md, "DPO beside SFT"); later
    steps pay nothing, so the step-time estimate (sizing.Job.step_seconds, a steady step) leaves it out.
    Without CUDA the buffers are ordinary memory (CPU tests).
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


def host_like(buf: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """View the uint8 buffer as `tensor` (same strides when its layout is dense, else contiguous)."""
    flat = buf.view(tensor.dtype)
    if tensor.is_contiguous():
        return flat.view(tensor.shape)
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
    if span == tensor.numel() and all(st >= 0 for st in tensor.stride()):
        return flat.as_strided(tensor.shape, tensor.stride())
    return flat.view(tensor.shape)


class HostRoundTrip:
    """Copies of saved activations to host memory and back, on one side stream per device.

    to_host: the copy waits for everything queued on the compute stream so far (it must see the finished
    tensor), then runs on the side stream, overlapping the next layers' compute; the device tensor is
    `record_stream`-ed there, so its memory is not reused before the copy is done.
    to_device: the destination is allocated on the compute stream (where it is used and freed); the side stream
    waits for the compute stream (so it does not write into memory still in use there), copies, and records an
    event per tensor that the compute stream waits for before it reads that tensor: a layer's recompute starts once
    its input is back, while its kept attention output (1 GB a layer on the Qwen3-4B shape at 128k, 1.5x the input)
    is still on its way. The device -> host copy was queued earlier on the same side stream, so it is done first.
    Without CUDA both are plain copies (the CPU tests' path).
    """

    def __init__(self):
        self.pool = HostPool()
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(self, tensor: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, tuple[torch.Tensor, bool]]:
        """(host copy of `tensor`, its (pool buffer, pinned) to give back once the copy back is queued)."""
        on_cuda = tensor.is_cuda
        buf, pinned = self.pool.take(nbytes, pin=on_cuda)
        host = host_like(buf, tensor)
        if on_cuda:
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)
        else:
            host.copy_(tensor)
        return host, (buf, pinned)

    def to_device(self, hosts: list[torch.Tensor], devices: list[torch.device]):
        """(device copies of `hosts`, for each the event the compute stream waits for before reading it: None on
        CPU)."""
        on_device, events = [], []
        for host, device in zip(hosts, devices):
            if device.type != "cuda":
                # CPU: a copy, so nothing of the graph aliases a pool buffer once it is reused.
                on_device.append(host.clone())
                events.append(None)
                continue
            compute = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            dst = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                dst.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            on_device.append(dst)
            events.append(event)
        return on_device, events

    def _side_stream(self, device: torch.device):
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]


def wait_unread(on_device: list, events: list) -> None:
    """For device copies brought back by HostRoundTrip.to_device and never read (a recompute that raised): make the
    compute stream wait for each one's copy before it frees them (a reader waits for its own copy only). Clears
    `on_device`; checkpointing.py calls it when a layer's record dies."""
    for tensor, event in zip(on_device, events):
        if tensor is not None and event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(event)
    on_device.clear()


__all__ = ["HostPool", "HostRoundTrip", "host_like", "wait_unread"]
