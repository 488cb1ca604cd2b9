"""Sliding-window and sink layers, one process: the band kernel against a dense-mask softmax, and the levers
these families need (soft-capped chunked loss, Gemma / gpt-oss RMSNorm, per-layer-type RoPE, window FLOPs, the
model check). The multi-rank parity against transformers is test_window_parity.py.
Tolerances: fp64 kernels 1e-12 absolute; the fp32 loss head 1e-5 relative (test_chunked_loss's).
"""

import pytest
import torch
from transformers import Gemma3TextConfig, GptOssConfig, KimiLinearConfig, Llama4TextConfig, MistralConfig

from tests._attention_ref import dense_reference
from tests.models import WINDOW_FAMILIES, build, tiny_config
from ulysses_lc import check_model_for_ulysses, install_efficient_rmsnorm
from ulysses_lc.levers.chunked_loss import chunked_cross_entropy
from ulysses_lc.mixers.kernels import document_attention
from ulysses_lc.plan.metrics import model_flops_per_step
from ulysses_lc.shape import ModelShape
from ulysses_lc.mixers.window_attention import window_attention
from ulysses_lc.levers.yarn import apply_yarn


def _inputs(b, h, h_kv, s, d, sinks, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    return make(b, h, s, d), make(b, h_kv, s, d), make(b, h_kv, s, d), (make(h) if sinks else None)


def _grads(out, inputs, seed=1):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    leaves = [x for x in inputs if x is not None]
    return torch.autograd.grad(out, leaves, grad_out)


# (batch, heads, kv heads, tokens, window, sinks): a window that divides the length and one that does not (padded
# chunks), GQA, a batch of two, a window of one token, a window as long as the sequence, and sinks without a window.
CASES = [(1, 4, 2, 37, 5, False), (1, 4, 2, 37, 5, True), (2, 4, 4, 24, 6, True), (1, 2, 1, 9, 1, False),
         (1, 2, 2, 16, 16, True), (1, 2, 1, 16, None, True), (1, 2, 2, 30, 7, True)]


@pytest.mark.parametrize("b,h,h_kv,s,window,sinks", CASES)
def test_band_equals_dense_softmax(b, h, h_kv, s, window, sinks):
    q, k, v, sink = _inputs(b, h, h_kv, s, 8, sinks)
    out = window_attention(q, k, v, 0.3, window, sink, kernel="sdpa")
    ref = dense_reference(q, k, v, 0.3, window, sink)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(_grads(out, (q, k, v, sink)), _grads(ref, (q, k, v, sink))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if window is not None and window < s:  # the comparison can fail: one key more or less changes the output
        for wrong in (window - 1, window + 1):
            if wrong >= 1:
                assert (dense_reference(q, k, v, 0.3, wrong, sink) - out).abs().max() > 1e-3


def test_documents_restart_the_window_and_sinks():
    q, k, v, sink = _inputs(1, 4, 2, 40, 8, True, seed=3)
    bounds = [0, 13, 20, 27, 40]  # documents of 13, 7, 7, 13 tokens: two runs of equal lengths batched
    out = document_attention(q, k, v, bounds, 0.3, "sdpa", window=5, sinks_h=sink)
    ref = dense_reference(q, k, v, 0.3, 5, sink, bounds)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(_grads(out, (q, k, v, sink)), _grads(ref, (q, k, v, sink))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (dense_reference(q, k, v, 0.3, 5, sink) - out).abs().max() > 1e-3  # the borders matter


def test_flash_window_is_cuda_only():
    q, k, v, _ = _inputs(1, 2, 2, 8, 8, False)
    with pytest.raises(ValueError, match="how='band' on CPU"):
        window_attention(q, k, v, 0.3, 4, how="flash_window")


def test_soft_capped_chunked_loss_equals_capped_logits():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (23,), generator=g)
    labels[:4] = -100
    loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels, chunk_rows=5, softcap=3.0)
    logits = torch.tanh(hidden @ weight.T / 3.0) * 3.0
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert int(n_valid) == 19 and abs(loss_sum.item() - ref.item()) <= 1e-5 * ref.item()
    for got, want in zip(torch.autograd.grad(loss_sum, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    uncapped = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    assert abs(uncapped.item() - loss_sum.item()) > 1.0


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_rmsnorm_forms_match_transformers(family):
    model = build(family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for norm in norms:
        torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 7, norms[0].weight.shape[0], dtype=torch.bfloat16, requires_grad=True)
    norm = norms[0].to(torch.bfloat16)
    want = norm(x)
    handle = install_efficient_rmsnorm(model)
    assert all("forward" in n.__dict__ for n in norms)  # every norm of the model, q/k norms included
    got = norm(x)
    assert torch.equal(got, want)  # the forward bit for bit
    handle.undo()


def test_rope_per_layer_type_rescales_the_global_layers_only():
    config = apply_yarn(tiny_config("gemma3"), 1024)  # trained length 256
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert config.rope_parameters["full_attention"]["factor"] == 4.0 and config.max_position_embeddings == 1024
    linear = Gemma3TextConfig(num_hidden_layers=2, rope_scaling={"rope_type": "linear", "factor": 8.0})
    apply_yarn(linear, 262144)  # Gemma 3's linear global scaling stays linear, stretched 2x further
    assert linear.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 16.0, "rope_theta": 1e6}


def test_window_flops_and_layer_windows():
    shapes = {f: ModelShape.from_config(tiny_config(f, sliding_window=64)) for f in WINDOW_FAMILIES}
    assert shapes["mistral"].layer_windows == (64, 64)
    assert shapes["gemma3"].layer_windows == shapes["gpt_oss"].layer_windows == (64, None)
    assert shapes["gpt_oss"].sinks and not shapes["gemma3"].sinks
    s, hd = 4096, 4 * 8  # heads x head_dim
    got = model_flops_per_step(shapes["gemma3"], s).attention
    # forward 4 hd pairs per layer, fwd + bwd 3x: a window costs s w - w^2 / 2 pairs, a full layer s^2 / 2
    assert got == pytest.approx(3 * 4 * hd * ((s * 64 - 64 ** 2 / 2) + s * s / 2))
    assert model_flops_per_step(ModelShape.from_config(tiny_config("qwen3")), s).attention == pytest.approx(
        3 * 2 * s * s * hd * 2)


def test_model_check_accepts_window_families_and_names_what_it_refuses():
    for config in (MistralConfig(num_hidden_layers=2, sliding_window=16), Gemma3TextConfig(num_hidden_layers=2),
                   GptOssConfig(num_hidden_layers=2), tiny_config("qwen3", use_sliding_window=True, sliding_window=16,
                                                                   max_window_layers=0)):
        check_model_for_ulysses(config, sp_size=2)
    # Refused at every sp, sp 1 included: the Ulysses attention is installed there too, and transformers builds no
    # mask for it, so a bidirectional layer was trained as causal at sp 1 (issue 28, item 2). No message offers
    # sp_size=1 as the fix.
    for sp in (1, 2):
        for config, what in ((Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=8192), r"\['chunked_attention'\]"),
                             (KimiLinearConfig(num_hidden_layers=4), r"\['linear_attention'\]"),
                             (Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True),
                              "use_bidirectional_attention=False"),
                             (tiny_config("gemma3", attn_logit_softcapping=50.0), "attn_logit_softcapping")):
            with pytest.raises(ValueError, match=what) as refused:
                check_model_for_ulysses(config, sp_size=sp)
            assert "sp_size=1" not in str(refused.value) and " sp" in str(refused.value)


