"""Packing: whole samples placed into `seq_len` windows, each window a list of documents plus padding.

The plan is first-fit-decreasing over a buffer of samples: samples are read until the buffer holds
`buffer_windows * seq_len` tokens, sorted longest first (ties by reading order), and each goes into
the first window with room, a new window when none has. Within a window, samples keep their
reading order. The last window the buffer opened is the one FFD fills least, so unless the source
is exhausted its samples go back to the front of the next buffer instead of being padded now. The
plan depends only on the samples, never on how many windows a run asks for, so a longer run's
first windows are a shorter run's windows (resume).

A window's remainder is padding: pad tokens whose labels are all ignored, a segment of its own.
Each window's document lengths therefore sum exactly to `seq_len`: the samples' lengths in order,
then the padding length when there is padding. The mask of each document's first token is 0: with
documents attending only to themselves, nothing in the document predicts its first token, and a
plain causal shift over the whole window then never trains one document's last position on the
next document's first token.

A sample longer than `seq_len` is cut into `seq_len` pieces (long_samples="split"; each piece is a
document of its own) or refused (long_samples="refuse").
"""

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .samples import MASK_DTYPE
from .tokenize import TOKEN_DTYPE

LONG_SAMPLES = ("split", "refuse")


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`, bins in the order FFD opened them."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        assert 0 < lengths[i] <= capacity, (lengths[i], capacity)
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedWindows:
    """`num_windows` windows of `seq_len` tokens, as flat arrays (CSR for the document lengths)."""

    tokens: np.ndarray  # uint32 [num_windows * seq_len]
    mask: np.ndarray  # uint8 [num_windows * seq_len], 1 where the label is the token
    doc_lengths: np.ndarray  # uint32 [segments]: window w's are doc_lengths[doc_starts[w]:doc_starts[w + 1]]
    doc_starts: np.ndarray  # int64 [num_windows + 1]
    padding: np.ndarray  # uint32 [num_windows]: padding tokens (the last segment when > 0)
    split_samples: int = 0  # samples longer than seq_len cut into pieces (long_samples="split")


def pack(
    samples: Iterator[tuple[int, np.ndarray, np.ndarray]],
    seq_len: int,
    num_windows: int,
    *,
    pad_id: int,
    long_samples: str = "split",
    buffer_windows: int = 4,
    on_window=None,
) -> PackedWindows:
    """Pack (index, ids, mask) samples into up to `num_windows` windows; fewer when the source runs out.

    on_window: called with each window's real token count (for a progress bar).
    """
    if long_samples not in LONG_SAMPLES:
        raise ValueError(f"long_samples={long_samples!r}; use one of {', '.join(LONG_SAMPLES)}")
    windows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    buffer: list[tuple[np.ndarray, np.ndarray]] = []
    buffered = split = 0
    exhausted = False
    samples = iter(samples)
    while len(windows) < num_windows and not exhausted:
        for index, ids, mask in samples:
            split += len(ids) > seq_len
            for piece in _pieces(index, ids, mask, seq_len, long_samples):
                buffer.append(piece)
                buffered += len(piece[0])
            if buffered >= buffer_windows * seq_len:
                break
        else:
            exhausted = True
        if not buffer:
            break
        bins = first_fit_decreasing([len(ids) for ids, _ in buffer], seq_len)
        keep = bins if exhausted or len(bins) == 1 else bins[:-1]
        for b in keep:
            windows.append([buffer[i] for i in b])
            if on_window is not None:
                on_window(sum(len(buffer[i][0]) for i in b))
        carried = [] if keep is bins else [buffer[i] for i in bins[-1]]
        buffer, buffered = carried, sum(len(ids) for ids, _ in carried)
    packed = _assemble(windows[:num_windows], seq_len, pad_id)
    packed.split_samples = split
    return packed


def refuse_if_long(index: int, length: int, seq_len: int, long_samples: str) -> None:
    """The refusal of a sample longer than seq_len under long_samples="refuse"."""
    if length > seq_len and long_samples == "refuse":
        raise ValueError(
            f"sample {index} has {length:,} tokens, more than seq_len={seq_len:,}, and long_samples='refuse'; "
            "pass long_samples='split' (its seq_len pieces train as separate documents), raise seq_len, "
            "or drop the sample"
        )


def _pieces(index: int, ids: np.ndarray, mask: np.ndarray, seq_len: int, long_samples: str):
    refuse_if_long(index, len(ids), seq_len, long_samples)
    if len(ids) <= seq_len:
        return [(ids, mask)]
    return [(ids[s : s + seq_len], mask[s : s + seq_len]) for s in range(0, len(ids), seq_len)]


def _assemble(windows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, pad_id: int) -> PackedWindows:
    n = len(windows)
    tokens = np.full(n * seq_len, pad_id, dtype=TOKEN_DTYPE)
    mask = np.zeros(n * seq_len, dtype=MASK_DTYPE)
    lengths, starts, padding = [], [0], []
    for w, docs in enumerate(windows):
        at = w * seq_len
        for ids, doc_mask in docs:
            tokens[at : at + len(ids)] = ids
            mask[at : at + len(ids)] = doc_mask
            mask[at] = 0  # nothing in the document precedes its first token
            lengths.append(len(ids))
            at += len(ids)
        pad = (w + 1) * seq_len - at
        if pad:
            lengths.append(pad)
        padding.append(pad)
        starts.append(len(lengths))
    return PackedWindows(
        tokens=tokens,
        mask=mask,
        doc_lengths=np.asarray(lengths, dtype=np.uint32),
        doc_starts=np.asarray(starts, dtype=np.int64),
        padding=np.asarray(padding, dtype=np.uint32),
    )
