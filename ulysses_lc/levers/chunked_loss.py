"""Cross-entropy of an LM head without ever holding the [tokens x vocab] logits.

Legend (shape.py): t tokens (batch and sequence flattened; already shifted so row i predicts labels[i]),
e hidden size, v vocabulary, c rows in one chunk (c <= t).

The loss is a sum over rows and each row's softmax runs along its own vocabulary, so rows
split cleanly: we walk chunks of c rows, and only one [c, v] block of logits exists at a time.

Gradient in forward, not recompute in backward
----------------------------------------------
Per chunk the loss head needs three matmuls of 2*c*v*e FLOPs each:
    logits_cv = hidden_ce @ weight_ve.T        (forward)
    grad_hidden_ch = dlogits_cv @ weight_ve    (backward)
    grad_weight_ve += dlogits_cv.T @ hidden_ce (backward)
Recomputing in backward repeats the first one: 4 matmuls, 8*t*v*e FLOPs. Computing the
gradients while the logits are live (the chunk's softmax *is* dlogits, up to the one-hot)
needs 3, 6*t*v*e FLOPs: 25% fewer, and for a 152k vocabulary the LM head is the largest
matmul of a small model (Qwen3-4B: v*e = 389M against 4 * 36 * e^2 + MLP per layer), so the
saving is not noise. This is valid because loss_sum enters the rest of the graph linearly:
whatever scalar grad_output arrives, d(grad_output * loss_sum) = grad_output * d(loss_sum),
so backward only scales what forward already computed.

Memory cost: recompute would keep hidden_te (and needs weight_ve again in backward); this
keeps grad_hidden_te instead, the same size and dtype, so the only extra is the fp32
grad_weight_ve accumulator (v*e*4 bytes, 1.5 GiB for 152k x 2560) held from forward to
backward. We accumulate it in fp32 because a long sequence is hundreds of chunks and bf16
accumulation over that many terms loses the small rows' contribution.

When neither hidden nor weight needs a gradient (evaluation) only the first matmul runs. An evaluation that needs
each row's loss (loss by position, a passkey's key tokens: ulysses_lc/eval) takes `chunked_token_scores`, the
same chunks without the sum.

Final logit soft-capping (Gemma 2/3's `final_logit_softcapping`, cap): the loss reads z = cap tanh(logits / cap),
and dz / dlogits = 1 - (z / cap)^2, so the chunk keeps tanh in one fp32 block and z in a second: two [c, v]
blocks instead of one, so the automatic chunk has half the rows.

Ignored rows and host syncs
---------------------------
The chunks walk all t rows, including those labelled IGNORE_INDEX: an ignored row goes through
the matmuls like any other and is masked out (0 to the loss, exact 0 to every gradient). We pay
for them because dropping them needs the size of the valid set, which is a host sync (nonzero)
that stalls the GPU queue every step, while a single long sequence has few ignored rows (the
last position and the end padding, plus a masked prompt if any). The mask costs no extra pass
over the [c, v] block: ignored rows subtract +inf instead of their logsumexp before the exp, so
their softmax comes out as exact zeros in the same pass, and their one-hot is scattered with 0.
(This needs the hidden states of ignored rows to be finite, which ordinary positions are.)

With labels on a GPU the forward never synchronizes with the host: n_valid stays a device
tensor and the label range check is a torch._assert_async: a device-side assert that prints
its message to stderr but surfaces in Python as a generic "device-side assert triggered" at
some later call, and leaves the CUDA context unusable. The clear check runs on the host where
the labels are built:
shard_batch(..., vocab_size=...). With labels on the CPU (tests, CPU runs) reading them is
free, so the forward raises the clear ValueError itself.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from ..handle import Handle
from ..parallel.sharding import check_labels_in_vocab
from . import ce_rows
from .fp32_accumulate import add_product_

# fp32 logits bytes per chunk. 1 GiB is ~1.7k rows at v=152k: large enough that each matmul
# fills an H100/H200 (TRL's 256 rows leave it underused at this vocabulary), small enough that
# the chunk's transients (bf16 logits, fp32 logits/probabilities, bf16 dlogits: ~2.5x this)
# stay far below one layer's activations at long sequence.
_TARGET_CHUNK_LOGITS_BYTES = 1 << 30
# Row counts are rounded to this multiple so matmul shapes stay tensor-core friendly.
_ROW_MULTIPLE = 64


def loss_head_bytes(shape, tokens: int) -> int:
    """Device bytes the loss head holds for a step on `tokens` rows of a `shape.ModelShape` model: the fp32
    weight-gradient accumulator (v x e x 4) and the hidden-state gradient computed in forward (e x 2 per
    token, bf16) from forward to backward, plus one chunk's logits while it runs."""
    return shape.vocab * shape.hidden * 4 + tokens * 2 * shape.hidden + _TARGET_CHUNK_LOGITS_BYTES


