"""`TokenStream`: one `seq_len` window per step over the cached tokens, with a resumable position."""

import numpy as np
import torch


class TokenStream:
    """Consecutive `seq_len`-token windows over a token array, with a resumable position.

    `sequence(step)` wraps around: step `len(stream) + k` gives the same window as step `k`
    (a new epoch over the data). A stream shorter than one window is refused at build time.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, stream_id: str, cache_hit: bool = False, cache_path=None):
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

    def __len__(self) -> int:
        """Distinct windows before the stream wraps around."""
        return len(self.tokens) // self.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sequence(self, step: int) -> torch.Tensor:
        """The step-th window as a LongTensor [seq_len] (wrapping around past the end)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        start = (step % len(self)) * self.seq_len
        # A copy: the memory map is read-only and the trainer may write into its batch.
        return torch.from_numpy(np.array(self.tokens[start : start + self.seq_len], dtype=np.int64))

    def next_sequence(self) -> torch.Tensor:
        """The window at `position`, then advance `position` by one."""
        window = self.sequence(self.position)
        self.position += 1
        return window

    def state_dict(self) -> dict:
        return {"position": self.position, "seq_len": self.seq_len, "stream_id": self.stream_id}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"checkpoint was written with seq_len={state['seq_len']:,} but this run uses {self.seq_len:,}; "
                "its data position would point at other windows. Resume with the same seq_len."
            )
        if state["stream_id"] != self.stream_id:
            raise ValueError(
                f"checkpoint's data stream {state['stream_id']} differs from this run's {self.stream_id} "
                "(another tokenizer or source); resume with the same source and tokenizer."
            )
        self.position = int(state["position"])
