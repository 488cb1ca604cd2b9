"""TRL's DPOTrainer through ulysses_lc: `ulysses_trainer(DPOTrainer)`, the same one class swap as for SFT.

    trainer = ulysses_trainer(DPOTrainer)(model=model, args=DPOConfig(..., deepspeed=load_deepspeed_config("zero3"),
        activation_checkpointing=False), train_dataset=pairs, processing_class=tokenizer, peft_config=lora)

TRL prepares the rows as it always does (prompt / chosen / rejected, chat or plain: its EOS, chat template and
tokenization into prompt_ids / chosen_ids / rejected_ids). What changes, beyond hf_trainer.py's mixin:
  - the data: each row is one packed sequence of two documents, [prompt + chosen | prompt + rejected], labels on
    the completions only, sharded on the host (`PairCollator`, preference.py says why one sequence);
  - the loss: TRL's formulas (its "sigmoid" and "ipo") on the completions' log-probabilities, computed from hidden
    states in chunks and summed over the SP group (`preference.PreferenceLoss`); TRL's reward metrics are recorded
    for its log (rewards/chosen, rejected, margins, accuracies; logps/chosen, rejected), averaged over DP ranks;
  - the reference: a `ref_model` is wrapped in a SequenceParallelCausalLM (Ulysses attention, chunked head, tiled
    MLP; no checkpointing, it runs without gradient) before TRL hands it to DeepSpeed, which partitions it under
    ZeRO-3 like the policy; with LoRA (`peft_config`) it is the policy with its adapters off, as in TRL.
Refused at construction, with the fix: loss types other than sigmoid and ipo, label smoothing (TRL's sigmoid
ignores it), loss weights over several losses, ld_alpha, WPO weighting, f-divergences, sync_ref_model,
precompute_ref_log_probs (TRL computes it with every rank holding the whole sequence), the MoE router loss, a
reference it would have to load by name, a PeftModel without a ref_model (TRL then copies its adapter as
reference), and a row that does not fit: a prompt + completion longer than max_length (TRL would cut it) or with
no completion or prompt token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mixers.attention import check_model_for_ulysses
from ..parallel.layout import ParallelLayout
from ..model import SequenceParallelCausalLM
from ..shape import text_config
from ..peft_support import is_peft_model
from ..objectives.preference import LOSS_TYPES, PreferenceBatch, PreferenceLoss, check_pair, reference_log_probs, shard_pairs
from ..parallel.sharding import ShardedBatch

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


class PairCollator:
    """The DPO collate function: one row -> this rank's slice of [prompt + chosen | prompt + rejected].

    Returns input_ids, labels (shifted), position_ids, cu_seqlens (a tuple of ints, read on the host), and the
    completions' token counts (tuples). layout: only sp_size and sp_rank are read (a group-free copy)."""

    def __init__(self, layout: ParallelLayout, vocab_size: int, pad_token_id: int):
        self.layout = layout.without_groups()
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        if len(examples) != 1:
            raise ValueError(f"a batch of {len(examples)} pairs: ulysses_lc trains one pair per device batch; set "
                             "per_device_train_batch_size=1 and per_device_eval_batch_size=1.")
        pair = tuple(list(examples[0][key]) for key in PAIR_COLUMNS)
        batch = shard_pairs([pair], self.layout, vocab_size=self.vocab_size, pad_token_id=self.pad_token_id)
        return {"input_ids": batch.batch.input_ids, "labels": batch.batch.labels,
                "position_ids": batch.batch.position_ids, "cu_seqlens": tuple(batch.batch.cu_seqlens.tolist()),
                "chosen_tokens": batch.chosen_tokens, "rejected_tokens": batch.rejected_tokens}


def check_dpo_setup(args, model, ref_model, peft_config) -> None:
    """Raise ValueError, with the fix, for DPOConfig settings ulysses_lc would not train as TRL does."""
    losses = list(getattr(args, "loss_type", ["sigmoid"]))
    if len(losses) != 1 or losses[0] not in LOSS_TYPES:
        raise ValueError(f"loss_type={losses}: ulysses_lc computes TRL's {' and '.join(LOSS_TYPES)} losses, one at a "
                         "time; pick one of them.")
    if getattr(args, "label_smoothing", 0.0):
        raise ValueError(f"label_smoothing={args.label_smoothing}: TRL's {losses[0]} loss does not use it; set it to "
                         "0 (the main job's --dpo-label-smoothing trains the conservative cDPO loss).")
    unsupported = {"loss_weights": (None, [1.0]), "ld_alpha": (None,), "use_weighting": (False,),
                   "f_divergence_type": ("reverse_kl",), "sync_ref_model": (False,),
                   "precompute_ref_log_probs": (False,)}
    for key, fine in unsupported.items():
        if getattr(args, key, fine[0]) not in fine:
            raise ValueError(f"{key}={getattr(args, key)!r} is not supported by ulysses_lc's DPO; set {key}={fine[0]!r}"
                             + (" (TRL precomputes with the whole sequence on every rank; leave it off, or precompute "
                                "with the main job)" if key == "precompute_ref_log_probs" else "") + ".")
    if ref_model is None and peft_config is None and not is_peft_model(model):
        raise ValueError("DPO needs a reference model: pass ref_model= (a frozen copy, loaded like the policy) or "
                         "peft_config= (LoRA: the reference is the model with its adapters off).")
    if ref_model is None and is_peft_model(model):
        raise ValueError("a PeftModel without ref_model: TRL would take a copy of its adapter as the reference. Pass "
                         "the base model with peft_config= (the reference is then the adapters off), or a ref_model.")


