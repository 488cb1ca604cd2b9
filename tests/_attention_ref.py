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
