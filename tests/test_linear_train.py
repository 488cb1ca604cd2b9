"""The main job on each gated DeltaNet family by its embedded name (tiny-qwen3_5, tiny-qwen3_5_moe, tiny-qwen3_next),
the Trainer path on one, and the dry run on each.

The main job: the shared 2-rank pool (sp 2, gloo, ZeRO-3 on CPU) trains each in turn on generated text, every lever
on, and its loss falls. The Trainer: UlyssesTrainer at sp 2 on a tiny Qwen3-Next, its first logged loss the plain
model's on that sequence (1e-5 relative). The dry run sizes each at 256k tokens from its config alone and names the
gated DeltaNet layers' kernel.
"""

import os

import torch

from tests._dist import run_shared
from tests.models import build
from tests.test_hf_trainer import sequences
from ulysses_lc.train import TrainConfig, main, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HYBRIDS = ("tiny-qwen3_5", "tiny-qwen3_5_moe", "tiny-qwen3_next")


def train_worker(rank, world_size, configs):
    return [[r["loss"] for r in train(cfg)] for cfg in configs]


def test_main_job_trains_each_hybrid_family(tmp_path):
    configs = [TrainConfig(model=name, data="tiny", seq_len=512, steps=4, lr=3e-3, warmup_steps=1,
                           output_dir=str(tmp_path / f"run-{name}"), cache_dir=str(tmp_path / "cache"), export=False)
               for name in HYBRIDS]
    job_losses = run_shared(train_worker, 2, configs, kind="deepspeed")[0]
    for name, losses in zip(HYBRIDS, job_losses):
        assert losses[-1] < losses[0] - 0.3, (name, losses)  # from ~log(257): the model learns the text


def trainer_worker(rank, world_size, out):
    import datasets

    from tests.test_hf_trainer import training_args
    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    trainer = UlyssesTrainer(model=build("qwen3_next"), args=training_args(out, 1), sp_size=2,
                             train_dataset=datasets.Dataset.from_dict({"input_ids": sequences()}))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_takes_a_hybrid(tmp_path):
    losses = run_shared(trainer_worker, 2, str(tmp_path), kind="trainer")[0]
    model = build("qwen3_next").eval()
    with torch.no_grad():
        plain = [model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss.item() for s in sequences()]
    assert len(losses) == 1 and any(abs(losses[0] - p) <= 1e-5 * p for p in plain), (losses, plain)


def test_dry_run_sizes_each_hybrid(capsys):
    for name in HYBRIDS:
        main(["--dry-run", "--model", name, "--world-size", "2", "--seq-len", "262144"])
        out = capsys.readouterr().out
        assert "ulysses_lc dry run" in out and "gated DeltaNet" in out, out
