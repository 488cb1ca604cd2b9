"""What the run prints: one start-up block, one line per step ("-" where a figure does not apply)."""

from __future__ import annotations

import sys

from ..metrics import StepLogger

GB = 1e9


class RunLogger(StepLogger):
    """StepLogger whose progress bar is only drawn on a terminal (in a log file it would interleave with the step
    lines), and that also sends each step's numbers to Weights & Biases."""

    def __init__(self, *args, wandb_run=None, **kwargs):
        """wandb_run: a started `wandb.init(...)` run (rank 0) that also receives every step's numbers."""
        stream = kwargs.get("stream") or sys.stdout
        kwargs.setdefault("progress", stream.isatty())
        super().__init__(*args, **kwargs)
        self._wandb = wandb_run

    def log(self, step: int, **values) -> dict | None:
        record = super().log(step, **values)
        if record is not None and self._wandb is not None:
            numbers = {k: v for k, v in record.items() if k not in ("step", "total_steps", "time") and isinstance(v, (int, float))}
            self._wandb.log(numbers, step=step)
        return record

    def close(self) -> None:
        super().close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def layout_line(layout) -> str:
    return (f"{layout.world_size} ranks = sp {layout.sp_size} (ranks sharing one sequence) x dp {layout.dp_size} "
            "(sequences per step)")


def _plan_reason(cfg, device: str) -> str:
    flags = [f"--{n.replace('_', '-')}" for n in ("recompute_layers", "keep_on_gpu", "cache_attention_layers")
             if getattr(cfg, n) is not None]
    if device != "gpu":
        why = "no GPU: every layer checkpointed and offloaded, to exercise the paths"
    else:
        why = "the fastest plan that fits the free device and host memory (memory.plan_memory)"
    return why + (f", with {', '.join(flags)} as given" if flags else "")


def startup_block(*, out, cfg, checked, layout_line: str, num_params: int, kernel: str, plan, estimate, device: str) -> str:
    """The run's start-up summary: where it writes, layout, model, length and YaRN, kernel, levers and plan, memory."""
    rope = getattr(checked.model_config, "rope_parameters", None) or {}
    yarn = f"YaRN factor {rope['factor']:g}" if rope.get("rope_type") == "yarn" else "no YaRN (within the trained length)"
    layers = checked.model_config.num_hidden_layers
    offloaded = plan.recompute_layers - plan.keep_on_gpu
    lines = [
        f"output    {out}" if out is not None else "output    none (dry run)",
        f"layout    {layout_line}",
        f"model     {cfg.model}: {type(checked.model_config).__name__}, {layers} layers, {num_params / 1e6:,.1f} M params"
        + (f"; LoRA r {cfg.lora_r} on {cfg.lora_targets}: {checked.trainable_params / 1e6:,.2f} M trained, the rest "
           "frozen (no optimizer state)" if checked.trainable_params is not None else ""),
        f"length    {cfg.seq_len:,} tokens per step, {yarn}",
        f"kernel    {kernel}, attention head groups {cfg.attention_head_groups}",
        f"deepspeed {cfg.ds_config} (ZeRO-3, bf16 {'on' if checked.ds_config['bf16']['enabled'] else 'off'})",
        "levers    chunked loss, tiled MLP, bf16-saving RMSNorm, activation checkpoints with offload"
        + (f", Ulysses all-to-all over {checked.sp_size} ranks" if checked.sp_size > 1 else " (sp 1: no all-to-all)"),
        f"plan      {layers - plan.recompute_layers} plain layers, {plan.recompute_layers} checkpointed "
        f"({offloaded} offloaded to host, {plan.keep_on_gpu} kept on {device}), "
        f"{plan.cache_attention_layers} keep their attention output; {_plan_reason(cfg, device)}",
        f"memory    per rank, predicted: {device} {estimate.gpu / GB:.1f} GB (ZeRO-3 state {estimate.state_gpu / GB:.1f}, "
        f"activations {estimate.act_gpu / GB:.1f}), host {estimate.host / GB:.1f} GB "
        f"(state {estimate.state_host / GB:.1f}, offloaded activations {estimate.act_host / GB:.1f})",
    ]
    return "\n".join(["ulysses_lc " + ("dry run" if cfg.dry_run else "run")] + ["  " + line for line in lines])
