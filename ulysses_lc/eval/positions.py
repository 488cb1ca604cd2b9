"""Loss by position: where in a long sequence the model predicts well, bucketed, with the trained length marked.

Legend (shape.py): b batch, s_local this rank's rows of the sequence; n buckets.

A row's position is its position id, the RoPE position of the token that predicts the next one: row p reads the
tokens at positions 0..p, so a row below the model's trained length (the pre-scaling length, levers/yarn.py's
`trained_length`) uses only positions the model was trained on, and a row at or past it does not. The trained
length is one of the bucket edges, so each bucket lies wholly inside it or wholly beyond it.

Each rank sums its own rows' losses per bucket (it knows their global positions from the batch), and the sums and
counts are added over every rank: the SP group's slices of one sequence and the DP groups' sequences alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Buckets:
    """Position buckets [edges[i], edges[i + 1]) over a sequence of edges[-1] tokens; trained_length: the base model's
    trained length (one of the edges when inside the sequence), None where not known."""

    edges: tuple[int, ...]
    trained_length: int | None = None

    @classmethod
    def make(cls, seq_len: int, buckets: int | list[int] = 8, trained_length: int | None = None) -> "Buckets":
        """`buckets` equal-width buckets over seq_len tokens, or the given bucket starts (0 first, increasing, below
        seq_len); the trained length added as an edge where it falls inside a bucket."""
        if isinstance(buckets, int):
            if not 1 <= buckets <= seq_len:
                raise ValueError(f"buckets={buckets}: give between 1 and the sequence length ({seq_len:,}) buckets.")
            edges = {seq_len * i // buckets for i in range(buckets)}
        else:
            starts = [int(b) for b in buckets]
            if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= seq_len:
                raise ValueError(f"bucket starts {starts}: give increasing positions from 0, each below the sequence "
                                 f"length {seq_len:,} (e.g. 0,4096,8192).")
            edges = set(starts)
        if trained_length is not None and 0 < trained_length < seq_len:
            edges.add(int(trained_length))
        return cls(tuple(sorted(edges)) + (seq_len,), trained_length)

    @property
    def count(self) -> int:
        return len(self.edges) - 1

    def beyond_trained(self, index: int) -> bool:
        """Whether bucket `index` lies past the trained length (False where it is not known)."""
        return self.trained_length is not None and self.edges[index] >= self.trained_length

    def index(self, position: torch.Tensor) -> torch.Tensor:
        """Each position's bucket (positions past the last edge fall in the last bucket)."""
        inner = torch.tensor(self.edges[1:-1], dtype=position.dtype, device=position.device)
        return torch.bucketize(position, inner, right=True)

    def sums(self, loss_bs: torch.Tensor, valid_bs: torch.Tensor, position_bs: torch.Tensor) -> torch.Tensor:
        """[2, n] float64 on the rows' device: this rank's summed loss and row count per bucket (valid rows only)."""
        index_t = self.index(position_bs.reshape(-1))
        valid_t = valid_bs.reshape(-1).to(torch.float64)
        out = torch.zeros(2, self.count, dtype=torch.float64, device=loss_bs.device)
        out[0].index_add_(0, index_t, loss_bs.reshape(-1).to(torch.float64) * valid_t)
        out[1].index_add_(0, index_t, valid_t)
        return out


__all__ = ["Buckets"]
