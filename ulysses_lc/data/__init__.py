"""The training token stream: documents joined end to end, cut into one `seq_len` window per step.

Documents (PG-19 books, text files, generated `tiny` books) are tokenized and joined with the
tokenizer's EOS between them into one causal stream; there is no block-diagonal mask, so every
token attends to every earlier token across document borders, as in the reference recipe's
PG-19 concatenation. Step `k` trains on tokens `[k * seq_len, (k + 1) * seq_len)`.

Tokenizing is done once per (tokenizer, source, token count) and cached on disk as a raw
uint32 file plus a JSON meta file; a rerun memory-maps the cache in seconds. On each node only
local rank 0 tokenizes; the other ranks wait for it and then map the same file.

This package knows nothing of the model or of sharding: the trainer splits each sequence
across sequence-parallel ranks itself.

Modules: `sources` (parsing and reading sources), `tokenize` (chunked tokenization), `cache` (the
on-disk token cache), `stream` (`TokenStream`), `build` (`build_token_stream`, which ties them).

Sources (one string):
  "pg19", "pg19:<split>"  PG-19 from the Hugging Face Hub (`PG19_HUB_ID`), streamed, so only as
                          many books as the run needs are read. split: train (default),
                          validation, test.
  "tiny"                  generated English-like books (`ulysses_lc.tiny.tiny_text`), offline.
  <dir>                   every *.txt below it, recursively, sorted by relative path; one
                          document per file.
  <file>.npy              pre-tokenized 1-D integer array, used as is (no EOS added).
  <file>.bin              pre-tokenized raw little-endian integers, `bin_dtype` (uint32 default),
                          used as is.
  <other file>            one UTF-8 text document.
"""

from .build import build_token_stream
from .cache import CACHE_DTYPE, CACHE_FORMAT_VERSION, default_cache_dir
from .sources import (
    PG19_HUB_ID,
    PG19_SPLITS,
    TINY_DOC_CHARS,
    Source,
    iter_documents,
    parse_source,
    source_identity,
)
from .stream import TokenStream
from .tokenize import (
    BATCH_CHARS,
    DEFAULT_CHUNK_CHARS,
    chunking_is_exact,
    iter_chunks,
    split_into_chunks,
    tokenize_documents,
    tokenizer_fingerprint,
)

__all__ = [
    "BATCH_CHARS",
    "CACHE_DTYPE",
    "CACHE_FORMAT_VERSION",
    "DEFAULT_CHUNK_CHARS",
    "PG19_HUB_ID",
    "PG19_SPLITS",
    "TINY_DOC_CHARS",
    "Source",
    "TokenStream",
    "build_token_stream",
    "chunking_is_exact",
    "default_cache_dir",
    "iter_chunks",
    "iter_documents",
    "parse_source",
    "source_identity",
    "split_into_chunks",
    "tokenize_documents",
    "tokenizer_fingerprint",
]
