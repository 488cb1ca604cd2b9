"""One training step on one long sequence: ulysses_lc vs DeepSpeed ALST pieces vs stock transformers.

    python benchmarks/bench_step.py --suite speed  --out results/   # issue 5: step time, TFLOPS, kernel ceiling
    python benchmarks/bench_step.py --suite memory --out results/   # issue 3: peak memory ladder
    python benchmarks/bench_step.py --smoke --out /tmp/smoke        # tiny shapes on CPU, every path end to end

Each variant runs in its own subprocess (an out-of-memory step cannot poison the next one) and writes
one JSON record; the parent skips what no longer fits in --budget-s, prints a table last and writes
all records to <out>/results.json. What a step is, for every variant: one sequence of `seq` random
tokens, batch 1, bf16 weights from the same seed, forward + backward + torch.optim.AdamW(fused=True)
step. Timed: one step after one warm-up step ("full": warm-up at the same length; "short": warm-up at
8k tokens, used where one step takes a minute, so the timed step also builds that length's attention
plans; "steady": 8k, the plan, then one untimed step at full length, so the timed step is the steady step a
run gets, for ours and the peer alike: the speed2b suite). Peak: torch.cuda.max_memory_allocated over the timed step (reset after warm-up, optimizer state
already allocated). GB are 1e9 bytes.

Importable pieces: `setup_ours`, `setup_alst`, `setup_stock`, `bench_attention_kernel`; what both runners share
(the model, the ALST pieces, the record, the parent's time guard and output) is in common.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    IGNORE_INDEX,
    K,
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


# ---- the three step implementations: each returns (batch_fn(ids_cpu) -> batch, fwd_bwd(batch) -> loss) ----

def setup_ours(model, layout, doc=None, **levers):
    """ulysses_lc.SequenceParallelCausalLM with the given levers (defaults: all on); "plan" is a MemoryPlan's
    (recompute_layers, keep_on_gpu, cache_attention_layers) as a list (specs travel as JSON). doc: the sequence
    is packed documents of this many tokens (shard_batch(document_lengths=...))."""
    from ulysses_lc import MemoryPlan, SequenceParallelCausalLM, shard_batch

    levers = dict(levers)
    plan = levers.pop("plan", None)
    if levers.pop("chunked_rmsnorm", False):  # the RMSNorm's eager row chunks on CUDA too (an A/B of its fused path)
        from ulysses_lc.levers import rmsnorm

        rmsnorm.FUSED_CUDA = False
    if levers.pop("eager_loss_weight_sum", False):  # the loss head's weight gradient summed as before 2026-12-06
        from ulysses_lc.levers import fp32_accumulate

        fp32_accumulate._fp32_out_gemm_works = lambda *a: False
    triton_rmsnorm = levers.pop("triton_rmsnorm", None)  # the norms' rows on rmsnorm_rows.py's Triton kernels
    if triton_rmsnorm is not None:  # (TRITON_ROWS, the default since 2026-12-07); False is the A/B of torch's kernels
        from ulysses_lc.levers import rmsnorm_rows

        rmsnorm_rows.TRITON_ROWS = bool(triton_rmsnorm)
    if levers.pop("full_mlp_recompute", False):  # the tiled backward recomputes the down projection too (before 12-07)
        from ulysses_lc.levers import tiled_mlp

        tiled_mlp.SKIP_DOWN_FORWARD = False
    wrapper = SequenceParallelCausalLM(model, layout, plan=MemoryPlan(*plan) if plan else None, **levers)

    def batch_fn(ids):
        n = ids.numel()
        lengths = None if doc is None else [doc] * (n // doc) + ([n % doc] if n % doc else [])
        return shard_batch(ids, layout, document_lengths=lengths).to(local_device()).as_kwargs()

    def fwd_bwd(batch):
        loss = wrapper(**batch)
        loss.backward()
        return loss

    return wrapper, batch_fn, fwd_bwd


def setup_alst(model, logits_shard_gib: float = 1.0):
    """DeepSpeed's ALST pieces at sp 1, wired as deepspeed.runtime.sequence_parallel.ulysses_sp documents them.

    - TiledMLP: `install_alst_tiled_mlp`.
    - TiledFusedLogitsLoss: `alst_loss_sum`, divided by the valid-token count.
    - HF non-reentrant gradient checkpointing with DeepSpeed's CheckpointHiddenStatesOffload
      (offload_activations.py): one manager for every step, forward and backward inside it.
    - cuDNN-first SDPA priority around forward and backward (so the checkpoint recompute agrees).
    """
    import deepspeed  # noqa: F401  (accelerator setup)
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    install_alst_tiled_mlp()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload_ctx = get_checkpoint_hidden_states_offloading_ctx_manager()

    def batch_fn(ids):
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return {k: v.to(local_device()) for k, v in dict(input_ids=ids, labels=labels, position_ids=positions).items()}

    def fwd_bwd(batch):
        labels = batch["labels"]
        with cudnn_first(), offload_ctx:
            hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                 use_cache=False).last_hidden_state
            loss = alst_loss_sum(model, hidden, labels, logits_shard_gib) / (labels != IGNORE_INDEX).sum()
            loss.backward()
        return loss

    fwd_bwd.offload_ctx = offload_ctx
    return model, batch_fn, fwd_bwd


def setup_stock(model):
    """Stock transformers: non-reentrant gradient checkpointing, SDPA in torch's default backend order,
    the model's own loss over full logits (labels shifted inside)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def batch_fn(ids):
        ids = ids.to(local_device())
        return dict(input_ids=ids, labels=ids)

    def fwd_bwd(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss

    return model, batch_fn, fwd_bwd


# ---- attention kernel ceiling ----

def bench_attention_kernel(lengths, backends, q_heads=16, kv_heads=8, head_dim=128, iters=3):
    """Causal SDPA fwd+bwd TF/s per (length, backend), GQA through enable_gqa (expanded KV if refused).

    FLOPs: 3.5 x the causal forward's 2*L^2*heads*head_dim (the backward counted as 2.5 forwards, as
    Dao-AILab/flash-attention's benchmarks/benchmark_flash_attention.py counts fwd_bwd)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dtype = local_device(), torch.bfloat16
    rows = []
    for length in lengths:
        for name in backends:
            backend = getattr(SDPBackend, name)
            g = torch.Generator(device=dev).manual_seed(length)
            q = torch.randn(1, q_heads, length, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
            k = torch.randn(1, kv_heads, length, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
            v = torch.randn(1, kv_heads, length, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
            dout = torch.randn_like(q)
            row = dict(length=length, backend=name, gqa="enable_gqa")

            def once(expand, q=q, k=k, v=v, dout=dout):  # bound now: the loop deletes its names below
                kk = k.repeat_interleave(q_heads // kv_heads, 1) if expand else k
                vv = v.repeat_interleave(q_heads // kv_heads, 1) if expand else v
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
                    out.backward(dout)
                q.grad = k.grad = v.grad = None

            try:
                expand = False
                try:
                    once(expand)  # warm-up (plan build, autotune)
                except RuntimeError:
                    expand, row["gqa"] = True, "expanded"
                    once(expand)
                times = []
                n = iters if length <= 131072 else max(1, iters - 1)
                for _ in range(n):
                    if dev.type == "cuda":
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    t0 = time.perf_counter()
                    once(expand)
                    if dev.type == "cuda":
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 1e3)
                    else:
                        times.append(time.perf_counter() - t0)
                times.sort()
                t = times[len(times) // 2]
                flops = 3.5 * 2.0 * length * length * q_heads * head_dim
                row.update(status="ok", fwd_bwd_s=t, tflops=flops / t / 1e12, iters=n)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row.update(status="error", error=str(e).splitlines()[0][:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, dout, once
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---- one variant, in its own process ----

def _init_dist():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def _attention_ops(fwd_bwd, batch):
    """Which SDPA implementation ran: aten op names under the profiler (CPU activity only, no CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd(batch)
    names = {e.key: e.count for e in prof.key_averages() if "scaled_dot_product" in e.key}
    return names


_KINDS = (("attention bwd", ("flash", "fmha", "attention", "attn"), ("bwd", "backward")),
          ("attention fwd", ("flash", "fmha", "attention", "attn"), ()),
          ("gemm", ("gemm", "nvjet", "xmma", "cublas"), ()),
          ("copy", ("memcpy", "memset", "copy"), ()))


def _kind(name: str) -> str:
    low = name.lower()
    for kind, any_of, also in _KINDS:
        if any(x in low for x in any_of) and (not also or any(x in low for x in also)):
            return kind
    return "other"


def _owner(e) -> str:
    """The nearest event around `e` that is not an aten op: the autograd Function (RMSNormFunction, TiledMLPFunction,
    ChunkedCrossEntropy, ExplicitAttention), backward node or optimizer call that issued it; model code called
    directly (RoPE, residual adds, projections outside a lever) is "(model code)"."""
    while e is not None and e.name.startswith(("aten::", "cuda", "cu")):
        e = e.cpu_parent
    return "(model code)" if e is None else e.name.replace("autograd::engine::evaluate_function: ", "")[:70]


def _idle_by_owner(cpu_events, spans, top: int = 300) -> dict[str, float]:
    """Seconds of the `top` longest gaps between kernels (spans: sorted, non-overlapping (start, end) us), each
    given to the deepest CPU event running at its middle: what the host was doing while the GPU waited."""
    import bisect

    gaps = sorted(((b0 - a1, (a1 + b0) / 2) for (_, a1), (b0, _) in zip(spans, spans[1:]) if b0 > a1), reverse=True)
    cpu = sorted(cpu_events, key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]
    idle: dict[str, float] = {}
    for length, mid in gaps[:top]:
        i, found = bisect.bisect_right(starts, mid) - 1, None
        for j in range(i, max(-1, i - 5000), -1):  # the latest-starting event still running at mid is the deepest
            if cpu[j].time_range.end >= mid:
                found = cpu[j]
                break
        key = "(no host event)" if found is None else _owner(found) + ("" if not found.name.startswith("aten::")
                                                                        else f" / {found.name}")
        idle[key] = idle.get(key, 0.0) + length / 1e6
    return idle


def _profiled(name: str) -> bool:
    """BENCH_PROFILE=1 profiles every variant; BENCH_PROFILE=a,b only the variants named (a call's time is short)."""
    want = os.environ.get("BENCH_PROFILE", "")
    return want == "1" or name in want.split(",")


def profile_step(step, batch, dev, path: Path) -> dict:
    """BENCH_PROFILE=1: one more step at the same length under torch.profiler (CUDA activity), after the timed one,
    so the timed step stays clean. Writes `path`: the GPU's time by kind of kernel (attention fwd / bwd, gemm, copy,
    other) and by the lever or autograd node that launched it (_owner), the GPU's idle time between the step's first
    and last kernel and what the host did meanwhile (_idle_by_owner), and the 40 kernels of most time; returns the
    kinds' seconds for the record."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(batch)
        sync(dev)
    wall = time.perf_counter() - t0
    events = prof.events()
    merged = []  # the union of kernel intervals (us) over all streams: busy time, and the idle gaps between them
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    busy = sum(b - a for a, b in merged)
    # The wall also holds the profiler's own start and stop (CUPTI, then reading tens of thousands of events back),
    # before the first kernel and after the last: the GPU's idle time is the gaps between them. Until 2026-12-06 this
    # file said `wall - busy` was idle: 0.87 s on 2026-12-05, where the gaps were a few ms and the timed step (37.08 s)
    # matched the busy time (37.02 s).
    span = (merged[-1][1] - merged[0][0]) if merged else 0.0
    gaps = span - busy
    rows = [(e.self_device_time_total / 1e6, e.count, e.key) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    rows.sort(reverse=True)
    kinds: dict[str, float] = {}
    for sec, _, name in rows:
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + sec
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    owners: dict[str, float] = {}
    for e in cpu:  # each op's own kernels' time, given to the lever or node around it
        if e.self_device_time_total > 0:
            owner = _owner(e)
            owners[owner] = owners.get(owner, 0.0) + e.self_device_time_total / 1e6
    idle = _idle_by_owner(cpu, merged)
    out = dict(wall_s=wall, gpu_busy_s=busy / 1e6, gpu_idle_s=gaps / 1e6, profiler_s=wall - span / 1e6, kinds_s=kinds,
               owners_s=dict(sorted(owners.items(), key=lambda kv: -kv[1])[:30]),
               idle_s=dict(sorted(idle.items(), key=lambda kv: -kv[1])[:20]))
    lines = [f"profiled step: {wall:.2f} s wall, GPU busy {busy / 1e6:.2f} s (union of kernels), idle between them "
             f"{gaps / 1e6:.3f} s; the profiler's start and stop {wall - span / 1e6:.2f} s", "",
             "kind                 GPU s"]
    lines += [f"{k:20} {v:7.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines += ["", "   GPU s  launched inside (top 30)"]
    lines += [f"{v:8.3f}  {k}" for k, v in out["owners_s"].items()]
    lines += ["", "  idle s  the host meanwhile (the 300 longest gaps)"]
    lines += [f"{v:8.3f}  {k}" for k, v in out["idle_s"].items()]
    lines += ["", f"{'GPU s':>8} {'calls':>6}  kernel (top 40)"]
    lines += [f"{sec:8.3f} {n:6d}  {name[:150]}" for sec, n, name in rows[:40]]
    path.write_text("\n".join(lines) + "\n")
    return out


def _fa4_override(name: str, over: dict) -> None:
    """Run FA4's SM90 backward ("bwd": BwdConfig fields) or forward ("fwd": FwdConfig fields) with these fields over
    its own pick (bench_fa4_tiles.py's variants), for causal calls without a window at head dim <= 128: the step with
    a launch config before it becomes the default."""
    import dataclasses

    from flash_attn.cute import interface

    attr = "select_bwd_config" if name == "bwd" else "select_fwd_config"
    select = getattr(interface, attr)

    def pick(inputs):
        cfg = select(inputs)
        if inputs.device_arch // 10 == 9 and inputs.causal and not inputs.local and inputs.head_dim <= 128:
            cfg = dataclasses.replace(cfg, **over)
        return cfg
    setattr(interface, attr, pick)


def run_variant(spec: dict) -> dict:
    """Build, warm up, time one step; never raises (OOM and errors become the record's status)."""
    rec = dict(spec)
    rec.update(status="error", phase="setup")
    dev = local_device()
    try:
        _init_dist()
        for name in ("bwd", "fwd"):  # BwdConfig / FwdConfig fields over FA4's own pick (bench_fa4_tiles.py)
            if spec.get(f"fa4_{name}"):
                _fa4_override(name, spec[f"fa4_{name}"])
        if spec.get("fused_ce_rows") is not None:  # the loss head's softmax as one Triton kernel a chunk
            from ulysses_lc.levers import ce_rows  # (levers/ce_rows.py; on by default since 2026-12-07)

            ce_rows.FUSED_ROWS = bool(spec["fused_ce_rows"])
        if spec.get("forward_groups"):  # the attention forward over the head groups too, as before 2026-12-06
            from ulysses_lc.mixers import explicit_attention

            explicit_attention._FORWARD_IN_ONE_CALL = False
        if spec["kind"] == "kernel":
            rec["rows"] = bench_attention_kernel(spec["lengths"], spec["backends"])
            rec["status"] = "ok"
            return rec
        from ulysses_lc import ParallelLayout
        from ulysses_lc.plan.metrics import model_flops_per_step

        layout = ParallelLayout.build(1)
        model = build_model(spec["shape"], spec.get("layers"))
        config = model.config
        rec["layers"] = config.num_hidden_layers
        if spec["kind"] == "ours":
            module, batch_fn, fwd_bwd = setup_ours(model, layout, spec.get("doc"), **spec.get("levers", {}))
        elif spec["kind"] == "alst":
            module, batch_fn, fwd_bwd = setup_alst(model)
        elif spec["kind"] == "stock":
            module, batch_fn, fwd_bwd = setup_stock(model)
        else:
            raise ValueError(f"unknown kind {spec['kind']}")
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=True)
        seq = spec["seq"]
        vocab = config.vocab_size

        def step(batch, do_opt=True):
            loss = fwd_bwd(batch)
            if do_opt:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        if spec.get("probe"):
            rec["phase"] = "probe"
            probe_len = min(4096, seq)
            rec["attention_ops"] = _attention_ops(fwd_bwd, batch_fn(random_tokens(probe_len, vocab, seed=7)))
            optimizer.zero_grad(set_to_none=True)

        rec["phase"] = "warmup"
        warm_len = warmup_tokens(spec)
        rec["warmup_tokens"] = warm_len
        sync(dev)
        t0 = time.perf_counter()
        loss_w = step(batch_fn(random_tokens(warm_len, vocab)))
        sync(dev)
        rec["warmup_s"] = time.perf_counter() - t0
        rec["loss_warmup"] = float(loss_w)

        if spec.get("plan"):
            # The training path's plan, from the memory free once the optimizer state exists (here after the
            # warm-up step, so nothing is reserved for it; the training path plans before its first step), and
            # for packed documents as the training path plans them (no kept outputs, the kernel's block whole).
            import dataclasses

            plan = module.plan_step(seq, dev, packed=spec.get("doc") is not None, reserved_bytes=0)
            module.use_plan(plan)
            rec["plan"] = dataclasses.asdict(plan)
            sync(dev)
            torch.cuda.empty_cache()

        if spec.get("warmup") == "steady":  # a full-length step under the plan: its first-time costs, untimed
            rec["phase"] = "warmup_full"
            sync(dev)
            t0 = time.perf_counter()
            step(batch_fn(random_tokens(seq, vocab, seed=3)))
            sync(dev)
            rec["warmup_full_s"] = time.perf_counter() - t0

        rec["phase"] = "measure"
        batch = batch_fn(random_tokens(seq, vocab))
        start_peak(rec, dev)  # static_gb: params + optimizer state (+ batch)
        t0 = time.perf_counter()
        loss = step(batch)
        sync(dev)
        step_s = time.perf_counter() - t0
        rec["step_s"] = step_s
        rec["loss"] = float(loss)
        end_peak(rec, dev)
        if spec["kind"] == "ours" and getattr(module, "checkpointing", None) is not None:
            rec["offload_report"] = module.checkpointing.report()
        if hasattr(fwd_bwd, "offload_ctx"):
            rec["offload_report"] = vars(fwd_bwd.offload_ctx.stats)
        ckpt = module.checkpointing.report() if spec["kind"] == "ours" and module.checkpointing is not None else None
        flops = model_flops_per_step(
            config, seq, recompute_layers=ckpt["checkpointed_layers"] if ckpt else None,
            cached_attention_layers=ckpt["cached_attention_layers"] if ckpt else 0,
        )
        rec["tflops_model"] = flops.model / step_s / 1e12
        rec["tflops_hardware"] = flops.hardware / step_s / 1e12
        rec["tflops_effective"] = flops.effective / step_s / 1e12
        if _profiled(spec["name"]) and os.environ.get("BENCH_PROFILE_DIR"):
            rec["phase"] = "profile"
            rec["profile"] = profile_step(step, batch, dev,
                                          Path(os.environ["BENCH_PROFILE_DIR"]) / f"profile_{slug(spec['name'])}.txt")
        rec["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a benchmark records every failure and moves on
        record_failure(rec, e, dev)
    return rec


# ---- suites ----

def _v(name, kind, seq, est_s, shape="qwen3-0.6b", **kw):
    return dict(name=name, kind=kind, seq=seq, est_s=est_s, shape=shape, **kw)


ALL_LEVERS = {}
CHUNK_ONLY = dict(tiled_mlp=False, offload=False)  # checkpointing on: stock recipe + chunked loss
CHUNK_OFFLOAD = dict(tiled_mlp=False)

SUITES = {
    # issue 5, in priority order; est_s: the step times measured on one H200 (BENCHMARKS.md) + ~15 s of
    # process start and model build.
    "speed": [
        dict(name="kernel", kind="kernel", lengths=[64 * K, 128 * K, 256 * K],
             backends=["CUDNN_ATTENTION", "FLASH_ATTENTION"], est_s=45),
        _v("ours@64k", "ours", 64 * K, 30, probe=True),
        _v("alst@64k", "alst", 64 * K, 35, probe=True),
        _v("stock@64k", "stock", 64 * K, 30, probe=True),
        _v("ours@128k", "ours", 128 * K, 50),
        _v("alst@128k", "alst", 128 * K, 62),
        _v("ours@256k", "ours", 256 * K, 90, warmup="short"),
        _v("stock@128k", "stock", 128 * K, 20),
        _v("alst@256k", "alst", 256 * K, 105, warmup="short"),
    ],
    # issue 5, second pass: the training path's memory plan (plain layers, kept attention outputs) against
    # the peers in the same run; split in two calls of the 10-minute device limit.
    "speed2a": [
        dict(name="kernel", kind="kernel", lengths=[128 * K, 256 * K], backends=["CUDNN_ATTENTION"], est_s=30),
        _v("ours-plan@64k", "ours", 64 * K, 25, plan=True),
        _v("stock@64k", "stock", 64 * K, 30),
        _v("alst@64k", "alst", 64 * K, 35),
        _v("ours-plan@128k", "ours", 128 * K, 45, plan=True),
        _v("alst@128k", "alst", 128 * K, 62),
        _v("ours-kept@128k", "ours", 128 * K, 50, levers=dict(plan=[28, 0, 28])),
    ],
    # Steady steps for both sides (a full-length warm-up first): est_s counts the untimed full-length step too.
    "speed2b": [
        _v("ours-plan@256k", "ours", 256 * K, 140, warmup="steady", plan=True),
        _v("alst@256k", "alst", 256 * K, 190, warmup="steady"),
        _v("ours-plan-4B@128k", "ours", 128 * K, 130, shape="qwen3-4b", warmup="steady", plan=True),
        _v("alst-4B@128k", "alst", 128 * K, 145, shape="qwen3-4b", warmup="steady"),
    ],
    # issue 43: the main job's steady step with FlashAttention-4 (kernel 'fa4', the wheel set in README) against
    # cuDNN in the same call; benchmarks/bench_fa4.py has the kernels alone.
    "fa4": [
        _v("ours-plan@256k-cudnn", "ours", 256 * K, 140, warmup="steady", plan=True, levers=dict(kernel="cudnn")),
        _v("ours-plan@256k-fa4", "ours", 256 * K, 125, warmup="steady", plan=True, levers=dict(kernel="fa4")),
    ],
    # issue 43's must-show: the main job's plan on FlashAttention-4 against ALST's pieces in the same call, at the
    # 0.6B shape's 256k and the 4B shape's 128k (est_s from the calls of 2026-12-02 and 2026-12-04: one call).
    "fa4alst": [
        _v("ours-plan@256k-fa4", "ours", 256 * K, 115, warmup="steady", plan=True, levers=dict(kernel="fa4")),
        _v("alst@256k", "alst", 256 * K, 165, warmup="steady"),
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 100, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("alst-4B@128k", "alst", 128 * K, 125, shape="qwen3-4b", warmup="steady"),
    ],
    # issue 43: the 4B step with torch's fused RMSNorm kernels (the default on CUDA since 2026-12-04) against the
    # eager row chunks before them, and ALST, in one call (after fa4.sh's install; est_s from the calls of 2026-12-04).
    "fa4rms": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("ours-plan-4B@128k-fa4-chunked-norm", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", chunked_rmsnorm=True)),
        _v("alst-4B@128k", "alst", 128 * K, 155, shape="qwen3-4b", warmup="steady"),
    ],
    # issue 43: the 4B step with the fused RoPE kernel (levers/rope.py, off by default until measured) against ALST,
    # then as default (torch's fused RMSNorm, the MLP recompute skip, per-tensor copy events, all since 2026-12-04):
    # the RoPE variant and ALST first, so a call's time guard drops the default before the pair that decides
    # whether the kernel becomes the default (est_s as fa4rms's).
    "fa4rope": [
        _v("ours-plan-4B@128k-fa4-rope", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_rope=True)),
        _v("alst-4B@128k", "alst", 128 * K, 155, shape="qwen3-4b", warmup="steady"),
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_rope=False)),  # the default before 2026-12-05 (now on with CUDA)
    ],
    # issue 43's must-show after the fused RoPE became the default (2026-12-05): ours and ALST in one call at the 4B
    # shape's 128k; with BENCH_PROFILE=ours-plan-4B@128k-fa4 our step is profiled after it is timed.
    "fa4final": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("alst-4B@128k", "alst", 128 * K, 155, shape="qwen3-4b", warmup="steady"),
    ],
    # issue 43: the 4B step with FA4's forward on the 128 x 160 tile (5.6% faster than its pick at the 4B head group
    # alone on an H100, 2026-12-06) against ALST and the default in one call.
    "fa4fwd": [
        _v("ours-plan-4B@128k-fa4-fwd160", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4"), fa4_fwd=dict(tile_n=160)),
        _v("alst-4B@128k", "alst", 128 * K, 155, shape="qwen3-4b", warmup="steady"),
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 125, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
    ],
    # issue 43: the 4B step with the attention forward in one call over all heads (the default since 2026-12-06;
    # only the backward runs over head groups) against the forward over the groups too, then ALST and the default
    # again on the same machine (a second call: `--only`).
    "fa4one": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("ours-plan-4B@128k-fa4-fwdgroups", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4"), forward_groups=True),
        _v("alst-4B@128k", "alst", 128 * K, 160, shape="qwen3-4b", warmup="steady"),
        _v("ours-plan-4B@128k-fa4-bwd80", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4"), fa4_bwd=dict(tile_m=80, dQ_swapAB=True)),
        _v("ours-plan@256k-fa4", "ours", 256 * K, 115, warmup="steady", plan=True, levers=dict(kernel="fa4")),
        _v("alst@256k", "alst", 256 * K, 165, warmup="steady"),
    ],
    # issue 43: the 4B step with the fused SwiGLU kernels (levers/swiglu.py, on with CUDA since 2026-12-06; about 0.1 s
    # by bench_swiglu.py) against the eager tiles, with the loss head's fused rows kernel (ce_rows.FUSED_ROWS,
    # off until measured), and ALST in one call.
    "fa4swiglu": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("ours-plan-4B@128k-fa4-eager-swiglu", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_swiglu=False)),
        _v("ours-plan-4B@128k-fa4-ce-rows", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4"), fused_ce_rows=True),
        _v("alst-4B@128k", "alst", 128 * K, 160, shape="qwen3-4b", warmup="steady"),
    ],
    # issue 43, the next device session's plan: the default (fused SwiGLU and RoPE since 2026-12-06) against the loss
    # head's fused rows (SequenceParallelCausalLM's fused_ce_rows) with the norms on rmsnorm_rows.py's kernels, and
    # those with FA4's 80 x 128 backward tile (36.31 against 36.69 s on the 4B shape, 2026-12-06, unmeasured on the
    # 0.6B's head group), each shape beside its ALST on the same machine (`--only` splits it over calls: the three 4B
    # ours, then ALST-4B and the 0.6B ones). Both kernels are the default since 2026-12-07, so the plain
    # "ours-plan-4B@128k-fa4" has them and "-eager-ce" / "-torch-rms" are the A/Bs of each.
    "fa4next": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("ours-plan-4B@128k-fa4-eager-ce", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_ce_rows=False)),  # the loss head's eager chunk (the default before 12-07)
        _v("ours-plan-4B@128k-fa4-torch-rms", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", triton_rmsnorm=False)),  # torch's fused RMSNorm (the default before 12-07, late)
        _v("ours-plan-4B@128k-fa4-ce-rows-rms", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_ce_rows=True, triton_rmsnorm=True)),
        _v("ours-plan-4B@128k-fa4-ce-rows-rms-bwd80", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady",
           plan=True, levers=dict(kernel="fa4", fused_ce_rows=True, triton_rmsnorm=True),
           fa4_bwd=dict(tile_m=80, dQ_swapAB=True)),
        _v("alst-4B@128k", "alst", 128 * K, 160, shape="qwen3-4b", warmup="steady"),
        _v("ours-plan@256k-fa4-ce-rows-rms", "ours", 256 * K, 130, warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_ce_rows=True, triton_rmsnorm=True)),
        _v("ours-plan@256k-fa4-ce-rows-rms-bwd80", "ours", 256 * K, 130, warmup="steady", plan=True,
           levers=dict(kernel="fa4", fused_ce_rows=True, triton_rmsnorm=True), fa4_bwd=dict(tile_m=80, dQ_swapAB=True)),
        _v("alst@256k", "alst", 256 * K, 190, warmup="steady"),
    ],
    # issue 43 on an H200, 2026-12-07 (session 27): the default (FA4, fused CE rows, RMSNorm rows, and since this
    # session the tiled backward without the down projection's forward: tiled_mlp.SKIP_DOWN_FORWARD) beside ALST, the
    # new lever's A/B (-full-mlp) and FA4's 80 x 128 backward tile; the 0.6B pair in a second call (`--only`).
    "fa4h200": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("alst-4B@128k", "alst", 128 * K, 160, shape="qwen3-4b", warmup="steady"),
        _v("ours-plan-4B@128k-fa4-full-mlp", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4", full_mlp_recompute=True)),
        _v("ours-plan-4B@128k-fa4-bwd80", "ours", 128 * K, 110, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4"), fa4_bwd=dict(tile_m=80, dQ_swapAB=True)),
        _v("ours-plan@256k-fa4", "ours", 256 * K, 130, warmup="steady", plan=True, levers=dict(kernel="fa4")),
        _v("alst@256k", "alst", 256 * K, 190, warmup="steady"),
    ],
    # issue 43: where the FA4 step's time goes (run with BENCH_PROFILE=1: one more step under the profiler each).
    "fa4profile": [
        _v("ours-plan-4B@128k-fa4", "ours", 128 * K, 150, shape="qwen3-4b", warmup="steady", plan=True,
           levers=dict(kernel="fa4")),
        _v("ours-plan@256k-fa4", "ours", 256 * K, 170, warmup="steady", plan=True, levers=dict(kernel="fa4")),
    ],
    # issue 3, second pass: the limits with exact-size pinned buffers and the prefetch after attention backward.
    "memory2": [
        _v("ours@1M/4L", "ours", 1024 * K, 185, layers=4, warmup="short"),
        _v("ours@2M/1L", "ours", 2048 * K, 220, layers=1, warmup="short"),
        _v("ours-4B@512k/2L", "ours", 512 * K, 70, shape="qwen3-4b", layers=2, warmup="short"),
    ],
    # issue 3, third pass: the prefetch moved after the attention block's backward.
    "memory3": [
        _v("ours@1M/4L", "ours", 1024 * K, 185, layers=4, warmup="short"),
        _v("ours@1M/1L", "ours", 1024 * K, 65, layers=1, warmup="short"),
    ],
    # The attention kernel over head groups (automatic: 4 at 256k, 8 at 2M) against one call (groups 1).
    "groups": [
        _v("ours@256k/1L-g1", "ours", 256 * K, 20, layers=1, levers=dict(attention_head_groups=1)),
        _v("ours@256k/1L", "ours", 256 * K, 20, layers=1),
        _v("ours-plan@128k-g1", "ours", 128 * K, 45, plan=True, levers=dict(attention_head_groups=1)),
        _v("ours-plan@128k", "ours", 128 * K, 45, plan=True),
        _v("ours@2M/1L", "ours", 2048 * K, 220, layers=1, warmup="short"),
        _v("ours-plan@256k", "ours", 256 * K, 80, warmup="short", plan=True),
    ],
    # issue 3, in priority order.
    "memory": [
        _v("ours@32k", "ours", 32 * K, 20),
        _v("ours-full-logits@32k", "ours", 32 * K, 22, levers=dict(chunked_loss=False)),
        _v("stock@32k", "stock", 32 * K, 20),
        _v("L1-chunk@256k/2L", "ours", 256 * K, 22, layers=2, levers=CHUNK_ONLY),
        _v("L2-chunk+offload@256k/2L", "ours", 256 * K, 22, layers=2, levers=CHUNK_OFFLOAD),
        _v("L3-all@256k/2L", "ours", 256 * K, 22, layers=2),
        _v("ours@256k/1L", "ours", 256 * K, 15, layers=1),
        _v("ours-4B@512k/1L", "ours", 512 * K, 45, shape="qwen3-4b", layers=1, warmup="short"),
        _v("ours@1M/1L", "ours", 1024 * K, 60, layers=1, warmup="short"),
        # Added after the first ladder: the 4-layer 1M target, with the bf16-saving RMSNorm and 4 i/h MLP tiles.
        _v("ours@1M/4L", "ours", 1024 * K, 200, layers=4, warmup="short"),
    ],
    # issue 11: the training path's plan at 128k after the restructuring (BENCHMARKS.md D/G: 15.43-15.59 s,
    # plan 4 checkpointed / 1 input on the GPU / 4 kept outputs); issue 12: 256k as packed documents.
    "refactor": [
        _v("ours-plan@128k", "ours", 128 * K, 45, plan=True),
    ],
    "packing": [
        _v("ours-plan@256k", "ours", 256 * K, 80, warmup="short", plan=True),
        _v("ours-plan@256k-docs8k", "ours", 256 * K, 45, warmup="short", plan=True, doc=8 * K),
        _v("ours-plan@256k-docs4k", "ours", 256 * K, 40, warmup="short", plan=True, doc=4 * K),
    ],
    "packing-smoke": [
        _v("ours", "ours", 256, 30, shape="tiny"),
        _v("ours-docs64", "ours", 256, 30, shape="tiny", doc=64),
    ],
    "smoke": [
        dict(name="kernel", kind="kernel", lengths=[256], backends=["MATH"], est_s=30),
        _v("ours", "ours", 256, 30, shape="tiny", probe=True),
        _v("ours-full-logits", "ours", 256, 30, shape="tiny", levers=dict(chunked_loss=False)),
        _v("ours-chunk-only", "ours", 256, 30, shape="tiny", levers=CHUNK_ONLY),
        _v("ours-kept-attention", "ours", 256, 30, shape="tiny", levers=dict(plan=[2, 0, 2])),
        _v("alst", "alst", 256, 40, shape="tiny", probe=True, warmup="steady"),
        _v("ours-plan-steady", "ours", 256, 30, shape="tiny", plan=True, warmup="steady"),
        _v("stock", "stock", 256, 30, shape="tiny", probe=True, warmup="short"),
    ],
}


