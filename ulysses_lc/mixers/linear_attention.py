"""Gated DeltaNet layers (the `linear_attention` layers of Qwen3.5, Qwen3.5-MoE, Qwen3-Next) under Ulysses, exactly.

Legend: shape.py, and for these layers hk key heads (q and k), hv value heads (each key head serves hv / hk of them,
as in GQA), dk, dv their head dims, K the causal convolution's width; hk_local, hv_local those one rank runs.

A gated DeltaNet layer projects each token (q, k, v, the gates a and b, the output gate z), runs a short causal
convolution over q, k and v along the sequence, then the gated delta rule (a recurrence along the sequence, per
value head), then a gated RMSNorm per head and the output projection. Sharding the sequence breaks the convolution
and the recurrence at every shard border. So, as for attention (exchange.py), one all-to-all after the projections
turns "slice of the sequence, all heads" into "whole sequence, some heads": each rank runs the convolution (its
heads' channels of the conv weight) and the recurrence over the whole sequence, exactly, and one all-to-all turns
the output back. The key heads are replicated when there are fewer than sp (rank r gets key head r // (sp / hk),
the one its value heads read). The gated norm and the output projection act per token and run after the exchange
back, on this rank's slice: z never travels. Packed documents (`document_bounds`, sharding.py): the convolution and
the recurrence restart at each document's start.

Kernels (`resolve_deltanet_kernel`): "fla" is flash-linear-attention's Triton kernels (fla-core, the `fla` extra:
`chunk_gated_delta_rule` and `causal_conv1d`, documents as their cu_seqlens), on CUDA; "torch" is transformers' own
torch path (its `torch_chunk_gated_delta_rule`, a depthwise conv1d), also the reference, one call per document.
fla's gated backward refuses Hopper GPUs on Triton >= 3.4.0, < 3.7.1, where it computes wrong gradients
(flash-linear-attention issue #640): "auto" probes it once per device and takes the torch path where it refuses.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.nn.functional as F

from ..parallel.exchange import bshd_heads_to_seq, bshd_seq_to_heads
from ..handle import Handle
from ..parallel.layout import ParallelLayout
from ..shape import text_config
from ..parallel.sharding import check_document_bounds

logger = logging.getLogger(__name__)

# The text configs whose `linear_attention` layers are gated DeltaNets this module runs, and those layers' classes.
LINEAR_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_MIXER_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
DELTANET_KERNELS = ("auto", "fla", "torch")
_FLA_REFUSAL = "#640"  # in fla's error for Hopper on Triton 3.4.0 - 3.7.0 (fla/ops/common/chunk_o.py)
# The first torch whose wheels bring a Triton fla's gated backward runs on: 2.12.1 pins triton==3.7.1 (2.11.0 pins
# 3.6.0, 2.12.0 3.7.0: their metadata on PyPI); the `fla` extra asks for it (pyproject.toml).
FLA_TORCH = "2.12.1"
FLA_FIX = f"install torch >= {FLA_TORCH} (it brings Triton >= 3.7.1): pip install 'ulysses_lc[fla]'"


def valid_linear_sp_sizes(key_heads: int, value_heads: int) -> list[int]:
    """SP degrees the exchange can split a gated DeltaNet's heads over (key heads may be replicated)."""
    return [sp for sp in range(1, value_heads + 1)
            if value_heads % sp == 0 and (key_heads % sp == 0 or sp % key_heads == 0)]


