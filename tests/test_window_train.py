"""The main job on a local folder of each sliding-window family: Mistral, Gemma 3 text, gpt-oss (sinks, MoE).

Each folder holds a tiny random model (save_pretrained) and the embedded byte tokenizer, as a user's download
would. One launch of 2 gloo ranks (sp 2) trains all three in turn on generated text, every lever on; the dry run
sizes each at 256k tokens from its config alone.
"""

import os

import torch
from transformers import AutoModelForCausalLM

from tests._dist import run_distributed
from tests.models import WINDOW_FAMILIES, tiny_config
from ulysses_lc.tiny import tiny_tokenizer
from ulysses_lc.train import TrainConfig, main, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_models(root):
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    folders = {}
    for family in WINDOW_FAMILIES:
        # A window of 64 tokens, a quarter of each rank's 256-token shard.
        config = tiny_config(family, vocab_size=vocab, hidden_size=64, intermediate_size=128, head_dim=16,
                             sliding_window=64, max_position_embeddings=1024, eos_token_id=vocab - 1,
                             pad_token_id=vocab - 1, bos_token_id=None)
        torch.manual_seed(0)
        folders[family] = str(root / family)
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[family])
        tokenizer.save_pretrained(folders[family])
    return folders


def train_worker(rank, world_size, configs):
    return [[r["loss"] for r in train(cfg)] for cfg in configs]


def test_main_job_trains_each_window_family(tmp_path):
    folders = save_models(tmp_path)
    configs = [TrainConfig(model=folders[f], data="tiny", seq_len=512, steps=5, lr=3e-3, warmup_steps=1,
                           output_dir=str(tmp_path / f"run-{f}"), cache_dir=str(tmp_path / "cache"), export=False)
               for f in WINDOW_FAMILIES]
    for family, losses in zip(WINDOW_FAMILIES, run_distributed(train_worker, 2, configs)[0]):
        assert losses[-1] < losses[0] - 0.3, (family, losses)  # from ~log(257): the model learns the text


def test_dry_run_sizes_each_window_family(tmp_path, capsys):
    folders = save_models(tmp_path)
    for family in WINDOW_FAMILIES:
        main(["--dry-run", "--model", folders[family], "--world-size", "2", "--seq-len", "262144"])
        out = capsys.readouterr().out
        assert "ulysses_lc dry run" in out and "YaRN factor 256" in out, out
        if family == "gemma3":
            assert "on the full-attention layers" in out  # its sliding layers keep their local RoPE
