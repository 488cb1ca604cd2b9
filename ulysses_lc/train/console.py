"""What the run prints: one start-up block, one line per step ("-" where a figure does not apply)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from ..mixers import fallbacks
from ..plan.deltanet_time import DELTANET_RULE
from ..plan.metrics import StepLogger
from ..plan.sizing import GB, MATMUL_FLOPS_PER_S, attention_flops_per_s
from ..levers.yarn import describe_rope_scaling
from ..shape import text_config
from ..parallel.distributed import ignore_unactionable_warnings


def quiet_warnings(rank: int | None = None) -> None:
    """Show each warning once per job: rank 0's only (every rank runs the same code, so the others' would repeat
    it), and none of DeepSpeed's ZeRO-3 deprecation warnings. The main job and the example scripts call it first.

    rank: default the launcher's RANK (0 without a launcher).
    """
    if (int(os.environ.get("RANK", "0")) if rank is None else rank) != 0:
        warnings.simplefilter("ignore")
    ignore_unactionable_warnings()


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

    def log_eval(self, step: int, result) -> dict | None:
        record = super().log_eval(step, result)
        if record is not None and self._wandb is not None:
            self._wandb.log(result.scalars(), step=step)
        return record

    def close(self) -> None:
        super().close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def layout_line(layout, global_batch: int | None = None) -> str:
    """The layout, the gradient accumulation where an optimizer step takes more sequences than DP groups, and on
    its own line of the block where the SP groups sit (inside a node or across nodes)."""
    ga = (global_batch or layout.dp_size) // layout.dp_size
    ranks = f"{layout.world_size} rank{'s' if layout.world_size > 1 else ''}"
    line = f"{ranks} = sp {layout.sp_size} (ranks sharing one sequence) x dp {layout.dp_size} "
    if ga == 1:
        line += "(sequences per step)"
    else:
        line += f"(sequences per micro step) x ga {ga} = global batch {global_batch} (sequences per step)"
    return line + f"\n  nodes     {layout.placement_line()}"


def _plan_reason(plan_settings, device: str, estimate, differs: str | None = None) -> str:
    flags = plan_settings.overridden()
    if device != "gpu":
        why = "no GPU: every layer checkpointed and offloaded, to exercise the paths (--gpu-memory-gb plans for one)"
    elif differs:
        why = f"not the dry run's plan for these limits: {differs}"
    elif estimate.fit is not None and not estimate.fit.fits:
        why = "the least memory a plan can take, and it does not fit (limits below)"
    else:
        why = "the fastest plan that fits the limits below (memory.plan_memory), the dry run's for them"
    return why + (f", with {', '.join(flags)} as given" if flags else "")


def layers_line(model_config, kernel: str, deltanet: str, on_gpu: bool = True) -> str:
    """Each kind of decoder layer, how many, and what computes it: full attention through the Ulysses attention with
    `kernel`; sliding windows and sinks through window_attention's pick on a GPU (on_gpu) or on the CPU; gated
    DeltaNet layers through `deltanet`."""
    from ..mixers.window_attention import describe_how
    from ..shape import ModelShape

    cfg = text_config(model_config)
    shape = ModelShape.from_config(cfg)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * shape.layers)
    windows = shape.layer_windows or (None,) * shape.layers
    kinds = {}
    for kind, window in zip(types, windows):
        if kind == "linear_attention":
            name = f"gated DeltaNet ({deltanet})"
        else:
            name = f"sliding window {window}" if window is not None else "full attention"
            if window is not None or shape.sinks:
                name += (" with sinks" if shape.sinks else "") + f" ({describe_how(window, shape.sinks, on_gpu)})"
            else:
                name += f" ({kernel})"
        kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in kinds.items())


def _trained_part(model, checked) -> str:
    """What of the model trains, where not all of it: LoRA's adapters, or a multimodal model's language model."""
    if checked.trainable_params is None:
        return ""
    trained = f"{checked.trainable_params / 1e6:,.2f} M trained"
    if model.lora_r:
        return f"; LoRA r {model.lora_r} on {model.lora_targets}: {trained}, the rest frozen (no optimizer state)"
    return (f"; its language model trains ({trained}), the rest (vision tower, projector) frozen and exported as "
            "loaded")


def reference_line(run, estimate) -> str:
    """DPO's reference model and what it costs per rank (sizing.Job.reference_params)."""
    job, objective = estimate.job, run.objective
    head = (f"DPO {objective.dpo_loss}, beta {objective.dpo_beta:g}; two documents per pair (prompt + chosen | "
            "prompt + rejected)")
    if objective.reference == "adapters":
        return f"reference the model with its LoRA adapters off: no second model; {head}"
    if objective.reference == "precomputed":
        return ("reference precomputed: the model as loaded" + (" with its adapters off" if run.model.lora_r else "")
                + f", once over the data before training, kept in the token cache: no second model; {head}")
    size = "" if job is None else (f": {job.reference_params / 1e6:,.1f} M params, "
                                   f"{2 * job.reference_params / job.world_size / GB:.2f} GB per rank of bf16 weights "
                                   "in the state below")
    return f"reference a frozen copy, ZeRO-3 partitioned like the policy{size}; {head}"