def auto_chunk_rows(vocab_size: int, target_bytes: int = _TARGET_CHUNK_LOGITS_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about `target_bytes`."""
    rows = target_bytes // (4 * vocab_size)
    return max(_ROW_MULTIPLE, rows // _ROW_MULTIPLE * _ROW_MULTIPLE)


def check_labels_on_device(labels_t: torch.Tensor, valid_t: torch.Tensor, v: int) -> None:
    """The loss's own label range check: a ValueError for CPU labels (no sync), a device-side assert on a GPU."""
    # A bad label would otherwise index out of range inside gather (a device-side assert on GPU, far from its cause).
    if labels_t.device.type == "cpu":
        check_labels_in_vocab(labels_t, v)  # reading a CPU tensor is no sync
        return
    # No host sync: fails loudly on the device before gather reads out of range. The clear message comes from the
    # host-side check in shard_batch(..., vocab_size=...).
    bad_t = (valid_t & ((labels_t < 0) | (labels_t >= v))).any()
    torch._assert_async(
        bad_t.logical_not(),
        f"labels must be in [0, {v}) or IGNORE_INDEX={IGNORE_INDEX}; pass vocab_size to shard_batch for a clear "
        "error on the host.",
    )


def chunk_logits(hidden_ce, weight_ve, bias_v, softcap, acc_dtype):
    """(logits [c, v] in acc_dtype as the loss reads them, tanh(logits / softcap) or None): the chunk's one fp32 block
    (two with softcap, the second kept for the gradient)."""
    return _loss_logits(F.linear(hidden_ce, weight_ve, bias_v), softcap, acc_dtype)


def _loss_logits(raw_cv, softcap, acc_dtype):
    logits_cv = raw_cv.to(acc_dtype)
    tanh_cv = None
    if softcap is not None:
        tanh_cv = logits_cv.div_(softcap).tanh_()
        logits_cv = tanh_cv * softcap
    return logits_cv, tanh_cv


def chunk_step(hidden_ce, weight_ve, bias_v, safe_labels_c, valid_c, softcap, acc_dtype,
               grad_hidden_ce=None, grad_weight_ve=None, grad_bias_v=None, fused_rows=None) -> torch.Tensor:
    """One chunk of the head: returns the summed cross-entropy of its valid rows and, for grad_output = 1, writes
    the rows' hidden-state gradient into grad_hidden_ce and adds the weight's and bias's into the fp32 accumulators
    (each None when not needed; all None: the forward matmul alone). Ignored rows give exact zeros everywhere.
    Only one [c, v] fp32 block (two with softcap) is live at a time; none where ce_rows.py's kernel takes the chunk
    (fused_rows: ce_rows.wanted)."""
    labels_c1 = safe_labels_c.unsqueeze(1)
    need_grad = not (grad_hidden_ce is None and grad_weight_ve is None and grad_bias_v is None)
    raw_cv = F.linear(hidden_ce, weight_ve, bias_v)
    if ce_rows.takes(raw_cv, softcap, acc_dtype, fused_rows):
        chunk_loss = ce_rows.fused_rows(raw_cv, safe_labels_c, valid_c, need_grad).sum()
        if need_grad:
            _chunk_backward(raw_cv, hidden_ce, weight_ve, grad_hidden_ce, grad_weight_ve, grad_bias_v)
        return chunk_loss
    logits_cv, tanh_cv = _loss_logits(raw_cv, softcap, acc_dtype)
    del raw_cv
    lse_c = torch.logsumexp(logits_cv, dim=-1)
    target_logit_c = logits_cv.gather(1, labels_c1).squeeze(1)
    chunk_loss = torch.where(valid_c, lse_c - target_logit_c, 0.0).sum()
    if not need_grad:
        return chunk_loss
    # d loss_row / d logits_row = mask_row * (softmax(logits_row) - onehot(label)), built in place in the fp32 logits
    # buffer so the chunk never holds a second [c, v] fp32 block. Ignored rows subtract +inf: exp gives exact zeros,
    # masking them in the same pass, and their one-hot is scattered with 0.
    shift_c = lse_c.masked_fill(valid_c.logical_not(), float("inf"))
    dlogits_cv = logits_cv.sub_(shift_c.unsqueeze(1)).exp_()
    dlogits_cv.scatter_add_(1, labels_c1, valid_c.to(acc_dtype).neg_().unsqueeze(1))
    if tanh_cv is not None:  # through z = cap tanh(logits / cap)
        dlogits_cv.mul_(tanh_cv.square_().neg_().add_(1.0))
        del tanh_cv
    if grad_bias_v is not None:
        grad_bias_v += dlogits_cv.sum(0)
    dlogits_lowp_cv = dlogits_cv.to(hidden_ce.dtype)
    del dlogits_cv, logits_cv
    _chunk_backward(dlogits_lowp_cv, hidden_ce, weight_ve, grad_hidden_ce, grad_weight_ve, None)
    return chunk_loss


def _chunk_backward(dlogits_lowp_cv, hidden_ce, weight_ve, grad_hidden_ce, grad_weight_ve, grad_bias_v):
    """The chunk's gradient matmuls from its d loss / d logits in the model's dtype (and the bias's sum, if asked)."""
    if grad_bias_v is not None:
        grad_bias_v += dlogits_lowp_cv.sum(0, dtype=grad_bias_v.dtype)
    if grad_hidden_ce is not None:
        torch.mm(dlogits_lowp_cv, weight_ve, out=grad_hidden_ce)
    if grad_weight_ve is not None:  # into the fp32 accumulator inside the GEMM on CUDA (fp32_accumulate.py)
        add_product_(grad_weight_ve, dlogits_lowp_cv.t(), hidden_ce)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden_te @ weight_ve.T (+ bias_v)` against `labels_t`.

    Forward communicates nothing and, with labels on a GPU, never synchronizes with the host (but at the first call
    on a device with bf16 / fp16 inputs, once: fp32_accumulate.py's probe).
    It returns (loss_sum scalar in fp32, fp64 for fp64 inputs; n_valid int64 scalar on the
    device, non-differentiable) and computes the gradients on the spot. Labels outside
    [0, v) other than IGNORE_INDEX raise ValueError on CPU and trip a device-side assert
    (torch._assert_async) on a GPU; the clear check for GPU runs is shard_batch(vocab_size=...).
    Saved for backward (as ctx attributes, on the device of `hidden`): grad_hidden_te in
    hidden's dtype, grad_weight_ve and grad_bias_v in fp32 (fp64 for fp64 inputs), each for
    grad_output = 1.
    Backward communicates nothing and only scales them by grad_output; it can run once.
    """

    @staticmethod
    def forward(ctx, hidden_te, weight_ve, bias_v, labels_t, chunk_rows, softcap=None, fused_rows=None):
        t, e = hidden_te.shape
        v = weight_ve.shape[0]
        dtype = hidden_te.dtype
        # Softmax in fp32 at least; fp64 inputs (tests, numerics checks) stay in fp64.
        acc_dtype = torch.promote_types(dtype, torch.float32)
        need_grad_hidden, need_grad_weight, need_grad_bias = ctx.needs_input_grad[:3]
        need_grad_bias = need_grad_bias and bias_v is not None

        valid_t = labels_t != IGNORE_INDEX
        check_labels_on_device(labels_t, valid_t, v)
        # Ignored rows gather/scatter column 0 (any in-range column would do); the mask zeroes them.
        safe_labels_t = labels_t.clamp(min=0)
        n_valid_t = valid_t.sum()  # int64 on the device, no sync

        loss_sum = torch.zeros((), dtype=acc_dtype, device=hidden_te.device)
        # Every row is written by its chunk (ignored rows with zeros), so no memset is needed.
        grad_hidden_te = torch.empty((t, e), dtype=dtype, device=hidden_te.device) if need_grad_hidden else None
        grad_weight_ve = (
            torch.zeros(v, e, dtype=acc_dtype, device=weight_ve.device) if need_grad_weight else None
        )
        grad_bias_v = torch.zeros(v, dtype=acc_dtype, device=weight_ve.device) if need_grad_bias else None

        # A static walk over all t rows: the chunk count never depends on label values.
        for start in range(0, t, chunk_rows):
            end = min(start + chunk_rows, t)
            hidden_ce = hidden_te[start:end]
            loss_sum += chunk_step(
                hidden_ce, weight_ve, bias_v, safe_labels_t[start:end], valid_t[start:end], softcap, acc_dtype,
                None if grad_hidden_te is None else grad_hidden_te[start:end], grad_weight_ve, grad_bias_v, fused_rows)

        ctx.grad_hidden_te = grad_hidden_te
        ctx.grad_weight_ve = grad_weight_ve
        ctx.grad_bias_v = grad_bias_v
        ctx.weight_dtype = weight_ve.dtype
        ctx.bias_dtype = None if bias_v is None else bias_v.dtype
        ctx.mark_non_differentiable(n_valid_t)
        return loss_sum, n_valid_t

    @staticmethod
    def backward(ctx, grad_loss_sum, grad_n_valid):
        if ctx.grad_hidden_te is None and ctx.grad_weight_ve is None and ctx.grad_bias_v is None:
            if any(ctx.needs_input_grad[:3]):
                raise RuntimeError(
                    "ChunkedCrossEntropy.backward ran twice; its gradients are scaled in place "
                    "and freed, so retain_graph=True over the loss head is not supported."
                )
        grad_hidden = grad_weight = grad_bias = None
        if ctx.grad_hidden_te is not None:
            # In place: the buffer is as large as the hidden states and is not needed again.
            grad_hidden = ctx.grad_hidden_te.mul_(grad_loss_sum.to(ctx.grad_hidden_te.dtype))
        if ctx.grad_weight_ve is not None:
            grad_weight = ctx.grad_weight_ve.mul_(grad_loss_sum).to(ctx.weight_dtype)
        if ctx.grad_bias_v is not None:
            grad_bias = ctx.grad_bias_v.mul_(grad_loss_sum).to(ctx.bias_dtype)
        ctx.grad_hidden_te = ctx.grad_weight_ve = ctx.grad_bias_v = None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_cross_entropy(
    hidden_te: torch.Tensor,
    weight_ve: torch.Tensor,
    labels_t: torch.Tensor,
    bias_v: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    softcap: float | None = None,
    fused_rows: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss_sum fp32 (fp64 for fp64 inputs), n_valid int64) of the LM head over `hidden_te`, chunk by chunk.

    Labels are already shifted; rows labelled IGNORE_INDEX contribute nothing. `chunk_rows`
    overrides the automatic rows per chunk (about 1 GiB of fp32 logits). softcap: the loss reads
    softcap * tanh(logits / softcap) (Gemma's final_logit_softcapping). fused_rows: each chunk's softmax as
    ce_rows.py's Triton kernel on CUDA (None: its default, ce_rows.wanted).
    """
    if hidden_te.dim() != 2 or labels_t.dim() != 1 or hidden_te.shape[0] != labels_t.shape[0]:
        raise ValueError(
            f"expected hidden [tokens, hidden] and labels [tokens], got {tuple(hidden_te.shape)} and "
            f"{tuple(labels_t.shape)}; flatten batch and sequence first (hidden.reshape(-1, e), labels.reshape(-1))."
        )
    if weight_ve.dim() != 2 or weight_ve.shape[1] != hidden_te.shape[1]:
        raise ValueError(
            f"weight must be [vocab, hidden={hidden_te.shape[1]}], got {tuple(weight_ve.shape)}; pass the "
            "lm_head weight itself (not transposed)."
        )
    if chunk_rows is None:
        chunk_rows = auto_chunk_rows(weight_ve.shape[0], _TARGET_CHUNK_LOGITS_BYTES // (2 if softcap else 1))
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1 or None (automatic), got {chunk_rows}.")
    return ChunkedCrossEntropy.apply(hidden_te, weight_ve, bias_v, labels_t.long(), int(chunk_rows), softcap,
                                     fused_rows)


@torch.no_grad()
def chunked_token_scores(
    hidden_te: torch.Tensor,
    weight_ve: torch.Tensor,
    labels_t: torch.Tensor,
    bias_v: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, without gradient (evaluation): (cross-entropy [t] fp32, whether the label is the argmax [t] bool),
    chunk by chunk as the loss, so one [c, v] block exists at a time. Every row is scored: select the labelled rows
    first (an IGNORE_INDEX label is refused like any label outside [0, v))."""
    t, v = hidden_te.shape[0], weight_ve.shape[0]
    labels_t = labels_t.long()
    check_labels_on_device(labels_t, torch.ones_like(labels_t, dtype=torch.bool), v)
    if chunk_rows is None:
        chunk_rows = auto_chunk_rows(v, _TARGET_CHUNK_LOGITS_BYTES // (2 if softcap else 1))
    acc_dtype = torch.promote_types(hidden_te.dtype, torch.float32)
    loss_t = torch.empty(t, dtype=torch.float32, device=hidden_te.device)
    correct_t = torch.empty(t, dtype=torch.bool, device=hidden_te.device)
    for start in range(0, t, chunk_rows):
        end = min(start + chunk_rows, t)
        logits_cv, _ = chunk_logits(hidden_te[start:end], weight_ve, bias_v, softcap, acc_dtype)
        labels_c1 = labels_t[start:end].unsqueeze(1)
        loss_t[start:end] = torch.logsumexp(logits_cv, dim=-1) - logits_cv.gather(1, labels_c1).squeeze(1)
        correct_t[start:end] = logits_cv.argmax(dim=-1) == labels_c1.squeeze(1)
    return loss_t, correct_t


class ChunkedLossHead(nn.Module):
    """Drop-in LM head: logits without labels, (loss_sum, n_valid) with labels.

    Holds the very Parameter objects of the `nn.Linear` it replaces, so tied input/output
    embeddings stay tied and ZeRO-3 gathers the weight once in this module's forward
    pre-hook (and once before its backward), not once per chunk. softcap: the model's final logit
    soft-capping, which the loss applies (the logits without labels stay the head's own: the
    model's forward caps them). fused_rows: the loss's softmax as ce_rows.py's kernel (chunked_cross_entropy).
    """

    def __init__(self, lm_head: nn.Linear, chunk_rows: int | None = None, softcap: float | None = None,
                 fused_rows: bool | None = None):
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise ValueError(
                f"ChunkedLossHead wraps an nn.Linear LM head, got {type(lm_head).__name__}; models whose "
                "head is not a plain linear layer need their own loss."
            )
        self.in_features = lm_head.in_features
        self.out_features = lm_head.out_features
        self.weight = lm_head.weight
        self.bias = lm_head.bias
        self.chunk_rows = chunk_rows
        self.softcap = softcap
        self.fused_rows = fused_rows

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, documents=None,
                per_token: bool = False):
        """Logits without labels; (loss_sum, n_valid) with them; with `documents` (a preference.DocumentRows), each
        document's summed log-probabilities of its labels, through `documents.log_probs`; with per_token, each row's
        (loss, label is the argmax), no gradient (`chunked_token_scores`). ZeRO-3 has gathered the weight for this
        module's forward either way."""
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}; "
                "pass labels already shifted to align with hidden."
            )
        if per_token:
            return chunked_token_scores(hidden.reshape(-1, hidden.shape[-1]), self.weight, labels.reshape(-1),
                                        self.bias, self.chunk_rows, self.softcap)
        if documents is not None:
            return documents.log_probs(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias,
                                       labels.reshape(-1), self.chunk_rows, self.softcap, self.fused_rows)
        return chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.weight, labels.reshape(-1), self.bias, self.chunk_rows,
            self.softcap, self.fused_rows,
        )

    def extra_repr(self) -> str:
        cap = f", softcap={self.softcap}" if self.softcap else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{cap}"


def final_logit_softcap(config) -> float | None:
    """The cap of the model's final logit soft-capping (Gemma 2/3), or None."""
    get = getattr(config, "get_text_config", None)
    cfg = get() if callable(get) else config
    return getattr(cfg, "final_logit_softcapping", None) or None


def install_chunked_loss_head(model: nn.Module, chunk_rows: int | None = None,
                              fused_rows: bool | None = None) -> Handle:
    """Replace the model's output embeddings by a ChunkedLossHead (its chunk_rows and fused_rows); the Handle's undo()
    puts the old head back."""
    old_head = model.get_output_embeddings()
    if isinstance(old_head, ChunkedLossHead):
        raise ValueError("the model already has a ChunkedLossHead; call the undo returned by the first install.")
    new_head = ChunkedLossHead(old_head, chunk_rows, final_logit_softcap(model.config), fused_rows)
    model.set_output_embeddings(new_head)

    def undo():
        model.set_output_embeddings(old_head)

    return Handle(undo, "chunked loss head")


__all__ = [
    "ChunkedCrossEntropy",
    "check_labels_on_device",
    "chunk_logits",
    "chunk_step",
    "chunked_token_scores",
    "ChunkedLossHead",
    "auto_chunk_rows",
    "chunked_cross_entropy",
    "final_logit_softcap",
    "install_chunked_loss_head",
    "loss_head_bytes",
]
