"""Resume a ZeRO-3 checkpoint on another number of ranks, through DeepSpeed's universal checkpoint.

ZeRO-3 cuts every parameter, its fp32 master and its Adam moments into one slice per rank of the
sequence-data-parallel group, which under our mpu is every rank (layout.py): a checkpoint of W ranks holds W
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt` files of those slices, named by that rank. The SP size plays no
part in the cut, so a change of sp_size at the same world size loads the files as they are (DeepSpeed's own
load); only a change of world size needs the state cut again. That is done here with DeepSpeed's universal
checkpoint: the W files are converted once into one file per parameter and state (`<tag>/universal/zero/
<name>/{fp32,exp_avg,exp_avg_sq}.pt`, plus the optimizer's step and hyperparameters), and an engine built with
`checkpoint.load_universal` reads, for each of its parameters, its own slice of those. DeepSpeed restores the
LR scheduler, its step counters and every rank's model_states client state as in a plain load.

Why DeepSpeed's format rather than our own consolidation: measured on DeepSpeed 0.19.8 on CPU, it restores the
trajectory of the uninterrupted run on 1, 4 (sp 4) and 4 (sp 2 x dp 2) ranks from 2 ranks at sp 2 with our SP
mpu unchanged, LoRA runs saved without their frozen weights included (those come from the model, as on any
resume), and it carries optimizer internals (sub-groups, offloaded state, the Adam step) that a consolidation of
our own would have to follow through DeepSpeed's private attributes. Its costs: the conversion writes the state
a second time (12 bytes per trainable parameter: ~98 GB for Qwen3-8B) and runs on one process, rank 0, while
the other ranks wait on the file system rather than in a collective that would time out (NCCL: 10 min). It is
done once per checkpoint and kept inside the tag's folder (pruned with it), so a second resume reuses it. The
conversion needs every old rank's files in one folder: a checkpoint on node-local disks must be gathered first.

The RNG: every rank's checkpoint client state comes from old rank 0's file (DeepSpeed reads one model_states
file in universal mode), so every new rank continues from old rank 0's RNG; nothing maps old ranks' streams onto
a new layout. The training path draws no random numbers except LoRA dropout.

Contract, for a loop of your own (the training loop, `train.run_state`, does exactly this):

    tag_dir = Path(save_dir) / tag
    resharded = saved_partitions(tag_dir) != torch.distributed.get_world_size()
    if resharded:
        ds_config = universal_config(ds_config)              # before deepspeed.initialize
    engine, *_ = deepspeed.initialize(..., config=ds_config, mpu=layout.mpu)
    if resharded:
        client_state = load_resharded(engine, tag_dir)      # collective; the first call converts (rank 0)
    else:
        _, client_state = engine.load_checkpoint(save_dir, tag)
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist

UNIVERSAL = "universal"  # the converted copy, inside the tag's folder
_FAILED = ".universal.failed"  # rank 0's conversion error, for the ranks that wait on the file system
GATHER_FIX = ("gather the checkpoint folder onto one file system that every rank reads (e.g. copy each node's "
              "files of this tag into one folder and pass it with --output-dir), then resume again")


def model_states_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states_names(rank: int) -> tuple[str, str]:
    """The file of rank `rank`'s ZeRO-3 slices: DeepSpeed prefixes `bf16_` when the run trained in bf16."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def read_model_states(tag_dir: Path, rank: int | None = None) -> dict:
    """One rank's model_states file of a tag (memory-mapped; small under ZeRO-3): its DeepSpeed bookkeeping
    (`dp_world_size`, `ds_config`, `global_steps`) and the client state saved with it.

    rank: whose file (None: any present, since they agree on everything but the RNG); ValueError if missing.
    """
    tag_dir = Path(tag_dir)
    path = tag_dir / model_states_name(rank) if rank is not None else next(
        iter(sorted(tag_dir.glob(model_states_name("*")))), None)
    if path is None or not path.is_file():
        raise ValueError(f"the checkpoint {tag_dir} has no {model_states_name('*' if rank is None else rank)}: "
                         f"it is incomplete or not a DeepSpeed ZeRO-3 checkpoint; {GATHER_FIX}.")
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def saved_partitions(tag_dir: Path) -> int:
    """How many ZeRO-3 slices the checkpoint's state is cut into: the world size of the run that saved it."""
    return int(read_model_states(tag_dir)["dp_world_size"])


