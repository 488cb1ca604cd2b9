"""The training token stream: samples or documents, tokenized once, cut into one `seq_len` window per step.

Without packing, documents (PG-19 books, text files, generated `tiny` books, dataset rows) are
tokenized and joined with the tokenizer's EOS into one causal stream; there is no block-diagonal
mask, so every token attends to every earlier token across document borders, as in the reference
recipe's PG-19 concatenation. Step `k` trains on tokens `[k * seq_len, (k + 1) * seq_len)`.
With packing (`build_token_stream(..., packing=True)`), each window holds whole samples, each a
document of its own, plus padding; `TokenStream.sample(step)` gives the window's labels and
document lengths (`Sample`). Chat and prompt/completion rows train their completions only by
default (`loss_on`); labels are unshifted, IGNORE_INDEX where not trained.

Tokenizing is done once per (tokenizer, source, token count, sample settings) and cached on disk as
raw arrays (tokens, and a loss mask and document lengths where needed) plus a JSON meta file; a rerun
memory-maps the cache in seconds. On each node only local rank 0 tokenizes; the other ranks wait
for it and then map the same files.

This package knows nothing of the model or of sharding: the trainer splits each sequence
across sequence-parallel ranks itself.

Modules: `sources` (parsing and reading sources), `tokenize` (chunked tokenization), `samples`
(rendering rows, loss masks), `packing` (the bin packer), `cache` (the on-disk token cache),
`stream` (`TokenStream`, `Sample`), `build` (`build_token_stream`, `check_source`, which tie them).

Sources (one string):
  "pg19", "pg19:<split>"  PG-19 from the Hugging Face Hub (`PG19_HUB_ID`), streamed, so only as
                          many books as the run needs are read. split: train (default),
                          validation, test.
  "tiny"                  generated English-like books (`ulysses_lc.tiny.tiny_text`), offline.
  "org/name[:split]"      a Hugging Face Hub dataset (when no such local path exists), streamed;
                          split train by default, config and revision by argument.
  <file>.jsonl / .json / .parquet / .arrow / .csv
                          a local dataset read with `datasets`, streamed.
  <dir>                   every *.txt below it, recursively, sorted by relative path; one
                          document per file. A folder without .txt files but with data files of
                          one format (above) is read as one dataset.
  <file>.npy              pre-tokenized 1-D integer array, used as is (no EOS added).
  <file>.bin              pre-tokenized raw little-endian integers, `bin_dtype` (uint32 default),
                          used as is.
  <other file>            one UTF-8 text document.
Dataset rows: see `ulysses_lc.data.samples` for the columns read (text, messages, prompt/completion).
"""

from .build import DataRepeats, build_token_stream, check_source
from .cache import CACHE_DTYPE, CACHE_FORMAT_VERSION, default_cache_dir
from .sources import (
    PG19_HUB_ID,
    PG19_SPLITS,
    TINY_DOC_CHARS,
    Source,
    iter_documents,
    iter_rows,
    parse_source,
    source_identity,
)
from .settings import DataSettings
from .stream import Sample, TokenStream
from .tokenize import (
    BATCH_CHARS,
    DEFAULT_CHUNK_CHARS,
    chunking_is_exact,
    iter_chunks,
    pad_token_id,
    split_into_chunks,
    tokenize_documents,
    tokenizer_fingerprint,
)

__all__ = [
    "BATCH_CHARS",
    "CACHE_DTYPE",
    "CACHE_FORMAT_VERSION",
    "DataRepeats",
    "DataSettings",
    "DEFAULT_CHUNK_CHARS",
    "PG19_HUB_ID",
    "PG19_SPLITS",
    "TINY_DOC_CHARS",
    "Sample",
    "Source",
    "TokenStream",
    "build_token_stream",
    "check_source",
    "chunking_is_exact",
    "default_cache_dir",
    "iter_chunks",
    "iter_documents",
    "iter_rows",
    "pad_token_id",
    "parse_source",
    "source_identity",
    "split_into_chunks",
    "tokenize_documents",
    "tokenizer_fingerprint",
]
