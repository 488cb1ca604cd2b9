"""kernel='fa4' (FlashAttention-4, mixers/fa4.py): the choice, its refusals and flags on CPU; on a Hopper GPU with
flash-attn-4 installed, every layer type it runs against an fp32 dense reference (full causal with GQA at head dims
64, 128 and 256, head groups, sliding windows, sinks, packed documents). `python -m pytest tests/test_fa4.py -q` on an H200
with the README's wheel set runs them all.

Tolerance as tests/test_window_cuda.py: bf16 inputs, the reference in fp32 on the same rounded inputs; relative
Frobenius error at most 2e-2 for the output and 4e-2 for each gradient.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests._attention_ref import check_against_dense, cuda_inputs
from ulysses_lc.mixers import fa4
from ulysses_lc.mixers.attention import UlyssesAttention
from ulysses_lc.mixers.explicit_attention import (attention_backward_block_bytes, explicit_attention,
                                                  explicit_backends, keeps_attention_outputs)
from ulysses_lc.mixers.kernels import KERNELS, causal_attention, document_attention
from ulysses_lc.mixers.window_attention import resolve_how, window_attention
from ulysses_lc.shape import ModelShape
from ulysses_lc.train.config import parse_args
from ulysses_lc.train.loading import SHIPPED_CONFIGS, load_model_config

_SP1 = SimpleNamespace(sp_size=1)


def test_fa4_is_a_kernel_choice_with_kept_outputs_and_head_groups():
    assert "fa4" in KERNELS
    assert parse_args(["--model", "x", "--kernel", "fa4"]).kernel == "fa4"
    assert keeps_attention_outputs("fa4")
    on_cuda = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert explicit_backends(on_cuda, "fa4") == ("fa4",)
    assert explicit_backends(SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32), "fa4") == ()


def test_fa4_refuses_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU; use kernel='auto'"):
        UlyssesAttention(_SP1, kernel="fa4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"Hopper or newer GPU \(compute capability 9.0\+\); this one is 8.0"):
        UlyssesAttention(_SP1, kernel="fa4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def missing():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(fa4, "_interface", missing)
    with pytest.raises(ValueError, match=r"needs flash-attn-4.*pip install 'ulysses_lc\[fa4\]'"):
        UlyssesAttention(_SP1, kernel="fa4")
    with pytest.raises(ValueError, match="how='fa4' runs FlashAttention-4's CUDA kernels; use how='band' on CPU"):
        resolve_how("fa4", torch.device("cpu"))


def test_fa4_refuses_dropout_and_fp32_before_calling_the_kernel():
    q = torch.randn(1, 4, 16, 8)
    with pytest.raises(ValueError, match="FlashAttention-4 has no dropout; set config.attention_dropout=0"):
        causal_attention(q, q, q, None, "fa4", dropout=0.1)
    with pytest.raises(ValueError, match="FlashAttention-4 has no dropout"):
        document_attention(q, q, q, (0, 8, 16), None, "fa4", dropout=0.1)
    with pytest.raises(ValueError, match="takes bf16 or fp16 CUDA tensors, got torch.float32 on cpu"):
        causal_attention(q, q, q, None, "fa4")


def test_auto_takes_fa4_on_hopper_where_installed_for_measured_head_dims(monkeypatch):
    """bench_fa4.py (2026-12-04, one H200): FA4 1.19x cuDNN at head dim 128, 1.26x at 64, 1.08x at 256 (Qwen3.5's
    8 / 2 heads; its exactness there, test_fa4_causal_matches_dense_fp32's 256 case, passed on an H100 on 2026-12-05)."""
    from ulysses_lc.mixers.kernels import resolve_kernel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "_interface", lambda: SimpleNamespace())
    assert [resolve_kernel("auto", d) for d in (64, 128, 256, 512, None)] == ["fa4", "fa4", "fa4", "cudnn", "cudnn"]
    assert resolve_kernel("auto", 128, dropout=0.1) == "cudnn"  # FA4 has no dropout
    assert resolve_kernel("sdpa", 128) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # Blackwell: not measured
    assert resolve_kernel("auto", 128) == "cudnn"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def missing():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(fa4, "_interface", missing)
    assert resolve_kernel("auto", 128) == "cudnn"