def check_complete(tag_dir: Path, partitions: int | None = None) -> None:
    """ValueError naming every file of the old ranks missing from `tag_dir`, with the fix.

    A conversion reads all of them; on node-local disks each node holds only its own ranks' files.
    """
    tag_dir = Path(tag_dir)
    partitions = saved_partitions(tag_dir) if partitions is None else partitions
    bf16 = any(tag_dir.glob(optim_states_names("*")[1]))  # name a missing file as the present ones are named
    missing = []
    for r in range(partitions):
        if not (tag_dir / model_states_name(r)).is_file():
            missing.append(model_states_name(r))
        if not any((tag_dir / name).is_file() for name in optim_states_names(r)):
            missing.append(optim_states_names(r)[bf16])
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(
            f"resuming on another number of ranks reads the ZeRO-3 files of all {partitions} ranks that saved "
            f"{tag_dir}, and {len(missing)} are not there ({shown}): the checkpoint was written to disks that are not "
            f"shared (each node holds only its own ranks' files) or was copied in part; {GATHER_FIX}.")


def universal_config(ds_config: dict) -> dict:
    """A copy of `ds_config` whose engine loads universal checkpoints (`load_resharded`); saving is unchanged."""
    config = dict(ds_config)
    config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    return config


def convert(tag_dir: Path, workers: int = 1) -> Path:
    """Convert a ZeRO-3 tag to a universal checkpoint at `<tag_dir>/universal` (once: kept for later resumes).

    Not collective: one process (rank 0) calls it. Written to a temporary folder and renamed, so a crash
    mid-way leaves no half-converted copy that a later resume would take. workers > 1 runs DeepSpeed's process
    pools (fork: from a process holding communicator threads, safest outside a training job).
    """
    from deepspeed.checkpoint import ds_to_universal

    tag_dir = Path(tag_dir)
    final = tag_dir / UNIVERSAL
    if final.is_dir():
        return final
    check_complete(tag_dir)
    tmp = tag_dir / f".{UNIVERSAL}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    args = Namespace(input_folder=str(tag_dir), output_folder=str(tmp), num_extract_workers=workers,
                     num_merge_workers=workers, keep_temp_folder=False, strict=True,
                     # our checkpoints carry no Megatron-style universal_checkpoint_info; ZeRO-3 needs none of it
                     inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):  # its prints and progress bars
            ds_to_universal.main(args)
    except Exception as e:
        raise RuntimeError(f"DeepSpeed's universal conversion of {tag_dir} failed: {e}\n{log.getvalue()[-2000:]}") from e
    finally:
        (tag_dir / "latest_universal").unlink(missing_ok=True)  # it points at the temporary folder's name
    os.replace(tmp, final)
    return final


def load_resharded(engine, tag_dir: Path, load_module_strict: bool = True, poll_s: float = 1.0) -> dict:
    """Collective: load the ZeRO-3 tag `tag_dir` of any world size into `engine`; returns the client state.

    The engine must have been built from `universal_config(ds_config)`. Rank 0 converts the tag unless a
    converted copy exists; the other ranks wait for it on the file system (a conversion of a large model takes
    minutes, longer than a collective's timeout), then every rank reads its own slices.
    load_module_strict: False for a checkpoint saved without frozen parameters (LoRA: exclude_frozen_parameters).
    """
    if not engine.load_universal_checkpoint():
        raise ValueError("load_resharded needs an engine built from universal_config(ds_config) (DeepSpeed's "
                         "checkpoint.load_universal); build the engine with it, or load with engine.load_checkpoint "
                         "at the world size that saved the checkpoint.")
    tag_dir = Path(tag_dir)
    final, failed = tag_dir / UNIVERSAL, tag_dir / _FAILED
    if dist.get_rank() == 0:
        failed.unlink(missing_ok=True)  # a failure of an earlier attempt
    dist.barrier()  # nobody reads the failure marker before rank 0 removed an old one
    if dist.get_rank() == 0:
        try:
            convert(tag_dir)
        except BaseException as e:
            failed.write_text(str(e))
            raise
    else:
        delay = min(0.05, poll_s)  # soon at first (a small model converts in a second), then every poll_s at most
        while not final.is_dir():
            if failed.is_file():
                raise RuntimeError(f"rank 0 could not convert {tag_dir} (its report says why): "
                                   f"{failed.read_text().splitlines()[0]}")
            time.sleep(delay)
            delay = min(2 * delay, poll_s)
    _, client = engine.load_checkpoint(str(tag_dir), tag=UNIVERSAL, load_module_strict=load_module_strict)
    if client is None:
        raise ValueError(f"DeepSpeed read no checkpoint from {final}; delete that folder (a conversion is "
                         "redone from the tag's files) and resume again.")
    _untie_steps(engine.optimizer)
    return client


def _untie_steps(optimizer) -> None:
    """Give each ZeRO-3 sub-group's optimizer state its own `step` tensor. DeepSpeed 0.19.8's universal load hands
    every sub-group one and the same tensor (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3), which
    torch's Adam increments in place once per sub-group and step: with two sub-groups (the weight-decay and exempt
    groups, train/optimizer.py, or a model past sub_group_size) the later one's bias correction ran a step ahead
    (the resharded resume's second loss 2.2e-5 off the uninterrupted run's, tests/test_reshard.py). It also gives
    every group group 0's hyperparameters; the training loop sets lr and weight decay again after the load."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