# ---- flex attention's band (flex_window.py): its block mask, its sink, its pick ----

@pytest.mark.parametrize("seed", range(4))
def test_flex_block_mask_covers_the_band_and_marks_only_whole_blocks_full(seed):
    """Every block holding a visible (query, key) pair is listed; a block listed as full is visible throughout
    (those skip the mask). Random lengths, windows, block sizes and documents."""
    from ulysses_lc.mixers.flex_window import band_blocks

    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        block = int(torch.randint(2, 17, (1,), generator=g))
        s = int(torch.randint(1, 90, (1,), generator=g))
        window = [None, 1, 3, 16, 40, 200][int(torch.randint(0, 6, (1,), generator=g))]
        bounds = None
        if s > 2 and torch.rand(1, generator=g) < 0.5:
            cuts = sorted(set(torch.randint(1, s, (3,), generator=g).tolist()))
            bounds = [0, *cuts, s]
        num, idx, full_num, full_idx = band_blocks(s, window, bounds, block=block)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None]
        allowed = (j <= i) & (i - j < (window or s + 1))
        if bounds is not None:
            doc = torch.bucketize(torch.arange(s), torch.tensor(bounds[1:-1]), right=True)
            allowed &= doc[:, None] == doc[None]
        n = -(-s // block)
        for m in range(n):
            partial, full = set(idx[m, :num[m]].tolist()), set(full_idx[m, :full_num[m]].tolist())
            assert not partial & full
            for c in range(n):
                cell = allowed[m * block:(m + 1) * block, c * block:(c + 1) * block]
                if cell.any():
                    assert c in partial | full, (s, window, bounds, block, m, c)
                if c in full:
                    assert cell.all() and cell.shape[1] == block, (s, window, bounds, block, m, c)


@pytest.mark.parametrize("s,window,bounds,h,h_kv", [(300, 40, None, 4, 2), (300, 7, (0, 100, 101, 250, 300), 4, 4),
                                                    (257, 300, (0, 5, 257), 2, 2)])
def test_flex_band_with_sinks_equals_dense_softmax(s, window, bounds, h, h_kv):
    """The flex path's mask and sink (flex_call uncompiled: flex's forward runs on CPU unfused; its backward is
    CUDA-only, the gradients are test_window_cuda.py's). fp32, 1e-5 absolute."""
    import warnings

    from ulysses_lc.mixers.flex_window import block_mask, flex_call

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, n, s, 16, generator=g) for n in (h, h_kv, h_kv))
    sinks = torch.randn(h, generator=g)
    mask = block_mask(s, window, bounds, q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex warns
        out = flex_call(q, k, v, mask, 0.25, h != h_kv)
        with_sinks = flex_call(q, k, v, mask, 0.25, h != h_kv, sinks)
    torch.testing.assert_close(out, dense_reference(q, k, v, 0.25, window, None, bounds), rtol=0, atol=1e-5)
    torch.testing.assert_close(with_sinks, dense_reference(q, k, v, 0.25, window, sinks, bounds), rtol=0, atol=1e-5)
    assert (with_sinks - out).abs().max() > 1e-2  # the sink matters


def test_flex_is_cuda_only_and_auto_is_the_band_on_cpu():
    from ulysses_lc.mixers.window_attention import resolve_how

    q, k, v, _ = _inputs(1, 2, 2, 8, 8, False)
    with pytest.raises(ValueError, match="how='band' on CPU"):
        window_attention(q, k, v, 0.3, 4, how="flex")
    assert resolve_how("auto", torch.device("cpu"), 128) == "band"


def test_flex_compiles_statically_under_a_raised_recompile_limit(monkeypatch):
    """One static compile per length (a dynamic one measured 0.14 against 0.19 on an H200): past dynamo's default
    of 8 compiles torch would run flex eagerly, materialising s x s, so the call raises the limit around itself."""
    import torch._dynamo

    from ulysses_lc.mixers import flex_window

    seen = []

    def fake_compiled(*args):
        seen.append(torch._dynamo.config.recompile_limit)
        return args[0]

    monkeypatch.setattr(flex_window, "_compiled", lambda: fake_compiled)
    q, k, v, _ = _inputs(1, 2, 2, 256, 8, False)
    before = torch._dynamo.config.recompile_limit
    flex_window.flex_window_attention(q, k, v, 0.3, 64)
    assert seen == [max(flex_window.RECOMPILE_LIMIT, before)] and seen[0] > 8
    assert torch._dynamo.config.recompile_limit == before  # restored after the call
    assert flex_window.flex_available(torch.device("cpu")) is False


def test_step_estimate_prices_window_layers_at_the_window_kernels_rate():
    """A window layer costs its FLOPs at the causal rate over the rate measured for the kernel auto picks on a GPU."""
    from ulysses_lc.plan.memory import MemoryPlan
    from ulysses_lc.plan.sizing import ATTENTION_FLOPS_PER_S, ATTENTION_PASSES, Job
    from ulysses_lc.shape import window_pairs
    from ulysses_lc.mixers.window_attention import rate_vs_causal, resolve_how

    shape = ModelShape.from_config(tiny_config("mistral", sliding_window=1024))
    plan, seq = MemoryPlan(0, 0, 0), 65536
    windowed = Job(shape, 1_000_000, 1, 1)
    unwindowed = Job(ModelShape.from_config(tiny_config("mistral", sliding_window=None)), 1_000_000, 1, 1)
    per_pair = ATTENTION_PASSES * 4.0 * shape.heads * shape.head_dim * shape.layers / ATTENTION_FLOPS_PER_S
    extra = windowed.step_seconds(seq, plan) - (unwindowed.step_seconds(seq, plan) - per_pair * window_pairs(seq, None))
    how = resolve_how("auto", torch.device("cuda"), 1024)
    assert how == "flex"  # priced for the GPU it would run on, also from this CPU machine (flex_available)
    assert abs(extra - per_pair * window_pairs(seq, 1024) / rate_vs_causal(how, 1024)) <= 1e-6 * extra
    assert rate_vs_causal("band", 128) < rate_vs_causal("band", 1024) < rate_vs_causal("band", 4096)
    assert rate_vs_causal("flash_window", 1 << 20) == rate_vs_causal("flash_window", 4096)


def test_start_up_block_names_each_layer_kind_and_its_window_kernel():
    from ulysses_lc.train.console import layers_line

    config = tiny_config("gpt_oss")
    gpu, cpu = layers_line(config, "cudnn", "torch", on_gpu=True), layers_line(config, "cudnn", "torch", on_gpu=False)
    window = ModelShape.from_config(config).layer_windows[0]
    assert f"sliding window {window} with sinks (flex attention" in gpu and "full attention with sinks (the band" in gpu
    assert "(the band over the CPU flash kernel)" in cpu
    mistral = layers_line(tiny_config("mistral", sliding_window=4096, max_position_embeddings=8192), "cudnn", "x")
    assert "sliding window 4096 (flex attention (torch.compile))" in mistral


def test_auto_takes_the_highest_measured_rate_and_flex_only_where_it_can_run(monkeypatch):
    """resolve_how on a GPU: the implementation of highest WINDOW_RATES at the window; flex only where it runs and
    the layer keeps no output. Today's table: flex at every window; without it flash_window at 128 and 1024, the
    band at 4096."""
    from ulysses_lc.mixers import window_attention as wa

    cuda = torch.device("cuda")
    monkeypatch.setattr(wa, "flex_available", lambda device: True)
    assert [wa.resolve_how("auto", cuda, w) for w in (128, 1024, 4096)] == ["flex"] * 3
    assert [wa.resolve_how("auto", cuda, w, kept=True) for w in (128, 1024, 4096)] == ["flash_window"] * 2 + ["band"]
    assert wa.resolve_how("flex", cuda, 4096, kept=True) == "band"
    assert wa.describe_how(1024, True).startswith("flex attention")
    monkeypatch.setitem(wa.WINDOW_RATES, "flex", ((128, 0.10), (1024, 0.50), (4096, 0.60)))  # below the others
    assert [wa.resolve_how("auto", cuda, w) for w in (128, 1024, 4096)] == ["flash_window", "flex", "band"]
    monkeypatch.setattr(wa, "flex_available", lambda device: False)
    assert [wa.resolve_how("auto", cuda, w) for w in (128, 1024, 4096)] == ["flash_window", "flash_window", "band"]
