"""What the run prints: one start-up block, one line per step ("-" where a figure does not apply), one summary."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

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


def kernel_named(asked: str, resolved: str) -> str:
    """The attention kernel as the block names it: the one that runs, after what was asked where they differ (auto)."""
    return resolved if asked == resolved else f"{asked}: {resolved}"


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
                how = ("FlashAttention-4" + (" with its window" if window is not None else "")
                       if kernel.endswith("fa4") else describe_how(window, shape.sinks, on_gpu))
                name += (" with sinks" if shape.sinks else "") + f" ({how})"
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
                  deltanet: str | None = None, threads: str | None = None, data: str | None = None,
                  kernels: str | None = None) -> str:
    """The run's start-up summary (run: settings.RunSettings): where it writes, layout, model, length and YaRN, kernel, levers and plan, memory
    (per rank, and `node`: per node), and against `limits_line`'s limits (estimate.fit) whether the plan fits.
    device: "gpu" where the plan is a GPU's (the dry run, a GPU run, a CPU run given --gpu-memory-gb); differs: why
    the run's plan is not the dry run's for the same limits; deltanet: what runs the gated DeltaNet layers (the run's
    resolved kernel and why; None: the GPU run's rule, for the dry run); threads: the CPU threads each rank runs
    (distributed.share_cpu_threads); data: what the data holds and how it trains (data_line, pairs_line); kernels: the
    kernel cache's line (kernel_cache.kernels_line), whose missing kernels estimate.first_extra_s adds to the first
    step."""
    yarn = checked.rope or describe_rope_scaling(checked.model_config)
    layers = text_config(checked.model_config).num_hidden_layers
    offloaded = plan.recompute_layers - plan.keep_on_gpu
    m, model = estimate.memory, run.model
    lines = [
        f"output    {out}" if out is not None else "output    none (dry run)",
        f"layout    {layout_line}",
        *([f"threads   {threads}"] if threads else []),
        f"model     {model.name}: {type(checked.model_config).__name__}, {layers} layers, {num_params / 1e6:,.1f} M "
        "params" + _trained_part(model, checked),
        f"length    {run.stream.seq_len:,} tokens per step, {yarn}",
        *([f"data      {data}"] if data else []),
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
        job = estimate.job
        deltanet_line = job.deltanet_line() if job is not None else None
        # the attention rate the step priced: the kernel the run takes (FlashAttention-4's where it runs)
        head_dim = job.shape.head_dim if job else 128
        attention = job.attention_kernel if job else "auto"
        lines.append(f"step      {estimate.step_s:,.1f} s predicted (model FLOPs at an H200's measured rates: attention "
                     f"{attention_flops_per_s(head_dim, attention) / 1e12:.0f}"
                     f"{' (FlashAttention-4)' if attention == 'fa4' and head_dim <= 128 else ''}, "
                     f"matmul {MATMUL_FLOPS_PER_S / 1e12:.0f} TF/s"
                     + ("; packed documents take less" if run.stream.shape.packing else "")
                     + (f"; {deltanet_line}" if deltanet_line else "") + ")"
                     + (f"; the first step {estimate.step_s + estimate.first_extra_s:,.1f} s, its kernels not in "
                        "the kernel cache (kernels line)" if estimate.first_extra_s else ""))
    return "\n".join(["ulysses_lc " + ("dry run" if run.dry_run else "run")] + ["  " + line for line in lines])


_FORMATS = {"text": "plain text", "messages": "chat messages", "prompt_completion": "prompt + completion",
            "token ids": "token ids"}


def data_line(source: str, stream, shape, steps: int, global_batch: int) -> str:
    """The start-up block's `data` line (stream: a data.TokenStream; shape: data.DataSettings): the source, the format
    found, samples and tokens, the loss, packing with its padding and split samples, the token cache (the one place
    the run names it) and, where the source holds fewer sequences than the run takes, how often it repeats."""
    st = stream.stats
    fmt, count = st.get("sample_format"), st.get("documents")
    if fmt:
        what = _FORMATS[fmt] + (f" (column {shape.text_column})" if shape.text_column else "")
        what += f", {_count(count, 'sample')}" if count else ""
    else:
        what = f"{_count(count, 'plain-text document')} joined into one stream" if count else "plain text"
    parts = [f"{source}: {what}, {stream.num_tokens:,} tokens"]
    loss = st.get("loss_on_resolved")
    if loss is not None:
        parts.append("loss on every token" if loss == "all" else "loss on the completions only (assistant turns)")
    if stream.packed:
        share = int(stream.documents.padding.sum()) / stream.num_tokens
        split = st.get("split_samples")
        parts.append(f"packed into {_count(len(stream), 'window')}, {100 * share:.1f}% padding"
                     + (f", {_count(split, 'sample')} longer than --seq-len split into pieces" if split else ""))
    if stream.cache_path is not None:
        parts.append(f"{'read from' if stream.cache_hit else 'tokenized into'} the token cache "
                     f"{Path(stream.cache_path).parent}")
    parts.append(_repeats(len(stream), steps, global_batch))
    return "; ".join(p for p in parts if p)


def pairs_line(source: str, pairs, packing: bool, steps: int, global_batch: int) -> str:
    """The `data` line of preference training (pairs: a data.PairStream); past half a sequence of padding without
    --packing, it says what --packing would fit."""
    sizes = [2 * len(p) + len(c) + len(r) for window in pairs.windows for p, c, r in window]
    tokens, n = sum(sizes), len(sizes)
    padding = 1 - tokens / (len(pairs) * pairs.seq_len)
    line = (f"{source}: {_count(n, 'preference pair')}, {tokens:,} tokens, "
            f"{'packed into ' if packing else 'one per sequence: '}{_count(len(pairs), 'sequence')}, "
            f"{100 * padding:.0f}% padding")
    if padding > 0.5 and not packing:
        line += (f" (over half of each sequence: --packing puts whole pairs together, about "
                 f"{max(1, int(pairs.seq_len // (tokens / n)))} a sequence, for fewer and fuller steps)")
    return "; ".join(p for p in (line, _repeats(len(pairs), steps, global_batch)) if p)


def _repeats(sequences: int, steps: int, global_batch: int) -> str:
    wanted = steps * global_batch
    if sequences >= wanted:
        return ""
    return (f"repeats: {_count(sequences, 'sequence')} for the {wanted:,} of {_count(steps, 'step')}, so the data is "
            f"seen {wanted / sequences:.1f} times")


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}{'s' * (n != 1)}"


def first_step_line(device) -> str | None:
    """What the first step does besides training on a GPU whose kernels are all in the kernel cache (the loop names
    fla's autotuning and flex's compiles where they are not): cuDNN picks its attention plans. None on a CPU."""
    if getattr(device, "type", device) == "cuda":
        return ("step 1: the first; its kernels are chosen and compiled on first use (cuDNN's attention plans, flex's "
                "window kernels), so it takes longer than the steps after it")
    return None


def summary(*, out: Path, records: list[dict], steps: int, start_step: int, checkpoint: str | None,
            export: Path | None, tensorboard: bool, started: float | None = None) -> str:
    """The end of a run (rank 0): wall time since the process started, the steps and tokens this run trained, the
    loss first -> last, throughput, rank 0's peak memory, and where metrics.jsonl, TensorBoard's events, the
    checkpoint and the export are. started: time.time() the wall time counts from (default: the process's start)."""
    import time

    import psutil

    started = psutil.Process().create_time() if started is None else started
    ran = len(records)
    wall = time.time() - started
    lines = [f"done: {steps} steps in {out} ({_duration(wall)} wall)"]
    if records:
        tokens = sum(r["tokens"] for r in records)
        step_s = sum(r["step_time_s"] for r in records)
        gpu = [r["gpu_mem_gb"] for r in records if r.get("gpu_mem_gb") is not None]
        host = max(r["host_rss_gb"] for r in records)
        lines += [
            f"steps     {start_step + 1}-{start_step + ran} trained in this run ({_duration(step_s)} of steps)"
            + (f", resumed from step {start_step}" if start_step else ""),
            f"tokens    {tokens:,}, {tokens / step_s:,.0f} tok/s over the steps",
            f"loss      {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} (step {records[0]['step']} -> "
            f"{records[-1]['step']})",
            f"memory    peak on rank 0: gpu {f'{max(gpu):.1f} GB' if gpu else '-'}, host {host:.1f} GB",
        ]
    lines.append(f"metrics   {out / 'metrics.jsonl'}"
                 + (f"; TensorBoard events in {out / 'tensorboard'}" if tensorboard else ""))
    lines.append(f"checkpoint {checkpoint or 'none'}" + (f" (--resume --output-dir {out} --steps N trains on)"
                                                         if checkpoint else ""))
    if export is not None:
        lines.append(f"export    {export} (a Hugging Face model: from_pretrained loads it)")
    return "\n".join(lines[:1] + ["  " + line for line in lines[1:]])


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def unmade_on_failure(out: Path, writes: bool, trained: list):
    """An ExitStack exit callback that removes the run folder `out` (and a runs/ folder made for it) where this run
    made it and left before a step of it ended (`trained`: the steps ended, empty): a run that never started leaves nothing behind, not
    a folder holding only its lock and run.json. Only the folder's writer (files.FolderOwner.writes) removes it."""
    import shutil

    made = [f for f in (out, out.parent) if not f.exists()] if writes else []

    def remove(exc_type, exc, tb):
        if exc_type is None or trained or not made:
            return
        shutil.rmtree(out, ignore_errors=True)
        for folder in made[1:]:
            try:
                folder.rmdir()  # empty only: another run may have written there meanwhile
            except OSError:
                pass

    return remove


@contextlib.contextmanager
def progress_bars_off():
    """transformers' own progress bars off (its "Writing model shards" at the export: a bar in a log, where the
    summary then says where the export went)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
