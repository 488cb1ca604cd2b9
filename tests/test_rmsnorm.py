"""Memory-efficient RMSNorm against transformers' own: same output bit for bit, same gradients."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tests.models import VOCAB, build
from ulysses_lc.levers.rmsnorm import RMSNormFunction, install_efficient_rmsnorm


# The norm runs in fp32 whatever the input dtype (as in transformers), so fp64 is held to fp32 rounding.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_function_matches_transformers(dtype, tol):
    torch.manual_seed(0)
    norm = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 17, 48, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 17, 48, dtype=dtype)
    ref = norm(x)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, norm.weight), g)
    out = RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    assert torch.equal(out, ref)  # the forward is the same computation
    for got, want in ((gx, ref_gx), (gw, ref_gw)):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err <= tol, err


def test_whole_model_loss_and_grads():
    # Every norm of a Qwen3 (layer norms and the per-head q/k norms) switched, against the plain model.
    ids = torch.randint(0, VOCAB, (2, 33))
    plain = build("qwen3")
    plain(input_ids=ids, labels=ids).loss.backward()
    model = build("qwen3")
    undo = install_efficient_rmsnorm(model).undo
    patched = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(patched) == 2 * 4 + 1  # four per layer, plus the final norm
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss, plain(input_ids=ids, labels=ids).loss)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert err <= 1e-5, (name, err)
    undo()
    assert not [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_row_chunks_compute_the_same_numbers(dtype, transposed):
    # 51 rows in chunks of 5 (a ragged last one) against one chunk: output and input gradient bitwise equal
    # (rows are independent); the weight gradient is a sum over rows split into chunk sums, so it is held to
    # fp32 rounding of that sum (1e-6 relative norm), then cast to the weight's dtype (bf16: at most one
    # rounding step per element, 2^-8 relative).
    torch.manual_seed(1)
    weight = torch.empty(48, dtype=dtype).uniform_(0.5, 1.5).requires_grad_()
    x = torch.randn(3, 48, 17, dtype=dtype).transpose(1, 2) if transposed else torch.randn(3, 17, 48, dtype=dtype)
    x.requires_grad_()
    g = torch.randn(3, 17, 48, dtype=dtype)
    whole = RMSNormFunction.apply(x, weight, 1e-6, 10**9)
    gx_whole, gw_whole = torch.autograd.grad(whole, (x, weight), g)
    chunked = RMSNormFunction.apply(x, weight, 1e-6, 5)
    gx, gw = torch.autograd.grad(chunked, (x, weight), g)
    assert torch.equal(chunked, whole)
    assert torch.equal(gx, gx_whole)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert ((gw.double() - gw_whole.double()).norm() / gw_whole.double().norm()).item() <= tol


def test_default_chunk_is_a_quarter_gib_of_fp32():
    from ulysses_lc.levers.rmsnorm import _rows_per_chunk

    assert _rows_per_chunk(128) == 2**19  # the q/k norms: 512k rows of one head
    assert _rows_per_chunk(1024) == 2**16
    assert _rows_per_chunk(2**30) == 1


def test_temporaries_exist_one_chunk_at_a_time():
    # The point of the chunks: no fp32 tensor larger than one chunk is made in forward or backward (bf16 in and
    # out, so every fp32 tensor is a temporary, rstd and the weight gradient aside). Whole, they are 51 x 48.
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestFp32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    LargestFp32.largest = max(LargestFp32.largest, t.numel())
            return out

    weight = torch.ones(48, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(3, 17, 48, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 17, 48, dtype=torch.bfloat16)
    with LargestFp32():
        y = RMSNormFunction.apply(x, weight, 1e-6, 5)
        torch.autograd.grad(y, (x, weight), g)
    assert LargestFp32.largest == 5 * 48


def _norm_classes():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    return {"llama": (Qwen3RMSNorm, {"eps": 1e-6}), "gemma": (Gemma3RMSNorm, {"eps": 1e-6}),
            "cast_after": (GptOssRMSNorm, {"eps": 1e-5})}


# Each form's backward against autograd through the class's own forward (issue 28, item 5): fp32 at 1e-5 relative,
# bf16 at 1e-2 (its inputs' rounding).
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("form", ["llama", "gemma", "cast_after"])
def test_each_form_backward_matches_its_class(form, dtype, tol):
    cls, kwargs = _norm_classes()[form]
    torch.manual_seed(0)
    norm = cls(40, **kwargs).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = torch.randn(5, 40, dtype=dtype, requires_grad=True)
    g = torch.randn(5, 40, dtype=dtype)
    ref = norm(x)
    want = torch.autograd.grad(ref, (x, norm.weight), g)
    install_efficient_rmsnorm(norm)
    assert "forward" in norm.__dict__
    out = norm(x)
    got = torch.autograd.grad(out, (x, norm.weight), g)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    for a, b in zip(got, want):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= tol, (form, dtype, err)


def test_a_changed_upstream_formula_is_caught_and_left_alone(monkeypatch, caplog):
    """The forms are hard-coded per class name: a transformers release that changed Qwen3RMSNorm's formula would have
    changed the numbers silently. Now each class is compared at install and keeps its own forward on a mismatch."""
    original = Qwen3RMSNorm.forward

    def changed(self, hidden_states):  # e.g. Gemma's (1 + weight) form adopted upstream
        return original(self, hidden_states) + hidden_states * torch.rsqrt(
            hidden_states.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon).to(hidden_states.dtype)

    model = build("qwen3")
    monkeypatch.setattr(Qwen3RMSNorm, "forward", changed)
    with caplog.at_level("WARNING", logger="ulysses_lc.levers.rmsnorm"):
        handle = install_efficient_rmsnorm(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    assert handle.mismatched == ["Qwen3RMSNorm"] and "no longer computes the form" in caplog.text
    monkeypatch.setattr(Qwen3RMSNorm, "forward", original)
    assert install_efficient_rmsnorm(model).mismatched == []
    assert [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gated_norm_matches_transformers(dtype, tol):
    # The gated DeltaNet's output norm (Qwen3.5's RMSNormGated): whole, and in row chunks of 7 (a ragged last one,
    # whose SiLU and row means vectorize otherwise: 6e-8 apart in fp32).
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    from ulysses_lc.levers.rmsnorm import GatedRMSNormFunction

    torch.manual_seed(0)
    norm = Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, gate = (torch.randn(3, 17, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    g = torch.randn(3, 17, 16, dtype=dtype)
    ref = norm(x, gate)
    want = torch.autograd.grad(ref, (x, gate, norm.weight), g)
    for chunk in (None, 7):
        out = GatedRMSNormFunction.apply(x, gate, norm.weight, norm.variance_epsilon, chunk)
        got = torch.autograd.grad(out, (x, gate, norm.weight), g)
        if chunk is None:
            assert torch.equal(out, ref)  # the forward is the same computation
        for a, b in zip((out, *got), (ref, *want)):
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= tol


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_norms_switched_loss_and_grads(family):
    # Each family's "1 + weight" norms and the gated DeltaNet's gated norm, against the plain model.
    ids = torch.randint(0, VOCAB, (1, 33))
    plain = build(family)
    plain(input_ids=ids, labels=ids).loss.backward()
    model = build(family)
    undo = install_efficient_rmsnorm(model).undo
    patched = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(patched) == 2 * 2 + 2 + 1 + 1  # two per layer, q/k norms, the gated norm, the final norm
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - plain(input_ids=ids, labels=ids).loss.item()) <= 1e-6
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= 1e-5, name
    undo()


def _reference_fused(x_tw, weight_w, eps):
    """What torch's fused CUDA kernel computes, in plain ops: the weight applied in fp32, one rounding."""
    rstd = torch.rsqrt(x_tw.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x_tw.float() * rstd * weight_w.float()).to(x_tw.dtype), rstd


