"""The memory ladder (issue 21): the dry run's predicted GPU and host peaks against the measured ones, on one GPU.

    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python3 benchmarks/bench_memory_ladder.py --only 0.6b@64k 0.6b@256k 4b@128k 4b@256k --budget-s 560 --out $OUT
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_memory_ladder.py --only 8b-offload --host-memory-gb 135 \
        --budget-s 560 --out $OUT/8b &    # 2 GPUs, 256 GiB host: the two rungs side by side, one GPU each
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_memory_ladder.py --only 0.6b@512k --host-memory-gb 100 \
        --budget-s 560 --out $OUT/512k; wait
    python3 benchmarks/bench_memory_ladder.py --smoke --out /tmp/ladder               # CPU, tiny shape: the paths

Rungs: Qwen3-0.6B shape at 64k, 256k and 512k tokens; Qwen3-4B at 128k and 256k; Qwen3-8B with the
`zero3_offload_optimizer` config at its longest dry-run length (sizing.Job.longest for this GPU and host). Each
rung runs in its own process, the main job's way (ulysses_lc.train.loop): random bf16 weights made on the GPU,
SequenceParallelCausalLM with every lever, deepspeed.initialize with the config's optimizer
(torch AdamW, or DeepSpeed's CPU Adam where the optimizer is offloaded), then the plan as the run makes it
(`plan_step` with `train.estimate.plan_reservations`: the dry run's budget for this machine's limits). Then one
warm-up step at 8k tokens with every layer plain (AdamW's moments allocated, no pinned buffers made), the plan,
and one measured step at the rung's length: torch.cuda.max_memory_allocated and max_memory_reserved over it,
the process's RSS after it and its peak RSS (ru_maxrss, the whole process). Predicted: sizing.Job.predict for
the run's plan (and the dry run's plan and verdict, and the verdict at 1.1x the length).

Limits: the GPU's total memory (torch.cuda.mem_get_info) and --host-memory-gb (default: 9/10 of this machine's
memory, one rank). The 8B rung cannot run on a 128 GiB host at any length (DeepSpeed's host optimizer state alone is
131 GB: the rung says so and builds nothing); on a 256 GiB host its longest length is 565k tokens, a ~15-minute
step, so --host-memory-gb 135 bounds it at 277,504 tokens (~4 minutes). A time guard skips a rung whose estimate (start-up + warm-up + 1.25 x the predicted step time)
no longer fits --budget-s. Writes <out>/ladder.json (every record), <out>/points.json (the finished rungs as
tests/data/h200_peaks.json points), <out>/ladder_table.txt; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GB = 1e9
K = 1024
# name: (shape, tokens (None: the longest that fits), DeepSpeed config, start-up seconds for the time guard[, layers
# [, GPU GB: the plan's limit and the caching allocator's cap, torch.cuda.set_per_process_memory_fraction]])
RUNGS = {
    "0.6b@64k": ("qwen3-0.6b", 64 * K, "zero3", 30),
    "0.6b@256k": ("qwen3-0.6b", 256 * K, "zero3", 30),
    "0.6b@512k": ("qwen3-0.6b", 512 * K, "zero3", 30),
    "4b@128k": ("qwen3-4b", 128 * K, "zero3", 40),
    "4b@256k": ("qwen3-4b", 256 * K, "zero3", 40),
    "8b-offload": ("qwen3-8b", None, "zero3_offload_optimizer", 180),
    # Held out of the fit (issue 28): a window, sinks with MoE, a fine-grained MoE; fewer layers to fit one GPU.
    "mistral-7b-4L@128k": ("mistral-7b", 128 * K, "zero3", 40, 4),
    "gpt-oss-20b-2L@64k": ("gpt-oss-20b", 64 * K, "zero3", 60, 2),
    "qwen3-30b-a3b-2L@64k": ("qwen3-30b-a3b", 64 * K, "zero3", 60, 2),
    # Issue 44 (benchmarks/results/2026-12-03/longest.sh): the longest on one GPU. The Llama-3.1-8B shape cut to 1
    # layer with everything offloaded: its longest is bound by the full model's terms (one layer's recompute, the loss
    # head), 1,721,344 tokens on a whole H200, a ~175 s step (2 layers ~344 s; the host would take 8 layers,
    # 1,376,256 tokens, ~1,080 s: past one 10-minute call).
    # The full Qwen3-0.6B shape at its longest for a 40 GB cap (602,112 tokens, ~290 s; 2,530,304 on the whole GPU
    # would take ~6,200 s).
    "llama-8b-1L-longest": ("llama-3.1-8b", None, "zero3_offload_all", 120, 1),
    "0.6b-longest-40gb": ("qwen3-0.6b", None, "zero3", 30, None, 40),
    # The refit of issue 44's terms (benchmarks/results/2026-12-03/longest_refit.sh): the same cut at 768k (with
    # MEMORY_BREAKDOWN=1: what is live at the GPU peak) and at the old longest, 1,146,880 tokens (the step time
    # before and after the levers: this script run over the package as it was, and as it is).
    "llama-8b-1L@768k": ("llama-3.1-8b", 768 * K, "zero3_offload_all", 80, 1),
    "llama-8b-1L@1120k": ("llama-3.1-8b", 1120 * K, "zero3_offload_all", 80, 1),
    "llama-8b-1L@1536k": ("llama-3.1-8b", 1536 * K, "zero3_offload_all", 80, 1),  # checkpointed: plan [1, 0, 1]
    # The allocator's slack at the refit's longest (benchmarks/results/2026-12-04/slack.sh): 1,637,376 tokens reserved
    # 137.6 GB for 119.9 allocated; 131.8 with the cached memory given back at the recompute (RELEASE_CACHED_MEMORY).
    "llama-8b-1L@1599k": ("llama-3.1-8b", 1637376, "zero3_offload_all", 80, 1),
    # Then the cut's longest with the allocator capped at 141 GB (the one-GPU goal's GPU), the 10% slack held out.
    "llama-8b-1L-longest-141gb": ("llama-3.1-8b", None, "zero3_offload_all", 120, 1, 141),
}
SMOKE = {"tiny@512": ("tiny", 512, "zero3", 30), "tiny-offload@512": ("tiny", 512, "zero3_offload_optimizer", 30)}
WARMUP_TOKENS = 8 * K


def _config(shape: str, seq: int, layers: int | None = None):
    from tests.test_memory_prediction import qwen3_config
    from ulysses_lc.tiny import tiny_model_config
    from ulysses_lc.levers.yarn import apply_yarn

    config = tiny_model_config() if shape == "tiny" else qwen3_config(shape, layers)
    config.use_cache = False
    return apply_yarn(config, max(seq, WARMUP_TOKENS))


def _job_and_limits(shape: str, seq: int | None, ds_name: str, host_gb: float | None, layers: int | None = None,
                    gpu_gb: float | None = None):
    import psutil

    from ulysses_lc import ModelShape
    from ulysses_lc.parallel.ds_config import check_deepspeed_config, check_optimizer_block, load_deepspeed_config
    from ulysses_lc.parallel.ds_config import resolve_precision
    from ulysses_lc.parallel.layout import ParallelLayout
    from ulysses_lc.plan.sizing import Job, Limits
    from ulysses_lc.train.estimate import count_params

    cuda = torch.cuda.is_available()
    config = _config(shape, seq or WARMUP_TOKENS, layers)
    ds_config = check_deepspeed_config(load_deepspeed_config(ds_name), ParallelLayout(1, 1), gradient_accumulation_steps=1)
    check_optimizer_block(resolve_precision(ds_config, torch.bfloat16 if cuda else torch.float32), 1e-5, 0.0)
    num_params = count_params(config)
    job = Job.from_ds_config(ModelShape.from_config(config), num_params, 1, 1, ds_config)
    gpu = torch.cuda.mem_get_info()[1] if cuda else 150e9
    gpu = min(gpu, gpu_gb * GB) if gpu_gb else gpu
    limits = Limits(gpu, host_gb * GB if host_gb else 0.9 * psutil.virtual_memory().total)
    return config, ds_config, job, limits


def run_rung(name: str, rung, host_gb: float | None, client_adam: bool = False) -> dict:
    """One rung in this process: its predicted and measured peaks. client_adam: with an offloaded optimizer, torch's
    AdamW on the host partitions instead of DeepSpeed's CPU Adam (whose C++ op is built at first use): the same
    fp32 master, gradient and moments on the host."""
    import deepspeed
    import psutil
    from transformers import AutoModelForCausalLM

    from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, shard_batch
    from ulysses_lc.parallel.distributed import init_distributed
    from ulysses_lc.train.estimate import plan_reservations

    shape, seq, ds_name, _, *rest = rung
    layers, gpu_gb = (list(rest) + [None, None])[:2]
    rec = dict(id=name, date=time.strftime("%Y-%m-%d"), shape=shape, ds_config=ds_name, sp=1, world=1,
               head_groups="auto", packed=False, harness="zero3", command=" ".join(sys.argv))
    config, ds_config, job, limits = _job_and_limits(shape, seq, ds_name, host_gb, layers, gpu_gb)
    rec.update(held_out=shape not in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "tiny"), params=job.num_params,
               layers=job.shape.layers, limits_gb=[limits.gpu_bytes / GB, limits.host_bytes / GB])
    if seq is None:
        seq = job.longest(limits)
        if not seq:
            rec.update(status="no length fits", verdict=job.fit(1024, limits).verdict())
            return rec
    config = _config(shape, seq, layers)
    if client_adam and "optimizer" in ds_config:
        ds_config = {k: v for k, v in ds_config.items() if k != "optimizer"}
        ds_config["zero_force_ds_cpu_optimizer"] = False
        rec["optimizer"] = "torch AdamW on the host"
    dry = job.fit(seq, limits)
    rec.update(seq=seq, dry_plan=list(dry.plan.counts), verdict=dry.verdict(),
               verdict_1p1=job.fit(int(seq * 1.1), limits).verdict())
    init_distributed()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        if gpu_gb:  # the caching allocator may not pass the limit the plan was made for
            torch.cuda.set_per_process_memory_fraction(limits.gpu_bytes / torch.cuda.mem_get_info(dev)[1], dev)
        rec["machine"] = f"{torch.cuda.get_device_name(dev)}, {psutil.virtual_memory().total / GB:.0f} GB host"
    layout = ParallelLayout.build(1)
    torch.manual_seed(0)
    # Random weights made on the device, partitioned by deepspeed.initialize (one rank: the same state as zero.Init's).
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    wrapper = SequenceParallelCausalLM(model, layout)
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW([p for p in wrapper.parameters() if p.requires_grad], lr=1e-5,
                                      fused=dev.type == "cuda")
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=ds_config, mpu=layout.mpu,
                                      model_parameters=wrapper.parameters() if optimizer is None else None)
    engine.train()
    plan = wrapper.plan_step(seq, dev, **plan_reservations(job, limits))  # the run's plan, as loop.py makes it
    predicted = job.predict(seq, plan)
    rec.update(plan=list(plan.counts), predicted_gpu=predicted.gpu / GB, predicted_gpu_needed=predicted.gpu_needed / GB,
               predicted_host=predicted.host / GB, predicted_step_s=job.step_seconds(seq, plan))
    vocab = config.vocab_size

    def phase(name: str):  # the peaks so far, after each phase of the step: where the reserved peak falls
        if dev.type == "cuda":
            rec.setdefault("phase_peaks", {})[name] = [torch.cuda.max_memory_allocated(dev) / GB,
                                                       torch.cuda.max_memory_reserved(dev) / GB]

    def step(tokens: int) -> float:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        batch = shard_batch(ids, layout, vocab_size=vocab).to(dev).as_kwargs()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(**batch)
        phase("forward")
        engine.backward(loss)
        phase("backward")
        engine.step()
        rec.setdefault("losses", []).append(float(loss.detach()))
        return time.perf_counter() - t0

    wrapper.use_plan(MemoryPlan(0, 0, 0))  # warm-up: optimizer state made, no pinned buffers
    rec["warmup_s"] = step(min(WARMUP_TOKENS, seq))
    # The run's way (loop.py): the cached memory given back at each recompute where the job counts on it;
    # RELEASE_CACHED_MEMORY=0 / 1 overrides, for a step with and without.
    release = os.environ.get("RELEASE_CACHED_MEMORY")
    release = job.release_cached_memory if release is None else release == "1"
    wrapper.use_plan(plan, release_cached_memory=release)
    rec["release_cached_memory"] = release
    breakdown = os.environ.get("MEMORY_BREAKDOWN") == "1" and dev.type == "cuda"
    rec["host_rss_before_step"] = psutil.Process().memory_info().rss / GB
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the warm-up's free pages are not the step's
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        if breakdown:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        rec["step_s"] = step(seq)
        rec["status"] = "ok"
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", error=str(e).splitlines()[0])
    if dev.type == "cuda":
        rec.update(gpu_peak=torch.cuda.max_memory_allocated(dev) / GB,
                   gpu_reserved=torch.cuda.max_memory_reserved(dev) / GB, gpu_before_step=base / GB)
        if breakdown:
            try:  # a record without its breakdown still reports the peaks
                rec["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot(), base)
            except Exception as e:  # noqa: BLE001 - said in the record
                rec["peak_breakdown"] = {"error": f"{type(e).__name__}: {e}"}
            torch.cuda.memory._record_memory_history(enabled=None)
    report = wrapper.checkpointing.report()
    rec["released"] = report.get("released_cached_memory", 0)
    rec.update(host_rss=psutil.Process().memory_info().rss / GB,
               host_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
               pinned=report.get("host_bytes", 0) / GB)
    return rec


def peak_breakdown(snapshot: dict, base: int, top: int = 40) -> dict:
    """What is live at the step's GPU peak, from torch.cuda.memory's recorded history: the allocations made in the step
    and not yet freed at the moment their total was highest, summed by where they were made (the innermost frames in
    ulysses_lc, transformers or DeepSpeed, and the innermost frame). `base`: what was allocated before the step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_snapshot import peak_live  # the trace's replay, shared with memory_snapshot.py

    events = snapshot["device_traces"][0]
    peak, _, live = peak_live(events)
    peak = max(peak, 0)

    def where(frames) -> str:
        ours = [f for f in frames if any(k in f["filename"] for k in ("ulysses_lc/", "transformers/", "deepspeed/"))]
        named = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours[:3]]
        inner = f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"
        return " < ".join([inner] + named)

    groups = {}
    for e in live:
        g = groups.setdefault(where(e.get("frames", [])), [0, 0, 0])
        g[0] += e["size"]
        g[1] += 1
        g[2] = max(g[2], e["size"])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"events": len(events), "base_gb": base / GB, "step_peak_gb": peak / GB, "peak_gb": (base + peak) / GB,
            "groups": [{"where": k, "gb": v[0] / GB, "count": v[1], "largest_gb": v[2] / GB} for k, v in rows[:top]],
            "rest_gb": sum(v[0] for _, v in rows[top:]) / GB}


