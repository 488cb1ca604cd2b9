"""Every check that costs seconds, run before any collective, tokenizing or weight loading.

Each rank runs `preflight` before any process waits on another. The inputs are the same on every rank, but what
they name may not be (a relative --data path or an output folder on node-local disks), so the loop then agrees on
every rank's outcome (job_watch.start) and every rank raises the first failing rank's `CheckFailed`: rank 0 reports
it and all exit (cli.main). Nothing is written by a refused run.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..composite import count_language_model_params, is_composite
from ..mixers.attention import check_model_for_ulysses
from ..data import parse_source
from ..parallel.ds_config import check_deepspeed_config, check_optimizer_block, load_deepspeed_config, resolve_precision
from ..parallel.layout import ParallelLayout
from ..peft_support import count_trainable_parameters, lora_config
from ..levers.yarn import plan_rope
from ..parallel.zero_reshard import check_complete
from .checkpoint_files import read_manifest, verify
from .loading import hub_offline, model_config_and_source
from .config import CheckFailed, as_check_failed
from .run_state import CHECKPOINT_DIR, check_output_dir, latest_tag, saved_layout
from .settings import RunSettings


# (flag, its TrainConfig field, the module it imports, the pyproject extra that installs it)
OPTIONAL_PACKAGES = (
    ("--tensorboard", "tensorboard", "torch.utils.tensorboard", "tensorboard"),
    ("--wandb", "wandb_project", "wandb", "wandb"),
    ("--lora-r", "lora_r", "peft", "peft"),
)


class AlreadyTrained(CheckFailed):
    """--resume of a run whose checkpoint already reached --steps: nothing to train, nothing written (cli.main says
    so and exits 0)."""


@dataclass
class Checked:
    """What the checks resolved from the settings and the launch, handed to the loop."""

    out: Path | None  # None: a new run directory, named once the ranks can agree on it
    ds_config: dict
    model_config: object  # YaRN applied
    sp_size: int
    world_size: int
    peft_config: object = None  # --lora-r: the peft LoraConfig the model gets
    # --lora-r: the adapters' parameters; a multimodal model's: its language model's (None: every parameter trains)
    trainable_params: int | None = None
    global_batch: int = 1  # sequences per optimizer step: dp_size x gradient accumulation
    saved: dict | None = None  # --resume: the checkpoint's layout (run_state.saved_layout)
    rope: str = ""  # what yarn.plan_rope did, for the start-up block
    config_note: str | None = None  # where a dry run read the config from, where not the hub or a folder

    @property
    def resharded(self) -> bool:
        """The checkpoint's ZeRO-3 state is cut for another world size (zero_reshard.py)."""
        return self.saved is not None and self.saved["world_size"] != self.world_size


def outcome(failure: BaseException | None) -> tuple[bool, str] | None:
    """What a rank tells the others of its checks: None (passed), or (a CheckFailed?, the message)."""
    if failure is None:
        return None
    described = str(failure) if isinstance(failure, ValueError) else f"{type(failure).__name__}: {failure}"
    return isinstance(failure, CheckFailed), described


