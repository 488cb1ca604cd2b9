"""Chunked LM-head loss vs F.cross_entropy(reduction="sum") on the full logits.

Shape legend: t tokens, h hidden, v vocab.
Tolerances: fp64 rel 1e-10, fp32 rel 1e-5 (summation order differs between chunks and the
full matmul; both are well above fp32 round-off for these sizes).
Also: the forward never reads device values (no host sync), and shard_batch(vocab_size=...) is the
host-side label range check.
"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ulysses_lc.levers.chunked_loss as chunked_loss_module
from ulysses_lc.levers import ce_rows
from ulysses_lc import ParallelLayout, shard_batch
from ulysses_lc.levers.chunked_loss import (
    ChunkedLossHead,
    auto_chunk_rows,
    chunked_cross_entropy,
    install_chunked_loss_head,
)
from ulysses_lc.constants import IGNORE_INDEX

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _reference(hidden_th, weight_vh, bias_v, labels_t):
    hidden_th = hidden_th.detach().clone().requires_grad_()
    weight_vh = weight_vh.detach().clone().requires_grad_()
    bias_v = None if bias_v is None else bias_v.detach().clone().requires_grad_()
    loss = F.cross_entropy(F.linear(hidden_th, weight_vh, bias_v), labels_t, reduction="sum")
    loss.backward()
    return loss, hidden_th.grad, weight_vh.grad, None if bias_v is None else bias_v.grad


def _labels(t, v, generator):
    labels_t = torch.randint(0, v, (t,), generator=generator)
    # Many ignored rows, including one whole chunk (rows 8..15 with chunk_rows=8).
    labels_t[torch.rand(t, generator=generator) < 0.4] = IGNORE_INDEX
    labels_t[8:16] = IGNORE_INDEX
    return labels_t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [8, 5, 1000])
def test_matches_full_cross_entropy(dtype, with_bias, chunk_rows):
    g = torch.Generator().manual_seed(0)
    t, h, v = 45, 16, 37  # 45 rows: with ~40% ignored the valid rows end in an uneven chunk
    hidden_th = torch.randn(t, h, generator=g, dtype=dtype)
    weight_vh = torch.randn(v, h, generator=g, dtype=dtype)
    bias_v = torch.randn(v, generator=g, dtype=dtype) if with_bias else None
    labels_t = _labels(t, v, g)

    ref_loss, ref_gh, ref_gw, ref_gb = _reference(hidden_th, weight_vh, bias_v, labels_t)

    hidden = hidden_th.clone().requires_grad_()
    weight = weight_vh.clone().requires_grad_()
    bias = None if bias_v is None else bias_v.clone().requires_grad_()
    loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels_t, bias, chunk_rows=chunk_rows)
    # A non-unit upstream gradient, as a mean loss would send.
    (loss_sum * 0.375).backward()

    assert loss_sum.dtype == torch.promote_types(dtype, torch.float32) and n_valid.dtype == torch.int64
    assert not n_valid.requires_grad
    assert int(n_valid) == int((labels_t != IGNORE_INDEX).sum())
    tol = TOL[dtype]
    torch.testing.assert_close(loss_sum, ref_loss, **tol)
    torch.testing.assert_close(hidden.grad, ref_gh * 0.375, **tol)
    torch.testing.assert_close(weight.grad, ref_gw * 0.375, **tol)
    if with_bias:
        torch.testing.assert_close(bias.grad, ref_gb * 0.375, **tol)
    # Ignored rows get exactly zero gradient.
    assert torch.all(hidden.grad[labels_t == IGNORE_INDEX] == 0)


def test_uneven_last_chunk_and_all_ignored():
    g = torch.Generator().manual_seed(1)
    t, h, v = 23, 8, 11
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels_t = torch.randint(0, v, (t,), generator=g)  # 23 valid rows, chunks of 4: last has 3
    loss_sum, _ = chunked_cross_entropy(hidden, weight, labels_t, chunk_rows=4)
    loss_sum.backward()
    ref_loss, ref_gh, ref_gw, _ = _reference(hidden, weight, None, labels_t)
    torch.testing.assert_close(loss_sum, ref_loss, **TOL[torch.float64])
    torch.testing.assert_close(hidden.grad, ref_gh, **TOL[torch.float64])
    torch.testing.assert_close(weight.grad, ref_gw, **TOL[torch.float64])

    hidden.grad = weight.grad = None
    all_ignored = torch.full((t,), IGNORE_INDEX)
    loss_sum, n_valid = chunked_cross_entropy(hidden, weight, all_ignored, chunk_rows=4)
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and n_valid.item() == 0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_no_grad_and_bad_labels():
    hidden = torch.randn(6, 4)
    weight = torch.randn(5, 4)
    with torch.no_grad():
        loss_sum, _ = chunked_cross_entropy(hidden, weight, torch.tensor([0, 1, 2, 3, 4, IGNORE_INDEX]))
    ref = F.cross_entropy(hidden @ weight.T, torch.tensor([0, 1, 2, 3, 4, IGNORE_INDEX]), reduction="sum")
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="labels must be in"):
        chunked_cross_entropy(hidden, weight, torch.tensor([0, 1, 2, 3, 5, 0]))
    with pytest.raises(ValueError, match="flatten"):
        chunked_cross_entropy(hidden.view(2, 3, 4), weight, torch.zeros(2, 3, dtype=torch.long))


def test_auto_chunk_rows_targets_a_gib_of_logits():
    rows = auto_chunk_rows(151_936)
    assert rows % 64 == 0 and rows > 256
    assert abs(rows * 151_936 * 4 - (1 << 30)) < 64 * 151_936 * 4
    assert auto_chunk_rows(10**9) == 64


def test_head_module_logits_and_loss():
    torch.manual_seed(0)
    linear = nn.Linear(8, 13, bias=True)
    head = ChunkedLossHead(linear, chunk_rows=3)
    assert head.weight is linear.weight and head.bias is linear.bias
    hidden_bsh = torch.randn(2, 5, 8)
    torch.testing.assert_close(head(hidden_bsh), linear(hidden_bsh), rtol=0, atol=0)
    labels_bs = torch.randint(0, 13, (2, 5))
    labels_bs[0, :2] = IGNORE_INDEX
    loss_sum, n_valid = head(hidden_bsh, labels_bs)
    ref = F.cross_entropy(linear(hidden_bsh).reshape(-1, 13), labels_bs.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=1e-6)
    assert int(n_valid) == 8


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).double()


def test_tied_qwen3_every_grad_matches_plain_loss():
    model = _tiny_qwen3()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 128, (2, 17), generator=g)
    labels_bs = input_ids.clone()
    labels_bs[0, :6] = IGNORE_INDEX

    # Reference: full logits, shifted, plain cross-entropy (sum).
    logits = model(input_ids=input_ids).logits
    ref_loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, 128), labels_bs[:, 1:].reshape(-1), reduction="sum"
    )
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    undo = install_chunked_loss_head(model, chunk_rows=5).undo
    assert isinstance(model.lm_head, ChunkedLossHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden_bsh = model.model(input_ids=input_ids).last_hidden_state
    loss_sum, n_valid = model.lm_head(hidden_bsh[:, :-1], labels_bs[:, 1:])
    loss_sum.backward()
    assert int(n_valid) == int((labels_bs[:, 1:] != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss_sum, ref_loss, **TOL[torch.float64])
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_grads)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-9, atol=1e-11, msg=name)

    undo()
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _ignored_heavy_labels(t, v, generator):
    """~half the rows ignored, plus the first row, the last row and the whole chunk 4..7 (chunk_rows=4)."""
    labels_t = torch.randint(0, v, (t,), generator=generator)
    labels_t[torch.rand(t, generator=generator) < 0.5] = IGNORE_INDEX
    labels_t[0] = labels_t[-1] = IGNORE_INDEX
    labels_t[4:8] = IGNORE_INDEX
    return labels_t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ignored_rows_contribute_exactly_nothing(dtype):
    """Loss and every gradient vs F.cross_entropy (TOL above) with many ignored rows, one chunk wholly
    ignored and an uneven last chunk; then ignored rows are given huge hidden states and the loss and
    weight/bias gradients must not move by a single bit (they are masked, not merely small)."""
    g = torch.Generator().manual_seed(3)
    t, h, v = 30, 8, 13  # chunk_rows=4: chunks 0..6 full, chunk 7 has 2 rows
    hidden_th = torch.randn(t, h, generator=g, dtype=dtype)
    weight_vh = torch.randn(v, h, generator=g, dtype=dtype)
    bias_v = torch.randn(v, generator=g, dtype=dtype)
    labels_t = _ignored_heavy_labels(t, v, g)
    ignored = labels_t == IGNORE_INDEX
    assert 0 < int((~ignored).sum()) < t - 8

    def run(hidden_values):
        hidden = hidden_values.clone().requires_grad_()
        weight = weight_vh.clone().requires_grad_()
        bias = bias_v.clone().requires_grad_()
        loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels_t, bias, chunk_rows=4)
        (loss_sum * 0.5).backward()
        return loss_sum.detach(), n_valid, hidden.grad, weight.grad, bias.grad

    loss_sum, n_valid, g_hidden, g_weight, g_bias = run(hidden_th)
    ref_loss, ref_gh, ref_gw, ref_gb = _reference(hidden_th, weight_vh, bias_v, labels_t)
    tol = TOL[dtype]
    assert int(n_valid) == int((~ignored).sum())
    torch.testing.assert_close(loss_sum, ref_loss, **tol)
    torch.testing.assert_close(g_hidden, ref_gh * 0.5, **tol)
    torch.testing.assert_close(g_weight, ref_gw * 0.5, **tol)
    torch.testing.assert_close(g_bias, ref_gb * 0.5, **tol)
    assert torch.all(g_hidden[ignored] == 0)

    garbage = hidden_th.clone()
    garbage[ignored] = 1e3 * torch.randn(int(ignored.sum()), h, generator=g, dtype=dtype)
    loss2, _, g_hidden2, g_weight2, g_bias2 = run(garbage)
    torch.testing.assert_close(loss2, loss_sum, rtol=0, atol=0)
    torch.testing.assert_close(g_weight2, g_weight, rtol=0, atol=0)
    torch.testing.assert_close(g_bias2, g_bias, rtol=0, atol=0)
    torch.testing.assert_close(g_hidden2, g_hidden, rtol=0, atol=0)


@pytest.mark.parametrize("needs_grad", [True, False])
def test_all_ignored_gives_zero_loss_grads_and_count(needs_grad):
    g = torch.Generator().manual_seed(4)
    t, h, v = 10, 8, 13
    hidden = torch.randn(t, h, generator=g, requires_grad=needs_grad)
    weight = torch.randn(v, h, generator=g, requires_grad=needs_grad)
    bias = torch.randn(v, generator=g, requires_grad=needs_grad)
    loss_sum, n_valid = chunked_cross_entropy(hidden, weight, torch.full((t,), IGNORE_INDEX), bias, chunk_rows=4)
    assert loss_sum.item() == 0.0 and n_valid.item() == 0 and n_valid.dtype == torch.int64
    if needs_grad:
        loss_sum.backward()
        for param in (hidden, weight, bias):
            assert torch.all(param.grad == 0)


def test_forward_and_backward_read_no_device_values():
    """Guards the no-host-sync contract of the training step (a sync stalls the GPU queue every step).

    On the 'meta' device tensors have shapes but no values: any nonzero, item, bool(tensor),
    int(tensor), tolist or value-dependent shape in forward or backward raises there, so a
    reintroduced sync (e.g. sizing the valid rows with nonzero, or a bool() range check on the
    device) fails this test. Meta takes the same branch as CUDA (labels not on the CPU).
    """
    t, h, v = 20, 8, 13
    for dtype, with_bias in [(torch.float32, True), (torch.bfloat16, False)]:
        hidden = torch.empty(t, h, device="meta", dtype=dtype, requires_grad=True)
        weight = torch.empty(v, h, device="meta", dtype=dtype, requires_grad=True)
        bias = torch.empty(v, device="meta", dtype=dtype, requires_grad=True) if with_bias else None
        labels = torch.empty(t, device="meta", dtype=torch.long)
        loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels, bias, chunk_rows=6)
        (loss_sum * 2.0).backward()
        assert n_valid.device.type == "meta" and n_valid.dtype == torch.int64 and n_valid.shape == ()
        assert hidden.grad.shape == (t, h) and weight.grad.shape == (v, h) and weight.grad.dtype == dtype
        if with_bias:
            assert bias.grad.shape == (v,)
        with torch.no_grad():
            chunked_cross_entropy(hidden, weight, labels, bias, chunk_rows=6)


def test_cpu_path_reads_values_only_in_the_label_check(monkeypatch):
    """On real CPU values, with ignored rows: outside the (free on CPU) label range check, forward and
    backward call none of nonzero / item / tolist / bool / int / float on a tensor, and still match."""
    g = torch.Generator().manual_seed(5)
    t, h, v = 30, 8, 13
    hidden_th = torch.randn(t, h, generator=g, dtype=torch.float64)
    weight_vh = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels_t = _ignored_heavy_labels(t, v, g)
    ref_loss, ref_gh, ref_gw, _ = _reference(hidden_th, weight_vh, None, labels_t)
    hidden = hidden_th.clone().requires_grad_()
    weight = weight_vh.clone().requires_grad_()

    checked = []
    monkeypatch.setattr(chunked_loss_module, "check_labels_in_vocab", lambda labels, vocab: checked.append(vocab))

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} reads a device value (a host sync on GPU)")

        return raise_

    with monkeypatch.context() as patch:
        for name in ("nonzero", "item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, forbidden(name))
        patch.setattr(torch, "nonzero", forbidden("nonzero"))
        loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels_t, chunk_rows=4)
        loss_sum.backward()
    assert checked == [v]
    assert int(n_valid) == int((labels_t != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss_sum, ref_loss, **TOL[torch.float64])
    torch.testing.assert_close(hidden.grad, ref_gh, **TOL[torch.float64])
    torch.testing.assert_close(weight.grad, ref_gw, **TOL[torch.float64])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_backward_without_sync():
    """The real thing on a GPU: sync debug mode 'error' raises on any synchronizing call."""
    g = torch.Generator().manual_seed(6)
    t, h, v = 300, 64, 1000
    hidden_th = torch.randn(t, h, generator=g, dtype=torch.float64)
    weight_vh = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias_v = torch.randn(v, generator=g, dtype=torch.float64)
    labels_t = _ignored_heavy_labels(t, v, g)
    labels_t[100:200] = IGNORE_INDEX
    ref_loss, ref_gh, ref_gw, ref_gb = _reference(hidden_th, weight_vh, bias_v, labels_t)
    hidden = hidden_th.cuda().requires_grad_()
    weight = weight_vh.cuda().requires_grad_()
    bias = bias_v.cuda().requires_grad_()
    labels = labels_t.cuda()
    from ulysses_lc.levers.fp32_accumulate import takes_fp32_gemm

    half = [x.detach().to(torch.bfloat16).requires_grad_() for x in (hidden, weight, bias)]
    # The fp32 GEMM's one-time probe (a sync), as a run's first step makes it.
    takes_fp32_gemm(torch.zeros(1, device="cuda"), half[0], half[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_sum, n_valid = chunked_cross_entropy(hidden, weight, labels, bias, chunk_rows=64)
        loss_sum.backward()
        with torch.no_grad():
            chunked_cross_entropy(hidden, weight, labels, bias, chunk_rows=64)
        chunked_cross_entropy(*half[:2], labels, half[2], chunk_rows=64)[0].backward()  # bf16: the fp32 GEMM's path
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert n_valid.device.type == "cuda" and int(n_valid) == int((labels_t != IGNORE_INDEX).sum())
    tol = TOL[torch.float64]
    torch.testing.assert_close(loss_sum.cpu(), ref_loss, **tol)
    torch.testing.assert_close(hidden.grad.cpu(), ref_gh, **tol)
    torch.testing.assert_close(weight.grad.cpu(), ref_gw, **tol)
    torch.testing.assert_close(bias.grad.cpu(), ref_gb, **tol)


def test_shard_batch_checks_label_range_on_the_host():
    """Host-side half of the label range check (on a GPU the loss only has a device-side assert)."""
    v = 50
    ids = torch.randint(0, v, (1, 9), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    for rank in (0, 1):  # every rank checks the whole sequence, so all raise alike
        layout = ParallelLayout(world_size=2, sp_size=2, rank=rank)
        batch = shard_batch(ids, layout, labels=labels, vocab_size=v)
        torch.testing.assert_close(batch.labels, shard_batch(ids, layout, labels=labels).labels, rtol=0, atol=0)
        for bad_value in (v, v + 7, -1, -5):
            bad = labels.clone()
            bad[0, 7] = bad_value  # lands in rank 1's slice after the shift
            with pytest.raises(ValueError, match=rf"labels must be in \[0, {v}\).*tokenizer matches the model"):
                shard_batch(ids, layout, labels=bad, vocab_size=v)
            shard_batch(ids, layout, labels=bad)  # without vocab_size nothing is checked
    assert shard_batch(ids, ParallelLayout(world_size=1, sp_size=1), vocab_size=v).labels.shape == (1, 9)


@pytest.mark.parametrize("chunk_rows", [7, 1000])
def test_bf16_is_as_close_to_the_truth_as_the_plain_bf16_loss(chunk_rows):
    """Production runs bf16 (issue 28, item 5). Against the fp64 loss and gradients of the same bf16 inputs, ours is
    held to twice the error of transformers' own bf16 path (bf16 logits upcast to fp32 for the loss), and to 1e-3
    relative on the loss and 2e-2 on each gradient."""
    g = torch.Generator().manual_seed(0)
    t, h, v = 96, 64, 301
    hidden = torch.randn(t, h, generator=g).bfloat16()
    weight = (0.3 * torch.randn(v, h, generator=g)).bfloat16()
    labels = _labels(t, v, g)

    def autograd(dtype, upcast_logits):
        x, w = hidden.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()
        logits = F.linear(x, w)
        loss = F.cross_entropy(logits.float() if upcast_logits else logits, labels, reduction="sum")
        loss.backward()
        return loss, x.grad, w.grad

    truth = autograd(torch.float64, False)
    plain = autograd(torch.bfloat16, True)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_sum, _ = chunked_cross_entropy(x, w, labels, chunk_rows=chunk_rows)
    loss_sum.backward()
    ours = (loss_sum, x.grad, w.grad)
    assert loss_sum.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.bfloat16

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for name, got, base, want, bound in zip(("loss", "d hidden", "d weight"), ours, plain, truth, (1e-3, 2e-2, 2e-2)):
        err, err_plain = rel(got, want), rel(base, want)
        assert err <= max(2 * err_plain, 1e-6) and err <= bound, (name, err, err_plain)


# ---- the fused rows kernel (ce_rows.FUSED_ROWS, ce_kernel.py) ----
# bf16 logits as the matmul writes them; the kernel computes in fp32 like the eager path, so the loss agrees within
# fp32 summation order (1e-6 relative) and the gradients within one bf16 step of d loss / d logits (2^-7 of the
# largest, relative; Triton's interpreter narrows fp32 to bf16 toward zero where the eager cast rounds to nearest).


def _fused_case(seed, t=50, e=16, v=97):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, e, generator=g).to(torch.bfloat16)
    weight = torch.randn(v, e, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[[3, 17, 18, t - 1]] = IGNORE_INDEX
    return hidden, weight, labels


def _loss_and_grads(hidden, weight, labels, chunk_rows):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_sum, n_valid = chunked_cross_entropy(h, w, labels, chunk_rows=chunk_rows)
    loss_sum.backward()
    return loss_sum.detach(), h.grad, w.grad


@pytest.mark.parametrize("block", [4096, 32])  # one block a row, and four of them, the last partly masked
def test_fused_rows_kernel_equals_the_eager_chunk(monkeypatch, block):
    pytest.importorskip("triton", reason="the fused rows kernel is Triton's (installed with the test extra)")
    hidden, weight, labels = _fused_case(7)
    eager = _loss_and_grads(hidden, weight, labels, chunk_rows=16)
    monkeypatch.setattr(ce_rows, "FUSED_ROWS", True)
    monkeypatch.setattr(ce_rows, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(ce_rows, "_ROWS_BLOCK", block)
    calls = []
    rows = ce_rows.fused_rows
    monkeypatch.setattr(ce_rows, "fused_rows", lambda *a: calls.append(a[3]) or rows(*a))
    fused = _loss_and_grads(hidden, weight, labels, chunk_rows=16)
    assert calls == [True] * 4  # 50 rows in chunks of 16, each with its gradient
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=0)
    for name, got, want in zip(("hidden", "weight"), fused[1:], eager[1:]):
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= 2**-7, (name, err)
    assert torch.count_nonzero(fused[1][[3, 17, 18, 49]]) == 0  # ignored rows: exact zeros
    with torch.no_grad():  # evaluation: the loss alone, no gradient written
        calls.clear()
        loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_rows=64)
    assert calls == [False]
    torch.testing.assert_close(loss_sum, eager[0], rtol=1e-6, atol=0)


def test_fused_rows_on_by_default_and_never_on_the_cpu_alone():
    assert ce_rows.FUSED_ROWS is True
    logits = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not ce_rows.takes(logits, None, torch.float32)


def test_a_heads_fused_rows_setting_overrides_the_default_down_to_each_chunk(monkeypatch):
    """fused_rows on chunked_cross_entropy, ChunkedLossHead (through install_chunked_loss_head and the DPO documents'
    log-probabilities) reaches chunk_step: True takes the kernel with the default off, False keeps the eager chunk
    with it on, None follows ce_rows.FUSED_ROWS; the kernel's numbers agree with the eager ones as above."""
    pytest.importorskip("triton", reason="the fused rows kernel is Triton's (installed with the test extra)")
    from ulysses_lc.levers.chunked_loss import install_chunked_loss_head
    from ulysses_lc.objectives.preference import DocumentRows

    monkeypatch.setattr(ce_rows, "INTERPRET_ON_CPU", True)
    calls = []
    rows = ce_rows.fused_rows
    monkeypatch.setattr(ce_rows, "fused_rows", lambda *a: calls.append(a[3]) or rows(*a))
    monkeypatch.setattr(ce_rows, "FUSED_ROWS", False)
    hidden, weight, labels = _fused_case(9, t=20, v=41)
    eager = chunked_cross_entropy(hidden, weight, labels, chunk_rows=8)[0]
    assert calls == []
    for setting, default, taken in ((True, False, 3), (False, True, 0), (None, True, 3), (None, False, 0)):
        monkeypatch.setattr(ce_rows, "FUSED_ROWS", default)
        calls.clear()
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_rows=8, fused_rows=setting)[0]
        assert len(calls) == taken, (setting, default, calls)
        torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)
    monkeypatch.setattr(ce_rows, "FUSED_ROWS", False)

    model = nn.Module()
    model.config = types.SimpleNamespace()
    model.head = nn.Linear(16, 41, bias=False, dtype=torch.bfloat16)
    model.get_output_embeddings = lambda: model.head
    model.set_output_embeddings = lambda head: setattr(model, "head", head)
    with torch.no_grad():
        model.head.weight.copy_(weight)
    handle = install_chunked_loss_head(model, 8, fused_rows=True)
    assert model.head.fused_rows is True
    calls.clear()
    torch.testing.assert_close(model.head(hidden, labels)[0], eager, rtol=1e-6, atol=0)
    assert len(calls) == 3
    documents = DocumentRows(2, ((0, 0, 12), (1, 12, 20)))
    calls.clear()
    fused_logps = model.head(hidden, labels, documents=documents)
    assert len(calls) == 3  # rows 0-8, 8-12 of the first document, 12-20 of the second
    model.head.fused_rows = False
    torch.testing.assert_close(fused_logps, model.head(hidden, labels, documents=documents), rtol=1e-6, atol=0)
    assert len(calls) == 3
    handle.undo()
    assert isinstance(model.head, nn.Linear)

    from tests.models import build
    from ulysses_lc import SequenceParallelCausalLM

    layout = ParallelLayout(world_size=1, sp_size=1)
    for setting in (True, False, None):  # the wrapper's fused_ce_rows is its head's fused_rows
        wrapped = SequenceParallelCausalLM(build("qwen3"), layout, checkpointing=False, offload=False,
                                           fused_ce_rows=setting)
        assert wrapped.model.get_output_embeddings().fused_rows is setting


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_rows_equal_the_eager_chunk(monkeypatch):
    g = torch.Generator().manual_seed(8)
    t, e, v = 2048, 256, 151936
    hidden = torch.randn(t, e, generator=g).to(torch.bfloat16).cuda()
    weight = (0.1 * torch.randn(v, e, generator=g)).to(torch.bfloat16).cuda()
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = IGNORE_INDEX
    labels = labels.cuda()
    monkeypatch.setattr(ce_rows, "FUSED_ROWS", False)  # the eager chunk (the default takes the kernel on CUDA)
    eager = _loss_and_grads(hidden, weight, labels, chunk_rows=512)
    monkeypatch.setattr(ce_rows, "FUSED_ROWS", True)
    fused = _loss_and_grads(hidden, weight, labels, chunk_rows=512)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=0)
    for name, got, want in zip(("hidden", "weight"), fused[1:], eager[1:]):
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= 2**-8, (name, err)


