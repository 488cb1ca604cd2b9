"""Sliding-window attention on one GPU: each CUDA candidate's fwd+bwd rate on the FLOPs the window needs, against
the full causal cuDNN kernel at the same length and heads; then whole training steps of a public gpt-oss shape
(random weights, fewer layers) beside stock transformers.

    python benchmarks/bench_window.py --out $OUT                 # kernels, then steps (about 6 minutes on an H200)
    python benchmarks/bench_window.py --only kernels --out $OUT
    python benchmarks/bench_window.py --smoke --out /tmp/w       # CPU, tiny sizes: every path end to end

FLOPs (FlashAttention's benchmark convention, github.com/Dao-AILab/flash-attention benchmarks/
benchmark_flash_attention.py: 4 T^2 h d halved for causal, backward 2.5x the forward): a causal forward is 2 T^2 h d, a windowed one 4 h d (T w - w^2 / 2)
(ModelShape.attention_pairs: the pairs the window needs, not what a kernel computes); fwd+bwd is 3.5x the forward.
rate_vs_causal = the candidate's TF/s on its own FLOPs / the full causal cuDNN kernel's TF/s (target >= 0.7).
Candidates (ulysses_lc.mixers.window_attention unless said): band_cudnn (two batched cuDNN causal calls over the band),
band_flash (the same through SDPA's FLASH ops), flash_window (one call of torch's FLASH kernel with its window),
band_cudnn_sinks / flash_window_sinks (those with gpt-oss sinks), flex (torch.nn.attention.flex_attention as its docs show it:
compiled, create_block_mask over a sliding-window mask_mod), auto / auto_sinks (the library's default,
window_attention with how="auto"), flex_lib / flex_lib_sinks (its flex path, how="flex": flex_window.py's
call, its own block mask, sinks through the log-sum-exp), flex_ourmask / flex_lib_torchmask / flex_lib_direct (torch's flex call
over the library's block mask, the library's call over torch's mask, and over its own without window_attention). Each is first checked against an fp32 softmax over an explicit mask (8 heads, a
length that is no multiple of the window): rel_err is the largest relative error norm over out, dq, dk, dv.
Each run prints its JSON rows as it goes, a table last, and writes <out>/window_results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import median_seconds  # noqa: E402

# (name, q heads, kv heads, head dim, window) from the public configs.
HEAD_SHAPES = [("gpt-oss-20b", 64, 8, 64, 128), ("gemma3-27b", 32, 16, 128, 1024), ("mistral-7b", 32, 8, 128, 4096)]
CANDIDATES = ["band_cudnn", "band_flash", "flash_window", "band_cudnn_sinks", "flash_window_sinks", "auto", "auto_sinks",
              "flex", "flex_lib", "flex_lib_sinks", "flex_ourmask", "flex_lib_torchmask",
              "flex_lib_direct"]
# torch.compile'd (the slowest to start): run after the others; auto is flex where WINDOW_RATES ranks it highest
COMPILED = {"flex", "flex_lib", "flex_lib_sinks", "auto", "auto_sinks", "flex_ourmask", "flex_lib_torchmask",
            "flex_lib_direct"}
# gpt-oss-20b (openai/gpt-oss-20b config.json): 24 layers, 32 experts of which 4 per token.
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, vocab_size=201088, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   tie_word_embeddings=False, max_position_embeddings=131072)


def _flops_fwd(T, h, d, window):
    from ulysses_lc.shape import window_pairs

    return 4.0 * h * d * window_pairs(T, window)


BACKENDS_SEEN: set = set()  # (candidate, the explicit backend window_attention ran): a refusal falls through


def _attend(name, window, sinks=None):
    """fn(q, k, v) -> out [b, h, s, d] for a candidate."""
    from ulysses_lc.mixers.window_attention import window_attention

    settings = {"band_cudnn": ("cudnn", "band"), "band_cudnn_sinks": ("cudnn", "band"), "band_flash": ("sdpa", "band"),
                "flash_window": ("auto", "flash_window"), "flash_window_sinks": ("auto", "flash_window")}
    if name in settings:
        kernel, how = settings[name]

        def fn(q, k, v):
            seen = []
            out = window_attention(q, k, v, None, window, sinks, kernel=kernel, how=how, sink_list=seen)
            BACKENDS_SEEN.add((name, seen[0][1]))
            return out
        return fn
    if name in ("auto", "auto_sinks", "flex_lib", "flex_lib_sinks"):  # the library's default, and its flex path

        def fn(q, k, v):
            from ulysses_lc.mixers.window_attention import resolve_how

            how = "flex" if name.startswith("flex") else "auto"
            BACKENDS_SEEN.add((name, resolve_how(how, q.device, window)))
            return window_attention(q, k, v, None, window, sinks if name.endswith("sinks") else None, how=how)
        return fn
    if name == "causal_cudnn":
        from ulysses_lc.mixers.kernels import causal_attention

        return lambda q, k, v: causal_attention(q, k, v, None, "cudnn")
    if name in ("flex", "flex_ourmask", "flex_lib_torchmask", "flex_lib_direct"):
        # torch's flex as its docs show it, and the two halves of the library's path swapped in one at a time (to
        # find where the library's flex path loses its 1-3% to it): torch's call over the library's block mask
        # (flex_window.block_mask), and the library's compiled call (flex_window.flex_call) over torch's mask
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from ulysses_lc.mixers import flex_window

        compiled = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def fn(q, k, v):
            T, gqa = q.shape[2], q.shape[1] != k.shape[1]
            if name == "flex_ourmask":
                return compiled(q, k, v, block_mask=flex_window.block_mask(T, window, None, q.device), enable_gqa=gqa)
            if name == "flex_lib_direct":  # the library's call and mask, without window_attention around them
                return flex_window.flex_window_attention(q, k, v, q.shape[-1] ** -0.5, window)
            if T not in masks:
                # _compile=True: built block by block; uncompiled it materialises a T x T mask (64 GiB at 256k)
                masks[T] = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (ki > qi - window), None, None, T, T,
                                             device=q.device, _compile=True)
            if name == "flex_lib_torchmask":
                return flex_window._compiled()(q, k, v, masks[T], q.shape[-1] ** -0.5, gqa, None)
            return compiled(q, k, v, block_mask=masks[T], enable_gqa=gqa)
        return fn
    raise ValueError(name)


def _reference(q, k, v, window, sinks):
    """fp32 softmax over an explicit mask, sinks as one more column."""
    h, T = q.shape[1], q.shape[2]
    q, k, v = (x.float() for x in (q, k, v))
    k, v = (x.repeat_interleave(h // x.shape[1], 1) for x in (k, v))
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, h, 1, 1).expand(1, h, T, 1)], -1)
    return scores.softmax(-1)[..., :T] @ v


def _check(name, h_kv, d, window, device, dtype):
    """Largest relative error norm of out, dq, dk, dv against _reference (8 query heads of one kv head's group)."""
    h, T = 8, 3 * window + 123
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, n, T, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (h, 1, 1))
    sinks = torch.randn(h, device=device, dtype=dtype, generator=g).requires_grad_() if "sinks" in name else None
    dout = torch.randn(1, h, T, d, device=device, dtype=dtype, generator=g)
    out = _attend(name, window, sinks)(q, k, v)
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    got = [out] + list(torch.autograd.grad(out, leaves, dout))
    ref_out = _reference(q, k, v, window, sinks)
    want = [ref_out] + list(torch.autograd.grad(ref_out, leaves, dout.float()))
    return max(float((a.detach().float() - b.detach()).norm() / b.detach().norm()) for a, b in zip(got, want))


