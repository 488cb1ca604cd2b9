"""`build_token_stream`: read, tokenize and cache a source once, then hand out its windows as a `TokenStream`."""

import os
import warnings
from pathlib import Path

from .cache import (
    CACHE_FORMAT_VERSION,
    CachePaths,
    build_or_reuse,
    default_cache_dir,
    digest,
    read_cache,
    wait_for,
)
from .sources import (
    Source,
    folder_files,
    iter_documents,
    load_pretokenized,
    parse_source,
    source_identity,
)
from .stream import TokenStream
from .tokenize import DEFAULT_CHUNK_CHARS, tokenize_documents, tokenizer_fingerprint


def build_token_stream(
    source: str | os.PathLike,
    tokenizer,
    seq_len: int,
    num_steps: int = 1,
    *,
    cache_dir: str | os.PathLike | None = None,
    local_rank: int | None = None,
    seed: int = 0,
    bin_dtype: str = "uint32",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    progress: bool = True,
    wait_timeout_s: float = 7200.0,
    poll_s: float = 1.0,
) -> TokenStream:
    """Read, tokenize and cache `seq_len * num_steps` tokens of `source`; return them as a `TokenStream`.

    tokenizer: a Hugging Face tokenizer with an EOS token (EOS joins documents); for .npy/.bin
        sources it may be None, else it is used to check the ids fit its vocabulary.
    local_rank: this process's rank on its node (default: $LOCAL_RANK, else 0). Rank 0 builds
        the cache; the others wait (torch.distributed barrier when initialised, so every rank
        must call this; else polling for the meta file) and then read it.
    seed: which generated books the `tiny` source writes.
    A source with fewer tokens than `seq_len * num_steps` but at least `seq_len` is used with
    wrap-around (a warning says after how many steps); fewer than `seq_len` is a ValueError.
    """
    if seq_len < 1 or num_steps < 1:
        raise ValueError(f"seq_len={seq_len} and num_steps={num_steps} must both be >= 1")
    src = parse_source(source, seed=seed)
    want = seq_len * num_steps

    if src.pretokenized:
        tokens = load_pretokenized(src, bin_dtype, tokenizer, seq_len)
        identity = source_identity(src, bin_dtype=bin_dtype)
        stream_id = digest({"source": identity})
        stream = TokenStream(tokens[:want], seq_len, stream_id=stream_id)
        _warn_if_short(stream, want)
        return stream

    if tokenizer is None:
        raise ValueError(f"source {os.fspath(source)!r} is text: pass the tokenizer of the model being trained")
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token, which joins documents; set one (tokenizer.eos_token = '...')"
        )
    if src.kind in ("text", "folder"):
        _check_size_upper_bound(src, seq_len)

    identity = source_identity(src)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stream_id = digest({"tokenizer": fingerprint, "eos": tokenizer.eos_token_id, "source": identity})
    key_fields = {
        "format": CACHE_FORMAT_VERSION,
        "tokenizer": fingerprint,
        "eos": tokenizer.eos_token_id,
        "source": identity,
        "num_tokens": want,
        "chunk_chars": chunk_chars,  # borders can change tokens for tokenizers where chunking is inexact
    }
    key = f"{src.kind}-{want}-{digest(key_fields)}"
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    paths = CachePaths(cache, key)

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank == 0:
        hit = build_or_reuse(paths, lambda: _tokenize_text(src, tokenizer, want, chunk_chars, progress), key_fields)
    else:
        hit = True
        wait_for(paths, wait_timeout_s, poll_s)

    tokens = read_cache(paths)[0]["tokens"]
    if len(tokens) < seq_len:
        raise ValueError(
            f"source {os.fspath(source)!r} gives {len(tokens):,} tokens but one step needs seq_len={seq_len:,}; "
            "add text, lower seq_len, or use 'tiny'"
        )
    stream = TokenStream(tokens, seq_len, stream_id=stream_id, cache_hit=hit, cache_path=paths.tokens)
    _warn_if_short(stream, want)
    return stream



def _warn_if_short(stream: TokenStream, want: int) -> None:
    if stream.num_tokens < want:
        warnings.warn(
            f"the source has {stream.num_tokens:,} tokens, fewer than the {want:,} the run asked for: "
            f"the data repeats after {len(stream)} steps",
            stacklevel=3,
        )


def _check_size_upper_bound(src: Source, seq_len: int) -> None:
    # Each token covers at least one UTF-8 byte (add_special_tokens=False), so the byte count
    # plus one EOS per border bounds the token count without tokenizing anything.
    files = folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
    bound = sum(f.stat().st_size for f in files) + len(files) - 1
    if bound < seq_len:
        raise ValueError(
            f"source {src.location} has {bound:,} bytes, so at most {bound:,} tokens, but one step needs "
            f"seq_len={seq_len:,}; add text, lower seq_len, or use 'tiny'"
        )



def _tokenize_text(src: Source, tokenizer, want: int, chunk_chars: int, progress: bool):
    tokens, stats = tokenize_documents(iter_documents(src), tokenizer, want, chunk_chars=chunk_chars, progress=progress)
    if stats["chunking_exact_on_probe"] is False:
        warnings.warn(
            "tokenizing in chunks gave other ids than tokenizing whole text on a probe (this "
            "tokenizer's pre-tokenizer does not split before ' word'); a few tokens per "
            f"{chunk_chars:,}-character chunk border differ, which training tolerates",
            stacklevel=4,
        )
    return {"tokens": tokens}, {"requested_tokens": want, **stats}