def run_suite(variants, out_dir: Path, budget_s: float, log) -> list[dict]:
    results = []
    for spec, left, reason in time_guard(variants, budget_s):
        if reason:
            results.append(skipped(spec, reason))
            continue
        rec_path = out_dir / f".{slug(spec['name'])}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), "--child-out", str(rec_path)]
        print(f"[run ] {spec['name']} (est {spec['est_s']} s, {left:.0f} s left)", flush=True)
        output, rc, timed_out, wall = launch(cmd, child_env(BENCH_PROFILE_DIR=str(out_dir)), max(5.0, left - 3), log,
                                             spec["name"])
        if rec_path.exists():
            rec = json.loads(rec_path.read_text())
            rec_path.unlink()
        else:
            rec = dict(spec, status="timeout" if timed_out else "crashed", returncode="timeout" if timed_out else rc,
                       output_tail=(output or "")[-1500:])
        rec["wall_s"] = wall
        results.append(rec)
        print(f"[done] {spec['name']}: {rec['status']} in {wall:.0f} s {_short(rec)}", flush=True)
    return results


def _short(r):
    if r.get("kind") == "kernel":
        return " ".join(f"{x['length'] // K}k/{x['backend'][:5]}={x.get('tflops', 0):.0f}TF" for x in r.get("rows", []))
    return short(r, (("step_s", "{:.2f}s"), ("peak_gb", "{:.1f}GB"), ("tflops_effective", "eff {:.0f}TF")), 160)


