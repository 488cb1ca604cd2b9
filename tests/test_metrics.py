"""FLOPs formulas against hand computation and the published shapes; the step logger's outputs."""

import io
import json

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from ulysses_lc.plan.metrics import (
    StepLogger,
    matmul_params,
    measure_peak_bf16_tflops,
    mfu,
    model_flops_per_step,
)


def qwen3_0_6b():
    return Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    )


def test_flops_by_hand_for_a_tiny_dense_config():
    cfg = Qwen3Config(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=10,
    )
    # per layer: q,o 2*8*2*4 = 128; k,v 2*8*1*4 = 64; MLP 3*8*16 = 384 -> 576; x2 layers = 1152; head 8*10 = 80
    assert matmul_params(cfg) == (1152, 80)
    f = model_flops_per_step(cfg, 6)
    attn_fwd = 2 * 6 * 6 * 2 * 4 * 2  # 2 matmuls * 2 FLOPs/MAC * T^2/2 * heads * head_dim * layers = 1152
    assert f.dense == 6 * 1232 * 6
    assert f.attention == 3 * attn_fwd
    assert f.model == 6 * 1232 * 6 + 3 * attn_fwd
    assert f.hardware == f.model + 2 * 1152 * 6 + attn_fwd  # recompute: layers' forward, not the LM head
    assert f.effective == 4.5 * attn_fwd + 8 * 1232 * 6
    assert model_flops_per_step(cfg, 6, recompute=False).hardware == f.model


def test_qwen3_0_6b_shape_against_the_reference():
    cfg = qwen3_0_6b()
    layers, head = matmul_params(cfg)
    assert layers == 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072) == 440_401_920
    assert head == 1024 * 151936
    f = model_flops_per_step(cfg, 262_144)
    assert f.attention_share > 0.9  # attention dominates at long context
    # DeepSpeed's ALST pieces on the Qwen3-0.6B shape, one H200, 2026-11-29 (the reference measurement quoted in
    # benchmarks/reports/2026-11-29_speed.md): 256k tokens in 84.3 s, 128k in 20.96 s, 384-453 effective TFLOPS.
    assert f.effective / 84.3 / 1e12 == pytest.approx(435.5, abs=0.5)
    assert model_flops_per_step(cfg, 131_072).effective / 20.96 / 1e12 == pytest.approx(452.8, abs=0.5)


def test_moe_counts_only_active_experts_and_router():
    cfg = Qwen3MoeConfig(
        hidden_size=8, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=10, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=12, decoder_sparse_step=2, mlp_only_layers=[3],
    )
    attn = 2 * 8 * 2 * 4 + 2 * 8 * 1 * 4
    dense_mlp = 3 * 8 * 40
    moe_mlp = 8 * 6 + 2 * 3 * 8 * 12  # router + 2 active experts
    # decoder_sparse_step=2: layers 1 and 3 are sparse, but 3 is listed in mlp_only_layers.
    assert matmul_params(cfg) == (4 * attn + 3 * dense_mlp + moe_mlp, 80)


def test_mfu_and_peak():
    assert mfu(512.3, 778.0) == pytest.approx(0.6585, abs=1e-4)
    assert mfu(512.3, None) is None
    assert measure_peak_bf16_tflops("cpu") is None


EXPECTED_KEYS = {
    "step", "total_steps", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
    "tflops_per_gpu", "hardware_tflops_per_gpu", "effective_tflops_per_gpu", "mfu", "gpu_mem_gb",
    "host_rss_gb", "host_used_gb", "time", "kernel_fallbacks",
}


def test_logger_writes_one_json_line_per_step(tmp_path):
    flops = model_flops_per_step(qwen3_0_6b(), 131_072)
    out = io.StringIO()
    with StepLogger(tmp_path, 3, tokens_per_step=131_072, world_size=8, flops=flops, peak_tflops=778.0, stream=out) as log:
        for step in range(1, 4):
            log.log(step, loss=4.0 - step / 10, grad_norm=1.5, lr=1e-5, step_time_s=2.0, gpu_mem_gb=20.3)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(set(r) == EXPECTED_KEYS for r in records)
    r = records[0]
    assert r["tokens_per_s"] == 65_536
    assert r["tflops_per_gpu"] == pytest.approx(flops.model / 2.0 / 8 / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 778.0)
    assert r["host_rss_gb"] > 0
    text = out.getvalue()
    assert "step 1/3 | loss 3.9000 | grad_norm 1.50 | lr 1.0e-05 | tokens 131,072 | 2.0 s | 65,536 tok/s" in text
    assert "MFU " in text and "gpu 20.3 GB" in text and "host " in text


def test_logger_is_silent_off_rank_0(tmp_path):
    out = io.StringIO()
    log = StepLogger(tmp_path / "run", 2, tokens_per_step=10, rank=1, stream=out)
    assert log.log(1, loss=1.0, step_time_s=1.0) is None
    log.close()
    assert out.getvalue() == "" and not (tmp_path / "run").exists()


def test_tensorboard_flag_without_tensorboard_says_how_to_fix(tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tensorboard"):
            StepLogger(tmp_path, 1, tokens_per_step=1, tensorboard=True, progress=False)
    else:
        log = StepLogger(tmp_path, 1, tokens_per_step=1, tensorboard=True, progress=False, stream=io.StringIO())
        log.log(1, loss=1.0, step_time_s=1.0)
        log.close()
        assert any((tmp_path / "tensorboard").iterdir())
