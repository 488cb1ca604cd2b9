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
from transformers import GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config, Qwen3MoeConfig

from ulysses_lc import MemoryPlan, ModelShape, memory, memory_model
from ulysses_lc.parallel.ds_config import load_deepspeed_config
from ulysses_lc.plan.sizing import Job, zero3_offload

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


def qwen3_config(name: str, layers: int | None = None):
    """The public config of shape `name`: a Qwen3 dense shape above, or one of OTHER_SHAPES (a sliding window, sinks,
    MoE); `layers` fewer decoder layers where the whole model would not fit one GPU."""
    if name in OTHER_SHAPES:
        cls, kwargs = OTHER_SHAPES[name]
        return cls(**{**kwargs, **({"num_hidden_layers": layers} if layers else {})})
    kwargs = dict(SHAPES[name], head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)
    if layers:
        kwargs["num_hidden_layers"] = layers
    return Qwen3Config(**kwargs)


# Shapes of other families, from their public config.json files (hub names in the comments), for points held out of
# the fit (`held_out`): a sliding window, attention sinks with MoE, and a fine-grained MoE.
OTHER_SHAPES = {
    "mistral-7b": (MistralConfig, dict(  # mistralai/Mistral-7B-v0.1: every layer windowed at 4096
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=32000, sliding_window=4096, max_position_embeddings=32768, rope_theta=1e4,
        tie_word_embeddings=False)),
    "gpt-oss-20b": (GptOssConfig, dict(  # openai/gpt-oss-20b: sinks, sliding 128 / full layers, 32 experts (4 a token)
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, vocab_size=201088, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
    "qwen3-30b-a3b": (Qwen3MoeConfig, dict(  # Qwen/Qwen3-30B-A3B: 128 experts of 768 (8 a token)
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rope_theta=1e6, tie_word_embeddings=False)),
    "llama-3.1-8b": (LlamaConfig, dict(  # meta-llama/Llama-3.1-8B (ulysses_lc/model_configs), its llama3 RoPE scaling left
        # out: the ladder puts YaRN on it for the length (the issue's --rope-scaling yarn); memory does not depend on it
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False)),
}


def predict_point(point: dict) -> tuple[float, float]:
    """(GPU peak, host RSS) bytes the model predicts for a recorded point."""
    shape = ModelShape.from_config(qwen3_config(point["shape"], point["layers"]))
    plan = MemoryPlan(*point["plan"])
    if point["harness"] == "zero3":
        ds_config = load_deepspeed_config(point.get("ds_config") or "zero3")  # its offload, as the run had it
        job = Job.from_ds_config(shape, point["params"], point["world"], point["sp"], ds_config,
                                 head_groups=point["head_groups"], packed=point["packed"])
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


FITTED_POINTS = [p for p in POINTS if not p.get("held_out")]
HELD_OUT = [p for p in POINTS if p.get("held_out")]
# Held-out points the model predicts below their measured GPU peak, by how much: findings to fix in the model, each
# still within WITHIN. Mistral-7B (every layer windowed at 4096, the band's path): 2.7% below on 2026-12-01.
KNOWN_BELOW = {"mistral-7b-4L@128k": 0.03}


@pytest.mark.parametrize("point", FITTED_POINTS, ids=[p["id"] for p in FITTED_POINTS])
def test_prediction_bounds_the_measured_peak_within_10_percent(point):
    gpu, host = predict_point(point)
    above, close = _bounds(point, gpu, host)
    ratios = f"gpu {gpu / 1e9:.1f} / {point['gpu_peak']} GB, host {host / 1e9:.1f} / {point['host_rss']} GB"
    assert above, "predicted below the measurement: " + ratios
    assert close, "predicted more than 10% above the measurement: " + ratios


@pytest.mark.parametrize("point", HELD_OUT, ids=[p["id"] for p in HELD_OUT])
def test_shapes_held_out_of_the_fit_are_predicted_within_10_percent(point):
    """Other families (a window, sinks with MoE, a fine-grained MoE), never fitted to: the model carries over to them
    within 10% of the measured GPU peak, at or above it except where KNOWN_BELOW says by how much, and the host RSS is
    bounded as for the fitted points."""
    gpu, host = predict_point(point)
    ratio, host_meas = gpu / (point["gpu_peak"] * 1e9), point["host_rss"] * 1e9
    assert 1 - KNOWN_BELOW.get(point["id"], 0.0) <= ratio <= 1 + WITHIN, f"gpu predicted / measured {ratio:.3f}"
    assert point["id"] in KNOWN_BELOW or ratio >= 1, f"gpu predicted / measured {ratio:.3f}"
    assert host_meas <= host <= max(host_meas * (1 + WITHIN), host_meas + HOST_SPREAD), (host, host_meas)


# Each term of the model, dropped: (module, name, value). The loss head's chunk of logits is not here: no recorded
# step peaks while the loss runs.
TERMS = {
    "plain layers": (memory_model, "PLAIN_FIT", 0.0),
    "plain layers' extra at sp > 1": (memory_model, "SP_PLAIN_FIT", 0.0),
    "plain layers' extra for packed documents": (memory_model, "PACKED_PLAIN_FIT", 0.0),
    "first plain layer's backward": (memory_model, "BACKWARD_FIT", 0.0),
    "checkpointed layer's recompute": (memory_model, "RECOMPUTE_FIT", 0.0),
    "attention kernel's block": (memory, "head_group_block_bytes", lambda *a: 0),
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
        monkeypatch.setattr("ulysses_lc.plan.sizing.zero3_state_bytes", value)
    below = [p["id"] for p in FITTED_POINTS if not _bounds(p, *predict_point(p))[0]]
    assert below, f"without the {term} every point is still bounded: the term is not tested by the data"


# Points whose measured allocator slack is above what the plan leaves them: findings, by how much. Qwen3-30B-A3B (128
# experts a layer, 2 layers at 64k): 4.8 GB reserved beyond its peak, 42% of its 11.6 GB of activations. The full
# Qwen3-0.6B shape at its longest under a 40 GB cap (issue 44, 602,112 tokens, every layer checkpointed): 2.3 GB, 8.8%
# of its predicted 25.9 GB, where the plan leaves 5%; the step ran (37.7 GB reserved under the cap).
SLACK_ABOVE = {"qwen3-30b-a3b-2L@64k", "0.6b-longest-40gb"}
# ZeRO-3's parameters offloaded, measured before the run gave the allocator's cached memory back at each recompute
# (release_cached_memory false): up to 13.8% by this measure, the 15% the plan left then; runs now release it.
SLACK_BEFORE_RELEASE = 0.15


def test_allocator_slack_the_plan_leaves_covers_the_measured():
    """memory_model.allocator_slack against each point's max_memory_reserved less max_memory_allocated, as a share of
    the predicted activations and gathered weights: at or above every point but SLACK_ABOVE, and the one-GPU dense
    share within 0.01 of the largest measured on such a point (fitted, not guessed)."""
    dense_one_gpu, offloaded_params = [], []
    for point in (p for p in POINTS if p.get("gpu_reserved") is not None):
        shape = ModelShape.from_config(qwen3_config(point["shape"], point["layers"]))
        act, _ = memory.plan_bytes(shape, point["seq"], MemoryPlan(*point["plan"]), sp_size=point["sp"],
                                   head_groups=point["head_groups"], packed=point["packed"])
        gathered = memory_model.zero3_working_bytes(shape.largest_module_params) if point["harness"] == "zero3" else 0
        measured = (point["gpu_reserved"] - point["gpu_peak"]) * 1e9 / (act + gathered)
        offload_params = zero3_offload(load_deepspeed_config(point.get("ds_config") or "zero3"))[1]
        share = memory_model.allocator_slack(shape, point["sp"], offload_params)
        if point.get("release_cached_memory") is False and point["plan"][0]:
            assert measured <= SLACK_BEFORE_RELEASE, (point["id"], measured)
            continue
        assert (share >= measured) != (point["id"] in SLACK_ABOVE), (point["id"], share, measured)
        if share == memory_model.DENSE_ONE_GPU_SLACK:
            dense_one_gpu.append(measured)
        elif share == memory_model.OFFLOADED_PARAMS_SLACK:
            offloaded_params.append(measured)
    assert len(dense_one_gpu) >= 10 and memory_model.DENSE_ONE_GPU_SLACK - max(dense_one_gpu) <= 0.01
    # ZeRO-3's parameters on the host, the cached memory given back (the Llama-8B cut's plain step, where nothing is
    # recomputed, and its two checkpointed steps of 2026-12-04), and the plan's 10% fitted to the largest of them.
    assert len(offloaded_params) >= 3 and memory_model.OFFLOADED_PARAMS_SLACK - max(offloaded_params) <= 0.01
