"""--resume and the flags: each setting a resume does not name is the saved run's; each one it names and changes
either applies, with a line saying what changed, or is refused with the reason. None is ignored.

  resolve(cfg)         the settings of a resume, before any check: (the TrainConfig, {field: (was, now)} applied)
  check_kept(...)      ValueError for a change of what the checkpoint's state depends on (KEPT)
  change_lines(...)    the start-up lines of the applied changes (--steps: the schedule's own, schedule.py)
  record_resume(...)   run.json: the settings now, and one entry per resume (its step and changes)
  saved_settings(out)  what run.json holds

A run's settings are its run.json (written at the start, rewritten at each resume). From the command line only the
flags given are "named" (TrainConfig.flags_given); from code every field is, so a resume from code passes the
config of the run it continues.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from ..parallel.ds_config import load_deepspeed_config
from .config import TrainConfig, flag_of
from .run_state import RUN_FILE, SETTINGS

# What the checkpoint's state depends on: a change is refused, with why.
_DATA = "the data position counts windows of this data and its tokenization"
KEPT = {
    "model": "the weights continue from this model's",
    "seq_len": _DATA, "data": _DATA, "text_column": _DATA, "data_config": _DATA, "loss_on": _DATA,
    "packing": _DATA, "long_samples": _DATA,
    "seed": "the seed orders the data, and the RNG continues from the checkpoint's",
    "lora_r": "the adapters are the trained state", "lora_targets": "the adapters are the trained state",
    "lora_alpha": "the adapters' scale is part of what they learned",
    "lora_dropout": "the adapters trained with this dropout; a resume continues, it does not change the recipe",
    "yarn_factor": "the weights trained with these RoPE positions",
    "rope_scaling": "the weights trained with these RoPE positions",
    "ds_config": "the optimizer state was saved in this config's form (precision, optimizer, offload)",
    "lr_schedule": "the schedule continues from the checkpoint's; change --lr or --steps instead",
    "warmup_steps": "the schedule continues from the checkpoint's; change --lr or --steps instead",
    "min_lr_ratio": "the schedule continues from the checkpoint's; change --lr or --steps instead",
    "method": "the data position counts this method's sequences (pairs for dpo)",
    "dpo_beta": "the preference objective continues as it trained", "dpo_loss": "the preference objective continues "
    "as it trained", "dpo_label_smoothing": "the preference objective continues as it trained",
    "dpo_reference": "the rewards are measured against this reference",
}
# Applied from the resumed step on; the line says what changes (None: another module says it).
APPLIED = {
    "lr": "the schedule goes on at the new peak lr (the step's factor x the new --lr)",
    "steps": None,  # the schedule's extension says how (schedule.Schedule.extend)
    "weight_decay": "AdamW's weight decay from here",
    "max_weight_growth": "the divergence guard's bound from here",
    "save_every": "checkpoints from here", "keep_checkpoints": "checkpoints kept from here",
    "cache_dir": "the token cache folder (the tokens are the same)",
    "kernel_cache": "the kernel cache folder (the same kernels; tuned again where it lacks them)",
    "tensorboard": "TensorBoard logging from here", "wandb_project": "W&B reporting from here",
    "export": "the export at the end", "export_merged": "the export at the end",
    "node_timeout_s": "the failure watch", "stop_grace_s": "how long a stop may take",
    "kernel": "the same attention by another kernel", "attention_head_groups": "the same attention, grouped otherwise",
    "keep_on_gpu": "the memory plan", "recompute_layers": "the memory plan",
    "cache_attention_layers": "the memory plan",
    # The held-out evaluation text follows the windows the run reads, so training reads the same data either way.
    "eval_data": "the evaluation from here", "eval_every": "the evaluation from here",
    "eval_at_start": "the evaluation from here", "eval_sequences": "the evaluation from here",
    "eval_passkey_depths": "the evaluation from here",
}
# DeepSpeed config keys that a resume applies, with a line: by DeepSpeed's config reference
# (https://www.deepspeed.ai/docs/config-json/, docs/_pages/config-json.md in its repository) they are logging,
# profiling and monitoring ("Logging", "Flops Profiler", "Monitoring Module", "Communication Logging"), or how ZeRO-3
# schedules the same gathers and reductions (bucket sizes, prefetch, overlap, which small parameters stay whole):
# memory and speed, not values. Every other key (the ZeRO stage, precision, the optimizer and its offload, gradient
# clipping, the batch, the data types, ...) stays refused: it changes what is trained or the optimizer state's form.
DS_APPLIED = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler", "tensorboard",
    "wandb", "csv_monitor", "comet", "comms_logger", "timers",
    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
    "zero_optimization.allgather_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
}
# Applied too; the resume line says what was resharded or changed (run_state.resume_line).
LAYOUT = ("sp_size", "sp_placement", "global_batch")
# How this launch runs, not what the run is: never taken from the saved run.
INVOCATION = ("output_dir", "resume", "dry_run", "world_size", "gpus_per_node", "gpu_memory_gb", "host_memory_gb",
              "max_seq_len", "flags_given")


def resolve(cfg: TrainConfig, out: Path | None) -> tuple[TrainConfig, dict]:
    """cfg with every setting it does not name taken from `out`'s run.json, and the named changes that apply, as
    {field: (saved, now)}. ValueError for a change of a KEPT setting. Not a resume, or no run.json: cfg as it is."""
    saved = saved_settings(out) if cfg.resume and out is not None else None
    if saved is None:
        return cfg, {}
    named = set(f.name for f in fields(cfg)) if cfg.flags_given is None else set(cfg.flags_given)
    taken = {f.name: saved[f.name] for f in fields(cfg)
             if f.name in saved and f.name not in named and f.name not in INVOCATION + LAYOUT}
    cfg = replace(cfg, **taken)
    ds_changed = check_kept(cfg, saved, out)
    changed = {f: (saved[f], getattr(cfg, f)) for f in APPLIED if f in saved and saved[f] != getattr(cfg, f)}
    return cfg, {**changed, **({SETTINGS: ds_changed} if ds_changed else {})}


def check_kept(cfg: TrainConfig, saved: dict, out: Path) -> tuple[dict, dict] | None:
    """ValueError naming the first KEPT setting of `cfg` that differs from the saved run's. The DeepSpeed config is
    compared by what it holds (run.json keeps it), not by its name: the same file moved is no change, a file
    edited since the run started is one, applied where it only changes DS_APPLIED keys: returned as
    ({key: saved}, {key: now}), dotted keys (None: no change)."""
    before_lora = {"lora_r": 0, "lora_targets": "all"}  # a run.json written before the LoRA flags
    ds_changed = None
    if SETTINGS in saved:
        now = load_deepspeed_config(cfg.ds_config)
        differ = _differences(saved[SETTINGS], now)
        kept = [(key, was, new) for key, was, new in differ if not _ds_applied(key)]
        if kept:
            shown = "; ".join(f"{key}: {was!r} -> {new!r}" for key, was, new in kept[:4])
            raise ValueError(
                f"--resume: the checkpoint in {out} was trained with another DeepSpeed config than --ds-config "
                f"{cfg.ds_config} holds now ({shown}); put the saved settings back (run.json's {SETTINGS} holds "
                f"them) or use another --output-dir (the DeepSpeed config cannot change on a resume: "
                f"{KEPT['ds_config']}; only logging, profiling and ZeRO's bucket and prefetch sizes can).")
        if differ:
            ds_changed = ({key: was for key, was, _ in differ}, {key: new for key, _, new in differ})
        saved = {**saved, "ds_config": cfg.ds_config}
    for field, why in KEPT.items():
        was = saved.get(field, before_lora.get(field, getattr(cfg, field)))
        if was != getattr(cfg, field):
            raise ValueError(
                f"--resume: the checkpoint in {out} was trained with {field}={was!r}, not {getattr(cfg, field)!r}; "
                f"resume with the same settings or use another --output-dir ({flag_of(field)} cannot change on a "
                f"resume: {why}).")
    return ds_changed


def _ds_applied(key: str) -> bool:
    """Whether a resume applies a change of the DeepSpeed config at dotted `key` (itself or a block it is in)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in DS_APPLIED for n in range(1, len(parts) + 1))


