"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor.

A resume with another --steps continues the schedule from the factor it had reached (`Schedule.extend`): the decay
is spanned again from there to the new last step, so the lr goes on without a jump. The extensions are kept with
each checkpoint (`Schedule.state_dict`), so a later resume rebuilds the same curve.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def _decay(kind: str, progress: float) -> float:
    """1 at progress 0, 0 at progress 1."""
    progress = min(1.0, max(0.0, progress))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """Multiplier of the base learning rate at optimizer step `step` (0-based): warmup, then the decay.

    optim: anything with steps, warmup_steps, lr_schedule and min_lr_ratio (settings.OptimSettings, a TrainConfig).
    extensions: (from_step, factor there, last step) of each resume that changed the number of steps, oldest first.
    """

    def __init__(self, optim, steps: int | None = None, extensions=()):
        self.kind, self.warmup, self.floor = optim.lr_schedule, optim.warmup_steps, optim.min_lr_ratio
        self.steps = optim.steps if steps is None else steps  # the first run's steps: the original curve
        self.extensions = [tuple(e) for e in extensions]

    @property
    def last_step(self) -> int:
        return self.extensions[-1][2] if self.extensions else self.steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        start, top, end = self.warmup, 1.0, self.steps
        for at, factor, last in self.extensions:
            if step >= at:
                start, top, end = at, factor, last
        if self.kind == "constant":
            return top
        progress = (step - start) / max(1, end - start)
        return self.floor + (top - self.floor) * _decay(self.kind, progress)

    def extend(self, step: int, steps: int) -> str | None:
        """Continue the curve from optimizer step `step` to `steps` steps in all; the line that says how, or None
        when `steps` is already the last step."""
        was = self.last_step
        if steps == was:
            return None
        factor = self(step)
        if step < self.warmup:  # the warmup goes on as it was; only the decay after it is spanned anew
            self.steps, self.extensions = steps, []
            return (f"--steps {was} -> {steps}: the warmup goes on, then the {self.kind} decay spans steps "
                    f"{self.warmup + 1}-{steps}")
        self.extensions.append((step, factor, steps))
        if self.kind == "constant":
            return f"--steps {was} -> {steps}: the constant schedule goes on (factor {factor:.3g} of --lr)"
        if factor <= self.floor + 1e-12:
            return (f"--steps {was} -> {steps}: the {self.kind} decay had reached its floor ({self.floor:g} x --lr) and "
                    f"stays there for steps {step + 1}-{steps}")
        return (f"--steps {was} -> {steps}: the {self.kind} decay continues from {factor:.3g} x --lr at step {step + 1} "
                f"(no jump), spanned anew down to {self.floor:g} x --lr at step {steps}")

    def state_dict(self) -> dict:
        return {"steps": self.steps, "extensions": [list(e) for e in self.extensions]}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.extensions = state["steps"], [tuple(e) for e in state["extensions"]]


def lr_lambda(optim):
    """The multiplier function of `optim`'s schedule, as torch.optim.lr_scheduler.LambdaLR takes it (no extensions)."""
    schedule = Schedule(optim)
    return lambda step: schedule(step)
