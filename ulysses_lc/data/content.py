"""What a token stream was built from, by content: digests of the documents, rows or token ids as they are read.

A file's size and modification time say nothing about its bytes: `cp -p`, `rsync -t` and `tar` restore the
time of a file whose content changed. So the build hashes what it reads, in the pass it makes anyway, and
the checkpoint keeps the digests; a resume compares them with what its own stream was built from, on
every node, whichever cache it found.

The digests form a chain of blocks: a block closes at the first item (document, row, or run of token ids)
boundary past BLOCK_BYTES, so two builds that read the same items in the same order close the same
blocks, and a longer run's chain starts with a shorter run's (resume with more --steps). Each block is
recorded as [items, sha256 hex]; two chains are compared block by block where both blocks hold the same
number of items (the last block of the shorter one may hold fewer).
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Iterable, Iterator

import numpy as np

BLOCK_BYTES = 4 << 20  # 4 MiB of text per block: ~1,000 entries per 4 GB read, a few seconds of hashing
TOKENS_PER_BLOCK = 1 << 20  # pre-tokenized sources: blocks of 4 MiB of uint32 ids


class ContentChain:
    """The block chain of one stream's source, fed item by item as the build reads it."""

    def __init__(self):
        self.blocks: list[list] = []  # [items, sha256 hex] per closed block
        self._hash = hashlib.sha256()
        self._items = 0
        self._bytes = 0

    def add(self, data: bytes) -> None:
        self._hash.update(len(data).to_bytes(8, "little"))  # item borders count: "ab"+"c" is not "a"+"bc"
        self._hash.update(data)
        self._items += 1
        self._bytes += len(data)
        if self._bytes >= BLOCK_BYTES:
            self._close()

    def wrap(self, items: Iterable, to_bytes: Callable[[object], bytes]) -> Iterator:
        """`items` unchanged, each hashed as it is read."""
        for item in items:
            self.add(to_bytes(item))
            yield item

    def finish(self) -> list[list]:
        """The chain, the last (partial) block included."""
        if self._items:
            self._close()
        return self.blocks

    def _close(self) -> None:
        self.blocks.append([self._items, self._hash.hexdigest()])
        self._hash, self._items, self._bytes = hashlib.sha256(), 0, 0


def text_bytes(document: str) -> bytes:
    return document.encode("utf-8")


def row_bytes(row: dict) -> bytes:
    return json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")


def token_chain(tokens: np.ndarray) -> list[list]:
    """The chain of pre-tokenized ids (read in blocks: a memory map is not read whole at once)."""
    chain = ContentChain()
    for start in range(0, len(tokens), TOKENS_PER_BLOCK):
        chain.add(np.ascontiguousarray(tokens[start : start + TOKENS_PER_BLOCK]).astype("<u4", copy=False).tobytes())
    return chain.finish()


def first_difference(saved: list[list], current: list[list]) -> tuple[int, int, int] | None:
    """(block index, first item, items) of the first block that differs between the chains, or None.

    Blocks are compared while both chains have them; the last block of either may hold fewer items than
    the other's (that build stopped reading there), and is compared only when the counts agree."""
    first = 0
    last = min(len(saved), len(current)) - 1
    for index, ((n_saved, d_saved), (n_now, d_now)) in enumerate(zip(saved, current)):
        if n_saved != n_now and index == last:
            return None
        if n_saved != n_now or d_saved != d_now:
            return index, first, n_saved
        first += n_saved
    return None
