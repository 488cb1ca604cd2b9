"""Sequence parallelism side by side: ulysses_lc's step against DeepSpeed ALST's, and what the all-to-all costs.

    python benchmarks/bench_sp.py --suite sp2 --budget-s 560 --out results/   # two GPUs (issue 15)
    python benchmarks/bench_sp.py --smoke --out /tmp/sp_smoke                 # CPU, gloo, 2 ranks, tiny shapes

The parent process starts each variant as its own process group (torchrun, one process per rank, rank r on
GPU r), so an out-of-memory step costs that variant only: a rank that fails writes its record at once and
exits, torchrun ends the others (a rank left waiting in a collective included), and the parent kills the
group if it outlives its time. A time guard skips variants (or the rest of a group of variants compared with
each other) whose estimate no longer fits in --budget-s, and records them as skipped.

What a step is, for both implementations at every sp: one sequence of `seq` random tokens (the same tokens),
batch 1, the same seed weights of a public Qwen3 shape (common.build_model: bf16 on CUDA, fp32 on CPU),
forward + backward + optimizer step through a DeepSpeed ZeRO-3 engine (the shipped zero3 config: bf16, gradient
clipping 1.0) around torch.optim.AdamW(lr=1e-5, fused on CUDA). Timed: one step after one warm-up step
("full": warm-up at the same length, so the timed step is a steady one: pinned host buffers, the allocator's
segments and attention plans exist; "short": warm-up at 8k tokens, used where one step takes minutes, so the
timed step also pays those first-time costs). Step time is the slowest rank's; peak GPU memory
(torch.cuda.max_memory_allocated over the timed step) and host memory (RSS, peak RSS) are per rank.

  ours  ulysses_lc.SequenceParallelCausalLM over ParallelLayout.build(sp), batches from shard_batch, every lever
        on (kernel "auto": cuDNN first on Hopper, head groups "auto"), and the memory plan the training path
        uses (SequenceParallelCausalLM.plan_step: free device and host memory, minimum over ranks, AdamW's
        moments still to come reserved), set before the first step.
  alst  DeepSpeed's sequence-parallel path as deepspeed/runtime/sequence_parallel/ulysses_sp.py and
        ArcticTraining's SFTTrainer.loss wire it: UlyssesSPAttentionHF.register_with_transformers(model, "sdpa"),
        batches sharded by UlyssesSPDataLoaderAdapter, the TiledMLP monkey patch, TiledFusedLogitsLoss over
        ~1 GiB fp32 logit shards with the differentiable all_gather weighted loss average, HF non-reentrant
        checkpointing inside DeepSpeed's CheckpointHiddenStatesOffload, cuDNN-first SDPA around forward and
        backward (the pieces bench_step.setup_alst wires, from common.py).

A variant with `profile` times its timed step with timers around every Ulysses exchange and every attention
kernel call (`ExchangeProfile`: two CUDA events per call, a few hundred calls a step, no synchronisation until
the step's end): the exchange's share of the step, split into forward, backward and checkpoint recompute.

Writes <out>/results_<suite>.json (meta, one merged record per variant with its per-rank records, the
comparisons), <out>/table_<suite>.txt (printed last) and <out>/log_<suite>.txt (each variant's output).
GB are 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GB,
    IGNORE_INDEX,
    K,
    SHAPES,
    alst_loss_sum,
    build_model,
    cell,
    child_env,
    cudnn_first,
    end_peak,
    install_alst_tiled_mlp,
    launch,
    list_variants,
    local_device,
    peak_cell,
    random_tokens,
    record_failure,
    runner_args,
    short,
    skipped,
    slug,
    start_peak,
    sync,
    time_guard,
    warmup_tokens,
    write_outputs,
    write_record,
)

LR = 1e-5


def _ds_config(dev, extra=None) -> dict:
    from ulysses_lc.parallel.ds_config import load_deepspeed_config

    config = load_deepspeed_config("zero3")
    config["bf16"] = {"enabled": dev.type == "cuda"}
    config.update(extra or {})
    return config


# ---- timers around the exchange and the attention kernel ----

class ExchangeProfile:
    """Timers around each Ulysses exchange and each attention kernel call of a step, by phase.

    Installed on ulysses_lc.parallel.exchange's autograd Functions and ulysses_lc.mixers.kernels' table for the profiled step
    only (the library is not edited): the q/k/v exchange (_QKVSeqToHeads: one all-to-all for the three, and
    one back in backward), the output exchange (_SeqAllToAll) and the explicit attention kernel's forward and
    backward (kernels._EXPLICIT, what the kept-output and head-group paths call). A forward-direction call made while
    the loss's backward runs is the checkpoint recompute. On CUDA the timers are CUDA events on the stream the
    call runs on (the compute stream), so an exchange's time is what the step waits for it: packing copies,
    NCCL's all-to-all and waiting for the peer rank. On CPU they are wall-clock.
    """

    def __init__(self, dev):
        self.dev = dev
        self.phase = "forward"  # set by the step: "backward" once the loss's backward starts
        self.calls = []  # (what, phase, start, end, bytes)
        self._undo = []

    def _now(self):
        if self.dev.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timed(self, what, fn, backward):
        profile = self
        exchange = what.startswith("exchange")

        def wrapper(*args):
            phase = "backward" if backward else ("recompute" if profile.phase == "backward" else profile.phase)
            # What one rank hands the all-to-all (it keeps 1/sp of it, sends the rest).
            nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)) if exchange else 0
            start = profile._now()
            out = fn(*args)
            profile.calls.append((what, phase, start, profile._now(), nbytes))
            return out

        return wrapper

    def install(self):
        from ulysses_lc import attention, exchange, explicit_attention as kernels

        for what, cls in (("exchange_qkv", exchange._QKVSeqToHeads), ("exchange_out", exchange._SeqAllToAll)):
            for method in ("forward", "backward"):
                original = cls.__dict__[method]
                setattr(cls, method, staticmethod(self._timed(what, original.__func__, method == "backward")))
                self._undo.append(lambda cls=cls, method=method, original=original: setattr(cls, method, original))
        for backend, (fwd, bwd) in list(kernels._EXPLICIT.items()):
            kernels._EXPLICIT[backend] = (self._timed("attention_kernel", fwd, False),
                                          self._timed("attention_kernel", bwd, True))
            self._undo.append(lambda b=backend, pair=(fwd, bwd): kernels._EXPLICIT.__setitem__(b, pair))
        original_causal = attention.causal_attention
        # The fallback through F.scaled_dot_product_attention: its forward only (autograd runs its backward).
        attention.causal_attention = self._timed("attention_fallback_fwd", original_causal, False)
        self._undo.append(lambda: setattr(attention, "causal_attention", original_causal))
        return self

    def undo(self):
        while self._undo:
            self._undo.pop()()

    def summary(self, step_s: float) -> dict:
        """Seconds, calls and bytes per (what, phase); the exchange's and the kernel's share of `step_s`."""
        sync(self.dev)
        rows = {}
        for what, phase, start, end, nbytes in self.calls:
            seconds = start.elapsed_time(end) / 1e3 if self.dev.type == "cuda" else end - start
            row = rows.setdefault(f"{what}/{phase}", dict(seconds=0.0, calls=0, bytes=0))
            row["seconds"] += seconds
            row["calls"] += 1
            row["bytes"] += nbytes
        exchange = sum(r["seconds"] for k, r in rows.items() if k.startswith("exchange"))
        kernel = sum(r["seconds"] for k, r in rows.items() if k.startswith("attention"))
        exchange_bytes = sum(r["bytes"] for k, r in rows.items() if k.startswith("exchange"))
        return dict(
            timer="cuda events" if self.dev.type == "cuda" else "wall clock", step_s=step_s, rows=rows,
            exchange_s=exchange, attention_kernel_s=kernel, rest_s=step_s - exchange - kernel,
            exchange_share=exchange / step_s, attention_kernel_share=kernel / step_s,
            exchange_gb=exchange_bytes / GB, exchange_gb_per_s=exchange_bytes / GB / exchange if exchange else None,
        )


# ---- the two implementations: each returns (engine, batch_fn(ids_cpu) -> batch, step(batch, profile)) ----

def setup_ours(model, sp: int, seq: int, dev, rec: dict):
    import deepspeed

    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, check_deepspeed_config, shard_batch

    layout = ParallelLayout.build(sp)
    wrapper = SequenceParallelCausalLM(model, layout)
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=LR, fused=dev.type == "cuda")
    config = check_deepspeed_config(_ds_config(dev), layout, gradient_accumulation_steps=1)
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=config, mpu=layout.mpu)
    engine.train()
    # Exactly the training path's plan (train() calls it right after deepspeed.initialize, as here), which
    # reserves the AdamW moments the first step will allocate.
    plan = wrapper.plan_step(seq, dev)
    wrapper.use_plan(plan)
    rec["plan"] = dataclasses.asdict(plan)
    vocab = model.config.vocab_size

    def batch_fn(ids):
        return shard_batch(ids, layout, vocab_size=vocab).to(dev).as_kwargs()

    def step(batch, profile=None):
        loss = engine(**batch)
        if profile:
            profile.phase = "backward"
        engine.backward(loss)
        if profile:
            profile.phase = "optimizer"
        engine.step()
        return loss.detach()

    step.report = lambda: wrapper.checkpointing.report()
    return engine, batch_fn, step


def setup_alst(model, sp: int, seq: int, dev, rec: dict):
    import deepspeed
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from torch.utils.data import DataLoader

    if sp < 2:
        raise ValueError("alst variants run at sp >= 2 (register_with_transformers does nothing at sp 1)")
    if model.config.tie_word_embeddings and not rec.get("keep_tied"):
        # Under ZeRO-3 a tied head fails: TiledFusedLogitsLoss runs the head's backward inside the forward, so
        # the shared weight's gradient hook fires there and again in the embedding's backward, and ZeRO-3
        # asserts on one parameter twice in a reduction bucket (suite "alst-head" reproduces it on CPU). So
        # ALST gets an untied head holding a copy of the embedding: the same function and first loss, and
        # vocab x hidden more parameters to gather and update.
        untie_head(model)
        rec["untied_head"] = True
    install_alst_tiled_mlp()
    # Overwrites transformers' global "sdpa" entry with DeepSpeed's wrapper (this process only).
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1, seq_length=seq,
        seq_length_is_variable=True,
    )
    sp_group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=dev.type == "cuda")
    config = _ds_config(dev, dict(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    # ZeRO-3 gathers a weight at every call of its module: TiledMLP calls the MLP's three projections once per
    # shard (ceil(seq_local / hidden) shards: 128 at 128k local tokens on the 0.6B shape), in forward, recompute
    # and backward. A persistence threshold above the model's largest weight keeps every weight gathered (ZeRO-3
    # then partitions gradients and optimizer state only): the variant that measures what those gathers cost.
    config["zero_optimization"].update(rec.get("zero_overrides") or {})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    engine.train()
    offload_ctx = get_checkpoint_hidden_states_offloading_ctx_manager()

    def batch_fn(ids):
        # Every rank passes the same sequence; the adapter gathers one sample per rank and hands out the
        # first sample's shards first: this rank's slice of `ids`, labels shifted as "shift_labels".
        sample = dict(input_ids=ids[0], labels=ids[0].clone(), position_ids=torch.arange(ids.shape[1]))
        adapter = UlyssesSPDataLoaderAdapter(DataLoader([sample], batch_size=1), sp_rank=sp_rank, sp_group=sp_group,
                                             sp_world_size=sp, device=dev)
        batch = next(iter(adapter))
        return {k: v.to(dev) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def step(batch, profile=None):
        labels = batch["shift_labels"]
        with cudnn_first(), offload_ctx:
            hidden = engine.module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                         use_cache=False).last_hidden_state
            good = (labels != IGNORE_INDEX).sum()
            loss = alst_loss_sum(engine.module, hidden, labels) / good.clamp(min=1)
            # ArcticTraining's differentiable weighted average of the ranks' losses.
            losses = dist_fn.all_gather(loss, group=sp_group)
            goods = dist_fn.all_gather(good, group=sp_group)
            loss = sum(l * g for l, g in zip(losses, goods)) / sum(goods)
            engine.backward(loss)
        engine.step()
        return loss.detach()

    step.report = lambda: vars(offload_ctx.stats)
    return engine, batch_fn, step


def untie_head(model):
    """Give a tied LM head its own weight, a copy of the embedding's (the same function, separate updates)."""
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False


