"""Whole training steps of a Qwen3.5 shape (gated DeltaNet + gated attention) on one GPU, each with the dry run's
predicted peak for the plan used, beside stock transformers at its longest fitting length (issue 27).

    python3 benchmarks/bench_hybrid.py --layers 8 --budget-s 510 --out $OUT   # H200, one call
    python3 benchmarks/bench_hybrid.py --smoke --out /tmp/hybrid               # CPU, tiny shape, every phase

The shape: Qwen/Qwen3.5-0.8B's text_config (huggingface.co/Qwen/Qwen3.5-0.8B, config.json): hidden 1024, MLP 3584,
24 layers as [3 gated DeltaNet, 1 gated full attention] x 6, 8 query / 2 kv heads of 256, DeltaNet 16 key / 16 value
heads of 128, conv width 4, vocab 248,320, tied embeddings; random bf16 weights from one seed, --layers of its 24
(the same pattern, cut short). Ours, the main job's way: a DeepSpeed ZeRO-3 engine (ds_configs/zero3.json) over
SequenceParallelCausalLM at sp 1, torch AdamW (fused) over every parameter, the plan `plan_step` makes for this GPU
after the optimizer state exists (reserved 0, the dry run's budget for the GPU's limits). The gated DeltaNet layers
run the kernel the library picks (the record's `deltanet`: fla-core is not installed for this call, whose gated
backward refuses Hopper on Triton 3.6, BENCHMARKS.md "Gated DeltaNet layers"; so the exact torch path).

Phases, each in a process of its own, in this order, each skipped when its estimate no longer fits --budget-s:
  ours    (--layers): an 8k warm-up step (a second one on fla's kernels, or when the first took over 30 s), then
          one timed step at each of 32k, 256k and the dry run's longest fitting length (sizing.Job.longest), each
          skipped when the last step's seconds, scaled up, say it cannot finish; on fla's kernels 32k and 256k
          first take an untimed step (the kernels' first calls at those shapes). The longest is one step, at the
          predicted longest or, where the FLOPs model (Job.step_seconds) scaled to the 256k step says that cannot
          finish in the time left less --stock-s, at the longest that can ("longest_capped_by_time");
  stock   (--layers): stock transformers (its own path, fla's rule where fla is installed; gradient checkpointing,
          SDPA, the model's loss over full logits, torch AdamW): a step at 48k, else 40k, 32k, 16k, 8k (the first that
          does not run out of memory), after a warm-up step at that length;
  full    (all 24 layers): ours at 256k, when the ours phase's 256k step says it fits what is left.
Each timed step: peaks (torch.cuda.max_memory_allocated) per part (forward + loss, backward, optimizer step) beside
the memory held at its start; predicted: sizing.Job.predict for the plan used, with its terms. Writes
<out>/hybrid.json after each phase (and each step), <out>/log_hybrid.txt, and prints a table last. GB are 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

GB = 1e9
K = 1024

# huggingface.co/Qwen/Qwen3.5-0.8B, config.json's text_config (rope: theta 1e7 on a quarter of the head dims).
SHAPES = {
    "qwen3.5-0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                         linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
                         rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)


def build_config(shape: str, layers: int | None):
    """The Qwen3.5 text config of `shape` with `layers` decoder layers (the public [L, L, L, F] pattern cut short)."""
    from transformers import Qwen3_5TextConfig

    kw = dict(SHAPES[shape])
    kw["num_hidden_layers"] = layers or kw["num_hidden_layers"]
    try:
        config = Qwen3_5TextConfig(**kw, rope_parameters=dict(ROPE))
    except (TypeError, ValueError):  # a transformers that takes the rope another way: its default rope (theta)
        config = Qwen3_5TextConfig(**kw)
    config.use_cache = False
    return config


def est_seconds(prev: tuple[int, float], tokens: int) -> float:
    """A step's seconds from the last one measured (tokens, s): linear in the length (the recurrence, the MLPs), a
    little more for the full-attention layers' quadratic share, and 10% spare."""
    t_prev, s_prev = prev
    return 1.1 * s_prev * (tokens / t_prev) ** 1.15


# ---- one phase, in its own process ----

