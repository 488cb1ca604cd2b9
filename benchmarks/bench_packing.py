"""Packed documents: attention and a whole step at 256k tokens as one causal sequence and as packed documents.

    python benchmarks/bench_packing.py --out results/                    # one H200: kernel table, then steps
    python benchmarks/bench_packing.py --smoke --out /tmp/pack           # CPU, tiny shapes

Kernel: `kernels.document_attention` fwd+bwd, how="loop" (cuDNN-first SDPA per run of equal-length documents:
here one batched call) and how="varlen" (torch.nn.attention.varlen, one call), on q [1, 16, s, 128],
k, v [1, 8, s, 128], bf16, against one causal call over the whole sequence. TF/s count the FLOPs the block
diagonal needs: 3.5 x sum over documents of the causal forward's 2 n^2 h d (fwd+bwd as 3.5 forwards, the
convention of Dao-AILab/flash-attention's benchmarks/benchmark_flash_attention.py and of bench_step.py's kernel
rows), so a packed layout at the single-document rate would show the same TF/s.
Step: bench_step.py's "ours" variant (Qwen3-0.6B shape, all levers, the memory plan) with `docs` set, i.e.
shard_batch(document_lengths=[doc] * (s / doc)), against the same tokens as one causal sequence.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
K = 1024


def time_documents(seq: int, doc: int, how: str = "loop", mixed: bool = False, iters: int = 3, heads=16, kv_heads=8,
                   head_dim=128) -> dict:
    """mixed: document lengths drawn from [doc/2, 3 doc/2) (seeded), as packing real samples gives; else all doc."""
    from ulysses_lc.mixers.kernels import document_attention, resolve_kernel

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(1, kv_heads, seq, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(1, kv_heads, seq, head_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
    dout = torch.randn_like(q)
    if mixed:
        import random

        rng, bounds = random.Random(0), [0]
        while bounds[-1] < seq:
            bounds.append(min(seq, bounds[-1] + rng.randrange(doc // 2, 3 * doc // 2)))
    else:
        bounds = list(range(0, seq, doc)) + [seq]
    kernel = resolve_kernel("auto")

    def once():
        document_attention(q, k, v, bounds, head_dim ** -0.5, kernel, how=how).backward(dout)
        q.grad = k.grad = v.grad = None

    once()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    flops = 3.5 * sum(2 * (b - a) ** 2 * heads * head_dim for a, b in zip(bounds[:-1], bounds[1:]))
    return dict(seq=seq, doc=doc, mixed=mixed, how=how, documents=len(bounds) - 1, kernel=kernel, seconds=seconds,
                tflops=flops / seconds / 1e12)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seq", type=int, default=256 * K)
    p.add_argument("--docs", type=int, nargs="+", default=[256 * K, 32 * K, 16 * K, 8 * K, 4 * K, 1 * K])
    p.add_argument("--steps", action="store_true", help="also time whole steps through bench_step.py")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seq, docs = (2048, [2048, 512, 128]) if args.smoke else (args.seq, args.docs)
    hows = ["loop", "varlen"] if torch.cuda.is_available() else ["loop"]
    rows = [time_documents(seq, doc, how, mixed) for doc in docs for mixed in ((False, True) if doc < seq else (False,))
            for how in (hows if doc < seq else ["loop"])]
    single = next(r for r in rows if r["doc"] == seq)
    for r in rows:
        r["rate_vs_single"] = r["tflops"] / single["tflops"]
    (out / "packing_kernel.json").write_text(json.dumps(rows, indent=1))
    if args.steps:
        suite = "packing-smoke" if args.smoke else "packing"
        subprocess.run([sys.executable, str(HERE / "bench_step.py"), "--suite", suite, "--out", str(out)], check=False)
    print(f"{'docs':>10} {'lengths':>8} {'how':>7} {'n':>5} {'s':>9} {'TF/s':>8} {'vs one doc':>10}")
    for r in rows:
        print(f"{r['doc']:>10,} {'mixed' if r['mixed'] else 'equal':>8} {r['how']:>7} {r['documents']:>5} {r['seconds']:>9.3f} {r['tflops']:>8.1f} "
              f"{r['rate_vs_single']:>10.2f}")


if __name__ == "__main__":
    main()
