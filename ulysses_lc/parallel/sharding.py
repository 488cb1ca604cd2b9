"""Batch sharding: one long sequence -> this rank's slice, with labels shifted before slicing.

Legend (shape.py): b batch, s full sequence length, s_pad = s rounded up to a multiple of sp, s_local = s_pad / sp.

The order matters. Labels are shifted over the *whole* sequence first (token t predicts token t+1), so
the label of the last token of rank r's slice is the first token of rank r+1's slice: nothing is lost at
shard borders. Then the sequence is padded at the end to a multiple of sp (padding has IGNORE_INDEX
labels and, being last, is never attended to by a real token under the causal kernel), and each rank
takes its contiguous slice with its *global* position ids.

Packed documents (`document_lengths`): several documents share the sequence without reading each other.
Positions restart at 0 in each document (RoPE, YaRN, as if it were alone), the label of a document's last
token is ignored (the next token is another document's), and the boundaries travel with the batch as
`cu_seqlens` over the WHOLE padded sequence (the end padding is a segment of its own), identical on every
rank: after the Ulysses exchange each rank holds the whole sequence for its heads and runs attention per
document (attention.py).

Padding (`token_mask`): the tokens added to reach a multiple of sp, and those the caller's attention_mask marks 0
(right padding only: the causal kernel keeps real tokens from reading padding at the end, not before them). Only
the MoE router loss reads it (objectives/router_loss.py: transformers leaves attention_mask-0 tokens out of it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..constants import IGNORE_INDEX
from .layout import ParallelLayout


def check_labels_in_vocab(labels: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless every label other than IGNORE_INDEX is in [0, vocab_size).

    Reads the values: free on CPU tensors, a host sync on a GPU, so call it where the labels are
    built on the host (shard_batch does with vocab_size=...), not in the training step.
    """
    valid = labels != IGNORE_INDEX
    if bool((valid & ((labels < 0) | (labels >= vocab_size))).any()):
        labels_valid = labels[valid]
        raise ValueError(
            f"labels must be in [0, {vocab_size}) or IGNORE_INDEX={IGNORE_INDEX}; got "
            f"min={int(labels_valid.min())}, max={int(labels_valid.max())}. Check that the "
            "tokenizer matches the model and that padding uses IGNORE_INDEX."
        )


@dataclass
class ShardedBatch:
    """This rank's slice of a batch. `labels` are already shifted: do not shift them again."""

    input_ids: torch.Tensor  # [b, s_local]
    labels: torch.Tensor  # [b, s_local], shifted, IGNORE_INDEX where nothing is predicted
    position_ids: torch.Tensor  # [b, s_local], global positions
    seq_len: int  # s, before padding
    padded_len: int  # s_pad
    cu_seqlens: torch.Tensor | None = None  # [documents + 1] int32 boundaries over the whole s_pad; None: one stream
    token_mask: torch.Tensor | None = None  # [b, s_local] bool, False on padding; None: no padding

    def to(self, device) -> "ShardedBatch":
        """The token tensors on `device`; cu_seqlens stays on the host, where attention reads it (no sync)."""
        return ShardedBatch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            self.seq_len,
            self.padded_len,
            self.cu_seqlens,
            None if self.token_mask is None else self.token_mask.to(device, non_blocking=True),
        )

    def as_kwargs(self) -> dict:
        kwargs = {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids}
        if self.cu_seqlens is not None:
            kwargs["cu_seqlens"] = self.cu_seqlens
        if self.token_mask is not None:
            kwargs["token_mask"] = self.token_mask
        return kwargs


def shift_labels(labels_bs: torch.Tensor) -> torch.Tensor:
    """labels[:, t] <- labels[:, t+1]; the last position predicts nothing."""
    ignore = torch.full_like(labels_bs[:, :1], IGNORE_INDEX)
    return torch.cat([labels_bs[:, 1:], ignore], dim=1)


def _check_positions(position_ids_bs: torch.Tensor) -> None:
    steps = position_ids_bs[:, 1:] - position_ids_bs[:, :-1]
    if steps.numel() and not bool((steps == 1).all()):
        raise ValueError(
            "position_ids are not one contiguous run per sequence (packed documents or gaps): the causal kernel "
            "would let packed documents attend to each other. Pass document_lengths=[...] to shard_batch (positions "
            "then restart per document and attention stays inside each; document_lengths_from_positions() reads "
            "them from positions restarting at 0), or join documents into one causal stream (EOS between them, "
            "positions 0..s-1)."
        )


def _document_lengths(document_lengths, b: int, s: int) -> list[int]:
    lengths = [int(n) for n in document_lengths]
    if b != 1:
        raise ValueError(f"document_lengths packs one sequence; got a batch of {b}. Pass one sequence per call.")
    if any(n < 1 for n in lengths) or sum(lengths) != s:
        raise ValueError(
            f"document_lengths must be positive and add up to the sequence length {s:,}; they add up to "
            f"{sum(lengths):,} ({len(lengths)} documents, smallest {min(lengths, default=0)}). Count every token, "
            "padding included (as its own document), once."
        )
    return lengths


def _packed_positions_and_labels(lengths: list[int], labels_bs: torch.Tensor):
    """Positions restarting at 0 per document, and shifted labels with each document's last one ignored."""
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ends = torch.tensor(lengths).cumsum(0) - 1
    labels_bs = labels_bs.clone()
    labels_bs[:, ends] = IGNORE_INDEX
    return position_ids.to(labels_bs.device), labels_bs


