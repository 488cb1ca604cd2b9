"""Ulysses attention: all-to-all from "slice of the sequence, all heads" to "whole sequence, some heads".

Legend: shape.py. Transformers calls an attention function with q [b, h, s_local, d] and k, v
[b, h_kv, s_local, d] (rotary already applied with *global* position ids, see sharding.py) and expects
[b, s_local, h, d] back. `UlyssesAttention` exchanges q, k, v to [b, h_local, s, d] (exchange.py), runs
causal attention over the whole sequence (kernels.py), and exchanges the output back. After the exchange the
sequence is in global order, so the causal kernel's `is_causal` mask is exactly "key position <= query
position": causality comes from global positions, never from a dense mask.

Sliding-window layers (the `sliding_window` kwarg transformers passes: Mistral, Gemma 3, gpt-oss, Qwen3 with
use_sliding_window) and attention sinks (gpt-oss's `s_aux`, this rank's heads of it) run after the same exchange
through window_attention.py: the window and the sink are per head along the sequence, which each rank holds whole.

Inside a checkpointed layer that keeps its attention output (recompute.py: the `RecomputeContext` handed in
by checkpointing), the forward keeps the kernel's output and log-sum-exp, and the recompute hands them back
instead of running the kernel again (`kept_output_attention`).
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch

from ..parallel.exchange import heads_to_seq, qkv_seq_to_heads, replicate_kv_heads
from ..handle import Handle
from .fa4 import check_fa4
from .explicit_attention import (
    ExplicitAttention, attention_head_groups, check_head_groups, explicit_attention, keeps_attention_outputs,
    splits_heads, valid_head_groups,
)
from .kernels import KERNELS, causal_attention, document_attention, flash_attn_func, resolve_kernel
from ..parallel.layout import ParallelLayout, check_heads
from .linear_attention import LINEAR_MODEL_TYPES, check_linear_heads, install_linear_attention
from ..recompute import LayerRun, RecomputeContext
from ..shape import ModelShape, text_config
from ..parallel.sharding import check_document_bounds
from .window_attention import window_attention

logger = logging.getLogger(__name__)
_instance_ids = itertools.count()

_MASK_REFUSED = (
    "Ulysses attention computes causality from global positions and cannot apply an attention_mask "
    "(padding or packed documents would be silently attended to by the causal kernel). Pass "
    "attention_mask=None, pad at the end and mark padded labels with IGNORE_INDEX (see shard_batch)."
)



def kept_output_bytes_per_token(shape: ModelShape) -> int:
    """Bytes a layer that keeps its attention output holds per token until its recompute: the bf16 output
    (h x d x 2) and the fp32 log-sum-exp (h x 4)."""
    return 2 * shape.q_width + 4 * shape.heads


def kept_output_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel: str, run: LayerRun, groups: int = 1):
    """Causal attention in a checkpointed layer that keeps its output, or None when no explicit backend takes
    this shape (the caller then runs `causal_attention`, in the forward and again in the recompute).

    Forward: run the kernel through an explicit backend and keep its output and log-sum-exp in `run`
    (`run.stash`: host memory when the layer is offloaded). Recompute: hand them back; the kernel's backward
    op then reads them as if the forward had just run, so the numbers are the forward's own, bitwise."""
    if run.is_recompute:
        if run.kept_attention is None:
            return None
        backend, out_token, lse_token, aux = run.kept_attention
        kept = (run.unstash(out_token), run.unstash(lse_token), aux)
        # Drop the run's references: the graph (and with it the run) can outlive the backward, e.g. while a
        # loop holds its last loss into the next forward, and a device-kept output would stay.
        run.kept_attention = None
        return ExplicitAttention.apply(q_bhsd, k_bhsd, v_bhsd, scaling, backend, len(aux), kept, None)
    sink = []
    out = explicit_attention(q_bhsd, k_bhsd, v_bhsd, scaling, kernel, groups, sink)
    if out is not None:
        backend, kept_out, lse, aux = sink[0]
        run.kept_attention = (backend, run.stash(kept_out), run.stash(lse), aux)
    return out