def test_the_fused_path_saves_input_and_rstd_and_passes_its_gradients_through(monkeypatch):
    # The CUDA branch's glue, run on CPU with the kernels replaced by the formula they compute: the Function hands
    # the fused forward a contiguous [t, w] view of any input, saves only (x, weight, rstd), and returns the fused
    # backward's gradients in the input's shape, each only where asked for.
    from ulysses_lc.levers import rmsnorm

    calls = []

    def backward(grad_y_tw, x_tw, rstd, weight_w, need_x, need_weight):
        calls.append((need_x, need_weight, grad_y_tw.is_contiguous(), x_tw.is_contiguous(), tuple(rstd.shape)))
        x_r, w_r = x_tw.detach().requires_grad_(), weight_w.detach().requires_grad_()
        with torch.enable_grad():  # a backward runs without grad mode
            gx, gw = torch.autograd.grad(_reference_fused(x_r, w_r, 1e-6)[0], (x_r, w_r), grad_y_tw)
        return (gx if need_x else None), (gw if need_weight else None)

    monkeypatch.setattr(rmsnorm, "_takes_fused", lambda x, w, gemma: not gemma)
    monkeypatch.setattr(rmsnorm, "_fused_forward", _reference_fused)
    monkeypatch.setattr(rmsnorm, "_fused_backward", backward)
    torch.manual_seed(2)
    weight = torch.empty(24, dtype=torch.bfloat16).uniform_(0.5, 1.5).requires_grad_()
    x = torch.randn(2, 24, 9, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()  # not contiguous
    g = torch.randn(2, 9, 24, dtype=torch.bfloat16)
    out = RMSNormFunction.apply(x, weight, 1e-6)
    assert out.shape == x.shape
    assert torch.equal(out.reshape(-1, 24), _reference_fused(x.reshape(-1, 24), weight, 1e-6)[0])
    saved = out.grad_fn.saved_tensors
    assert [t.shape for t in saved] == [x.shape, weight.shape, (18, 1)] and saved[2].dtype == torch.float32
    gx, gw = torch.autograd.grad(out, (x, weight), g)
    x_r, w_r = x.detach().requires_grad_(), weight.detach().requires_grad_()
    want = torch.autograd.grad(_reference_fused(x_r.reshape(-1, 24), w_r, 1e-6)[0].view(x.shape), (x_r, w_r), g)
    assert gx.shape == x.shape and torch.equal(gx, want[0]) and torch.equal(gw, want[1])
    assert calls == [(True, True, True, True, (18, 1))]
    # Only the weight's gradient asked for (a frozen input), then only the input's (a frozen weight).
    RMSNormFunction.apply(x.detach(), weight, 1e-6).backward(g)
    RMSNormFunction.apply(x, weight.detach(), 1e-6).backward(g)
    assert [c[:2] for c in calls[1:]] == [(False, True), (True, False)]
    # Gemma's (1 + weight) form keeps the chunks: the fused kernels are not called.
    RMSNormFunction.apply(x, weight, 1e-6, None, True).backward(g)
    assert len(calls) == 3
    # Past FUSED_MAX_ELEMENTS the rows go in calls of FUSED_PART_ELEMENTS (5 of at most 4 rows here): the same output
    # and input gradient (rows are independent), the weight gradient's partial sums added in fp32 (bf16: 2^-8).
    monkeypatch.setattr(rmsnorm, "FUSED_MAX_ELEMENTS", 400)
    monkeypatch.setattr(rmsnorm, "FUSED_PART_ELEMENTS", 100)
    out5 = RMSNormFunction.apply(x, weight, 1e-6)
    gx5, gw5 = torch.autograd.grad(out5, (x, weight), g)
    assert len(calls) == 3 + 5 and torch.equal(out5, out) and torch.equal(gx5, gx)
    assert ((gw5.double() - gw.double()).norm() / gw.double().norm()).item() <= 2**-8


def test_the_fused_kernels_are_taken_only_on_cuda_for_the_forms_they_compute(monkeypatch):
    from types import SimpleNamespace

    from ulysses_lc.levers import rmsnorm

    bf16 = torch.bfloat16
    cuda_x, w = SimpleNamespace(is_cuda=True, dtype=bf16), SimpleNamespace(dtype=bf16)
    assert not rmsnorm._takes_fused(torch.ones(2, dtype=bf16), torch.ones(2, dtype=bf16), False)  # CPU: the chunks
    monkeypatch.setattr(rmsnorm, "_fused_kernels_exist", lambda: True)
    assert rmsnorm._takes_fused(cuda_x, w, False)
    assert not rmsnorm._takes_fused(cuda_x, w, True)  # Gemma's (1 + weight)
    assert not rmsnorm._takes_fused(cuda_x, SimpleNamespace(dtype=torch.float32), False)  # mixed dtypes
    monkeypatch.setattr(rmsnorm, "FUSED_CUDA", False)
    assert not rmsnorm._takes_fused(cuda_x, w, False)
    monkeypatch.setattr(rmsnorm, "FUSED_CUDA", True)
    monkeypatch.setattr(rmsnorm, "_fused_kernels_exist", lambda: False)  # a torch without them
    assert not rmsnorm._takes_fused(cuda_x, w, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused RMSNorm kernels run on CUDA")
@pytest.mark.parametrize("form", ["llama", "cast_after"])
def test_the_fused_cuda_kernels_match_the_class_and_the_chunks(form, monkeypatch):
    # On a GPU: the fused path (the default there) against the class's own forward and autograd, and against the
    # chunks (FUSED_CUDA off). bf16 at 1e-2 relative (one rounding of the input's dtype apart in the forward).
    # torch's kernels, not the rows kernels that take their place by default (TRITON_ROWS, tested below).
    from ulysses_lc.levers import rmsnorm, rmsnorm_rows

    monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", False)
    assert rmsnorm._fused_kernels_exist(), "this torch has no fused RMSNorm CUDA kernels"
    cls, kwargs = _norm_classes()[form]
    torch.manual_seed(0)
    norm = cls(128, **kwargs).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    ref = norm(x)
    want = torch.autograd.grad(ref, (x, norm.weight), g)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(rmsnorm, "FUSED_CUDA", fused)
        out = rmsnorm._RMSNORM_FORMS[cls.__name__](norm, x)
        assert out.grad_fn.saved_tensors[2].numel() == 4096  # rstd per row, either way
        results[fused] = (out, *torch.autograd.grad(out, (x, norm.weight), g))
    for got in results.values():
        for a, b in zip(got, (ref, *want)):
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-2
    assert torch.equal(results[False][0], ref)  # the chunks: bit for bit
    # In parts (as past 2^30 elements): the same output and input gradient as one call.
    monkeypatch.setattr(rmsnorm, "FUSED_CUDA", True)
    monkeypatch.setattr(rmsnorm, "FUSED_MAX_ELEMENTS", 128 * 1000)
    monkeypatch.setattr(rmsnorm, "FUSED_PART_ELEMENTS", 128 * 1000)
    out = rmsnorm._RMSNORM_FORMS[cls.__name__](norm, x)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    assert torch.equal(out, results[True][0]) and torch.equal(gx, results[True][1])
    assert ((gw.double() - results[True][2].double()).norm() / results[True][2].double().norm()).item() <= 2**-8


# ---- rmsnorm_rows.py: a block of rows a program (TRITON_ROWS) ----
# Triton's interpreter on CPU against torch's fused formula (_reference_fused) in float64: fp32 at 1e-6 relative, bf16
# within one rounding of its dtype (2^-8; the interpreter narrows fp32 to bf16 toward zero where torch rounds to
# nearest); the gradients against autograd through that formula, fp32 at 1e-5 and bf16 at 1e-2 relative, as above.


def _formula64(x_tw, weight_w, eps):
    """torch's fused formula in float64: (y, rstd)."""
    rstd = torch.rsqrt(x_tw.double().pow(2).mean(-1, keepdim=True) + eps)
    return x_tw.double() * rstd * weight_w.double(), rstd


@pytest.mark.parametrize("width,rows", [(128, 70), (300, 9), (16, 1000)])  # 32 rows a program; a padded width; 256
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_rows_kernels_compute_torchs_fused_formula(monkeypatch, width, rows, dtype, tol):
    pytest.importorskip("triton", reason="the rows kernels are Triton's (installed with the test extra)")
    from ulysses_lc.levers import rmsnorm_rows

    monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", True)
    monkeypatch.setattr(rmsnorm_rows, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(rmsnorm_rows, "_BWD_PROGRAMS", 3)  # several row blocks a program, three partial sums
    eps = 0.5  # large enough beside mean(x^2) = 9 that a kernel without it fails
    generator = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(rows, width, generator=generator)).to(dtype)
    weight = torch.empty(width, dtype=dtype).uniform_(-0.5, 1.5, generator=generator)
    g = torch.randn(rows, width, generator=generator).to(dtype)
    y, rstd = rmsnorm_rows.forward(x, weight, eps)
    want_y, want_rstd = _formula64(x, weight, eps)
    assert rstd.shape == (rows, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-6, atol=0)
    rel = ((y.double() - want_y).abs() / want_y.abs().clamp_min(1e-30)).max().item()
    assert rel <= (1e-6 if dtype == torch.float32 else 2**-7), rel
    x_r, w_r = x.double().requires_grad_(), weight.double().requires_grad_()
    want = torch.autograd.grad(_formula64(x_r, w_r, eps)[0], (x_r, w_r), g.double())
    got = rmsnorm_rows.backward(g, x, rstd, weight, True, True)
    for a, b in zip(got, want):
        assert a.dtype == dtype and ((a.double() - b).norm() / b.norm()).item() <= tol
    only_weight, only_x = rmsnorm_rows.backward(g, x, rstd, weight, False, True), \
        rmsnorm_rows.backward(g, x, rstd, weight, True, False)
    assert only_weight[0] is None and torch.equal(only_weight[1], got[1])
    assert only_x[1] is None and torch.equal(only_x[0], got[0])


def test_the_function_takes_the_rows_kernels_where_torchs_fused_ones_would_be(monkeypatch):
    # TRITON_ROWS on (the interpreter here): RMSNormFunction saves (x, weight, rstd) and returns the kernels' gradients
    # in the input's shape for any layout; Gemma's (1 + weight), a weight of another dtype and rows wider than
    # MAX_WIDTH keep their paths. On by default (CUDA), never on a CPU without the tests' interpreter switch.
    pytest.importorskip("triton", reason="the rows kernels are Triton's (installed with the test extra)")
    from ulysses_lc.levers import rmsnorm_rows

    assert rmsnorm_rows.TRITON_ROWS is True and not rmsnorm_rows.takes(torch.ones(2, 4))  # CPU w/o the interpreter
    monkeypatch.setattr(rmsnorm_rows, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", False)
    assert not rmsnorm_rows.takes(torch.ones(2, 4))  # switched off: never
    monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", True)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(rmsnorm_rows, name)
        monkeypatch.setattr(rmsnorm_rows, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    torch.manual_seed(3)
    weight = torch.empty(24, dtype=torch.bfloat16).uniform_(0.5, 1.5).requires_grad_()
    x = torch.randn(2, 24, 9, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()  # not contiguous
    g = torch.randn(2, 9, 24, dtype=torch.bfloat16)
    out = RMSNormFunction.apply(x, weight, 1e-6)
    saved = out.grad_fn.saved_tensors
    assert [t.shape for t in saved] == [x.shape, weight.shape, (18, 1)] and saved[2].dtype == torch.float32
    gx, gw = torch.autograd.grad(out, (x, weight), g)
    assert calls == ["forward", "backward"] and gx.shape == x.shape and gw.shape == weight.shape
    x_r, w_r = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = _formula64(x_r.reshape(-1, 24), w_r, 1e-6)[0].view(x.shape)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-2
    for a, b in zip((gx, gw), torch.autograd.grad(ref, (x_r, w_r), g.double())):
        assert ((a.double() - b).norm() / b.norm()).item() <= 1e-2
    RMSNormFunction.apply(x, weight, 1e-6, None, True).backward(g)  # Gemma's form
    RMSNormFunction.apply(x, weight.detach().float(), 1e-6).backward(g)  # mixed dtypes
    strided = torch.empty(48, dtype=torch.bfloat16).uniform_(0.5, 1.5)[::2].requires_grad_()
    RMSNormFunction.apply(x, strided, 1e-6).backward(g)  # a weight view with a stride: the kernel reads it as stride 1
    monkeypatch.setattr(rmsnorm_rows, "MAX_WIDTH", 16)
    RMSNormFunction.apply(x, weight, 1e-6).backward(g)
    assert calls == ["forward", "backward"]


def test_whole_model_on_the_rows_kernels(monkeypatch):
    # Every norm of a Qwen3 in bf16 (layer norms and the per-head q/k norms) on the rows kernels, against the model's
    # own norms: the loss at 1e-2 and each gradient at 5e-2 relative (bf16 through two layers; the kernels round once
    # where the class rounds twice).
    pytest.importorskip("triton", reason="the rows kernels are Triton's (installed with the test extra)")
    from ulysses_lc.levers import rmsnorm_rows

    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    plain = build("qwen3").to(torch.bfloat16)
    plain(input_ids=ids, labels=ids).loss.backward()
    model = build("qwen3").to(torch.bfloat16)
    install_efficient_rmsnorm(model)
    monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", True)
    monkeypatch.setattr(rmsnorm_rows, "INTERPRET_ON_CPU", True)
    calls = []
    real = rmsnorm_rows.forward
    monkeypatch.setattr(rmsnorm_rows, "forward", lambda *a: calls.append(a[0].shape) or real(*a))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(calls) == 2 * 4 + 1
    torch.testing.assert_close(loss.float(), plain(input_ids=ids, labels=ids).loss.float(), rtol=1e-2, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        err = ((p.grad.double() - q.grad.double()).norm() / q.grad.double().norm()).item()
        assert err <= 5e-2, (name, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the rows kernels compiled by Triton)")
@pytest.mark.parametrize("width", [128, 2560])  # Qwen3's per-head q/k norms; the Qwen3-4B layer norms
def test_cuda_rows_kernels_match_torchs_fused_ones_and_the_class(width, monkeypatch):
    # On a GPU: the rows kernels against torch's fused ones (the same formula: one rounding of bf16 apart, at most one
    # bf16 step, 2^-7 of the value; 2^-8 failed on an H100 on 2026-12-07 where fp32 sums in another order round apart)
    # and both against the class's own forward and autograd at 1e-2 relative, as above.
    from ulysses_lc.levers import rmsnorm, rmsnorm_rows

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(width, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    rows = 3 * 8192 + 5
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    ref = norm(x)
    want = torch.autograd.grad(ref, (x, norm.weight), g)
    results = {}
    for triton_rows in (True, False):
        monkeypatch.setattr(rmsnorm_rows, "TRITON_ROWS", triton_rows)
        out = rmsnorm._RMSNORM_FORMS["Qwen3RMSNorm"](norm, x)
        assert out.grad_fn.rows_kernel is triton_rows and out.grad_fn.saved_tensors[2].shape == (rows, 1)
        results[triton_rows] = (out, *torch.autograd.grad(out, (x, norm.weight), g))
        for a, b in zip(results[triton_rows], (ref, *want)):
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-2
    ours, torchs = results[True][0].double(), results[False][0].double()
    assert ((ours - torchs).abs() <= 2**-7 * torchs.abs() + 1e-30).all()
    for a, b in zip(results[True][1:], results[False][1:]):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 2**-8
