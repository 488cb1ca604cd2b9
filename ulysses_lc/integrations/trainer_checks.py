"""The Trainer settings under which ulysses_lc would train wrong or not at all, refused with the fix before any work
(hf_trainer.UlyssesTrainerMixin calls it first; DPO adds its own in hf_dpo.py)."""

from __future__ import annotations

from ..shape import text_config


def check_trainer_setup(args, model, trainer_kwargs: dict, seq_len: int | None = None, sft_loss: bool = True) -> None:
    """Raise ValueError, with the fix, for Trainer settings under which ulysses_lc would train wrong or not at all.
    sft_loss: the Trainer's loss is the token NLL (False for DPO, whose loss_type hf_dpo.py checks)."""
    if args is None or not getattr(args, "deepspeed", None):
        raise ValueError("ulysses_lc trains on DeepSpeed ZeRO-3: pass TrainingArguments(..., deepspeed="
                         "load_deepspeed_config('zero3')) (or SFTConfig(..., deepspeed=...)).")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_size", 1) > 1 or getattr(pc, "cp_size", 1) > 1):
        raise ValueError("parallelism_config asks accelerate for its own sequence/context parallelism, which would "
                         "install DeepSpeed's attention next to ours; remove parallelism_config and pass sp_size= to "
                         "the ulysses_lc trainer (or sequence_parallel_size in the DeepSpeed JSON).")
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("use_liger_kernel=True replaces the loss and kernels ulysses_lc installs (its fused loss "
                         "and attention do not know the sequence is split); remove it: the chunked loss already "
                         "avoids the [tokens x vocab] logits.")
    for key in ("compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"):
        if trainer_kwargs.get(key) is not None:
            raise ValueError(f"{key} needs the [tokens x vocab] logits, which ulysses_lc never builds (the loss is "
                             f"computed from hidden states in chunks); remove {key}. evaluate() reports the loss.")
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError("label_smoothing_factor is applied by the Trainer to full logits, which ulysses_lc never "
                         "builds; set it to 0.")
    if sft_loss and getattr(args, "loss_type", "nll") != "nll":
        raise ValueError(f"loss_type={args.loss_type!r} weighs tokens by their probability from full logits; "
                         "ulysses_lc's chunked loss is the plain NLL: set loss_type='nll'.")
    # Evaluation changes no weight and each sequence is evaluated whole either way, so the eval batch (8 by
    # TrainingArguments' default, which a script without an eval set never thinks of) is set to one sequence.
    if getattr(args, "per_device_eval_batch_size", 1) != 1:
        args.per_device_eval_batch_size = 1
    if getattr(args, "per_device_train_batch_size", 1) != 1:
        raise ValueError(f"per_device_train_batch_size={args.per_device_train_batch_size}: ulysses_lc trains one whole "
                         "sequence per device batch (SP ranks share it); set it to 1 and use gradient_accumulation_steps "
                         "for more.")
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        raise ValueError("activation_checkpointing (gradient_checkpointing) is on: ulysses_lc checkpoints (and "
                         "offloads) layers itself, as its memory plan says; set activation_checkpointing=False "
                         "(TRL's SFTConfig turns it on by default).")
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") == "wrapped":
        raise ValueError("packing_strategy='wrapped' cuts documents into blocks without boundaries, so documents "
                         "would attend to each other; use packing_strategy='bfd' (ulysses_lc trains its documents "
                         "apart, from their position ids).")
    if seq_len is not None and model is not None:
        cfg = text_config(model.config)
        max_positions = getattr(cfg, "max_position_embeddings", None)
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if max_positions is not None and seq_len > max_positions and rope_type == "default":
            raise ValueError(f"seq_len={seq_len:,} is longer than the model's {max_positions:,} positions and it has "
                             "no RoPE scaling; load it with ulysses_lc.load_model_for_length(name, seq_len) (YaRN).")
