"""The main job on a local folder of each sliding-window family: Mistral, Gemma 3 text, gpt-oss (sinks, MoE).

Each folder holds a tiny random model (save_pretrained) and the embedded byte tokenizer, as a user's download
would. One launch of 2 gloo ranks (sp 2) trains all three in turn on generated text, every lever on, then gpt-oss
through UlyssesTrainer (the Trainer path: its first logged loss is the plain model's on that sequence, 1e-5
relative); the dry run sizes each at 256k tokens from its config alone.
"""

import os

import torch
from transformers import AutoModelForCausalLM

from tests._dist import run_distributed
from tests.models import WINDOW_FAMILIES, build, tiny_config
from tests.test_hf_trainer import sequences
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


def train_worker(rank, world_size, configs, trainer_out):
    import datasets

    from tests.test_hf_trainer import sequences, training_args
    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    losses = [[r["loss"] for r in train(cfg)] for cfg in configs]
    trainer = UlyssesTrainer(model=build("gpt_oss"), args=training_args(trainer_out, 1), sp_size=2,
                             train_dataset=datasets.Dataset.from_dict({"input_ids": sequences()}))
    trainer.train()
    return losses, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_main_job_and_trainer_take_each_window_family(tmp_path):
    folders = save_models(tmp_path)
    configs = [TrainConfig(model=folders[f], data="tiny", seq_len=512, steps=4, lr=3e-3, warmup_steps=1,
                           output_dir=str(tmp_path / f"run-{f}"), cache_dir=str(tmp_path / "cache"), export=False)
               for f in WINDOW_FAMILIES]
    job_losses, trainer_losses = run_distributed(train_worker, 2, configs, str(tmp_path / "trainer"))[0]
    for family, losses in zip(WINDOW_FAMILIES, job_losses):
        assert losses[-1] < losses[0] - 0.3, (family, losses)  # from ~log(257): the model learns the text
    model = build("gpt_oss").eval()
    with torch.no_grad():
        plain = [model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss.item() for s in sequences()]
    assert len(trainer_losses) == 1 and any(abs(trainer_losses[0] - p) <= 1e-5 * p for p in plain), (
        trainer_losses, plain)


def test_dry_run_sizes_each_window_family(tmp_path, capsys):
    folders = save_models(tmp_path)
    for family in WINDOW_FAMILIES:
        main(["--dry-run", "--model", folders[family], "--world-size", "2", "--seq-len", "262144"])
        out = capsys.readouterr().out
        assert "ulysses_lc dry run" in out and "YaRN factor 256" in out, out
        if family == "gemma3":
            assert "on the full-attention layers" in out  # its sliding layers keep their local RoPE
