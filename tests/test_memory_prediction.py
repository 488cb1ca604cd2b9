"""The memory model (what the dry run predicts and the planner chooses with) against the peaks measured on H200s.

The points, each with its date, machine, command and plan, are tests/data/h200_peaks.json: the main job, the
Trainer path's harness and the benchmarks, Qwen3-0.6B and -8B shapes, 128k-2M tokens, sp 1 and 2, one packed run.
Held: every predicted GPU peak (torch.cuda.max_memory_allocated) at or above its measurement and within 10%;
every predicted host RSS at or above its measurement and within 10% or HOST_SPREAD (the host process alone
measured 1.8-2.9 GB across harnesses, which decides the small points). A second test drops each term of the
model in turn and finds a point predicted below its measurement: every term is needed to bound the data.
benchmarks/fit_memory_model.py prints the same table and fits the coefficients.
"""

import json
from pathlib import Path

import pytest
from transformers import Qwen3Config

from ulysses_lc import MemoryPlan, ModelShape, memory, memory_model
from ulysses_lc.sizing import Job

POINTS = json.loads((Path(__file__).parent / "data" / "h200_peaks.json").read_text())["points"]
WITHIN = 0.10
HOST_SPREAD = 1.3e9  # the host process alone: 1.75-2.92 GB measured, so a constant that covers the largest is this far above the smallest
SHAPES = {  # public configs (huggingface.co/Qwen/Qwen3-{0.6B,4B,8B,32B}, config.json), written here: no downloads
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, tie_word_embeddings=False),
}


def qwen3_config(name: str, layers: int | None = None) -> Qwen3Config:
    kwargs = dict(SHAPES[name], head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)
    if layers:
        kwargs["num_hidden_layers"] = layers
    return Qwen3Config(**kwargs)


def predict_point(point: dict) -> tuple[float, float]:
    """(GPU peak, host RSS) bytes the model predicts for a recorded point."""
    shape = ModelShape.from_config(qwen3_config(point["shape"], point["layers"]))
    plan = MemoryPlan(*point["plan"])
    if point["harness"] == "zero3":
        job = Job.from_ds_config(shape, point["params"], point["world"], point["sp"],
                                 {"zero_optimization": {"stage": 3}}, head_groups=point["head_groups"],
                                 packed=point["packed"])
        predicted = job.predict(point["seq"], plan)
        # The measurement is the rank's own RSS: the launcher and what the kernel holds for pinned pages are the node's.
        return predicted.gpu, predicted.host - predicted.node_host_share
    # bench_step: its measured static (bf16 weights, AdamW's bf16 moments) and bf16 gradients; no ZeRO-3.
    act, pinned = memory.plan_bytes(shape, point["seq"], plan, sp_size=point["sp"], head_groups=point["head_groups"],
                                    packed=point["packed"])
    return point["static"] * 1e9 + 2 * point["params"] + act, memory_model.HOST_PROCESS_BYTES + pinned


def _bounds(point, gpu, host) -> tuple[bool, bool]:
    """(never below, within the tolerance), GPU and host together."""
    gpu_meas, host_meas = point["gpu_peak"] * 1e9, point["host_rss"] * 1e9
    above = gpu >= gpu_meas and host >= host_meas
    close = gpu <= gpu_meas * (1 + WITHIN) and host <= max(host_meas * (1 + WITHIN), host_meas + HOST_SPREAD)
    return above, close


@pytest.mark.parametrize("point", POINTS, ids=[p["id"] for p in POINTS])
def test_prediction_bounds_the_measured_peak_within_10_percent(point):
    gpu, host = predict_point(point)
    above, close = _bounds(point, gpu, host)
    ratios = f"gpu {gpu / 1e9:.1f} / {point['gpu_peak']} GB, host {host / 1e9:.1f} / {point['host_rss']} GB"
    assert above, "predicted below the measurement: " + ratios
    assert close, "predicted more than 10% above the measurement: " + ratios


# Each term of the model, dropped: (module, name, value). The loss head's chunk of logits is not here: no recorded
# step peaks while the loss runs.
TERMS = {
    "plain layers": (memory_model, "PLAIN_FIT", 0.0),
    "plain layers' extra at sp > 1": (memory_model, "SP_PLAIN_FIT", 0.0),
    "plain layers' extra for packed documents": (memory_model, "PACKED_PLAIN_FIT", 0.0),
    "first plain layer's backward": (memory_model, "BACKWARD_FIT", 0.0),
    "checkpointed layer's recompute": (memory_model, "RECOMPUTE_FIT", 0.0),
    "attention kernel's block": (memory, "attention_backward_block_bytes", lambda *a: 0),
    "checkpointed inputs": (memory, "checkpointed_input_bytes_per_token", lambda shape: 0),
    "kept attention outputs": (memory, "kept_output_bytes_per_token", lambda shape: 0),
    "loss head": (memory, "loss_head_bytes", lambda shape, tokens: memory.auto_chunk_rows(shape.vocab) * shape.vocab * 4),
    "ZeRO-3 state": (memory, "zero3_state_bytes", lambda *a, **kw: (0, 0)),
    "ZeRO-3 gathered weights": (memory_model, "zero3_working_bytes", lambda params: 0),
    "host process": (memory_model, "HOST_PROCESS_BYTES", 0),
}


@pytest.mark.parametrize("term", TERMS)
def test_every_term_is_needed_to_bound_the_measurements(term, monkeypatch):
    module, name, value = TERMS[term]
    monkeypatch.setattr(module, name, value)
    if module is memory and name == "zero3_state_bytes":
        monkeypatch.setattr("ulysses_lc.sizing.zero3_state_bytes", value)
    below = [p["id"] for p in POINTS if not _bounds(p, *predict_point(p))[0]]
    assert below, f"without the {term} every point is still bounded: the term is not tested by the data"
