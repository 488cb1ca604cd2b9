"""The main job on Hugging Face datasets (issue 12): local jsonl and parquet, packed and joined, on 2 gloo ranks.

Each run must train (the loss falls over a few steps), log what it trained (labels counted after the completion
mask, documents per step), and reuse its token cache on a rerun. Bad data is refused before weights load, with
nothing written.
"""

import json
import os
from dataclasses import replace

import pytest

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
