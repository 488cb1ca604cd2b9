"""Run state on disk: the output-directory policy, the run record, and checkpoints with RNG and data position.

A checkpoint is DeepSpeed's (model, optimizer, schedule) plus our client state: the step, the token
stream's position (in sequences consumed), every RNG and the layout (world size, sp_size, global batch), so that
--resume continues the uninterrupted trajectory bit for bit on the same layout, and within float32 reduction order
on another world size or sp_size that holds the global batch (the ZeRO-3 state resharded: zero_reshard.py).

Run directories: without --output-dir every run gets a new `runs/<model>-<date>-<time>`, so the README's
commands can be run again as they are (a user who reruns a command expects a new run, not a refusal or an
overwrite); --resume without --output-dir continues the latest such run that holds a checkpoint.
Checkpoints are written atomically: DeepSpeed writes a tag's files, every rank finishes, and only then
does rank 0 point `latest` at it (by rename), so a crash mid-save leaves `latest` on the previous one. On
node-local disks each node's folder gets its own run.json and `latest` (files.py says which rank writes what).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..parallel.ds_config import load_deepspeed_config
from ..parallel.zero_reshard import load_resharded, model_states_name, read_model_states, saved_partitions
from .checkpoint_files import (MANIFEST, choose_checkpoint, raise_first_failure, recording_files, save_failure,
                               state_bytes, verify, write_manifest)

CHECKPOINT_DIR = "checkpoints"
RUN_FILE = "run.json"
SETTINGS = "ds_config_settings"  # run.json's copy of what --ds-config held (resume.check_kept compares it)
RUNS_DIR = Path("runs")
LATEST = "latest"  # DeepSpeed's name for the file holding the newest complete tag

logger = logging.getLogger(__name__)


def rng_state() -> dict:
    """Every RNG a step can draw from (Python, NumPy, torch CPU, and CUDA where present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def run_name(model: str) -> str:
    """The stem of a run directory: the model's last path part ('tiny', 'Qwen3-8B')."""
    return Path(model.rstrip("/")).name or "run"


def new_run_dir(model: str) -> Path:
    """A fresh runs/<model>-<date>-<time> (a suffix when two runs start within one second). Rank 0 only."""
    stem = RUNS_DIR / f"{run_name(model)}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = stem, 1
    while out.exists():
        out, n = Path(f"{stem}.{n}"), n + 1
    return out


def find_latest_run(model: str) -> Path:
    """The newest runs/<model>-* that holds a checkpoint (for --resume without --output-dir)."""
    runs = sorted(p for p in RUNS_DIR.glob(f"{run_name(model)}-*") if (p / CHECKPOINT_DIR / LATEST).is_file())
    if not runs:
        raise ValueError(f"--resume: no run of {run_name(model)} under {RUNS_DIR}/ holds a checkpoint; pass "
                         "--output-dir of the run to continue, or drop --resume to start a new run.")
    return max(runs, key=lambda p: (p / CHECKPOINT_DIR / LATEST).stat().st_mtime)


def check_output_dir(out: Path, resume: bool) -> Path:
    """Refuse to overwrite another run's checkpoints; on --resume, require one (resume.check_kept: the same run)."""
    has_ckpt = (out / CHECKPOINT_DIR / LATEST).exists()
    if has_ckpt and not resume:
        raise ValueError(
            f"{out} already holds a checkpoint of a run; pass --resume to continue it, or choose another "
            "--output-dir (nothing is overwritten)."
        )
    if resume and not has_ckpt:
        raise ValueError(f"--resume: {out} holds no checkpoint to resume from; drop --resume to start a new run.")
    return out


def write_run_file(out: Path, flags, sp_size: int, world_size: int) -> None:
    """Record what this run trains (flags: the TrainConfig as resolved, settings.RunSettings.flags), checked by a
    later --resume. One rank per folder (files.folder_owner)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = load_deepspeed_config(flags.ds_config)
    (out / RUN_FILE).write_text(json.dumps({**asdict(flags), SETTINGS: settings, "sp_size": sp_size,
                                            "world_size": world_size}, indent=2))


def save_checkpoint(engine, out: Path, step: int, stream, keep: int = 0, writes: bool | None = None,
                    layout: dict | None = None, schedule=None) -> None:
    """Collective: model, optimizer and schedule (DeepSpeed) plus step, data position and RNG, then `latest`.

    keep: the newest `keep` checkpoints stay, older ones are deleted once `latest` points past them (0: all).
    writes: whether this rank writes `latest` and prunes (files.folder_owner: one rank per folder, so every
        node-local copy gets its own); default global rank 0, for one shared folder.
    layout: world_size, sp_size and global_batch of the run, kept with the checkpoint (not only in run.json) so
        that a resume on another layout knows what it reshards from (`saved_layout`).
    schedule: the run's schedule.Schedule, whose extensions by earlier resumes a later one continues.
    """
    ckpt_dir = out / CHECKPOINT_DIR
    # DeepSpeed's own `latest` is written by rank 0 as soon as rank 0's files are done, before the other
    # ranks' are: a crash there leaves `latest` naming a checkpoint with missing shards.
    # A LoRA run's frozen base weights are not saved (every checkpoint would hold the whole model again): --resume
    # loads them from --model, as the run did, and the checkpoint restores the adapters and their optimizer state.
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    owner = torch.distributed.get_rank() == 0 if writes is None else writes
    if owner and (ckpt_dir / f"step{step}").exists():
        # A step saved again (a resume from an older checkpoint): the earlier save goes first, so that none of its
        # files (another layout's ranks) nor its resharded copy (zero_reshard's universal/) outlives it beside these.
        shutil.rmtree(ckpt_dir / f"step{step}")
    torch.distributed.barrier()
    failed = []
    with recording_files(engine, failed) as written:  # each file's size and CRC-32, summed as it is written
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", save_latest=False, exclude_frozen_parameters=frozen,
                               client_state={"step": step, "data": stream.state_dict(), "rng": rng_state(),
                                             "layout": layout,
                                             "schedule": schedule.state_dict() if schedule is not None else None})
    world = torch.distributed.get_world_size()

    def failure_of(path, error):
        return save_failure(path, error, rank_bytes=state_bytes(engine), world_size=world, keep=keep,
                            previous=latest_tag(out) if (ckpt_dir / LATEST).is_file() else None)

    every = [None] * world
    torch.distributed.all_gather_object(every, (written, failure_of(*failed[0]) if failed else None))  # a barrier too
    raise_first_failure([f for _, f in every])
    failure = None
    if owner:
        try:
            write_manifest(ckpt_dir / f"step{step}", [w for w, _ in every])  # last in the tag, before `latest` names it
            point_latest(ckpt_dir, f"step{step}")
        except OSError as e:  # the disk filled up at the last small writes: every rank hears it, not only this one
            failure = failure_of(Path(e.filename or ckpt_dir / f"step{step}" / MANIFEST), e)
        else:
            if keep:
                _prune(ckpt_dir, keep)
    every = [None] * world
    torch.distributed.all_gather_object(every, failure)  # also the barrier: `latest` names the new tag
    raise_first_failure(every)


def point_latest(ckpt_dir: Path, tag: str) -> None:
    """`latest` names `tag`, by rename: atomic, it names the old tag or the new one, never half."""
    tmp = ckpt_dir / f".{LATEST}.tmp"
    tmp.write_text(tag)
    os.replace(tmp, ckpt_dir / LATEST)


def _prune(ckpt_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and unfinished tags older than `latest`)."""
    latest = int((ckpt_dir / LATEST).read_text().removeprefix("step"))
    steps = sorted(int(p.name[4:]) for p in ckpt_dir.glob("step*") if p.is_dir() and p.name[4:].isdigit())
    done = [s for s in steps if s <= latest]
    for s in done[:-keep]:
        shutil.rmtree(ckpt_dir / f"step{s}", ignore_errors=True)


def load_checkpoint(engine, out: Path, stream, layout=None, schedule=None) -> int:
    """Collective: restore a checkpoint into `engine` and `stream`, and the RNG; returns its step.

    Same world size: the newest checkpoint every rank holds its files of (files.agree_on_checkpoint: each rank
    reads its own folder's `latest`, which on node-local disks is its node's; layout None: this folder's `latest`).
    An engine built with `zero_reshard.universal_config` (train() does so when the checkpoint was saved on another
    world size) gets the ZeRO-3 state resharded from the saved ranks' files of `latest`; the data position is in
    sequences consumed, whatever the layout. schedule: a schedule.Schedule that takes the saved extensions.
    """
    ckpt_dir = out / CHECKPOINT_DIR
    # A LoRA run's checkpoint holds no frozen weights (save_checkpoint): those keys are missing by design.
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    if engine.load_universal_checkpoint():
        tag, lines = choose_checkpoint(ckpt_dir, latest_tag(out), layout, every_file=True)
        if lines and layout.rank == 0:
            logger.info("\n".join(lines))
        client = load_resharded(engine, ckpt_dir / tag, load_module_strict=not frozen)
    else:
        tag = None
        if layout is not None:
            latest = latest_tag(out) if (ckpt_dir / LATEST).is_file() else None
            tag, lines = choose_checkpoint(ckpt_dir, latest, layout)
            if lines and layout.rank == 0:
                logger.info("\n".join(lines))
            if tag != latest and (saved := saved_partitions(ckpt_dir / tag)) != layout.world_size:
                # The engine was built for `latest`'s layout; DeepSpeed would only say it cannot repartition.
                raise ValueError(
                    f"--resume: the newest checkpoint that checks, {tag}, was saved on {saved} ranks, not the "
                    f"{layout.world_size} that {latest} was (the lines above say what is wrong with {latest}); point "
                    f"`latest` at it (echo {tag} > {ckpt_dir / LATEST}) and resume again, which reshards it, or "
                    f"resume on {saved} ranks.")
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=not frozen)
    if client is None:
        raise ValueError(f"--resume: the checkpoint {ckpt_dir} names cannot be read; pass another --output-dir.")
    stream.load_state_dict(client["data"])
    if schedule is not None and client.get("schedule"):
        schedule.load_state_dict(client["schedule"])
    set_rng_state(client["rng"])
    return client["step"]


