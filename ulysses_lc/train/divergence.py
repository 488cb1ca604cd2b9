"""A step that went wrong stops the run before its checkpoint, naming one that a resume goes on from, or the command
that starts the run again.

A step goes wrong three ways, each found at the step, before its checkpoint is written (`StepGuard`):
  - its loss or gradient norm is not finite. Both come from the weights the step started from (and the step's data,
    the same on a resume): a resume from the checkpoint of the step before meets the same numbers again, whatever its
    --lr. That checkpoint is not good; the good one is the newest before it, and `latest` is pointed at it so that
    --resume takes it (the other stays on disk, unused).
  - its update blew the weights up: the trained weights' norm grew past (1 + --max-weight-growth) x its norm before
    the step (`WeightGuard`). The weights are finite, so nothing else stops the run there: the next step's gradient
    overflows, and a checkpoint of this step would resume straight into that. The checkpoint before the step is good:
    its loss and gradient were finite, and a lower --lr makes a smaller update.
  - its update left inf or NaN in the weights or optimizer state (checkpoint_files.finite_state, at a save): as above.
The advice names the case's way on: with a good checkpoint, --resume with a lower --lr (which a resume applies:
loop._apply_lr); without one, the run's own flags with a lower --lr, which start it again.

The guard's measure. Adam moves each trained weight by about lr a step (its first step by lr x sign(g) exactly), so
the update is ||dw|| ~ lr sqrt(N) over N weights, nearly orthogonal to w: the norm grows by sqrt(1 + (lr / rms(w))^2)
- 1 a step. Measured on the embedded tiny model (115k weights of rms 0.061, its norm layers' ones weighing in; 4 steps
at --seq-len 256, warmup 1): lr 3e-3, its default, grows the norm by 1.3e-3 at step 1 and at most 2.2e-3 a step; lr
1e-2 by at most 0.02, 3e-2 by 0.13; 1e30 to inf (float32's norm overflows). A large model's weights are of rms ~0.02
(the initializer_range of Qwen and Llama configs): a fine-tune's lr 1e-5 grows its norm by ~1e-7 a step. The default
bound, 1 (the norm doubled in one step), is 450 times the tiny default's growth and ~1e7 times a fine-tune's; it trips
from lr ~ sqrt(3) x rms(w) (0.035 for weights of rms 0.02), where each step moves every weight by more than its own
size. The growth is a lower bound of the update's size, ||dw|| / ||w|| (triangle inequality), measured without a copy
of the weights: one pass over each rank's ZeRO-3 partition a step (in float32: a float64 norm would copy it), and one
all-reduce of one number.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint_files import MANIFEST, agree_on_write, finite_state, write_failure
from .config import TINY_DEFAULTS, TrainConfig, as_flags
from .run_state import CHECKPOINT_DIR, LATEST, latest_tag, point_latest
from ..tiny import TINY_MODELS


class NonFiniteError(RuntimeError):
    """A step's loss, gradient norm or state went inf/NaN, or its update blew the weights up: the run stops before
    saving it; the message names the last good checkpoint and how to go on."""


def trained_norm(engine, group) -> float:
    """Collective over `group`: the norm of the weights the optimizer trains (its fp32 copy), every rank's ZeRO-3
    partition's squares summed. A rank's partitions may sit on the host (an offloaded optimizer)."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None:  # no ZeRO-3 wrapper: the torch optimizer holds the weights themselves
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        flats = [p for group_ in inner.param_groups for p in group_["params"]]
    squares = torch.zeros((), dtype=torch.float64, device=engine.device)
    for flat in flats:
        if flat is not None:  # None: a sub-group swapped out to NVMe, which the guard does not read
            squares += torch.linalg.vector_norm(flat.detach()).to(squares.device, torch.float64) ** 2
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    return math.sqrt(float(squares))


class WeightGuard:
    """The trained weights' norm before and after each step; `grew` says when an update blew them up (module
    docstring). bound: --max-weight-growth (0: off, nothing measured)."""

    def __init__(self, engine, group, bound: float):
        self.engine, self.group, self.bound = engine, group, bound
        self.norm = trained_norm(engine, group) if bound else None

    def grew(self) -> str | None:
        """Collective, after the step's update: how it blew the weights up, or None."""
        if not self.bound:
            return None
        before, self.norm = self.norm, trained_norm(self.engine, self.group)
        if before > 0 and not self.norm <= (1 + self.bound) * before:  # NaN trips too
            after = f"{self.norm:.4g} (x{self.norm / before:.3g}" if math.isfinite(self.norm) else \
                f"{self.norm} (past float32's range" if self.norm == math.inf else "nan (non-finite weights"
            return (f"its update grew the trained weights' norm from {before:.4g} to {after}; --max-weight-growth "
                    f"{self.bound:g} allows x{1 + self.bound:g})")
        return None


