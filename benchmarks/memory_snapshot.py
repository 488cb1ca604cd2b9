"""Where one step's peak GPU memory goes: live allocations at the peak, grouped by where they were made.

    python benchmarks/memory_snapshot.py --seq 262144 --layers 1 4 --out $OUT

For each layer count: the Qwen3-0.6B shape with random weights and all levers (as bench_step.py's "ours"),
a warm-up step at 8k tokens, then one step at --seq under torch.cuda.memory._record_memory_history. The
trace is replayed to find the moment of the largest total allocated, and the allocations live then are
listed by the innermost frame in ulysses_lc / transformers / torch.utils.checkpoint (allocations made by
the autograd engine's C++ backward have no Python frame and are listed as "<backward>", with their sizes).
Allocations made before recording (weights, optimizer state) are not in the trace: they are the "static"
line. Writes <out>/snapshot_<kernel>_<layers>L.txt and prints the same.

Status: its one run so far (H200, torch 2.11, 2026-11-29) died inside the first checkpoint recompute with
"SystemError: apply returned NULL without setting an exception" while memory history was recorded: the
recompute's early stop ends it by raising through autograd Functions. The recorded step now runs with
early stop off (the recompute then also computes the layer's output, a few tensors more); not rerun yet.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import _init_dist, setup_ours  # noqa: E402
from common import build_model, random_tokens  # noqa: E402

GIB = 2**30
KEYS = ("ulysses_lc", "transformers", "checkpoint.py")


def _site(frames) -> str:
    for f in frames:
        if any(k in f["filename"] for k in KEYS):
            return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    return "<backward>" if not frames else f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}"


def peak_live(trace):
    live, total, best, best_i = {}, 0, -1, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, best_i = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    live = {}
    for e in trace[: best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return best, best_i, list(live.values())


def run(layers: int, seq: int, out: Path, levers: dict) -> str:
    from ulysses_lc import ParallelLayout

    model = build_model("qwen3-0.6b", layers)
    module, batch_fn, fwd_bwd = setup_ours(model, ParallelLayout.build(1), **levers)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=True)
    fwd_bwd(batch_fn(random_tokens(8192, model.config.vocab_size)))
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = batch_fn(random_tokens(seq, model.config.vocab_size))
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        fwd_bwd(batch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][0]
    best, best_i, live = peak_live(trace)
    groups = collections.defaultdict(list)
    for e in live:
        groups[_site(e.get("frames", []))].append(e["size"])
    lines = [f"{layers} layers, {seq} tokens, kernel {levers.get('kernel', 'auto')}: peak {peak / GIB:.2f} GiB = static {static / GIB:.2f} + traced "
             f"{best / GIB:.2f} (event {best_i} of {len(trace)}); live at the peak, by site:"]
    for site, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:25]:
        sizes.sort(reverse=True)
        shown = ", ".join(f"{s / GIB:.3f}" for s in sizes[:6]) + (" ..." if len(sizes) > 6 else "")
        lines.append(f"  {sum(sizes) / GIB:8.3f} GiB  {len(sizes):4d} x  {site}   [{shown}]")
    # The 30 events before the peak: what was being computed.
    lines.append("  last allocations before the peak:")
    for e in trace[max(0, best_i - 12): best_i + 1]:
        if e["action"] == "alloc":
            lines.append(f"    {e['size'] / GIB:8.3f} GiB  {_site(e.get('frames', []))}")
    text = "\n".join(lines)
    (out / f"snapshot_{levers.get('kernel', 'auto')}_{layers}L.txt").write_text(text + "\n")
    del module, opt, batch, model
    torch.cuda.empty_cache()
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=262144)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--kernel", default="auto", help="attention kernel (ulysses_lc.KERNELS); auto = cuDNN first")
    p.add_argument("--out", default=os.environ.get("OUT", "snapshot_out"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _init_dist()
    for layers in args.layers:
        print(run(layers, args.seq, out, {"kernel": args.kernel}), flush=True)


if __name__ == "__main__":
    main()
