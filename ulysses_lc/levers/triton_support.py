"""Where the levers' Triton kernels run (rope.py, swiglu.py, ce_rows.py): CUDA with Triton importable, or the CPU in
Triton's interpreter where the lever's own INTERPRET_ON_CPU switch (the tests') is on; and the default of their
settings, on where CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_runs_on(device: torch.device, interpret_on_cpu: bool) -> bool:
    """Whether a lever's Triton kernel runs on `device`: CUDA with Triton, or the CPU in Triton's interpreter where
    `interpret_on_cpu` (the lever's INTERPRET_ON_CPU) is on."""
    if not triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpret_on_cpu)


def wanted_where_cuda(setting: bool | None) -> bool:
    """A kernel lever's setting: True / False as given; None (the default) where CUDA is available, the only device
    the kernels run on outside the tests."""
    return bool(setting) if setting is not None else torch.cuda.is_available()


def launch_device(device: torch.device):
    """The context a kernel launch on `device` runs in: Triton launches on the current CUDA device, so that device's
    for a CUDA tensor, nothing for the interpreter's CPU tensors."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