def format_table(results) -> str:
    """Plain-text table of the step variants, then the kernel rows."""
    head = (f"{'variant':28} {'status':8} {'seq':>8} {'L':>3} {'step s':>8} {'peak GB':>8} {'static':>7} "
            f"{'host GB':>8} {'TF model':>9} {'TF eff':>7} {'loss':>7}  attention op")
    lines = [head, "-" * len(head)]
    kernels = []
    for r in results:
        if r.get("kind") == "kernel":
            kernels.extend(r.get("rows", []))
            if r["status"] != "ok":
                lines.append(f"{r['name']:28} {r['status']:8}")
            continue

        def f(key, fmt):
            return cell(r, key, fmt)

        peak = peak_cell(r)
        ops = ",".join(k.replace("aten::_scaled_dot_product_", "") for k in (r.get("attention_ops") or {}))
        rep = r.get("offload_report") or {}
        if "checkpointed_layers" in rep:  # ours: recomputed / kept on GPU / kept attention outputs
            ops = (f"ckpt {rep['checkpointed_layers']} gpu {rep['kept_on_device_layers']} "
                   f"kept-attn {rep.get('cached_attention_layers', 0)} {ops}").strip()
        lines.append(
            f"{r['name']:28} {r['status']:8} {r.get('seq', 0):>8} {r.get('layers', r.get('layers', '-')) or '-':>3} "
            f"{f('step_s', '.2f'):>8} {peak:>8} {f('static_gb', '.1f'):>7} {f('host_maxrss_gb', '.1f'):>8} "
            f"{f('tflops_model', '.0f'):>9} {f('tflops_effective', '.0f'):>7} {f('loss', '.4f'):>7}  {ops}"
        )
    if kernels:
        lines += ["", f"{'attention kernel':28} {'length':>8} {'fwd+bwd s':>10} {'TF/s':>7}  gqa"]
        for k in kernels:
            t = k.get("fwd_bwd_s")
            lines.append(f"{k['backend']:28} {k['length']:>8} {t if t is None else format(t, '.3f'):>10} "
                         f"{k.get('tflops', float('nan')):>7.0f}  {k.get('gqa')} {k.get('error', '')}")
    lines.append("(* = peak before the failure)")
    return "\n".join(lines)


def main(argv=None):
    args = runner_args(__doc__, SUITES, "speed", 540.0, argv)
    if args.child:
        rec = run_variant(json.loads(args.child))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        write_record(rec, Path(args.child_out))
        return
    suite, variants = args.suite, args.variants
    if args.list:
        print(list_variants(suite, variants))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(suite=suite, torch=torch.__version__, cuda=torch.version.cuda,
                device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                started=time.strftime("%Y-%m-%d %H:%M:%S"), budget_s=args.budget_s)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    with open(out / f"log_{suite}.txt", "w") as log:
        results = run_suite(variants, out, args.budget_s, log)
    write_outputs(out, suite, meta, results, format_table(results))


if __name__ == "__main__":
    main()