# ---- the weight gradient's fp32 accumulation (fp32_accumulate.py) ----


def test_add_product_is_the_eager_sum_off_cuda():
    from ulysses_lc.levers.fp32_accumulate import add_product_, takes_fp32_gemm

    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 5, generator=g).to(torch.bfloat16), torch.randn(5, 7, generator=g).to(torch.bfloat16)
    acc = torch.randn(6, 7, generator=g)
    want = acc + (a @ b).float()
    assert not takes_fp32_gemm(acc, a, b)  # the CPU: the eager form
    assert add_product_(acc, a, b) is acc and torch.equal(acc, want)


def test_the_fp32_gemm_is_taken_only_where_this_torch_computes_it_right(monkeypatch):
    # The one-time probe, its GEMM replaced on the CPU: an addmm that refuses an fp32 input (some torch releases), one
    # that computes the sum, one that overwrites the accumulator instead of adding to it.
    from ulysses_lc.levers import fp32_accumulate

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda *a: True)

    def refuses(acc, a, b, out_dtype, out):
        raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")

    def adds(acc, a, b, out_dtype, out):
        return out.copy_(acc + (a.float() @ b.float()))

    def overwrites(acc, a, b, out_dtype, out):
        return out.copy_(a.float() @ b.float())

    results = {}
    for name, addmm in (("refuses", refuses), ("adds", adds), ("overwrites", overwrites)):
        monkeypatch.setattr(torch, "addmm", addmm)
        results[name] = fp32_accumulate._fp32_out_gemm_works.__wrapped__(torch.device("cpu"), torch.bfloat16)
    assert results == {"refuses": False, "adds": True, "overwrites": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS with an fp32 output)")
