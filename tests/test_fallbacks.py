"""Kernel fallbacks are narrow and visible (issue 28, item 3): only a kernel's "no kernel for these inputs" error
leads to the next kernel, keyed on the whole call; every fallback is in the step record and the start-up block; the
plan is made for the kernel actually used; any other error propagates."""

import pytest
import torch

from tests.models import build
from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, fallbacks
from ulysses_lc import explicit_attention as explicit_mod
from ulysses_lc.mixers.explicit_attention import explicit_attention
from ulysses_lc.plan.metrics import StepLogger
from ulysses_lc.mixers.window_attention import window_attention

CPU_FORWARD, CPU_BACKWARD = explicit_mod._EXPLICIT["cpu"]


@pytest.fixture(autouse=True)
def _clean():
    fallbacks.reset()
    yield
    fallbacks.reset()


def _qkv(s=16, h=4, h_kv=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, s, d, generator=g, requires_grad=True) for n in (h, h_kv, h_kv)]


def _raising(error):
    def forward(q, k, v, scale):
        raise error
    return forward


def test_a_non_kernel_error_propagates_and_is_not_remembered(monkeypatch):
    """A shape bug of ours (or any error that is no refusal) used to be swallowed as the backend's "refusal" and
    remembered for the process: now it propagates, from the full-attention and the window path alike."""
    bug = RuntimeError("The size of tensor a (16) must match the size of tensor b (15) at non-singleton dimension 2")
    monkeypatch.setitem(explicit_mod._EXPLICIT, "cpu", (_raising(bug), CPU_BACKWARD))
    with pytest.raises(RuntimeError, match="must match the size"):
        explicit_attention(*_qkv(), None, "auto")
    with pytest.raises(RuntimeError, match="must match the size"):
        window_attention(*_qkv(), None, 4, None, "auto")
    assert fallbacks.taken() == ()


def test_a_refusal_falls_back_keyed_on_the_whole_call_and_is_reported(monkeypatch, tmp_path):
    calls = []

    def forward(q, k, v, scale):  # refuses 16 tokens only, as a kernel with a length limit would
        calls.append(q.shape[2])
        if q.shape[2] == 16:
            raise RuntimeError("No available kernel. Aborting execution.")
        return CPU_FORWARD(q, k, v, scale)

    monkeypatch.setitem(explicit_mod._EXPLICIT, "cpu", (forward, CPU_BACKWARD))
    assert explicit_attention(*_qkv(16), None, "auto") is None  # no explicit kernel left: the caller runs SDPA
    assert explicit_attention(*_qkv(16), None, "auto") is None
    assert calls == [16]  # that call's refusal is remembered ...
    assert explicit_attention(*_qkv(32), None, "auto") is not None  # ... but not for another length
    [taken] = fallbacks.taken()
    assert taken.q_shape == (1, 4, 16, 8) and "No available kernel" in taken.reason
    with StepLogger(tmp_path, 2, tokens_per_step=16, progress=False) as log:
        first, second = log.log(1, loss=1.0, step_time_s=1.0), log.log(2, loss=1.0, step_time_s=1.0)
    assert first["kernel_fallbacks"] == [taken.line()] and second["kernel_fallbacks"] == []
    assert "cpu refused q [1, 4, 16, 8]" in fallbacks.summary()


def test_the_plan_is_made_for_the_kernel_the_probe_found(monkeypatch):
    """Where no explicit kernel takes the model's call, checkpointed layers cannot keep their attention output:
    the plan no longer counts on it (it used to plan for the refused kernel)."""
    layout = ParallelLayout(world_size=1, sp_size=1)
    model = SequenceParallelCausalLM(build("qwen3"), layout)
    assert model.probe_attention(torch.device("cpu"), torch.float32) == ()
    assert model.plan_step(256, torch.device("cpu")).cache_attention_layers == 2
    monkeypatch.setitem(explicit_mod._EXPLICIT, "cpu", (_raising(RuntimeError("cpu flash: not implemented for "
                                                                                "'Float8'")), CPU_BACKWARD))
    [refusal] = model.probe_attention(torch.device("cpu"), torch.float32)
    assert not model.attention.explicit_ok and refusal.kernel == "cpu"
    assert model.plan_step(256, torch.device("cpu")).cache_attention_layers == 0


def test_no_kernel_errors_are_told_apart():
    for message in ("No available kernel. Aborting execution.", "cuDNN Frontend error: No valid execution plans built.",
                    "FlashAttention only supports Ampere GPUs or newer.", "\"flash_fwd\" not implemented for 'Half'",
                    "FlashAttention only support fp16 and bf16 data type"):  # torch's FLASH kernel on fp32
        assert fallbacks.is_no_kernel_error(RuntimeError(message)), message
    assert fallbacks.is_no_kernel_error(NotImplementedError("Could not run 'aten::_flash' with arguments from 'CPU'"))
    for error in (RuntimeError("shape '[1, 4, 16, 8]' is invalid for input of size 100"), ValueError("not supported"),
                  RuntimeError("CUDA error: an illegal memory access was encountered"),
                  torch.OutOfMemoryError("CUDA out of memory; expandable segments not supported on this device")):
        assert not fallbacks.is_no_kernel_error(error), error


def test_fp32_on_cuda_asks_no_explicit_kernel():
    """cuDNN's and FLASH's ops take fp16 and bf16 only (torch's cuDNN op would read fp32 as fp16 rather than refuse):
    an fp32 call on CUDA (tests/test_nccl_sp.py's fp32 cases, with kept outputs) goes to SDPA's own fp32 kernels."""
    from types import SimpleNamespace

    from ulysses_lc.mixers.explicit_attention import explicit_backends

    def on_cuda(dtype):
        return SimpleNamespace(device=torch.device("cuda"), dtype=dtype)  # only device and dtype are read

    assert explicit_backends(on_cuda(torch.bfloat16), "auto") == ("cudnn", "flash")
    assert explicit_backends(on_cuda(torch.float16), "sdpa") == ("flash",)
    assert explicit_backends(on_cuda(torch.float32), "auto") == explicit_backends(on_cuda(torch.float32), "sdpa") == ()
    assert explicit_backends(torch.zeros(1, dtype=torch.float32), "auto") == ("cpu",)
