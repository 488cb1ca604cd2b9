"""The main job on CPU: the embedded default end to end on 2 gloo ranks, cache, kill-and-resume, export, bad input."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests._dist import run_shared
from ulysses_lc.tiny import tiny_model_config
from ulysses_lc.train import EXPORT_DIR, TrainConfig, parse_args, train
from ulysses_lc.model import SequenceParallelCausalLM
from ulysses_lc.train.schedule import Schedule

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying the network


def tiny_config(tmp_path, **overrides):
    base = TrainConfig(
        model="tiny", data="tiny", seq_len=2048, steps=6, lr=3e-3, warmup_steps=1,
        output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), export=True,
    )
    return replace(base, **overrides)


class Killed(Exception):
    pass


def train_worker(rank, world_size, cfg, kill_after=None):
    def on_step(step, record):
        if kill_after is not None and step == kill_after:
            raise Killed

    try:
        records = train(cfg, on_step=on_step)
    except Killed:
        return "killed"
    return records


def losses_of(records):
    return [r["loss"] for r in records]


def test_cli_defaults_to_tiny_without_gpu():
    cfg = parse_args(["--steps", "3"])
    if not torch.cuda.is_available():
        assert (cfg.model, cfg.data, cfg.steps) == ("tiny", "tiny", 3)
    full = parse_args(["--model", "Qwen/Qwen3-8B"])
    if not torch.cuda.is_available():  # any model gets the embedded data and a short sequence (issue 31)
        assert (full.model, full.seq_len, full.data, full.lr) == ("Qwen/Qwen3-8B", 4096, "tiny", 1e-5)
    # A dry run sizes the GPU run, from anywhere.
    sized = parse_args(["--model", "Qwen/Qwen3-8B", "--dry-run"])
    assert (sized.model, sized.seq_len, sized.data) == ("Qwen/Qwen3-8B", 1_048_576, "pg19")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The embedded default, 6 steps at 2048 tokens with a checkpoint every 2 and the export: (folder, config,
    records). Its first loss is also the reference of the run from a local folder."""
    root = tmp_path_factory.mktemp("tiny-run")
    cfg = tiny_config(root, save_every=2)
    return root, cfg, run_shared(train_worker, 2, cfg, kind="deepspeed")[0]


