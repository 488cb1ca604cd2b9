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

from tests._attention_ref import OUT_TOL, check_against_dense, cuda_inputs, relative_error
from ulysses_lc.mixers.kernels import document_attention
from ulysses_lc.mixers.window_attention import window_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels: needs a GPU")


@pytest.mark.parametrize("how", ["band", "flash_window", "flex", "auto"])
@pytest.mark.parametrize("d,window,sinks", [(128, 128, False), (128, 1000, True), (64, 4096, True), (64, 300, False)])
def test_window_kernels_match_dense_fp32(how, d, window, sinks):
    s = 4096 if window < 4096 else 6000
    inputs = cuda_inputs(8, 2, s, d, sinks)
    check_against_dense(lambda q, k, v, scale: window_attention(q, k, v, scale, window, inputs[3], "auto", how=how),
                        inputs, window)


@pytest.mark.parametrize("how", ["auto", "loop"])
@pytest.mark.parametrize("window,sinks", [(64, True), (700, False)])
def test_packed_documents_restart_window_and_sinks_on_cuda(how, window, sinks):
    bounds = (0, 900, 1300, 1301, 2500, 3072)
    inputs = cuda_inputs(4, 4, 3072, 128, sinks, seed=2)
    check_against_dense(lambda q, k, v, scale: document_attention(q, k, v, bounds, scale, "auto", how=how,
                                                                  window=window, sinks_h=inputs[3]),
                        inputs, window, bounds)


def test_flex_in_a_layer_that_keeps_its_output_takes_an_explicit_kernel():
    """A layer keeping its output for the recompute needs a backward op that reads a given output (flex's is
    autograd's own): window_attention then runs auto's pick and says which; the numbers agree with flex's."""
    from ulysses_lc.mixers.window_attention import resolve_how

    assert resolve_how("flex", torch.device("cuda"), 128, kept=True) == "flash_window"
    assert resolve_how("auto", torch.device("cuda"), None) == "band"  # sinks without a window: one cuDNN call
    inputs = cuda_inputs(4, 2, 1024, 64, True)
    got = []
    out = window_attention(*inputs[:3], 0.125, 128, inputs[3], "auto", how="flex", sink_list=got)
    assert got[0][0] in ("flash_window", "band")
    ref = window_attention(*inputs[:3], 0.125, 128, inputs[3], "auto", how="flex")
    assert relative_error(out, ref) <= OUT_TOL
