"""`TokenStream`: one `seq_len` window per step over the cached tokens, with a resumable position.

Shapes: s = seq_len, the tokens of one step's whole sequence (before any sharding).
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..constants import IGNORE_INDEX
from .content import first_difference


@dataclass(frozen=True)
class Sample:
    """One step's sequence.

    input_ids: LongTensor [s].
    labels: LongTensor [s], unshifted (Hugging Face convention: labels[t] is input_ids[t] where token
        t is trained, IGNORE_INDEX where not); the consumer shifts. In packed windows the first token
        of each document and all padding are IGNORE_INDEX.
    document_lengths: packed windows: the lengths of the window's segments in order, summing exactly
        to s; the samples (or pieces of split samples) first, then, when `padding_tokens` > 0, one
        final segment of padding. Attention must not cross these borders and positions restart at 0
        in each. None without packing: the window is one causal stream (documents joined with EOS
        attend across borders).
    num_documents: sample documents in the window (the padding segment not counted); 1 without packing.
    padding_tokens: pad tokens at the end of a packed window; 0 without packing.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_lengths: list[int] | None
    num_documents: int
    padding_tokens: int

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """[s] 1 on the window's tokens, 0 on its padding (transformers' convention); None where there is none."""
        if not self.padding_tokens:
            return None
        mask = torch.ones(len(self.input_ids), dtype=torch.long)
        mask[len(mask) - self.padding_tokens:] = 0
        return mask

    @property
    def num_trained_tokens(self) -> int:
        """Labels that are a loss target after the causal shift (position 0 never is)."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class WindowDocuments:
    """Document lengths of packed windows: window w's segments are lengths[starts[w]:starts[w + 1]]."""

    lengths: np.ndarray  # [segments]
    starts: np.ndarray  # [num_windows + 1]
    padding: np.ndarray  # [num_windows], the last segment's length when > 0


class TokenStream:
    """Consecutive `seq_len`-token windows over a token array, with a resumable position.

    `sequence(step)` / `sample(step)` wrap around: step `len(stream) + k` gives the same window as
    step `k` (a new epoch over the data). A stream shorter than one window is refused at build time.
    mask: uint8 per token, 1 where the label is the token (None: every token is trained).
    documents: the packed windows' document lengths (None: not packed).
    content: the chain of digests of what the stream was built from (`content.ContentChain`), or a callable that
        computes it when first needed; a checkpoint keeps it and a resume compares (None: not known).
    stats: what the build found, as its cache's meta file records it (sample_format, loss_on_resolved, documents,
        windows, padding_tokens, split_samples, requested_tokens; each absent where it does not apply).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        stream_id: str,
        cache_hit: bool = False,
        cache_path=None,
        mask: np.ndarray | None = None,
        documents: WindowDocuments | None = None,
        content=None,
        stats: dict | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len:
            raise ValueError(f"the token stream has {len(tokens):,} tokens but one step needs seq_len={seq_len:,}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stream_id = stream_id  # tokenizer + source, not the length: resume may extend a run
        self.cache_hit = cache_hit  # True when this process read tokens some earlier build wrote
        self.cache_path = cache_path
        self.position = 0  # the next step `next_sequence` returns
        assert mask is None or len(mask) == len(tokens), (len(mask), len(tokens))
        assert documents is None or (len(documents.starts) - 1) * seq_len == len(tokens)
        self.mask = mask
        self.documents = documents
        self._content = content
        self.stats = stats or {}
        self.held_out = None  # build_token_stream(..., held_out=k): the k windows read after these, for evaluation

    @property
    def content(self) -> list | None:
        if callable(self._content):
            self._content = self._content()
        return self._content

    @property
    def packed(self) -> bool:
        return self.documents is not None

    def __len__(self) -> int:
        """Distinct windows before the stream wraps around."""
        return len(self.tokens) // self.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sequence(self, step: int) -> torch.Tensor:
        """The step-th window's input_ids as a LongTensor [seq_len] (wrapping around past the end)."""
        return torch.from_numpy(np.array(self.tokens[self._window(step)], dtype=np.int64))

    def sample(self, step: int) -> Sample:
        """The step-th window with its labels and document lengths (wrapping around past the end)."""
        window = self._window(step)
        # Copies: the memory map is read-only and the trainer may write into its batch.
        input_ids = torch.from_numpy(np.array(self.tokens[window], dtype=np.int64))
        if self.mask is None:
            labels = input_ids.clone()
        else:
            trained = torch.from_numpy(np.array(self.mask[window], dtype=np.bool_))
            labels = torch.where(trained, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        if self.documents is None:
            return Sample(input_ids, labels, None, 1, 0)
        w = step % len(self)
        docs = self.documents
        lengths = [int(n) for n in docs.lengths[docs.starts[w] : docs.starts[w + 1]]]
        padding = int(docs.padding[w])
        return Sample(input_ids, labels, lengths, len(lengths) - (padding > 0), padding)

    def split(self, windows: int) -> tuple["TokenStream", "TokenStream"]:
        """(the first `windows` windows, the rest) as two streams over the same arrays. The first keeps this stream's
        identity and content chain (what was read to build it); the second is `<stream_id>-held-out`."""
        assert 0 < windows < len(self), (windows, len(self))
        parts = []
        for lo, hi, suffix in ((0, windows, ""), (windows, len(self), "-held-out")):
            docs = self.documents
            if docs is not None:
                first, last = docs.starts[lo], docs.starts[hi]
                docs = WindowDocuments(docs.lengths[first:last], docs.starts[lo:hi + 1] - first, docs.padding[lo:hi])
            span = slice(lo * self.seq_len, hi * self.seq_len)
            parts.append(TokenStream(self.tokens[span], self.seq_len, stream_id=self.stream_id + suffix,
                                     cache_hit=self.cache_hit, cache_path=self.cache_path,
                                     mask=None if self.mask is None else self.mask[span], documents=docs,
                                     content=self._content if not suffix else None,
                                     stats=self.stats if not suffix else None))
        return parts[0], parts[1]

    def _window(self, step: int) -> slice:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        start = (step % len(self)) * self.seq_len
        return slice(start, start + self.seq_len)

    def next_sequence(self) -> torch.Tensor:
        """The window at `position`, then advance `position` by one."""
        window = self.sequence(self.position)
        self.position += 1
        return window

    def state_dict(self) -> dict:
        return {"position": self.position, "seq_len": self.seq_len, "stream_id": self.stream_id,
                "content": self.content}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"checkpoint was written with seq_len={state['seq_len']:,} but this run uses {self.seq_len:,}; "
                "its data position would point at other windows. Resume with the same seq_len."
            )
        if state["stream_id"] != self.stream_id:
            raise ValueError(
                f"checkpoint's data stream {state['stream_id']} differs from this run's {self.stream_id} "
                "(another tokenizer, source or sample settings); resume with the same source and tokenizer "
                "(and the same text_column, loss_on and packing settings)."
            )
        saved = state.get("content")  # None: a checkpoint from before content chains
        changed = None if saved is None or self.content is None else first_difference(saved, self.content)
        if changed is not None:
            block, first, items = changed
            raise ValueError(
                f"the data changed since the checkpoint was written: items {first:,}-{first + items - 1:,} of the "
                f"source (documents, rows or blocks of token ids, in reading order; digest block {block}) read "
                "differently now, whatever their sizes and modification times say. The checkpoint's data position "
                "would point into other text: resume with the data the run trained on, or start a new run (another "
                "--output-dir).")
        self.position = int(state["position"])
