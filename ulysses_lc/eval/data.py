"""The evaluation's text: windows of an evaluation source, read as training reads its data (data/)."""

from __future__ import annotations

import warnings

from ..data import build_token_stream, check_source
from ..data.settings import DataSettings
from ..data.stream import Sample


def eval_windows(source: str, tokenizer, seq_len: int, count: int, *, shape: DataSettings | None = None,
                 cache_dir=None, builder: bool | None = None, progress: bool = False) -> list[Sample]:
    """Up to `count` distinct windows of `seq_len` tokens of `source` (any source --data takes: data/__init__.py),
    tokenized and cached as training's are; fewer where the source holds fewer (none repeated). ValueError with the
    fix for a source shorter than one window. shape: how samples and windows are shaped (training's settings)."""
    shape = shape or DataSettings()
    try:
        check_source(source, tokenizer, seq_len=seq_len, **shape.kwargs())
        with warnings.catch_warnings():  # a source of fewer windows than asked is used as it is, without repeating
            warnings.simplefilter("ignore", UserWarning)
            stream = build_token_stream(source, tokenizer, seq_len, num_steps=count, cache_dir=cache_dir,
                                        builder=builder, progress=progress, **shape.kwargs())
    except ValueError as e:
        raise ValueError(f"the evaluation text {source!r} cannot be read as windows of {seq_len:,} tokens: {e}. An "
                         "evaluation at this length needs at least one window of it: give a longer text (a folder "
                         "of files joins them), or evaluate at a shorter length.") from e
    return [stream.sample(i) for i in range(min(count, len(stream)))]


__all__ = ["eval_windows"]
