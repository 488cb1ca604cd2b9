"""FlashAttention-4's SM90 launch configurations at the main job's head groups, timed against its own default.

Issue 43: at the Qwen3-4B shape at 128k FA4's backward is 56% of the step and runs at about 0.9x its forward's
rate. flash-attn-4 4.0.0b40 picks one SM90 backward tile for head dim <= 128 causal (64 x 128, from C++ FA3's
launch template, benchmarked there on H100); `_flash_attn_bwd(..., config=)` takes any other BwdConfig and
validates it (shared memory, MMA divisibility). This script records the config FA4 selects for each shape, then
times each variant (median of 3 after a compiling call) and checks its dq / dk / dv against the default's (relative
Frobenius error; fp32 accumulation order is the only difference, so anything above 1e-2 is a wrong variant). The
same for a few forward variants (FwdConfig). One rank's view after the Ulysses exchange: [b, s, h, d] views of
[b, h, s, d] tensors, as mixers/fa4.py passes them.

    python benchmarks/bench_fa4_tiles.py --out $OUT [--budget-s 400] [--shapes 4b-all,4b,0.6b]

Writes <out>/fa4_tiles.json (every variant: config fields, ms, TF/s, errors, or the error it raised) and prints a
table per shape last. CUDA with flash-attn-4 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from common import median_seconds

# name: (seq, q heads, kv heads, head dim) of one head-group call
SHAPES = {
    "4b": (131072, 8, 2, 128),     # Qwen3-4B at 128k: 32 / 8 heads over 4 head groups
    "0.6b": (262144, 4, 2, 128),   # Qwen3-0.6B at 256k: 16 / 8 heads over 4 head groups
    "4b-all": (131072, 32, 8, 128),  # the 4B layer in one call (no head groups)
}

# backward variants: overrides of the selected BwdConfig (head dim 128, 2 MMA warp groups)
BWD = {
    "default": {},
    "dQ_swapAB": dict(dQ_swapAB=True),
    "PdS1": dict(num_stages_PdS=1),
    "V_in_regs": dict(V_in_regs=True),
    "dQ_atom2": dict(AtomLayoutMdQ=2),
    "SdP_noswap": dict(SdP_swapAB=False),
    "dKV_swap": dict(dKV_swapAB=True, AtomLayoutNdKV=1),
    "80x128": dict(tile_m=80, num_stages_PdS=1, dQ_swapAB=True),
    "80x128_PdS2": dict(tile_m=80, dQ_swapAB=True),
    "64x112": dict(tile_n=112, num_stages_PdS=1, SdP_swapAB=False, dKV_swapAB=True, AtomLayoutNdKV=1),
    "64x96": dict(tile_n=96, num_stages_PdS=1, SdP_swapAB=False, dKV_swapAB=True, AtomLayoutNdKV=1),
    "128x64": dict(tile_m=128, tile_n=64, num_stages_dO=1, num_stages_PdS=1, SdP_swapAB=False, AtomLayoutMSdP=2,
                   AtomLayoutNdKV=1, AtomLayoutMdQ=2),
    "96x64": dict(tile_m=96, tile_n=64, num_stages_PdS=1, dQ_swapAB=True, AtomLayoutMSdP=2, AtomLayoutNdKV=1),
    "64x64": dict(tile_n=64, num_stages_PdS=1, SdP_swapAB=False, AtomLayoutNdKV=1),
}
# forward variants: overrides of the selected FwdConfig
FWD = {
    "default": {},
    "pack_gqa_flip": "flip:pack_gqa",
    "no_overlap": dict(intra_wg_overlap=False),
    "pv_ss": dict(mma_pv_is_rs=False),
    "128x160": dict(tile_n=160),
    "128x176": dict(tile_n=176),
    "q_stage2": dict(q_stage=2),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def measure(call, iters=3):
    """(seconds of the first call, which compiles the variant; the median ms of `iters` more; the last result)."""
    c0 = time.time()
    call()
    torch.cuda.synchronize()
    first_s = time.time() - c0
    last = [None]

    def run():
        last[0] = call()
    return first_s, 1e3 * median_seconds(run, iters, warmup=0), last[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--shapes", default="4b-all,4b,0.6b")
    ap.add_argument("--only-bwd", default="", help="comma-separated BWD variant names (default: all)")
    ap.add_argument("--skip-fwd", action="store_true")
    ap.add_argument("--default-only", default="4b-all", help="shapes timed at FA4's own pick only")
    args = ap.parse_args()
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    from flash_attn.cute import interface

    seen = {}
    for name in ("select_bwd_config", "select_fwd_config"):
        orig = getattr(interface, name)

        def rec(inputs, _orig=orig, _name=name):
            cfg = _orig(inputs)
            seen[_name] = cfg
            return cfg
        setattr(interface, name, rec)

    records = []
    path = args.out / "fa4_tiles.json"
    tables = []
    for shape in args.shapes.split(","):
        s, h, hk, d = SHAPES[shape]
        torch.manual_seed(0)
        q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, hk, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
        bshd = lambda x: x.transpose(1, 2)  # noqa: E731
        scale = d ** -0.5
        fwd_flops = 4 * h * d * s * (s + 1) / 2
        kw = dict(softmax_scale=scale, causal=True)
        rows = []

        # forward variants
        out_ref = lse_ref = None
        lone = shape in args.default_only.split(",")
        for name, over in ({"default": {}} if args.skip_fwd or lone else FWD).items():
            if time.time() - t0 > args.budget_s:
                rows.append((f"fwd {name}", "skipped: time")); continue
            rec_ = dict(shape=shape, kind="fwd", variant=name)
            try:
                cfg = None
                if name != "default":
                    base = seen["select_fwd_config"]
                    if over == "flip:pack_gqa":
                        over = dict(pack_gqa=not base.pack_gqa)
                    cfg = dataclasses.replace(base, **over)
                first_s, ms, res = measure(lambda: interface._flash_attn_fwd(bshd(q), bshd(k), bshd(v),
                                                                             return_lse=True, config=cfg, **kw))
                rec_["first_s"] = round(first_s, 2)
                out, lse = res[0], res[1]
                if name == "default":
                    out_ref, lse_ref = out, lse
                    rec_["config"] = {f.name: repr(getattr(seen["select_fwd_config"], f.name))
                                      for f in dataclasses.fields(seen["select_fwd_config"])}
                else:
                    rec_["config"] = {k_: repr(v_) for k_, v_ in over.items()}
                rec_.update(ms=round(ms, 2), tflops=round(fwd_flops / ms / 1e9, 1), err_out=rel(out, out_ref))
                rows.append((f"fwd {name}", f"{ms:9.2f} ms {rec_['tflops']:7.1f} TF/s  err {rec_['err_out']:.1e}"))
            except Exception as e:  # noqa: BLE001 - a refused variant is a result
                rec_["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append((f"fwd {name}", "refused: " + rec_["error"][:90]))
            records.append(rec_)
            path.write_text(json.dumps(records, indent=1))
            print(shape, rows[-1], flush=True)
        out = lse = res = None  # only the default's output and log-sum-exp are kept
        grads_ref = None
        only = set(filter(None, args.only_bwd.split(",")))
        for name, over in BWD.items():
            if (only or lone) and name not in only and name != "default":
                continue
            if time.time() - t0 > args.budget_s:
                rows.append((f"bwd {name}", "skipped: time")); continue
            rec_ = dict(shape=shape, kind="bwd", variant=name, config=over)
            try:
                cfg = None if name == "default" else dataclasses.replace(seen["select_bwd_config"], **over)

                def call():
                    return interface._flash_attn_bwd(bshd(q), bshd(k), bshd(v), out_ref, bshd(dout),
                                                     lse_ref.contiguous(), config=cfg, **kw)
                first_s, ms, grads = measure(call)
                rec_["first_s"] = round(first_s, 2)
                grads = grads[:3]
                if name == "default":
                    grads_ref = grads
                    cfg_ = seen["select_bwd_config"]
                    rec_["config"] = {f.name: repr(getattr(cfg_, f.name)) for f in dataclasses.fields(cfg_)}
                errs = [rel(a, b) for a, b in zip(grads, grads_ref)]
                rec_.update(ms=round(ms, 2), tflops=round(2.5 * fwd_flops / ms / 1e9, 1), err_dq_dk_dv=errs)
                bad = " WRONG" if max(errs) > 1e-2 else ""
                rows.append((f"bwd {name}", f"{ms:9.2f} ms {rec_['tflops']:7.1f} TF/s  err {max(errs):.1e}{bad}"))
            except Exception as e:  # noqa: BLE001
                rec_["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append((f"bwd {name}", "refused: " + rec_["error"][:90]))
            records.append(rec_)
            path.write_text(json.dumps(records, indent=1))
            print(shape, rows[-1], flush=True)
        tables.append((shape, SHAPES[shape], rows))
        del q, k, v, dout, out_ref, lse_ref, grads_ref
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}; flash-attn-4 configs against its default, median of 3")
    for shape, (s, h, hk, d), rows in tables:
        print(f"\n{shape}: {s} tokens, {h} / {hk} heads x {d}")
        for name, text in rows:
            print(f"  {name:18s} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
