"""The fused SwiGLU kernels (levers/swiglu.py) against the eager silu(gate) * up, at the main job's MLP tiles.

One tile of the tiled MLP (levers/tiled_mlp.py: 16 tiles of 8192 tokens on the Qwen3-4B shape at 128k, i = 9728; 4 of
65536 on Qwen3-0.6B at 256k, i = 3072), bf16: the forward alone (what the tiled forward and its recompute run) and the
forward with its backward (what a tile's backward runs), median of 10 after a warm-up, and the whole step's share
(36 layers x 16 tiles, or 28 x 4: two forwards and one forward with backward a tile).

    python benchmarks/bench_swiglu.py --out $OUT

Writes <out>/swiglu.json; prints a table last. CUDA with Triton only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from common import median_seconds

from ulysses_lc.levers import swiglu  # noqa: E402

# name: (tile tokens, intermediate width, layers x tiles in the step)
SHAPES = {"qwen3-4b@128k": (8192, 9728, 36 * 16), "qwen3-0.6b@256k": (65536, 3072, 28 * 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res, lines = {"device": torch.cuda.get_device_name()}, []
    for name, (c, i, tiles) in SHAPES.items():
        g, u, dp = (torch.randn(1, c, i, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g.requires_grad_()
        u.requires_grad_()
        row = {}
        for how, fn in (("eager", lambda a, b: F.silu(a) * b), ("fused", swiglu.swiglu)):
            with torch.no_grad():
                fwd = median_seconds(lambda: fn(g, u), 10, warmup=2)

            def both():
                p = fn(g, u)
                torch.autograd.grad(p, (g, u), dp)
            both_s = median_seconds(both, 10, warmup=2)
            row[how] = dict(fwd_ms=1e3 * fwd, fwd_bwd_ms=1e3 * both_s, step_s=tiles * (2 * fwd + both_s))
        res[name] = row
        e, f = row["eager"], row["fused"]
        lines.append(f"{name:18s} eager fwd {e['fwd_ms']:7.3f} ms fwd+bwd {e['fwd_bwd_ms']:7.3f} ms | fused "
                     f"{f['fwd_ms']:7.3f} / {f['fwd_bwd_ms']:7.3f} ms | the step's share {e['step_s']:.3f} s -> "
                     f"{f['step_s']:.3f} s")
        del g, u, dp
    (args.out / "swiglu.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}; one MLP tile, bf16, median of 10")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