# ---- one variant, on every rank of its process group ----

def _timed_step(step, batch, dev, profile=None):
    sync(dev)
    t0 = time.perf_counter()
    loss = step(batch, profile)
    sync(dev)
    return time.perf_counter() - t0, float(loss)


def run_rank(spec: dict, out_dir: Path) -> int:
    """Build, warm up, time one step (and profile one more); write this rank's record; never raises."""
    rank = int(os.environ.get("RANK", "0"))
    rec = dict(spec, rank=rank, status="error", phase="setup")
    dev = local_device()
    try:
        import deepspeed
        import torch.distributed as dist

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            rec["device_name"] = torch.cuda.get_device_name(dev)
        deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo", verbose=False)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model = build_model(spec["shape"], spec.get("layers"), seed=0, dtype=dtype, device=dev)
        if spec.get("untie_head"):  # ours on the model ALST trains (its tied head fails under ZeRO-3)
            untie_head(model)
            rec["untied_head"] = True
        config = model.config
        rec["layers"] = config.num_hidden_layers
        setup = {"ours": setup_ours, "alst": setup_alst}[spec["kind"]]
        sp, seq, vocab = spec["sp"], spec["seq"], config.vocab_size
        engine, batch_fn, step = setup(model, sp, seq, dev, rec)

        rec["phase"] = "warmup"
        warm_len = warmup_tokens(spec)
        rec["warmup_tokens"] = warm_len
        rec["warmup_s"], rec["loss_warmup"] = _timed_step(step, batch_fn(random_tokens(warm_len, vocab)), dev)

        rec["phase"] = "measure"
        batch = batch_fn(random_tokens(seq, vocab))
        start_peak(rec, dev)  # static_gb: ZeRO-3 partitions + optimizer state + batch
        profile = ExchangeProfile(dev).install() if spec.get("profile") else None
        try:
            rec["step_s"], rec["loss"] = _timed_step(step, batch, dev, profile)
        finally:
            if profile is not None:
                profile.undo()
        if profile is not None:
            rec["profile"] = profile.summary(rec["step_s"])
        end_peak(rec, dev)
        rec["offload_report"] = step.report()
        rec["status"] = "ok"
        rec.pop("phase")
        _write(rec, out_dir)
        dist.barrier()
        dist.destroy_process_group()  # a clean exit: no TCPStore warnings from the peers
        return 0
    except BaseException as e:  # noqa: BLE001 - a benchmark records every failure and moves on
        record_failure(rec, e, dev)
        _write(rec, out_dir)
        return 1


