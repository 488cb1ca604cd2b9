"""Run each decoder layer's MLP over tiles of the sequence so its wide intermediate never exists whole.

Legend (shape.py): b batch, s_local this rank's sequence, e hidden size, i MLP intermediate width per token
(for MoE: experts per token x expert width), c tokens in one tile (s_local split into `num_tiles` tiles, the
last possibly shorter).

Why: at long sequence the dense MLP builds four [b, s_local, i] tensors (gate, act(gate), up, their
product) and keeps them for backward; with i = 3.8 e (Qwen3-4B) that is ~15x the layer input.
An MLP acts on each token on its own, so computing it tile by tile along s is exact. That also
holds for a sparse MoE block: routing is per token (top-k over that token's router logits), so
a token's output does not depend on which other tokens share its tile.

Tile rule: tiles = ceil(4 i / e), but no tile longer than MAX_TILE_TOKENS or shorter than MIN_TILE_TOKENS. A tile's backward
holds about four to six [c, i] tensors at once (gate, up, act(gate), their product and their
gradients), so a tile intermediate of a quarter of the layer input [s_local, e] keeps the MLP's working
set near one layer input. The first rule, ceil(i / e), left 3 tiles of [s_local/3, i] on the Qwen3-0.6B
shape: measured on an H200 at 256k it removed only 16 of the ~70 KB per token that one layer's
recompute and backward hold (BENCHMARKS.md). The floor keeps each tile's matmuls large enough to
run at full rate. Every rank of an SP group holds the same s, so they agree without a collective.

Backward: each tile is recomputed under enable_grad and autograd runs through it. For an MLP of gated-SiLU form
(Qwen3, Llama, Mistral) whose down projection is a plain nn.Linear, the recompute stops before the down projection's
forward (`_DownGradOnly`: its gradients from its input and the incoming gradient, as nn.Linear's backward makes them):
8 of the 9 matmuls a tile's recompute and backward would run (SKIP_DOWN_FORWARD).

ZeRO-3: each TiledMLP makes itself a ZeRO-3 leaf module through DeepSpeed's public `set_z3_leaf_module` (the
one-module form of `set_z3_leaf_modules`), before `deepspeed.initialize` registers its hooks. What that buys,
read off DeepSpeed 0.19's `parameter_offload._register_deepspeed_module` and
`stage3.create_reduce_and_remove_grad_hooks`:
  - gathering: the inner Linear layers are not registered as DeepSpeed modules, so they get no hooks; the leaf's
    own pre-forward and pre-backward hooks fetch all of its parameters (recursively), once for the whole tile loop.
    `deepspeed.zero.GatheredParameters` around the loop is not enough: registered inner modules' post-forward hooks
    would release the weights after every tile and the next tile would gather them again;
  - reduction: a leaf's parameters get no per-parameter gradient hook. One full backward hook on the leaf reduces
    them (zero-filling any left without a gradient) when the leaf's input gradient exists, which is when
    TiledMLPFunction.backward returns, after its last tile: every tile's gradient has been accumulated by then.
We also keep `ds_grad_is_ready = False` until the last tile, the flag DeepSpeed's own TiledMLP sets and
`reduce_ready_partitions_and_remove_grads` reads, so a per-parameter hook, were one registered, would wait too.
"""

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.autograd.function import once_differentiable

from ..handle import Handle
from ..layers import decoder_layers
from .swiglu import fused_forward, fused_product, gated_silu_form, runs_on as swiglu_runs_on
from ..shape import text_config


MIN_TILE_TOKENS = 1024
# torch's non-reentrant checkpoint (early stop on, its default) ends a layer's recompute by raising this from the pack
# hook of the last tensor the layer's forward saved. Where that is a TiledMLP's input (layers whose MLP output only
# feeds the residual add: Qwen3, Llama, Mistral, gpt-oss; not Gemma 3, whose post-MLP norm saves it), the MLP's output
# in the recompute is never read: computing it there was a third MLP forward per checkpointed layer, about 0.7 s of the
# Qwen3-4B step at 128k (21 checkpointed layers x 19.6 TFLOP at ~610 TF/s). TiledMLP learns it on the first recompute
# that stops there and from then on defers the forward's tiles until the Function is built (`deferred`), so a recompute
# that stops there skips them and every other call computes them as before (the same tiles, the same RNG state).
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
# At millions of tokens a quarter of the layer input is still gigabytes: on the Llama-3.1-8B shape at sp 8 and 5.5M
# tokens a tile of s_local / 14 holds six [c, i] of 8.5 GB, and a checkpointed layer's MLP backward then peaks above
# its attention backward (plan/memory.py). No tile longer than this: 1.5 GB there, and matmuls of 16k rows still run
# at full rate.
MAX_TILE_TOKENS = 16384
# The backward's recompute of an MLP of gated-SiLU form whose down projection is a plain nn.Linear builds the down
# projection's gradients without computing its output (_DownGradOnly). False recomputes the whole MLP forward, as
# before 2026-12-07 (an A/B switch for benchmarks and tests).
SKIP_DOWN_FORWARD = True