def _differences(was, now, key: str = "") -> list[tuple]:
    """The settings two configs differ in, as (dotted key, was, now) (absent where one lacks the key)."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [d for k in sorted(set(was) | set(now), key=str)
                for d in _differences(was.get(k, _ABSENT), now.get(k, _ABSENT), f"{key}.{k}" if key else k)]
    return [] if was == now else [(key, was, now)]


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def change_lines(changed: dict) -> list[str]:
    """One line per applied change whose line is said here."""
    lines = []
    for field, (was, now) in changed.items():
        if field == SETTINGS:
            shown = ", ".join(f"{key} {was[key]!r} -> {now[key]!r}" for key in was)
            lines.append(f"--ds-config on resume: {shown}: logging, or how ZeRO schedules the same gathers and "
                         "reductions (the trained values do not change)")
        elif APPLIED[field] is not None:
            lines.append(f"{flag_of(field)} {was!r} -> {now!r} on resume: {APPLIED[field]}")
    return lines


def record_resume(out: Path, cfg: TrainConfig, step: int, changed: dict, sp_size: int, world_size: int) -> None:
    """Rewrite run.json with the settings now and one more entry in its "resumes". One rank per folder."""
    saved = saved_settings(out) or {}
    entry = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sp_size": sp_size, "world_size": world_size,
             "changed": {f: [was, now] for f, (was, now) in changed.items()}}
    record = {**asdict(cfg), SETTINGS: load_deepspeed_config(cfg.ds_config), "sp_size": sp_size,
              "world_size": world_size, "resumes": [*saved.get("resumes", []), entry]}
    tmp = out / ".run.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=repr))  # repr: a DeepSpeed key absent on one side
    tmp.replace(out / RUN_FILE)  # a crash leaves the old record or the new one, never half


def saved_settings(out: Path) -> dict | None:
    """The settings in `out`'s run.json, or None."""
    run_file = out / RUN_FILE
    return json.loads(run_file.read_text()) if run_file.is_file() else None


def _classified() -> None:
    every = set(KEPT) | set(APPLIED) | set(LAYOUT) | set(INVOCATION)
    missing = [f.name for f in fields(TrainConfig) if f.name not in every]
    assert not missing, f"TrainConfig fields without a rule on --resume (resume.py): {missing}"


_classified()
