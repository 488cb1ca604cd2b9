"""Why FA4's backward runs slower inside the step than alone, and the forward over all heads against head groups.

Issue 43: in the profiled Qwen3-4B step at 128k FA4's backward took 144 ms a call (20.76 s over 36 layers x 4 head
groups), where bench_fa4_tiles.py timed the same head group at 135.78 ms alone; the forward did not slow down (52.6
ms in the step, 53.8 alone). Each suspect is timed here on one layer's tensors (32 / 8 heads x 128, 128k, bf16),
through the step's own code (`explicit_attention._grouped_forward` / `_grouped_backward` with backend "fa4"):

  layout     q, k, v, out, dout in [b, h, s, d] storage (bench_fa4_tiles.py's) against [b, s, h, d] storage seen as
             [b, h, s, d] (what the step hands the kernel: the projections' output, and dout from o_proj's backward)
  copies     the backward while a side stream copies pinned host memory both ways (the offload's prefetch and
             store run beside it in the step)
  sustained  the layer's backward back to back for --sustain-s seconds, each call timed with CUDA events: the
             first calls against the last, with the SM clock and power sampled by nvidia-smi meanwhile
  forward    one call over all heads (the default since 2026-12-06) against four head-group calls

    python benchmarks/bench_fa4_gap.py --out $OUT [--sustain-s 20]

Writes <out>/fa4_gap.json and prints a table last. CUDA with flash-attn-4 only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import REPO, median_seconds  # noqa: F401 - common puts the repo on sys.path

from ulysses_lc.mixers import explicit_attention as ea  # noqa: E402

S, H, HK, D, GROUPS = 131072, 32, 8, 128, 4
FWD_FLOPS = 4 * H * D * S * (S + 1) / 2  # causal, one layer


def tensors(seq_major: bool):
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(h):
        shape = (1, S, h, D) if seq_major else (1, h, S, D)
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        return x.transpose(1, 2) if seq_major else x

    q, k, v, dout = make(H), make(HK), make(HK), make(H)
    return q, k, v, dout


def timed(fn, iters=5):
    return 1e3 * median_seconds(fn, iters, warmup=1)


def layer_backward(q, k, v, dout, fwd):
    out, lse, aux = fwd
    return ea._grouped_backward("fa4", dout, q, k, v, out, lse, aux, D ** -0.5)


def head_major_backward(q, k, v, dout, fwd):
    """The step-layout backward with each group's inputs copied head-major first ([b, h_g, s, d] storage, the tile
    bench's layout), copies included: what a fix would cost if the layout is the gap."""
    out, lse, aux = fwd
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for g, (sq, sk) in enumerate(ea._group_slices(H, HK, GROUPS)):
        dq_g, dk_g, dv_g = ea._EXPLICIT["fa4"][1](dout[:, sq].contiguous(), q[:, sq].contiguous(),
                                                    k[:, sk].contiguous(), v[:, sk].contiguous(),
                                                    out[:, sq].contiguous(), lse[g], aux[g], D ** -0.5)
        dq[:, sq].copy_(dq_g)
        dk[:, sk].copy_(dk_g)
        dv[:, sk].copy_(dv_g)
    return dq, dk, dv


