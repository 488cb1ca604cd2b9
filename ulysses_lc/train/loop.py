"""The training loop behind examples/train_1m.py: long sequences, one per DP group per micro step, on DeepSpeed ZeRO-3.

Every piece is a library call a user can take on its own (see examples/embed_in_your_loop.py); this
module strings them together with the run's bookkeeping: checks before any heavy work, the token
cache, the engine, logging, checkpoints with resume, and the final Hugging Face export.

Order of work, chosen so that mistakes cost seconds: every rank runs the same cheap checks (preflight.py:
flags, DeepSpeed config, output directory, optional packages, data source, model config and SP split)
before any collective; only then does the process group start, every rank's outcome is agreed (a file on one
node's disk only fails every rank), and the data is tokenized and the weights loaded. From there to the end of
the loop, job_watch.py ends every node's ranks when one fails.
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from ..data import DataRepeats, build_token_stream, check_source, pad_token_id
from ..parallel.distributed import init_distributed, seed_step, share_cpu_threads, world_size
from ..parallel.layout import ParallelLayout, dp_mean, dp_sum
from ..plan.first_step import WHAT
from ..plan.metrics import measure_peak_bf16_tflops, model_flops_per_step
from ..model import SequenceParallelCausalLM
from ..objectives.loss import step_num_items
from ..shape import text_config
from ..parallel.sharding import shard_batch
from ..parallel.zero_reshard import universal_config
from .run_state import (RUN_FILE, check_output_dir, latest_checkpoint, load_checkpoint, new_run_dir, resume_line,
                        save_checkpoint, write_run_file)
from .config import TrainConfig
from .checkpoint_files import agree_on_write, write_failure
from .console import (RunLogger, data_line, first_step_line, kernel_named, layout_line, pairs_line, progress_bars_off,
                      startup_block, summary, unmade_on_failure)
from .divergence import StepGuard
from .engine_start import deepspeed_initialize
from .estimate import (check_node_memory, estimate_memory, job_for, node_beside_bytes, node_line, plan_reservations,
                       run_limits, sized_params)
from .evaluation import RunEvaluation
from .export import EXPORT_DIR, export_hf_model
from .files import agree_on_run_dir, folder_owner
from .kernel_cache import RunKernels, cache_environment
from .loading import load_model, load_tokenizer
from . import job_watch
from .preference_step import (DPOStep, build_pair_stream, load_reference, mean_metrics, pairs_in_step,
                              reference_entry)
from .optimizer import param_groups, set_weight_decay
from .preflight import preflight
from .resume import change_lines, record_resume
from .run_lock import hold_run_folder
from .stop import Stopped, StopRequest
from .same_flags import check_same_flags
from .schedule import Schedule
from .settings import OptimSettings, RunSettings, WatchSettings

logger = logging.getLogger(__name__)


def train(cfg: TrainConfig, on_step=None) -> list[dict]:
    """Run (or resume) training; returns the per-step records (rank 0; other ranks get []).

    on_step(step, record) is called after every step on every rank (record None off rank 0); raising
    from it stops the run there, as a crash would (tests use this to kill a run mid-way).
    """
    if cfg.dry_run:
        raise ValueError("--dry-run: call ulysses_lc.train.dry_run(cfg), which loads nothing and starts no process group.")
    # The flags resolved once (on --resume over the saved run's), split into each part's settings (settings.py); the
    # timeouts first, for the watch below, which starts even when the flags are refused.
    timeouts = WatchSettings(cfg.node_timeout_s, cfg.stop_grace_s)
    run = checked = failure = cache_vars = None
    # The kernel cache's variables from before preflight (the model config's checks import torch's compiler, which
    # reads them) to the run's end (kernel_cache.py).
    with ExitStack() as environment:
        try:
            run = RunSettings(cfg)
            cache_vars = environment.enter_context(cache_environment(run.output.kernel_cache))
            checked = preflight(run, world_size())
        except Exception as e:  # noqa: BLE001 - a rank whose checks failed still joins the agreement below
            if world_size() == 1:
                raise  # nobody to agree with, and no process group to start
            failure = e
        init_distributed()  # any launcher, or one process under plain python
        # Every rank's checks agreed (one failed on one node's disk fails every rank, naming it), then the watch that
        # ends every node's ranks when one fails, for as long as the run lasts. init_distributed bound this rank's
        # GPU, on which NCCL runs the agreement's object collective.
        watch = job_watch.start(failure, node_timeout_s=timeouts.node_timeout_s, stop_grace_s=timeouts.stop_grace_s)
        try:
            with ExitStack() as held:  # the run folder's lock, from before any work to the end (run_lock.py)
                records = _train(run, checked, on_step, held=held, stop=watch.stop_request, cache_vars=cache_vars)
        except Stopped:
            watch.stop(clean=True)  # every rank stopped at the same step: none is a peer gone without a report
            raise
        except BaseException:
            watch.stop(clean=False)
            raise
        watch.stop(clean=True)
    return records


def _train(run: RunSettings, checked, on_step, held: ExitStack, stop: StopRequest, cache_vars: dict) -> list[dict]:
    beside = node_beside_bytes()  # what the node holds beside the job, before it loads anything
    threads = share_cpu_threads()  # each rank its share of the node's cores, before any heavy work
    layout = ParallelLayout.build(checked.sp_size, placement=run.parallel.placement)
    world, sp_size, model_config, ds_config = layout.world_size, layout.sp_size, checked.model_config, checked.ds_config
    model_settings, stream_settings, output, optim = run.model, run.stream, run.output, run.optim
    seq_len, steps, dpo = stream_settings.seq_len, optim.steps, run.objective.dpo
    global_batch = checked.global_batch
    grad_accum = global_batch // layout.dp_size  # micro steps per optimizer step, each DP group one sequence each
    rank0 = layout.rank == 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_same_flags(run.given, layout)  # a node started with other flags would run rank 0's without a word
    # One run folder for the whole job (rank 0's), then who writes what in it and in the token cache: once per
    # folder, whether the nodes share one file system or each has its own disk (files.py).
    out = agree_on_run_dir(checked.out, lambda: new_run_dir(model_settings.name), layout)
    if output.resume and checked.out != out:  # this node's latest run was another: check rank 0's here too
        check_output_dir(out, output.resume)
    run_files = folder_owner(out, layout)
    stepped = []  # the steps of this run that ended: once one has, its folder is kept whatever comes after
    held.push(unmade_on_failure(out, run_files.writes, stepped))  # before the lock: removed after its release
    held.enter_context(hold_run_folder(out, run_files.writes, layout))  # a second job on this folder stops here
    cache_files = folder_owner(stream_settings.cache_dir, layout)
    if rank0:
        logger.info("%s %s%s", "resuming" if output.resume else "writing to", out,
                    "" if layout.num_nodes == 1 else f" (run folder {run_files.describe()}, token cache "
                    f"{cache_files.describe()})")

    tokenizer = load_tokenizer(model_settings.name)
    if dpo:  # every pair read and checked (length, completion tokens) before any weight loads
        stream = build_pair_stream(stream_settings, tokenizer)
        data = pairs_line(stream_settings.source, stream, stream_settings.shape.packing, steps, global_batch)
    else:
        shape = stream_settings.shape.kwargs()
        # A missing path, column or completion fails here, on the first rows, before any weights load.
        check_source(stream_settings.source, tokenizer, seq_len=seq_len, **shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataRepeats)  # the data line says it
            stream = build_token_stream(
                stream_settings.source, tokenizer, seq_len, num_steps=steps * global_batch,
                cache_dir=stream_settings.cache_dir, builder=cache_files.writes, progress=rank0, **shape,
                held_out=run.eval.held_out(layout.dp_size) if run.eval else 0,
            )
        data = data_line(stream_settings.source, stream, stream_settings.shape, steps, global_batch)
    evaluation = RunEvaluation.build(run.eval, stream, stream_settings, tokenizer, layout, cache_files.writes, rank0,
                                     text_config(model_config).vocab_size, pad_token_id(tokenizer)) if run.eval else None

    _stop_before_start(stop, layout, device, out, output.resume)  # a Ctrl-C while the data was tokenized
    torch.manual_seed(run.seed)
    if rank0:  # tens of seconds of silence otherwise, more for a large model
        logger.info("loading the weights of %s%s", model_settings.name, f", ZeRO-3 over {world} ranks" * (world > 1))
    hf_model = load_model(model_settings.name, model_config, model_settings.dtype, run.seed, device, ds_config,
                          checked.peft_config)
    model = SequenceParallelCausalLM(hf_model, layout, kernel=model_settings.kernel,
                                     attention_head_groups=model_settings.attention_head_groups)
    # The plan's parameter count is the dry run's (the config's, on the meta device), so both price the same state.
    num_params = sized_params(checked)

    # No weight decay on biases and norm weights, as Hugging Face's Trainer (optimizer.py); the groups reach the
    # config's optimizer too (DeepSpeed's CPU Adam under optimizer offload), which takes each group's weight_decay.
    groups = param_groups(model, optim.weight_decay)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay, fused=device.type == "cuda")
    schedule = Schedule(optim)  # a function of this object, not the object: LambdaLR would save and load its fields
    if rank0:
        logger.info("starting DeepSpeed's ZeRO-3 engine%s", " and the DPO reference model"
                    if dpo and run.objective.reference == "copy" else "")
    engine, _, _, scheduler = deepspeed_initialize(
        model=model, optimizer=optimizer, model_parameters=groups if optimizer is None else None,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule(step)),
        # Saved on another world size: the engine reads the ZeRO-3 state through DeepSpeed's universal checkpoint.
        config=universal_config(ds_config) if checked.resharded else ds_config, mpu=layout.mpu,
    )
    engine.train()  # from_pretrained returns eval mode, where transformers skips checkpointing altogether
    dpo_step = DPOStep(run.objective, seq_len, layout, text_config(model_config).vocab_size, pad_token_id(tokenizer),
                       load_reference(run, checked, device, layout), adapters=bool(model_settings.lora_r)) \
        if dpo else None
    # After deepspeed.initialize: ZeRO-3's partitions exist; AdamW's moments, due at the first step, are reserved.
    # The plan is the dry run's for this machine's limits (the same Job.plan, within the same budget): only device
    # memory held outside this job (another process) changes it, and the plan line says so. One that does not fit
    # stops here.
    limits, limits_line = run_limits(run.plan, checked, device, layout) or (None, None)
    ranks_here = layout.ranks_on_node()
    job = job_for(run, checked, num_params, ranks_here)
    reserve = plan_reservations(job, limits) if limits else {}
    model.probe_attention(device, model_settings.dtype)  # a kernel that refuses this model's call is known first
    plan = model.plan_step(seq_len, device, packed=stream_settings.packed_documents,
                           long_documents=stream_settings.long_documents, **reserve).with_overrides(*run.plan.overrides)
    model.use_plan(plan, release_cached_memory=job.release_cached_memory)
    kernels = RunKernels.build(run.output.kernel_cache, cache_vars, job.shape, seq_len, model.deltanet_kernel, layout,
                               device, model.attention.kernel)
    estimate = estimate_memory(run, checked, plan, num_params, limits, ranks_here, uncached=kernels.uncached)
    dry = job.plan(seq_len, limits).with_overrides(*run.plan.overrides) if limits else plan
    if rank0:
        logger.info(startup_block(
            out=out, run=run, checked=checked, layout_line=layout_line(layout, checked.global_batch),
            num_params=num_params, kernel=kernel_named(model_settings.kernel, model.attention.kernel), plan=plan,
            estimate=estimate, device="gpu" if limits else "cpu", limits_line=limits_line, deltanet=model.deltanet,
            threads=threads, data=data, kernels=kernels.line(),
            node=node_line(estimate, ranks_here, beside) if limits else None,
            differs=None if plan == dry else "device memory is in use outside this job's allocator and CUDA context "
                                             "(another process on this GPU?), which the dry run's plan needs"))
        if evaluation is not None:
            logger.info("  " + evaluation.describe())
    if device.type == "cuda":  # a CPU run's memory is no GPU node's
        check_node_memory(estimate, ranks_here, beside)
    estimate.check()

    if run.objective.reference == "precomputed":  # before a checkpoint loads: the model as loaded is the reference
        entry = reference_entry(model_settings, model_config, tokenizer, stream, stream_settings.cache_dir, layout)
        hit = dpo_step.precompute(engine, stream, entry, cache_files.writes, device)
        if rank0:
            logger.info("DPO reference log-probabilities of %d sequences %s the token cache", len(stream),
                        "read from" if hit else "computed once, written to")

    start_step = 0
    if output.resume:
        start_step = load_checkpoint(engine, out, stream, layout, schedule=schedule)
        extended = schedule.extend(start_step, steps)
        _apply_lr(scheduler, schedule, optim)  # a new --lr or --weight-decay; the checkpoint's lr otherwise, as saved
        loaded = {**checked.saved, "step": start_step, "position": stream.position}  # an older one where it is damaged
        if rank0:
            for line in [resume_line(loaded, world, sp_size, global_batch), *change_lines(run.changed),
                         *([extended] if extended else [])]:
                logger.info(line)
    failed = None
    try:  # run.json, one writer a folder: a disk that refuses it stops every rank here, with the cause
        if run_files.writes and output.resume:
            record_resume(out, run.flags, start_step, run.changed, sp_size, world)  # the old one stays on a failure
        elif run_files.writes:
            write_run_file(out, run.flags, sp_size, world)
    except OSError as e:
        failed = write_failure(out / RUN_FILE, e, latest_checkpoint(out) if output.resume else None)
    agree_on_write(failed)

    # FLOPs of one sequence over the sp_size GPUs that share it: per-GPU figures hold for any DP size. Without a
    # GPU the figures mean nothing, so the line shows "-".
    flops = model_flops_per_step(model_config, seq_len, recompute_layers=plan.recompute_layers,
                                 cached_attention_layers=plan.cache_attention_layers) \
        if device.type == "cuda" and not dpo else None  # DPO: pairs shorter than seq_len, a reference forward: "-"
    peak = measure_peak_bf16_tflops(device) if device.type == "cuda" else None
    _stop_before_start(stop, layout, device, out, output.resume)  # while the weights loaded and the engine started
    stop.training = True
    guard = StepGuard(engine, layout, out, run, run_files.writes)  # from the weights as loaded (divergence.py)
    records = []
    with RunLogger(
        out, steps, tokens_per_step=seq_len * global_batch, world_size=sp_size, flops=flops,
        peak_tflops=peak, rank=layout.rank, start_step=start_step, tensorboard=output.tensorboard,
        wandb_run=_start_wandb(output.wandb_project, run.flags, out) if rank0 and output.wandb_project else None,
    ) as step_logger:
        if evaluation is not None and run.eval.at_start:
            evaluation(engine, start_step, step_logger)
        for step in range(start_step, steps):
            if step == start_step and rank0 and kernels.uncached:
                logger.info("step %d: the first; %s in it, about %.0f s, once: kept in %s", step + 1,
                            " and ".join(WHAT[kind] for kind in kernels.uncached), estimate.first_extra_s,
                            kernels.folder)
            elif step == start_step and rank0 and (first := first_step_line(device)):
                logger.info(first.replace("step 1:", f"step {step + 1}:"))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            # The lr this step trains with: engine.step() advances the schedule at the step's last micro step, after
            # which get_last_lr() is the next step's.
            lr = scheduler.get_last_lr()[0]
            losses, aux_losses, trained, documents, padding, pair_metrics = [], [], 0, 0, 0, []
            step_pairs = pairs_in_step(stream, stream.position, global_batch) if dpo else None
            # Micro step i, DP group j: window position + i * dp_size + j, so that the step takes the next
            # global_batch sequences however they are split over DP groups and micro steps.
            windows = [stream.position + micro * layout.dp_size + layout.dp_rank for micro in range(grad_accum)]
            if not dpo:  # every micro step's sequence first: its labels count in every sequence's token loss
                samples = [stream.sample(window) for window in windows]
                batches = [shard_batch(sample.input_ids, layout, labels=sample.labels, pad_token_id=pad_token_id(tokenizer),
                                       vocab_size=text_config(model_config).vocab_size,
                                       document_lengths=sample.document_lengths,
                                       attention_mask=sample.attention_mask).to(device) for sample in samples]
                # Tokens weigh the same across micro steps and DP groups, as in transformers' Trainer
                # (docs/weighting.md): each sequence's summed token losses over the step's labels per sequence, which
                # DeepSpeed's mean over the step's global_batch sequences turns into the step's token mean.
                per_sequence = step_num_items([batch.labels for batch in batches], layout) / global_batch
            for micro in range(grad_accum):
                seed_step(run.seed, layout.rank, step, micro)  # per rank and step: dropout masks differ by rank
                if dpo:
                    sample = stream.sample(windows[micro])
                    loss, metrics, n_trained, n_documents, n_padding = dpo_step(
                        engine, sample, device, windows[micro] % len(stream), step_pairs=step_pairs,
                        step_sequences=global_batch)
                    pair_metrics.append(metrics)
                else:
                    sample = samples[micro]
                    loss = engine(**batches[micro].as_kwargs(), num_items_in_batch=per_sequence)
                    if model.last_aux_loss is not None:  # MoE: loss holds router_aux_loss_coef x this too
                        aux_losses.append(model.last_aux_loss)
                    n_trained, n_documents, n_padding = model.last_num_tokens, sample.num_documents, sample.padding_tokens
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps: the step's mean
                engine.step()  # the optimizer steps at the last micro step only
                losses.append(loss.detach())
                trained = trained + n_trained
                documents, padding = documents + n_documents, padding + n_padding
            trained, documents, padding = dp_sum([trained, documents, padding], layout)
            # The host syncs of the step: the logged numbers (SFT: the token mean; DPO: the pair mean).
            loss_value = dp_mean(torch.stack(losses).mean(), layout)
            aux_value = dp_mean(torch.stack(aux_losses).mean(), layout) if aux_losses else None
            step_time = time.perf_counter() - t0
            if step == start_step:
                kernels.first_step_done(step_time)
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            failed = None
            try:
                record = step_logger.log(
                    step + 1, loss=loss_value, step_time_s=step_time, grad_norm=grad_norm,
                    lr=lr, offload_host_gb=model.checkpointing.host_bytes / 1e9,
                    # Unpacked windows are one causal stream each: no document count to show.
                    trained_tokens=trained, documents=documents if stream_settings.packed_documents else 1,
                    padding_share=padding / (seq_len * global_batch),
                    **(mean_metrics(pair_metrics, step_pairs, layout) if dpo else {}),
                    **({"aux_loss": aux_value} if aux_losses else {}),
                )
            except OSError as e:  # the disk refused metrics.jsonl (rank 0's): every rank stops at the boundary below
                record, failed = None, f"step {step + 1}: " + write_failure(
                    Path(e.filename) if e.filename else step_logger.jsonl_path, e, latest_checkpoint(out))
            stream.position += global_batch
            if record is not None:
                records.append(record)
            done = step + 1
            stepped.append(done)
            # The loss is the same on every rank (SP-reduced, then the DP mean), the norms are global, so every
            # rank stops here together: before this step's checkpoint.
            guard.after_step(done, loss_value, grad_norm)
            # A SIGTERM, SIGINT or launcher's end on any rank (stop.py), or a write refused (SaveFailed on every rank).
            stopping = stop.agreed(layout, device, failed)
            if (output.save_every and done % output.save_every == 0) or done == steps or stopping:
                guard.before_save(done, loss_value, grad_norm)
                save_checkpoint(engine, out, done, stream, keep=output.keep_checkpoints, writes=run_files.writes,
                                schedule=schedule, layout={"world_size": world, "sp_size": sp_size, "global_batch": global_batch})
            if evaluation is not None and not stopping and run.eval.due(done, steps):
                evaluation(engine, done, step_logger)
            if on_step is not None:
                on_step(done, record)
            if stopping and done < steps:
                raise Stopped(f"stopped at step {done} of {steps} by {stopping}; checkpoint "
                              f"{latest_checkpoint(out)} written: --resume --output-dir {out} continues", stop.code)

    if output.export:
        with progress_bars_off():
            export_hf_model(engine, model, tokenizer, out / EXPORT_DIR, layout, merged=output.export_merged)
    if rank0:
        logger.info(summary(out=out, records=records, steps=steps, start_step=start_step, checkpoint=latest_checkpoint(out),
                            export=out / EXPORT_DIR if output.export else None, tensorboard=output.tensorboard))
    return records


def _stop_before_start(stop: StopRequest, layout: ParallelLayout, device, out: Path, resume: bool) -> None:
    """Collective: a stop asked during the start-up (a Ctrl-C while the data tokenized or the weights loaded) ends it
    there, on every rank, before a step is trained: nothing is saved (a resume's checkpoint stays as it was)."""
    stopping = stop.agreed(layout, device)
    if stopping:
        then = f"--resume --output-dir {out} continues from {latest_checkpoint(out)} as before" if resume else \
            "nothing was trained; the same command starts the run"
        raise Stopped(f"stopped before training started by {stopping}: {then}", stop.code)


def _apply_lr(scheduler, schedule: Schedule, optim: OptimSettings) -> None:
    """The resumed optimizer's lr and weight decay from `optim` at the loaded step: the checkpoint holds the saved
    run's (LambdaLR's base lr, the optimizer's groups), which a new --lr would otherwise leave in place."""
    scheduler.base_lrs = [optim.lr for _ in scheduler.base_lrs]
    lr = optim.lr * schedule(scheduler.last_epoch)
    for group in scheduler.optimizer.param_groups:
        group["lr"] = lr
    set_weight_decay(scheduler.optimizer, optim.weight_decay)  # the exempt group stays at 0
    scheduler._last_lr = [lr for _ in scheduler.base_lrs]


def _start_wandb(project: str, flags: TrainConfig, out: Path):
    import wandb

    # One W&B run per run directory: a resumed run continues it (its id is the directory's name).
    run_id = re.sub(r"[^\w-]", "-", out.name)  # W&B ids take letters, digits, '-' and '_'
    return wandb.init(project=project, name=out.name, id=run_id, resume="allow", dir=str(out), config=asdict(flags))