def _write(rec: dict, out_dir: Path):
    write_record(rec, out_dir / f"{slug(rec['name'])}.rank{rec['rank']}.json", hide=("traceback", "profile"))


# ---- suites ----

def _v(name, kind, sp, seq, est_s, shape="qwen3-0.6b", **kw):
    return dict(name=name, kind=kind, sp=sp, ranks=sp, seq=seq, est_s=est_s, shape=shape, **kw)


SUITES = {
    # Issue 15, in priority order. A group runs only when all of it still fits (a comparison needs both sides).
    # est_s: ~25 s of process start, model build and engine, plus the steps as measured before this runner
    # (H200s, 2026-11-29/30: ours 29.5 s/step at 256k sp 2 and 57.5 s at sp 1; DeepSpeed's ALST pieces 84 s at
    # 256k sp 1; ours 27.4 s for the 8B shape at 131k sp 2; benchmarks/reports/).
    "sp2": [
        _v("ours-sp2@256k", "ours", 2, 256 * K, 90, group="0.6B@256k", profile=True),
        _v("alst-sp2@256k", "alst", 2, 256 * K, 120, group="0.6B@256k"),
        _v("ours-sp1@256k", "ours", 1, 256 * K, 140, group="0.6B@256k"),
        # Where ALST's time goes: the same step with every weight kept gathered (warm-up at 8k: it was run in
        # the time left after the first pass).
        _v("alst-sp2-persist@256k", "alst", 2, 256 * K, 100, warmup="short", group="alst-persist",
           zero_overrides={"stage3_param_persistence_threshold": 1e12}),
        _v("ours-sp2-8B@128k", "ours", 2, 128 * K, 85, shape="qwen3-8b", group="8B@128k"),
        _v("alst-sp2-8B@128k", "alst", 2, 128 * K, 105, shape="qwen3-8b", group="8B@128k"),
        # The same pair, warm-up at 8k, where the full warm-ups no longer fit; then ours alone.
        _v("ours-sp2-8B@128k", "ours", 2, 128 * K, 65, shape="qwen3-8b", warmup="short", group="8B@128k-short",
           only_if_skipped="8B@128k"),
        _v("alst-sp2-8B@128k", "alst", 2, 128 * K, 80, shape="qwen3-8b", warmup="short", group="8B@128k-short",
           only_if_skipped="8B@128k"),
        _v("ours-sp2-8B@128k", "ours", 2, 128 * K, 65, shape="qwen3-8b", warmup="short", group="8B@128k-ours",
           only_if_skipped="8B@128k-short"),
        _v("ours-sp2-4B@256k", "ours", 2, 256 * K, 130, shape="qwen3-4b", warmup="short", group="4B@256k"),
        _v("alst-sp2-4B@256k", "alst", 2, 256 * K, 160, shape="qwen3-4b", warmup="short", group="4B@256k"),
        _v("ours-sp2@512k", "ours", 2, 512 * K, 170, warmup="short", group="0.6B@512k"),
        _v("alst-sp2@512k", "alst", 2, 512 * K, 230, warmup="short", group="0.6B@512k"),
    ],
    "smoke": [
        _v("ours-sp2", "ours", 2, 512, 40, shape="tiny", group="tiny", profile=True),
        _v("alst-sp2", "alst", 2, 512, 40, shape="tiny", group="tiny"),
        _v("ours-sp1", "ours", 1, 512, 40, shape="tiny", group="tiny"),
    ],
    # The tied head: DeepSpeed's path with it kept fails under ZeRO-3 (the assertion that makes the ALST variants
    # untie it); ours on the untied model ALST then trains reaches ALST's loss after the step (CPU, fp32).
    "alst-head": [
        _v("alst-sp2-tied", "alst", 2, 512, 40, shape="tiny", keep_tied=True),
        _v("ours-sp2-untied", "ours", 2, 512, 40, shape="tiny", untie_head=True),
        _v("alst-sp2", "alst", 2, 512, 40, shape="tiny"),
    ],
}