def auto_num_tiles(seq_len: int, hidden_size: int, intermediate_size: int) -> int:
    """Tiles so that one tile's [t, intermediate] is about a quarter of the layer input [s, hidden], and no tile
    longer than MAX_TILE_TOKENS."""
    by_width = max(math.ceil(4 * intermediate_size / hidden_size), math.ceil(seq_len / MAX_TILE_TOKENS))
    return max(1, min(by_width, math.ceil(seq_len / MIN_TILE_TOKENS)))


def _tile_bounds(seq_len: int, num_tiles: int) -> list[tuple[int, int]]:
    step = math.ceil(seq_len / num_tiles)
    return [(start, min(start + step, seq_len)) for start in range(0, seq_len, step)]


class TiledMLPFunction(torch.autograd.Function):
    """y_bse = mlp(x_bse), computed tile by tile along s.

    Forward communicates nothing and runs under no_grad, so no tile's intermediates outlive it;
    the output is preallocated and filled tile by tile.
    Saved for backward: only x_bse (through save_for_backward, so activation checkpointing and
    offload hooks see it), on x's device, and the RNG state the forward started from (host). The
    `params` inputs are passed only so that autograd calls backward when a parameter, but not x,
    needs a gradient; nothing is saved for them.
    Backward communicates nothing itself: it recomputes each tile under enable_grad (with the backward's
    callable where a pair is given) and runs autograd through it, which accumulates every parameter's .grad
    across tiles and writes the tile's input gradient into a preallocated grad_x_bse. It replays the tiles
    from the forward's RNG state (in a forked RNG, so the caller's stream is untouched): a dropout inside the
    MLP (a LoRA adapter's) draws the same masks as in the forward, as torch's checkpoint does for layers.

    With `router` (a RouterLoss, objectives/router_loss.py; mask_bs the rows it counts, kept as an attribute, on
    its device) each tile runs inside a tally of its own and the outputs also carry the layer's router sums
    (probabilities, with a gradient; assignments and rows, without); backward sends the probabilities' gradient
    into each tile's recompute beside the tile's output gradient.
    """

    @staticmethod
    def forward(ctx, mlp, x_bse: torch.Tensor, num_tiles: int, router, mask_bs, deferred,
                *params: torch.Tensor):
        # mlp: a callable, or (the forward's, the backward's recompute) where the backward's may skip work whose
        # output its gradient does not need (TiledMLP: the down projection's forward, `_DownGradOnly`).
        mlp, ctx.mlp = mlp if isinstance(mlp, tuple) else (mlp, mlp)
        ctx.num_tiles = num_tiles
        ctx.params = params
        ctx.router, ctx.mask_bs = router, mask_bs  # attributes, not saved tensors: a recompute passes no mask
        ctx.save_for_backward(x_bse)
        ctx.rng = _rng_state(x_bse.device)
        if deferred is not None:  # (dtype, trailing shape) of y: the caller runs the tiles into it once built
            dtype, trailing = deferred
            return x_bse.new_empty((x_bse.shape[0], x_bse.shape[1], *trailing), dtype=dtype)
        y_bse, sums = run_tiles(mlp, x_bse, num_tiles, router, mask_bs)
        if sums is None:
            return y_bse
        ctx.mark_non_differentiable(*sums[1:])
        return (y_bse, *sums)

    @staticmethod
    def backward(ctx, grad_y_bse, grad_probs_e=None, *_grad_counts):
        (x_bse,) = ctx.saved_tensors
        need_grad_x = ctx.needs_input_grad[1]
        grad_x_bse = torch.empty_like(x_bse) if need_grad_x else None
        bounds = _tile_bounds(x_bse.shape[1], ctx.num_tiles)
        zero3_params = [p for p in ctx.params if hasattr(p, "ds_id")]
        cuda = [x_bse.device] if x_bse.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            _set_rng_state(ctx.rng, x_bse.device)
            for tile, (start, end) in enumerate(bounds):
                # ZeRO-3 reduces a gradient as soon as its hook fires unless told to wait.
                for param in zero3_params:
                    param.ds_grad_is_ready = tile == len(bounds) - 1
                x_bce = x_bse[:, start:end].detach().contiguous().requires_grad_(need_grad_x)
                with torch.enable_grad(), _tile_tally(ctx.router, ctx.mask_bs, start, end) as tally:
                    y_bce = ctx.mlp(x_bce)
                # The router loss's gradient enters each tile's routers with the tile's own (its probability sums
                # are a sum over tiles).
                pairs = [(y_bce, grad_y_bse[:, start:end])]
                if tally is not None and grad_probs_e is not None:
                    pairs.append((tally.probs_e, grad_probs_e))
                pairs = [(out, grad) for out, grad in pairs if out.requires_grad]
                if pairs:
                    torch.autograd.backward(*zip(*pairs))
                if need_grad_x:
                    grad_x_bse[:, start:end] = x_bce.grad if x_bce.grad is not None else 0
        return (None, grad_x_bse, None, None, None, None) + (None,) * len(ctx.params)