class StepGuard:
    """Each step's checks before its checkpoint (module docstring); each failing one raises NonFiniteError with the
    advice, on every rank together. Built after the weights (and a resume's checkpoint) loaded.

    out: the run folder; run: settings.RunSettings; writes: whether this rank writes the folder's `latest`
    (files.folder_owner)."""

    def __init__(self, engine, layout, out: Path, run, writes: bool):
        self.engine, self.out, self.run, self.writes = engine, out, run, writes
        self.weights = WeightGuard(engine, layout.world_group, run.optim.max_weight_growth)

    def after_step(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Collective: the step's loss and gradient norm (the same on every rank), then its update's size."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            raise self._stop(step, f"loss {loss}, grad_norm {grad_norm}: not finite", weights_led=True)
        grew = self.weights.grew()
        if grew:
            norm = "-" if grad_norm is None else f"{grad_norm:.4g}"
            raise self._stop(step, f"loss {loss:.4g}, grad_norm {norm}, but {grew}", weights_led=False)

    def before_save(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Collective, at a save: the state about to be saved is finite (the guard reads the weights only, and not
        with --max-weight-growth 0; the optimizer's moments can overflow too)."""
        if not finite_state(self.engine):
            raise self._stop(step, f"loss {loss}, grad_norm {grad_norm}, but the update left non-finite values in the "
                             "weights or optimizer state", weights_led=False)

    def _stop(self, step: int, why: str, weights_led: bool) -> NonFiniteError:
        """Collective: the error to raise at `step`. weights_led: the step's own numbers went wrong, so the weights
        it started from are not good (module docstring)."""
        good = last_good(self.out, step - 2 if weights_led else step - 1)
        ckpt_dir = self.out / CHECKPOINT_DIR
        moved = good is not None and good != _latest(self.out)
        failed = None
        if moved and self.writes:
            try:
                point_latest(ckpt_dir, good)
            except OSError as e:
                failed = write_failure(ckpt_dir / LATEST, e, None)
        agree_on_write(failed)
        lr = self.run.optim.lr
        # A value the command can carry as it is: a tenth, and no more than the model's default (from --lr 1e30, a
        # tenth would blow up again).
        lower = min(lr / 10, TINY_DEFAULTS["lr"] if self.run.model.name in TINY_MODELS else TrainConfig.lr)
        message = f"step {step}: {why}; the run stops without saving this step. "
        if moved:
            message += (f"The checkpoint of step {step - 1} led to this step (a resume from it meets the same "
                        f"numbers again): `latest` now names {good}, the one before (step {step - 1}'s stays on disk, "
                        "unused). ")
        if good is not None:
            return NonFiniteError(
                message + f"Last good checkpoint: {ckpt_dir / good}. Lower --lr (now {lr:g}) and check the data; "
                f"then continue from it with --resume --output-dir {self.out} --lr {lower:g} (a new --lr applies on "
                "resume).")
        held = _latest(self.out) is not None
        return NonFiniteError(
            message + "Last good checkpoint: none" + (f" (step {step - 1}'s led to this step)" if held else "")
            + f". Lower --lr (now {lr:g}) and start the run again, with your launcher and script as before: "
            + self._again(lower, held))

    def _again(self, lr: float, held: bool) -> str:
        """The flags that start the run again at `lr`: its own (a resumed run's in full), in a new folder where this
        one holds a checkpoint (a run folder without one takes the new run)."""
        flags = self.run.flags
        given = None if flags.resume or flags.flags_given is None else {*flags.flags_given, "lr"}
        folder = flags.output_dir
        if folder is not None and held:
            n = 1
            while Path(f"{folder}.{n}").exists():
                n += 1
            folder = f"{folder}.{n}"
        return as_flags(replace(flags, lr=lr, resume=False, output_dir=folder, 
                                  flags_given=None if given is None else tuple(sorted(given))))


def last_good(out: Path, step: int) -> str | None:
    """The newest complete checkpoint of `out` at or before `step`: `latest`, or an older tag with its manifest (one
    that a save finished); None: none."""
    newest = _latest(out)
    if newest is None or int(newest.removeprefix("step")) <= step:
        return newest
    ckpt_dir = out / CHECKPOINT_DIR
    steps = [int(p.name[4:]) for p in ckpt_dir.glob("step*") if p.name[4:].isdigit() and (p / MANIFEST).is_file()]
    kept = [s for s in steps if s <= step]
    return f"step{max(kept)}" if kept else None


def _latest(out: Path) -> str | None:
    return latest_tag(out) if (out / CHECKPOINT_DIR / LATEST).is_file() else None