def test_auto_decides_at_install_from_the_model_and_names_the_kernel(monkeypatch):
    from tests.models import build
    from ulysses_lc.mixers.attention import install_ulysses_attention

    model = build("qwen3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "_interface", lambda: SimpleNamespace())
    handle = install_ulysses_attention(model, _SP1)
    try:
        assert handle.attention.kernel == "fa4" and "fa4" in model.config._attn_implementation
    finally:
        handle.undo()
    model.config.attention_dropout = 0.1  # FA4 has none: cuDNN-first SDPA
    handle = install_ulysses_attention(model, _SP1)
    assert handle.attention.kernel == "cudnn"
    handle.undo()


def test_step_time_prices_fa4_at_its_measured_rate():
    """The step estimate's attention at FA4's rate (626 against cuDNN's 524 TF/s in one call; 439 against 408 at head dim
    256) for kernel 'fa4', and its window layers at FA4's measured share, against kernel 'cudnn' (flex for the
    windows). 'auto' prices what it resolves to on the machine that asks (resolve_kernel: on a GPU with flash-attn-4,
    FA4)."""
    from transformers import AutoConfig

    from ulysses_lc.plan import sizing
    from ulysses_lc.plan.memory import MemoryPlan

    assert sizing.attention_flops_per_s(128, "fa4") / sizing.attention_flops_per_s(128) == pytest.approx(1.194, 1e-3)
    # head dim 256: cuDNN's fitted rate there, times FA4's 439.4 / 407.8 TF/s of the same call
    assert sizing.attention_flops_per_s(256, "fa4") / sizing.attention_flops_per_s(256) == pytest.approx(1.0775, 1e-3)
    for folder in ("Qwen__Qwen3-8B", "openai__gpt-oss-20b"):
        shape = ModelShape.from_config(AutoConfig.from_pretrained(SHIPPED_CONFIGS / folder))
        jobs = [sizing.Job(shape, 10 ** 9, 1, 1, kernel=k) for k in ("cudnn", "fa4")]
        cudnn, fast = (job.step_seconds(262144, MemoryPlan(shape.layers, 0, 0)) for job in jobs)
        assert fast < cudnn, folder


def test_the_plan_prices_fa4_backward_at_cudnn_block_or_more():
    """The memory plan reserves cuDNN's backward block (explicit_attention.attention_backward_block_bytes) for every
    kernel; FA4's (fa4.backward_block_bytes: fp32 dq accumulator, two fp32 rows per query head, fp32 dk, dv per kv head
    under GQA) is at most that where a kv head serves 2+ query heads, and 8 bytes a query head and token more without
    GQA: within 2 / head_dim of it on every shipped config, at 256k on the rank's heads of sp 1 and 8."""
    for folder in sorted(SHIPPED_CONFIGS.glob("*/")):
        shape = ModelShape.from_config(load_model_config(str(folder)))
        for sp in (1, 8):
            if shape.heads % sp or max(shape.kv_heads, sp) % min(shape.kv_heads, sp):
                continue
            h, kv, d, s = shape.local_heads(sp), shape.local_kv_heads(sp), shape.head_dim, 262144
            assert fa4.backward_block_bytes(s, h, kv, d) <= attention_backward_block_bytes(s, h, kv, d) * (1 + 2 / d)


# ---- on a GPU: against an fp32 dense reference ----

def _fa4_runs():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("cutlass") is not None


cuda = pytest.mark.skipif(not _fa4_runs(), reason="FlashAttention-4: needs a Hopper GPU and flash-attn-4")


@cuda
@pytest.mark.parametrize("h,h_kv,d", [(16, 8, 128), (16, 2, 64), (8, 2, 256)])  # 256: Qwen3.5's full layers
def test_fa4_causal_matches_dense_fp32(h, h_kv, d):
    check_against_dense(lambda q, k, v, scale: causal_attention(q, k, v, scale, "fa4"),
                        cuda_inputs(h, h_kv, 3000, d, False))


@cuda
def test_fa4_head_groups_and_kept_output_match_dense_fp32():
    """Two groups of kv heads through ExplicitAttention, and the recompute's replay of a kept output."""
    from ulysses_lc.mixers.explicit_attention import ExplicitAttention

    inputs = cuda_inputs(16, 8, 2048, 128, False, seed=3)
    check_against_dense(lambda q, k, v, scale: explicit_attention(q, k, v, scale, "fa4", groups=2), inputs)

    def replay(q, k, v, scale):
        sink = []
        explicit_attention(q.detach(), k.detach(), v.detach(), scale, "fa4", 1, sink)
        return ExplicitAttention.apply(q, k, v, scale, "fa4", 1, sink[0][1:], None)

    check_against_dense(replay, inputs)


@cuda
@pytest.mark.parametrize("d,window,sinks", [(64, 128, True), (128, 1000, False)])
def test_fa4_window_and_sinks_match_dense_fp32(d, window, sinks):
    inputs = cuda_inputs(8, 2, 4096, d, sinks)
    check_against_dense(lambda q, k, v, scale: window_attention(q, k, v, scale, window, inputs[3], "fa4"),
                        inputs, window)


@cuda
@pytest.mark.parametrize("window,sinks", [(None, False), (64, True)])
def test_fa4_packed_documents_match_dense_fp32(window, sinks):
    bounds = (0, 900, 1300, 1301, 2500, 3072)
    inputs = cuda_inputs(8, 4, 3072, 128 if window is None else 64, sinks, seed=2)
    check_against_dense(lambda q, k, v, scale: document_attention(q, k, v, bounds, scale, "fa4", window=window,
                                                                  sinks_h=inputs[3]),
                        inputs, window, bounds)
