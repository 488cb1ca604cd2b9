"""Faults that lose nothing and say what happened (issue 23). Each test fails when its item is undone.

Launches are few and short (the tiny model, 2 ranks, seq-len 256): a two-core CI machine pays ~10 s per launch
for imports alone, so one in-process run covers the cases that need no launcher, and each launcher run shows
several things.
"""

import os

import numpy as np
import pytest

from ulysses_lc.data import build_token_stream
from ulysses_lc.tiny import tiny_text, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -- data identity by content -------------------------------------------------------------------------------

def test_an_edit_that_keeps_size_and_mtime_is_noticed_on_resume(tmp_path):
    tokenizer = tiny_tokenizer()
    book = tmp_path / "book.txt"
    book.write_text(tiny_text(20_000, seed=3))

    def stream(cache):
        return build_token_stream(book, tokenizer, 256, 4, cache_dir=tmp_path / cache, progress=False)

    checkpoint = stream("cache")
    checkpoint.position = 2
    saved = checkpoint.state_dict()
    os.utime(book)  # a new time, the same bytes: resumes (no size-and-time identity to trip on)
    stream("cache").load_state_dict(saved)

    stat = book.stat()
    with open(book, "r+b") as f:  # edited in place, same size, its time put back (as cp -p, rsync -t, tar do)
        f.seek(100)
        f.write(b"XYZ")
    os.utime(book, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert book.stat().st_size == stat.st_size and book.stat().st_mtime_ns == stat.st_mtime_ns
    for cache in ("cache", "empty-cache-of-another-node"):
        with pytest.raises(ValueError, match="the data changed since the checkpoint was written"):
            stream(cache).load_state_dict(saved)
    fresh = stream("cache")
    assert not np.array_equal(fresh.tokens, checkpoint.tokens)  # the old cache's stale tokens are not reused