def saved_layout(out: Path, rank: int = 0) -> dict:
    """world_size, sp_size, global_batch and step of the latest checkpoint of `out`, from its model_states file.

    Read before any process group starts (preflight), from this rank's file where it has one (node-local disks
    hold only their own ranks'), else from any rank's: they agree. A checkpoint from before the layout was kept
    gives DeepSpeed's own record (the ZeRO-3 partition count, train_batch_size) and run.json's sp_size.
    """
    tag_dir = _readable_tag(out, rank)
    states = read_model_states(tag_dir, rank if (tag_dir / model_states_name(rank)).is_file() else None)
    layout = states.get("layout")
    if layout is None:
        run_file = out / RUN_FILE
        layout = {"world_size": int(states["dp_world_size"]), "global_batch": int(states["ds_config"]["train_batch_size"]),
                  "sp_size": json.loads(run_file.read_text()).get("sp_size") if run_file.is_file() else None}
    return {**layout, "step": int(states["step"]), "position": int(states["data"]["position"])}


def _readable_tag(out: Path, rank: int) -> Path:
    """The newest tag up to `latest` whose model_states file (this rank's, else any) checks against its manifest, so
    that a damaged newest checkpoint fails nothing here: the loop's load says what is wrong and takes an older one."""
    ckpt_dir = out / CHECKPOINT_DIR
    newest = int(latest_tag(out).removeprefix("step"))
    steps = sorted((int(p.name[4:]) for p in ckpt_dir.glob("step*") if p.name[4:].isdigit()), reverse=True)
    for step in [s for s in steps if s <= newest]:
        tag_dir = ckpt_dir / f"step{step}"
        mine = tag_dir / model_states_name(rank)
        states = mine if mine.is_file() else next(iter(sorted(tag_dir.glob(model_states_name("*")))), None)
        if states is not None and not verify(tag_dir, [states.name]):
            return tag_dir
    return ckpt_dir / latest_tag(out)  # none checks: the load names what is wrong


