"""Resume on another world size or SP size (issue 20, item 5): one run of 2 ranks at sp 2, global batch 2 (ga 2),
saved at step 2 of 4, resumed to step 4 on 1 rank, on 4 ranks at sp 4 and on 4 ranks at sp 2 x dp 2. Each resume
holds the global batch at 2 and is compared with the uninterrupted run: the losses of steps 3-4 and every fp32
master weight at step 4.

Tolerances, fp32 on CPU: the resumed runs differ from the uninterrupted one only in reduction order (the attention
and loss split over 1, 2 or 4 ranks, gradients reduced over 1, 2 or 4 ranks, sequences summed by DeepSpeed's
gradient accumulation or by the DP reduction). Measured on 2026-12-01 (DeepSpeed 0.19.8, torch 2.13, 2 loaded CPU
cores): losses within 9.6e-8 relative, weights within 2.1e-8 relative norm; the bounds below are about 10x those,
a few float32 ulps, so any difference in the restored state (moments, Adam step, schedule) or in the sequences
trained, beyond the order of reductions, fails them. The 1-rank and sp-4 resumes also check that the global batch
is held: each would train 1 sequence per step by default (dp 1).
"""

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._dist import run_distributed, run_shared
from ulysses_lc.train import CheckFailed, RunSettings, TrainConfig, preflight, train
from ulysses_lc.train.run_state import resume_line

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAVE_AT, STEPS = 2, 4
LOSS_RTOL = 1e-6  # measured: at most 9.6e-8 (1 rank), 0 at 4 ranks (the printed float32 loss equal)
WEIGHT_RTOL = 2e-7  # relative norm per parameter; measured: at most 2.1e-8 (sp 4), 1.2e-8 (1 rank, sp 2 x dp 2)
RESUMES = {  # name: (world size, sp size)
    "1 rank": (1, 1),
    "4 ranks sp 4": (4, 4),
    "4 ranks sp 2 x dp 2": (4, 2),
}


def _config(tmp, **overrides):
    base = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=STEPS, lr=3e-3, warmup_steps=1,
                       cache_dir=f"{tmp}/cache", export=False, keep_checkpoints=0)
    return replace(base, **overrides)


def _saved_run_worker(rank, world_size, tmp):
    records = train(_config(tmp, output_dir=f"{tmp}/full", sp_size=2, global_batch=2, save_every=SAVE_AT))
    return [r["loss"] for r in records]


def _copy_to_resume(full: Path, out: Path, rank: int) -> None:
    """`full` copied to `out` (rank 0) without the tags after SAVE_AT, `latest` back on step SAVE_AT."""
    if rank == 0:
        shutil.copytree(full, out, ignore=shutil.ignore_patterns(*[f"step{s}" for s in range(SAVE_AT + 1, STEPS + 1)]))
        (out / "checkpoints" / "latest").write_text(f"step{SAVE_AT}")
    torch.distributed.barrier()


def _resume_worker(rank, world_size, tmp, names):
    """Each named resume in its own copy of the saved run, `latest` back on step SAVE_AT; (losses, resume line)."""
    results = {}
    for name in names:
        out = Path(tmp) / name.replace(" ", "_")
        _copy_to_resume(Path(tmp) / "full", out, rank)
        lines, log = _LogLines(), logging.getLogger("ulysses_lc.train.loop")
        level = log.level
        log.addHandler(lines)
        log.setLevel(logging.INFO)
        try:  # these ranks run other tests' bodies next: the logger as it was
            records = train(_config(tmp, output_dir=str(out), sp_size=RESUMES[name][1], resume=True))
        finally:
            log.removeHandler(lines)
            log.setLevel(level)
        results[name] = ([r["loss"] for r in records], [m for m in lines.messages if m.startswith("resumed")])
    return results


class _LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _final_weights(run: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=f"step{STEPS}")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    losses = run_shared(_saved_run_worker, 2, str(tmp), kind="deepspeed")[0]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    return tmp, losses


def _four_rank_worker(rank, world_size, tmp, names):
    return _resume_worker(rank, world_size, tmp, names), _same_world_worker(rank, world_size, tmp)


@pytest.fixture(scope="module")
def on_four_ranks(saved_run):
    """What the tests below train on 4 ranks, in one start of 4 fresh ranks (each start costs ~25 s of imports on 2
    cores; the suite's shared 4-rank pool runs plain bodies, which a DeepSpeed body would make restart twice): the
    saved run's resumes at sp 4 and at sp 2 x dp 2, and the same-world run of _same_world_worker."""
    tmp, _ = saved_run
    return run_distributed(_four_rank_worker, 4, str(tmp), ["4 ranks sp 4", "4 ranks sp 2 x dp 2"])[0]


def test_resume_on_other_world_and_sp_sizes_follows_the_uninterrupted_run(saved_run, on_four_ranks):
    tmp, losses = saved_run
    results = run_shared(_resume_worker, 1, str(tmp), ["1 rank"], kind="deepspeed")[0]
    results.update(on_four_ranks[0])
    reference = _final_weights(tmp / "full")
    for name, (resumed, lines) in results.items():
        world, sp = RESUMES[name]
        np.testing.assert_allclose(resumed, losses[SAVE_AT:], rtol=LOSS_RTOL, err_msg=name)
        weights = _final_weights(tmp / name.replace(" ", "_"))
        assert weights.keys() == reference.keys()
        for key, ref in reference.items():
            err = float((weights[key] - ref).detach().norm() / ref.detach().norm())
            assert err <= WEIGHT_RTOL, f"{name}, {key}: relative error {err:.1e}"
        dp = world // sp
        ranks = f"{world} rank{'s' * (world > 1)}"
        assert lines == [f"resumed step {SAVE_AT} saved on 2 ranks (sp 2 x dp 1) on {ranks} (sp {sp} x dp {dp}): ZeRO-3 "
                         f"state resharded, global batch 2 = 1 x ga 2 -> {dp} x ga {2 // dp} (the uninterrupted "
                         "trajectory)"], lines