def test_train_resume_export(tiny_run):
    tmp_path, cfg, records = tiny_run
    losses = losses_of(records)
    assert all(r["offload_host_gb"] > 0 for r in records)  # checkpointed layer inputs went to the host
    # Real text, 6 steps: the loss must come down clearly from the ~log(257) start.
    assert losses[-1] < losses[0] - 0.3, losses
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert {"loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "tflops_per_gpu", "host_rss_gb"} <= metrics[0].keys()

    # The token cache is hit on a rerun: the token file is not rewritten.
    (token_file,) = (tmp_path / "cache").glob("*.tokens")
    mtime = token_file.stat().st_mtime_ns

    # Killed after step 3 (checkpoint at step 2), then resumed: steps 3..6 reproduce the uninterrupted run.
    killed = tiny_config(tmp_path, output_dir=str(tmp_path / "killed"), save_every=2, export=False)
    assert run_shared(train_worker, 2, killed, 3, kind="deepspeed") == ["killed", "killed"]
    resumed = losses_of(run_shared(train_worker, 2, replace(killed, resume=True), kind="deepspeed")[0])
    assert token_file.stat().st_mtime_ns == mtime
    assert len(resumed) == 4
    np.testing.assert_allclose(resumed, losses[2:], rtol=1e-6)

    # The export reloads with from_pretrained, carries YaRN, and gives the trained weights' logits.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from ulysses_lc.levers.yarn import apply_yarn

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / EXPORT_DIR, dtype=torch.float32)
    rope = exported.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0  # 2048 tokens on a 1024-token model
    reference = AutoModelForCausalLM.from_config(apply_yarn(tiny_model_config(), cfg.seq_len), dtype=torch.float32)
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "run" / "checkpoints"))
    state = {SequenceParallelCausalLM.plain_name(k): v for k, v in state.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied
    reference.load_state_dict(state)
    ids = torch.randint(0, 256, (1, 64))
    torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def bad_input_worker(rank, world_size, cfg_dict, tmp):
    """Each case must fail with a ValueError naming the fix, before loading weights or data."""
    cfg = TrainConfig(**cfg_dict)
    np.save(f"{tmp}/few.npy", np.arange(10, dtype=np.int64))
    configs = {
        "micro": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}},
        "stage": {"zero_optimization": {"stage": 2}},
        "sp": {"zero_optimization": {"stage": 3}, "sequence_parallel_size": 4},
        "ga": {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4},
    }
    for name, body in configs.items():
        with open(f"{tmp}/{name}.json", "w") as f:
            json.dump(body, f)
    os.makedirs(f"{tmp}/taken/checkpoints", exist_ok=True)
    open(f"{tmp}/taken/checkpoints/latest", "w").write("step2")
    cases = {
        "sp_not_dividing_world": replace(cfg, sp_size=3),
        "seq_too_short": replace(cfg, seq_len=1),
        "head_groups_zero": replace(cfg, attention_head_groups=0),
        "ds_grad_accumulation": replace(cfg, ds_config=f"{tmp}/ga.json"),
        "missing_data": replace(cfg, data=f"{tmp}/nope.txt"),
        "too_few_tokens": replace(cfg, data=f"{tmp}/few.npy"),
        "ds_micro_batch": replace(cfg, ds_config=f"{tmp}/micro.json"),
        "ds_stage": replace(cfg, ds_config=f"{tmp}/stage.json"),
        "ds_sp_size": replace(cfg, ds_config=f"{tmp}/sp.json"),
        "missing_ds_config": replace(cfg, ds_config=f"{tmp}/none.json"),
        "output_dir_taken": replace(cfg, output_dir=f"{tmp}/taken"),
        "resume_nothing": replace(cfg, output_dir=f"{tmp}/empty", resume=True),
        "model_offline": replace(cfg, model="Qwen/Qwen3-8B", data="tiny"),
        "model_bad_name": replace(cfg, model="no such//model"),
    }
    messages = {}
    for name, case in cases.items():
        try:
            train(case)
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = None
    return messages


EXPECTED = {
    "sp_not_dividing_world": "pick sp_size in",
    "seq_too_short": "at least 2 tokens",
    "head_groups_zero": "--attention-head-groups 0: give 'auto' or a whole number >= 1",
    "ds_grad_accumulation": "gradient_accumulation_steps=4",
    "missing_data": "no file or folder exists",
    "too_few_tokens": "one step needs seq_len=2,048",
    "ds_micro_batch": "set it to 1",
    "ds_stage": "use stage 3",
    "ds_sp_size": "sequence_parallel_size=4",
    "missing_ds_config": "zero3, zero3_offload_optimizer, zero3_offload_all",
    "output_dir_taken": "pass --resume",
    "resume_nothing": "drop --resume",
    "model_offline": "--model tiny",
    "model_bad_name": "no such folder",  # two separators: a folder, not a hub name (loading.looks_local)
}


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """sp_size=1 on 2 ranks (two DP groups train different windows), 4 steps of 256 tokens under a cosine schedule
    with 2 warmup steps: (config, records), for the logged lr's test and the data-parallel one."""
    root = tmp_path_factory.mktemp("dp-run")
    cfg = tiny_config(root, steps=4, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.0, seq_len=256,
                      export=False, sp_size=1)
    return cfg, run_shared(train_worker, 2, cfg, kind="deepspeed")[0]


