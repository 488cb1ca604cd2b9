"""The dense-mask attention every window and sink kernel test compares with (CPU and CUDA)."""

import math

import torch


def dense_reference(q, k, v, scale, window, sinks=None, bounds=None):
    """Softmax over an explicit mask: key j <= query i, j > i - window, same document; sinks as one more column."""
    b, h, s, _ = q.shape
    k, v = (x.repeat_interleave(h // x.shape[1], 1) for x in (k, v))
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None]
    allowed = (j <= i) & (j > i - (window or s))
    if bounds is not None:
        doc = torch.bucketize(torch.arange(s, device=q.device), torch.tensor(bounds[1:-1], device=q.device), right=True)
        allowed &= doc[:, None] == doc[None]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    return scores.softmax(-1)[..., :s] @ v


# bf16 inputs against the reference in fp32 on the same (rounded) inputs: relative Frobenius error bounds for the output
# and for each gradient (tests/test_window_cuda.py's docstring says what they rest on).
OUT_TOL, GRAD_TOL = 2e-2, 4e-2


def cuda_inputs(h, h_kv, s, d, sinks, seed=0):
    """bf16 q [1, h, s, d], k and v [1, h_kv, s, d] and per-head sinks [h] (or None) on CUDA, needing gradients."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    return make(1, h, s, d), make(1, h_kv, s, d), make(1, h_kv, s, d), (make(h) if sinks else None)


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_against_dense(run, inputs, window=None, bounds=None) -> list[float]:
    """`run(q, k, v, scale)`'s output and the gradients of `inputs` against dense_reference in fp32, within OUT_TOL and
    GRAD_TOL; with a window, half that window must differ by more than 5x the output's error, so the check can fail."""
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
    errors = [relative_error(out, ref)] + [relative_error(a, b) for a, b in zip(got, want)]
    assert errors[0] <= OUT_TOL and max(errors[1:]) <= GRAD_TOL, errors
    if window is not None and window > 1:
        half = dense_reference(rq, rk, rv, scale, window // 2, rsink, bounds)
        assert relative_error(out, half) > 5 * errors[0]
    print(f"rel errors out, dq, dk, dv[, dsink]: {', '.join(f'{e:.1e}' for e in errors)}")
    return errors