def bench_kernels(T, device, dtype, iters, deadline, shapes=HEAD_SHAPES, candidates=CANDIDATES, baselines=None,
                  warmup=2):
    """Rows per (shape, candidate); `baselines` {shape: causal TF/s} is filled on the first call and read after."""
    rows, baselines = [], {} if baselines is None else baselines
    for shape, h, h_kv, d, window in shapes:
        g = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(1, h, T, d, device=device, dtype=dtype, generator=g).requires_grad_()
        k, v = (torch.randn(1, h_kv, T, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in "kv")
        sinks = torch.randn(h, device=device, dtype=dtype, generator=g).requires_grad_()
        dout = torch.randn(1, h, T, d, device=device, dtype=dtype, generator=g)
        for name in ([] if shape in baselines else ["causal_cudnn"]) + candidates:
            row = dict(shape=shape, heads=h, kv_heads=h_kv, head_dim=d, window=window, tokens=T, candidate=name)
            if time.monotonic() > deadline:
                rows.append(dict(row, status="skipped"))
                continue
            try:
                if name != "causal_cudnn":
                    row["rel_err"] = _check(name, h_kv, d, window, device, dtype)
                fn = _attend(name, window, sinks if "sinks" in name else None)

                def once():
                    for x in (q, k, v, sinks):
                        x.grad = None
                    fn(q, k, v).backward(dout)

                causal = name == "causal_cudnn"
                t = median_seconds(once, min(2, iters) if causal else iters, warmup=warmup if name in COMPILED else 1)
                flops = 3.5 * (2.0 * T * T * h * d if causal else _flops_fwd(T, h, d, window))
                row.update(status="ok", fwd_bwd_s=t, tflops=flops / t / 1e12,
                           backend=sorted(b for c, b in BACKENDS_SEEN if c == name))
                if causal:
                    baselines[shape] = row["tflops"]
                elif baselines.get(shape):
                    row["rate_vs_causal"] = row["tflops"] / baselines[shape]
            except Exception as e:  # noqa: BLE001 - a benchmark records every failure and moves on
                row.update(status="error", error=str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del q, k, v, dout, sinks
    return rows


# ---- whole steps, each in its own process (an out-of-memory step cannot poison the next) ----

def build_gpt_oss(layers, device, dtype, smoke=False):
    from transformers import AutoModelForCausalLM, GptOssConfig

    kw = dict(GPT_OSS_20B)
    if smoke:
        kw.update(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=1000, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    config = GptOssConfig(num_hidden_layers=layers, attn_implementation="eager", use_cache=False, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def run_step(spec):
    from bench_step import _init_dist, random_tokens, setup_ours, setup_stock

    from ulysses_lc import ParallelLayout
    from ulysses_lc.plan.metrics import model_flops_per_step

    rec = dict(spec, status="error")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        _init_dist()
        model = build_gpt_oss(spec["layers"], device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                              spec.get("smoke", False))
        layout = ParallelLayout.build(1)
        if spec["kind"] == "ours":
            module, batch_fn, fwd_bwd = setup_ours(model, layout, **spec.get("levers", {}))
        else:
            module, batch_fn, fwd_bwd = setup_stock(model)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=device.type == "cuda")
        vocab, seq = model.config.vocab_size, spec["seq"]

        def step(ids):
            loss = fwd_bwd(batch_fn(ids))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)

        step(random_tokens(min(seq, spec.get("warmup", seq)), vocab))
        if spec["kind"] == "ours" and device.type == "cuda":
            # The optimizer state exists after the warm-up step: nothing left to reserve.
            module.use_plan(module.plan_step(seq, device, reserved_bytes=0))
            rec["plan"] = list(module.plan.counts)
            # flex compiles once per length (flex_window.py): an untimed step at the timed length first
            # (2026-12-02, with the warm-up alone at 8k, the timed step took that compile: 21.29 s, BENCHMARKS.md)
            step(random_tokens(seq, vocab, seed=1))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rec["loss"] = step(random_tokens(seq, vocab, seed=2))
        if device.type == "cuda":
            torch.cuda.synchronize()
            rec["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        rec["step_s"] = time.perf_counter() - t0
        ckpt = module.checkpointing.report() if getattr(module, "checkpointing", None) is not None else None
        flops = model_flops_per_step(model.config, seq, recompute_layers=ckpt["checkpointed_layers"] if ckpt else None,
                                     cached_attention_layers=ckpt["cached_attention_layers"] if ckpt else 0)
        rec.update(status="ok", tflops_model=flops.model / rec["step_s"] / 1e12)
    except BaseException as e:  # noqa: BLE001
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
        rec.update(status="oom" if oom else "error", error=str(e).splitlines()[0][:300] if str(e) else repr(e))
        if not oom:
            rec["traceback"] = traceback.format_exc()[-1500:]
    return rec


def bench_steps(specs, deadline):
    rows = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    for spec in specs:
        left = deadline - time.monotonic()
        if spec.get("longest") and any(r.get("longest") and r["status"] == "ok" for r in rows):
            continue  # a longer one already ran: that is the longest that fits
        if left < spec.get("est_s", 30):
            rows.append(dict(spec, status="skipped"))
            continue
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=left)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            rec = json.loads(line[-1]) if line else dict(spec, status="crashed", tail=proc.stdout[-800:])
        except subprocess.TimeoutExpired:
            rec = dict(spec, status="timeout")
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        if rec.get("traceback"):
            print(rec["traceback"], flush=True)
    return rows


def table(kernel_rows, step_rows):
    lines = ["shape            w     candidate          rel_err   fwd+bwd s   TF/s   vs causal"]
    for r in kernel_rows:
        if r.get("status") != "ok":
            lines.append(f"{r['shape']:<16} {r['window']:<5} {r['candidate']:<18} {r.get('status')}: "
                         f"{r.get('error', '')[:60]}")
            continue
        lines.append(f"{r['shape']:<16} {r['window']:<5} {r['candidate']:<18} {r.get('rel_err', 0):8.1e} "
                     f"{r['fwd_bwd_s']:10.4f} {r['tflops']:6.0f}   {r.get('rate_vs_causal', 1.0):.2f}  "
                     f"{','.join(r.get('backend', []))}")
    lines.append("step (gpt-oss-20b shape)   layers  tokens    status  step s   peak GB  model TF/s")
    for r in step_rows:
        kind = r["kind"] + ("" if not r.get("levers") else " " + ",".join(f"{k}={v}" for k, v in r["levers"].items()))
        lines.append(f"{kind:<26} {r['layers']:<7} {r['seq']:<9} {r['status']:<7} {r.get('step_s', 0):7.2f} "
                     f"{r.get('peak_gb', 0):8.1f}  {r.get('tflops_model', 0):6.0f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--only", choices=["kernels", "steps"])
    p.add_argument("--tokens", type=int, default=262144)
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--candidates", nargs="*", default=CANDIDATES, choices=CANDIDATES,
                   help="in the order they run, per shape (compiled ones after the others)")
    p.add_argument("--shapes", nargs="*", default=[x[0] for x in HEAD_SHAPES], choices=[x[0] for x in HEAD_SHAPES])
    p.add_argument("--iters", type=int, default=3, help="timed calls per candidate (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of a compiled candidate first")
    p.add_argument("--fused-rope", action="store_true",
                   help="also time ours with fused_rope=True (levers/rope.py) after ours, in the same call")
    p.add_argument("--child")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_step(json.loads(args.child)), default=str), flush=True)
        return
    torch._dynamo.config.recompile_limit = 64  # torch's flex compiles once per length and window, statically
    deadline = time.monotonic() + args.budget_s
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    T = args.tokens if cuda else 96
    kernel_rows, step_rows, baselines = [], [], {}
    shapes = [x for x in HEAD_SHAPES if x[0] in args.shapes] if cuda else [("tiny", 4, 2, 16, 8)]
    if args.only != "steps":  # flex (compiled per shape, the slowest to start) after the steps
        kernel_rows = bench_kernels(T, device, dtype, args.iters if cuda else 1, deadline, shapes,
                                    [c for c in args.candidates if c not in COMPILED] if cuda else ["band_cudnn"],
                                    baselines)
    if args.only != "kernels":
        seq, layers = (args.tokens, args.layers) if cuda else (256, 2)
        specs = [dict(kind="ours", seq=seq, layers=layers, warmup=8192, est_s=120, smoke=not cuda),
                 dict(kind="stock", seq=seq, layers=layers, est_s=30, smoke=not cuda)]
        if args.fused_rope:
            specs.insert(1, dict(specs[0], levers=dict(fused_rope=True)))
        specs += [dict(kind="stock", seq=n, layers=layers, est_s=40, smoke=not cuda, longest=True)
                  for n in ((32768, 16384, 8192) if cuda else (128,))]  # stock's longest fitting length
        step_rows = bench_steps(specs, deadline)
    if args.only != "steps" and cuda:
        kernel_rows += bench_kernels(T, device, dtype, args.iters, deadline, shapes,
                                     [c for c in args.candidates if c in COMPILED], baselines, args.warmup)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__,
                device=torch.cuda.get_device_name() if cuda else "cpu", tokens=T)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window_results.json").write_text(json.dumps(dict(meta=meta, kernels=kernel_rows, steps=step_rows),
                                                        indent=1, default=str))
    print(json.dumps(meta))
    print(table(kernel_rows, step_rows))


if __name__ == "__main__":
    main()