def raise_agreed(failure: BaseException | None, outcomes: list, table) -> None:
    """Every rank's `outcome`, gathered (job_watch.start): where any failed, every rank raises the same CheckFailed,
    naming the first failing rank (`table`: a job_table.RankTable) unless every rank failed alike. A failing rank
    whose error is no check failure (a bug) raises its own instead, so its traceback prints where it happened."""
    failed = [r for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    first = failed[0]
    is_check, message = outcomes[first]
    if table.rank == first and not is_check:
        raise failure
    if all(o == outcomes[first] for o in outcomes):
        # every rank found the same: no rank to name; its own error keeps its kind (AlreadyTrained exits 0)
        raise failure if isinstance(failure, CheckFailed) else CheckFailed(message)
    others = f"; ranks {', '.join(map(str, failed))} failed their checks" if len(failed) > 1 else ""
    raise CheckFailed(message, origin=f"{table.where(first)}{others}")


def preflight(run: RunSettings, world_size: int) -> Checked:
    """Run every cheap check of `run` on `world_size` ranks; CheckFailed (a ValueError) names the fix."""
    with as_check_failed():
        return _preflight(run, world_size)


def _preflight(run: RunSettings, world_size: int) -> Checked:
    stream, model = run.stream, run.model
    sp_size = run.parallel.sp_size or world_size
    layout = ParallelLayout(world_size, sp_size)  # sizes only, no groups: ValueError when sp does not divide
    if stream.seq_len < sp_size:
        raise ValueError(f"--seq-len {stream.seq_len} is shorter than sp_size={sp_size}: each rank needs a token.")
    out = None if run.dry_run else _check_output(run.output)
    saved = saved_layout(out, int(os.environ.get("RANK", "0"))) if run.output.resume and out is not None else None
    if saved is not None and saved["step"] >= run.optim.steps:
        _refuse_trained(out, saved["step"], run.optim.steps)
    if saved is not None and saved["world_size"] != world_size:
        # Every old rank's ZeRO-3 file is read to reshard: missing ones fail here, on every rank, in seconds.
        check_complete(out / CHECKPOINT_DIR / latest_tag(out), saved["world_size"])
    global_batch = _global_batch(run.parallel.global_batch, layout, saved)
    # The loop, schedule and checkpoints count optimizer steps: global_batch sequences each, ga per DP group.
    ds_config = check_deepspeed_config(load_deepspeed_config(run.optim.ds_config), layout,
                                       gradient_accumulation_steps=global_batch // layout.dp_size)
    check_optimizer_block(resolve_precision(ds_config, model.dtype), run.optim.lr, run.optim.weight_decay)
    for flag, field, module, extra in OPTIONAL_PACKAGES:
        if getattr(run.flags, field):
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ValueError(f"{flag} needs the {extra} package ({e}); pip install 'ulysses_lc[{extra}]' or drop "
                                 f"{flag}.") from e
    source = parse_source(stream.source, seed=run.seed)  # a missing path or unknown source name
    if source.kind == "hub" and not run.dry_run and (offline := hub_offline()):
        # Its first rows are read before the weights load (data.check_source): without the hub that only fails later.
        raise ValueError(f"--data {stream.source} streams from the Hugging Face hub, which cannot be reached here "
                         f"({offline}); pass --data tiny (generated text) or local data files (.jsonl, .parquet, "
                         ".txt, or a folder of them).")
    if run.objective.dpo:
        from .preference_step import check_pair_source

        check_pair_source(stream)
    model_config, config_note = model_config_and_source(model.name, dry_run=run.dry_run)
    check_model_for_ulysses(model_config, sp_size)
    rope = plan_rope(model_config, stream.seq_len, model.yarn_factor, rope_scaling=model.rope_scaling, sp_size=sp_size)
    rope.apply(model_config)
    peft_config = trainable = None
    if model.lora_r:
        peft_config = lora_config(model.lora_r, model.lora_alpha, model.lora_targets, model.lora_dropout)
        # On the meta device, in seconds: a target the model does not have fails here, before any weight loads.
        _, trainable = count_trainable_parameters(model_config, peft_config)
    elif is_composite(model_config):  # the vision tower and projector stay frozen (composite.py)
        trainable = count_language_model_params(model_config)
    return Checked(out, ds_config, model_config, sp_size, world_size, peft_config, trainable, global_batch, saved,
                   rope.summary, config_note)


def _refuse_trained(out: Path, step: int, steps: int) -> None:
    """AlreadyTrained where `out`'s checkpoint at `step` reached --steps and every file of it checks against its
    manifest (a damaged one, or one without a manifest, is the load's to name: it resumes an older one and trains on)."""
    tag = out / CHECKPOINT_DIR / f"step{step}"
    if verify(tag) or read_manifest(tag) is None:
        return
    raise AlreadyTrained(
        f"{out} already reached step {step} (--steps {steps}): nothing to train, and its checkpoint, export and "
        f"run.json stay as they are. To train on, pass --resume with a larger --steps (e.g. --steps {step + steps}); "
        "the schedule then continues from the factor reached.")


def _global_batch(given: int | None, layout: ParallelLayout, saved: dict | None) -> int:
    """Sequences per optimizer step: --global-batch, else the resumed run's (so that its trajectory continues on any
    dp_size that divides it), else one per DP group. ValueError with the fix when dp_size does not divide it."""
    dp = layout.dp_size
    held = saved["global_batch"] if saved is not None else None
    global_batch = given or held or dp
    if global_batch % dp == 0:
        return global_batch
    fits = sorted({max(dp, global_batch // dp * dp), -(-global_batch // dp) * dp})
    options = " or ".join(f"--global-batch {n}" for n in fits)
    if given is None:
        raise ValueError(
            f"--resume: the run trained {held} sequences per optimizer step, which dp_size={dp} ({layout.world_size} "
            f"ranks / sp {layout.sp_size}) cannot split into equal shares. Keep the trajectory with a layout whose dp_size "
            f"divides {held} (another --sp-size or number of ranks), or change the global batch with {options}: the data "
            "then continues by sequences consumed and the schedule by optimizer step, so later steps differ from the "
            "uninterrupted run's.")
    raise ValueError(f"--global-batch {global_batch} is not a multiple of dp_size={dp} ({layout.world_size} ranks / sp "
                     f"{layout.sp_size}): every DP group trains the same number of sequences per step; pass {options}.")


def _check_output(output) -> Path | None:
    """The run folder (settings.OutputSettings.folder), checked: writable, and holding a checkpoint exactly when
    resuming. None: a new folder under runs/, named once the ranks agree on it."""
    if output.folder is None:
        _check_writable(Path("runs"), "the default runs/ folder")
        return None
    _check_writable(output.folder, f"--output-dir {output.folder}")
    return check_output_dir(output.folder, output.resume)


def _check_writable(out: Path, what: str) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} is a file, not a folder; pass a folder (it is created if missing).")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} cannot be created: {existing} is a file; pass another --output-dir.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what} is not writable ({existing} refuses writes); pass a folder you can write to.")
