"""Memory-efficient RMSNorm against transformers' own: same output bit for bit, same gradients."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tests.models import VOCAB, build
from ulysses_lc.rmsnorm import RMSNormFunction, install_memory_efficient_rmsnorm


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
    undo = install_memory_efficient_rmsnorm(model)
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