class _DownGradOnly(torch.autograd.Function):
    """The down projection in a tile's backward recompute: y = p W^T + b's gradients without computing y.

    Why: the tiled backward recomputes a tile under enable_grad only to run autograd through it; the down
    projection's output is never read there (its gradient comes from outside), yet computing it is 2 c i e FLOPs, a
    ninth of the tile's backward matmuls: 6.5 TFLOP a layer on the Qwen3-4B shape at 128k; 0.59 s of that step over
    36 layers on an H100 (BENCHMARKS.md). The forward returns an uninitialised [.., e] (never read: the only use of
    the recompute's output is autograd.backward from the incoming gradient); the backward is nn.Linear's: dp = dy W,
    dW = dy^T p, db = the sum of dy, so the gradients and their accumulation into .grad (hooks, ZeRO-3's flags) are
    autograd's own.
    """

    @staticmethod
    def forward(ctx, p, weight, bias):
        ctx.save_for_backward(p, weight)
        ctx.has_bias = bias is not None
        return p.new_empty((*p.shape[:-1], weight.shape[0]))

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        p, weight = ctx.saved_tensors
        dy2, p2 = dy.reshape(-1, dy.shape[-1]), p.reshape(-1, p.shape[-1])
        dp = torch.mm(dy2, weight).view(p.shape) if ctx.needs_input_grad[0] else None
        dw = torch.mm(dy2.t(), p2) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dp, dw, db