def document_lengths_from_positions(position_ids_s: torch.Tensor) -> list[int] | None:
    """Document lengths of one packed sequence given as positions restarting at 0 per document (TRL's packing and
    padding_free write them so), for shard_batch(document_lengths=...); None for one run 0..s-1."""
    starts = (position_ids_s == 0).nonzero().flatten().tolist()
    if starts == [0] and bool((position_ids_s == torch.arange(len(position_ids_s))).all()):
        return None
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start at 0 and restart at 0 for each packed document.")
    return [b - a for a, b in zip(starts, [*starts[1:], len(position_ids_s)])]


def check_document_bounds(expected: tuple | None, got, module) -> None:
    """ValueError unless a layer of a packed forward received the batch's borders (`expected`, the whole sequence's,
    None for an unpacked batch): they reach attention through transformers' layer **kwargs, and a model (or a release)
    whose layers drop them would let the documents attend to each other."""
    if expected is not None and got != expected:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) got no document borders though "
            "the batch is packed: this model's layers do not pass their keyword arguments on to the attention, so "
            "the packed documents would attend to each other. Train it unpacked (without --packing, no "
            "cu_seqlens): one stream of text per sequence.")


def shard_batch(
    input_ids: torch.Tensor,
    layout: ParallelLayout,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
    *,
    vocab_size: int | None = None,
    document_lengths: list[int] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> ShardedBatch:
    """Shift, pad and slice one batch of full sequences for this rank of the SP group.

    input_ids: [b, s] or [s], the whole sequence (every rank of the SP group passes the same one).
    labels: unshifted, in the Hugging Face convention (defaults to input_ids); IGNORE_INDEX is kept.
    position_ids: global positions, one contiguous run per row (default 0..s-1).
    document_lengths: packed documents, lengths in order adding up to s (one sequence, b = 1): positions
        restart per document, a document's last label is ignored, attention stays inside each document.
    attention_mask: [b, s] or [s], 0 on padding at the end of a row (transformers' convention; right padding
        only). It changes no label or attention: it marks tokens the MoE router loss does not count.
    vocab_size: when given, every shifted label other than IGNORE_INDEX must be in [0, vocab_size)
        (ValueError otherwise). Pass it: on a GPU the loss only has a device-side assert for this
        (it must not sync), so this is where a bad label gets a clear error.
    Call on CPU tensors: the checks read values, which on a GPU would be a host sync.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] or [seq], got shape {tuple(input_ids.shape)}.")
    b, s = input_ids.shape
    if s < 2:
        raise ValueError(f"a sequence of {s} token(s) has nothing to predict; pass at least 2 tokens.")
    labels = input_ids if labels is None else labels.reshape(b, -1)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}.")
    lengths = None
    if document_lengths is not None:
        if position_ids is not None:
            raise ValueError("pass document_lengths or position_ids, not both: packed positions follow the lengths.")
        lengths = _document_lengths(document_lengths, b, s)
    elif position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    else:
        position_ids = position_ids.reshape(-1, s).expand(b, s)
        _check_positions(position_ids)

    real_bs = _real_tokens(attention_mask, b, s)
    sp = layout.sp_size
    s_pad = -(-s // sp) * sp
    pad = s_pad - s
    labels = shift_labels(labels)
    cu_seqlens = None
    if lengths is not None:
        position_ids, labels = _packed_positions_and_labels(lengths, labels)
        bounds = [0, *itertools.accumulate(lengths)] + ([s_pad] if pad else [])  # the padding: a segment
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    if vocab_size is not None:
        # On the whole sequence, before slicing: every rank of the SP group raises alike, none is left
        # waiting in a collective.
        check_labels_in_vocab(labels, vocab_size)
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_full((b, pad), pad_token_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((b, pad), IGNORE_INDEX)], dim=1)
        # The padding continues the last run of positions (a segment of its own when packed).
        tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        if lengths is not None:
            tail = torch.arange(pad, device=position_ids.device).expand(b, pad)
        position_ids = torch.cat([position_ids, tail], dim=1)
        real_bs = torch.cat([real_bs, real_bs.new_zeros((b, pad))], dim=1)
    token_mask = None if bool(real_bs.all()) else real_bs

    s_local = s_pad // sp
    rows = slice(layout.sp_rank * s_local, (layout.sp_rank + 1) * s_local)
    return ShardedBatch(
        input_ids[:, rows].contiguous(),
        labels[:, rows].contiguous(),
        position_ids[:, rows].contiguous(),
        seq_len=s,
        padded_len=s_pad,
        cu_seqlens=cu_seqlens,
        token_mask=None if token_mask is None else token_mask[:, rows].contiguous(),
    )


def _real_tokens(attention_mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """[b, s] bool, False on the caller's padding; ValueError for padding that is not at the end of its row."""
    if attention_mask is None:
        return torch.ones((b, s), dtype=torch.bool)
    real_bs = attention_mask.reshape(b, -1).bool().cpu()
    if real_bs.shape != (b, s):
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {(b, s)}.")
    if bool((real_bs[:, 1:] & ~real_bs[:, :-1]).any()):
        raise ValueError("attention_mask has padding before real tokens (left padding or holes): pad on the right "
                         "(tokenizer.padding_side='right'); the causal kernel keeps only padding at the end unread.")
    return real_bs