def run_ours(args, rec: dict, save) -> None:
    import deepspeed
    import psutil
    from transformers import AutoModelForCausalLM

    from ulysses_lc import ModelShape, ParallelLayout, SequenceParallelCausalLM, shard_batch
    from ulysses_lc.mixers import fallbacks
    from ulysses_lc.parallel.distributed import init_distributed
    from ulysses_lc.parallel.ds_config import check_deepspeed_config, load_deepspeed_config
    from ulysses_lc.plan.memory import MemoryPlan
    from ulysses_lc.plan.sizing import Job, Limits
    from ulysses_lc.train.estimate import count_params

    from common import is_oom

    config = build_config(args.shape, args.layers)
    layout_sizes = ParallelLayout(1, 1)
    ds_config = check_deepspeed_config(load_deepspeed_config("zero3"), layout_sizes, gradient_accumulation_steps=1)
    init_distributed()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    layout = ParallelLayout.build(1)
    total_gpu = torch.cuda.mem_get_info(dev)[1] if cuda else 150e9
    limits = Limits(total_gpu, 0.9 * psutil.virtual_memory().total)
    num_params = count_params(config)
    job = Job.from_ds_config(ModelShape.from_config(config), num_params, 1, 1, ds_config)
    rec.update(layers=config.num_hidden_layers, layer_types=config.layer_types, params=num_params,
               limits_gb=dict(gpu=limits.gpu_bytes / GB, host=limits.host_bytes / GB))
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    wrapper = SequenceParallelCausalLM(model, layout)
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-5, fused=cuda)
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=ds_config, mpu=layout.mpu)
    engine.train()
    rec.update(deltanet=wrapper.deltanet, attention_kernel=str(wrapper.attention.kernel),
               setup_s=time.perf_counter() - args.t0)
    vocab = config.vocab_size
    parts = {}

    def part(name):  # the peak since the last part; "held": the memory allocated as the step starts
        if cuda:
            torch.cuda.synchronize()
            now = (torch.cuda.memory_allocated if name == "held" else torch.cuda.max_memory_allocated)(dev) / GB
            parts[name] = max(parts.get(name, 0.0), now)
            torch.cuda.reset_peak_memory_stats(dev)

    def step(tokens: int, seed: int):
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
        batch = shard_batch(ids, layout, vocab_size=vocab).to(dev).as_kwargs()
        part("held")
        t0 = time.perf_counter()
        loss = engine(**batch)
        part("forward_and_loss")
        engine.backward(loss)
        part("backward")
        engine.step()
        part("optimizer_step")
        return time.perf_counter() - t0, float(loss)

    wrapper.use_plan(MemoryPlan(0, 0, 0))
    fla = (wrapper.deltanet or "").startswith("fla")
    rec["warmup_s"] = step(args.warmup, 0)[0]
    if rec["warmup_s"] > 30 or fla:
        # fla's first calls compile its kernels (and autotune them, minutes, without a cache): a second warm-up
        # times the step the estimates below scale
        rec["first_warmup_s"] = rec["warmup_s"]
        rec["warmup_s"] = step(args.warmup, 1)[0]
    save()
    lengths = list(zip(args.names, args.lengths))
    if args.longest:
        longest = job.longest(limits)
        rec["longest_predicted"] = longest
        lengths.append(("longest", min(longest, args.longest_cap) if args.longest_cap else longest))
    prev = (args.warmup, rec["warmup_s"] * 2)  # the warm-up pays first-time costs: doubled, it over-estimates
    speed = None  # measured seconds over the FLOPs model's (Job.step_seconds), from the last timed step
    for name, tokens in lengths:
        left = args.deadline - time.time()
        # the longest: one step, its first at that length; a forced plan (a memory probe): no timing wanted
        untimed_first = fla and name != "longest" and not args.force_plan
        if name == "longest" and speed is None:  # no step timed in this process: the FLOPs model, 10% spare (its
            speed = 1.1  # fla steps measured 0.96-1.04 of it, BENCHMARKS.md)
        if name == "longest":
            # the longest the time left allows, from the FLOPs model scaled to the last step, at most the
            # predicted longest, leaving --reserve-s for the phases after this one
            def est_at(n):
                return speed * job.step_seconds(n, job.fit(n, limits).plan) + 20

            floor = args.lengths[-1] if args.lengths else args.warmup
            while tokens > floor and est_at(tokens) + 10 > left - args.reserve_s:
                tokens = max(floor, int(tokens * 0.85) // 8192 * 8192)
            if tokens < lengths[-1][1]:
                rec["longest_capped_by_time"] = tokens
            est = est_at(tokens)
        else:
            est = est_seconds(prev, tokens)
            if untimed_first:
                est = 2 * est + 30  # the untimed step first, and its compiling
        if est + 10 > left:
            rec[name] = dict(tokens=tokens, status=f"skipped: estimated {est:.0f} s, {left:.0f} s left")
            save()
            continue
        plan = (MemoryPlan(*args.force_plan) if args.force_plan else
                wrapper.plan_step(tokens, dev, reserved_bytes=0, budget=job.budget(limits)))
        predicted = job.predict(tokens, plan)
        wrapper.use_plan(plan)
        parts.clear()
        entry = dict(tokens=tokens, plan=list(plan.counts), predicted_gpu=predicted.gpu / GB, est_s=est,
                     predicted_terms_gb=dict(state=predicted.state_gpu / GB, gathered=predicted.gathered / GB,
                                             activations=predicted.act_gpu / GB, host=predicted.act_host / GB),
                     predicted_step_s_flops=job.step_seconds(tokens, plan))
        try:
            if untimed_first:  # a new length's first step (its kernels' first calls at these shapes): not timed
                entry["first_step_s"] = step(tokens, 2)[0]
                parts.clear()
            else:
                entry["first_at_length"] = True
            step_s, loss = step(tokens, 1)
            peak = max(v for k, v in parts.items() if k != "held") if cuda else float("nan")
            entry.update(status="ok", step_s=step_s, loss=loss, gpu_peak=peak, ratio=predicted.gpu / GB / peak
                         if cuda else None)
            prev = (tokens, step_s)
            speed = step_s / entry["predicted_step_s_flops"]
        except RuntimeError as e:  # out of memory: recorded, and the longer lengths after it not tried
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300],
                         peak_at_failure=torch.cuda.max_memory_allocated(dev) / GB if cuda else None)
        entry["part_peaks_gb"] = dict(parts)
        entry["host_rss_gb"] = psutil.Process().memory_info().rss / GB
        rec[name] = entry
        print(name, json.dumps(entry), flush=True)
        save()
        if entry["status"] != "ok":
            break
    rec["fallbacks"] = fallbacks.summary()


