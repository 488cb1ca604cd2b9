"""The dry run's memory prediction (memory.plan_bytes + the ZeRO-3 state) against peaks measured on an H200.

Measured (BENCHMARKS.md I, 2026-11-30), Qwen3-0.6B shape, one GPU, torch.cuda.max_memory_allocated over a step:
  the main job at 131,072 tokens, plan 6 checkpointed / 4 on the GPU / 6 keeping outputs: 95.2 GB
  (ZeRO-3 state 18 bytes per parameter, as the dry run counts it);
  bench_step at 131,072 tokens, plan 4 / 1 / 4: 92.9 GB; at 262,144 tokens, plan 17 / 0 / 17: 85.9 GB
  (its static memory measured: 3.6 GB, a plain torch AdamW).
The prediction is the planner's own terms without its margins: it must never fall below the measured peak
(a user sizes GPUs with it) and is measured here at +7% / +7% / +16% (issue 14 asks for 10%: not met at 256k,
where the working-set formula is 57 KB/token against 45 measured, BENCHMARKS.md G).
"""

import pytest
from transformers import Qwen3Config

from ulysses_lc import MemoryPlan, ModelShape
from ulysses_lc.memory import plan_bytes
from ulysses_lc.memory import zero3_state_bytes

SHAPE = ModelShape.from_config(Qwen3Config(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True))
PARAMS = 596_049_920


@pytest.mark.parametrize("seq, plan, static, measured, within", [
    (131072, MemoryPlan(6, 4, 6), None, 95.2e9, 0.10),
    (131072, MemoryPlan(4, 1, 4), 3.6e9, 92.9e9, 0.10),
    (262144, MemoryPlan(17, 0, 17), 3.6e9, 85.9e9, 0.20),
])
def test_prediction_bounds_the_measured_peak(seq, plan, static, measured, within):
    device, _ = plan_bytes(SHAPE, seq, plan)
    if static is None:
        static = zero3_state_bytes(PARAMS, 1, {"zero_optimization": {"stage": 3}})[0]
    predicted = device + static
    assert measured <= predicted <= measured * (1 + within), predicted / measured
