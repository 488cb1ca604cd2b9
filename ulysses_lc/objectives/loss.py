"""Loss reduction across the SP group: the mean over every valid token of the whole sequence.

Each rank holds the summed loss of its slice's tokens and their count. The mean of the sequence is
sum_r(loss_sum_r) / sum_r(n_valid_r): a mean of per-rank means would weight a rank holding few valid
tokens (padding, ignored prompt) as much as a full one, and an average of losses over ranks would scale
an eval loss by nothing or by sp_size depending on how it is summed. Training and evaluation share
this one path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..constants import IGNORE_INDEX
from ..parallel.layout import ParallelLayout


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) over the SP group. Backward: all-reduce (sum) of the incoming gradient.

    Every SP rank holds the same total loss and runs its own backward, so the gradient reaching each
    rank's local sum is the sum of all sp_size ranks' (identical) gradients: sp_size times its own share.
    ZeRO-3 then averages over all sp_size * dp_size ranks, which turns that back into the exact sum over
    the SP group and mean over DP (layout.py). Saves nothing."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sp_sum(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """x summed over the SP group, differentiable (each rank's gradient then flows as _SumOverGroup says)."""
    return _SumOverGroup.apply(x, layout.sp_group) if layout.sp_size > 1 else x


def sp_mean_loss(loss_sum: torch.Tensor, n_valid: torch.Tensor, layout: ParallelLayout, num_items_in_batch=None):
    """Mean loss over the valid tokens of the whole sequence, identical on every rank of the SP group.

    loss_sum: differentiable fp32 scalar, this rank's summed token losses.
    n_valid: integer scalar, this rank's count of labels != IGNORE_INDEX.
    num_items_in_batch: the denominator instead of the sequence's own count: the valid labels of every sequence of
      the optimizer step (token weighting across accumulation and DP, as transformers' Trainer passes it), or those
      per sequence where DeepSpeed then averages over the step's sequences (the main job, docs/weighting.md).
    Returns (loss, n_valid_total). A sequence with no valid label gives loss 0 with zero gradients.
    No host sync: counts stay on the device.
    """
    n_total = n_valid.detach().to(torch.float32).clone()
    if layout.sp_size > 1:
        dist.all_reduce(n_total, group=layout.sp_group)
        loss_sum = _SumOverGroup.apply(loss_sum, layout.sp_group)
    denominator = n_total if num_items_in_batch is None else torch.as_tensor(
        num_items_in_batch, dtype=torch.float32, device=n_total.device)
    # No label at all (then every loss sum is 0): 0, not 0 / 0. A given count may be a fraction (labels per sequence).
    return loss_sum / torch.where(denominator > 0, denominator, torch.ones_like(denominator)), n_total


def step_num_items(labels: list, layout: ParallelLayout, device=None, across_dp: bool = True) -> torch.Tensor:
    """The valid labels of the optimizer step, for token weighting (`num_items_in_batch`, docs/weighting.md).

    labels: this rank's slices of its micro steps' shifted labels (ShardedBatch.labels, each != IGNORE_INDEX a target).
    Summed over the SP group (the slices of each sequence) and, across_dp, over the DP groups too (transformers'
    average_tokens_across_devices). Collective over those ranks; an int64 scalar on `device` (default: the labels').
    """
    count = sum((labels_bs != IGNORE_INDEX).sum() for labels_bs in labels)
    count = torch.as_tensor(count, dtype=torch.int64, device=device if device is not None else labels[0].device)
    if (layout.world_size if across_dp else layout.sp_size) > 1:
        dist.all_reduce(count, group=layout.world_group if across_dp else layout.sp_group)
    return count