def test_a_global_batch_that_cannot_be_held_is_refused_or_stated(saved_run, monkeypatch):
    """On 4 ranks at sp 1 (dp 4) the saved global batch of 2 cannot be split: refused before anything starts, naming
    --global-batch 4; with it, the run resumes and its start-up line says what changes."""
    tmp, _ = saved_run
    monkeypatch.delenv("RANK", raising=False)
    # `latest`: step 4, 8 sequences consumed; --steps past it (a resume of a run that reached its steps trains nothing)
    cfg = _config(tmp, output_dir=str(tmp / "full"), resume=True, steps=STEPS + 2)
    held = preflight(RunSettings(replace(cfg, sp_size=2)), 2)  # the layout that saved it: DeepSpeed's own load, ga 2
    assert (held.global_batch, held.ds_config["gradient_accumulation_steps"], held.resharded) == (2, 2, False)
    with pytest.raises(CheckFailed, match=r"the run trained 2 sequences per optimizer step, which dp_size=4 \(4 ranks "
                                          r"/ sp 1\) cannot split.* or change the global batch with --global-batch 4"):
        preflight(RunSettings(replace(cfg, sp_size=1)), 4)
    with pytest.raises(CheckFailed, match="--global-batch 3 is not a multiple of dp_size=2 .*pass --global-batch 2 or "
                                          "--global-batch 4"):
        preflight(RunSettings(replace(cfg, sp_size=2, global_batch=3)), 4)
    changed = preflight(RunSettings(replace(cfg, sp_size=1, global_batch=4)), 4)
    ds = changed.ds_config
    assert (ds["gradient_accumulation_steps"], ds["train_batch_size"], changed.resharded) == (1, 4, True)
    assert resume_line(changed.saved, 4, 1, changed.global_batch) == (
        "resumed step 4 saved on 2 ranks (sp 2 x dp 1) on 4 ranks (sp 1 x dp 4): ZeRO-3 state resharded, global batch "
        "2 -> 4 sequences per step (--global-batch): the data continues after the 8 sequences consumed and the schedule "
        "at optimizer step 4, so the steps from here train 4 sequences each and differ from the uninterrupted run's")


def test_missing_shards_of_the_saved_ranks_are_named_with_the_fix(saved_run, monkeypatch, tmp_path):
    # Node-local disks: the node of new rank 0 holds only old rank 0's files of the tag.
    tmp, _ = saved_run
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "local"
    shutil.copytree(tmp / "full", run)
    tag = run / "checkpoints" / f"step{STEPS}"
    for f in tag.glob("zero_pp_rank_*_optim_states.pt"):  # named as a bf16 run's (GPU runs) names them
        f.rename(tag / f"bf16_{f.name}")
    cfg = _config(tmp, output_dir=str(run), resume=True, sp_size=4, steps=STEPS + 2)
    preflight(RunSettings(cfg), 4)  # every old rank's files are there
    for f in tag.glob("*zero_pp_rank_1_*"):
        f.unlink()
    with pytest.raises(CheckFailed) as e:
        preflight(RunSettings(cfg), 4)
    message = str(e.value)
    assert "all 2 ranks that saved" in message and "2 are not there" in message, message
    assert "(zero_pp_rank_1_mp_rank_00_model_states.pt, bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt)" in message, message
    assert "gather the checkpoint folder onto one file system that every rank reads" in message, message


def _same_world_worker(rank, world_size, tmp):
    """4 ranks: the uninterrupted run at sp 4 (global batch 2 = ga 2), then its step-SAVE_AT checkpoint resumed on the
    same 4 ranks at sp 2 x dp 2 (ga 1): ZeRO-3 shards as saved, another SP and DP split of each step's sequences."""
    full = train(_config(tmp, output_dir=f"{tmp}/full_sp4", sp_size=4, global_batch=2, save_every=SAVE_AT))
    out = Path(tmp) / "sp4_to_sp2"
    _copy_to_resume(Path(tmp) / "full_sp4", out, rank)
    resumed = train(_config(tmp, output_dir=str(out), sp_size=2, resume=True))
    return [r["loss"] for r in full], [r["loss"] for r in resumed]


def test_resume_on_the_same_world_with_another_sp_size(saved_run, on_four_ranks):
    """Issue 28, item 5: 4 ranks at sp 4 saved, resumed on 4 ranks at sp 2 x dp 2, on the uninterrupted trajectory."""
    tmp, _ = saved_run
    full, resumed = on_four_ranks[1]
    assert len(full) == STEPS and len(resumed) == STEPS - SAVE_AT
    np.testing.assert_allclose(resumed, full[SAVE_AT:], rtol=LOSS_RTOL)
    reference, weights = _final_weights(tmp / "full_sp4"), _final_weights(tmp / "sp4_to_sp2")
    assert weights.keys() == reference.keys()
    for key, ref in reference.items():
        err = float((weights[key] - ref).detach().norm() / ref.detach().norm())
        assert err <= WEIGHT_RTOL, f"{key}: relative error {err:.1e}"
