"""The loss head alone: our chunked loss against a TRL-style chunked loss and full logits.

    python benchmarks/bench_loss.py --tokens 32768 131072 --hidden 1024 --out $OUT    # one GPU
    python benchmarks/bench_loss.py --smoke                                            # CPU, tiny

Variants, each forward + backward of the summed cross-entropy of hidden [t, h] (bf16) against a
[vocab, h] head (bf16, vocab 151,936 as Qwen3), gradients for both:
  ours          ulysses_lc.chunked_cross_entropy, automatic rows (~1 GiB of fp32 logits per chunk),
                gradient computed in forward (3 matmuls per chunk, bf16 in, fp32 softmax)
  ours-fused    ours with each chunk's softmax cross-entropy as one Triton kernel over its bf16 logits, the
                gradient written in place (levers/ce_rows.py's FUSED_ROWS; CUDA)
  ours-256      the same with 256-row chunks (isolates the chunk size)
  trl-style     the peer the issue names: 256-row chunks, the head cast to fp32 per chunk, the chunk's
                logits recomputed in backward (torch.utils.checkpoint per chunk: 4 matmuls, fp32)
  full          bf16 logits [t, vocab] at once, fp32 cross-entropy (what fits only at short length)
  ours-<rows>   with --rows: ours with that many rows per chunk (the automatic size is
                ulysses_lc.levers.chunked_loss.auto_chunk_rows(vocab), printed first)
Timed: median of 3 after one warm-up; peak = max_memory_allocated above what the inputs hold.
The same numbers are printed as a table and written to <out>/loss_results.json. Loss values of all
variants are printed next to each other (they must agree to ~1e-3 relative in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when not pip-installed
from ulysses_lc.constants import IGNORE_INDEX  # noqa: E402


def trl_style(hidden, weight, labels, rows=256):
    total = hidden.new_zeros((), dtype=torch.float32)

    def chunk_loss(h, y):
        logits = F.linear(h.float(), weight.float())
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    for start in range(0, hidden.shape[0], rows):
        total = total + checkpoint(chunk_loss, hidden[start:start + rows], labels[start:start + rows],
                                   use_reentrant=False)
    return total


def full(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def ours(rows=None, fused=False):
    from ulysses_lc import chunked_cross_entropy
    from ulysses_lc.levers import ce_rows

    def run(hidden, weight, labels):
        before, ce_rows.FUSED_ROWS = ce_rows.FUSED_ROWS, fused
        try:
            return chunked_cross_entropy(hidden, weight, labels, chunk_rows=rows)[0]
        finally:
            ce_rows.FUSED_ROWS = before

    return run


def bench(fn, t, h, vocab, device, dtype, iters=3):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(t, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (t,), generator=g).to(device)
    labels[: t // 100] = IGNORE_INDEX

    def once():
        loss = fn(hidden, weight, labels)
        loss.backward()
        hidden.grad = weight.grad = None
        return float(loss)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loss = once()
    sync()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return dict(step_s=statistics.median(times), peak_extra_gib=peak, loss=loss)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, nargs="*", default=[],
                   help="also time ours with these chunk row counts (a chunk-size sweep)")
    p.add_argument("--variants", nargs="*", default=None, help="time only these (default: all)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32")
    p.add_argument("--out", default=os.environ.get("OUT", "loss_out"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.tokens, args.hidden, args.vocab = [512], 32, 1000
    variants = {"ours": ours(), "ours-fused": ours(fused=True), "ours-256": ours(256), "trl-style": trl_style,
                "full": full}
    variants.update({f"ours-{r}": ours(r) for r in args.rows})
    if args.variants:
        unknown = sorted(set(args.variants) - set(variants))
        if unknown:
            p.error(f"unknown variants {unknown}; known: {sorted(variants)}")
        variants = {name: variants[name] for name in args.variants}
    from ulysses_lc.levers.chunked_loss import auto_chunk_rows

    print(f"automatic chunk: {auto_chunk_rows(args.vocab)} rows at vocab {args.vocab}", flush=True)
    rows = []
    for t in args.tokens:
        for name, fn in variants.items():
            row = dict(tokens=t, hidden=args.hidden, vocab=args.vocab, variant=name)
            try:
                row.update(bench(fn, t, args.hidden, args.vocab, device, dtype))
                row["status"] = "ok"
            except torch.OutOfMemoryError:
                row["status"] = "oom"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_results.json").write_text(json.dumps(dict(device=str(device), torch=torch.__version__,
                                                           rows=rows), indent=1))
    print(f"\n{'tokens':>8} {'variant':10} {'status':6} {'fwd+bwd s':>10} {'peak GiB':>9} {'loss':>14}")
    for r in rows:
        pk = r.get("peak_extra_gib")
        print(f"{r['tokens']:>8} {r['variant']:10} {r['status']:6} {r.get('step_s', float('nan')):>10.4f} "
              f"{'-' if pk is None else format(pk, '.2f'):>9} {r.get('loss', float('nan')):>14.4f}")


if __name__ == "__main__":
    main()
