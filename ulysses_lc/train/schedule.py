"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_lambda(cfg):
    """Multiplier of the base learning rate at optimizer step `step` (0-based): warmup, then the schedule.

    cfg: anything with steps, warmup_steps, lr_schedule and min_lr_ratio (a TrainConfig).
    """

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_schedule == "constant":
            return 1.0
        if cfg.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor
