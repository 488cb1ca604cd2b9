"""How a data source becomes training windows: the settings `check_source` and `build_token_stream` share."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DataSettings:
    """The settings that shape a source's samples and windows (and so key its token cache).

    text_column: the plain-text column (None: 'messages', then 'prompt' + 'completion', then 'text').
    data_config: a hub dataset's config name.
    loss_on: "completion" | "all"; None: completion for chat and prompt/completion data, all for text.
    packing: whole samples per window, each attending only to itself.
    long_samples: with packing, a sample longer than the window is split or refused.
    seed: which generated books the `tiny` source writes.
    """

    text_column: str | None = None
    data_config: str | None = None
    loss_on: str | None = None
    packing: bool = False
    long_samples: str = "split"
    seed: int = 0

    def kwargs(self) -> dict:
        """As keyword arguments of check_source and build_token_stream."""
        return asdict(self)


__all__ = ["DataSettings"]
