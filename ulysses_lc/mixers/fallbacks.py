"""Kernel fallbacks: which errors of a kernel mean "no kernel for these inputs", and the record of each one taken.

An attention path tries its kernels in order (explicit_attention.py: cuDNN, FLASH, CPU flash; window_attention.py:
the band or flash's window). A kernel may *refuse* an input: an unsupported head dim, dtype or GPU, or no cuDNN
execution plan for the graph. Only those errors (`is_no_kernel_error`, matched on the messages torch, cuDNN and
flash give for them) lead to the next kernel; every other error, a shape bug of ours included, propagates.

A refusal is keyed on the full call (path, kernel, dtype, q's and k's shapes, window), so a length one kernel
refuses does not keep it from the lengths it takes. Each fallback is logged when it happens and kept here:
`unreported()` hands the new ones to the step record (train/loop.py, hf_trainer.py) and `taken()` lists them all,
for the start-up block after the start-up probe (`SequenceParallelCausalLM.probe_attention`) and for the plan,
which is made for the kernel actually used.
"""

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Lower-case fragments of the errors a kernel raises for inputs it has no kernel for (torch's SDPA dispatch, its
# cuDNN frontend, FlashAttention's checks, aten ops without a dtype's kernel).
NO_KERNEL_MESSAGES = (
    "no available kernel",
    "no valid execution plans",
    "no execution plans support",
    "cudnn_status_not_supported",
    "only support",  # also "FlashAttention only support fp16 and bf16 data type" (torch's FLASH kernel on fp32)
    "is not supported",
    "not supported on",
    "not implemented for",
    "unsupported head",
    "unsupported dtype",
    "unsupported gpu",
)


def is_no_kernel_error(error: BaseException) -> bool:
    """Whether `error` says the kernel has no implementation for these inputs (then the next kernel is tried); never
    for running out of memory (torch.OutOfMemoryError, a RuntimeError), which is no refusal of the inputs."""
    if type(error).__name__ == "OutOfMemoryError":
        return False
    if isinstance(error, NotImplementedError):  # aten: no kernel of this op for the dtype or device
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(fragment in message for fragment in NO_KERNEL_MESSAGES)


@dataclass(frozen=True)
class Fallback:
    """One kernel that refused one call: `path` (explicit attention, window attention), the kernel, the call."""

    path: str
    kernel: str
    q_shape: tuple
    k_shape: tuple
    dtype: str
    window: int | None
    reason: str

    def line(self) -> str:
        window = f", window {self.window}" if self.window is not None else ""
        return (f"{self.path}: {self.kernel} refused q {list(self.q_shape)} k {list(self.k_shape)} {self.dtype}{window} "
                f"({self.reason}); the next kernel ran")


_REFUSED: set[tuple] = set()
_TAKEN: list[Fallback] = []
_REPORTED = [0]


def call_key(path: str, kernel: str, q, k, window: int | None = None) -> tuple:
    """The key a refusal is remembered under: the whole call, not only its dtype and head dim."""
    return path, kernel, q.dtype, tuple(q.shape), tuple(k.shape), window


def refused(key: tuple) -> bool:
    """Whether this call's kernel refused before (it is then not tried again in this process)."""
    return key in _REFUSED


def record(key: tuple, error: BaseException) -> Fallback:
    """Remember that the kernel of `key` refused (`error` passed `is_no_kernel_error`), log it once, return it."""
    path, kernel, dtype, q_shape, k_shape, window = key
    message = str(error).strip()
    fallback = Fallback(path, kernel, q_shape, k_shape, str(dtype).removeprefix("torch."), window,
                        message.splitlines()[0][:200] if message else type(error).__name__)
    _REFUSED.add(key)
    _TAKEN.append(fallback)
    logger.warning("kernel fallback: %s", fallback.line())
    return fallback


def taken() -> tuple[Fallback, ...]:
    """Every fallback taken in this process, oldest first."""
    return tuple(_TAKEN)


def unreported() -> list[Fallback]:
    """The fallbacks taken since the last call (for the step record)."""
    new = _TAKEN[_REPORTED[0]:]
    _REPORTED[0] = len(_TAKEN)
    return new


def summary() -> str:
    """One phrase for the start-up block."""
    if not _TAKEN:
        return "none (a kernel that refuses a call later is named in that step's record)"
    return "; ".join(f.line() for f in _TAKEN)


def reset() -> None:
    """Forget every refusal (tests; a process that changes device or dtype)."""
    _REFUSED.clear()
    _TAKEN.clear()
    _REPORTED[0] = 0


__all__ = ["Fallback", "NO_KERNEL_MESSAGES", "call_key", "is_no_kernel_error", "record", "refused", "reset",
           "summary", "taken", "unreported"]