class UlyssesAttention:
    """A transformers attention function running Ulysses sequence parallelism over `layout`'s SP group.

    `install(model)` registers it with transformers' AttentionInterface under its own name and points the
    model at it; the returned Handle's `undo()` restores the model's implementation and unregisters it.
    Another implementation's entry is never overwritten.

    kernel: one of KERNELS ("auto": FlashAttention-4 on Hopper where installed and measured faster, decided at
        `install` from the model's head dim, else cuDNN-first SDPA; "fa4": FlashAttention-4 for every layer type).
    head_groups: run the kernel over this many groups of kv heads, one after another ("auto": the fewest that
        keep its backward's own block under 1 GiB, CUDA only; kernels.attention_head_groups).
    recompute: the RecomputeContext that checkpointing was given; layers it runs with `keep_attention` keep
        their attention output for the recompute. None: every recompute runs the kernel again.
    """

    def __init__(
        self, layout: ParallelLayout, kernel: str = "auto", name: str | None = None, head_groups: int | str = "auto",
        recompute: RecomputeContext | None = None,
    ):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; pick one of {KERNELS}.")
        if not valid_head_groups(head_groups):
            raise ValueError(f"head_groups must be 'auto' or an int >= 1, got {head_groups!r}.")
        self.asked = kernel
        kernel = resolve_kernel(kernel)
        if kernel.startswith("flash"):
            flash_attn_func(kernel)  # fail now, not at the first layer
            if head_groups not in ("auto", 1):
                raise ValueError(
                    f"head_groups={head_groups} needs a kernel whose forward and backward we call ourselves "
                    f"(kernel='auto', 'cudnn', 'sdpa' or 'fa4'); {kernel!r} runs over all heads at once."
                )
        elif kernel == "fa4":
            check_fa4()  # fail now, not at the first layer
        self.layout = layout
        self.kernel = kernel
        self.head_groups = head_groups
        self.recompute = recompute
        # One entry per instance: two models in one process (say, a policy and a reference) may differ. No "sdpa"
        # in the name: transformers checks a model's own SDPA support for any name containing it, and gpt-oss has
        # none (its sinks), though Ulysses attention computes them.
        self.instance = next(_instance_ids)
        self.named = name
        self.name = name or self._default_name()
        # False once SequenceParallelCausalLM.probe_attention found no explicit kernel for this model's call:
        # the plan then counts no kept outputs or head groups (fallbacks.py).
        self.explicit_ok = True
        # The packed batch's borders while SequenceParallelCausalLM.hidden_states runs a forward (None: unpacked):
        # each call checks that transformers' layer kwargs brought them here.
        self.expected_bounds = None
        logger.info("ulysses_lc attention: kernel %s, sp_size %d", kernel, layout.sp_size)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, document_bounds=None,
                 **kwargs):
        if attention_mask is not None:
            raise ValueError(_MASK_REFUSED)
        check_document_bounds(self.expected_bounds, document_bounds, module)
        if kwargs.get("softcap") is not None:
            raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} soft-caps its attention logits "
                             f"(softcap={kwargs['softcap']}), which no kernel here computes at any sp; train this model "
                             "without ulysses_lc, or set config.attn_logit_softcapping=None (a model change).")
        sp = self.layout.sp_size
        key = replicate_kv_heads(key, sp)
        value = replicate_kv_heads(value, sp)
        q, k, v = qkv_seq_to_heads(query, key, value, self.layout)
        dropout = dropout if module.training else 0.0
        window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
        if window is not None and window >= q.shape[2]:
            window = None  # the window holds the whole sequence: plain causal attention
        if window is not None or sinks is not None:
            if dropout:
                raise ValueError(f"attention dropout {dropout} in a sliding-window or sink layer: the window kernels "
                                 "run without dropout; set config.attention_dropout=0.")
            if sinks is not None:  # this rank's heads of the per-head sink logits (exchange.py: contiguous blocks)
                h_local = q.shape[1]
                sinks = sinks[self.layout.sp_rank * h_local:(self.layout.sp_rank + 1) * h_local]
            if document_bounds is not None:
                out = document_attention(q, k, v, document_bounds, scaling, self.kernel, window=window, sinks_h=sinks)
            else:
                out = self.window_call(module, q, k, v, scaling, window, sinks)
            return heads_to_seq(out, self.layout).transpose(1, 2), None
        if document_bounds is not None:
            # Packed documents (sharding.py): the whole sequence's boundaries, the same on every rank.
            out = document_attention(q, k, v, document_bounds, scaling, self.kernel, dropout)
            return heads_to_seq(out, self.layout).transpose(1, 2), None
        groups = self.groups_for(q, k)
        out = None
        run = self.recompute.running(getattr(module, "layer_idx", None)) if self.recompute is not None else None
        if run is not None and run.keep_attention and torch.is_grad_enabled() and not dropout:
            out = kept_output_attention(q, k, v, scaling, self.kernel, run, groups=groups)
        elif groups > 1 and not dropout:
            out = explicit_attention(q, k, v, scaling, self.kernel, groups)
        if out is None:
            out = causal_attention(q, k, v, scaling, self.kernel, dropout)
        out_bshd = heads_to_seq(out, self.layout).transpose(1, 2)
        return out_bshd, None

    def window_call(self, module, q, k, v, scaling, window, sinks):
        """A window or sink layer (window_attention.py); inside a checkpointed layer that keeps its attention
        output, the forward keeps out and the final log-sum-exp in its LayerRun and the recompute hands them back."""
        run = self.recompute.running(getattr(module, "layer_idx", None)) if self.recompute is not None else None
        if run is None or not run.keep_attention or not torch.is_grad_enabled():
            return window_attention(q, k, v, scaling, window, sinks, self.kernel)
        if run.is_recompute:
            if run.kept_attention is None:
                return window_attention(q, k, v, scaling, window, sinks, self.kernel)
            how, backend, out_token, lse_token, aux = run.kept_attention
            run.kept_attention = None  # as in kept_output_attention: the graph can outlive the backward
            kept = (how, backend, (run.unstash(out_token), run.unstash(lse_token), aux))
            return window_attention(q, k, v, scaling, window, sinks, self.kernel, kept=kept)
        got = []
        out = window_attention(q, k, v, scaling, window, sinks, self.kernel, sink_list=got)
        how, backend, (kept_out, lse, aux) = got[0]
        run.kept_attention = (how, backend, run.stash(kept_out), run.stash(lse), aux)
        return out

    def groups_for(self, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor) -> int:
        """Head groups for one call on this rank's [b, h_local, s, d] q and k (explicit_attention.py): 1 where the
        kernel is not ours to call or there is no backward (evaluation, inference), `head_groups` when set,
        else `attention_head_groups` from the shapes, per sequence in the batch, on CUDA only (the CPU
        kernel holds no such block)."""
        if not keeps_attention_outputs(self.kernel) or not torch.is_grad_enabled():
            return 1
        if self.head_groups != "auto":
            check_head_groups(q_bhsd, k_bhsd, self.head_groups)
            return self.head_groups
        if q_bhsd.device.type != "cuda":
            return 1
        b, h, s, d = q_bhsd.shape
        return attention_head_groups(b * s, h, k_bhsd.shape[1], d)

    # -- registration -------------------------------------------------------------------------
    def register(self) -> "UlyssesAttention":
        from transformers import AttentionInterface

        current = AttentionInterface._global_mapping.get(self.name)
        if current is not None and current is not self:
            raise ValueError(
                f"an attention implementation named {self.name!r} is already registered by someone else; "
                "pass another name=... to UlyssesAttention."
            )
        AttentionInterface.register(self.name, self)
        return self

    def unregister(self) -> None:
        from transformers import AttentionInterface

        if AttentionInterface._global_mapping.get(self.name) is self:
            del AttentionInterface._global_mapping[self.name]

    def _default_name(self) -> str:
        return f"ulysses_lc_{self.kernel.replace('sdpa', 'torch')}_{self.instance}"

    def install(self, model) -> Handle:
        """Check the model and switch its attention to this implementation; returns a Handle to undo it."""
        check_model_for_ulysses(model.config, self.layout.sp_size)
        if self.asked == "auto":  # FlashAttention-4 where it was measured faster for this model's heads
            cfg = text_config(model.config)
            kernel = resolve_kernel("auto", ModelShape.from_config(cfg).head_dim, getattr(cfg, "attention_dropout", 0))
            if kernel != self.kernel:
                self.kernel = kernel
                self.name = self.named or self._default_name()
                logger.info("ulysses_lc attention: kernel auto takes %s for this model's heads", kernel)
        if self.head_groups != "auto":
            shape = ModelShape.from_config(model.config)
            sp = self.layout.sp_size
            local_kv, local_q = shape.local_kv_heads(sp), shape.local_heads(sp)
            if not splits_heads(local_q, local_kv, self.head_groups):
                raise ValueError(
                    f"head_groups={self.head_groups} must divide the kv heads each rank runs, or be a multiple of them "
                    f"dividing its query heads: {shape.kv_heads} kv / {shape.heads} query heads over sp_size {sp} = "
                    f"{local_kv} / {local_q}; pick a divisor of {local_kv}, a multiple of it dividing {local_q}, or "
                    "head_groups='auto'."
                )
        linear = install_linear_attention(model, self.layout, borders=self)
        self.register()
        previous = model.config._attn_implementation
        _set_attn(model, self.name)
        check = functools.partial(_check_model_inputs, sp_size=self.layout.sp_size)
        hook = model.base_model.register_forward_pre_hook(check, with_kwargs=True)

        def undo():
            hook.remove()
            _set_attn(model, previous)
            self.unregister()
            linear.undo()

        handle = Handle(undo, f"ulysses attention ({self.kernel})")
        handle.attention, handle.linear = self, linear
        return handle