# ---- the parent ----

def run_variant(spec: dict, rec_dir: Path, timeout_s: float, log) -> dict:
    """Launch one variant's process group and merge its ranks' records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['ranks']}",
           str(Path(__file__).resolve()), "--child", json.dumps(spec), "--child-out", str(rec_dir)]
    paths = [rec_dir / f"{slug(spec['name'])}.rank{r}.json" for r in range(spec["ranks"])]
    text, returncode, timed_out, wall = launch(cmd, child_env(OMP_NUM_THREADS="1"), timeout_s, log, spec["name"])
    ranks = [json.loads(p.read_text()) if p.exists() else None for p in paths]
    for p in paths:
        p.unlink(missing_ok=True)
    return merge_ranks(spec, ranks, "timeout" if timed_out else None, returncode, text, wall)


def merge_ranks(spec, ranks, outcome, returncode, output, wall) -> dict:
    """One record per variant: the slowest rank's step, the largest per-rank memory, rank 0's loss."""
    rec = dict(spec, wall_s=wall, ranks_records=ranks)
    got = [r for r in ranks if r is not None]
    failed = [r for r in got if r["status"] != "ok"]
    if len(got) == len(ranks) and not failed:
        rec["status"] = "ok"
        for key in ("step_s", "warmup_s", "peak_gb", "peak_reserved_gb", "static_gb", "host_rss_gb", "host_maxrss_gb"):
            values = [r[key] for r in got if r.get(key) is not None]
            if values:
                rec[key] = max(values)
        rec["host_maxrss_gb_sum"] = sum(r.get("host_maxrss_gb", 0.0) for r in got)
        for key in ("loss", "loss_warmup", "loss_profiled", "layers", "plan", "offload_report", "profile",
                    "warmup_tokens"):
            if key in got[0]:
                rec[key] = got[0][key]
        rec["loss_ranks_agree"] = len({round(r["loss"], 6) for r in got}) == 1
    elif failed:
        first = failed[0]
        rec["status"] = first["status"]
        rec["error"] = f"rank {first['rank']} ({first.get('phase')}): {first.get('error', '')}"
        peaks = [r.get("peak_gb_at_failure") for r in failed if r.get("peak_gb_at_failure") is not None]
        if peaks:
            rec["peak_gb_at_failure"] = max(peaks)
    else:
        rec["status"] = "timeout" if outcome == "timeout" else "crashed"
        rec["returncode"] = returncode
        rec["output_tail"] = (output or "")[-1500:]
    if rec["status"] == "ok":
        from ulysses_lc.plan.metrics import model_flops_per_step

        flops = model_flops_per_step(_config(spec), spec["seq"])
        rec["tflops_model_per_gpu"] = flops.model / rec["step_s"] / spec["ranks"] / 1e12
    return rec


def _config(spec):
    from transformers import Qwen3Config

    kw = dict(SHAPES[spec["shape"]])
    if spec.get("layers"):
        kw["num_hidden_layers"] = spec["layers"]
    return Qwen3Config(**kw)


def run_suite(variants, out_dir: Path, budget_s: float, log) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as rec_dir:
        for spec, left, reason in time_guard(variants, budget_s):
            if reason:
                results.append(skipped(spec, reason))
                continue
            print(f"[run ] {spec['name']} (est {spec['est_s']} s, {left:.0f} s left)", flush=True)
            rec = run_variant(spec, Path(rec_dir), max(5.0, left - 3), log)
            results.append(rec)
            print(f"[done] {spec['name']}: {rec['status']} in {rec['wall_s']:.0f} s {_short(rec)}", flush=True)
    return results


def _short(r):
    return short(r, (("step_s", "{:.2f}s"), ("peak_gb", "{:.1f}GB"), ("loss", "loss {:.6f}")), 200)


def comparisons(results) -> list[dict]:
    """ours / alst step time at each (shape, sp, seq); sp 1 -> sp 2 speed-up of ours; the exchange's share."""
    done = [r for r in results if r.get("status") == "ok"]
    # The peer as shipped; variants with engine overrides are compared on their own lines.
    ok = {(r["kind"], r["shape"], r["sp"], r["seq"]): r for r in done if not r.get("zero_overrides")}
    rows = []
    for (kind, shape, sp, seq), r in ok.items():
        peers = [a for a in done if a["kind"] == "alst" and (a["shape"], a["sp"], a["seq"]) == (shape, sp, seq)]
        for a in (peers if kind == "ours" else []):
            rows.append(dict(what="ours / alst step time", shape=shape, sp=sp, seq=seq, alst=a["name"],
                             ours_s=r["step_s"], alst_s=a["step_s"], ratio=r["step_s"] / a["step_s"],
                             target="<= 0.8", loss_ours=r["loss"], loss_alst=a["loss"],
                             loss_warmup_ours=r.get("loss_warmup"), loss_warmup_alst=a.get("loss_warmup")))
        if kind == "ours" and sp > 1 and ("ours", shape, 1, seq) in ok:
            one = ok[("ours", shape, 1, seq)]
            rows.append(dict(what=f"ours sp 1 -> sp {sp} speed-up", shape=shape, seq=seq, sp1_s=one["step_s"],
                             sp_s=r["step_s"], speedup=one["step_s"] / r["step_s"], target=">= 1.95 (sp 2)",
                             loss_sp1=one["loss"], loss_sp=r["loss"]))
        for rank_rec in r.get("ranks_records") or []:
            # Per rank: the exchange is where the ranks meet, so a rank whose kernel ran faster waits there for
            # its peer; the slowest rank's exchange time is what the step pays for the exchange itself.
            p = (rank_rec or {}).get("profile")
            if p:
                rows.append(dict(what="exchange share of a step", shape=shape, sp=sp, seq=seq, rank=rank_rec["rank"],
                                 step_s=p["step_s"], exchange_s=p["exchange_s"], exchange_share=p["exchange_share"],
                                 attention_kernel_s=p["attention_kernel_s"], rest_s=p["rest_s"],
                                 exchange_gb=p["exchange_gb"], timer=p["timer"]))
    return rows