def _plain_linear(module: nn.Module) -> bool:
    """nn.Linear's own forward with no module hooks: `_DownGradOnly` may stand in for it (a LoRA or quantised
    layer, or one whose hooks act on its output, keeps its own forward)."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and not module._forward_hooks and not module._forward_pre_hooks)


def run_tiles(mlp: Callable, x_bse: torch.Tensor, num_tiles: int, router=None, mask_bs=None, out_bse=None):
    """(y_bse, the tiles' router sums or None): mlp over x_bse tile by tile, into out_bse where given."""
    y_bse, sums = out_bse, None  # the router sums: probabilities, assignments, rows
    for start, end in _tile_bounds(x_bse.shape[1], num_tiles):
        with _tile_tally(router, mask_bs, start, end) as tally:
            # contiguous: MLPs such as Qwen3-MoE's view the tile as [b * c, e].
            y_bce = mlp(x_bse[:, start:end].contiguous())
        if tally is not None:
            tile = (tally.probs_e, tally.counts_e, tally.rows)
            sums = tile if sums is None else tuple(a + b for a, b in zip(sums, tile))
        if y_bse is None:
            y_bse = y_bce.new_empty((x_bse.shape[0], x_bse.shape[1], *y_bce.shape[2:]))
        y_bse[:, start:end] = y_bce
    return y_bse, sums


def _tile_tally(router, mask_bs, start: int, end: int):
    """The tally a tile's routers add to (router_loss.py), with the tile's rows of the mask; nothing without one."""
    if router is None:
        return contextlib.nullcontext()
    return router.tally(None if mask_bs is None else mask_bs[:, start:end])


def _rng_state(device: torch.device):
    """The CPU generator's state, and the device's where the MLP runs on CUDA (host-side reads, no sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class TiledMLP(nn.Module):
    """Wraps a decoder layer's MLP (kept as `.mlp`) and runs it tile by tile along the sequence.

    `intermediate_size` is the per-token intermediate width that sets the automatic tile count;
    `num_tiles` overrides it. state_dict keys are those of the wrapped MLP, so checkpoints saved
    with the wrapper installed load into the plain model and back.
    """

    def __init__(self, mlp: nn.Module, intermediate_size: int, num_tiles: int | None = None, router=None,
                 fused_swiglu: bool = False):
        super().__init__()
        if num_tiles is not None and num_tiles < 1:
            raise ValueError(f"num_tiles must be >= 1 or None (automatic), got {num_tiles}.")
        self.mlp = mlp
        self.intermediate_size = intermediate_size
        self.num_tiles = num_tiles
        self.router = router  # a RouterLoss whose routers run in this MLP (router_loss.py), or None
        # Its forward is down(silu(gate(x)) * up(x)) (checked once here, on a stand-in): its tiles' silu(gate) * up
        # may run as swiglu.py's kernels, and its backward's recompute may skip the down projection's forward.
        self.gated_silu = gated_silu_form(mlp)
        self.fused_swiglu = bool(fused_swiglu) and self.gated_silu
        # A checkpoint recompute stopped right after this MLP (_STOP_RECOMPUTATION): its later calls defer the tiles.
        self.recompute_stops_here = False
        self._output = None  # (inputs' key, y dtype, y's trailing shape) of the last computed call
        from deepspeed.utils import set_z3_leaf_module

        set_z3_leaf_module(self, True)  # module docstring: one gather per layer, one reduction after the last tile
        self.register_state_dict_post_hook(_drop_wrapper_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapper_prefix)

    def forward(self, x_bse: torch.Tensor) -> torch.Tensor:
        if x_bse.dim() != 3:
            raise ValueError(f"TiledMLP expects hidden states [batch, seq, hidden], got shape {tuple(x_bse.shape)}.")
        seq_len, hidden_size = x_bse.shape[1], x_bse.shape[2]
        num_tiles = self.num_tiles or auto_num_tiles(seq_len, hidden_size, self.intermediate_size)
        num_tiles = min(num_tiles, seq_len)
        if num_tiles <= 1:
            return self.mlp(x_bse)
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        returns_tuple = []
        fused = self.fused_swiglu and swiglu_runs_on(x_bse.device)  # every tile is on x's device

        def recompute(x_bce):  # the backward's: the down projection's gradients without its output (_DownGradOnly)
            inner, down = self.mlp, self.mlp.down_proj
            if fused:
                p_bci = fused_product(inner, x_bce)
            else:  # the MLP's own ops (its forward is this form: gated_silu_form)
                p_bci = inner.act_fn(inner.gate_proj(x_bce)) * inner.up_proj(x_bce)
            if p_bci.dtype != down.weight.dtype:  # autocast, or weights kept in another dtype: nn.Linear's own path
                return down(p_bci)
            return _DownGradOnly.apply(p_bci, down.weight, down.bias)

        def mlp(x_bce):
            if fused:
                return fused_forward(self.mlp, x_bce)
            # gpt-oss's MoE block returns (hidden, router scores); its decoder layer drops the scores (the router
            # loss reads the router's own output, through the RouterLoss hooks).
            y = self.mlp(x_bce)
            if isinstance(y, tuple):
                returns_tuple.append(True)
                return y[0]
            return y

        skip_down = SKIP_DOWN_FORWARD and self.gated_silu and self.router is None and _plain_linear(self.mlp.down_proj)
        tiles = (mlp, recompute) if skip_down else mlp  # TiledMLPFunction's: the forward's, the backward's
        if self.router is not None:
            outer = self.router.active  # the forward's tally; None in a checkpoint's recompute
            y_bse, *sums = TiledMLPFunction.apply(tiles, x_bse, num_tiles, self.router,
                                                  None if outer is None else outer.mask_bs, None, *params)
            if outer is not None:
                outer.add(*sums)
            return (y_bse, None) if returns_tuple else y_bse
        # What sets y's dtype: x's and autocast's (a recompute runs under the forward's autocast state)
        key = (x_bse.dtype, torch.is_autocast_enabled(x_bse.device.type), torch.get_autocast_dtype(x_bse.device.type))
        known = self._output
        deferred = (known[1], known[2]) if self.recompute_stops_here and known and known[0] == key else None
        try:
            y_bse = TiledMLPFunction.apply(tiles, x_bse, num_tiles, None, None, deferred, *params)
        except Exception as e:
            if _STOP_RECOMPUTATION is not None and isinstance(e, _STOP_RECOMPUTATION):
                self.recompute_stops_here = True  # the recompute needs nothing of this call past its input
            raise
        if deferred is None:
            self._output = (key, y_bse.dtype, tuple(y_bse.shape[2:]))
        else:  # not a recompute that stops here (a forward, or a layer whose later ops save): the tiles, as before
            with torch.no_grad():
                run_tiles(mlp, x_bse, num_tiles, out_bse=y_bse)  # its tiles tell returns_tuple too
        return (y_bse, None) if returns_tuple else y_bse

    def extra_repr(self) -> str:
        fused = ", fused_swiglu=True" if self.fused_swiglu else ""
        return f"intermediate_size={self.intermediate_size}, num_tiles={self.num_tiles or 'auto'}{fused}"


def plain_parameter_name(name: str) -> str:
    """A parameter name under a model with TiledMLP installed -> the plain model's name (the wrapper keeps the
    MLP as `.mlp`, so `layers.0.mlp.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`); names already plain
    pass unchanged. The one rule behind SequenceParallelCausalLM.plain_name; the state-dict hooks below apply it
    to state_dict() and load_state_dict()."""
    return name.replace(".mlp.mlp.", ".mlp.")


def _drop_wrapper_prefix(module, state_dict, prefix, local_metadata):
    inner = prefix + "mlp."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    inner = prefix + "mlp."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _mlp_width(mlp: nn.Module, config) -> int:
    """Per-token intermediate width of a dense MLP or a sparse MoE block."""
    width = getattr(mlp, "intermediate_size", None)
    if isinstance(width, int):
        return width
    experts_per_token = getattr(config, "num_experts_per_tok", None)
    expert_width = getattr(config, "moe_intermediate_size", None)
    if experts_per_token and expert_width is None and getattr(config, "num_local_experts", None):
        expert_width = config.intermediate_size  # gpt-oss: each expert is intermediate_size wide
    if experts_per_token and expert_width:
        return experts_per_token * expert_width + (getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return config.intermediate_size


def install_tiled_mlp(
    model: nn.Module, num_tiles: int | None = None, router=None, fused_swiglu: bool = False
) -> Handle:
    """Wrap every decoder layer's `.mlp` in a TiledMLP; the Handle's undo() restores them.

    Call it before `deepspeed.initialize`: ZeRO-3 registers its gather hooks then, and needs to
    see the TiledMLP wrappers as leaf modules.
    router: the model's RouterLoss (objectives/router_loss.py), required when config.output_router_logits is on.
    fused_swiglu: the tiles of gated-SiLU MLPs run silu(gate) * up as one Triton kernel each way where it runs
    (swiglu.py: CUDA); other MLPs and devices run their own forward.
    """
    layers = decoder_layers(model, "tiled MLP")
    config = model.config
    if router is None and getattr(text_config(config), "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits=True: the router auxiliary loss needs the router logits with their "
            "graph, which the tiled forward (run under no_grad) does not keep, and transformers' own forward would "
            "read them so. SequenceParallelCausalLM computes that loss with tiles (pass it router=its RouterLoss "
            "here); else set output_router_logits=False or do not tile this MoE model's MLPs."
        )
    if any(hasattr(layer, "ds_id") for layer in layers):
        raise ValueError(
            "the model is already wrapped by deepspeed.initialize; call install_tiled_mlp before it so ZeRO-3 "
            "registers the TiledMLP wrappers as leaf modules (one weight gather per layer, not per tile)."
        )
    originals = []
    for layer in layers:
        mlp = layer.mlp
        if isinstance(mlp, TiledMLP):
            raise ValueError("tiled MLP is already installed; call the undo returned by the first install.")
        originals.append(mlp)
        layer.mlp = TiledMLP(mlp, _mlp_width(mlp, config), num_tiles,
                             router if router is not None and router.owns(mlp) else None, fused_swiglu)

    def undo():
        for layer, mlp in zip(layers, originals):
            layer.mlp = mlp

    return Handle(undo, "tiled MLP")


__all__ = ["SKIP_DOWN_FORWARD", "TiledMLP", "TiledMLPFunction", "auto_num_tiles", "install_tiled_mlp",
           "plain_parameter_name"]