def run_stock(args, rec: dict, save) -> None:
    """Stock transformers: the model's own forward (its torch gated delta rule, SDPA), non-reentrant gradient
    checkpointing, its loss over full logits, torch AdamW; the first length of args.lengths that does not run out of
    memory (a warm-up step at that length, then the timed one)."""
    from transformers import AutoModelForCausalLM

    from common import is_oom

    config = build_config(args.shape, args.layers)
    config._attn_implementation = "sdpa"
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    rec.update(layers=config.num_hidden_layers, setup_s=time.perf_counter() - args.t0)

    def step(tokens, seed):
        ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed)).to(dev)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, float(loss)

    tried = []
    for tokens in args.lengths:
        entry = dict(tokens=tokens)
        try:
            entry["warmup_s"] = step(tokens, 0)[0]
            if cuda:
                entry["static_gb"] = torch.cuda.memory_allocated(dev) / GB
                torch.cuda.reset_peak_memory_stats(dev)
            entry["step_s"], entry["loss"] = step(tokens, 1)
            entry.update(status="ok", gpu_peak=torch.cuda.max_memory_allocated(dev) / GB if cuda else None)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            entry.update(status="oom", error=str(e).splitlines()[0][:300])
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        tried.append(entry)
        rec["tried"] = tried
        print("stock", json.dumps(entry), flush=True)
        save()
        if entry["status"] == "ok" or args.deadline - time.time() < 20:
            break