def _child(cmd, log_path: Path, seconds: float) -> str | None:
    """Run one rung's process; None when it finished, else why not."""
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(seconds, 1), cwd=ROOT)
        except subprocess.TimeoutExpired:
            return f"timeout after {seconds:.0f} s"
    return None if done.returncode == 0 else f"failed (exit {done.returncode}, see {log_path.name})"


def _estimate_s(rung, host_gb) -> tuple[float, dict]:
    """Seconds the rung should take (start-up + warm-up + 1.25 x its predicted step), from the dry run's arithmetic."""
    shape, seq, ds_name, startup, *rest = rung
    _, _, job, limits = _job_and_limits(shape, seq, ds_name, host_gb, *rest)
    seq = seq or job.longest(limits)
    if not seq:  # the child only prices it: no model is built
        return 30, {}
    plan = job.plan(seq, limits)
    step = job.step_seconds(seq, plan) + (30 if job.offload_optimizer else 0)  # + CPU Adam over 8B: ~30 s, a guess
    return startup + 15 + 1.25 * step, {"seq": seq, "plan": list(plan.counts)}


def _table(records) -> str:
    lines = [f"{'rung':<12} {'tokens':>9} {'plan':<13} {'gpu pred':>8} {'meas':>6} {'ratio':>6} {'host pred':>9} "
             f"{'peak':>6} {'ratio':>6} {'step pred':>9} {'meas':>6}  status"]
    ok = True
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"{r['id']:<12} {r.get('seq', '-'):>9} {str(r.get('plan', '-')):<13} {'':>56}  "
                         f"{r.get('status')}: {r.get('verdict', r.get('error', ''))[:120]}")
            continue
        gpu_ratio = r["predicted_gpu"] / r["gpu_peak"] if r.get("gpu_peak") else float("nan")
        host_ratio = r["predicted_host"] / r["host_peak_rss"]
        good = 1 <= gpu_ratio <= 1.1 and 1 <= host_ratio <= 1.1
        ok &= good
        lines.append(f"{r['id']:<12} {r['seq']:>9} {str(r['plan']):<13} {r['predicted_gpu']:8.1f} "
                     f"{r.get('gpu_peak', float('nan')):6.1f} {gpu_ratio:6.3f} {r['predicted_host']:9.1f} "
                     f"{r['host_peak_rss']:6.1f} {host_ratio:6.3f} {r['predicted_step_s']:9.1f} {r['step_s']:6.1f}  "
                     f"ok{'' if good else ' (outside 1.0-1.1)'}")
    lines.append(f"every finished rung within 10% above its measured GPU and peak host memory: {'yes' if ok else 'no'}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", help=f"rungs, of {', '.join(RUNGS)}")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--host-memory-gb", type=float, help="host limit per rank (default: 9/10 of this machine's)")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny shape, every path")
    p.add_argument("--out", default=os.environ.get("OUT", "ladder_out"))
    p.add_argument("--client-adam", action="store_true",
                   help="offloaded optimizer: torch AdamW on the host instead of DeepSpeed's CPU Adam (tried "
                        "anyway when the CPU Adam rung fails)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    rungs = SMOKE if args.smoke else RUNGS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        rec = run_rung(args.child, rungs[args.child], args.host_memory_gb, args.client_adam or args.smoke)
        (out / f"rung_{args.child}.json").write_text(json.dumps(rec, indent=1))
        return
    start, records = time.monotonic(), []
    for name in args.only or list(rungs):
        left = args.budget_s - (time.monotonic() - start)
        estimate, about = _estimate_s(rungs[name], args.host_memory_gb)
        if estimate > left:
            records.append(dict(id=name, status=f"skipped (needs ~{estimate:.0f} s, {left:.0f} s left)", **about))
            print(records[-1], flush=True)
            continue
        cmd = [sys.executable, __file__, "--child", name, "--out", str(out)] + (["--smoke"] if args.smoke else [])
        cmd += ["--host-memory-gb", str(args.host_memory_gb)] if args.host_memory_gb else []
        t0 = time.monotonic()
        status = _child(cmd + (["--client-adam"] if args.client_adam else []), out / f"log_{name}.txt", left)
        offloaded = rungs[name][2] != "zero3"
        if status and offloaded and not args.client_adam and "cpu_adam" in (out / f"log_{name}.txt").read_text():
            left = args.budget_s - (time.monotonic() - start)
            if left > estimate:  # DeepSpeed's CPU Adam did not build here: torch's AdamW on the host instead
                status = _child(cmd + ["--client-adam"], out / f"log_{name}_client_adam.txt", left)
        path = out / f"rung_{name}.json"
        rec = json.loads(path.read_text()) if path.exists() and status is None else dict(id=name, status=status, **about)
        rec["wall_s"] = time.monotonic() - t0
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "losses"}), flush=True)
    (out / "ladder.json").write_text(json.dumps(records, indent=1))
    keys = ("id", "date", "machine", "command", "shape", "layers", "seq", "sp", "world", "plan", "head_groups",
            "packed", "harness", "ds_config", "params", "gpu_peak", "gpu_reserved", "host_rss", "pinned", "held_out")
    points = [{k: r[k] for k in keys if k in r} for r in records if r.get("status") == "ok"]
    (out / "points.json").write_text(json.dumps(points, indent=1))
    table = _table(records)
    (out / "ladder_table.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