class UlyssesDPOMixin:
    """DPOTrainer methods for ulysses_lc (module docstring); `ulysses_trainer(DPOTrainer)` puts it before
    hf_trainer.UlyssesTrainerMixin. The sequence length for the memory plan is a pair's: 2 x max_length."""

    _documents_per_row = 2
    _sft_loss = False

    def _check_setup(self, args, model, kwargs, seq_len):
        super()._check_setup(args, model, kwargs, seq_len)
        check_dpo_setup(args, model, kwargs.get("ref_model"), kwargs.get("peft_config"))

    def _parent_kwargs(self, layout: ParallelLayout, kwargs: dict, levers: dict) -> dict:
        ref_model = kwargs.get("ref_model")
        if ref_model is not None:
            check_model_for_ulysses(ref_model.config, layout.sp_size)
            # No gradient, so nothing to checkpoint or offload; the other levers as the policy's.
            ref_levers = {**levers, "checkpointing": False, "offload": False, "plan": None}
            kwargs = {**kwargs, "ref_model": SequenceParallelCausalLM(ref_model.requires_grad_(False), layout,
                                                                      **ref_levers)}
        return kwargs

    def _after_parent_init(self) -> None:
        if self.aux_loss_enabled:
            raise ValueError("the MoE router's auxiliary loss is on (router_aux_loss_coef): ulysses_lc's DPO loss does "
                             "not add it; set router_aux_loss_coef=0.0 in the DPOConfig.")
        if self.ref_model is not None:  # TRL patched its fused LM head onto the wrapper's forward: ours is the one
            getattr(self.ref_model, "module", self.ref_model).__dict__.pop("forward", None)
        self.preference_loss = PreferenceLoss(beta=self.beta, loss_type=self.loss_types[0])
        max_length = getattr(self.args, "max_length", None)
        datasets = [self.train_dataset, *(
            (self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset])
            if self.eval_dataset is not None else [])]
        for dataset in datasets:
            if hasattr(dataset, "select_columns"):  # a map-style dataset: every row is checked before any step
                for i, row in enumerate(dataset.select_columns(list(PAIR_COLUMNS))):
                    check_row(row, max_length, where=f"row {i}")

    def _collate_fn(self, pad_token_id: int):
        return PairCollator(self.layout, text_config(self.model.config).vocab_size, pad_token_id)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = PreferenceBatch(
            ShardedBatch(inputs["input_ids"], inputs["labels"], inputs["position_ids"], 0, 0,
                         torch.tensor(inputs["cu_seqlens"], dtype=torch.int32)),
            tuple(inputs["chosen_tokens"]), tuple(inputs["rejected_tokens"]))
        ref_logps = reference_log_probs(model, batch, self.ref_model)
        loss, metrics = self.preference_loss(model(**batch.as_kwargs()), ref_logps, batch)
        self._record_metrics(metrics)
        return (loss, {"loss": loss}) if return_outputs else loss

    def _record_metrics(self, metrics: dict) -> None:
        """TRL's metrics for its log(): the same on every rank of an SP group, so the mean over all ranks is the
        mean over DP ranks. One all-reduce of a few scalars and one host read per step."""
        values = torch.stack([v.float() for v in metrics.values()])
        dist.all_reduce(values, group=self.layout.world_group)
        mode = "train" if self.model.training else "eval"
        for key, value in zip(metrics, (values / self.layout.world_size).tolist()):
            self._metrics[mode][key].append(value)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


def check_row(row: dict, max_length: int | None, where: str) -> None:
    """A tokenized DPO row: each prompt + completion within TRL's max_length (TRL would cut it), tokens in each."""
    prompt, chosen, rejected = (row[key] for key in PAIR_COLUMNS)
    check_pair(prompt, chosen, rejected, where=where)
    longest = len(prompt) + max(len(chosen), len(rejected))
    if max_length is not None and longest > max_length:
        raise ValueError(f"{where} is {longest:,} tokens as prompt + completion, more than max_length={max_length:,}: "
                         "TRL would cut the completion, so the pair would score another one. Raise max_length (the "
                         "pair trains as one sequence of up to 2 x max_length) or drop the row.")


__all__ = ["PAIR_COLUMNS", "PairCollator", "UlyssesDPOMixin", "check_dpo_setup", "check_row"]
