"""The CUDA window and sink kernels against an fp32 dense reference (issue 28, item 5): cuDNN's band, flash's
window, sinks, packed documents, GQA, bf16. Skipped without a GPU; on one H200 with
`python -m pytest tests/test_window_cuda.py -q`.

flex (flex_window.py, opt-in) is among the kernels checked.

Tolerance: bf16 inputs, the reference in fp32 on the same (rounded) inputs. Relative Frobenius error at most 2e-2 for
the output and 4e-2 for each gradient (measured on an H200, 2026-12-01: the outputs 2.0e-3 to 2.8e-3); a window of half
the size must differ by more than 5x that error, so the comparison can fail (one key fewer of a 700-key window moves
the output by only 2-8x the bf16 error).
"""

import pytest
import torch

from tests._attention_ref import dense_reference
from ulysses_lc.mixers.kernels import document_attention
from ulysses_lc.mixers.window_attention import window_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels: needs a GPU")
OUT_TOL, GRAD_TOL = 2e-2, 4e-2


def _inputs(h, h_kv, s, d, sinks, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    return make(1, h, s, d), make(1, h_kv, s, d), make(1, h_kv, s, d), (make(h) if sinks else None)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _check(run, inputs, window, bounds=None):
    q, k, v, sink = inputs
    leaves = [x for x in inputs if x is not None]
    scale = q.shape[-1] ** -0.5
    out = run(q, k, v, scale)
    grad_out = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                           dtype=out.dtype)
    got = torch.autograd.grad(out, leaves, grad_out)
    ref_inputs = [x.detach().float().requires_grad_() for x in leaves]
    rq, rk, rv = ref_inputs[:3]
    rsink = ref_inputs[3] if sink is not None else None
    ref = dense_reference(rq, rk, rv, scale, window, rsink, bounds)
    want = torch.autograd.grad(ref, ref_inputs, grad_out.float())
    errors = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(got, want)]
    assert errors[0] <= OUT_TOL and max(errors[1:]) <= GRAD_TOL, errors
    if window is not None and window > 1:  # the check can fail: half the window is another result
        assert _rel(out, dense_reference(rq, rk, rv, scale, window // 2, rsink, bounds)) > 5 * errors[0]
    print(f"rel errors out, dq, dk, dv[, dsink]: {', '.join(f'{e:.1e}' for e in errors)}")
    return errors


@pytest.mark.parametrize("how", ["band", "flash_window", "flex", "auto"])
@pytest.mark.parametrize("d,window,sinks", [(128, 128, False), (128, 1000, True), (64, 4096, True), (64, 300, False)])
def test_window_kernels_match_dense_fp32(how, d, window, sinks):
    s = 4096 if window < 4096 else 6000
    inputs = _inputs(8, 2, s, d, sinks)
    _check(lambda q, k, v, scale: window_attention(q, k, v, scale, window, inputs[3], "auto", how=how), inputs, window)


@pytest.mark.parametrize("how", ["auto", "loop"])
@pytest.mark.parametrize("window,sinks", [(64, True), (700, False)])
def test_packed_documents_restart_window_and_sinks_on_cuda(how, window, sinks):
    bounds = (0, 900, 1300, 1301, 2500, 3072)
    inputs = _inputs(4, 4, 3072, 128, sinks, seed=2)
    _check(lambda q, k, v, scale: document_attention(q, k, v, bounds, scale, "auto", how=how, window=window,
                                                     sinks_h=inputs[3]), inputs, window, bounds)


def test_flex_in_a_layer_that_keeps_its_output_takes_an_explicit_kernel():
    """A layer keeping its output for the recompute needs a backward op that reads a given output (flex's is
    autograd's own): window_attention then runs auto's pick and says which; the numbers agree with flex's."""
    from ulysses_lc.mixers.window_attention import resolve_how

    assert resolve_how("flex", torch.device("cuda"), 128, kept=True) == "flash_window"
    assert resolve_how("auto", torch.device("cuda"), None) == "band"  # sinks without a window: one cuDNN call
    inputs = _inputs(4, 2, 1024, 64, True)
    got = []
    out = window_attention(*inputs[:3], 0.125, 128, inputs[3], "auto", how="flex", sink_list=got)
    assert got[0][0] in ("flash_window", "band")
    ref = window_attention(*inputs[:3], 0.125, 128, inputs[3], "auto", how="flex")
    assert _rel(out, ref) <= OUT_TOL
