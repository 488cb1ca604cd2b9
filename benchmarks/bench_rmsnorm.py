"""RMSNorm's rows kernels (levers/rmsnorm_rows.py, TRITON_ROWS) against torch's fused kernels, at the main job's norms.

Each norm of a decoder layer at the step's length, bf16, through RMSNormFunction (levers/rmsnorm.py) as the model runs
it: the forward alone and the forward with its backward, median of 10 after a warm-up; the bytes each moves at the
card's rate (forward: x read, y written; backward: x and dy read, dx written); and the whole step's share: a forward
for every layer and again for each checkpointed layer's recompute, a backward for every layer (the plans of
BENCHMARKS.md: 21 of 36 layers checkpointed on the Qwen3-4B shape at 128k, 10 of 28 on Qwen3-0.6B at 256k). Then the
rows kernels' block size (elements a program: rmsnorm_rows._ELEMENTS and _BWD_ELEMENTS, alike) swept on the per-head
q norm.

    python benchmarks/bench_rmsnorm.py --out $OUT

Writes <out>/rmsnorm.json; prints a table last. CUDA with Triton only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common import median_seconds

from ulysses_lc.levers import rmsnorm_rows  # noqa: E402
from ulysses_lc.levers.rmsnorm import RMSNormFunction  # noqa: E402

K = 1024
# shape: (layers, checkpointed layers, {norm: (rows, width)}); a layer runs each norm once.
SHAPES = {
    "qwen3-4b@128k": (36, 21, {"input/post-attention": (128 * K, 2560), "q (32 heads)": (128 * K * 32, 128),
                               "k (8 heads)": (128 * K * 8, 128)}),
    "qwen3-0.6b@256k": (28, 10, {"input/post-attention": (256 * K, 1024), "q (16 heads)": (256 * K * 16, 128),
                                 "k (8 heads)": (256 * K * 8, 128)}),
}


def _time(rows: int, width: int, triton_rows: bool) -> tuple[float, float]:
    """(forward s, forward + backward s) of one norm call."""
    rmsnorm_rows.TRITON_ROWS = triton_rows
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(width, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5).requires_grad_()
    dy = torch.randn_like(x)
    with torch.no_grad():
        fwd = median_seconds(lambda: RMSNormFunction.apply(x, w, 1e-6), 10, warmup=2)

    def both():
        torch.autograd.grad(RMSNormFunction.apply(x, w, 1e-6), (x, w), dy)
    return fwd, median_seconds(both, 10, warmup=2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res, lines = {"device": torch.cuda.get_device_name()}, []
    for shape, (layers, checkpointed, norms) in SHAPES.items():
        share = {"torch": 0.0, "rows": 0.0}
        for norm, (rows, width) in norms.items():
            calls = 2 if norm.startswith("input") else 1
            row = {}
            for how in ("torch", "rows"):
                fwd, both = _time(rows, width, how == "rows")
                elems = rows * width
                row[how] = dict(fwd_ms=1e3 * fwd, fwd_bwd_ms=1e3 * both, fwd_gbs=4 * elems / fwd / 1e9,
                                bwd_gbs=6 * elems / max(both - fwd, 1e-9) / 1e9)
                share[how] += calls * ((layers + checkpointed) * fwd + layers * (both - fwd))
            res[f"{shape} {norm}"] = row
            t, r = row["torch"], row["rows"]
            lines.append(f"{shape:16s} {norm:21s} torch fwd {t['fwd_ms']:7.3f} ms ({t['fwd_gbs']:5.0f} GB/s) fwd+bwd "
                         f"{t['fwd_bwd_ms']:7.3f} | rows {r['fwd_ms']:7.3f} ({r['fwd_gbs']:5.0f}) / "
                         f"{r['fwd_bwd_ms']:7.3f}")
        res[f"{shape} step share s"] = share
        lines.append(f"{shape:16s} the step's norms: torch {share['torch']:.3f} s -> rows {share['rows']:.3f} s")
    sweep = {}
    rows, width = SHAPES["qwen3-4b@128k"][2]["q (32 heads)"]
    default = rmsnorm_rows._ELEMENTS, rmsnorm_rows._BWD_ELEMENTS
    for elements in (1024, 2048, 4096, 8192, 16384):  # forward and backward alike
        rmsnorm_rows._ELEMENTS = rmsnorm_rows._BWD_ELEMENTS = elements
        fwd, both = _time(rows, width, True)
        sweep[elements] = dict(fwd_ms=1e3 * fwd, fwd_bwd_ms=1e3 * both)
        lines.append(f"q norm, 4B@128k, {elements:6d} elements a program: fwd {1e3 * fwd:7.3f} ms, fwd+bwd "
                     f"{1e3 * both:7.3f} ms")
    rmsnorm_rows._ELEMENTS, rmsnorm_rows._BWD_ELEMENTS = default
    res["sweep_q_norm_4b"] = sweep
    (args.out / "rmsnorm.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}; one norm call, bf16, median of 10")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