def mha_backward(q, k, v, dout, fwd):
    """The step-layout backward with each group's kv heads repeated to its query heads (MHA: no GQA accumulation of
    dk, dv in the kernel), then dk, dv summed over the repeats in fp32; repeats and sums included."""
    out, lse, aux = fwd
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rep = H // HK
    for g, (sq, sk) in enumerate(ea._group_slices(H, HK, GROUPS)):
        k_g, v_g = (x[:, sk].repeat_interleave(rep, dim=1) for x in (k, v))
        dq_g, dk_g, dv_g = ea._EXPLICIT["fa4"][1](dout[:, sq], q[:, sq], k_g, v_g, out[:, sq], lse[g], aux[g],
                                                    D ** -0.5)
        dq[:, sq].copy_(dq_g)
        b, hg, s_, d = dk_g.shape
        dk[:, sk].copy_(dk_g.float().view(b, hg // rep, rep, s_, d).sum(2))
        dv[:, sk].copy_(dv_g.float().view(b, hg // rep, rep, s_, d).sum(2))
    return dq, dk, dv


def smi_sampler(path: Path):
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu",
                                 "--format=csv,noheader", "-lms", "250"], stdout=path.open("w"),
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sustain-s", type=float, default=20.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "shape": dict(seq=S, heads=H, kv_heads=HK, head_dim=D,
                                                                       groups=GROUPS)}
    rows = []

    def row(name, ms, flops=2.5 * FWD_FLOPS):
        res[name] = round(ms, 2)
        rows.append((name, f"{ms:9.2f} ms  {flops / ms / 1e9:6.1f} TF/s"))
        print(rows[-1], flush=True)

    for seq_major in (False, True):
        lay = "bshd" if seq_major else "bhsd"
        q, k, v, dout = tensors(seq_major)
        one = ea._grouped_forward("fa4", q, k, v, D ** -0.5, GROUPS)
        ea._FORWARD_IN_ONE_CALL = False
        grouped = ea._grouped_forward("fa4", q, k, v, D ** -0.5, GROUPS)
        row(f"fwd {lay} 4 groups", timed(lambda: ea._grouped_forward("fa4", q, k, v, D ** -0.5, GROUPS)), FWD_FLOPS)
        ea._FORWARD_IN_ONE_CALL = True
        row(f"fwd {lay} one call", timed(lambda: ea._grouped_forward("fa4", q, k, v, D ** -0.5, GROUPS)), FWD_FLOPS)
        err = ((one[0].float() - grouped[0].float()).norm() / grouped[0].float().norm()).item()
        res[f"fwd {lay} one call against groups, rel err"] = err
        rows.append((f"fwd {lay} out: one call vs groups", f"rel err {err:.1e}"))
        del grouped
        row(f"bwd {lay} 4 groups", timed(lambda: layer_backward(q, k, v, dout, one)))
        if seq_major:
            row("bwd bshd 4 groups, head-major copies first", timed(lambda: head_major_backward(q, k, v, dout, one)))
            ref, got = layer_backward(q, k, v, dout, one), head_major_backward(q, k, v, dout, one)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
            rows.append(("bwd head-major copies vs step layout", f"rel err {err:.1e}"))
            got = mha_backward(q, k, v, dout, one)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref))
            rows.append(("bwd MHA (kv repeated) vs step layout", f"rel err {err:.1e}"))
            del ref, got
            row("bwd bshd 4 groups, kv repeated to MHA", timed(lambda: mha_backward(q, k, v, dout, one)))
            # the offload's copies beside it: 512 MiB each way, pinned, on a side stream, looping while it runs
            host = torch.empty(2 ** 29, dtype=torch.uint8, pin_memory=True)
            dev_buf = torch.empty(2 ** 29, dtype=torch.uint8, device="cuda")
            side = torch.cuda.Stream()
            torch.cuda.synchronize()

            def with_copies():
                with torch.cuda.stream(side):
                    for _ in range(6):
                        host.copy_(dev_buf, non_blocking=True)
                        dev_buf.copy_(host, non_blocking=True)
                return layer_backward(q, k, v, dout, one)
            row("bwd bshd 4 groups, pinned copies beside", timed(with_copies))
            torch.cuda.synchronize()
            del host, dev_buf
            # sustained: back to back, each layer's backward timed with events
            smi_path = args.out / "fa4_gap_smi.csv"
            smi = smi_sampler(smi_path)
            times, t0 = [], time.time()
            while time.time() - t0 < args.sustain_s:
                evs = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                evs[0].record()
                layer_backward(q, k, v, dout, one)
                evs[1].record()
                times.append(evs)
                if len(times) % 10 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            if smi is not None:
                smi.terminate()
            ms = [a.elapsed_time(b) for a, b in times]
            res["sustained_ms"] = [round(x, 2) for x in ms]
            first, last = sorted(ms[:5])[2], sorted(ms[-20:])[10]
            row("bwd bshd sustained: first 5 (median)", first)
            row(f"bwd bshd sustained: last 20 of {len(ms)} (median)", last)
            if smi_path.exists():
                lines = smi_path.read_text().strip().splitlines()
                res["smi"] = lines
                if lines:
                    rows.append(("nvidia-smi first / last sample", f"{lines[0]} | {lines[-1]}"))
        del q, k, v, dout, one
        torch.cuda.empty_cache()
        (args.out / "fa4_gap.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}; one Qwen3-4B layer at 128k (32 / 8 heads x 128), FA4 through explicit_attention")
    for name, text in rows:
        print(f"  {name:44s} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