def test_logged_lr_is_the_one_the_step_used(dp_run):
    # Warmup over 2 steps, then a cosine decay to 0: the logged lr of each step is the schedule's at that step, not
    # the next step's (which the engine's step has already moved the scheduler to): lr/2 on the first, lr/2 on the
    # last (the next step's would be 0).
    cfg, records = dp_run
    schedule = Schedule(cfg)
    expected = [cfg.lr * schedule(step) for step in range(cfg.steps)]
    assert expected == [cfg.lr / 2, cfg.lr, cfg.lr, cfg.lr / 2]
    assert [r["lr"] for r in records] == expected


def test_bad_input_refused_before_heavy_work(tmp_path):
    cfg = tiny_config(tmp_path, output_dir=str(tmp_path / "out"))
    messages = run_shared(bad_input_worker, 2, cfg.__dict__, str(tmp_path), kind="deepspeed")[0]
    for name, fragment in EXPECTED.items():
        assert messages[name] is not None, f"{name}: no error"
        assert fragment in messages[name], f"{name}: {messages[name]}"
    assert "no network" in messages["model_offline"]
    assert not (tmp_path / "out").exists()  # nothing was written by a refused run


def test_train_from_local_folder(tmp_path, tiny_run):
    # The real loading path (from_pretrained under ZeRO-3's zero.Init, tokenizer from the folder) on a
    # tiny model saved to disk: no hub needed.
    from ulysses_lc.tiny import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tiny-model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_model_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    # No --data: without GPUs a local folder trains on the embedded data too, as --help says (issue 31).
    cfg = parse_args(["--model", str(folder), "--seq-len", "2048", "--steps", "2", "--lr", "3e-3", "--no-export",
                      "--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")])
    if not torch.cuda.is_available():
        assert cfg.data == "tiny"
    records = run_shared(train_worker, 2, cfg, kind="deepspeed")[0]
    losses = losses_of(records)
    assert len(losses) == 2 and all(np.isfinite(losses))
    # from_pretrained returns eval mode, in which transformers silently skips checkpointing: the run must
    # train in train mode, with the checkpointed inputs offloaded.
    assert all(r["offload_host_gb"] > 0 for r in records)
    # Same weights as the embedded default with seed 0: the same first loss (the default's run at 2048 tokens).
    tiny = losses_of(tiny_run[2])
    assert abs(losses[0] - tiny[0]) <= 1e-5 * tiny[0]


@pytest.mark.cpu_adam
def test_optimizer_offload_config(tmp_path):
    # The shipped zero3_offload_optimizer config: DeepSpeed's CPU Adam (built on first use) takes --lr through
    # the "auto" optimizer block and follows the same trajectory as torch AdamW under zero3.json.
    base = tiny_config(tmp_path, steps=2, export=False, seq_len=256)
    plain = losses_of(run_shared(train_worker, 2, base, kind="deepspeed")[0])
    offload = replace(base, output_dir=str(tmp_path / "offload"), ds_config="zero3_offload_optimizer")
    offloaded = losses_of(run_shared(train_worker, 2, offload, kind="deepspeed")[0])
    assert offloaded[0] == plain[0]  # same weights, same data, before any update
    np.testing.assert_allclose(offloaded, plain, rtol=1e-3)


def test_data_parallel_run(dp_run):
    # sp_size=1 on 2 ranks: two DP groups train different windows; the logged loss is their mean.
    cfg, records = dp_run
    assert [r["tokens"] for r in records] == [512] * 4
    # The first step's loss is the mean of the plain model's losses on windows 0 and 1 (one per DP rank).
    from transformers import AutoModelForCausalLM

    from ulysses_lc.data import build_token_stream
    from ulysses_lc.tiny import tiny_tokenizer

    stream = build_token_stream("tiny", tiny_tokenizer(), cfg.seq_len, num_steps=8, cache_dir=cfg.cache_dir,
                                progress=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config())
    with torch.no_grad():
        plain = [model(input_ids=w[None], labels=w[None]).loss.item() for w in (stream.sequence(0), stream.sequence(1))]
    assert plain[0] != plain[1]
    assert abs(records[0]["loss"] - sum(plain) / 2) <= 1e-5 * records[0]["loss"]