def install_ulysses_attention(
    model, layout: ParallelLayout, kernel: str = "auto", *, head_groups: int | str = "auto",
    recompute: RecomputeContext | None = None,
) -> Handle:
    """Switch `model`'s attention to Ulysses attention over `layout` (see UlyssesAttention); the Handle's
    `.attention` is the attention function, `undo()` restores the model's own."""
    return UlyssesAttention(layout, kernel, head_groups=head_groups, recompute=recompute).install(model)


def _check_model_inputs(module, args, kwargs, sp_size):
    # transformers drops a 2D attention_mask on its way to a custom attention function: refuse it here,
    # or padding would silently be attended to.
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None:
        raise ValueError(_MASK_REFUSED)
    # Without position ids every rank would number its slice from 0: wrong rotary phases, silently.
    if sp_size > 1 and kwargs.get("position_ids") is None and len(args) < 3:
        raise ValueError(
            "position_ids are required under sequence parallelism: each rank holds a slice of the sequence and "
            "needs its global positions; build the batch with ulysses_lc.shard_batch()."
        )


def _set_attn(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - transformers without the public setter
        model.config._attn_implementation = name


# Layer types Ulysses attention computes exactly: full causal, and causal over a sliding window (window_attention.py).
_EXACT_LAYER_TYPES = {"full_attention", "attention", "sliding_attention"}


def check_model_for_ulysses(config, sp_size: int) -> None:
    """Raise ValueError if this model cannot be trained exactly with Ulysses attention at sp_size.

    The attention is installed at every sp, sp 1 included, and transformers builds no mask for an attention
    function of its own: whatever it cannot compute (bidirectional or chunked layers, soft-capped logits) is refused
    at sp 1 as at sp 8, never trained as causal attention."""
    cfg = text_config(config)
    # gpt-oss has no SDPA path in transformers (its sinks), so it loads as 'eager'; Ulysses attention replaces it.
    if sp_size > 1 and cfg._attn_implementation == "eager" and not ModelShape.from_config(cfg).sinks:
        raise ValueError(
            "the model was loaded with attn_implementation='eager', whose dense masks cannot be split across "
            "ranks; load it with attn_implementation='sdpa' (ulysses_lc then switches it to Ulysses attention)."
        )
    layer_types = set(getattr(cfg, "layer_types", None) or [])
    exact = _EXACT_LAYER_TYPES | ({"linear_attention"} if cfg.model_type in LINEAR_MODEL_TYPES else set())
    refused = sorted(layer_types - exact)
    if getattr(cfg, "attention_chunk_size", None):
        refused = sorted(set(refused) | {"chunked_attention"})
    if refused:
        raise ValueError(
            f"{cfg.model_type} has layers of type {refused}, which Ulysses attention (installed at every sp, sp 1 "
            "included) would silently train as full causal attention. ulysses_lc trains full and sliding-window "
            "attention (Qwen3, Llama, Mistral, Gemma 3, gpt-oss) and gated DeltaNet layers (Qwen3.5, Qwen3-Next); "
            "train this model without ulysses_lc."
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{cfg.model_type} with use_bidirectional_attention=True attends to later tokens, which the "
                         "causal kernels here (installed at every sp, sp 1 included) do not; set "
                         "config.use_bidirectional_attention=False for a causal LM, or train this model without "
                         "ulysses_lc.")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{cfg.model_type} soft-caps its attention logits (attn_logit_softcapping="
                         f"{cfg.attn_logit_softcapping}), which no kernel here computes, at any sp; train this model "
                         "without ulysses_lc, or set config.attn_logit_softcapping=None (a model change).")
    if getattr(cfg, "attention_dropout", 0.0) and layer_types & {"sliding_attention"}:
        raise ValueError(f"attention dropout {cfg.attention_dropout} with sliding-window layers: the window kernels "
                         "run without dropout; set config.attention_dropout=0.")
    shape = ModelShape.from_config(cfg)
    check_heads(shape.heads, shape.kv_heads, sp_size)
    if "linear_attention" in layer_types and not refused:
        check_linear_heads(cfg, sp_size)


__all__ = ["UlyssesAttention", "check_model_for_ulysses", "install_ulysses_attention", "kept_output_attention",
           "kept_output_bytes_per_token"]