def format_table(results, comps) -> str:
    head = (f"{'variant':20} {'status':8} {'sp':>2} {'seq':>8} {'step s':>8} {'warm s':>7} {'peak GB':>8} "
            f"{'static':>7} {'host GB':>8} {'TF/GPU':>7} {'loss':>10} {'warm loss':>10}  plan / offload")
    lines = [head, "-" * len(head)]

    f = cell
    for r in results:
        peak = peak_cell(r)
        plan = r.get("plan")
        note = (f"plain {r['offload_report'].get('plain_layers')} gpu {plan['keep_on_gpu']} "
                f"kept-attn {plan['cache_attention_layers']}") if plan and r.get("offload_report") else ""
        if r["status"] in ("skipped", "oom", "error", "timeout", "crashed"):
            note = (r.get("reason") or r.get("error") or r.get("output_tail", "")[-120:] or "").splitlines()[-1][:120] \
                if (r.get("reason") or r.get("error") or r.get("output_tail")) else ""
        lines.append(
            f"{r['name']:20} {r['status']:8} {r['sp']:>2} {r['seq']:>8} {f(r, 'step_s', '.2f'):>8} "
            f"{f(r, 'warmup_s', '.1f'):>7} {peak:>8} {f(r, 'static_gb', '.1f'):>7} {f(r, 'host_maxrss_gb', '.1f'):>8} "
            f"{f(r, 'tflops_model_per_gpu', '.0f'):>7} {f(r, 'loss', '.6f'):>10} {f(r, 'loss_warmup', '.6f'):>10}  {note}")
    lines.append("(peak, host: the largest rank's; * = peak before the failure; TF/GPU: model FLOPs per GPU)")
    for c in comps:
        if "ratio" in c:
            lines.append(f"{c['shape']} sp {c['sp']} {c['seq']}: ours {c['ours_s']:.2f} s / {c['alst']} {c['alst_s']:.2f} s "
                         f"= {c['ratio']:.3f} (target {c['target']}); losses {c['loss_ours']:.6f} / "
                         f"{c['loss_alst']:.6f}, warm-up {c['loss_warmup_ours']:.6f} / {c['loss_warmup_alst']:.6f}")
        elif "speedup" in c:
            lines.append(f"{c['shape']} {c['seq']}: sp 1 {c['sp1_s']:.2f} s -> sp 2 {c['sp_s']:.2f} s = "
                         f"{c['speedup']:.3f}x (target {c['target']}); losses {c['loss_sp1']:.6f} / {c['loss_sp']:.6f}")
        else:
            lines.append(f"{c['shape']} sp {c['sp']} {c['seq']} rank {c['rank']}: exchange {c['exchange_s']:.3f} s of "
                         f"a {c['step_s']:.2f} s step = {100 * c['exchange_share']:.2f}% (attention kernel "
                         f"{c['attention_kernel_s']:.2f} s, rest {c['rest_s']:.2f} s; {c['timer']})")
    for r in results:
        for rank_rec in r.get("ranks_records") or []:
            if (rank_rec or {}).get("profile"):
                lines.append(f"profile of {r['name']}, rank {rank_rec['rank']} (its timed step, timers on):")
                for key, row in sorted(rank_rec["profile"]["rows"].items()):
                    lines.append(f"  {key:32} {row['seconds']:8.3f} s {row['calls']:5} calls "
                                 f"{row['bytes'] / GB:8.2f} GB")
    return "\n".join(lines)


def main(argv=None):
    args = runner_args(__doc__, SUITES, "sp2", 560.0, argv)
    if args.child:
        sys.exit(run_rank(json.loads(args.child), Path(args.child_out)))
    suite, variants = args.suite, args.variants
    if args.list:
        print(list_variants(suite, variants))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # No CUDA call here beyond counting devices: the parent must not hold a context on GPU 0.
    meta = dict(suite=suite, torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), budget_s=args.budget_s, argv=sys.argv)
    for name in ("transformers", "deepspeed"):
        try:
            meta[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    with open(out / f"log_{suite}.txt", "w") as log:
        results = run_suite(variants, out, args.budget_s, log)
    meta["device"] = next((r["device_name"] for res in results for r in res.get("ranks_records") or []
                           if r and r.get("device_name")), "cpu")
    comps = comparisons(results)
    write_outputs(out, suite, meta, results, format_table(results, comps), extra=dict(comparisons=comps),
                  shown_meta={k: v for k, v in meta.items() if k != "argv"})


if __name__ == "__main__":
    main()