def check_linear_heads(cfg, sp_size: int) -> None:
    """Raise ValueError unless this config's gated DeltaNet heads split over sp_size ranks."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hv % hk:
        raise ValueError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}.")
    if sp_size not in valid_linear_sp_sizes(hk, hv):
        raise ValueError(
            f"sp_size={sp_size} cannot split the gated DeltaNet heads (linear_num_key_heads={hk}, "
            f"linear_num_value_heads={hv}): each rank needs a whole number of value heads and either a whole number "
            f"of key heads or one replicated key head; pick sp_size in {valid_linear_sp_sizes(hk, hv)}."
        )


# ---- kernels ----

def _fla_ops():
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        try:
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            return None
    return causal_conv1d, chunk_gated_delta_rule


@functools.lru_cache(maxsize=None)
def _fla_probe(device_index: int) -> str | None:
    """None when fla's gated delta rule runs forward and backward on this GPU; else why not (its refusal)."""
    causal_conv1d, rule = _fla_ops()
    device = torch.device("cuda", device_index)
    q, k, v = (torch.randn(1, 64, 1, 16, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.full((1, 64, 1), -0.1, device=device, requires_grad=True)
    beta = torch.full((1, 64, 1), 0.5, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        out, _ = rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
    except RuntimeError as e:
        if _FLA_REFUSAL not in str(e):
            raise
        return str(e).split(". ")[0]
    return None


def resolve_deltanet_kernel(kernel: str, device: torch.device) -> tuple[str, str]:
    """(kernel, why) for `kernel` on `device`: "auto" is fla on CUDA where fla-core is installed and its backward
    runs (probed once per GPU), else torch; `why` says what decided it, for the start-up block."""
    if kernel not in DELTANET_KERNELS:
        raise ValueError(f"deltanet kernel {kernel!r}: pick one of {DELTANET_KERNELS}.")
    if kernel == "torch":
        return "torch", "asked for"
    if device.type != "cuda":
        if kernel == "fla":
            raise ValueError("deltanet kernel 'fla' runs Triton kernels on CUDA; use 'torch' or 'auto' on CPU.")
        return "torch", "no GPU"
    if _fla_ops() is None:
        if kernel == "fla":
            raise ValueError("deltanet kernel 'fla' needs fla-core: `pip install ulysses_lc[fla]`, or use 'torch'.")
        return "torch", "fla-core not installed (`pip install ulysses_lc[fla]`)"
    refusal = _fla_probe(device.index if device.index is not None else torch.cuda.current_device())
    if refusal is not None:
        if kernel == "fla":
            raise ValueError(f"fla's gated delta rule refuses this GPU: {refusal}; {FLA_FIX}, or use deltanet kernel "
                             "'torch'.")
        logger.warning("fla refuses its gated backward here (%s): gated DeltaNet layers take the torch path; %s",
                       refusal, FLA_FIX)
        return "torch", f"fla refuses its backward here: {refusal}; {FLA_FIX}"
    return "fla", "fla-core (its kernels autotune on the first step, minutes on a fresh machine, then kept in the kernel cache)"


# Device bytes one gated DeltaNet layer's recurrence holds at its peak (forward + backward), per token of the whole
# sequence and per value head a rank runs, the layer's inputs q, k, v, a, b included. The torch path in segments of
# TORCH_SEGMENT_TOKENS, measured in whole training steps on an H200 (benchmarks/bench_hybrid.py, 2026-12-01, the
# Qwen3.5-0.8B shape's 16 value heads of 128, 8 layers): a recomputed layer's block at 262,144 and 437,248 tokens is
# 10.2 and 11.0 KB beside the memory model's other terms; 11.5 KB holds both from above. One call of transformers'
# rule over the whole sequence (before the segments) held 14.7 KB (bench_deltanet.py: 123.5 GB at 262,144 tokens x 32
# heads), its backward writing into one whole-sequence output; fla's forward alone 5.1 KB (its backward is refused
# there, not measured).
RECURRENCE_BYTES_PER_HEAD_TOKEN = 11_500
# fla's kernels (fla-core 0.6.0 over Triton 3.7.1, whose gated backward fla allows on Hopper): one whole step of the
# Qwen3.5-0.8B shape, all 24 layers, at 32,768 tokens with the plan 5 / 5 / 5 (18 DeltaNet layers, 15 of them plain)
# on one H200, 2026-12-02 (benchmarks/results/2026-12-02/hybrid_qwen3.5-0.8b-24layers_fla.json): 47.7 GB measured
# against 116.8 GB priced at the torch path's 11.5 KB; 2.1 KB prices it at 47.9 GB (1.004). One point, fitted; the
# 256k and 1M steps after it held it (1.063, 1.012 with the recompute's own bytes below: tests/test_hybrid_memory.py).
FLA_RECURRENCE_BYTES_PER_HEAD_TOKEN = 2_100
# What a recomputed gated DeltaNet layer holds at its peak on fla's kernels (its forward again, then its backward),
# apart from the stored block above: the same shape, 12 of its layers, every layer recomputed (plan 12 / 0 / 12), at
# 262,144 and 524,288 tokens (benchmarks/results/2026-12-02/next/probe_12layers.json, 2026-12-02): the backward's
# peak 38.16 and 64.68 GB, 101.2 KB a token between them, 33.0 KB a token over the recompute term priced at the
# stored block's 2.1 KB a head. Priced at the block's 2.1 KB, the 12-layer step at the dry run's longest (1,713,152
# tokens) ran out of memory past 149 GB against 127.9 predicted. Fitted on these two points; held out, all 24
# layers at the dry run's longest after the fit (1,116,160 tokens): 129.05 GB measured, 128.49 predicted (0.996).
FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN = 4_160


def recurrence_block_bytes(shape, seq_len: int, sp_size: int, kernel: str = "torch", recompute: bool = False) -> int:
    """Device bytes of one gated DeltaNet layer's recurrence on one rank (its value heads over the whole padded
    sequence) on `kernel`'s path ("torch" or "fla"), 0 for a model without such layers; a `shape.ModelShape`.
    recompute: at a recomputed layer's peak (fla: FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN; the torch path's
    figure is a recomputed layer's already), not the block a plain layer stores."""
    if not shape.linear_layers:
        return 0
    s_pad = -(-seq_len // sp_size) * sp_size
    per = RECURRENCE_BYTES_PER_HEAD_TOKEN
    if kernel == "fla":
        per = FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN if recompute else FLA_RECURRENCE_BYTES_PER_HEAD_TOKEN
    return s_pad * (shape.linear_heads[1] // sp_size) * per


def _segments(bounds, s: int):
    return [(0, s)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))


def _torch_conv(x_bsc, weight_ck, bias_c, bounds):
    """Depthwise causal conv1d + SiLU per document, as transformers' causal_conv1d_fn (its dtypes)."""
    width = weight_ck.shape[1]
    outs = []
    for a, b in _segments(bounds, x_bsc.shape[1]):
        x = x_bsc[:, a:b].transpose(1, 2).to(weight_ck.dtype)
        y = F.conv1d(x, weight_ck.unsqueeze(1), bias_c, padding=width - 1, groups=x.shape[1])[..., :b - a]
        outs.append(F.silu(y).to(x_bsc.dtype).transpose(1, 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# Tokens of one call of transformers' torch rule (a multiple of its 64-token chunk): longer runs go through it in
# segments, each starting from the last one's state. Its chunk loop writes each chunk's output into one preallocated
# tensor, whose backward copies the whole gradient once per chunk: O(T^2) traffic. Measured on an H200 at 262,144
# tokens (Qwen3_5TextConfig's 32 value heads of 128, benchmarks/bench_deltanet.py, 2026-12-01): 0.89 s forward,
# 81.6 s forward + backward in one call. Segments bound that to T x (segment / 64) and keep the 64-token chunks
# where one call puts them, so each chunk's numbers are the same ops on the same values.
TORCH_SEGMENT_TOKENS = 1024


def _torch_rule(module, q, k, v, g, beta, bounds, segment: int = TORCH_SEGMENT_TOKENS):
    """transformers' own chunked gated delta rule (the layer's modeling module's torch function), per document, in
    segments of `segment` tokens carrying the recurrent state from one to the next."""
    fn = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
    fn = getattr(fn, "__wrapped__", fn)  # transformers puts fla's kernel behind it where fla is installed
    if q.shape[2] != v.shape[2]:  # grouped value heads (5.17 repeats in the layer, 5.24 in the function)
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    outs = []
    for a, b in _segments(bounds, q.shape[1]):
        state = None
        for start in range(a, b, segment):
            end = min(start + segment, b)
            out, state = fn(q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end],
                            beta=beta[:, start:end], initial_state=state, output_final_state=end < b,
                            use_qk_l2norm_in_kernel=True)
            outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _fla_cu(bounds, x_bsc):
    if bounds is None:
        return None
    if x_bsc.shape[0] != 1:
        raise ValueError("packed documents train one sequence per step (batch 1).")
    return torch.tensor(bounds, dtype=torch.long, device=x_bsc.device)


# ---- the layer ----

class GatedDeltaNetMixer:
    """The forward of one gated DeltaNet layer under Ulysses over `layout` with `kernel` ("fla" or "torch", resolved).

    Communicates: one all-to-all of the projections q, k, v, a, b (model dtype) to this rank's heads over the whole
    sequence, one of the recurrence's output back (and their inverses in backward). Keeps nothing of its own: autograd
    saves what the conv, the recurrence and the gates need."""

    def __init__(self, module, layout: ParallelLayout, kernel: str):
        self.layout, self.kernel = layout, kernel
        self.borders = None  # install_linear_attention's borders: a packed forward's expected_bounds
        sp, rank = layout.sp_size, layout.sp_rank
        hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
        self.key_copies = sp // hk if hk < sp else 1
        hk_local, hv_local = max(hk, sp) // sp, hv // sp
        k0 = (rank // self.key_copies) * hk_local if hk < sp else rank * hk_local
        keys = torch.arange(k0 * dk, (k0 + hk_local) * dk)
        values = torch.arange(rank * hv_local * dv, (rank + 1) * hv_local * dv)
        key_dim = hk * dk
        # This rank's channels of the conv weight [2 hk dk + hv dv, K]: its q heads, k heads, v heads.
        self.channels = torch.cat([keys, key_dim + keys, 2 * key_dim + values])
        self.value_heads = torch.arange(rank * hv_local, (rank + 1) * hv_local)
        self.widths = (hk_local * dk, hk_local * dk, hv_local * dv)
        self.dims = (dk, dv)

    def mix(self, module, q, k, v, b, a, bounds=None):
        """The layer between the exchanges, on this rank's heads over the whole sequence: q, k [b, s, hk_local, dk],
        v [b, s, hv_local, dv], b, a [b, s, hv_local] -> the recurrence's output [b, s, hv_local, dv]: the causal
        conv + SiLU over q, k, v (the layer's conv1d, running this rank's channels: `attach`), the gates, the gated
        delta rule; both restart at each document's start (`bounds`, the whole sequence's)."""
        heads = self.value_heads.to(q.device)
        beta = b.sigmoid()
        g = -module.A_log.index_select(0, heads).float().exp() * F.softplus(
            a.float() + module.dt_bias.index_select(0, heads))
        y_bsc = module.conv1d(torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1), bounds)
        dk, dv = self.dims
        yq, yk, yv = y_bsc.split(self.widths, dim=-1)
        yq, yk, yv = (yq.unflatten(-1, (-1, dk)).contiguous(), yk.unflatten(-1, (-1, dk)).contiguous(),
                      yv.unflatten(-1, (-1, dv)).contiguous())
        if self.kernel == "fla" and y_bsc.is_cuda:
            rule = _fla_ops()[1]
            return rule(yq, yk, yv, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=_fla_cu(bounds, y_bsc))[0]
        return _torch_rule(module, yq, yk, yv, g, beta, bounds)

    def conv(self, conv1d, x_bsc, bounds=None):
        """The forward `attach` gives the layer's conv1d: x_bsc [b, s, C_local] (this rank's q, k, v channels over the
        whole sequence) -> causal depthwise conv + SiLU with those channels of its weight [C, 1, K]. Called as the
        module, so ZeRO-3 gathers the weight around it, as for any module's own forward."""
        channels = self.channels.to(x_bsc.device)
        weight_ck = conv1d.weight.squeeze(1).index_select(0, channels)
        bias_c = None if conv1d.bias is None else conv1d.bias.index_select(0, channels)
        if self.kernel == "fla" and x_bsc.is_cuda:
            return _fla_ops()[0](x_bsc, weight_ck, bias_c, activation="silu", cu_seqlens=_fla_cu(bounds, x_bsc))[0]
        return _torch_conv(x_bsc, weight_ck, bias_c, bounds)

    def attach(self, module) -> None:
        """Run `module` (a gated DeltaNet layer) through this mixer: its forward and its conv1d's (undo: `detach`)."""
        module._ulysses_original_forward = module.forward
        module.forward = functools.partial(self, module)
        module.conv1d.forward = functools.partial(self.conv, module.conv1d)

    @staticmethod
    def detach(module) -> None:
        for owner, name in ((module, "forward"), (module, "_ulysses_original_forward"), (module.conv1d, "forward")):
            owner.__dict__.pop(name, None)

    def projections(self, module, x_bse):
        """q, k [b, s_local, hk, dk], v, z [b, s_local, hv, dv], b, a [b, s_local, hv] before the convolution."""
        if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved per key head
            q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x_bse), module.in_proj_ba(x_bse))
            return q, k, v, z, b, a
        bsz, s_local = x_bse.shape[:2]
        q, k, v = module.in_proj_qkv(x_bse).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
        dk, dv = self.dims
        return (q.reshape(bsz, s_local, -1, dk), k.reshape(bsz, s_local, -1, dk), v.reshape(bsz, s_local, -1, dv),
                module.in_proj_z(x_bse).reshape(bsz, s_local, -1, dv), module.in_proj_b(x_bse),
                module.in_proj_a(x_bse))

    def __call__(self, module, hidden_states, cache=None, attention_mask=None, document_bounds=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("cache_params", None)  # transformers 5.17's name
        if cache is not None or attention_mask is not None:
            if self.layout.sp_size == 1:  # generation, or a padding mask: the layer's own forward
                return module._ulysses_original_forward(hidden_states, cache, attention_mask, **kwargs)
            raise ValueError(f"gated DeltaNet layer {module.layer_idx} under sequence parallelism takes neither a cache "
                             "nor an attention_mask; pass use_cache=False and no mask (see shard_batch).")
        check_document_bounds(getattr(self.borders, "expected_bounds", None), document_bounds, module)
        q, k, v, z, b, a = self.projections(module, hidden_states)
        if self.key_copies > 1:  # fewer key heads than ranks: each rank receives the one its value heads read
            q, k = (x.repeat_interleave(self.key_copies, dim=2) for x in (q, k))
        q, k, v, b, a = bshd_seq_to_heads([q, k, v, b.unsqueeze(-1), a.unsqueeze(-1)], self.layout)
        out_bshd = self.mix(module, q, k, v, b.squeeze(-1), a.squeeze(-1), document_bounds)
        out_bshd = bshd_heads_to_seq(out_bshd, self.layout)
        # The gated RMSNorm per (token, head) and the output projection, on this rank's slice.
        dv = self.dims[1]
        normed = module.norm(out_bshd.reshape(-1, dv), z.reshape(-1, dv))
        return module.out_proj(normed.reshape(*out_bshd.shape[:2], -1))


def is_gated_deltanet(module) -> bool:
    return type(module).__name__ in _MIXER_CLASSES


_LAYER_ATTRIBUTES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d", "A_log", "dt_bias", "norm",
                     "out_proj")


def _check_layer(module) -> None:
    """The layer as this module reads it (transformers 5.17 - 5.24); another version's layout is refused by name."""
    import transformers

    missing = [a for a in _LAYER_ATTRIBUTES if not hasattr(module, a)]
    if not (hasattr(module, "in_proj_qkv") or hasattr(module, "fix_query_key_value_ordering")):
        missing.append("in_proj_qkv / in_proj_qkvz")
    if not hasattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule"):
        missing.append("its module's torch_chunk_gated_delta_rule")
    if missing:
        raise ValueError(f"transformers {transformers.__version__}'s {type(module).__name__} lacks {missing}, which the "
                         "gated DeltaNet exchange reads (tested on transformers 5.17 and 5.24); install one of those "
                         "or train at sp_size=1 without ulysses_lc's levers.")


def install_linear_attention(model, layout: ParallelLayout, kernel: str = "auto", borders=None) -> Handle:
    """Run every gated DeltaNet layer of `model` through GatedDeltaNetMixer over `layout`; the Handle's undo() gives
    each its own forward back, and `.kernel` / `.why` say which kernel runs them. A model without such layers gets a
    Handle that does nothing (kernel None).

    ZeRO-3: the layer's own parameters (A_log, dt_bias) and its submodules' are gathered by their modules' hooks as
    usual; the conv weight too, because the layer's conv1d is called as a module (`GatedDeltaNetMixer.conv`), which
    transformers' own forward does not do. borders: an object whose `expected_bounds` holds a packed forward's
    borders (the UlyssesAttention): each layer checks it got them."""
    mixers = [m for m in model.modules() if is_gated_deltanet(m)]
    handle = Handle(None, "gated DeltaNet")
    handle.kernel = handle.why = None
    if not mixers:
        return handle
    check_linear_heads(text_config(model.config), layout.sp_size)
    # The run's device: the model may still be on the host here (DeepSpeed moves it at initialize).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    handle.kernel, handle.why = resolve_deltanet_kernel(kernel, device)
    for module in mixers:
        _check_layer(module)
        if "_ulysses_original_forward" in module.__dict__:
            raise ValueError("gated DeltaNet exchange is already installed; call the undo of the first install.")
        mixer = GatedDeltaNetMixer(module, layout, handle.kernel)
        mixer.borders = borders
        mixer.attach(module)

    def undo():
        for module in mixers:
            GatedDeltaNetMixer.detach(module)

    handle._undo_fn = undo
    return handle


__all__ = ["DELTANET_KERNELS", "GatedDeltaNetMixer", "LINEAR_MODEL_TYPES", "check_linear_heads",
           "install_linear_attention", "is_gated_deltanet", "recurrence_block_bytes",
           "FLA_RECURRENCE_BYTES_PER_HEAD_TOKEN", "FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN",
           "resolve_deltanet_kernel", "valid_linear_sp_sizes"]
