"""Train through Hugging Face's `Trainer` or TRL's `SFTTrainer`: one class swap, the script stays a Trainer script.

    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer, ulysses_trainer
    trainer = UlyssesTrainer(model=model, args=TrainingArguments(..., deepspeed=load_deepspeed_config("zero3")),
                             train_dataset=ds, data_collator=collator, sp_size=2, seq_len=131072)
    trainer = ulysses_trainer(SFTTrainer)(model=model, args=SFTConfig(..., deepspeed=...), ...)   # TRL
    trainer = ulysses_trainer(DPOTrainer)(model=model, ref_model=ref, args=DPOConfig(...), ...)  # TRL DPO: hf_dpo.py

What the subclass changes, each through the Trainer's own overridable methods:
  - the model: after the parent's __init__ (which TRL uses to prepare the model and the dataset) the HF model is
    wrapped in `SequenceParallelCausalLM` (Ulysses attention, chunked loss, tiled MLP, offloaded checkpoints);
  - the data: one sampler per DP rank (every rank of an SP group reads the SAME sequence), batches of one
    sequence, sharded on the host by `shard_batch` in the collate function (`ShardingCollator`); packed
    documents (a `document_lengths` column, or position ids restarting per document, as TRL's packing and
    padding_free produce) train as separate documents;
  - DeepSpeed: `deepspeed.initialize` gets `layout.mpu` (accelerate passes an mpu only on its own sequence-parallel
    path, which would install DeepSpeed's attention; so for the span of train/evaluate/predict the function is
    wrapped to add ours, and `train_batch_size` is counted over the DP axis as DeepSpeed then expects);
  - the memory plan: `SequenceParallelCausalLM.plan_step` at the first training step, once ZeRO-3 has allocated its
    partitions;
  - the loss: the wrapper's loss, the same on every SP rank; logs and `evaluate()` average it over ranks, so they
    report the loss, not sp_size times it.

Loss normalisation, the Trainer's own (docs/weighting.md): tokens weigh the same, not sequences. As for a
transformers model that takes `num_items_in_batch`, the Trainer counts the valid labels of the optimizer step's
micro batches (`_get_num_items_in_batch`, here over the SP slices' shifted labels, so the SP group's sum is a
sequence's count), summed over DP ranks under `average_tokens_across_devices` (the default); the wrapper divides each
sequence's summed token losses by that count, and `compute_loss` multiplies by the DP size where the Trainer multiplies
by its world size (ZeRO-3 averages over every rank, but an SP group's ranks already hold the sequence's sum, layout.py),
with no division by the accumulation steps. TRL's DPO keeps its per-pair mean (hf_dpo.py).

Refused at construction, with the fix (`check_trainer_setup`): no DeepSpeed ZeRO-3 config, accelerate's own
sequence parallelism, Liger or hub kernels, a loss from logits (compute_loss_func, label smoothing, TRL's dft
loss, compute_metrics), more than one sequence per device batch, the Trainer's gradient checkpointing, and TRL's
"wrapped" packing (it cuts documents without boundaries).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..composite import save_model
from ..mixers.attention import check_model_for_ulysses
from ..constants import IGNORE_INDEX
from ..data import pad_token_id
from ..parallel.ds_config import check_deepspeed_config
from ..parallel.distributed import init_distributed, seed_step
from ..parallel.layout import ParallelLayout
from .trainer_checks import check_trainer_setup
from .trainer_engine import check_engine_mpu, deepspeed_initialize_with_mpu
from ..model import SequenceParallelCausalLM
from ..objectives.loss import step_num_items
from ..shape import text_config
from ..parallel.sharding import document_lengths_from_positions, shard_batch

logger = logging.getLogger(__name__)

# Columns the sharding collate function reads; the Trainer's column filter keeps them.
SEQUENCE_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", "document_lengths")


class ShardingCollator:
    """The Trainer's collate function, then `shard_batch`: this rank's slice of one whole sequence.

    Runs on the host (in dataloader workers where there are any), where shard_batch's checks cost no device sync.
    Returns input_ids, labels (shifted), position_ids, cu_seqlens as a tuple of ints (the Trainer moves
    tensors to the device; the attention reads the boundaries on the host) and, where there is padding, token_mask.
    layout: only sp_size and sp_rank are read (a group-free copy travels to worker processes).
    """

    def __init__(self, collator, layout: ParallelLayout, vocab_size: int, pad_token_id: int):
        self.collator = collator
        self.layout = layout.without_groups()
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        if len(examples) != 1:
            raise ValueError(f"a batch of {len(examples)} sequences: ulysses_lc trains one sequence per device batch; "
                             "set per_device_train_batch_size=1 and per_device_eval_batch_size=1.")
        example = dict(examples[0])
        lengths = example.pop("document_lengths", None)
        batch = self.collator([example])
        input_ids = batch["input_ids"].reshape(1, -1)
        labels = batch.get("labels")
        labels = input_ids.clone() if labels is None else labels.reshape(1, -1).clone()
        mask = batch.get("attention_mask")
        if mask is not None:
            mask = mask.reshape(-1)
            valid = int(mask.sum())
            if not bool(mask[:valid].all()):
                raise ValueError("left padding inside a sequence: pad on the right (tokenizer.padding_side='right') "
                                 "or do not pad (one sequence per batch needs no padding).")
            labels[:, valid:] = IGNORE_INDEX
        position_ids = batch.get("position_ids")
        if lengths is None and position_ids is not None:
            lengths = document_lengths_from_positions(position_ids.reshape(-1))
        sharded = shard_batch(input_ids, self.layout, labels=labels, pad_token_id=self.pad_token_id,
                              vocab_size=self.vocab_size, document_lengths=lengths, attention_mask=mask)
        out = {"input_ids": sharded.input_ids, "labels": sharded.labels, "position_ids": sharded.position_ids}
        if sharded.cu_seqlens is not None:
            out["cu_seqlens"] = tuple(sharded.cu_seqlens.tolist())
        if sharded.token_mask is not None:  # the padding, which the MoE router loss leaves out as transformers does
            out["token_mask"] = sharded.token_mask
        return out


class _EpochDataLoader(DataLoader):
    """A DataLoader whose set_epoch reaches its DistributedSampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


