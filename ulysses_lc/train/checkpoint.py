"""Run state on disk: the output-directory policy, the run record, and checkpoints with RNG and data position.

A checkpoint is DeepSpeed's (model, optimizer, schedule) plus our client state: the step, the token
stream's position and every RNG, so that --resume continues the uninterrupted trajectory bit for bit.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
RUN_FILE = "run.json"


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


def check_output_dir(cfg, sp_size: int, world_size: int) -> Path:
    """Refuse to overwrite another run's checkpoints; on --resume, require the same run."""
    out = Path(cfg.output_dir)
    run_file = out / RUN_FILE
    has_ckpt = (out / CHECKPOINT_DIR / "latest").exists()
    if has_ckpt and not cfg.resume:
        raise ValueError(
            f"{out} already holds a checkpoint of a run; pass --resume to continue it, or choose another "
            "--output-dir (nothing is overwritten)."
        )
    if cfg.resume and not has_ckpt:
        raise ValueError(f"--resume: {out} holds no checkpoint to resume from; drop --resume to start a new run.")
    if cfg.resume and run_file.exists():
        saved = json.loads(run_file.read_text())
        # The ZeRO-3 partitions and the DP split of the data follow the world size and sp_size.
        now = {"model": cfg.model, "seq_len": cfg.seq_len, "data": cfg.data, "sp_size": sp_size, "world_size": world_size}
        for key, value in now.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"--resume: the checkpoint in {out} was trained with {key}={saved.get(key)!r}, not "
                    f"{value!r}; resume with the same settings (number of GPUs included) or use another --output-dir."
                )
    return out


def write_run_file(out: Path, cfg, sp_size: int, world_size: int) -> None:
    """Record what this run trains (checked by a later --resume). Rank 0 only."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps({**asdict(cfg), "sp_size": sp_size, "world_size": world_size}, indent=2))


def save_checkpoint(engine, out: Path, step: int, stream) -> None:
    """Collective: model, optimizer and schedule (DeepSpeed) plus step, data position and RNG."""
    engine.save_checkpoint(
        str(out / CHECKPOINT_DIR), tag=f"step{step}",
        client_state={"step": step, "data": stream.state_dict(), "rng": rng_state()},
    )


def load_checkpoint(engine, out: Path, stream) -> int:
    """Collective: restore the latest checkpoint into `engine` and `stream`, and the RNG; returns its step."""
    _, client = engine.load_checkpoint(str(out / CHECKPOINT_DIR))
    stream.load_state_dict(client["data"])
    set_rng_state(client["rng"])
    return client["step"]