def startup_block(*, out, run, checked, layout_line: str, num_params: int, kernel: str, plan, estimate, device: str,
                  limits_line: str | None = None, node: str | None = None, differs: str | None = None,
                  deltanet: str | None = None, kernels: str | None = None) -> str:
    """The run's start-up summary (run: settings.RunSettings): where it writes, layout, model, length and YaRN, kernel, levers and plan, memory
    (per rank, and `node`: per node), and against `limits_line`'s limits (estimate.fit) whether the plan fits.
    device: "gpu" where the plan is a GPU's (the dry run, a GPU run, a CPU run given --gpu-memory-gb); differs: why
    the run's plan is not the dry run's for the same limits; deltanet: what runs the gated DeltaNet layers (the run's
    resolved kernel and why; None: the GPU run's rule, for the dry run); kernels: the kernel cache's line
    (kernel_cache.kernels_line), whose missing kernels estimate.first_extra_s adds to the first step."""
    yarn = checked.rope or describe_rope_scaling(checked.model_config)
    layers = text_config(checked.model_config).num_hidden_layers
    offloaded = plan.recompute_layers - plan.keep_on_gpu
    m, model = estimate.memory, run.model
    lines = [
        f"output    {out}" if out is not None else "output    none (dry run)",
        f"layout    {layout_line}",
        f"model     {model.name}: {type(checked.model_config).__name__}, {layers} layers, {num_params / 1e6:,.1f} M "
        "params" + _trained_part(model, checked),
        f"length    {run.stream.seq_len:,} tokens per step, {yarn}",
        *([reference_line(run, estimate)] if run.objective.dpo else []),
        f"kernel    {kernel}, attention head groups {model.attention_head_groups}; fallbacks {fallbacks.summary()}",
        f"layers    {layers_line(checked.model_config, kernel, deltanet or DELTANET_RULE, on_gpu=device == 'gpu' and (out is None or torch.cuda.is_available()))}",
        f"deepspeed {run.optim.ds_config} (ZeRO-3, bf16 {'on' if checked.ds_config['bf16']['enabled'] else 'off'})",
        "levers    chunked loss, tiled MLP, bf16-saving RMSNorm, activation checkpoints with offload"
        + (f", Ulysses all-to-all over {checked.sp_size} ranks" if checked.sp_size > 1 else " (sp 1: no all-to-all)"),
        f"plan      {layers - plan.recompute_layers} plain layers, {plan.recompute_layers} checkpointed "
        f"({offloaded} offloaded to host, {plan.keep_on_gpu} kept on {device}), "
        f"{plan.cache_attention_layers} keep their attention output; {_plan_reason(run.plan, device, estimate, differs)}",
        f"memory    per rank, predicted: {device} {m.gpu / GB:.1f} GB peak (ZeRO-3 state {m.state_gpu / GB:.1f}, "
        f"gathered weights {m.gathered / GB:.1f}, activations {m.act_gpu / GB:.1f}), host {m.host / GB:.1f} GB "
        f"(process {m.process_host / GB:.1f}, state {m.state_host / GB:.1f}, offloaded activations {m.act_host / GB:.1f})",
    ]
    if node is not None:
        lines.append(f"node      {node}")
    if kernels is not None:
        lines.append(f"kernels   {kernels}")
    if estimate.fit is not None:
        lines.append(f"limits    {limits_line}: {estimate.fit.verdict()}")
    if device == "gpu":
        # The gated DeltaNet layers' path priced: the dry run's by DELTANET_RULE (it cannot probe a GPU it lacks).
        deltanet_line = estimate.job.deltanet_line() if estimate.job is not None else None
        lines.append(f"step      {estimate.step_s:,.1f} s predicted (model FLOPs at an H200's measured rates: attention "
                     f"{attention_flops_per_s(estimate.job.shape.head_dim if estimate.job else 128) / 1e12:.0f}, "
                     f"matmul {MATMUL_FLOPS_PER_S / 1e12:.0f} TF/s"
                     + ("; packed documents take less" if run.stream.shape.packing else "")
                     + (f"; {deltanet_line}" if deltanet_line else "") + ")"
                     + (f"; the first step {estimate.step_s + estimate.first_extra_s:,.1f} s, its kernels not in "
                        "the kernel cache (kernels line)" if estimate.first_extra_s else ""))
    return "\n".join(["ulysses_lc " + ("dry run" if run.dry_run else "run")] + ["  " + line for line in lines])
