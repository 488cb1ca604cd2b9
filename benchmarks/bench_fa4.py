"""FlashAttention-4 (kernel='fa4', ulysses_lc/mixers/fa4.py) against cuDNN SDPA, flex and torch's varlen on one GPU:
fwd+bwd TF/s on one rank's heads after the Ulysses exchange, at 256k tokens.

    python benchmarks/bench_fa4.py --out $OUT                    # full, window, docs (about 5 minutes on an H200)
    python benchmarks/bench_fa4.py --only full --out $OUT
    python benchmarks/bench_fa4.py --smoke --out /tmp/f          # CPU: the table from the SDPA rows only

Cases (the heads from the public configs):
  full    causal over the whole sequence: Qwen3-0.6B (16 q / 8 kv heads, head dim 128), gpt-oss-20b (64 / 8, 64)
          and Qwen3.5-0.8B's full layers (8 / 2, 256; --full-shapes picks among them);
          candidates cudnn (kernels.causal_attention, kernel='cudnn') and fa4 (kernel='fa4', the explicit op
          explicit_attention calls, one head group)
  window  sliding windows 128 (gpt-oss-20b, with and without its sinks) / 1024 (Gemma 3 27B: 32 / 16, 128) / 4096
          (Mistral 7B: 32 / 8, 128): flex (window_attention how='flex', the default where it runs) and fa4
  docs    packed documents, Qwen3-0.6B heads: 32 of 8k and a seeded mix of 1k-16k; auto (document_attention's
          default: one torch varlen call where documents are short, else per-run calls) and fa4 (one varlen call)
FLOPs (FlashAttention's benchmark convention, as bench_window.py): 4 h d per (query, key) pair the mask allows
(shape.window_pairs), backward 2.5x the forward, so fwd+bwd is 3.5x. vs_cudnn = a row's TF/s over the full causal cuDNN
rate at the same head dim (the full case's: for the windows at head dim 128 that is Qwen3-0.6B's heads, not theirs).
first_s is the first fwd+bwd (FA4 and flex compile there); peak_gb the most allocated during a fwd+bwd beyond q, k,
v (out, dout, the gradients and the kernel's own block). Each row is printed as JSON as it ends; a table last;
<out>/fa4_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ulysses_lc.shape import window_pairs  # noqa: E402
from common import median_seconds  # noqa: E402

GB = 1e9
FULL = [("qwen3-0.6b", 16, 8, 128), ("gpt-oss-20b", 64, 8, 64),
        ("qwen3.5-0.8b", 8, 2, 256)]  # Qwen3.5's gated full-attention layers: 8 / 2 heads of 256
WINDOWS = [("gpt-oss-20b", 64, 8, 64, 128, False), ("gpt-oss-20b", 64, 8, 64, 128, True),
           ("gemma3-27b", 32, 16, 128, 1024, False), ("mistral-7b", 32, 8, 128, 4096, False)]


def _doc_bounds(T: int, kind: str) -> tuple[int, ...]:
    if kind == "8k":
        return tuple(range(0, T + 1, 8192))
    rng, bounds = random.Random(0), [0]
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + rng.randint(1024, 16384)))
    return tuple(bounds)


def _attend(candidate: str, window=None, sinks=None, bounds=None):
    from ulysses_lc.mixers.kernels import causal_attention, document_attention
    from ulysses_lc.mixers.window_attention import window_attention

    kernel = "fa4" if candidate == "fa4" else ("cudnn" if candidate == "cudnn" else "auto")
    if bounds is not None:
        return lambda q, k, v: document_attention(q, k, v, bounds, None, kernel)
    if window is not None:
        how = "fa4" if candidate == "fa4" else "flex"
        return lambda q, k, v: window_attention(q, k, v, None, window, sinks, kernel, how=how)
    return lambda q, k, v: causal_attention(q, k, v, None, kernel)


def _run(fn, q, k, v, sinks, dout):
    for x in (q, k, v, sinks):
        if x is not None:
            x.grad = None
    fn(q, k, v).backward(dout)


def bench_row(case, name, candidate, h, h_kv, d, T, iters, device, window=None, sinks=False, bounds=None):
    row = dict(case=case, shape=name, candidate=candidate, heads=f"{h}/{h_kv}x{d}", tokens=T, window=window,
               sinks=sinks, docs=None if bounds is None else len(bounds) - 1)
    pairs = (sum(window_pairs(b - a, window) for a, b in zip(bounds[:-1], bounds[1:])) if bounds is not None
             else window_pairs(T, window))
    flops = 3.5 * 4.0 * h * d * pairs
    try:
        g = torch.Generator(device=device).manual_seed(0)
        make = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
        q, k, v = make(1, h, T, d), make(1, h_kv, T, d), make(1, h_kv, T, d)
        sink = make(h) if sinks else None
        dout = torch.randn(1, h, T, d, generator=g, device=device, dtype=torch.bfloat16)
        fn = _attend(candidate, window, sink, bounds)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _run(fn, q, k, v, sink, dout)
        torch.cuda.synchronize()
        row["first_s"] = round(time.perf_counter() - t0, 2)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            row["fwd_s"] = median_seconds(lambda: fn(q, k, v), iters, warmup=0)
        row["fwd_bwd_s"] = median_seconds(lambda: _run(fn, q, k, v, sink, dout), iters, warmup=0)
        row["peak_gb"] = round((torch.cuda.max_memory_allocated() - before) / GB, 2)
        row["tf_s"] = round(flops / row["fwd_bwd_s"] / 1e12, 1)
        row["fwd_tf_s"] = round(flops / 3.5 / row["fwd_s"] / 1e12, 1)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a row of the table, not the end of the run
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:400], traceback=traceback.format_exc()[-1500:])
    finally:
        q = k = v = dout = sink = None
        torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def table(rows) -> str:
    cudnn = {int(r["heads"].split("x")[1]): r["tf_s"] for r in rows
             if r["case"] == "full" and r["candidate"] == "cudnn" and r["status"] == "ok"}
    lines = [f"{'case':7s} {'shape':12s} {'heads':10s} {'window':>6s} {'sinks':5s} {'docs':>4s} {'candidate':9s} "
             f"{'fwd+bwd s':>9s} {'TF/s':>6s} {'vs cuDNN':>8s} {'fwd TF/s':>8s} {'first s':>7s} {'peak GB':>7s}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['case']:7s} {r['shape']:12s} {r['heads']:10s} {str(r['window'] or '-'):>6s} "
                         f"{str(r['sinks']):5s} {str(r['docs'] or '-'):>4s} {r['candidate']:9s} {r['error'][:90]}")
            continue
        ref = cudnn.get(int(r["heads"].split("x")[1]))
        vs = f"{r['tf_s'] / ref:.2f}" if ref else "-"
        lines.append(f"{r['case']:7s} {r['shape']:12s} {r['heads']:10s} {str(r['window'] or '-'):>6s} "
                     f"{str(r['sinks']):5s} {str(r['docs'] or '-'):>4s} {r['candidate']:9s} {r['fwd_bwd_s']:9.3f} "
                     f"{r['tf_s']:6.1f} {vs:>8s} {r['fwd_tf_s']:8.1f} {r['first_s']:7.1f} {r['peak_gb']:7.2f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--only", nargs="*", choices=["full", "window", "docs"], default=["full", "window", "docs"])
    p.add_argument("--candidates", nargs="*", default=["cudnn", "fa4", "flex", "auto"])
    p.add_argument("--full-shapes", nargs="*", default=[f[0] for f in FULL], choices=[f[0] for f in FULL])
    p.add_argument("--tokens", type=int, default=262144)
    p.add_argument("--iters", type=int, default=3, help="timed calls per row (the median is kept)")
    p.add_argument("--budget-s", type=float, default=400, help="no new row starts after this many seconds")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64
    if not torch.cuda.is_available():
        raise SystemExit("bench_fa4 times CUDA kernels: run it on a GPU.")
    device, T = torch.device("cuda"), (4096 if args.smoke else args.tokens)
    plan = []
    if "full" in args.only:
        plan += [("full", n, c, h, kv, d, {}) for n, h, kv, d in FULL if n in args.full_shapes
                 for c in ("cudnn", "fa4")]
    if "window" in args.only:
        plan += [("window", n, c, h, kv, d, dict(window=w, sinks=s)) for n, h, kv, d, w, s in WINDOWS
                 for c in ("fa4", "flex")]
    if "docs" in args.only:
        plan += [("docs", "qwen3-0.6b", c, 16, 8, 128, dict(bounds=_doc_bounds(T, kind)))
                 for kind in ("8k", "mixed") for c in ("auto", "fa4")]
    deadline = time.monotonic() + args.budget_s
    rows = []
    for case, name, candidate, h, kv, d, kw in plan:
        if candidate not in args.candidates:
            continue
        if time.monotonic() > deadline:
            rows.append(dict(case=case, shape=name, candidate=candidate, heads=f"{h}/{kv}x{d}",
                             window=kw.get("window"), sinks=kw.get("sinks", False), docs=None, status="skipped",
                             error="out of --budget-s"))
            continue
        rows.append(bench_row(case, name, candidate, h, kv, d, T, args.iters, device, **kw))
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                flash_attn_4=version("flash-attn-4"), cutlass_dsl=version("nvidia-cutlass-dsl"), tokens=T,
                iters=args.iters)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fa4_results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