def resume_line(saved: dict, world_size: int, sp_size: int, global_batch: int) -> str:
    """The one start-up line of a resume: what was saved, what runs now, what was resharded and what changes."""
    def where(world, sp):
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        return f"{ranks} (sp {sp} x dp {world // sp})" if sp else ranks

    was, dp = saved["global_batch"], world_size // sp_size
    if (saved["world_size"], saved.get("sp_size"), was) == (world_size, sp_size, global_batch):
        return f"resumed step {saved['step']} on the layout that saved it: {where(world_size, sp_size)}, global batch {was}"
    old_dp = saved["world_size"] // saved["sp_size"] if saved.get("sp_size") else None
    state = ("ZeRO-3 state resharded" if saved["world_size"] != world_size
             else "ZeRO-3 state loaded as saved (the same partitions)")
    text = (f"resumed step {saved['step']} saved on {where(saved['world_size'], saved.get('sp_size'))} on "
            f"{where(world_size, sp_size)}: {state}, ")
    if was == global_batch:
        before = f"{old_dp} x ga {was // old_dp}" if old_dp else "as saved"
        return text + f"global batch {was} = {before} -> {dp} x ga {global_batch // dp} (the uninterrupted trajectory)"
    return text + (
        f"global batch {was} -> {global_batch} sequences per step (--global-batch): the data continues after the "
        f"{saved['position']} sequences consumed and the schedule at optimizer step {saved['step']}, so the steps from "
        f"here train {global_batch} sequences each and differ from the uninterrupted run's")


def latest_tag(out: Path) -> str:
    """The tag `latest` names (the newest complete checkpoint of `out`)."""
    return (out / CHECKPOINT_DIR / LATEST).read_text().strip()


def latest_checkpoint(out: Path) -> str | None:
    """The path of the newest complete checkpoint of `out`, or None."""
    return str(out / CHECKPOINT_DIR / latest_tag(out)) if (out / CHECKPOINT_DIR / LATEST).is_file() else None
