"""The MoE routers' load-balancing loss over the whole sequence, as transformers adds it to the token loss.

Legend (shape.py): b batch, s_local this rank's sequence, n router rows (b x s_local, or b x c of one MLP tile),
E experts, k experts per token.

transformers 5.24's `load_balancing_loss_func` (the same text in qwen3_moe, qwen3_5_moe, qwen3_next, gpt_oss and
mixtral) takes every MoE layer's router logits [n, E] and returns
    aux = E * sum_e f_e * P_e,   f_e = A_e / R,   P_e = Q_e / R,
A_e: top-k assignments to expert e (top-k of the softmax of the logits), Q_e: the softmax probabilities of e,
R: tokens x MoE layers, each summed over every MoE layer and every counted token; the *ForCausalLM adds
router_aux_loss_coef x aux to its loss when output_router_logits is on. gpt-oss's router records its full logits
too, so one rule serves every family.

Under SP each rank holds s_local tokens, so f_e and P_e are sums over the SP group divided by its R: a product of
means over the whole sequence, not the mean of per-rank products. Each rank adds its (A_e, Q_e, R) layer by layer
as the routers run (a forward hook on each router); `RouterTally.aux_loss` sums them over the SP group, Q_e through
the differentiable sum (objectives/loss.py), so every rank holds the sequence's aux loss and the exact gradient.

Counted tokens: transformers counts every row unless attention_mask is given, then those with mask 1. Here every
token of the sequence counts and padding does not: the batch's `token_mask` (sharding.py) marks the tokens
shard_batch adds to reach a multiple of sp and those the caller's attention_mask marks 0 (the Trainer's padding,
the packing's padding segment) as padding. Packed documents count as the one row they are, as transformers' plain
forward over the packed row does (no mask there). Labels do not enter: an ignored prompt is still routed.

Per sequence: one forward, one aux term, as transformers adds one per forward; DP ranks and accumulated micro steps
each add their own sequence's, averaged as the token loss is (layout.py).

Tiled MLP (levers/tiled_mlp.py): a tile's router runs inside the tiled forward under no_grad; the tiled function
sums the tile tallies into its layer's and returns Q_e as an output of its own, whose gradient its backward sends
into each tile's recompute. The hook takes the tile's own mask from the tally the tiled function opens around it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..handle import Handle
from ..parallel.layout import ParallelLayout
from ..shape import text_config
from .loss import sp_sum


class RouterSums(torch.autograd.Function):
    """(Q_e, A_e) of one router call: the fp32 sums over the counted rows of softmax(logits_ne) and of the top-k
    assignments (A_e without gradient). The row weights (1 counted, 0 padding; None: all count) scale both sums.

    Forward communicates nothing; it follows load_balancing_loss_func (softmax in the logits' dtype, top-k of it,
    sums in fp32). Saved: logits_ne through save_for_backward (a checkpoint's recompute and offload treat it as any
    layer tensor; the same device), the weights as a plain attribute: a recompute runs outside the forward's tally,
    without weights, and must not hand back others. Backward communicates nothing: it recomputes the softmax in fp32.
    """

    @staticmethod
    def forward(ctx, logits_ne: torch.Tensor, weights_n: torch.Tensor | None, top_k: int):
        probs_ne = torch.softmax(logits_ne, dim=-1)
        chosen_nk = probs_ne.topk(top_k, dim=-1).indices
        if weights_n is None:
            weights_n = torch.ones(logits_ne.shape[0], dtype=torch.float32, device=logits_ne.device)
        counts_e = torch.zeros(logits_ne.shape[1], dtype=torch.float32, device=logits_ne.device)
        counts_e.scatter_add_(0, chosen_nk.reshape(-1), weights_n.repeat_interleave(top_k))
        probs_e = (probs_ne.float() * weights_n.unsqueeze(1)).sum(0)
        ctx.save_for_backward(logits_ne)
        ctx.weights_n = weights_n
        ctx.mark_non_differentiable(counts_e)
        return probs_e, counts_e

    @staticmethod
    def backward(ctx, grad_probs_e, _grad_counts):
        (logits_ne,) = ctx.saved_tensors
        probs_ne = torch.softmax(logits_ne.float(), dim=-1)
        # d/dlogits of sum_n w_n p_n . g = w_n p_n * (g - p_n . g)
        grad_ne = probs_ne * (grad_probs_e - probs_ne @ grad_probs_e.unsqueeze(1)) * ctx.weights_n.unsqueeze(1)
        return grad_ne.to(logits_ne.dtype), None, None


class RouterTally:
    """One forward's (or one MLP tile's) sums: Q_e (differentiable), A_e and R, and the mask of the rows it counts.

    mask_bs: [b, s] bool, True on counted tokens, for the rows the routers see while this tally is open (the
    rank's slice, or one tile of it); None: every row counts."""

    def __init__(self, mask_bs: torch.Tensor | None, num_experts: int):
        self.mask_bs = mask_bs
        self.num_experts = num_experts
        self.probs_e = self.counts_e = self.rows = None

    def weights(self, rows: int) -> torch.Tensor | None:
        if self.mask_bs is None:
            return None
        assert self.mask_bs.numel() == rows, (tuple(self.mask_bs.shape), rows)  # a router sees every open row
        return self.mask_bs.reshape(-1).to(torch.float32)

    def add(self, probs_e: torch.Tensor, counts_e: torch.Tensor, rows: torch.Tensor) -> None:
        if self.probs_e is None:
            self.probs_e, self.counts_e, self.rows = probs_e, counts_e, rows
        else:
            self.probs_e, self.counts_e, self.rows = self.probs_e + probs_e, self.counts_e + counts_e, self.rows + rows

    def aux_loss(self, layout: ParallelLayout, device: torch.device) -> torch.Tensor:
        """E * sum_e f_e * P_e over the whole sequence (the SP group), the same on every rank of it: collective."""
        if self.probs_e is None:  # no MoE layer ran
            return torch.zeros((), device=device)
        counts = torch.cat([self.counts_e, self.rows.reshape(1).to(torch.float32)])
        probs_e = self.probs_e
        if layout.sp_size > 1:
            dist.all_reduce(counts, group=layout.sp_group)
            probs_e = sp_sum(probs_e, layout)
        rows = counts[-1].clamp(min=1.0)
        return self.num_experts * ((counts[:-1] / rows) * (probs_e / rows)).sum()


class RouterLoss(Handle):
    """The routers' hooks of one model, and where they add: `tally(mask_bs)` opens the tally they add to.

    Outside a tally (a checkpoint's recompute) the hook runs the same computation, so that the recompute saves what
    the forward saved, and keeps nothing. coef: the config's router_aux_loss_coef."""

    def __init__(self, routers: list[nn.Module], index: int, num_experts: int, top_k: int, coef: float):
        self.routers = routers
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.index = index
        self.active: RouterTally | None = None
        hooks = [router.register_forward_hook(self._on_router) for router in routers]
        super().__init__(lambda: [h.remove() for h in hooks], "router load-balancing loss")

    def owns(self, module: nn.Module) -> bool:
        """Whether one of these routers runs inside `module`."""
        return any(any(m is router for router in self.routers) for m in module.modules())

    @contextlib.contextmanager
    def tally(self, mask_bs: torch.Tensor | None = None):
        """Routers add to a new RouterTally while this is open (nested: a tile's inside its forward's)."""
        outer, self.active = self.active, RouterTally(mask_bs, self.num_experts)
        try:
            yield self.active
        finally:
            self.active = outer

    def _on_router(self, module, args, output):
        logits_ne = output[self.index] if isinstance(output, tuple) else output
        tally = self.active
        weights_n = None if tally is None else tally.weights(logits_ne.shape[0])
        probs_e, counts_e = RouterSums.apply(logits_ne, weights_n, self.top_k)
        if tally is not None:
            rows = torch.full((), logits_ne.shape[0], dtype=torch.float32, device=logits_ne.device) \
                if weights_n is None else weights_n.sum()
            tally.add(probs_e, counts_e, rows)


def router_recorders(model: nn.Module) -> tuple[tuple[type, ...], int]:
    """The router classes and output index transformers records `router_logits` from (`_can_record_outputs`)."""
    from transformers.utils.output_capturing import OutputRecorder

    classes, indices = [], set()
    for module in model.modules():
        specs = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        for spec in specs if isinstance(specs, list) else [specs] if specs is not None else []:
            if not isinstance(spec, OutputRecorder) or spec.target_class is None or spec.layer_name is not None:
                raise ValueError(f"{type(module).__name__} records its router logits as {spec!r}, by name rather than "
                                 "by router class, which ulysses_lc does not read; set output_router_logits=False.")
            classes.append(spec.target_class)
            indices.add(spec.index)
    if len(indices) > 1:
        raise ValueError(f"routers record their logits at several output indices {sorted(indices)}; ulysses_lc "
                         "reads one. Set output_router_logits=False.")
    return tuple(classes), indices.pop() if indices else 0


def install_router_loss(model: nn.Module) -> RouterLoss | None:
    """Hooks on every router of `model` (a transformers *ForCausalLM) when its config has output_router_logits on;
    None when it is off (nothing installed, nothing computed). The Handle's undo() removes them."""
    config = text_config(model.config)
    if not getattr(config, "output_router_logits", False):
        return None
    classes, index = router_recorders(model)
    routers = [m for m in model.modules() if classes and isinstance(m, classes)]
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not routers or not num_experts:
        raise ValueError(f"config.output_router_logits=True but {type(model).__name__} has no router whose logits "
                         "transformers records (or no num_experts in its config); set output_router_logits=False.")
    return RouterLoss(routers, index, num_experts, config.num_experts_per_tok, config.router_aux_loss_coef)


__all__ = ["RouterLoss", "RouterSums", "RouterTally", "install_router_loss"]
