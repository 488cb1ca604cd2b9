"""The run's settings, resolved once at the top: the flags (on --resume over the saved run's) split into what each
part of the job takes.

`train(cfg)` and `dry_run(cfg)` build one `RunSettings` before anything else. Below it, each part takes its own
settings object (or the plain values in it), never the whole TrainConfig, and what is resolved here (the dtype, the
token cache's folder, the run folder a resume continues, the DPO reference, whether documents are packed) is not
derived again anywhere else. What needs the launch (sp_size, the global batch, the DeepSpeed config as checked, the
model config with its RoPE) is resolved next, by preflight.py, into `Checked`.

  model     ModelSettings   what loads and how it runs: name, dtype, RoPE, LoRA, attention kernel
  stream    StreamSettings  the training sequences: source, length, what shapes them (DataSettings), token cache
  parallel  ParallelSettings  sp size, placement, global batch (None: resolved from the launch)
  optim     OptimSettings   the DeepSpeed config, lr and its schedule, weight decay, steps, the divergence guard
  objective ObjectiveSettings  sft, or dpo with its loss and reference
  plan      PlanSettings    the memory plan's overrides and limits; the dry run's world
  output    OutputSettings  run folder, resume, checkpoints, export, logging, the kernel cache
  watch     WatchSettings   failure and stop timeouts (job_watch.py, stop.py)
  eval      EvalSettings    the evaluation at --seq-len, or None (evaluation.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.cache import default_cache_dir
from ..data.settings import DataSettings
from ..mixers.kernels import DOCUMENT_VARLEN_TOKENS
from .config import TrainConfig, as_check_failed
from .kernel_cache import kernel_cache_dir
from .resume import resolve
from .run_state import find_latest_run


@dataclass(frozen=True)
class ModelSettings:
    """What loads and how it runs. dtype: bf16 on GPUs, fp32 on CPU; a dry run sizes the GPU run (bf16)."""

    name: str
    dtype: torch.dtype
    seed: int  # random weights of the embedded models
    yarn_factor: float | None
    rope_scaling: str
    kernel: str
    attention_head_groups: int | str
    lora_r: int = 0  # 0: every weight trains
    lora_alpha: float | None = None
    lora_targets: str = "all"
    lora_dropout: float = 0.0


@dataclass(frozen=True)
class StreamSettings:
    """The training sequences. packed_documents: a sequence holds several documents (--packing, or DPO's two per pair);
    long_documents: DPO without --packing, each document long enough for its own kernel call (memory.step_terms)."""

    source: str
    seq_len: int
    shape: DataSettings  # what shapes samples and windows: the token cache's key
    cache_dir: Path
    packed_documents: bool
    long_documents: bool


@dataclass(frozen=True)
class ParallelSettings:
    sp_size: int | None  # None: every rank in one SP group
    placement: str
    global_batch: int | None  # None: one sequence per DP group (on --resume: the saved run's)


@dataclass(frozen=True)
class OptimSettings:
    """What the optimizer does; Schedule takes it (steps, warmup_steps, lr_schedule, min_lr_ratio)."""

    ds_config: str
    lr: float
    weight_decay: float
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    steps: int
    max_weight_growth: float = 1.0  # the divergence guard's bound (divergence.py); 0: off


@dataclass(frozen=True)
class ObjectiveSettings:
    """sft, or dpo with its loss; reference: "copy", "adapters" or "precomputed" (auto resolved), None for sft."""

    method: str
    dpo_beta: float
    dpo_loss: str
    dpo_label_smoothing: float
    reference: str | None

    @property
    def dpo(self) -> bool:
        return self.method == "dpo"


@dataclass(frozen=True)
class PlanSettings:
    """The memory plan's overrides (None: planned) and limits (None: this machine's); the dry run's world."""

    recompute_layers: int | None
    keep_on_gpu: int | None
    cache_attention_layers: int | None
    gpu_memory_gb: float | None
    host_memory_gb: float | None
    world_size: int | None
    gpus_per_node: int | None
    max_seq_len: bool

    @property
    def overrides(self) -> tuple:
        """MemoryPlan.with_overrides's arguments."""
        return self.recompute_layers, self.keep_on_gpu, self.cache_attention_layers

    def overridden(self) -> list[str]:
        """The flags that set the plan by hand, for the start-up block."""
        names = ("recompute_layers", "keep_on_gpu", "cache_attention_layers")
        return [f"--{n.replace('_', '-')}" for n, v in zip(names, self.overrides) if v is not None]


@dataclass(frozen=True)
class OutputSettings:
    """folder: --output-dir, or on --resume without it the latest run with a checkpoint; None: a new runs/ folder."""

    folder: Path | None
    resume: bool
    save_every: int
    keep_checkpoints: int
    export: bool
    export_merged: bool
    tensorboard: bool
    wandb_project: str | None
    kernel_cache: Path | None = None  # Triton's and inductor's caches (kernel_cache.py)


