"""The main job on Hugging Face datasets (issue 12): local jsonl and parquet, packed and joined, on 2 gloo ranks.

Each run must train (the loss falls over a few steps), log what it trained (labels counted after the completion
mask, documents per step), and reuse its token cache on a rerun. Bad data is refused before weights load, with
nothing written.
"""

import json
import os
from dataclasses import replace

import pytest
import torch

from tests._dist import run_shared
from ulysses_lc.train import TrainConfig, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    import datasets

    from ulysses_lc.tiny import tiny_text

    folder = tmp_path_factory.mktemp("datasets")
    with open(folder / "pc.jsonl", "w") as f:
        for i in range(120):
            prompt = f"Question {i}: " + tiny_text(150, seed=i)
            f.write(json.dumps({"prompt": prompt, "completion": tiny_text(300 + 53 * (i % 5), seed=1000 + i)}) + "\n")
    datasets.Dataset.from_list([{"text": tiny_text(300 + 71 * (i % 9), seed=i)} for i in range(60)]).to_parquet(
        folder / "text.parquet")
    with open(folder / "no_completion.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "a question", "completion": ""}) + "\n")
    with open(folder / "other.jsonl", "w") as f:
        f.write(json.dumps({"body": "no text column here"}) + "\n")
    return folder


def _cfg(tmp_path, data, **overrides):
    base = TrainConfig(model="tiny", data=str(data), seq_len=1024, steps=5, lr=3e-3, warmup_steps=1,
                       output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), export=False)
    return replace(base, **overrides)


def _train(rank, world_size, cfg):
    return train(cfg)


@pytest.mark.parametrize("source, packing", [("pc.jsonl", True), ("pc.jsonl", False), ("text.parquet", True)])
def test_dataset_trains_and_caches(tmp_path, datasets_dir, source, packing):
    cfg = _cfg(tmp_path, datasets_dir / source, packing=packing)
    records = run_shared(_train, 2, cfg, kind="deepspeed")[0]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.2, losses
    trained = [r["trained_tokens"] for r in records]
    if source == "pc.jsonl":
        # Completion-only by default: fewer labels than tokens, prompts included in every window.
        assert all(0 < n < 1024 - 40 for n in trained), trained
    if packing:
        assert any(r["documents"] > 1 for r in records)  # whole samples share windows
        assert all(0.0 <= r["padding_share"] < 0.7 for r in records)
    (tokens_file,) = (tmp_path / "cache").glob("*.tokens")
    mtime = tokens_file.stat().st_mtime_ns
    again = run_shared(_train, 2, replace(cfg, output_dir=str(tmp_path / "again"), steps=1), kind="deepspeed")[0]
    assert tokens_file.stat().st_mtime_ns == mtime  # the cache was hit, not rebuilt
    assert again[0]["loss"] == records[0]["loss"]


def _refused(rank, world_size, cfgs):
    messages = {}
    for name, cfg in cfgs.items():
        try:
            train(cfg)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def test_bad_datasets_refused_before_weights(tmp_path, datasets_dir):
    cases = {
        "missing_column": _cfg(tmp_path, datasets_dir / "other.jsonl"),
        "named_column_missing": _cfg(tmp_path, datasets_dir / "text.parquet", text_column="body"),
        "no_completion": _cfg(tmp_path, datasets_dir / "no_completion.jsonl"),
        "completion_loss_on_text": _cfg(tmp_path, datasets_dir / "text.parquet", loss_on="completion"),
        "packing_token_ids": _cfg(tmp_path, datasets_dir / "ids.npy", packing=True),
    }
    import numpy as np

    np.save(datasets_dir / "ids.npy", np.arange(5000) % 200)
    messages = run_shared(_refused, 2, cases, kind="deepspeed")[0]
    for name, message in messages.items():
        assert message is not None, f"{name}: no error"
    assert "columns" in messages["missing_column"] and "body" in messages["missing_column"]
    assert "body" in messages["named_column_missing"]
    assert "completion" in messages["no_completion"]
    assert not (tmp_path / "run").exists()  # nothing written by a refused run


def token_weighted_step(cfg, sequences):
    """The plain model's loss and gradients over the main job's first `sequences` windows of `cfg`'s data: the summed
    token losses over the summed labels (transformers' Trainer's weighting), one process, no levers."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ulysses_lc.data import build_token_stream
    from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer
    from ulysses_lc.train import RunSettings

    settings = RunSettings(cfg).stream
    stream = build_token_stream(settings.source, tiny_tokenizer(), cfg.seq_len, num_steps=cfg.steps * sequences,
                                cache_dir=cfg.cache_dir, progress=False, **settings.shape.kwargs())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config())  # the main job's weights for seed 0
    loss_sum, counts = 0.0, []
    for i in range(sequences):
        sample = stream.sample(i)
        logits = model(input_ids=sample.input_ids[None]).logits[0, :-1]
        loss_sum = loss_sum + F.cross_entropy(logits.float(), sample.labels[1:], reduction="sum")
        counts.append(sample.num_trained_tokens)
    loss = loss_sum / sum(counts)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}, counts


def test_main_job_weighs_tokens_across_accumulation_and_dp(tmp_path, datasets_dir):
    # Completion-only windows with different label counts: every label weighs the same across micro steps and DP
    # groups, as in transformers' Trainer (docs/weighting.md). sp 2 with 2 micro steps, and sp 1 with 2 DP
    # groups of 2 micro steps, against the plain model: the first step's loss 1e-5 relative, every gradient 1e-4.
    from tests._grads import assert_grads_close, train_first_step
    from ulysses_lc.model import SequenceParallelCausalLM

    base = _cfg(tmp_path, datasets_dir / "pc.jsonl", seq_len=512, steps=1)
    cfgs = [replace(base, output_dir=str(tmp_path / "sp2"), sp_size=2, global_batch=2),
            replace(base, output_dir=str(tmp_path / "dp2"), sp_size=1, global_batch=4)]
    results = run_shared(train_first_step, 2, cfgs, kind="deepspeed")[0]
    for cfg, (records, grads) in zip(cfgs, results):
        loss, ref, counts = token_weighted_step(cfg, cfg.global_batch)
        assert min(counts) < 0.9 * max(counts), counts  # a per-sequence mean would weigh them otherwise
        assert records[0]["trained_tokens"] == sum(counts)
        assert abs(records[0]["loss"] - loss) <= 1e-5 * loss, (records[0]["loss"], loss)
        assert_grads_close({SequenceParallelCausalLM.plain_name(n): g for n, g in grads.items()}, ref)
