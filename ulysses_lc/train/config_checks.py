"""The main job's flag checks: each setting no run can use, refused with the flag and the fix (TrainConfig.check)."""

from __future__ import annotations

import math
from dataclasses import fields

from ..mixers.explicit_attention import valid_head_groups
from ..parallel.layout import PLACEMENTS
from .evaluation import check_eval_flags
from .schedule import SCHEDULES

TINY_LR = 3e-3  # the embedded tiny models' default --lr (config.TINY_DEFAULTS)


def flag_of(field: str) -> str:
    """The command-line flag of a TrainConfig field."""
    return "--" + {"wandb_project": "wandb"}.get(field, field.replace("_", "-"))


def check_config(cfg) -> None:
    """ValueError naming the flag and the fix for a setting of `cfg` (a TrainConfig) no run can use."""
    if cfg.seq_len < 2:
        raise ValueError(f"--seq-len {cfg.seq_len} is too short: a step needs at least 2 tokens.")
    if cfg.steps < 1:
        raise ValueError(f"--steps {cfg.steps}: train at least one step.")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise ValueError(f"--global-batch {cfg.global_batch}: an optimizer step takes at least one sequence.")
    _check_numbers(cfg)
    if cfg.lr_schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule {cfg.lr_schedule!r}: pick constant, linear or cosine.")
    if cfg.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints {cfg.keep_checkpoints} must be >= 0 (0 keeps every checkpoint).")
    if cfg.save_every < 0:
        raise ValueError(f"--save-every {cfg.save_every} must be >= 0 (0 saves only at the end).")
    if not valid_head_groups(cfg.attention_head_groups):
        raise ValueError(f"--attention-head-groups {cfg.attention_head_groups!r}: give 'auto' or a whole "
                         "number >= 1.")
    for flag in ("gpu_memory_gb", "host_memory_gb"):
        value = getattr(cfg, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be positive (GB per GPU / per rank).")
    if cfg.sp_placement not in PLACEMENTS:
        raise ValueError(f"--sp-placement {cfg.sp_placement!r}: pick node (SP groups inside a node, DP across "
                         "nodes) or across (SP over nodes, DP inside each).")
    if cfg.gpus_per_node is not None and cfg.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {cfg.gpus_per_node} must be >= 1.")
    if cfg.node_timeout_s < 5:
        raise ValueError(f"--node-timeout-s {cfg.node_timeout_s:g} is too short: heartbeats come once a second, "
                         "and a loaded node may miss a few; give 5 or more (default 60).")
    if cfg.stop_grace_s <= 0:
        raise ValueError(f"--stop-grace-s {cfg.stop_grace_s:g} must be positive: the seconds a stop may take to "
                         "reach a step boundary and write its checkpoint (default 25, under launchers' 30).")
    if cfg.max_seq_len and not cfg.dry_run:
        raise ValueError("--max-seq-len sizes a run without loading it; add --dry-run.")
    if cfg.lora_r < 0 or (cfg.lora_r == 0 and "lora_r" in (cfg.flags_given or ())):
        raise ValueError(f"--lora-r {cfg.lora_r}: give the adapters' rank, >= 1 (e.g. 16); leave --lora-r out for "
                         "a full fine-tune of every weight.")
    lora_only = [f"--{f.replace('_', '-')}" for f in ("lora_alpha", "lora_dropout", "export_merged")
                 if getattr(cfg, f) not in (None, 0.0, False)]
    if not cfg.lora_r and lora_only:
        raise ValueError(f"{' and '.join(lora_only)} only {'apply' if len(lora_only) > 1 else 'applies'} to LoRA "
                         "adapters; add --lora-r (e.g. 16) to train them, or drop "
                         f"{'it' if len(lora_only) == 1 else 'them'} for a full fine-tune.")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"--lora-dropout {cfg.lora_dropout} must be in [0, 1).")
    _check_method(cfg)
    check_eval_flags(cfg.eval_every, cfg.eval_sequences, cfg.eval_passkey_depths, cfg.evaluates, cfg.method)
    for flag in ("keep_on_gpu", "recompute_layers", "cache_attention_layers"):
        value = getattr(cfg, flag)
        if value is not None and value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 0 (leave it out to plan from memory).")

def _check_numbers(cfg) -> None:
    """The float flags: finite (argparse takes inf and nan), and each in its range."""
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):  # inf trains one step, then stops with nothing to resume
        raise ValueError(f"--lr {cfg.lr:g} must be a positive finite number: the peak learning rate (default "
                         f"{type(cfg).lr:g}; the tiny models' {TINY_LR:g}).")
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            default = getattr(type(cfg), f.name, None)
            hint = f" (default {default:g})" if isinstance(default, (int, float)) else ""
            raise ValueError(f"{flag_of(f.name)} {value} is not a finite number: give a finite value{hint}.")
    if cfg.warmup_steps < 0:
        raise ValueError(f"--warmup-steps {cfg.warmup_steps} must be >= 0 (0: no warmup).")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio {cfg.min_lr_ratio:g}: the final lr as a fraction of --lr, in [0, 1].")
    if cfg.weight_decay < 0:
        raise ValueError(f"--weight-decay {cfg.weight_decay:g} must be >= 0 (0: none).")
    if cfg.max_weight_growth < 0:
        raise ValueError(f"--max-weight-growth {cfg.max_weight_growth:g} must be >= 0 (0 turns the divergence "
                         f"guard off; default {type(cfg).max_weight_growth:g}).")
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha {cfg.lora_alpha:g} must be positive (default 2 x --lora-r).")

def _check_method(cfg) -> None:
    if cfg.method not in ("sft", "dpo"):
        raise ValueError(f"--method {cfg.method!r}: pick sft or dpo.")
    dpo_flags = {"dpo_beta": 0.1, "dpo_loss": "sigmoid", "dpo_label_smoothing": 0.0, "dpo_reference": "auto"}
    if cfg.method != "dpo":
        changed = [f"--{k.replace('_', '-')}" for k, v in dpo_flags.items() if getattr(cfg, k) != v]
        if changed:
            raise ValueError(f"{', '.join(changed)} set up preference training; add --method dpo or drop them.")
        return
    from ..objectives.preference import PreferenceLoss

    PreferenceLoss(cfg.dpo_beta, cfg.dpo_loss, cfg.dpo_label_smoothing)  # its ValueError names the setting
    if cfg.dpo_reference not in ("auto", "copy", "adapters", "precomputed"):
        raise ValueError(f"--dpo-reference {cfg.dpo_reference!r}: pick auto, copy, adapters or precomputed.")
    if cfg.dpo_reference == "adapters" and not cfg.lora_r:
        raise ValueError("--dpo-reference adapters is the model with its LoRA adapters off: add --lora-r (e.g. "
                         "16), or use --dpo-reference copy for a full fine-tune.")
    if cfg.loss_on is not None or cfg.text_column is not None:
        raise ValueError("--method dpo trains the chosen and rejected completions of prompt / chosen / rejected "
                         "rows; drop --loss-on and --text-column.")