@dataclass(frozen=True)
class EvalSettings:
    """The evaluation at --seq-len (evaluation.py). source None: the held-out windows after the run's; every 0: at the
    end only; sequences None: one window per DP group; depths: the passkey's (empty: none)."""

    source: str | None
    every: int
    at_start: bool
    sequences: int | None
    depths: tuple[float, ...]

    def windows(self, dp_size: int) -> int:
        return self.sequences or dp_size

    def held_out(self, dp_size: int) -> int:
        """Windows to read from --data after the run's, for the evaluation (0: it has its own text)."""
        return 0 if self.source is not None else self.windows(dp_size)

    def due(self, step: int, steps: int) -> bool:
        """Whether the evaluation runs after step `step` (1-based) of `steps`."""
        return step == steps or (self.every > 0 and step % self.every == 0)


@dataclass(frozen=True)
class WatchSettings:
    node_timeout_s: float
    stop_grace_s: float


class RunSettings:
    """The flags resolved once: on --resume the saved run's settings where the flags do not name them (resume.py),
    checked (TrainConfig.check), then split into each part's settings.

    flags: the TrainConfig as resolved (what run.json records); given: as the command line gave it (what every rank
    must agree on); changed: a resume's named changes that apply, {field: (saved, now)}. CheckFailed (a ValueError)
    with the fix for flags no run can use.
    """

    def __init__(self, flags: TrainConfig):
        self.given = flags
        changed = {}
        folder = Path(flags.output_dir) if flags.output_dir else None
        with as_check_failed():  # a flag no run can use is a user mistake, agreed across ranks as every check is
            if flags.resume and not flags.dry_run:  # the saved run's settings first: its LoRA flags need not be repeated
                folder = folder or find_latest_run(flags.model)
                flags, changed = resolve(flags, folder)
            flags.check()
        self.flags, self.changed, self.dry_run, self.seed = flags, changed, flags.dry_run, flags.seed
        dpo = flags.method == "dpo"
        self.model = ModelSettings(
            flags.model, torch.bfloat16 if flags.dry_run or torch.cuda.is_available() else torch.float32, flags.seed,
            flags.yarn_factor, flags.rope_scaling, flags.kernel, flags.attention_head_groups, flags.lora_r,
            flags.lora_alpha, flags.lora_targets, flags.lora_dropout)
        self.stream = StreamSettings(
            flags.data, flags.seq_len,
            DataSettings(text_column=flags.text_column, data_config=flags.data_config, loss_on=flags.loss_on,
                         packing=flags.packing, long_samples=flags.long_samples, seed=flags.seed),
            Path(flags.cache_dir) if flags.cache_dir else default_cache_dir(),
            packed_documents=flags.packing or dpo,
            long_documents=dpo and not flags.packing and flags.seq_len >= 2 * DOCUMENT_VARLEN_TOKENS)
        self.parallel = ParallelSettings(flags.sp_size, flags.sp_placement, flags.global_batch)
        self.optim = OptimSettings(flags.ds_config, flags.lr, flags.weight_decay, flags.lr_schedule, flags.warmup_steps,
                                   flags.min_lr_ratio, flags.steps, flags.max_weight_growth)
        reference = None
        if dpo:
            reference = flags.dpo_reference if flags.dpo_reference != "auto" else "adapters" if flags.lora_r else "copy"
        self.objective = ObjectiveSettings(flags.method, flags.dpo_beta, flags.dpo_loss, flags.dpo_label_smoothing,
                                           reference)
        self.plan = PlanSettings(flags.recompute_layers, flags.keep_on_gpu, flags.cache_attention_layers,
                                 flags.gpu_memory_gb, flags.host_memory_gb, flags.world_size, flags.gpus_per_node,
                                 flags.max_seq_len)
        self.output = OutputSettings(folder, flags.resume, flags.save_every, flags.keep_checkpoints, flags.export,
                                     flags.export_merged, flags.tensorboard, flags.wandb_project,
                                     kernel_cache_dir(flags.kernel_cache, folder))
        self.watch = WatchSettings(flags.node_timeout_s, flags.stop_grace_s)
        self.eval = None  # no evaluation
        if flags.evaluates:
            from .evaluation import passkey_depths

            self.eval = EvalSettings(flags.eval_data, flags.eval_every, flags.eval_at_start, flags.eval_sequences,
                                     passkey_depths(flags.eval_passkey_depths))


__all__ = ["EvalSettings", "ModelSettings", "ObjectiveSettings", "OptimSettings", "OutputSettings", "ParallelSettings", "PlanSettings",
           "RunSettings", "StreamSettings", "WatchSettings"]
