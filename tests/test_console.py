"""The first run and the console, and messages that lead somewhere (issue 42): each test fails when its item is undone.

In-process where the item is a check or a line (a run of one process, the tiny model); a launch only where the
launcher is what is tested.
"""

import json
import os
from dataclasses import replace

import pytest

from ulysses_lc.train import CheckFailed, TrainConfig, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _no_heavy_work(monkeypatch):
    import ulysses_lc.train.loop as loop

    def heavy(*a, **k):
        raise AssertionError("heavy work started before the checks")

    for name in ("load_tokenizer", "load_model", "build_token_stream"):
        monkeypatch.setattr(loop, name, heavy)


BASE = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1, output_dir="run")


# -- messages that lead somewhere ------------------------------------------------------------------------------

def test_deepspeed_config_keys_unknown_to_deepspeed_are_named_with_the_closest_before_any_work(tmp_path, monkeypatch):
    """An unknown top-level key trained on ZeRO stage 0 (DeepSpeed skips it) and was refused as "stage=0"; an unknown
    ZeRO key failed with DeepSpeed's pydantic error after the weights loaded and the run folder was made."""
    _no_heavy_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"zero_optimisation": {"stage": 3}}))
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comms": True,
                                                        "offload_param": {"devic": "cpu"}},
                                  "tensorboard": {"enabled": False, "output_pth": "tb"}}))
    with pytest.raises(CheckFailed) as e:
        train(replace(BASE, ds_config=str(typo)))
    assert "'zero_optimisation' is no key DeepSpeed knows" in str(e.value), str(e.value)
    assert "did you mean 'zero_optimization'?" in str(e.value) and "stage=0" not in str(e.value)
    with pytest.raises(CheckFailed) as e:
        train(replace(BASE, ds_config=str(nested)))
    message = str(e.value)
    for key, close in [("zero_optimization.overlap_comms", "overlap_comm"),
                       ("zero_optimization.offload_param.devic", "device"), ("tensorboard.output_pth", "output_path")]:
        assert f"'{key}' is no key DeepSpeed knows" in message and f"did you mean '{close}'?" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nested.json", "typo.json"]  # no run folder made


def test_shipped_deepspeed_configs_and_the_examples_keys_are_known():
    from ulysses_lc.parallel.ds_config import CONFIG_NAMES, check_known_keys, load_deepspeed_config

    for name in CONFIG_NAMES:
        check_known_keys(load_deepspeed_config(name))
    # HF's "auto" values and the keys the README names as applied on a resume
    check_known_keys({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9},
                      "flops_profiler": {"enabled": False}, "comms_logger": {"enabled": False}, "activation_checkpointing": {},
                      "train_batch_size": "auto", "sequence_parallel_size": 2, "optimizer": {"type": "AdamW"}})


def test_a_model_path_that_looks_local_and_is_missing_says_the_folder_does_not_exist(tmp_path, monkeypatch):
    """It was taken for a hub name: offline, "no local copy in the Hugging Face cache"; online, a hub error."""
    from ulysses_lc.train.loading import load_model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen3-8B").mkdir()
    with pytest.raises(ValueError) as e:
        load_model_config("./Qwen3-8b-typo")
    assert str(e.value).startswith(f"--model ./Qwen3-8b-typo: no such folder ({tmp_path}/Qwen3-8b-typo does not "
                                   "exist); did you mean --model ./Qwen3-8B?"), str(e.value)
    for name in ("../elsewhere", "/no/such/model", "~/no-such-model", "models/qwen/8b"):
        with pytest.raises(ValueError, match="no such folder"):
            load_model_config(name)
    with pytest.raises(ValueError) as e:  # a hub name (one slash) is still a hub name
        load_model_config("no-such-org/no-such-model")
    assert "no such folder" not in str(e.value)


def test_a_column_of_role_content_lists_under_text_column_is_read_as_messages(tmp_path):
    """`--text-column conversation` said "holds list, not text": a dead end for a chat dataset whose column has
    another name. It trains as the same rows under `messages` do (the reference), assistant turns only."""
    from ulysses_lc.data import build_token_stream, check_source
    from ulysses_lc.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    rows = [[{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": f"answer {i} " * 4}]
            for i in range(40)]
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps({"conversation": r, "id": i}) + "\n"
                                                 for i, r in enumerate(rows)))
    (tmp_path / "msgs.jsonl").write_text("".join(json.dumps({"messages": r, "id": i}) + "\n"
                                                 for i, r in enumerate(rows)))
    found = check_source(str(tmp_path / "conv.jsonl"), tok, text_column="conversation")
    assert found["format"] == "messages" and found["loss_on"] == "completion", found

    def windows(name, **kw):
        stream = build_token_stream(str(tmp_path / name), tok, 128, 4, cache_dir=tmp_path / "cache", local_rank=0,
                                    progress=False, **kw)
        return [(s.input_ids.tolist(), s.labels.tolist()) for s in map(stream.sample, range(4))]

    assert windows("conv.jsonl", text_column="conversation") == windows("msgs.jsonl")


def test_resume_of_a_run_that_reached_its_steps_says_so_and_writes_nothing(tmp_path, monkeypatch):
    """It loaded the model, trained nothing, and rewrote the export and run.json."""
    import ulysses_lc.train.cli as cli

    def fail(e):  # cli's report ends the process (os._exit): here, the test's
        raise e

    monkeypatch.setattr(cli, "_fail", fail)
    main = cli.main
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["--model", "tiny", "--steps", "1", "--seq-len", "256", "--output-dir", "run", "--cache-dir", "cache"]
    main(args)
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert any(p.parent.name == "hf_export" for p in written)
    _no_heavy_work(monkeypatch)
    import sys
    from io import StringIO

    out = StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    main([*args, "--resume"])
    assert out.getvalue().strip() == (
        "run already reached step 1 (--steps 1): nothing to train, and its checkpoint, export and run.json stay as "
        "they are. To train on, pass --resume with a larger --steps (e.g. --steps 2); the schedule then continues "
        "from the factor reached."), out.getvalue()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()} == written
