"""Transient memory of one causal attention forward + backward, per SDPA backend.

    python benchmarks/attn_workspace.py --seq 262144 --heads 16 --kv-heads 8 --out $OUT     # one GPU

At long sequence one layer's backward is the peak of a step, and the attention backward is the
largest thing in it (benchmarks/memory_snapshot.py). This times one fwd+bwd of q [1, heads, s, d],
k, v [1, kv_heads, s, d] in bf16 for each backend that takes the shape, GQA (enable_gqa) and with k, v
repeated to all heads, and reports peak memory above the inputs and gradients' own sizes. Then
ulysses_lc's explicit cuDNN path over --groups head groups (attention.explicit_attention): time, peak,
and whether output and gradients are bitwise equal to F.scaled_dot_product_attention's. Writes
<out>/attn_workspace.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GIB = 2**30


def one(backend, s, heads, kv_heads, d, gqa, groups=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    kvh = kv_heads if gqa else heads
    q = torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, kvh, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, kvh, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dout = torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    # What any kernel must hold anyway: out and dq (each the size of q), dk, dv (the sizes of k, v).
    must = 2 * q.nbytes + k.nbytes + v.nbytes
    scale = d**-0.5
    with sdpa_kernel([backend]):
        for i in range(2):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if groups is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=gqa and kvh != heads)
            else:
                from ulysses_lc.mixers.explicit_attention import explicit_attention

                out = explicit_attention(q, k, v, scale, "cudnn", groups)
            out.backward(dout)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() - base
            result = (out.detach(), q.grad, k.grad, v.grad)
            del out
            q.grad = k.grad = v.grad = None
    row = dict(step_s=dt, peak_above_inputs_gib=peak / GIB, beyond_out_and_grads_gib=(peak - must) / GIB)
    return row, result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=262144)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--groups", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="head groups for ulysses_lc's explicit cuDNN path")
    p.add_argument("--out", default=os.environ.get("OUT", "attn_out"))
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, when not pip-installed
    rows = []
    ref = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            row = dict(backend=backend.name, gqa=gqa, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads)
            try:
                got, result = one(backend, args.seq, args.heads, args.kv_heads, args.head_dim, gqa)
                row.update(got)
                row["status"] = "ok"
                if backend == SDPBackend.CUDNN_ATTENTION and gqa:
                    ref = result
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row["status"] = type(e).__name__ + ": " + str(e).splitlines()[0][:120]
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    # The kernel against itself: a second run of the same SDPA cuDNN call on the same inputs.
    row = dict(backend="sdpa-cudnn rerun", gqa=True, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads)
    got, result = one(SDPBackend.CUDNN_ATTENTION, args.seq, args.heads, args.kv_heads, args.head_dim, True)
    row.update(got, status="ok", bitwise_vs_sdpa=all(torch.equal(a, b) for a, b in zip(result, ref)),
               max_abs_diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(result, ref)))
    del result
    rows.append(row)
    print(json.dumps(row), flush=True)
    for groups in args.groups:
        row = dict(backend=f"ours-cudnn/{groups}", gqa=True, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads)
        result = None
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                got, result = one(SDPBackend.CUDNN_ATTENTION, args.seq, args.heads, args.kv_heads, args.head_dim,
                                  True, groups)
            row.update(got)
            row["bitwise_vs_sdpa"] = ref is not None and all(torch.equal(a, b) for a, b in zip(result, ref))
            row["max_abs_diff"] = None if ref is None else max((a.float() - b.float()).abs().max().item()
                                                               for a, b in zip(result, ref))
            row["status"] = "ok"
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
            row["status"] = type(e).__name__ + ": " + str(e).splitlines()[0][:120]
        del result
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn_workspace.json").write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))
    print(f"\n{'backend':20} {'gqa':5} {'fwd+bwd s':>9} {'peak GiB':>9} {'own GiB':>10}  status")
    for r in rows:
        if r["status"] == "ok":
            same = "" if "bitwise_vs_sdpa" not in r else f" bitwise={r['bitwise_vs_sdpa']} maxdiff={r['max_abs_diff']}"
            print(f"{r['backend']:20} {str(r['gqa']):5} {r['step_s']:9.3f} {r['peak_above_inputs_gib']:9.3f} "
                  f"{r['beyond_out_and_grads_gib']:10.3f}  ok{same}")
        else:
            print(f"{r['backend']:20} {str(r['gqa']):5} {'-':>9} {'-':>9} {'-':>10}  {r['status']}")


if __name__ == "__main__":
    main()