def child(args) -> None:
    rec = dict(phase=args.phase, shape=args.shape, status="error")
    out = Path(args.child_out)

    def save():
        out.write_text(json.dumps(rec, indent=1, default=str))

    try:
        (run_ours if args.phase in ("ours", "full") else run_stock)(args, rec, save)
        rec["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a benchmark records its failure and the parent moves on
        import traceback

        rec.update(status="error", error=str(e)[-600:], traceback=traceback.format_exc()[-3000:])
    rec["total_s"] = time.perf_counter() - args.t0
    save()


# ---- the parent ----

def table(results: dict) -> str:
    lines = [f"{'phase':6} {'L':>3} {'tokens':>8}  {'plan':12} {'step s':>8} {'GPU predicted / measured':>26}  note"]
    for phase in ("ours", "stock", "full"):
        r = results.get(phase) or {}
        if not r:
            continue
        if phase == "stock":
            for e in r.get("tried", []):
                peak = f"{e['gpu_peak']:.1f} GB" if e.get("gpu_peak") else "-"
                lines.append(f"{phase:6} {r.get('layers', '-'):>3} {e['tokens']:>8}  {'-':12} "
                             f"{e.get('step_s', float('nan')):8.2f} {peak:>26}  {e['status']}")
            if not r.get("tried"):
                lines.append(f"{phase:6} {r.get('status')} {r.get('error', r.get('reason', ''))[:120]}")
            continue
        names = [k for k in ("32k", "256k", "longest") if k in r]
        for name in names:
            e = r[name]
            if e.get("status") != "ok":
                lines.append(f"{phase:6} {r.get('layers', '-'):>3} {e['tokens']:>8}  {str(e.get('plan', '-')):12} "
                             f"{'-':>8} {'-':>26}  {e.get('status')} {e.get('error', '')[:80]}")
                continue
            ratio = e["predicted_gpu"] / e["gpu_peak"] if e["gpu_peak"] == e["gpu_peak"] else float("nan")
            gpu = f"{e['predicted_gpu']:.1f} / {e['gpu_peak']:.1f} ({ratio:.3f})"
            note = name
            if name == "longest" and r.get("longest_capped_by_time"):
                note = f"longest the time left allowed (predicted longest {r.get('longest_predicted')})"
            lines.append(f"{phase:6} {r['layers']:>3} {e['tokens']:>8}  {str(e['plan']):12} {e['step_s']:8.2f} "
                         f"{gpu:>26}  {note}")
        if not names:
            lines.append(f"{phase:6} {r.get('status')} {r.get('error', r.get('reason', ''))[:120]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the ours and stock phases")
    p.add_argument("--smoke", action="store_true", help="the tiny shape at a few hundred tokens (CPU)")
    p.add_argument("--budget-s", type=float, default=510)
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--stock-s", type=float, default=75.0,
                   help="seconds the ours phase leaves for the stock phase when it picks its longest length")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--shape", default="qwen3.5-0.8b", help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--names", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--longest", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--longest-cap", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=8 * K, help=argparse.SUPPRESS)
    p.add_argument("--reserve-s", type=float, default=0.0, help=argparse.SUPPRESS)
    # the ours phase's plan counts (checkpointed, inputs on the GPU, kept outputs) instead of plan_step's: a probe of
    # one term of the memory model (every layer recomputed: the peak is one layer's recompute beside what is held)
    p.add_argument("--force-plan", type=int, nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.t0 = time.perf_counter()
    if args.phase:
        child(args)
        return

    from common import child_env, launch

    start = time.time()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    shape = "tiny" if smoke else "qwen3.5-0.8b"
    full_layers = SHAPES[shape]["num_hidden_layers"]
    k = 8 if smoke else K  # smoke: the same phases at 1/128 of the lengths
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                command=" ".join(sys.argv), started=time.strftime("%Y-%m-%d %H:%M:%S"), budget_s=args.budget_s)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    results = dict(meta=meta)
    out_json = args.out / "hybrid.json"

    def write():
        out_json.write_text(json.dumps(results, indent=1, default=str))

    def phase(name, layers, lengths, names=(), longest=False, est_s=0.0):
        left = deadline - time.time()
        if est_s + 15 > left:
            results[name] = dict(status="skipped", reason=f"estimated {est_s:.0f} s, {left:.0f} s left")
            write()
            return
        rec_path = args.out / f".{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", "full" if name == "full" else name,
               "--child-out", str(rec_path), "--deadline", str(deadline - 5), "--shape", shape,
               "--layers", str(layers), "--warmup", str(8 * k), "--lengths", *map(str, lengths)]
        if names:
            cmd += ["--names", *names]
        if longest:
            cmd += ["--longest", "--reserve-s", str(args.stock_s)] + (["--longest-cap", str(2048)] if smoke else [])
        print(f"[run ] {name}: {layers} layers, {left:.0f} s left", flush=True)
        with open(args.out / "log_hybrid.txt", "a") as log:
            output, rc, timed_out, wall = launch(cmd, child_env(), max(5.0, left - 3), log, name)
        rec = json.loads(rec_path.read_text()) if rec_path.exists() else dict(status="timeout" if timed_out else
                                                                                 "crashed", returncode=rc)
        rec_path.unlink(missing_ok=True)
        if rec.get("status") != "ok":
            rec["output_tail"] = (output or "")[-2000:]
        rec["wall_s"] = wall
        results[name] = rec
        write()
        print(f"[done] {name}: {rec.get('status')} in {wall:.0f} s", flush=True)

    phase("ours", args.layers, [32 * k, 256 * k], ["32k", "256k"], longest=True)
    # stock's longest fitting length: the first of these that does not run out of memory (with fla installed,
    # transformers' Qwen3.5 runs fla's rule: 32k of the 24 layers took 104.2 GB on an H200, 2026-12-02)
    phase("stock", args.layers, [48 * k, 40 * k, 32 * k, 16 * k, 8 * k], est_s=min(60.0, args.stock_s))
    at256 = (results.get("ours") or {}).get("256k") or {}
    if args.layers < full_layers and at256.get("status") == "ok":
        ours = results["ours"]
        # The whole model's 256k step: this one's, scaled by the layers, plus a process's set-up and warm-up.
        est = at256["step_s"] * full_layers / args.layers * 1.1 + ours.get("setup_s", 30) + 3 * ours.get("warmup_s", 5)
        phase("full", full_layers, [256 * k], ["256k"], est_s=est)
    results["total_s"] = time.time() - start
    write()
    text = table(results)
    (args.out / "table_hybrid.txt").write_text(text + "\n")
    print(json.dumps(meta))
    print(text)


if __name__ == "__main__":
    main()
