"""Fused SwiGLU (levers/swiglu.py) against the eager silu(gate) * up: the kernels, the form check, tiled models.

On CPU the Triton kernels run in Triton's interpreter (swiglu.INTERPRET_ON_CPU): the same kernel source, its arithmetic
in numpy; the CUDA test runs them compiled. Tolerances: fp32 within 1e-6 relative of float64. bf16, against float64 on
the same bf16 inputs: compiled, within one rounding to nearest (2^-8 relative) and never further than the eager bf16
result, which rounds twice each way; in the interpreter, which narrows fp32 to bf16 toward zero, within one bf16 step
(2^-7 relative). A tiled model with the kernels against the plain model: loss and every gradient within fp32's
tiling tolerance (tests/test_tiled_mlp.py), on the published Qwen3 and Llama configs' MLP form.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import VOCAB, build
from ulysses_lc.levers import swiglu
from ulysses_lc.levers.tiled_mlp import TiledMLP, install_tiled_mlp, plain_parameter_name

pytest.importorskip("triton", reason="the fused SwiGLU kernels are Triton's (installed with the test extra)")


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(swiglu, "INTERPRET_ON_CPU", True)
    calls = []
    apply = swiglu.FusedSwiGLU.apply

    def counted(*args):
        calls.append(args[0].shape)
        return apply(*args)

    monkeypatch.setattr(swiglu.FusedSwiGLU, "apply", counted)
    return calls


def _reference(g, u, dp):
    """(p, dg, du) in float64 through autograd on the same values."""
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    p = F.silu(g64) * u64
    p.backward(dp.double())
    return p.detach(), g64.grad, u64.grad


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_kernels_against_float64(interpreted, dtype, bound):
    gen = torch.Generator().manual_seed(0)
    # 3 x 1500 elements: two programs of 2048, the second partly masked
    g, u, dp = (4 * torch.randn(3, 1500, generator=gen) for _ in range(3))
    g, u, dp = (t.to(dtype) for t in (g, u, dp))
    g.requires_grad_()
    u.requires_grad_()
    p = swiglu.swiglu(g, u)
    p.backward(dp)
    assert interpreted == [g.shape]
    assert p.dtype == g.grad.dtype == u.grad.dtype == dtype
    for name, got, want in zip(("p", "dg", "du"), (p, g.grad, u.grad), _reference(g, u, dp)):
        assert _rel(got, want) <= bound, (name, _rel(got, want))


def test_no_kernel_on_the_cpu_without_the_interpreter():
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    assert not swiglu.runs_on(g.device)
    assert torch.equal(swiglu.swiglu(g, u), F.silu(g) * u)


class _Swapped(nn.Module):  # silu on up, not gate: another function
    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class _Scaled(_Swapped):  # the form, times a learned scale the stand-in does not have
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.scale


def test_the_form_is_checked_on_the_module_s_own_forward():
    qwen3, llama = build("qwen3"), build("llama")
    assert swiglu.gated_silu_form(qwen3.model.layers[0].mlp)
    assert swiglu.gated_silu_form(llama.model.layers[0].mlp)
    mlp = qwen3.model.layers[0].mlp
    assert not swiglu.gated_silu_form(_Swapped(mlp))
    assert not swiglu.gated_silu_form(_Scaled(mlp))
    assert not swiglu.gated_silu_form(nn.Linear(4, 4))  # no projections at all
    assert not swiglu.gated_silu_form(build("qwen3", hidden_act="gelu_pytorch_tanh").model.layers[0].mlp)
    assert not swiglu.gated_silu_form(build("gemma3").model.layers[0].mlp)  # GELU (tanh), published so
    assert not swiglu.gated_silu_form(build("qwen3_moe").model.layers[0].mlp)  # a sparse MoE block


def _grads(model):
    return {plain_parameter_name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral", "qwen3_5"])
def test_tiled_model_with_the_kernels_equals_the_plain_model(interpreted, family):
    torch.manual_seed(0)
    plain = build(family)
    tiled = build(family)
    tiled.load_state_dict(plain.state_dict())
    ids = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(3))
    plain(input_ids=ids, labels=ids).loss.backward()
    handle = install_tiled_mlp(tiled, num_tiles=3, fused_swiglu=True)
    assert all(layer.mlp.fused_swiglu for layer in tiled.model.layers)
    loss = tiled(input_ids=ids, labels=ids).loss
    loss.backward()
    layers = len(tiled.model.layers)
    # each layer: 3 tiles in the forward, 3 again in the backward's recompute
    assert len(interpreted) == 2 * 3 * layers, len(interpreted)
    ref = _grads(plain)
    got = _grads(tiled)
    assert set(got) == set(ref)
    torch.testing.assert_close(loss, plain(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    handle.undo()


def test_off_or_another_form_runs_the_module_s_forward(interpreted):
    model = build("qwen3")
    install_tiled_mlp(model, num_tiles=2, fused_swiglu=False)
    ids = torch.randint(0, VOCAB, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert interpreted == []
    gelu = TiledMLP(build("qwen3", hidden_act="gelu_pytorch_tanh").model.layers[0].mlp, 64, 2, fused_swiglu=True)
    assert not gelu.fused_swiglu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_within_one_rounding_and_never_further_than_eager():
    gen = torch.Generator(device="cuda").manual_seed(0)
    g, u, dp = (4 * torch.randn(2, 8192, 9728, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    g.requires_grad_()
    u.requires_grad_()
    p = swiglu.swiglu(g, u)
    p.backward(dp)
    got = (p, g.grad, u.grad)
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    p2 = F.silu(g2) * u2
    p2.backward(dp)
    eager = (p2, g2.grad, u2.grad)
    for name, a, e, want in zip(("p", "dg", "du"), got, eager, _reference(g, u, dp)):
        assert _rel(a, want) <= 2**-8, (name, _rel(a, want))
        assert (a.double() - want).abs().max() <= (e.double() - want).abs().max(), name