_NO_DEEPSPEED = (
    "accelerate did not turn DeepSpeed on, so the ZeRO-3 partitioned weights would never be gathered. `accelerate "
    "launch --cpu` does this: on CPU accelerate runs DDP only (and starts more than one process only through MPI). "
    "On CPU leave --cpu out: `accelerate launch --num_processes 2 --config_file examples/accelerate_zero3.yaml "
    "script.py` with TrainingArguments(use_cpu=True) trains on CPU with gloo; or use torchrun.")


def _sp_size_from(args, sp_size: int | None) -> int | None:
    """sp_size given, else the DeepSpeed JSON's sequence_parallel_size, else None (all ranks)."""
    if sp_size is not None:
        return sp_size
    hf_ds = getattr(args, "hf_deepspeed_config", None)
    return None if hf_ds is None else hf_ds.config.get("sequence_parallel_size")


class UlyssesTrainerMixin:
    """Trainer methods for ulysses_lc; see the module docstring. Use through `ulysses_trainer(cls)`.

    Extra constructor arguments:
      sp_size: ranks sharing one sequence (default: the DeepSpeed JSON's sequence_parallel_size, else all ranks).
      seq_len: the longest sequence the run trains, for the memory plan and the YaRN check (default: TRL's
        max_length, else the first batch's length, the longest over ranks).
      levers: keyword arguments for SequenceParallelCausalLM (kernel, chunked_loss, tiled_mlp, offload, ...).
      sp_placement: "node" (SP groups inside a node, DP across nodes; default) or "across" (layout.py).
    """

    def __init__(self, *args, sp_size: int | None = None, seq_len: int | None = None, levers: dict | None = None,
                 sp_placement: str = "node", **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        max_length = getattr(training_args, "max_length", None)
        seq_len = seq_len or (max_length and max_length * self._documents_per_row)
        self._check_setup(training_args, model if isinstance(model, torch.nn.Module) else None, kwargs, seq_len)
        init_distributed()
        # The parent makes output_dir on rank 0; a run that saves nothing in it takes it away again (train()).
        output_dir = Path(getattr(training_args, "output_dir", None) or ".")
        self._made_dirs = [d for d in (output_dir, output_dir.parent) if not d.exists()] \
            if torch.distributed.get_rank() == 0 else []
        # Before the parent's __init__, which hands a DPO reference model to DeepSpeed (hf_dpo.py wraps it first).
        layout = ParallelLayout.build(_sp_size_from(training_args, sp_size), placement=sp_placement)
        super().__init__(*args, **self._parent_kwargs(layout, kwargs, levers or {}))
        if not self.is_deepspeed_enabled:
            raise ValueError(_NO_DEEPSPEED)
        if self.accelerator.num_processes != torch.distributed.get_world_size():
            raise ValueError(f"accelerate sees {self.accelerator.num_processes} process(es) but torch.distributed has "
                             f"{torch.distributed.get_world_size()}: on CPU pass use_cpu=True in the TrainingArguments "
                             "(or start with accelerate launch --cpu).")
        if layout.rank == 0 and layout.num_nodes > 1:  # a warning where the all-to-all leaves the node: it costs
            (logger.warning if layout.sp_group_nodes > 1 else logger.info)("ulysses_lc nodes: %s", layout.placement_line())
        check_deepspeed_config({k: v for k, v in self.args.hf_deepspeed_config.config.items()
                                if k not in ("train_batch_size", "gradient_accumulation_steps")}, layout)
        check_model_for_ulysses(self.model.config, layout.sp_size)
        self.layout = layout
        self.seq_len = seq_len
        self.model = self.model_wrapped = SequenceParallelCausalLM(self.model, layout, **(levers or {}))
        # The wrapper's forward takes num_items_in_batch, as a transformers model does (module docstring); DPO's loss
        # is TRL's per-pair mean.
        self.model_accepts_loss_kwargs = self._sft_loss
        # The MoE router term: the plain Trainer sums it over the step's micro steps and DP ranks, TRL's SFTTrainer
        # averages it over them (compute_loss follows the parent class).
        self._router_mean = any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl.")
                                for c in type(self).__mro__)
        self._planned = False
        self._micro_steps = 0  # training_step calls, for the per-rank seed (distributed.seed_step)
        self._after_parent_init()

    # -- what a trainer kind changes (hf_dpo.UlyssesDPOMixin): checks, the parent's arguments, the collate function --
    _documents_per_row = 1  # documents a dataset row trains as: the default seq_len is max_length times this
    _sft_loss = True

    def _check_setup(self, args, model, kwargs, seq_len) -> None:
        check_trainer_setup(args, model, kwargs, seq_len, sft_loss=self._sft_loss)

    def _parent_kwargs(self, layout: ParallelLayout, kwargs: dict, levers: dict) -> dict:
        return kwargs

    def _after_parent_init(self) -> None:
        pass

    def _collate_fn(self, pad_token_id: int):
        return ShardingCollator(self.data_collator, self.layout, text_config(self.model.config).vocab_size, pad_token_id)

    # -- DeepSpeed gets our mpu wherever the Trainer may initialise it --
    def train(self, *args, **kwargs):
        try:
            with deepspeed_initialize_with_mpu(self.layout):
                result = super().train(*args, **kwargs)
            # Every rank past the parent's last look into output_dir (its checkpoint sort) before rank 0 takes it away.
            torch.distributed.barrier()
            return result
        finally:
            for folder in self._made_dirs:  # made by the Trainer and left empty (save_strategy "no"): no leftovers
                try:
                    folder.rmdir()
                except OSError:  # not empty (a checkpoint, logs) or gone: kept as it is
                    pass

    def evaluate(self, *args, **kwargs):
        with deepspeed_initialize_with_mpu(self.layout):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with deepspeed_initialize_with_mpu(self.layout):
            return super().predict(*args, **kwargs)

    # -- data: one sampler per DP rank, one sequence per batch, sharded on the host --
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *SEQUENCE_COLUMNS]))

    def _sequence_dataloader(self, dataset, description: str, train: bool) -> DataLoader:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        tokenizer = getattr(self, "processing_class", None)
        collate = self._collate_fn(pad_token_id(tokenizer))
        params = dict(batch_size=1, collate_fn=collate, num_workers=self.args.dataloader_num_workers,
                      pin_memory=self.args.dataloader_pin_memory)
        if isinstance(dataset, torch.utils.data.IterableDataset):
            if not isinstance(dataset, datasets.IterableDataset):
                raise ValueError("an IterableDataset other than datasets.IterableDataset: ulysses_lc cannot give each "
                                 "DP group its own share of it; pass a datasets.Dataset or datasets.IterableDataset.")
            dataset = datasets.distributed.split_dataset_by_node(dataset, self.layout.dp_rank, self.layout.dp_size)
            return DataLoader(dataset, **params)
        sampler = DistributedSampler(dataset, num_replicas=self.layout.dp_size, rank=self.layout.dp_rank,
                                     shuffle=train, seed=self.args.seed, drop_last=train and self.args.dataloader_drop_last)
        return _EpochDataLoader(dataset, sampler=sampler, **params)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._sequence_dataloader(self.train_dataset, "training", train=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._sequence_dataloader(eval_dataset, "evaluation", train=False)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self._sequence_dataloader(test_dataset, "test", train=False)

    # -- the step --
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The valid labels of `batch_samples` (an optimizer step's micro batches, or one eval batch), summed over the
        SP group (its ranks hold slices of the same sequences) and, under average_tokens_across_devices, over the DP
        ranks: what the Trainer counts for a model that takes num_items_in_batch. Collective over those ranks."""
        if not self._sft_loss or not batch_samples:
            return super()._get_num_items_in_batch(batch_samples, device)
        # Our labels are shifted already (ShardingCollator): every one != IGNORE_INDEX is a prediction target, which
        # the Trainer's own count (labels[..., 1:] of unshifted labels) would miss on every SP rank but the first.
        return step_num_items([batch["labels"] for batch in batch_samples], self.layout, device=device,
                              across_dp=self.args.average_tokens_across_devices)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        if "cu_seqlens" in inputs:
            inputs["cu_seqlens"] = torch.tensor(inputs["cu_seqlens"], dtype=torch.int32)
        if num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch
            if self._router_mean:
                # TRL's SFTTrainer adds the router term / the accumulation steps, left out of its x world size, and
                # DDP averages it over ranks: the step's mean of it. Here the loss is x dp_size below, and ZeRO-3
                # averages over all ranks (docs/weighting.md).
                dp = self.layout.dp_size if self.args.average_tokens_across_devices else 1
                inputs["router_scale"] = 1.0 / (getattr(self, "current_gradient_accumulation_steps", 1) * dp)
        loss = model(**inputs)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            # The Trainer multiplies by its world size, undoing DDP's mean over ranks; ZeRO-3 here averages over all
            # sp_size x dp_size ranks, of which each SP group's already sum to the sequence's share: dp_size undoes it.
            loss = loss * self.layout.dp_size
        return (loss, {"loss": loss}) if return_outputs else loss

    def training_step(self, model, inputs, *args, **kwargs):
        if not self._planned:
            check_engine_mpu(self.model_wrapped, self.layout)
            self._plan_memory(inputs["input_ids"].shape[1] * self.layout.sp_size, packed="cu_seqlens" in inputs)
        # Per rank and micro step (the Trainer seeds every rank alike): dropout masks differ between the SP slices.
        self._micro_steps += 1
        seed_step(self.args.seed, self.layout.rank, self.state.global_step, self._micro_steps)
        return super().training_step(model, inputs, *args, **kwargs)

    def _plan_memory(self, batch_len: int, packed: bool = False) -> None:
        """The wrapper's plan_step for the longest sequence any rank trains (every rank must plan alike)."""
        device = self.args.device
        # On the device: NCCL reduces CUDA tensors only.
        longest = torch.tensor([max(self.seq_len or 0, batch_len)], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX, group=self.layout.world_group)
        wrapper = self.model
        wrapper.probe_attention(device, next(wrapper.parameters()).dtype)  # the plan for the kernel actually used
        wrapper.use_plan(wrapper.plan_step(int(longest), device, packed=packed))
        self._planned = True
        # One start-up block, as the main job prints one (train/console.py), once the first batch fixed the length.
        self.startup_block = "\n".join(["ulysses_lc trainer"] + ["  " + line for line in wrapper.summary(
            int(longest), device, length_note="the longest any rank trains")])
        if self.layout.rank == 0:
            logger.info("%s", self.startup_block)

    # -- saving: a plain Hugging Face model folder --
    def _save(self, output_dir: str | None = None, state_dict=None):
        import os

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        wrapper = self.model
        if state_dict is None:
            state_dict = wrapper.state_dict()
        hf_state = wrapper.plain_state_dict(state_dict)
        if hf_state:  # a multimodal model into a copy of its source's files (composite.py)
            save_model(wrapper.model, hf_state, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


@functools.lru_cache(maxsize=None)
def ulysses_trainer(trainer_cls: type) -> type:
    """A subclass of `trainer_cls` (transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer, or a subclass of one) that
    trains with ulysses_lc. Its constructor takes the parent's arguments plus sp_size, seq_len and levers."""
    bases = (UlyssesTrainerMixin, trainer_cls)
    if any(c.__name__ == "DPOTrainer" and c.__module__.startswith("trl.") for c in trainer_cls.__mro__):
        from .hf_dpo import UlyssesDPOMixin

        bases = (UlyssesDPOMixin, *bases)
    return type(f"Ulysses{trainer_cls.__name__}", bases, {})


def __getattr__(name: str):
    # UlyssesTrainer / UlyssesSFTTrainer built on first use: transformers' Trainer and trl import slowly.
    if name == "UlyssesTrainer":
        from transformers import Trainer

        return ulysses_trainer(Trainer)
    if name == "UlyssesSFTTrainer":
        from trl import SFTTrainer

        return ulysses_trainer(SFTTrainer)
    if name == "UlyssesDPOTrainer":
        from trl import DPOTrainer

        return ulysses_trainer(DPOTrainer)
    raise AttributeError(name)


__all__ = ["SEQUENCE_COLUMNS", "ShardingCollator", "UlyssesTrainerMixin", "check_engine_mpu", "check_trainer_setup",
           "deepspeed_initialize_with_mpu", "ulysses_trainer"]
