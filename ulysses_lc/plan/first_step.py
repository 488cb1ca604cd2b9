"""What a run's first step costs beyond a steady one where its kernels are not in the kernel cache yet
(train/kernel_cache.py): fla's autotuning of the gated DeltaNet kernels, torch.compile's build of flex attention
for the window layers, FlashAttention-4's JIT compile of its kernels (kernel 'fa4', which then runs the window
layers too: no flex).

  kernel_kinds(shape, deltanet_path, seq_len, kernel)   which of the three a model's step runs on a GPU
  first_step_extra_seconds(kinds)                      their one-time cost, from the measured constants below

fla autotunes once per kernel and autotune key (its keys are heads, head dims and the chunk size, never the length:
`T` is do_not_specialize), and every gated DeltaNet layer of a model has the same shape, so the cost is one per run,
not per layer or length. flex compiles once per sequence length (flex_window.py: dynamic=False) and per window,
forward and backward.
"""

from __future__ import annotations

from .deltanet_time import deltanet_path as _deltanet_path

# fla's autotuning on a fresh machine: the Qwen3.5-0.8B shape (18 gated DeltaNet layers of 24) at 262,144 tokens on
# one H200, fla-core 0.6.0 over Triton 3.7.1: its first step took 204.9 s (issue 43) against 21.85 s a steady step
# (benchmarks/results/2026-12-02/hybrid_qwen3.5-0.8b-24layers_fla_steps.json, BENCHMARKS.md "32k, 256k and
# 1,007,616 tokens on fla"): 183 s. First 8k steps on fresh machines took 153 to 188 s (the same section's 8k
# warm-ups, hybrid_qwen3.5-0.8b-24layers_fla_first_autotune.json), so the cost hardly depends on the length.
FLA_AUTOTUNE_S = 204.9 - 21.85
# flex attention's compile for one length: the gpt-oss-20b shape (4 of its 24 layers, windows of 128 with sinks) at
# 262,144 tokens on one H200: 21.29 s with the compile inside the timed step (2026-12-02) against 16.38 s compiled
# before it (benchmarks/results/2026-12-03/gpt_oss/gpt_oss_steps.log; BENCHMARKS.md "the gpt-oss step back under
# its earlier time"): 4.9 s.
FLEX_COMPILE_S = 21.29 - 16.38
# FlashAttention-4's JIT compile (CuTe DSL) of its forward and backward: a fresh process's first fwd+bwd of full causal
# attention on Qwen3-0.6B's heads (8,192 tokens, 3 ms once compiled) took 10.24 s on one H200; a second process on the
# kernel cache the first left took 3.97 s (2026-12-04, `fa4.sh $OUT smoke,cache`, benchmarks/results/2026-12-04/
# fa4_cache.log: flash-attn-4 stored 8 more files then, so part of its compile is keyed per process). A window or sink
# variant compiles its own, 2-4 s more each (bench_fa4.py's first calls; not counted). Its key holds no length.
FA4_COMPILE_S = 10.24
FIRST_STEP_S = {"fla": FLA_AUTOTUNE_S, "flex": FLEX_COMPILE_S, "fa4": FA4_COMPILE_S}
WHAT = {"fla": "fla's autotuning of its gated DeltaNet kernels", "flex": "flex attention's compile for this length",
        "fa4": "FlashAttention-4's compile of its kernels"}


def kernel_kinds(shape, deltanet: str = "auto", seq_len: int | None = None, kernel: str = "auto") -> tuple[str, ...]:
    """Which kernels of a step of `shape` (a shape.ModelShape) tune or compile on first use on a GPU: "fla" where its
    gated DeltaNet layers take fla (`deltanet`: a path, or "auto" for deltanet_time's rule); "fa4" where the attention
    layers run FlashAttention-4 (`kernel` as kernels.resolve_kernel resolves it for the model's heads: 'auto' takes it
    on a Hopper GPU where flash-attn-4 is installed, as the step time prices it), which runs the window layers too;
    else "flex" where a window layer takes flex attention (window_attention's pick on a GPU; a window as long as
    `seq_len` is a causal call)."""
    from ..mixers.kernels import resolve_kernel

    kinds = []
    linear = shape.linear_layers or (False,) * shape.layers
    if any(linear) and (deltanet if deltanet in ("fla", "torch") else _deltanet_path(deltanet)[0]) == "fla":
        kinds.append("fla")
    if not all(linear) and resolve_kernel(kernel, shape.head_dim, shape.attention_dropout) == "fa4":
        kinds.append("fa4")
    elif _flex_windows(shape, seq_len):
        kinds.append("flex")
    return tuple(kinds)


def _flex_windows(shape, seq_len: int | None) -> bool:
    import torch

    from ..mixers.window_attention import resolve_how

    linear = shape.linear_layers or (False,) * shape.layers
    return any(w is not None and not lin and (seq_len is None or w < seq_len)
               and resolve_how("auto", torch.device("cuda"), w) == "flex"
               for w, lin in zip(shape.layer_windows or (), linear))


def first_step_extra_seconds(kinds) -> float:
    """Seconds the first step adds to a steady one for the kernels `kinds` that are not cached."""
    return sum(FIRST_STEP_S[kind] for kind in kinds)


__all__ = ["FA4_COMPILE_S", "FIRST_STEP_S", "FLA_AUTOTUNE_S", "FLEX_COMPILE_S", "first_step_extra_seconds",
           "kernel_kinds"]
