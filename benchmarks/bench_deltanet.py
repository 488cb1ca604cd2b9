"""The gated DeltaNet layer between its exchanges (linear_attention.GatedDeltaNetMixer.mix: the causal conv over this
rank's channels, the gates, the gated delta rule) on one GPU, against fla-core's two kernels alone on the same
tensors, and the torch path it falls back to; exactness of fla against the torch path first.

    python benchmarks/bench_deltanet.py --out $OUT                # H200: about 2 minutes
    python benchmarks/bench_deltanet.py --smoke --out /tmp/d      # CPU, tiny sizes: the torch path end to end

Shape: transformers' Qwen3_5TextConfig defaults for the linear layer (16 key heads, 32 value heads, head dims 128,
conv width 4), all heads on one GPU (sp 1: the sp-N rank runs 1/N of them over the same sequence). Timings are fwd
(and fwd+bwd where fla's backward runs; fla-core 0.6 refuses it on Hopper with Triton >= 3.4, < 3.7.1, issue #640),
CUDA events, median of --iters after one warm-up. "fla_alone" is fla's causal_conv1d + chunk_gated_delta_rule on
inputs prepared outside the timing; "ours_fla" / "ours_torch" is the mixer's whole `mix` on the exchanged q, k, v,
a, b. Exactness: the largest relative error norm of fla's output (and gradients where its backward runs) against
the torch path, bf16 inputs, two packed documents. Prints JSON rows as it goes, a table last, writes
<out>/deltanet_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = []
OUT_FILE = None
START = time.perf_counter()


def emit(row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if OUT_FILE is not None:  # after each row: a run cut short keeps what it measured
        OUT_FILE.write_text(json.dumps(ROWS, indent=1))


FIRST_CALL = {}


def _time(fn, iters, device):
    t0 = time.perf_counter()
    fn()  # the first call compiles and autotunes fla's kernels: recorded apart (FIRST_CALL), not timed
    if device.type == "cuda":
        torch.cuda.synchronize()
    FIRST_CALL["s"] = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def build_layer(device, dtype, smoke):
    from transformers import Qwen3_5TextConfig

    kw = dict(num_hidden_layers=1, layer_types=["linear_attention"])
    if smoke:
        kw.update(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16)
    config = Qwen3_5TextConfig(**kw)
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    with torch.device(device):
        layer = Qwen3_5GatedDeltaNet(config, 0).to(dtype)
    with torch.no_grad():  # decay rates of 0.1 - 1 (the U(0.01, 16) init forgets within a token on some heads)
        layer.A_log.copy_(torch.linspace(0.1, 1.0, layer.num_v_heads, device=device).log())
    return layer


def inputs(layer, T, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()

    return [r(1, T, hk, dk), r(1, T, hk, dk), r(1, T, hv, dv), r(1, T, hv), r(1, T, hv)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def fwd_bwd(mixer, layer, xs, bounds=None, backward=True):
    mixer.attach(layer)  # mix runs the layer's conv1d as this mixer's conv (its channels, its kernel)
    try:
        out = mixer.mix(layer, *xs, bounds)
        if backward:
            out.float().square().mean().backward()
    finally:
        mixer.detach(layer)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench_deltanet")
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--check-tokens", type=int, default=4096, help="the exactness check's length; 0: no check")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=330,
                    help="start no timed variant this many seconds after the timings begin (after the exactness "
                         "check, whose first fla calls autotune: 2-3 minutes on a fresh machine)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    global OUT_FILE
    OUT_FILE = out_dir / "deltanet_results.json"
    if args.smoke:
        args.tokens, args.check_tokens, args.iters = 512, 256, 1

    import torch.distributed as dist

    from ulysses_lc import ParallelLayout
    from ulysses_lc.mixers.linear_attention import GatedDeltaNetMixer, _fla_ops, resolve_deltanet_kernel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    layout = ParallelLayout.build(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    import transformers
    env = dict(kind="env", torch=torch.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    try:
        import triton
        import fla

        env.update(triton=triton.__version__, fla=getattr(fla, "__version__", "?"))
    except ImportError as e:
        env.update(import_error=str(e))
    try:
        kernel, why = resolve_deltanet_kernel("auto", device)
    except Exception as e:  # noqa: BLE001 - a probe failure other than fla's named refusal: recorded, torch timed
        kernel, why = "torch", f"probe failed: {type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    env.update(auto_kernel=kernel, why=why)
    emit(env)
    layer = build_layer(device, dtype, args.smoke)
    torch_mixer = GatedDeltaNetMixer(layer, layout, "torch")
    has_fla = device.type == "cuda" and _fla_ops() is not None and not why.startswith("probe failed")
    fla_mixer = GatedDeltaNetMixer(layer, layout, "fla") if has_fla else None
    fla_backward = kernel == "fla"

    # ---- exactness at a short length, two packed documents ----
    T = args.check_tokens
    bounds = (0, T // 3, T)
    if fla_mixer is not None and T:
        xs_t, xs_f = inputs(layer, T, device, dtype), inputs(layer, T, device, dtype)
        out_t = fwd_bwd(torch_mixer, layer, xs_t, bounds)
        layer.zero_grad()
        grads_t = [x.grad.clone() for x in xs_t]
        row = dict(kind="exact", tokens=T, documents=2)
        try:
            out_f = fwd_bwd(fla_mixer, layer, xs_f, bounds, backward=fla_backward)
            row["out_rel_err"] = _rel(out_f, out_t)
            if fla_backward:
                row["grad_rel_err"] = max(_rel(x.grad, g) for x, g in zip(xs_f, grads_t))
            else:
                row["grad"] = f"not run: {why}"
        except Exception as e:  # noqa: BLE001 - the record says what failed
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:400])
        emit(row)

    # ---- timings at the long length ----
    global START
    START = time.perf_counter()  # --budget-s counts from here: fla's first calls above autotune for minutes
    T = args.tokens
    variants = []
    if fla_mixer is not None:
        causal_conv1d, rule = _fla_ops()
        xs = inputs(layer, T, device, dtype)
        with torch.no_grad():
            ch = torch_mixer.channels.to(device)
            w = layer.conv1d.weight.squeeze(1).index_select(0, ch).detach()
            x_bsc = torch.cat([xs[0].flatten(2), xs[1].flatten(2), xs[2].flatten(2)], -1).detach()
            beta = xs[3].sigmoid().detach()
            gate = (-layer.A_log.float().exp() * torch.nn.functional.softplus(xs[4].float() + layer.dt_bias)).detach()
        hk, dk = layer.num_k_heads, layer.head_k_dim

        def fla_alone(backward):
            xc = x_bsc.clone().requires_grad_(backward)
            y, _ = causal_conv1d(xc, w, None, activation="silu")
            q, k, v = y.split([hk * dk, hk * dk, y.shape[-1] - 2 * hk * dk], -1)
            o, _ = rule(q.unflatten(-1, (hk, dk)).contiguous(), k.unflatten(-1, (hk, dk)).contiguous(),
                        v.unflatten(-1, (-1, layer.head_v_dim)).contiguous(), gate, beta,
                        use_qk_l2norm_in_kernel=True)
            if backward:
                o.float().square().mean().backward()

        variants.append(("fla_alone", "fwd", lambda: fla_alone(False)))
        variants.append(("ours_fla", "fwd", lambda: _no_grad(fla_mixer, layer, xs)))
        if fla_backward:
            variants.append(("fla_alone", "fwd+bwd", lambda: fla_alone(True)))
            variants.append(("ours_fla", "fwd+bwd", lambda: fwd_bwd(fla_mixer, layer, xs)))
    xs_torch = inputs(layer, T, device, dtype)
    variants.append(("ours_torch", "fwd", lambda: _no_grad(torch_mixer, layer, xs_torch)))
    variants.append(("ours_torch", "fwd+bwd", lambda: fwd_bwd(torch_mixer, layer, xs_torch)))
    for name, what, fn in variants:
        row = dict(kind="time", variant=name, what=what, tokens=T)
        if time.perf_counter() - START > args.budget_s:
            emit(dict(row, status="skipped: out of --budget-s"))
            continue
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row["s"] = _time(fn, 1 if name == "ours_torch" else args.iters, device)
            row["first_call_s"] = FIRST_CALL["s"]
            if device.type == "cuda":
                row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:400])
            traceback.print_exc()
        layer.zero_grad(set_to_none=True)
        emit(row)

    times = {(r["variant"], r["what"]): r.get("s") for r in ROWS if r["kind"] == "time"}
    print("\nvariant     what      tokens   s        vs fla_alone")
    for (name, what), s in times.items():
        base = times.get(("fla_alone", what))
        ratio = f"{s / base:.2f}x" if s and base else "-"
        print(f"{name:11s} {what:9s} {T:7d}  {s if s is None else round(s, 4)!s:8s} {ratio}")
    dist.destroy_process_group()


def _no_grad(mixer, layer, xs):
    with torch.no_grad():
        return fwd_bwd(mixer, layer, xs, backward=False)


if __name__ == "__main__":
    main()