def test_cuda_weight_gradient_accumulates_in_fp32_inside_the_gemm(monkeypatch):
    # The head's weight gradient over many chunks (bf16 inputs, Qwen3's vocabulary) against float64: the GEMM into the
    # fp32 accumulator is at least as close as the eager path, which rounds each chunk's product to bf16 first.
    from ulysses_lc.levers import fp32_accumulate

    g = torch.Generator().manual_seed(9)
    t, e, v = 4096, 128, 151936
    hidden = torch.randn(t, e, generator=g).to(torch.bfloat16).cuda()
    weight = (0.1 * torch.randn(v, e, generator=g)).to(torch.bfloat16).cuda()
    labels = torch.randint(0, v, (t,), generator=g).cuda()
    taken = fp32_accumulate.takes_fp32_gemm(torch.zeros(1, 1, device="cuda"), hidden, hidden)
    if not taken:
        pytest.skip(f"this torch ({torch.__version__}) does not add into an fp32 sum inside the GEMM: the eager "
                    "form runs")
    # One chunk's product against float64: the GEMM into fp32 within fp32 summation (1e-5), where rounding the product
    # to bf16 first (the eager form) is 2^-9 off.
    acc = torch.randn(v, e, generator=g).cuda()
    dlogits = (0.01 * torch.randn(512, v, generator=g)).to(torch.bfloat16).cuda()
    want = acc.double() + dlogits.double().t() @ hidden[:512].double()
    fp32_accumulate.add_product_(acc, dlogits.t(), hidden[:512])
    assert ((acc.double() - want).norm() / want.norm()).item() <= 1e-5
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    F.cross_entropy(F.linear(h64, w64), labels, reduction="sum").backward()
    errors = {}
    for fp32_gemm in (True, False):
        monkeypatch.setattr(fp32_accumulate, "_fp32_out_gemm_works",
                            lambda *a, fp32_gemm=fp32_gemm: fp32_gemm)
        grads = _loss_and_grads(hidden, weight, labels, chunk_rows=256)
        errors[fp32_gemm] = ((grads[2].double() - w64.grad).norm() / w64.grad.norm()).item()
    assert errors[True] <= errors[False] * 1.01 and errors[True] <= 2**-8, errors
